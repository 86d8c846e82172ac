"""The engine benchmark's own helpers (``benchmarks/``): the busy core it runs engines beside, and how it names a
step's kind. The benchmark itself runs by hand; these are the parts whose mistakes would skew what it reports."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_engine
import common


def _user_ticks(pid: int) -> int:
    """``utime`` from ``/proc/PID/stat``, in clock ticks (the 14th field; the name in parentheses may hold spaces)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[11])


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux's")
def test_busy_core_is_a_lowest_priority_loop_on_the_last_cpu_that_ends_with_the_block():
    with common.busy_core() as busy:
        pid = busy["pid"]
        time.sleep(0.3)
        assert os.getpriority(os.PRIO_PROCESS, pid) == 19
        assert os.sched_getaffinity(pid) == {max(os.sched_getaffinity(0))} == {busy["cpu"]}
        # It spins: its user time grows. At nice 19 beside busy test workers it gets ~1.5 % of its CPU, so a
        # clock tick (10 ms) of user time can take a second or more to show; wait for it, bounded.
        deadline = time.monotonic() + 30
        while _user_ticks(pid) == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _user_ticks(pid) > 0
    assert not Path(f"/proc/{pid}").exists()  # killed and reaped


def test_busy_core_off_runs_nothing():
    with common.busy_core(False) as busy:
        assert busy is None


def _out(*rows: tuple[int, int]) -> SimpleNamespace:
    return SimpleNamespace(scheduled=[SimpleNamespace(start=s, num_prompt_tokens=p) for s, p in rows])


@pytest.mark.parametrize(
    ("rows", "kind"),
    [
        (((0, 40), (16, 40)), "prefill"),  # a prompt's first chunk and its second
        (((40, 40), (57, 12)), "decode"),  # the first token after the prompt counts as a decode
        (((40, 40), (16, 300)), "mixed"),  # chunked prefill beside a decode
    ],
)
def test_step_kind(rows, kind):
    assert bench_engine.step_kind(_out(*rows)) == kind
