"""The seam where a learner's function stands in for a piece of the engine. Imports nothing from the package.

Each place in the engine that a learner can replace asks ``hooks.plugged(name)`` first and, if something is
plugged in, calls it instead of its own piece::

    remove = hooks.plugged("free_queue_remove")
    (remove or queue.remove)(...)

The engine knows nothing else about learners: what is plugged in, how calls are checked and what a wrong
answer says all live in ``minipaged.parts`` (the classroom), which fills this module through ``push``/``pop``.
Keeping the seam here, below everything, is what lets the engine's modules import it without an import circle.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

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


def plugged(name: str) -> Any:
    """What is plugged in for part ``name`` now, or None (the engine's own piece runs)."""
    return _plugged.get(name) if _plugged else None


def active(ignore: frozenset[str] = frozenset()) -> bool:
    """Whether anything is plugged in now (other than the parts named in ``ignore``)."""
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
