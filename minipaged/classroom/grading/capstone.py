"""The guided track's parts in the package's engine: chapter 10's report card, and the workload exercise 10 serves.

Exercises 03–09 each build one piece of the engine with the signature of the package's own (``parts.PARTS``).
``report_card(my_parts)`` serves one batch of chat prompts on an ``LLM`` with each exercise's parts alone and with
all of them together, and compares every output token with transformers' greedy ``generate`` (computed once, kept
next to the converted model). The engine serves float32 on any device (on a GPU ``dtype="auto"`` would be
bfloat16, whose rounding two right implementations do not share), and the reference is computed on the engine's
device in the engine's dtype. A run that differs is run again with the parts checked call by call
(``parts.use(check=True)``), which names the first wrong call::

    ex04  slot_mapping, would_allocate      calls 48, 310   token-exact
    ex05  paged_decode_attention            calls 330       request 2 differs from its token 1 (engine step 9);
                                                            first wrong call: part 'paged_decode_attention' ...

Exercise 10 (``minipaged/classroom/grading/ex10.py``) grades the learner's own step loop on the same prompts and reference, with
these parts plugged into the components it joins (``load_exercises``, ``guided_parts``).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...utils import cdiv
from .. import parts
from .runner import run_code_cells

EXERCISES = ("ex03", "ex04", "ex05", "ex05b", "ex06", "ex07", "ex08")


def capstone_parts() -> dict[str, parts.Part]:
    """The parts of exercises 03-09, which the capstone assembles (exercise 05d's puzzles plug in on their own)."""
    return {n: p for n, p in parts.PARTS.items() if p.exercise in EXERCISES}


# Chat prompts of 37 to 41 tokens (the chat template's system prompt is most of them): with 12 output
# tokens each crosses a 16-token block boundary while decoding, so a small pool makes the scheduler preempt.
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "What is 12 times 12?",
]
MAX_TOKENS = 12


# The second model shape. SmolLM2 has 9 query heads over 3 KV heads (h // 3 is also h // num_kv_heads), its
# engine runs 16-token blocks and tables without a spare column: a part can be right on it by accident. A tiny
# random Llama with 8 query heads over 2 KV heads, 32-token blocks and ragged prompts that share one block tells
# such parts apart; its reference is the package's own engine on the same model.
SHAPE: dict[str, Any] = dict(num_attention_heads=8, num_key_value_heads=2, hidden_size=128, intermediate_size=192)
SHAPE_SETTINGS = dict(
    block_size=32,
    num_gpu_blocks_override=5,
    max_num_batched_tokens=40,
    max_num_seqs=4,
    enable_prefix_caching=True,
    dtype="float32",
    max_model_len=96,
)
SHAPE_TAILS = (9, 14, 38, 1)  # prompt tokens after the shared 32: prompts of 41, 46, 70 and 33 tokens
SHAPE_LABEL = "8 query heads over 2 KV heads, blocks of 32"


# ---- the learner's own code, from their exercise notebooks -------------------------------------------
def load_exercises(folder: str | Path = ".") -> dict[str, types.SimpleNamespace]:
    """Run the code cells of exercises 03–09 found in ``folder`` (not their check cells) and return each
    one's functions: ``mine["ex04"].slot_mapping``. A cell that fails is skipped (its error is kept in
    ``mine[ex].errors``): the functions defined before it are still there."""
    import minipaged.kernels  # noqa: F401  (without a GPU: Triton's interpreter, before triton is imported)

    found: dict[str, types.SimpleNamespace] = {}
    for ex in EXERCISES:
        paths = sorted(Path(folder).glob(f"{ex}_*.ipynb"))
        if len(paths) != 1:
            raise FileNotFoundError(f"expected one {ex}_*.ipynb in {Path(folder).resolve()}, found {len(paths)}")
        namespace, errors = run_code_cells(paths[0], f"learner_{ex}")
        found[ex] = types.SimpleNamespace(**{k: v for k, v in namespace.items() if callable(v)}, errors=errors)
    return found


# The name each exercise gave its function, where it is not the part's: exercise 03 wrote the queue's ``remove``.
FUNCTION_NAMES = {"free_queue_remove": "remove"}


def guided_parts(mine: dict[str, types.SimpleNamespace]) -> dict[str, Callable[..., Any]]:
    """Every part of exercises 03–09, taken from what ``load_exercises`` found in the learner's notebooks by the
    name each exercise asked for. A function that is missing is named with its exercise."""
    got, missing = {}, []
    for name, part in capstone_parts().items():
        fn = getattr(mine[part.exercise], FUNCTION_NAMES.get(name, name), None)
        if fn is None:
            missing.append(f"{FUNCTION_NAMES.get(name, name)} ({part.exercise})")
        else:
            got[name] = fn
    if missing:
        raise NameError(f"your exercise notebooks define no {', '.join(missing)}")
    return got


# ---- the workload and its reference -----------------------------------------------------------------
def prompt_ids() -> list[list[int]]:
    from ...model_loader import chat_prompt_ids, load_tokenizer

    tokenizer = load_tokenizer()
    return [chat_prompt_ids(tokenizer, p) for p in PROMPTS]


