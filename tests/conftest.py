"""Shared test set-up (keep it small)."""
# Triton reads TRITON_INTERPRET when a @triton.jit function is defined, and triton.language defines its own
# helpers (tl.zeros, tl.sum, ...) when triton is first imported: the variable must be set before any test module
# imports triton. minipaged.kernels sets it on import when there is no CUDA GPU, so import it first.
import minipaged.kernels  # noqa: F401
