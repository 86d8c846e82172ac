"""What an engine gives back (issue 41): ``LLM.shutdown()`` and dropping the last reference free the weights,
the KV pool, the input buffers and the CUDA graphs; a later call names the shutdown; a second engine that does
not fit on a GPU names the engine holding the card. The weakref checks run everywhere; the memory figures on a
CUDA machine (``make gpu-check`` runs this file there)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
from conftest import small_engine

from minipaged import LLM, SamplingParams
from minipaged.worker import executor, gpu_memory
from minipaged.worker.gpu_memory import GPUMemoryError

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU memory figures need a CUDA GPU")
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def served(tiny_model, **kw) -> tuple[LLM, dict[str, weakref.ref]]:
    llm = small_engine(tiny_model, **kw)
    llm.generate([[5, 17, 3, 9, 40], [7, 7, 30]], GREEDY)
    refs = {
        "llm": weakref.ref(llm),
        "weights": weakref.ref(next(llm.model.parameters())),
        "K of layer 0": weakref.ref(llm.cache.gpu_cache[0][0]),
        "input buffer": weakref.ref(llm.executor.runner.buffers.input_ids),
    }
    return llm, refs


def alive(refs: dict[str, weakref.ref]) -> list[str]:
    return [name for name, r in refs.items() if r() is not None]


def test_dropping_the_last_reference_frees_everything_without_the_cycle_collector(tiny_model):
    llm, refs = served(tiny_model, device="cpu")
    gc.disable()  # a reference cycle would keep it all until the next collection
    try:
        del llm
        assert alive(refs) == []
    finally:
        gc.enable()


def test_shutdown_frees_the_tensors_while_the_engine_is_still_referenced(tiny_model):
    llm, refs = served(tiny_model, device="cpu")
    kept = [llm]  # a notebook's output history, say
    llm.shutdown()
    llm.shutdown()  # twice is fine
    assert alive(refs) == ["llm"] and kept[0] is llm
    assert "KV pool: 13 blocks" in llm.describe()  # what it was stays readable
    for call in (lambda: llm.generate([[1, 2]], GREEDY), lambda: llm.step(), lambda: llm.model, lambda: llm.cache):
        with pytest.raises(RuntimeError, match=r"shut down \(llm.shutdown\(\)\).*build a new LLM"):
            call()
    assert llm.executor.runner not in gpu_memory._LIVE


def test_an_engine_in_a_reference_cycle_is_freed_by_the_collector(tiny_model):
    llm, refs = served(tiny_model, device="cpu")
    llm.cycle = llm  # type: ignore[attr-defined]
    del llm
    gc.collect()
    assert alive(refs) == []


def test_the_memory_report_names_the_engine_holding_the_device(tiny_model, monkeypatch):
    llm, _ = served(tiny_model, device="cpu")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, 80 << 30))
    text = gpu_memory.gpu_memory_report(torch.device("cpu"), need=70 << 30)
    assert text.splitlines()[0] == "cpu has 1.00 GiB free of 80.00 GiB, and this engine needs 70.00 GiB"
    assert "held by the engine built at " + str(Path(__file__).with_name("conftest.py")) + ":" in text  # who built it
    assert "KV pool 28.00 KiB (14 blocks), weights 289.25 KiB" in text and "llm.shutdown()" in text
    held = text.count("held by")  # this engine, and any other test's still alive in this process
    llm.shutdown()
    assert gpu_memory.gpu_memory_report(torch.device("cpu")).count("held by") == held - 1
    monkeypatch.setattr(gpu_memory, "_LIVE", weakref.WeakSet())
    text = gpu_memory.gpu_memory_report(torch.device("cpu"))
    assert "held by" not in text and "another process" in text


def test_building_retries_once_after_freeing_then_names_the_holders(monkeypatch):
    freed: list[str] = []
    monkeypatch.setattr(executor, "free_device_memory", lambda device: freed.append(str(device)))
    monkeypatch.setattr(executor, "gpu_memory_report", lambda device: f"{device} has 0 B free")
    attempts = []

    def build() -> str:
        attempts.append(1)
        if len(attempts) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return "built"

    assert executor.build_on_device(build, torch.device("cuda")) == "built" and freed == ["cuda"]

    def never() -> str:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(GPUMemoryError, match=r"ran out of GPU memory \(CUDA out of memory.*\n.*cuda has 0 B free"):
        executor.build_on_device(never, torch.device("cuda"))
    assert executor.build_on_device(lambda: "cpu", torch.device("cpu")) == "cpu"  # no retry logic on a CPU


def device_used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


@needs_cuda
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_three_engines_built_and_dropped_end_where_they_started(tiny_model, enforce_eager):
    """Build, serve, drop, three times: the allocator's count and the driver's used memory come back to the
    start (within 1 %). A first round runs before the start is read: it loads the kernels' code into the CUDA
    context, which stays, as it would for any program that ran them once."""

    def one_round(shutdown: bool) -> None:
        llm = LLM(str(tiny_model), device="cuda", kv_cache_memory="1GiB", max_num_seqs=8, enforce_eager=enforce_eager)
        llm.generate([[5, 17, 3, 9, 40]] * 8, GREEDY)
        if shutdown:
            llm.shutdown()
        del llm

    one_round(shutdown=True)
    gpu_memory.free_device_memory(torch.device("cuda"))
    allocated, used = torch.cuda.memory_allocated(), device_used()
    for i in range(3):
        one_round(shutdown=i % 2 == 0)  # shut down, dropped, shut down
        gpu_memory.free_device_memory(torch.device("cuda"))
        assert torch.cuda.memory_allocated() <= allocated * 1.01 + (1 << 20), f"round {i}"
        assert device_used() <= used * 1.01, f"round {i}: {device_used() - used:,} bytes more in use"


@needs_cuda
def test_a_second_default_engine_names_the_first(tiny_model):
    first = LLM(str(tiny_model), device="cuda", gpu_memory_utilization=0.6)
    try:
        with pytest.raises(GPUMemoryError, match=r"(?s)not free.*held by the engine built at .*test_engine_memory"):
            LLM(str(tiny_model), device="cuda", gpu_memory_utilization=0.6)
    finally:
        first.shutdown()
    LLM(str(tiny_model), device="cuda", gpu_memory_utilization=0.6).shutdown()  # fits once the first is gone