def reference_outputs(
    prompts: list[list[int]], max_tokens: int = MAX_TOKENS, device: Any = "cpu", dtype: Any = None
) -> list[list[int]]:
    """transformers' greedy output for each prompt, one at a time, on ``device`` in ``dtype`` (float32 by default):
    where and how the engine it is compared with runs. Computed once, then read from a file beside the converted
    model (it depends only on the weights, the prompts, ``max_tokens``, the device type and the dtype)."""
    import torch

    from ...model_loader import ensure_converted

    dev, dt = torch.device(device), dtype or torch.float32
    model_dir = ensure_converted(progress=False)
    how = [] if (dev.type, dt) == ("cpu", torch.float32) else [dev.type, str(dt)]  # the CPU's keys as they were
    key = hashlib.sha256(json.dumps([prompts, max_tokens, *how]).encode()).hexdigest()[:16]
    path = Path(model_dir) / "greedy_reference.json"
    saved = _read_json(path)
    if key not in saved:
        from ...model_loader import hf_greedy_token_ids, load_hf_model

        saved[key] = hf_greedy_token_ids(load_hf_model(dtype=dt, device=str(dev)), prompts, max_tokens)
        # Another process (a second grading run, a test worker) may write it too: write whole, then rename.
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**_read_json(path), **saved}))
        os.replace(tmp, path)
    return saved[key]


def _read_json(path: Path) -> dict[str, Any]:
    """The saved references, or none when the file is missing or unreadable (they are computed again)."""
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def package_parts() -> dict[str, Callable[..., Any]]:
    """The package's own piece for every part, with the parts' signatures: what a learner who solved every
    exercise hands in."""
    from ...core.block_pool import FreeKVCacheBlockQueue, chain_block_hashes, free_blocks, get_new_blocks
    from ...core.kv_cache_manager import KVCacheManager, find_prefix_hits
    from ...core.scheduler import admit_waiting, preempt_recompute, schedule_running
    from ...kernels import reference
    from ...worker.block_table import slot_mapping

    return dict(
        free_queue_remove=FreeKVCacheBlockQueue.remove,
        slot_mapping=slot_mapping,
        would_allocate=KVCacheManager.can_allocate,
        reshape_and_cache=reference.reshape_and_cache,
        admit_waiting=admit_waiting,
        schedule_running=schedule_running,
        preempt_recompute=preempt_recompute,
        chain_block_hashes=chain_block_hashes,
        find_prefix_hits=find_prefix_hits,
        get_new_blocks=get_new_blocks,
        free_blocks=free_blocks,
        paged_decode_attention=reference.paged_decode_attention,
    )


def shape_model() -> Path:
    """The tiny Llama of the second shape, made once (seeded) beside the converted SmolLM2."""
    from ...model_loader import cache_dir, save_tiny_llama

    folder = cache_dir() / "tiny-llama-8q-2kv"
    if not (folder / "config.json").exists():
        tmp = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
        save_tiny_llama(tmp, seed=24, **SHAPE)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process made it first: the same seeded weights
            shutil.rmtree(tmp)
    return folder


def shape_prompts() -> list[list[int]]:
    rng = random.Random(24)
    shared = [rng.randrange(1, 96) for _ in range(32)]
    return [shared + [rng.randrange(1, 96) for _ in range(n)] for n in SHAPE_TAILS]


# ---- one run, and the card ---------------------------------------------------------------------------
@dataclass
class Run:
    outputs: list[list[int]] = field(default_factory=list)
    steps: list[list[int]] = field(default_factory=list)  # the engine step that produced each token
    calls: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    num_preemptions: int = 0
    prefix_hit_tokens: int = 0


def serve(
    llm: Any,
    prompts: list[list[int]],
    plugged: dict[str, Callable[..., Any]],
    check: bool,
    max_tokens: int = MAX_TOKENS,
) -> Run:
    """One batch on a fresh engine (same weights) with ``plugged`` parts; errors are caught and kept."""
    from ...sampling_params import SamplingParams

    llm.reset()
    run = Run(outputs=[[] for _ in prompts], steps=[[] for _ in prompts])
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    block = parts.use(check=check, **plugged)
    try:
        wrappers = block.__enter__()  # checked: the probes run here, before the engine does
    except parts.PartError as exc:
        run.error, run.calls = f"{exc}", {name: 0 for name in plugged}
        return run
    try:
        for out in llm.stream(prompts, params):
            i = int(out.request_id)
            new = out.outputs[0].token_ids[len(run.outputs[i]) :]
            run.outputs[i] += new
            run.steps[i] += [llm.num_steps] * len(new)
    except Exception as exc:
        step = getattr(exc, "step", None) or llm.num_steps
        run.error = (
            f"{exc}" if isinstance(exc, parts.PartError) else f"{type(exc).__name__} at engine step {step}: {exc}"
        )
    finally:
        block.__exit__(None, None, None)
    run.calls = {name: w.calls for name, w in wrappers.items()}
    run.num_preemptions = llm.scheduler.num_preemptions
    run.prefix_hit_tokens = llm.kv_cache_manager.prefix_cache_hits
    return run


