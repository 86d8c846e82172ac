"""Shared test set-up (keep it small)."""

# Triton reads TRITON_INTERPRET when a @triton.jit function is defined, and triton.language defines its own
# helpers (tl.zeros, tl.sum, ...) when triton is first imported: the variable must be set before any test module
# imports triton. minipaged.kernels sets it on import when there is no CUDA GPU, so import it first.
import pytest
import torch  # noqa: F401

import minipaged.kernels  # noqa: F401
from minipaged.model_loader import save_tiny_llama

# Token-id prompts too many for small_engine's pool: serving them chunks prompts, preempts and hits the prefix cache.
PREEMPTING_PROMPTS = [
    [5, 17, 3, 9, 40, 2, 8, 61, 33, 12, 7, 1, 90, 4, 4, 22, 13, 50, 5, 17],
    [7, 7, 30],
    [5, 17, 3, 9, 40, 2],
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27],
    [3],
]


def small_engine(tiny_model, **kw):
    """The tiny model with a small pool and budget (13 usable blocks of 4, 16 tokens a step), prefix caching on."""
    from minipaged.engine.llm import LLM

    args = dict(
        model=tiny_model,
        block_size=4,
        num_gpu_blocks_override=14,
        max_model_len=48,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
    )
    args.update(kw)
    return LLM(**args)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny random Llama saved as a model folder (no tokenizer: prompts are token ids), for fast engine tests."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"))


# ---- the order files run in --------------------------------------------------------------------------------------
# `make test` hands whole files to two processes (--dist loadfile) in collection order, the next file to whichever
# finishes first. Collected as found, the slowest files (the capstone's and the open policy's solutions) come last
# and one process runs them alone while the other sits idle. Longest first evens the two out: tests/durations.json
# holds each file's measured seconds (`make durations` measures them again); a file it does not know goes first.
_DURATIONS = __import__("pathlib").Path(__file__).with_name("durations.json")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    import json

    from minipaged.model_loader import weights_are_random

    if weights_are_random():  # a GPU lease's stand-in model: the work is the real model's, the words are not
        why = pytest.mark.skip(reason="the cached model holds random SmolLM2-shaped weights: no real text to check")
        for item in items:
            if item.get_closest_marker("real_weights"):
                item.add_marker(why)
    known: dict[str, float] = json.loads(_DURATIONS.read_text()) if _DURATIONS.exists() else {}
    files = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], len(files))
    items.sort(
        key=lambda item: (-known.get(item.nodeid.split("::")[0], float("inf")), files[item.nodeid.split("::")[0]])
    )
