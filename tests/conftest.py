"""Shared test set-up (keep it small)."""

# Triton reads TRITON_INTERPRET when a @triton.jit function is defined, and triton.language defines its own
# helpers (tl.zeros, tl.sum, ...) when triton is first imported: the variable must be set before any test module
# imports triton. minipaged.kernels sets it on import when there is no CUDA GPU, so import it first.
import pytest
import torch  # noqa: F401

import minipaged.kernels  # noqa: F401
from minipaged.model_loader import save_tiny_llama


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny random Llama saved as a model folder (no tokenizer: prompts are token ids), for fast engine tests."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"))
