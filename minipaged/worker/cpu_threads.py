"""How many threads a CPU step runs on: every core while the cores are free, one while another program fights for one.

PyTorch's CPU kernels (and the engine's own, ``kernels/cpu_kernel.py``) run on one team of OpenMP threads, a
thread per core. A step is some 300 parallel regions with Python between them, and how a thread waits for the
next region decides how fast the step is, and how it shares the machine. Measured on a 2-core Xeon (Cascade
Lake, a cloud VM, 2026-11-29; 32 chat requests built as ``benchmarks/bench_engine.py`` builds its 128, one run
each, tok/s; the VM's own speed drifted by up to 40 % from one minute to the next, so read the large gaps only;
the busy loop is pinned to one of the two CPUs)::

    how the threads wait             alone   beside a nice-19 loop   beside a nice-0 loop
    sleep at once (PASSIVE)            76             93                      78
    spin up to 1M turns (about 6 ms)  126            131                      40
    one thread                         86              -                      92
    cpu_threads="auto" (this module)  141            126                      68   (it dropped to one thread)

* A thread that sleeps the moment a region ends has to be woken for the next one, microseconds later: on a
  virtual machine that wake-up crosses the hypervisor, and the step runs 1.6× slower than with threads that
  spin. Spinning a few milliseconds (``GOMP_SPINCOUNT``, set on ``import minipaged`` unless you set it or
  ``OMP_WAIT_POLICY`` yourself) covers the gaps inside a step and still lets the threads sleep when the engine
  is idle: 6 ms of spinning after the last step, not a core burnt for ever (``OMP_WAIT_POLICY=ACTIVE``).
* A low-priority neighbour (``nice -n 19``: an indexer, a backup) takes nothing from spinning threads: the
  kernel runs ours first.
* A neighbour at the same priority (another notebook's engine, a build) does. With two threads on two cores
  and one core shared, every region ends waiting for the thread that the kernel has just descheduled, and a
  spinning partner holds its own core meanwhile: over 2× slower than one thread alone on the free core.

So a one-process CPU engine watches for that fight (``CpuThreads``): every ``WINDOW_S`` it reads from Linux's
``/proc/stat`` how busy its CPUs were, less its own time and less the time of programs at a lower priority (the
``nice`` column): what is left is other programs at its priority or above. It runs one thread fewer per core
they hold (never fewer than one), and all of them again once they leave. ``LLM(cpu_threads=N)`` fixes N
threads instead (nothing watched); where there is no ``/proc/stat`` (macOS, Windows) "auto" is PyTorch's thread
count, fixed. A tensor-parallel rank keeps its share of the cores (``executor``).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger("minipaged")

WINDOW_S = 0.5  # the time over which the other programs' share of our CPUs is measured
# In a fight a neighbour gets about half the core it shares with a spinning thread of ours, and all of it once we
# leave it: it must hold DOWN of a core beyond what we leave it for us to step down a thread, and use UP less than
# we leave it for us to take one back (the gap keeps the count from flapping).
DOWN = 0.3
UP = 0.6
_SAID: list[bool] = []  # the note about torch coming first, said once a process


def others_busy(cpus: set[int], stat: Path = Path("/proc/stat")) -> float | None:
    """Seconds so far that ``cpus`` ran anything but idle, wait, stolen time or niced programs (user, system,
    interrupts: ``/proc/stat``'s columns 1, 3, 6, 7), less this process's own CPU time; None where there is no
    ``/proc/stat`` to read. Differences of it over a window are what other programs at our priority took."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    ticks = 0
    names = {f"cpu{c}" for c in cpus}
    for line in lines:
        fields = line.split()
        if fields and fields[0] in names and len(fields) > 7:
            ticks += int(fields[1]) + int(fields[3]) + int(fields[6]) + int(fields[7])
    if not ticks:
        return None
    own = os.times()
    return ticks / os.sysconf("SC_CLK_TCK") - own.user - own.system


class CpuThreads:
    """The thread count of a one-process CPU engine: ``setting`` "auto" (watch and adapt) or a fixed count.

    ``after_step`` is called once a step by the thread that runs the steps (an OpenMP thread count belongs to
    the thread that sets it); it costs a clock read, and one read of ``/proc/stat`` every ``WINDOW_S``.
    """

    def __init__(self, setting: int | str) -> None:
        self.setting = setting
        self.found = torch.get_num_threads()  # given back by ``release``
        self.most = torch.get_num_threads() if setting == "auto" else int(setting)
        self.threads = self.most
        self.drops = 0  # times the engine gave a core up to another program
        self.cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        busy = others_busy(self.cpus) if setting == "auto" and self.most > 1 else None
        self.watching = busy is not None
        self._since, self._busy = time.perf_counter(), busy or 0.0
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        # What ``minipaged/__init__.py`` found on import, read without importing the package (a layer above this one)
        if getattr(sys.modules.get("minipaged"), "_SPIN_AFTER_TORCH", False) and not _SAID:
            log.info(
                "minipaged: torch was imported before minipaged, so its threads sleep between parallel regions "
                "(CPU steps about 1.6x slower on a VM); import minipaged first, or set GOMP_SPINCOUNT=1000000 "
                "before Python starts"
            )
            _SAID.append(True)

    def after_step(self) -> None:
        """Measure the cores other programs held over the last window; leave them those cores, or take them back."""
        if not self.watching:
            return
        now = time.perf_counter()
        elapsed = now - self._since
        if elapsed < WINDOW_S:
            return
        busy = others_busy(self.cpus)
        if busy is None:  # /proc went away (a sandbox): keep what runs now
            self.watching = False
            return
        held = max(0.0, busy - self._busy) / elapsed  # cores' worth, over the window
        self._since, self._busy = now, busy
        if elapsed > 4 * WINDOW_S:  # the engine sat idle: what ran meanwhile says nothing about its steps
            return
        left = self.most - self.threads  # the cores we leave them now
        if held - left > DOWN and self.threads > 1:
            self._set(self.threads - 1)
            self.drops += 1
        elif left - held > UP and self.threads < self.most:
            self._set(self.threads + 1)

    def _set(self, n: int) -> None:
        log.debug("minipaged: %d threads (other programs' use of our CPUs changed)", n)
        torch.set_num_threads(n)
        self.threads = n

    def release(self) -> None:
        """Put the process's thread count back as the engine found it (the engine is being dropped)."""
        self.watching = False
        if torch.get_num_threads() != self.found:
            torch.set_num_threads(self.found)

    def describe(self) -> str:
        """One line for the benchmarks: the threads now, and how they are chosen."""
        if self.setting != "auto":
            return f"{self.threads} threads (cpu_threads={self.setting})"
        if not self.watching:
            return f"{self.threads} threads (auto; nothing watched: no /proc/stat here)"
        why = "one fewer per core another program holds"
        return f"{self.threads} of {self.most} threads (auto: {why}; {self.drops} drops)"
