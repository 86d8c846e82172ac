"""Tensor parallelism: the engine split over N processes gives the tokens of one process, and fails cleanly.

Every test here starts real worker processes (fresh interpreters) joined by gloo groups on 127.0.0.1,
on a tiny Llama with 8 query heads, 4 KV heads and a 97-token vocabulary (so the vocabulary's last slice is padded
at N = 2 and 4). SmolLM2 at N = 3 is checked against transformers in ``test_engine.py``.

Greedy tokens are compared exactly. The ranks sum their partial products in another order than one process does,
so a logit may move in its last bits; on these prompts no token moved (if one ever does, the failing test prints
both sequences: check whether the two top logits were all but tied there before suspecting a bug).
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import PREEMPTING_PROMPTS, small_engine

from minipaged.config import Config
from minipaged.distributed import Shape, check_tp_size, free_port
from minipaged.engine.llm import LLM
from minipaged.model_loader import save_tiny_llama
from minipaged.sampling_params import SamplingParams
from minipaged.worker.executor import TensorParallelError

# Every test here starts rank processes (and kills, interrupts or joins them): make test-slow. make test still
# serves SmolLM2 over three ranks in chapter 12's notebook.
pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# PREEMPTING_PROMPTS preempt in the small pool; two more share a 9-token prefix (two full blocks of 4) with the
# first, so prefix caching hits; the budget of 16 tokens a step chunks every prompt longer than that.
PROMPTS = [*PREEMPTING_PROMPTS, PREEMPTING_PROMPTS[0][:9] + [70, 71], PREEMPTING_PROMPTS[0][:9] + [80]]


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory) -> Path:
    return save_tiny_llama(
        tmp_path_factory.mktemp("tiny_tp"), num_attention_heads=8, num_key_value_heads=4, vocab_size=97
    )


def run(llm: LLM, prompts=PROMPTS, params=GREEDY) -> dict:
    """The tokens, and the events that prove the run went through preemption, prefix hits and chunked prefill."""
    outs = llm.generate(prompts, params)
    stats = list(llm.step_stats)
    return {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "preempted": sum(s["preempted"] for s in stats),
        "prefix_hits": llm.kv_cache_manager.prefix_cache_hits,
        "chunked": any(s["tokens"] == 16 for s in stats),
    }


@pytest.fixture(scope="module")
def reference(tp_model) -> dict:
    """One process: the tokens, and the K/V every block of every layer holds at the end."""
    llm = small_engine(tp_model)
    got = run(llm)
    got["kv"] = [llm.executor.kv_blocks(layer, list(range(llm.num_blocks)))[0] for layer in range(2)]
    return got


def gone(pids: list[int], within_s: float = 10.0) -> bool:
    """True once none of ``pids`` is a live process (a zombie counts as gone: it runs nothing)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def children() -> set[int]:
    """This process's live child processes (the workers are subprocesses, not multiprocessing's children)."""
    return {c.pid for c in psutil.Process().children(recursive=True) if _alive(c.pid)}


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


# ---- the same tokens ---------------------------------------------------------------------------------------
# Two ranks of two KV heads each here; one KV head per rank is test_engine's tensor_parallel_size=3 on SmolLM2 (against
# transformers), so four ranks on two cores (13 s) would add no case.
@pytest.mark.parametrize("size", [2])
def test_tp_gives_the_tokens_of_one_process(tp_model, reference, size) -> None:
    shm_before = shm_entries()
    llm = small_engine(tp_model, tensor_parallel_size=size)
    pids = llm.executor.pids
    assert len(pids) == size - 1 and all(_alive(p) for p in pids)
    got = run(llm)
    assert got["preempted"] > 0 and got["prefix_hits"] > 0 and got["chunked"]  # the paths under test ran
    assert got["tokens"] == reference["tokens"]
    # Each rank holds its own slice of the KV heads, in a pool of the same blocks: rank r's heads of block b are
    # heads [r·4/N, (r+1)·4/N) of block b in the one-process engine.
    ranks = llm.executor.ranks()
    assert [r["rank"] for r in ranks] == list(range(size))
    assert {r["num_kv_heads"] for r in ranks} == {4 // size} and {r["num_blocks"] for r in ranks} == {llm.num_blocks}
    assert len({r["pid"] for r in ranks}) == size
    for layer in range(2):
        shards = llm.executor.kv_blocks(layer, list(range(llm.num_blocks)))
        for i in range(2):  # K, then V
            joined = torch.cat([s[i] for s in shards], dim=2)  # [blocks, block_size, heads, head_dim]
            torch.testing.assert_close(joined, reference["kv"][layer][i], rtol=1e-5, atol=1e-5)
    llm.shutdown()
    assert gone(pids)
    assert shm_entries() <= shm_before  # no shared-memory segment left behind
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1, 2, 3]], GREEDY)


