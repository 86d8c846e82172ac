"""Where ``Config`` puts an engine when it is left to choose (issue 41): a tensor-parallel split that needs more
GPUs than the machine has runs on the CPU over gloo, as the course's tensor-parallel cells do on a one-GPU
notebook; asked for CUDA by name, it is refused with the count. Checked with the GPU count faked."""

from __future__ import annotations

import logging

import pytest
import torch

from minipaged.config import Config


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_a_split_over_more_gpus_than_there_are_falls_back_to_the_cpu(one_gpu, caplog):
    with caplog.at_level(logging.WARNING, logger="minipaged"):
        config = Config(tensor_parallel_size=3)
    assert config.torch_device == torch.device("cpu")
    assert "torch sees 1 GPU(s): the ranks run on the CPU over gloo" in caplog.text


def test_one_rank_stays_on_the_gpu_and_cuda_by_name_is_refused(one_gpu, caplog):
    with caplog.at_level(logging.WARNING, logger="minipaged"):
        assert Config().torch_device == torch.device("cuda")
    assert caplog.text == ""
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 puts 3 rank\(s\).*sees 1 GPU\(s\)"):
        Config(tensor_parallel_size=3, device="cuda")


def test_without_a_gpu_nothing_changes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert Config(tensor_parallel_size=3).torch_device == torch.device("cpu")
