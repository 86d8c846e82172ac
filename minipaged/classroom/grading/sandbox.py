"""Bounded runs for the grader: a time limit, a memory limit, and every process a notebook starts ended with it.

A notebook's code can start processes that outlive it: ``subprocess.Popen(..., start_new_session=True)`` leaves
the worker's process group, and a double fork (fork, ``setsid``, fork again, the middle one exits) leaves it and
its parent. Killing the worker's process group misses both. So the worker runs under a small supervisor::

    grader ──▶ supervisor (PR_SET_CHILD_SUBREAPER) ──▶ worker ──▶ whatever the notebook starts
                    ▲                                               │ orphaned, however it detached
                    └───────────── reparented here, not to init ◀───┘

On Linux a *subreaper* receives every orphaned descendant in place of init, however it detached: when the
worker ends (or its time is up), the supervisor kills the worker's group, then kills and reaps its own children
until it has none left. Elsewhere (no ``prctl``) it falls back to the process group and says so.

The memory limit is ``RLIMIT_DATA`` on the worker (inherited by what it starts): the bytes of private writable
memory it may map — the heap and every tensor's storage — so an allocation past it fails at once with
``MemoryError`` (or torch's "can't allocate memory") and the grader names the limit in the row. Address space
(``RLIMIT_AS``) would count what torch and Triton only reserve.

    python -m minipaged.classroom.grading.sandbox SECONDS MEMORY_BYTES -- COMMAND ...

exits with the command's exit code, ``TIME_UP`` when its time ran out, or ``128 + n`` when a signal ``n`` ended it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import subprocess
import sys
import time

# What ending a process can meet: it ended already, it is not ours, nothing left to reap, it will not end.
_suppress = contextlib.suppress(ProcessLookupError, PermissionError, ChildProcessError, subprocess.TimeoutExpired)
TIME_UP = 124  # the exit code of timeout(1)
PR_SET_CHILD_SUBREAPER = 36
MEMORY_WORDS = ("MemoryError", "can't allocate memory", "Cannot allocate memory", "out of memory")


def become_subreaper() -> bool:
    """Make this process the one orphaned descendants are reparented to (Linux); False where that cannot be."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc; empty where there is none)."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue  # it ended while we looked
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses; the last ')' ends it
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            found.append(int(entry))
    return found


def end_all(worker: subprocess.Popen) -> None:
    """Kill the worker's group, then every child this supervisor has (orphans reparented to it), until none is
    left; reap them all."""
    with _suppress:
        os.killpg(worker.pid, signal.SIGKILL)
    with _suppress:
        worker.wait(timeout=10)
    me = os.getpid()
    for _ in range(200):  # each round kills what is here now; a dying parent's children arrive in the next
        left = children(me)
        if not left:
            return
        for pid in left:
            with _suppress:
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            try:
                reaped, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if reaped == 0:
                time.sleep(0.01)


def _limit_memory(memory_bytes: int) -> None:
    resource.setrlimit(resource.RLIMIT_DATA, (memory_bytes, memory_bytes))


def supervise(seconds: float, memory_bytes: int, cmd: list[str]) -> int:
    reaping = become_subreaper()
    if not reaping:
        print("minipaged grade: no subreaper on this system: a process that leaves the worker's group may outlive "
              "grading", file=sys.stderr)  # fmt: skip
    worker = subprocess.Popen(cmd, start_new_session=True, preexec_fn=lambda: _limit_memory(memory_bytes))

    def stop(signum: int, _frame: object) -> None:  # the grader was stopped: take everything down with us
        end_all(worker)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        rc = worker.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        rc = None
    end_all(worker)
    if rc is None:
        return TIME_UP
    return 128 - rc if rc < 0 else rc


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    return supervise(float(argv[0]), int(argv[1]), argv[3:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
