"""The CPU engine's thread count (``worker/cpu_threads.py``): the spin setting on import, the neighbour watch that
gives a core up and takes it back, the fixed setting, and the one-thread path against the many-thread one."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import minipaged
from minipaged.worker import cpu_threads
from minipaged.worker.cpu_threads import DOWN, UP, WINDOW_S, CpuThreads, others_busy
from tests.conftest import small_engine


@pytest.fixture(autouse=True)
def keep_thread_count():
    found = torch.get_num_threads()
    yield
    torch.set_num_threads(found)


def _stat(path: Path, rows: dict[int, tuple[int, ...]]) -> Path:
    """A /proc/stat with the given per-CPU columns (user nice system idle iowait irq softirq steal)."""
    total = [sum(col) for col in zip(*rows.values(), strict=True)]
    lines = ["cpu  " + " ".join(map(str, total))]
    lines += [f"cpu{c} " + " ".join(map(str, cols)) for c, cols in sorted(rows.items())]
    path.write_text("\n".join(lines + ["intr 0", ""]))
    return path


def test_others_busy_counts_user_system_interrupts_of_our_cpus_less_our_own_time(tmp_path, monkeypatch):
    hz = os.sysconf("SC_CLK_TCK")
    stat = _stat(
        tmp_path / "stat",
        {
            0: (100 * hz, 7 * hz, 10 * hz, 999, 5, 1 * hz, 2 * hz, 50 * hz),  # nice, idle, iowait, steal: not counted
            1: (20 * hz, 0, 0, 0, 0, 0, 0, 0),
            2: (500 * hz, 0, 0, 0, 0, 0, 0, 0),  # not one of ours
        },
    )
    monkeypatch.setattr(cpu_threads.os, "times", lambda: os.times_result((30.0, 3.0, 0.0, 0.0, 0.0)))
    assert others_busy({0, 1}, stat) == pytest.approx(100 + 10 + 1 + 2 + 20 - 33)
    assert others_busy({0}, stat) == pytest.approx(113 - 33)


def test_others_busy_is_none_without_a_readable_stat(tmp_path):
    assert others_busy({0}, tmp_path / "missing") is None
    assert others_busy({7}, _stat(tmp_path / "stat", {0: (1, 0, 0, 0, 0, 0, 0, 0)})) is None  # no line for cpu7


class _Clock:
    """``others_busy`` and ``time.perf_counter`` as a script: each window, how many cores the others held."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now, self.busy = 1000.0, 0.0
        monkeypatch.setattr(cpu_threads, "others_busy", lambda cpus: self.busy)
        monkeypatch.setattr(cpu_threads.time, "perf_counter", lambda: self.now)

    def window(self, threads: CpuThreads, cores_held: float, seconds: float = WINDOW_S) -> int:
        self.now += seconds
        self.busy += cores_held * seconds
        threads.after_step()
        return threads.threads


def test_auto_gives_a_core_up_to_a_neighbour_and_takes_it_back(monkeypatch):
    torch.set_num_threads(2)
    clock = _Clock(monkeypatch)
    threads = CpuThreads("auto")
    assert threads.watching and threads.threads == 2
    assert clock.window(threads, 0.05) == 2  # a browser's few percent: nothing changes
    assert clock.window(threads, DOWN + 0.05) == 1  # the fight: half a core each
    assert torch.get_num_threads() == 1 and threads.drops == 1
    assert clock.window(threads, 1.0) == 1  # the neighbour now has the core we left it: stay
    assert clock.window(threads, 1.0 - UP + 0.05) == 1  # it uses a little less: not enough to come back
    assert clock.window(threads, 0.1) == 2  # it left
    assert torch.get_num_threads() == 2
    assert "2 of 2 threads" in threads.describe() and "1 drops" in threads.describe()


def test_auto_decides_nothing_inside_a_window_or_over_an_idle_stretch(monkeypatch):
    torch.set_num_threads(2)
    clock = _Clock(monkeypatch)
    threads = CpuThreads("auto")
    assert clock.window(threads, 1.0, seconds=WINDOW_S / 4) == 2  # too short a window to judge
    assert clock.window(threads, 1.0, seconds=10 * WINDOW_S) == 2  # the engine sat idle while others ran
    assert clock.window(threads, 1.0) == 1  # steps beside a busy neighbour again


def test_a_fixed_count_is_set_and_never_watched(monkeypatch):
    clock = _Clock(monkeypatch)
    threads = CpuThreads(1)
    assert torch.get_num_threads() == 1 and not threads.watching
    torch.set_num_threads(2)
    threads = CpuThreads(2)
    assert clock.window(threads, 1.0) == 2
    assert threads.describe() == "2 threads (cpu_threads=2)"


