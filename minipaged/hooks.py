"""The seam where a learner's function stands in for a piece of the engine. Imports nothing from the package.

Each engine component that a learner can replace a piece of declares those pieces once, as its seam, and asks
the seam for the function to run: the one plugged in, else its own::

    SEAM = hooks.Seam("block_pool", free_queue_remove="BlockPool.touch: a cached block leaves the free queue")
    ...
    SEAM.pick("free_queue_remove", _remove)(queue, block)

The engine knows nothing else about learners: what is plugged in, how calls are checked and what a wrong
answer says all live in ``minipaged.classroom.parts``, which fills this module through ``push``/``pop``.
Keeping the seam here, below everything, is what lets the engine's modules import it without an import circle.

``bounded(fn, seconds)`` runs a learner's code on a leash (exercise 10b's policy, a policy file's import): on a
worker thread, waited for at most ``seconds``, stopped if it does not answer (see ``bounded`` for why a thread).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar, cast

T = TypeVar("T")

# What is plugged in now, by part name; and, per active ``parts.use`` block (innermost last), what to run when it
# ends, by key (an engine forgetting its prefix cache).
_plugged: dict[str, Callable[..., Any]] = {}
_stack: list[tuple[dict[str, Callable[..., Any]], dict[Any, Callable[[], None]]]] = []


class PartError(RuntimeError):
    """A plugged-in part raised, returned the wrong kind of thing, or (checked) returned a wrong result."""

    def __init__(
        self, part: str, message: str, call: int = 0, probe: str | None = None, exercise: str | None = None
    ) -> None:
        which = f" (exercise {exercise[2:]})" if exercise else ""
        where = f" on probe {probe!r}" if probe else f" on call {call}" if call else ""
        super().__init__(f"part {part!r}{which}{where}: {message}")
        self.part, self.call, self.probe, self.exercise = part, call, probe, exercise
        self.step: int | None = None  # the engine step, filled in by step.run_step

    def in_step(self, step: int) -> None:
        """Name the engine step it failed in, once (a note under the message; Python 3.10 has no notes)."""
        if self.step is None:
            self.step = step
            if hasattr(self, "add_note"):  # Python >= 3.11
                self.add_note(f"(engine step {step})")


F = TypeVar("F", bound=Callable[..., Any])
SEAMS: dict[str, Seam] = {}  # every component's seam, by component name, as the engine's modules declare them


class Seam:
    """One component's replaceable pieces, declared once where the component lives::

        SEAM = hooks.Seam("block_pool", free_queue_remove="BlockPool.touch: a cached block leaves the queue")
        ...
        SEAM.pick("free_queue_remove", _remove)(queue, block)

    ``pick`` answers the function to run: the one plugged in for that part, else the engine's own. The component
    names nothing else of the course; the classroom (``minipaged.classroom.parts``) checks that every part it can
    plug in is a part some seam declares (``tests/test_seams.py``)."""

    component: str
    parts: dict[str, str]  # part name -> where the engine calls it

    def __init__(self, component: str, **parts: str) -> None:
        if component in SEAMS or not parts:
            raise ValueError(f"seam {component!r}: declared twice, or with no parts")
        taken = {p for seam in SEAMS.values() for p in seam.parts} & set(parts)
        if taken:
            raise ValueError(f"seam {component!r}: parts {sorted(taken)} belong to another seam")
        self.component, self.parts = component, dict(parts)
        SEAMS[component] = self

    def pick(self, part: str, own: F) -> F:
        """The function to run for ``part``: the one plugged in now, else ``own``."""
        self._declared(part)
        return cast(F, _plugged.get(part, own)) if _plugged else own

    def plugged(self, part: str) -> Callable[..., Any] | None:
        """What is plugged in for ``part`` now, or None: for a part with no one function of the engine's own."""
        self._declared(part)
        return _plugged.get(part) if _plugged else None

    def _declared(self, part: str) -> None:
        if part not in self.parts:
            raise KeyError(f"seam {self.component!r} has no part {part!r}; it has {sorted(self.parts)}")

    def replaced(self) -> bool:
        """Whether any of this seam's parts is plugged in now."""
        return bool(_plugged) and any(part in _plugged for part in self.parts)

    def __repr__(self) -> str:
        return f"Seam({self.component!r}, parts={sorted(self.parts)})"


def plugged(name: str) -> Any:
    """What is plugged in under ``name`` now, or None (the engine's own piece runs)."""
    return _plugged.get(name) if _plugged else None