def test_tp_speculative_decoding_and_offloading_give_the_same_tokens(tp_model, reference) -> None:
    """Drafts verified by two ranks (one forward over the drafts' rows, rank 0 samples), and a CPU store of
    evicted prefix blocks on each rank: the tokens of one process without either."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    llm = small_engine(tp_model, tensor_parallel_size=2, speculative_config=spec, kv_offloading_size="1MiB")
    try:
        got = run(llm)
        assert got["tokens"] == reference["tokens"]
        assert llm.scheduler.spec_decoding_stats.num_drafts > 0
        assert llm.kv_cache_manager.connector.num_saved > 0
    finally:
        llm.shutdown()


def test_tp_a_hybrid_model_gives_the_tokens_of_one_process(tmp_path) -> None:
    """A Qwen2 with windowed layers over two ranks: each rank's two KV cache groups share its tensors, and the
    groups' block tables reach the worker with the step."""
    path = save_tiny_llama(
        tmp_path / "qwen2", model_type="qwen2", use_sliding_window=True, max_window_layers=2, num_hidden_layers=4,
        initializer_range=0.2, sliding_window=6,
    )  # fmt: skip
    prompts = [list(range(3, 20)), [5, 6, 7, 5, 6, 7, 8], list(range(30, 60))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    one = [o.outputs[0].token_ids for o in LLM(model=path, dtype="float32", block_size=4).generate(prompts, params)]
    llm = LLM(model=path, dtype="float32", block_size=4, tensor_parallel_size=2)
    try:
        assert len(llm.kv_cache_manager.kv_cache_groups) == 2
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == one
    finally:
        llm.shutdown()


def test_tp_swap_preemption_and_an_engine_nobody_holds(tp_model) -> None:
    """Swapping moves each rank's own slice of the blocks to its own CPU pool and back. Then the engine is
    dropped without ``shutdown()``: garbage collection ends its worker."""
    kw = dict(preemption_mode="swap", num_cpu_blocks_override=20)
    want = run(small_engine(tp_model, **kw))
    llm = small_engine(tp_model, tensor_parallel_size=2, **kw)
    pids = llm.executor.pids
    got = run(llm)
    assert got["preempted"] > 0 and got["tokens"] == want["tokens"]
    del llm
    gc.collect()
    assert gone(pids)


# ---- refused before anything starts -------------------------------------------------------------------------
def test_a_size_that_does_not_divide_the_heads_is_refused_before_any_process(tp_model) -> None:
    t0, before = time.perf_counter(), children()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide num_key_value_heads=4") as e:
        LLM(model=tp_model, tensor_parallel_size=3)
    assert "Sizes that work for this model: 1, 2, 4" in str(e.value)
    assert children() <= before and time.perf_counter() - t0 < 5


def test_smollm2_splits_over_1_or_3_ranks() -> None:
    from minipaged.model_loader import ensure_converted

    path, before = ensure_converted(), children()
    assert Shape.of(path).sizes_that_work(9) == [1, 3] and check_tp_size(path, 3).num_key_value_heads == 3
    with pytest.raises(ValueError) as e:
        LLM(tensor_parallel_size=2)
    assert "num_key_value_heads=3 and num_attention_heads=9" in str(e.value) and "work for this model: 1, 3" in str(
        e.value
    )
    assert children() <= before


@pytest.mark.parametrize(
    "knobs, words",
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive integer"),
        ({"tensor_parallel_size": 3, "nnodes": 2}, "nnodes=2 must divide tensor_parallel_size=3"),
        ({"master_port": 70000}, "master_port must be an integer from 1 to 65535"),
        ({"master_addr": ""}, "master_addr must be a host name"),
        ({"distributed_timeout_s": 0}, "distributed_timeout_s must be a positive number"),
    ],
)
def test_distributed_knobs_are_checked(knobs, words) -> None:
    with pytest.raises(ValueError, match=words):
        Config(None, **knobs)


