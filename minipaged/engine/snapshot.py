"""Undo a step: put the engine's bookkeeping back exactly as it was before the step began.

The engine's own pieces are written so that a failed step leaves nothing half-done (``allocate_slots`` checks
everything before it changes anything; a step's results are applied only once they are all in). A learner's
part (``minipaged.classroom.parts``) gives no such promise: a ``remove`` that unlinks a block and then hits a typo, an
admission that pops a request and then raises, leave the free queue, the ref counts or the queues half-changed,
deep inside a section that must not fail. So while parts are plugged in, ``step.run_step`` takes a snapshot of every
object of the bookkeeping first, and restores it if the step raises::

    snap = Snapshot.take(scheduler.bookkeeping())   # scheduler, KV manager, pools, blocks, requests
    try:
        step()
    except BaseException:
        snap.restore()                                # same objects, same fields, same contents
        raise

What is restored: every attribute of every object listed, and the contents of the lists, dicts, deques and
sets they hold, in place (so a list another object also holds is fixed for both). What is not: tensors (the KV
cache's contents; a checked part writes to a scratch copy first, see ``parts``) and objects not listed.
The cost is one pass over the blocks and requests per step, paid only while parts are plugged in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

# (original container, what it held) or (a plain value, None)
_Saved = tuple[Any, Any]


def _save(value: Any) -> _Saved:
    if isinstance(value, dict):
        return value, [(k, _save(v)) for k, v in value.items()]
    if isinstance(value, (list, deque)):
        return value, [_save(v) for v in value]
    if isinstance(value, set):
        return value, list(value)
    return value, None


def _put(saved: _Saved) -> Any:
    value, held = saved
    if held is None:
        return value
    if isinstance(value, dict):
        items = [(k, _put(s)) for k, s in held]
        value.clear()
        value.update(items)
    elif isinstance(value, list):
        value[:] = [_put(s) for s in held]
    elif isinstance(value, deque):
        items = [_put(s) for s in held]
        value.clear()
        value.extend(items)
    else:
        value.clear()
        value.update(held)
    return value


def _fields(obj: Any) -> list[str]:
    if hasattr(obj, "__dict__"):
        return list(vars(obj))
    return [name for cls in type(obj).__mro__ for name in getattr(cls, "__slots__", ())]


class Snapshot:
    """The attributes of some objects, and the contents of the containers they hold, at one moment."""

    def __init__(self, saved: list[tuple[Any, dict[str, _Saved]]]) -> None:
        self._saved = saved

    @classmethod
    def take(cls, objects: Iterable[Any]) -> Snapshot:
        seen: set[int] = set()
        saved = []
        for obj in objects:
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            saved.append((obj, {name: _save(getattr(obj, name)) for name in _fields(obj) if hasattr(obj, name)}))
        return cls(saved)

    def restore(self) -> None:
        for obj, fields in self._saved:
            if hasattr(obj, "__dict__"):
                for name in set(vars(obj)) - set(fields):  # attributes added since: gone again
                    delattr(obj, name)
            for name, saved in fields.items():
                object.__setattr__(obj, name, _put(saved))
