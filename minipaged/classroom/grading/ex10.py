"""Checks for exercise 10, the capstone: the learner's own engine, the step loop that joins the components.

The learner writes ``Engine(model, parts, num_blocks, block_size, max_num_seqs, max_num_batched_tokens,
max_model_len)``: the loop that joins a ``BlockPool``, a ``KVCacheManager``, a ``Scheduler`` and a
``decoder_layer``, with the two runner pieces in between — ``prepare_inputs`` (a step's flat rows and
``StepMeta``) and ``sample`` (greedy) — and a ``step`` that happens whole or not at all. None of the package's
engine pieces run in it.

The two tracks meet here. A learner of the build track hands their loop their own components (exercises 03b,
04b, 06b and 09b); a learner of the guided track hands it the package's components behind the same interfaces,
with their own parts of exercises 03–08 plugged into them (``parts.use``: the free queue's ``remove``, the
admission rule and loop, preemption, the block hashes and the prefix lookup, the scatter-write and decode
attention). Either way every token is checked against transformers.

Four groups:

* ``engine_inputs``: ``prepare_inputs`` on the steps of a scripted run (chunks, decodes, a prefix hit, a
  preemption), against what the grader computes from the requests and their block tables.
* ``engine_tiny``: ``generate`` on a tiny random Llama with the package's own pieces behind the learner's
  interfaces, token for token against transformers' greedy ``generate`` on the same model.
* ``engine_rollback``: a step whose layer fails halfway (an error, then Ctrl-C) raises, leaves every request,
  block table and the pool as before it, and the run then finishes with the same tokens as a run without faults.
* ``engine_smollm2``: the learner's engine *with the learner's own pieces* (the build track's four components
  when their notebooks are beside this one, else the guided track's parts) serves SmolLM2 on a workload that
  preempts, chunks and hits the prefix cache, token for token against transformers' greedy ``generate``.

``report_card`` (not graded: speed is a machine's) times the same SmolLM2 workload on the learner's engine and on
the package's ``LLM`` in the same process.
"""

from __future__ import annotations

import inspect
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...config import SchedulerConfig
from ...core.block_pool import BlockPool as PackagePool
from ...core.block_pool import get_request_block_hasher
from ...core.kv_cache_manager import KVCacheManager as PackageManager
from ...core.request import Request
from ...core.scheduler import Scheduler as PackageScheduler
from ...kernels import reference
from ...model.attention import SEAM
from ...sampling_params import SamplingParams
from .. import parts as plug
from . import capstone, ownership
from .core import Check, CheckOutcome, report
from .ex09b import LayerConfig, StepMeta, smollm2_config
from .exercises import COMPONENTS
from .runner import run_code_cells

EngineClass = Callable[..., Any]
BUILD_TRACK = {"ex03b": "BlockPool", "ex04b": "KVCacheManager", "ex06b": "Scheduler", "ex09b": "decoder_layer"}


# ---- the model, as the engine sees it -----------------------------------------------------------------------------
@dataclass
class Model:
    """A Llama's weights by role: ``embed`` [vocab, hidden], one weight dict per layer (exercise 09b's names),
    the final ``norm`` [hidden], ``lm_head`` [vocab, hidden]; its ``cfg`` and its ``eos_token_id`` (None: none)."""

    cfg: LayerConfig
    embed: torch.Tensor
    layers: list[dict[str, torch.Tensor]]
    norm: torch.Tensor
    lm_head: torch.Tensor
    eos_token_id: int | None


def model_from_hf(hf: Any) -> Model:
    layers = [{k: v.detach() for k, v in layer.state_dict().items()} for layer in hf.model.layers]
    eos = hf.config.eos_token_id
    return Model(
        smollm2_config(hf.config), hf.model.embed_tokens.weight.detach(), layers, hf.model.norm.weight.detach(),
        hf.lm_head.weight.detach(), eos if isinstance(eos, int) else None,
    )  # fmt: skip


_MODELS: dict[str, Any] = {}