def test_auto_without_proc_stat_keeps_pytorchs_count(monkeypatch):
    torch.set_num_threads(2)
    monkeypatch.setattr(cpu_threads, "others_busy", lambda cpus: None)
    threads = CpuThreads("auto")
    assert not threads.watching and threads.threads == 2 and "nothing watched" in threads.describe()


def test_release_gives_the_process_its_thread_count_back(monkeypatch):
    torch.set_num_threads(2)
    clock = _Clock(monkeypatch)
    threads = CpuThreads("auto")
    clock.window(threads, 1.0)
    assert torch.get_num_threads() == 1
    threads.release()
    assert torch.get_num_threads() == 2 and not threads.watching


def test_torch_imported_first_is_said_once(monkeypatch, caplog):
    monkeypatch.setattr(minipaged, "_SPIN_AFTER_TORCH", True)
    monkeypatch.setattr(cpu_threads, "_SAID", [])
    with caplog.at_level(logging.INFO, logger="minipaged"):
        CpuThreads(1)
        CpuThreads(1)
    said = [r.getMessage() for r in caplog.records if "imported before minipaged" in r.getMessage()]
    assert len(said) == 1 and "GOMP_SPINCOUNT=1000000" in said[0]


@pytest.mark.parametrize(
    ("env", "first", "spin", "after_torch"),
    [
        ({}, "minipaged", "1000000", False),
        ({}, "torch", "1000000", True),  # set, but too late for the runtime: the engine says so
        ({"OMP_WAIT_POLICY": "PASSIVE"}, "minipaged", None, False),  # the user's choice stands
        ({"GOMP_SPINCOUNT": "5"}, "minipaged", "5", False),
    ],
)
def test_import_sets_the_spin_only_when_nobody_chose(env, first, spin, after_torch):
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = f"import {first}, os, minipaged; print(os.environ.get('GOMP_SPINCOUNT'), minipaged._SPIN_AFTER_TORCH)"
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(spin), str(after_torch)]


@pytest.mark.parametrize("bad", ["many", 0, -1, 1.5, True, None])
def test_cpu_threads_refuses_what_is_not_auto_or_a_count(bad):
    from minipaged.config import Config

    with pytest.raises(ValueError, match=r'cpu_threads must be "auto" or a positive integer'):
        Config(cpu_threads=bad, device="cpu")


def test_one_thread_and_two_threads_give_the_same_greedy_tokens(tiny_model):
    """The path a fight moves the engine to, against the one it leaves: the same tokens, step for step."""
    from minipaged import SamplingParams

    prompts = [[5, 17, 3, 9, 40, 2, 8, 61], [7, 7, 30], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = {}
    for n in (1, 2):
        llm = small_engine(tiny_model, device="cpu", dtype="float32", cpu_threads=n, num_gpu_blocks_override=40)
        assert torch.get_num_threads() == n
        outs[n] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    assert outs[1] == outs[2] and all(len(t) == 12 for t in outs[1])


@pytest.mark.parametrize(
    ("argv", "env", "want"),
    [
        (["serve"], {}, "None PASSIVE"),  # the server's event loop needs a core between steps
        (["generate"], {}, "1000000 None"),
        (["serve"], {"GOMP_SPINCOUNT": "7"}, "7 None"),  # the user's choice stands
    ],
)
def test_serve_keeps_the_threads_sleeping(argv, env, want):
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = (
        "import os, minipaged.__main__ as m; "
        f"m.server_threads_sleep({argv!r}); "
        "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))"
    )
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == want


ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(
    [*ROOT.glob("notebooks/*.ipynb"), *ROOT.glob("exercises/*.ipynb"), *ROOT.glob("exercises/solutions/*.ipynb")]
)


def first_import(nb_path: Path) -> str | None:
    """``minipaged`` or ``torch`` (transformers loads torch too), whichever a notebook's code imports first."""
    import json
    import re

    pattern = re.compile(r"^\s*(?:import|from)\s+(minipaged|torch|transformers)\b")
    for cell in json.loads(nb_path.read_text())["cells"]:
        if cell["cell_type"] == "code":
            for line in "".join(cell["source"]).splitlines():
                if m := pattern.match(line):
                    return "minipaged" if m.group(1) == "minipaged" else "torch"
    return None


@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_notebook_imports_minipaged_before_torch(nb_path):
    """After torch, ``import minipaged`` is too late to set how the threads wait: a learner's engine runs slower."""
    assert first_import(nb_path) in ("minipaged", None)


def test_the_import_order_check_sees_torch_first(tmp_path):
    import json

    nb = {"cells": [{"cell_type": "code", "source": ["import math\n", "import torch\n", "import minipaged\n"]}]}
    (tmp_path / "nb.ipynb").write_text(json.dumps(nb))
    assert first_import(tmp_path / "nb.ipynb") == "torch"
