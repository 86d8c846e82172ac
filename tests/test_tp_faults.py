"""Tensor parallelism's faults, phase by phase: workers that a plain script could not start, a worker killed
before it joins, one stopped (SIGSTOP) mid-step or before shutdown, a rendezvous port that cannot be served.

Every wait is bounded twice: the engine's own ``distributed_timeout_s``, and the test's (a subprocess timeout, or
the time asserted), so that a regression fails here instead of hanging the suite. Each engine here starts real
worker processes; keep the list short.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import small_engine

from minipaged.engine.llm import LLM
from minipaged.model_loader import save_tiny_llama
from minipaged.sampling_params import SamplingParams
from minipaged.worker.executor import TensorParallelError

pytestmark = pytest.mark.slow  # processes killed, interrupted and restarted: make test-slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model3(tmp_path_factory) -> Path:
    """A tiny Llama that splits three ways: 6 query heads, 3 KV heads, an MLP of 96, a vocabulary of 96."""
    return save_tiny_llama(
        tmp_path_factory.mktemp("tiny_tp3"), num_attention_heads=6, num_key_value_heads=3, hidden_size=48
    )


def children() -> set[int]:
    """This process's live child processes (a zombie has run its course)."""
    out = set()
    for c in psutil.Process().children(recursive=True):
        try:
            if c.status() != psutil.STATUS_ZOMBIE:
                out.add(c.pid)
        except psutil.Error:
            pass
    return out


def gone(pids: list[int], within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.1)
    return False


# ---- start-up ---------------------------------------------------------------------------------------------
SERVE = """
from minipaged import LLM, SamplingParams

llm = LLM(model={model!r}, block_size=4, max_model_len=32, tensor_parallel_size=2, distributed_timeout_s=20)
out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
llm.shutdown()
print("tokens", len(out[0].outputs[0].token_ids), flush=True)
"""


def test_a_script_piped_to_python_serves_with_two_ranks(tiny_model) -> None:
    """multiprocessing's spawn re-runs the caller's script in every worker: a script read from stdin is no file
    (the workers died with FileNotFoundError: '<stdin>' and the engine waited for them for good). Workers that
    import only minipaged start from any script (the next test's has no ``__main__`` guard either)."""
    done = subprocess.run(
        [sys.executable, "-"], input=SERVE.format(model=str(tiny_model)), capture_output=True, text=True, timeout=90
    )
    assert done.returncode == 0 and "tokens 4" in done.stdout, done.stdout + done.stderr[-3000:]


KILL_FIRST_WORKER = """
import os, threading, time
import psutil
from minipaged import LLM

with open({marker!r}, "a") as f:  # spawn would run this in every worker too: the script has no __main__ guard
    f.write(f"{{os.getpid()}}\\n")


def kill_the_first_worker():
    while True:
        for child in psutil.Process().children():
            try:
                line = " ".join(child.cmdline())
            except psutil.Error:
                continue
            if "minipaged-tp-rank" in line or "spawn_main" in line:  # this engine's worker, or spawn's
                child.kill()
                print("killed", child.pid, flush=True)
                return
        time.sleep(0.02)


threading.Thread(target=kill_the_first_worker, daemon=True).start()
t0 = time.monotonic()
try:
    LLM(model={model!r}, block_size=4, max_model_len=32, tensor_parallel_size=3, distributed_timeout_s=30)
except Exception as e:
    print(f"{{type(e).__name__}} after {{time.monotonic() - t0:.1f}} s: {{e}}", flush=True)
left = [c.pid for c in psutil.Process().children() if c.status() != psutil.STATUS_ZOMBIE]
print("left", left, flush=True)
"""


def test_a_worker_killed_before_it_joins_is_named_at_once(model3, tmp_path) -> None:
    """Killed as soon as it is started: the engine says which rank and how within seconds, not after
    distributed_timeout_s (30 s here) nor never (a wait group joined without a timeout), and leaves no process.
    The script has no ``__main__`` guard: it runs once, in the caller's process only."""
    marker = tmp_path / "runs.txt"
    (tmp_path / "killed.py").write_text(KILL_FIRST_WORKER.format(model=str(model3), marker=str(marker)))
    done = subprocess.run([sys.executable, str(tmp_path / "killed.py")], capture_output=True, text=True, timeout=90)
    out = done.stdout
    killed = re.search(r"killed (\d+)", out)
    assert killed, out + done.stderr[-3000:]
    failed = re.search(r"TensorParallelError after ([\d.]+) s: (.*)", out)
    assert failed and float(failed[1]) < 10, out
    assert re.search(rf"start-up: rank \d \(pid {killed[1]}\) was killed by SIGKILL", failed[2]), out
    assert "left []" in out, out
    assert len(marker.read_text().splitlines()) == 1


# ---- a stopped worker -------------------------------------------------------------------------------------------
def test_a_stopped_worker_is_named_not_the_rank_that_gave_up_waiting_for_it(model3) -> None:
    """Rank 1 stopped mid-run: rank 2 times out waiting for it as rank 0 does, and exits. The error names rank 1
    as stopped, first; every rank is ended (a stopped process is killed, not left stopped)."""
    llm = small_engine(model3, tensor_parallel_size=3, distributed_timeout_s=2)
    pids = llm.executor.pids
    llm.add_request([5, 17, 3, 9], GREEDY)
    llm.step()
    os.kill(pids[0], signal.SIGSTOP)
    t0 = time.perf_counter()
    try:
        with pytest.raises(TensorParallelError) as e:
            for _ in range(100):
                llm.step()
        assert time.perf_counter() - t0 < 15
        assert re.search(rf"during a step: rank 1 \(pid {pids[0]}\) is stopped", str(e.value)), str(e.value)
        assert gone(pids)
    finally:
        for pid in pids:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)


def test_shutdown_does_not_wait_for_a_stopped_worker(tiny_model) -> None:
    """The "stop" message would wait distributed_timeout_s (30 s here) for a stopped worker to take it."""
    llm = small_engine(tiny_model, tensor_parallel_size=2, distributed_timeout_s=30)
    pids = llm.executor.pids
    os.kill(pids[0], signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 5
        while psutil.Process(pids[0]).status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
            time.sleep(0.05)  # a signal lands when its process is next scheduled
        t0 = time.perf_counter()
        llm.shutdown()
        assert time.perf_counter() - t0 < 5 and gone(pids)
    finally:
        if psutil.pid_exists(pids[0]):
            os.kill(pids[0], signal.SIGKILL)


# ---- the rendezvous -------------------------------------------------------------------------------------------
def test_a_master_port_in_use_or_a_bad_master_variable_is_named(tiny_model, monkeypatch) -> None:
    before = children()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.perf_counter()
        with pytest.raises(TensorParallelError, match=rf"master_port={port} .*pick another master_port"):
            LLM(model=tiny_model, tensor_parallel_size=2, master_port=port)
        assert time.perf_counter() - t0 < 10
    monkeypatch.setenv("MASTER_PORT", "http")
    with pytest.raises(ValueError, match=r"\$MASTER_PORT='http' is not a port"):
        LLM(model=tiny_model, tensor_parallel_size=2)
    monkeypatch.delenv("MASTER_PORT")
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.1")  # TEST-NET-1: no machine's own address
    with pytest.raises(ValueError, match=r"\$MASTER_ADDR='192.0.2.1' is not an address of this machine"):
        LLM(model=tiny_model, tensor_parallel_size=2)
    assert children() <= before