def smollm2() -> Model:
    if "smollm2" not in _MODELS:
        from ...model_loader import load_hf_model

        _MODELS["smollm2"] = model_from_hf(load_hf_model())
    return _MODELS["smollm2"]


def tiny_hf() -> Any:
    """Exercise 10's tiny random Llama (8 query heads over 2 KV heads, 2 layers), its norms' weights made uneven
    (seeded): a norm of all ones only rescales each row, which no greedy token notices."""
    if "tiny_hf" not in _MODELS:
        from ...model_loader import load_hf_model

        hf = load_hf_model(capstone.shape_model())
        g = torch.Generator().manual_seed(10)
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(0.5 + torch.rand(p.shape, generator=g))
        _MODELS["tiny_hf"] = hf
    return _MODELS["tiny_hf"]


def tiny() -> Model:
    if "tiny" not in _MODELS:
        _MODELS["tiny"] = model_from_hf(tiny_hf())
    return _MODELS["tiny"]


def make_request(
    request_id: str, prompt: list[int], max_tokens: int, eos_token_id: int | None, block_size: int
) -> Request:
    """A request as the build track's components read it: its block hashes kept for the prefix cache."""
    return Request(
        request_id, list(prompt), sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0),
        eos_token_id=eos_token_id, block_hasher=get_request_block_hasher(block_size),
    )  # fmt: skip


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The final norm, as in exercise 09b (given: it is not this exercise's)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


# ---- the package's pieces behind the learner's interfaces ----------------------------------------------------------
def _package_manager(block_pool: Any, block_size: int, watermark_blocks: int = 0) -> PackageManager:
    return PackageManager(block_size, len(block_pool.blocks), watermark_blocks=watermark_blocks)


class _PackageScheduler:
    """The package's ``Scheduler`` with exercise 06b's interface."""

    def __init__(self, kv_cache_manager: Any, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int):
        config = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len
        )
        self.kv_cache_manager = kv_cache_manager
        self.sched = PackageScheduler(config, kv_cache_manager)
        self.last: Any = None

    @property
    def waiting(self) -> Any:
        return self.sched.waiting

    @property
    def running(self) -> list[Request]:
        return self.sched.running

    def add_request(self, request: Request) -> None:
        self.sched.add_request(request)

    def has_unfinished(self) -> bool:
        return self.sched.has_unfinished()

    def schedule(self) -> tuple[list[tuple[str, int]], list[str]]:
        self.last = self.sched.schedule()
        return [(s.request_id, s.num_new_tokens) for s in self.last.scheduled], list(self.last.preempted)

    def update_from_output(self, scheduled: list[tuple[str, int]], sampled: dict[str, int]) -> list[Request]:
        return self.sched.update_from_output(self.last, {rid: [t] for rid, t in sampled.items()})


