"""``dtype="auto"`` on a GPU: bfloat16 only where the GPU computes it (compute capability 8.0 and up).

A T4 (sm_75) answers ``torch.cuda.is_bf16_supported()`` True by emulation; serving bf16 there is slow, so "auto"
picks float16. The capability is faked here.
"""

from __future__ import annotations

import logging

import pytest
import torch

from minipaged.config import cuda_computes_bf16, resolve_dtype

CUDA = torch.device("cuda")


def _gpu(monkeypatch, capability: tuple[int, int]) -> None:
    """Pretend to be a CUDA GPU of ``capability``, whose torch answers bf16 support as a real one does (emulation
    counts: True everywhere; without it: from sm_80)."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation or capability >= (8, 0)
    )


def test_a_t4_gets_float16(monkeypatch) -> None:
    _gpu(monkeypatch, (7, 5))
    assert torch.cuda.is_bf16_supported()  # what misled "auto" before: emulation counts as support
    assert not cuda_computes_bf16(CUDA)
    for config_dtype in ("float32", "bfloat16", "float16", None):
        assert resolve_dtype("auto", config_dtype, CUDA) == torch.float16, config_dtype


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (9, 0)])
def test_ampere_and_later_get_bfloat16(monkeypatch, capability) -> None:
    _gpu(monkeypatch, capability)
    assert cuda_computes_bf16(CUDA)
    assert resolve_dtype("auto", "float32", CUDA) == torch.bfloat16
    assert resolve_dtype("auto", "bfloat16", CUDA) == torch.bfloat16
    assert resolve_dtype("auto", None, CUDA) == torch.bfloat16
    assert resolve_dtype("auto", "float16", CUDA) == torch.float16  # the model's own dtype
    assert resolve_dtype("auto", "float32", torch.device("cpu")) == torch.float32


def test_asking_for_bfloat16_on_a_t4_is_honoured_with_a_warning(monkeypatch, caplog) -> None:
    _gpu(monkeypatch, (7, 5))
    with caplog.at_level(logging.WARNING, logger="minipaged"):
        assert resolve_dtype("bfloat16", "float32", CUDA) == torch.bfloat16
    assert "compute capability 8.0" in caplog.text
    caplog.clear()
    _gpu(monkeypatch, (9, 0))
    with caplog.at_level(logging.WARNING, logger="minipaged"):
        assert resolve_dtype("bfloat16", "float32", CUDA) == torch.bfloat16
    assert caplog.text == ""


def test_rocm_computes_bfloat16(monkeypatch) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.0")
    assert cuda_computes_bf16(CUDA)