# ---- faults ------------------------------------------------------------------------------------------------
def test_a_killed_worker_fails_the_step_within_seconds_and_ends_every_rank(tp_model, reference) -> None:
    shm_before = shm_entries()
    llm = small_engine(tp_model, tensor_parallel_size=4)
    pids = llm.executor.pids
    for p in PROMPTS:
        llm.add_request(p, GREEDY)
    for _ in range(3):
        llm.step()
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.perf_counter()
    with pytest.raises(TensorParallelError, match=rf"rank 2 \(pid {pids[1]}\) was killed by SIGKILL") as e:
        for _ in range(100):
            llm.step()
    assert time.perf_counter() - t0 < 30 and "build a new LLM" in str(e.value)
    assert gone(pids) and shm_entries() <= shm_before
    with pytest.raises(TensorParallelError, match="ranks are gone"):
        llm.step()
    # The same session builds a new engine, which gives the same tokens.
    again = small_engine(tp_model, tensor_parallel_size=2)
    assert run(again)["tokens"] == reference["tokens"]
    again.shutdown()


def test_an_interrupted_step_ends_every_rank(tp_model, monkeypatch) -> None:
    """Ctrl-C that lands inside a step: the workers sit mid-collective, waiting for a rank 0 that will not come.
    Every rank is ended, the KeyboardInterrupt reaches the caller, and this call's requests are gone."""
    llm = small_engine(tp_model, tensor_parallel_size=2)
    pids = llm.executor.pids
    forward, calls = llm.executor.runner.forward_step, []

    def interrupted(out):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return forward(out)

    monkeypatch.setattr(llm.executor.runner, "forward_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY)
    assert gone(pids) and not llm._requests
    with pytest.raises(TensorParallelError, match=r"interrupted \(Ctrl-C\) in the caller"):
        llm.generate([[1, 2]], GREEDY)


def test_ctrl_c_in_a_script_leaves_no_process(tp_model, tmp_path) -> None:
    """A real SIGINT to a script serving with two ranks: the script ends, and so does its worker."""
    script = tmp_path / "serve.py"
    script.write_text(
        textwrap.dedent(f"""
        import signal
        from minipaged import LLM, SamplingParams
        if __name__ == "__main__":
            # Python's own Ctrl-C handler, as in a terminal (a shell that started pytest in the background
            # hands its children SIGINT ignored)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            llm = LLM(model={str(tp_model)!r}, tensor_parallel_size=2, block_size=4, max_model_len=64)
            print("pids", *llm.executor.pids, flush=True)
            params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
            while True:
                llm.generate([[1, 2, 3]] * 8, params)
        """)
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("pids"), proc.stderr.read()
        pids = [int(p) for p in line.split()[1:]]
        time.sleep(0.5)  # generating
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
        assert gone(pids)
    finally:
        proc.kill()
        proc.wait()


# ---- two machines -------------------------------------------------------------------------------------------
def test_two_machines_through_torch_rendezvous(tp_model, reference) -> None:
    """Two groups of processes on 127.0.0.1 stand for two machines: this one runs rank 0 (the engine) and rank 1;
    the other, started by hand with ``python -m minipaged worker``, runs ranks 2 and 3 — it learns the model and
    the knobs from the engine's rendezvous store (MASTER_ADDR:MASTER_PORT)."""
    port = free_port()
    node = subprocess.Popen(
        [sys.executable, "-m", "minipaged", "worker", "--master-addr", "127.0.0.1", "--master-port", str(port),
         "--node-rank", "1", "--timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        llm = small_engine(tp_model, tensor_parallel_size=4, nnodes=2, master_addr="127.0.0.1", master_port=port)
        assert len(llm.executor.pids) == 1  # rank 1 here; ranks 2 and 3 on the other "machine"
        ranks = llm.executor.ranks()
        assert [r["rank"] for r in ranks] == [0, 1, 2, 3] and {r["num_kv_heads"] for r in ranks} == {1}
        assert run(llm)["tokens"] == reference["tokens"]
        llm.shutdown()
        out, _ = node.communicate(timeout=30)
        assert node.returncode == 0 and "clean shutdown" in out, out
    finally:
        node.kill()
        node.wait()