def active(ignore: frozenset[str] = frozenset()) -> bool:
    """Whether any part is plugged in now (other than those named in ``ignore``)."""
    return bool(_plugged) and any(name not in ignore for name in _plugged)


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Nothing plugged in while the block lasts: for cleanup that must succeed whatever a learner's part does
    (an abort gives a request's blocks back with the package's own functions)."""
    saved = dict(_plugged)
    _plugged.clear()
    try:
        yield
    finally:
        _plugged.update(saved)


def at_exit(key: Any, action: Callable[[], None]) -> None:
    """Run ``action`` when the innermost active block of parts ends (once per ``key``)."""
    if _stack:
        _stack[-1][1].setdefault(key, action)


def push(parts: Mapping[str, Callable[..., Any]]) -> None:
    """Plug ``parts`` in, on top of (and overriding) what is plugged in already."""
    _stack.append((dict(_plugged), {}))
    _plugged.update(parts)


def pop() -> None:
    """Undo the last ``push`` and run the actions registered while it was the innermost."""
    saved, actions = _stack.pop()
    _plugged.clear()
    _plugged.update(saved)
    for action in actions.values():
        action()


# ---- learner's code on a leash ---------------------------------------------------------------------------
STOP_GRACE_S = 0.5  # how long code that ran out of time is given to unwind once told to stop


class TimeUp(BaseException):
    """Raised inside learner's code that ran out of time. A BaseException, so that neither the code's own
    ``except Exception`` nor the wrapper that names a part's errors (``parts.Plugged``) takes it for an answer."""


class Overdue(Exception):
    """``bounded``'s call did not answer in time. ``stopped``: it was stopped; False: it is stuck outside Python
    code (a sleep, a lock, ``input()``) or ignored the stop, and was left behind on its daemon thread."""

    def __init__(self, seconds: float, stopped: bool) -> None:
        how = (
            "it was stopped (an endless loop?)"
            if stopped
            else "it would not stop (stuck in a sleep, a lock or input(), or it caught the stop) and was left "
            "behind on a background thread"
        )
        super().__init__(f"did not answer within {seconds:.3g} s: {how}")
        self.seconds, self.stopped = seconds, stopped


class _Job:
    """One call handed to the worker. ``done`` is a bare lock, held until the call ends: waiting on it costs a
    third of an ``Event`` (no Python-level condition per wait), and the simulator makes one call a step."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn, self.done, self.ended = fn, threading.Lock(), False
        self.done.acquire()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # handed to the caller, whatever it is
            self.error = exc
        self.ended = True
        self.done.release()

    def wait(self, seconds: float) -> bool:
        """True once the call ended, waiting at most ``seconds`` for it."""
        if self.ended or self.done.acquire(timeout=max(seconds, 0.0)):
            self.ended = True
            return True
        return False


class _Worker:
    """A daemon thread that runs one calling thread's jobs in turn; retired once a job ran out of time."""

    def __init__(self) -> None:
        self.owner, self.pid, self.retired = threading.current_thread(), os.getpid(), False
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=f"minipaged-leash-{self.owner.name}", daemon=True)
        self.thread.start()

    def usable(self) -> bool:
        return not self.retired and self.pid == os.getpid() and self.thread.is_alive()  # a fork keeps no threads

    def _serve(self) -> None:
        try:
            while not self.retired:
                try:
                    job = self.jobs.get(timeout=10.0)
                except queue.Empty:
                    if self.owner.is_alive():
                        continue
                    return  # the thread it served is gone: so is it
                if job is None:
                    return
                job.run()
        except BaseException:  # a stop that landed after its job ended: this worker is retired already
            return

    def retire(self, job: _Job) -> bool:
        """Stop ``job``'s code (a ``TimeUp`` raised in it, again every 50 ms for ``STOP_GRACE_S``) and end this
        worker; True if the job ended."""
        self.retired = True
        self.jobs.put(None)
        api, ident = getattr(ctypes, "pythonapi", None), self.thread.ident
        for _ in range(max(1, round(STOP_GRACE_S / 0.05))):
            if job.ended or not self.thread.is_alive():
                return True
            if api is not None and ident is not None:
                api.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(TimeUp))
            job.wait(0.05)
        return job.ended or not self.thread.is_alive()


_leash = threading.local()  # each calling thread's worker


def bounded(fn: Callable[[], T], seconds: float) -> T:
    """``fn()``, run on a worker thread while this thread waits at most ``seconds`` for it; ``Overdue`` if it does
    not answer, after a ``TimeUp`` raised inside it has stopped it (``stopped``) or it was left behind. What
    ``fn`` raises is raised here, whatever it is: callers turn a learner's errors into their own first.

    Why a thread: the engine steps on the main thread in a notebook but on the server's engine thread when it
    serves, and a signal (``SIGALRM``) reaches the main thread only; tracing (``sys.settrace``) slows every line
    of the learner's code and cannot end a call stuck in C (``time.sleep``). Waiting on a thread is bounded in
    any thread, whatever the code does; the exception raised in it (``PyThreadState_SetAsyncExc``) ends a Python
    loop, so nothing is left spinning in the usual case. A Ctrl-C while it runs stops it too, then goes on."""
    worker = getattr(_leash, "worker", None)
    if worker is None or not worker.usable():
        worker = _leash.worker = _Worker()
    job = _Job(fn)
    worker.jobs.put(job)
    try:
        answered = job.wait(seconds)
    except BaseException:  # interrupted while waiting: the learner's code must not run on
        worker.retire(job)
        raise
    if not answered:
        raise Overdue(seconds, worker.retire(job))
    if job.error is not None:
        raise job.error
    return job.result