def package_decoder_layer(
    x: torch.Tensor,
    positions: torch.Tensor,
    weights: dict[str, torch.Tensor],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: StepMeta,
    cfg: LayerConfig,
) -> torch.Tensor:
    """A decoder layer of the package's own pieces (the kernels' PyTorch references) with exercise 09b's
    signature; its attention goes through the package's attention seam (``model/attention.py``)."""
    w, rows, d = weights, x.shape[0], cfg.head_dim
    h = rms_norm(x, w["input_layernorm.weight"], cfg.rms_norm_eps)
    q = (h @ w["self_attn.q_proj.weight"].T).view(rows, cfg.num_heads, d)
    k = (h @ w["self_attn.k_proj.weight"].T).view(rows, cfg.num_kv_heads, d)
    v = (h @ w["self_attn.v_proj.weight"].T).view(rows, cfg.num_kv_heads, d)
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = positions.float()[:, None] * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]

    def rotate(t: torch.Tensor) -> torch.Tensor:
        return t * cos + torch.cat([-t[..., d // 2 :], t[..., : d // 2]], -1) * sin

    q, k = rotate(q), rotate(k)
    i32 = torch.int32  # the kernels' index dtype
    tables, seq_lens, cu = meta.block_tables.to(i32), meta.seq_lens.to(i32), meta.cu_seqlens_q.to(i32)
    # Through the attention seam, as the package's layer goes: a guided-track learner's scatter-write and decode
    # attention (exercises 05b and 05) run here when plugged in, the kernels' references otherwise.
    SEAM.pick("reshape_and_cache", reference.reshape_and_cache)(k, v, k_cache, v_cache, meta.slot_mapping.long())
    if rows == len(seq_lens):  # one new row per sequence: a decode-only step
        a = SEAM.pick("paged_decode_attention", reference.paged_decode_attention)(
            q, k_cache, v_cache, tables, seq_lens, d**-0.5
        )
    else:
        a = reference.paged_prefill_attention(q, k_cache, v_cache, tables, cu, seq_lens, d**-0.5)
    x = x + a.reshape(rows, -1) @ w["self_attn.o_proj.weight"].T
    h = rms_norm(x, w["post_attention_layernorm.weight"], cfg.rms_norm_eps)
    return (
        x
        + (torch.nn.functional.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T))
        @ w["mlp.down_proj.weight"].T
    )


def package_parts() -> dict[str, Any]:
    """The package's pieces behind the build track's interfaces: what ``engine_inputs``, ``engine_tiny`` and
    ``engine_rollback`` run the learner's step loop on, so that those groups grade the loop alone."""
    return dict(
        BlockPool=PackagePool, KVCacheManager=_package_manager, Scheduler=_PackageScheduler,
        decoder_layer=package_decoder_layer,
    )  # fmt: skip


def load_build_track(folder: str | Path = ".") -> dict[str, Any]:
    """The learner's components, from their build-track notebooks in ``folder`` (their code cells, not their check
    cells): ``{"BlockPool": ..., "KVCacheManager": ..., "Scheduler": ..., "decoder_layer": ...}``."""
    parts: dict[str, Any] = {}
    for ex, name in BUILD_TRACK.items():
        paths = sorted(Path(folder).glob(f"{ex}_*.ipynb"))
        if len(paths) != 1:
            raise FileNotFoundError(f"expected one {ex}_*.ipynb in {Path(folder).resolve()}, found {len(paths)}")
        namespace, _errors = run_code_cells(paths[0], f"learner_{ex}")
        if name not in namespace:
            raise NameError(f"{paths[0].name} defines no {name}")
        parts[name] = namespace[name]
    return parts


# ---- engine_inputs ---------------------------------------------------------------------------------------------
def expected_inputs(engine: Any, scheduled: list[tuple[str, int]]) -> dict[str, list]:
    """What a step's inputs must be, from the requests (before the step) and the manager's block tables."""
    kv, bs = engine.kv_cache_manager, engine.block_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    cu, lens, tables, sample_rows = [0], [], [], []
    for rid, n in scheduled:
        req = engine.requests[rid]
        start = req.num_computed_tokens
        table = kv.get_block_ids(rid)
        ids += req.all_token_ids[start : start + n]
        positions += list(range(start, start + n))
        slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
        cu.append(cu[-1] + n)
        lens.append(start + n)
        tables.append(table)
        if start + n == req.num_tokens:
            sample_rows.append(cu[-1] - 1)
    width = max(len(t) for t in tables)
    return dict(
        input_ids=ids, positions=positions, slot_mapping=slots, cu_seqlens_q=cu, seq_lens=lens,
        block_tables=[t + [0] * (width - len(t)) for t in tables], sample_rows=sample_rows,
    )  # fmt: skip


def _as_lists(got: Any) -> dict[str, list]:
    input_ids, positions, meta, sample_rows = got
    return dict(
        input_ids=torch.as_tensor(input_ids).tolist(), positions=torch.as_tensor(positions).tolist(),
        slot_mapping=meta.slot_mapping.tolist(), cu_seqlens_q=meta.cu_seqlens_q.tolist(),
        seq_lens=meta.seq_lens.tolist(), block_tables=meta.block_tables.tolist(),
        sample_rows=torch.as_tensor(sample_rows).tolist(),
    )  # fmt: skip


TINY_SETTINGS = dict(num_blocks=12, block_size=4, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=96)
TINY_MAX_TOKENS = 10


def tiny_prompts() -> list[list[int]]:
    """Four prompts, three sharing their first 12 tokens (three blocks of 4)."""
    shared = [(7 * i + 3) % 90 + 1 for i in range(12)]
    return [shared + [5, 9, 17], shared + [44, 2], [(3 * i) % 90 + 1 for i in range(9)], shared + [61]]


def _inputs_run(cls: EngineClass) -> list[str]:
    """Serve the tiny workload step by step, checking every step's inputs; one verdict per kind of step."""
    model = tiny()
    engine = cls(model, package_parts(), **TINY_SETTINGS)
    for i, p in enumerate(tiny_prompts()):
        engine.add_request(str(i), p, TINY_MAX_TOKENS)
    seen = {"chunk": "not seen", "decode": "not seen", "hit": "not seen", "mixed": "not seen"}
    sched = engine.scheduler
    for step in range(200):
        if not sched.has_unfinished():
            break
        scheduled, _preempted = sched.schedule()
        if not scheduled:
            continue
        want = expected_inputs(engine, scheduled)
        got = _as_lists(engine.prepare_inputs(scheduled))
        starts = [engine.requests[rid].num_computed_tokens for rid, _ in scheduled]
        kinds = {
            "chunk": any(s + n < engine.requests[r].num_tokens for (r, n), s in zip(scheduled, starts)),
            "decode": any(n == 1 and s > 0 for (_, n), s in zip(scheduled, starts)),
            "hit": any(s > 0 and s + n > engine.requests[r].num_prompt_tokens - 1 and n > 1
                       for (r, n), s in zip(scheduled, starts)),
            "mixed": len({n == 1 for _, n in scheduled}) == 2,
        }  # fmt: skip
        for kind, present in kinds.items():
            if present and seen[kind] == "not seen":
                seen[kind] = "right"
            if present and got != want:
                diff = next(k for k in want if got.get(k) != want[k])
                seen[kind] = f"step {step} ({scheduled}): {diff} {got.get(diff)}, expected {want[diff]}"
        if got != want:
            break
        rows = torch.as_tensor(got["sample_rows"], dtype=torch.long)
        sampled = {rid: 1 + (7 * len(engine.requests[rid].all_token_ids)) % 90
                   for (rid, n), s in zip(scheduled, starts) if s + n == engine.requests[rid].num_tokens}  # fmt: skip
        assert len(sampled) == len(rows) or got != want
        sched.update_from_output(scheduled, sampled)
    return [seen["chunk"], seen["decode"], seen["hit"], seen["mixed"]]


def check_engine_inputs(Engine: EngineClass) -> list[CheckOutcome]:
    """``prepare_inputs`` on every step of a tiny run, beside what the grader computes for that step."""
    cache: dict[str, list[str]] = {}

    def verdict(i: int) -> str:
        if "v" not in cache:
            cache["v"] = _inputs_run(Engine)
        return cache["v"][i]

    hint = (
        "one row per new token: its id, its position (start + i), its slot (table[pos // block_size] * block_size "
        "+ pos % block_size); cu_seqlens_q and seq_lens (start + n) per sequence; tables padded with 0; a sample "
        "row (the sequence's last row) only where every token is computed"
    )
    labels = [
        "a step with a prompt chunk that does not reach the prompt's end (it samples nothing)",
        "a step with decode rows (one token each, positions past the prompt)",
        "a step with a request admitted on prefix-cache hits (its rows start past them)",
        "a mixed step: chunks and decodes in one batch",
    ]
    return report(
        "engine_inputs",
        [
            Check(f"tiny run, {label}: inputs", lambda i=i: verdict(i), "right", hint=hint)
            for i, label in enumerate(labels)
        ],
    )


# ---- engine_tiny -------------------------------------------------------------------------------------------------
def _tiny_reference(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy ``generate`` on the tiny model, one prompt at a time: the reference for
    ``engine_tiny`` and ``engine_rollback``."""
    if "tiny_ref" not in _MODELS:
        from ...model_loader import hf_greedy_token_ids

        _MODELS["tiny_ref"] = hf_greedy_token_ids(tiny_hf(), prompts, max_tokens)
    return _MODELS["tiny_ref"]


@dataclass
class Served:
    outputs: list[list[int]]
    preemptions: int
    shared_blocks: int  # blocks seen in two tables at once, summed over steps: prefix-cache hits
    chunks: int


def serve_counting(engine: Any, prompts: list[list[int]], max_tokens: int) -> Served:
    """Serve ``prompts`` step by step (``add_request``, then ``step`` until the scheduler is done), watching from
    outside between steps: a request part-way through its prompt was chunked; a block in two tables at once came
    from the prefix cache (nothing else shares blocks here); each request counts its own preemptions."""
    ids = [f"p{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, max_tokens)
    chunked: set[str] = set()
    shared = 0
    for _ in range(10_000):  # a bound: a scheduler that never finishes fails here instead of hanging
        if not engine.scheduler.has_unfinished():
            break
        engine.step()
        seen: set[int] = set()
        for req in engine.scheduler.running:
            if 0 < req.num_computed_tokens < req.num_prompt_tokens:
                chunked.add(req.request_id)
            table = set(engine.kv_cache_manager.get_block_ids(req.request_id))
            shared += len(table & seen)
            seen |= table
    else:
        raise RuntimeError("the run did not finish in 10,000 steps")
    reqs = [engine.requests[rid] for rid in ids]
    return Served([list(r.output_token_ids) for r in reqs], sum(r.num_preemptions for r in reqs), shared, len(chunked))


def _compare_outputs(got: list[list[int]], want: list[list[int]]) -> str:
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            k = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
            return (
                f"request {i} differs from its token {k}: {g[k : k + 3]}... where the reference has {w[k : k + 3]}..."
            )
    return "token-exact" if len(got) == len(want) else f"{len(got)} outputs for {len(want)} prompts"


def check_engine_tiny(Engine: EngineClass) -> list[CheckOutcome]:
    """The learner's step loop with the package's pieces on a tiny random Llama: the package engine's tokens."""
    cache: dict[str, Any] = {}

    def run() -> Served:
        if "s" not in cache:
            engine = Engine(tiny(), package_parts(), **TINY_SETTINGS)
            cache["s"] = serve_counting(engine, tiny_prompts(), TINY_MAX_TOKENS)
        return cache["s"]

    def generated() -> str:
        engine = Engine(tiny(), package_parts(), **TINY_SETTINGS)
        return _compare_outputs([list(o) for o in engine.generate(tiny_prompts(), TINY_MAX_TOKENS)], want)

    want = _tiny_reference(tiny_prompts(), TINY_MAX_TOKENS)
    return report(
        "engine_tiny",
        [
            Check(
                f"tiny Llama (8 query heads over 2 KV heads), 4 prompts, {TINY_SETTINGS['num_blocks'] - 1} blocks of "
                f"{TINY_SETTINGS['block_size']}, budget {TINY_SETTINGS['max_num_batched_tokens']}: generate()",
                generated,
                "token-exact",
                hint="inputs right but tokens wrong: the forward (embed, layers, final norm on the sample rows, "
                "lm_head) or the sampled token given to the right request",
            ),
            Check(
                "the same run step by step (add_request, then step() until done): [tokens, preempted?, chunked "
                "prompts?, prefix-cache hits?]",
                lambda: [
                    _compare_outputs(run().outputs, want),
                    run().preemptions > 0,
                    run().chunks > 0,
                    run().shared_blocks > 0,
                ],
                ["token-exact", True, True, True],
                hint="the engine's settings reach the scheduler and the manager as given",
            ),
        ],
    )


# ---- engine_rollback ---------------------------------------------------------------------------------------------
class _Fault(RuntimeError):
    pass


def _observable(engine: Any) -> Any:
    """Everything a step changes that can be seen from outside the engine."""
    kv = engine.kv_cache_manager
    pool = kv.block_pool
    reqs = {
        rid: (r.num_computed_tokens, list(r.all_token_ids), kv.get_block_ids(rid))
        for rid, r in sorted(engine.requests.items())
    }
    return (
        reqs, [r.request_id for r in engine.scheduler.running], [r.request_id for r in engine.scheduler.waiting],
        pool.get_num_free_blocks(), [b.ref_cnt for b in pool.blocks],
    )  # fmt: skip


def _rollback_run(cls: EngineClass, exc_type: type[BaseException], fail_at_step: int, num_blocks: int = 0) -> str:
    calls = {"n": 0, "armed": False}

    def flaky(*args: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["armed"] and calls["n"] == 2:  # the second layer: the first wrote its K/V already
            raise exc_type("injected: the layer failed mid-step")
        return package_decoder_layer(*args)

    parts = {**package_parts(), "decoder_layer": flaky}
    engine = cls(tiny(), parts, **{**TINY_SETTINGS, "num_blocks": num_blocks or TINY_SETTINGS["num_blocks"]})
    prompts = tiny_prompts()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, TINY_MAX_TOKENS)
    for _ in range(fail_at_step):
        engine.step()
    before = _observable(engine)
    calls.update(n=0, armed=True)
    try:
        engine.step()
    except exc_type:
        pass
    else:
        return f"step {fail_at_step} did not raise: the layer's {exc_type.__name__} was swallowed"
    calls["armed"] = False
    if _observable(engine) != before:
        after = _observable(engine)
        names = ("requests (computed, tokens, table)", "running", "waiting", "free blocks", "ref counts")
        which = next(n for n, a, b in zip(names, after, before) if a != b)
        return f"after the failed step {fail_at_step}, {which} changed"
    while engine.scheduler.has_unfinished():
        engine.step()
    outs = [list(engine.requests[str(i)].output_token_ids) for i in range(len(prompts))]
    return _compare_outputs(outs, _tiny_reference(prompts, TINY_MAX_TOKENS))


def check_engine_rollback(Engine: EngineClass) -> list[CheckOutcome]:
    """A step whose second layer fails: it raises, changes nothing, and the run then ends with the right tokens."""
    hint = (
        "save what a step changes (the scheduler, which holds the manager, the pool, its blocks and the requests) "
        "before schedule(); on any exception (BaseException: Ctrl-C too) put it back in place, then raise"
    )
    big = (
        "save without recursion: copy.deepcopy follows the free list link by link and runs out of stack on a big "
        "pool; walk the objects with a stack and save each one's attributes and each container's contents"
    )
    cases = [
        (_Fault, 2, "a RuntimeError", 0, hint),
        (KeyboardInterrupt, 4, "Ctrl-C (KeyboardInterrupt)", 0, hint),
        (_Fault, 3, "a RuntimeError, in a pool of 10,000 blocks", 10_000, big),
    ]
    return report(
        "engine_rollback",
        [
            Check(
                f"tiny run, {label} in layer 2 of step {at}: it raises, every request, table and the pool are as "
                "before the step, and the run finishes token-exact",
                lambda exc=exc, at=at, n=n: _rollback_run(Engine, exc, at, n),
                "token-exact",
                hint=h,
            )
            for exc, at, label, n, h in cases
        ],
    )


# ---- engine_smollm2: the capstone ----------------------------------------------------------------------------------
SMOLLM2_SETTINGS = dict(num_blocks=9, block_size=16, max_num_seqs=4, max_num_batched_tokens=48, max_model_len=128)


def notebook_folder() -> Path:
    """Where the notebook being graded lives: the grader's worker is given its path (``sys.argv[1]``); a kernel
    (Jupyter, nbval) runs in the notebook's folder."""
    arg = sys.argv[1] if len(sys.argv) > 1 else ""
    return Path(arg).resolve().parent if arg.endswith(".ipynb") else Path.cwd()


def _tiny_passes(Engine: EngineClass) -> bool:
    """Whether the learner's step loop, with the package's components, serves the tiny model token-exact (a failing
    group's hint: the grader hands the package's components over on purpose, so the call tracer looks away)."""
    ownership.exempt(COMPONENTS)
    engine = Engine(tiny(), package_parts(), **TINY_SETTINGS)
    got = [list(o) for o in engine.generate(tiny_prompts(), TINY_MAX_TOKENS)]
    return _compare_outputs(got, _tiny_reference(tiny_prompts(), TINY_MAX_TOKENS)) == "token-exact"


@dataclass
class YourPieces:
    """What the learner's engine runs on in ``engine_smollm2``: ``components`` are handed to ``Engine``; ``plugged``
    parts (the guided track's) are plugged into them for the run."""

    track: str  # "build" or "guided"
    components: dict[str, Any]
    plugged: dict[str, Callable[..., Any]]


# The guided parts the learner's engine gives work to. Exercise 04's slot_mapping is not one of them: the loop's own
# prepare_inputs computes the slots (exercise 09's step inputs, written again in the loop).
GUIDED_PARTS = tuple(n for n in capstone.capstone_parts() if n != "slot_mapping")


def your_pieces(folder: Path) -> YourPieces:
    """The build track's four components when their four notebooks are in ``folder``; else the package's components
    with the guided track's parts from exercises 03–08's notebooks in ``folder`` (all of them must be there)."""
    found = {ex: len(list(folder.glob(f"{ex}_*.ipynb"))) == 1 for ex in BUILD_TRACK}
    if all(found.values()):
        return YourPieces("build", load_build_track(folder), {})
    try:
        mine = capstone.load_exercises(folder)
    except FileNotFoundError as exc:
        missing = ", ".join(ex for ex, ok in found.items() if not ok)
        raise FileNotFoundError(
            f"neither track is complete beside this notebook: the build track lacks {missing}; the guided track: {exc}"
        ) from None
    guided = capstone.guided_parts(mine)
    return YourPieces("guided", package_parts(), {n: guided[n] for n in GUIDED_PARTS})


def _provenance(parts: dict[str, Any]) -> str:
    """'yours' when each build-track component was defined in its notebook (``load_build_track`` names the code it
    runs after the notebook and cell), else which one came from elsewhere."""
    for ex, name in BUILD_TRACK.items():
        obj = parts[name]
        fns = [obj] if inspect.isfunction(obj) else [v for v in vars(obj).values() if inspect.isfunction(v)]
        files = {fn.__code__.co_filename for fn in fns} if isinstance(obj, type) or fns == [obj] else set()
        if not files or not all(f.startswith(f"<{ex}_") for f in files):
            return f"{name} was not defined in your {ex} notebook (found in {sorted(files) or type(obj).__name__})"
    return "yours"


def _yours(pieces: YourPieces) -> str:
    """'yours' when every piece was defined in its own notebook, else which one came from elsewhere."""
    if pieces.track == "build":
        return _provenance(pieces.components)
    exercise = {n: p.exercise for n, p in capstone.capstone_parts().items()}
    for name, fn in pieces.plugged.items():
        ex = exercise[name]
        where = getattr(getattr(fn, "__code__", None), "co_filename", type(fn).__name__)
        if not where.startswith(f"<{ex}_"):
            return f"{name} was not defined in your {ex} notebook (found in {where})"
    return "yours"


def check_engine_smollm2(Engine: EngineClass) -> list[CheckOutcome]:
    """The learner's engine with the learner's own pieces, which the grader loads itself from the notebooks beside
    the one being graded (the build track's components, else the guided track's parts), serves SmolLM2:
    transformers' greedy tokens."""
    cache: dict[str, Any] = {}

    def pieces() -> YourPieces:
        if "pieces" not in cache:
            cache["pieces"] = your_pieces(notebook_folder())
        return cache["pieces"]

    def run() -> Served:
        if "s" not in cache:
            if pieces().track == "guided":  # the package's components, handed over by the grader on purpose
                ownership.exempt(COMPONENTS)
            with plug.use(check=False, **pieces().plugged) as wrappers:
                engine = Engine(smollm2(), pieces().components, **SMOLLM2_SETTINGS)
                cache["s"] = serve_counting(engine, capstone.prompt_ids(), capstone.MAX_TOKENS)
            cache["idle"] = sorted(n for n, w in wrappers.items() if w.calls == 0)
        return cache["s"]

    def worked() -> tuple[bool, bool, bool, str]:
        s = run()
        idle = cache["idle"]
        return s.preemptions > 0, s.chunks > 0, s.shared_blocks > 0, f"never called: {', '.join(idle)}" if idle else ""

    return report(
        "engine_smollm2",
        [
            Check(
                "pieces: yours, from the notebooks beside this one — the build track's BlockPool, KVCacheManager, "
                "Scheduler and decoder_layer (03b, 04b, 06b, 09b), else the guided track's parts (03 to 08) in the "
                "package's components — each defined in its notebook (none of the package's)",
                lambda: _yours(pieces()),
                "yours",
                hint="keep this notebook in the folder of your exercise notebooks; each must define its class "
                "or function itself",
            ),
            Check(
                f"SmolLM2, {len(capstone.PROMPTS)} chat prompts, {SMOLLM2_SETTINGS['num_blocks'] - 1} blocks of "
                f"{SMOLLM2_SETTINGS['block_size']}, budget {SMOLLM2_SETTINGS['max_num_batched_tokens']}: every "
                "token, step by step",
                lambda: _compare_outputs(run().outputs, capstone.reference_outputs(capstone.prompt_ids())),
                "token-exact",
                hint=lambda got: (
                    "engine_tiny passes but this fails: a piece of yours (a component on SmolLM2's shape, under "
                    "this pool, or a part) — its own exercise's checks say which"
                    if _tiny_passes(Engine)
                    else "engine_tiny fails too, with the package's components: fix your step loop first"
                ),
            ),
            Check(
                "and the run preempted, chunked prompts, admitted on prefix-cache hits, and gave every part work",
                worked,
                (True, True, True, ""),
                hint="the engine's settings reach the scheduler and the manager as given",
            ),
        ],
    )


# ---- the report card (not graded) --------------------------------------------------------------------------------
def report_card(Engine: EngineClass, pieces: YourPieces) -> types.SimpleNamespace:
    """Time the SmolLM2 workload on the learner's engine (on ``pieces``, from ``your_pieces``) and on the package's
    ``LLM`` (same settings, this process); print both and their ratio. Speed depends on the machine: this is a
    measurement, not a grade."""
    from ...engine.llm import LLM

    prompts = capstone.prompt_ids()
    t0 = time.perf_counter()
    with plug.use(check=False, **pieces.plugged):
        engine = Engine(smollm2(), pieces.components, **SMOLLM2_SETTINGS)
        mine = engine.generate(prompts, capstone.MAX_TOKENS)
    t_mine = time.perf_counter() - t0
    llm = LLM(dtype="float32", device="cpu", block_size=SMOLLM2_SETTINGS["block_size"],
              num_gpu_blocks_override=SMOLLM2_SETTINGS["num_blocks"],
              max_num_seqs=SMOLLM2_SETTINGS["max_num_seqs"],
              max_num_batched_tokens=SMOLLM2_SETTINGS["max_num_batched_tokens"],
              max_model_len=SMOLLM2_SETTINGS["max_model_len"], watermark=0.0)  # fmt: skip
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0))  # warm: its first step compiles
    t0 = time.perf_counter()
    theirs = llm.generate(prompts, SamplingParams(max_tokens=capstone.MAX_TOKENS, temperature=0))
    t_pkg = time.perf_counter() - t0
    llm.shutdown()
    tokens = sum(len(o) for o in mine)
    same = [list(o) for o in mine] == [list(o.outputs[0].token_ids) for o in theirs]
    print(f"your engine:     {tokens} tokens in {t_mine:.2f} s  ({tokens / t_mine:.1f} tok/s)")
    print(f"package's LLM:   {tokens} tokens in {t_pkg:.2f} s  ({tokens / t_pkg:.1f} tok/s)")
    print(f"ratio: {t_mine / t_pkg:.1f}x the package's time; same tokens: {same}")
    return types.SimpleNamespace(seconds=t_mine, package_seconds=t_pkg, tokens=tokens, same=same)