def first_difference(run: Run, reference: list[list[int]]) -> str | None:
    """Where the outputs first part from the reference, or None if every token is the same."""
    for i, (got, want) in enumerate(zip(run.outputs, reference)):
        if got != want:
            k = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            step = f" (engine step {run.steps[i][k]})" if k < len(run.steps[i]) else ""
            return (
                f"request {i} differs from its token {k}{step}: {got[k : k + 3]}... where transformers has "
                f"{want[k : k + 3]}..."
            )
    return None


@dataclass
class Row:
    label: str
    part_names: list[str]
    calls: dict[str, int]
    verdict: str  # "token-exact", or what went wrong
    title: str = ""  # for a row of all parts: what it ran them on

    def line(self) -> str:
        if len(self.part_names) > 2:  # all of them: the calls are the rows' above
            title = self.title or f"all {len(self.part_names)} parts together"
            return f"  {self.label:<5} {title:<58} {self.verdict}"
        calls = ", ".join(str(self.calls.get(n, 0)) for n in self.part_names)
        return f"  {self.label:<5} {', '.join(self.part_names):<40} calls {calls:<11} {self.verdict}"


@dataclass
class ReportCard:
    rows: list[Row]
    num_preemptions: int
    prefix_hit_tokens: int
    num_blocks: int

    def __str__(self) -> str:
        head = (
            f"report card: {len(PROMPTS)} SmolLM2 chat requests, {MAX_TOKENS} greedy tokens each, a pool of "
            f"{self.num_blocks - 1} blocks\n  with all parts: preemptions {self.num_preemptions}, "
            f"{self.prefix_hit_tokens} prompt tokens from the prefix cache"
        )
        return "\n".join([head, *(r.line() for r in self.rows)])

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


def _verdict(
    llm: Any, prompts: list[list[int]], reference: list[list[int]], plugged: dict[str, Callable[..., Any]]
) -> tuple[str, Run]:
    run = serve(llm, prompts, plugged, check=False)
    problem = run.error or first_difference(run, reference)
    idle = [name for name, n in run.calls.items() if n == 0]
    if problem is None and not idle:
        return "token-exact", run
    if problem is None:
        return f"never called: {', '.join(idle)} (does the engine give it work?)", run
    checked = serve(llm, prompts, plugged, check=True)
    if checked.error and checked.error != run.error:
        problem += f"; first wrong call: {checked.error}"
    return problem, run


def engine(settings: dict[str, Any]) -> Any:
    """An ``LLM`` with ``settings`` whose ``max_model_len`` is what the batch needs (so a small pool is no warning).
    ``dtype="auto"`` serves float32 here on any device: what it means on a CPU, and on a GPU (where it would be
    bfloat16) the precision in which a right engine and transformers pick the same greedy tokens."""
    from ...engine.llm import LLM

    block_size = settings.get("block_size", 16)
    longest = cdiv(max(len(p) for p in prompt_ids()) + MAX_TOKENS, block_size) * block_size
    dtype = settings.get("dtype", "auto")
    return LLM(**{"max_model_len": longest, **settings, "dtype": "float32" if dtype == "auto" else dtype})


def report_card(
    my_parts: dict[str, Callable[..., Any]], settings: dict[str, Any] | None = None, llm: Any = None
) -> ReportCard:
    """Each exercise's parts alone, then all together, against transformers (see the module docstring).
    The engine is built from ``settings``, or ``llm`` is used as it is (reset before every run)."""
    prompts = prompt_ids()
    llm = llm or engine(settings or {})
    reference = reference_outputs(prompts, device=llm.device, dtype=llm.dtype)  # where and how the engine runs
    rows = []
    for ex in EXERCISES:
        names = [n for n, p in capstone_parts().items() if p.exercise == ex]
        verdict, run = _verdict(llm, prompts, reference, {n: my_parts[n] for n in names})
        rows.append(Row(ex, names, run.calls, verdict))
    verdict, together = _verdict(llm, prompts, reference, dict(my_parts))
    rows.append(Row("all", list(capstone_parts()), together.calls, verdict))
    rows.append(shape_row(my_parts))
    return ReportCard(rows, together.num_preemptions, together.prefix_hit_tokens, llm.num_blocks)


def shape_row(my_parts: dict[str, Callable[..., Any]]) -> Row:
    """All parts together on the second model shape, against the package's own engine on it."""
    from ...engine.llm import LLM
    from ...sampling_params import SamplingParams

    llm = LLM(shape_model(), **SHAPE_SETTINGS)
    prompts = shape_prompts()
    reference = [
        o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    ]
    verdict, run = _verdict(llm, prompts, reference, dict(my_parts))
    return Row(
        "shape",
        list(capstone_parts()),
        run.calls,
        verdict.replace("transformers", "the package's engine"),
        title=f"all {len(capstone_parts())} parts, {SHAPE_LABEL}",
    )
