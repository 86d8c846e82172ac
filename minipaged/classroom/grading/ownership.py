"""The learner's own code, judged by what runs, not by names.

An exercise asks a learner to write a component. An answer that hands the work to the package's component (or to
the reference the checks compare with) passes every value check, so the grader looks at two things:

* **where the code comes from** (``foreign_code``): every function the graded object is made of — the function
  itself, or every method of a class and of its bases, the function under a ``functools.partial``, a bound
  method or a Triton kernel — must have been compiled from the notebook's own cells. An assignment
  (``remove = FreeKVCacheBlockQueue.remove``), a copied method, a subclass of the package's class, or code
  ``exec``'d from another notebook (the solution's), even under a cell's file name, is found here.
* **what it runs** (``Tracer``): while the checks call the learner's code, a profile hook watches every Python
  call; a call into the implementation the exercise is about, made while a frame of the notebook's code is on the
  stack, is delegation at some depth — a wrapper, a tuple holding the package's object, a method forwarding to
  it. The grader's own calls into the same code (to compute what is expected) have no notebook frame below them.

What this cannot see: code copied into the notebook's cells (it is then compiled there), and a learner who
switches the hook off and back on (``sys.setprofile``) between calls; the tracer notices a hook that is not its
own when it stops, and says so.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import threading
import types
from collections.abc import Iterable, Mapping
from typing import Any

# Methods Python itself writes for a dataclass or a namedtuple, compiled from a string ("<string>"): allowed by
# name only, so that code a notebook ``exec``s (also "<string>") is still found.
_GENERATED = {"__init__", "__repr__", "__eq__", "__hash__", "__lt__", "__le__", "__gt__", "__ge__", "__setattr__",
              "__delattr__", "__getstate__", "__setstate__", "__new__", "__replace__", "_make", "_replace",
              "_asdict", "__getnewargs__", "__match_args__"}  # fmt: skip


def cell_prefix(notebook: str) -> str:
    """The file name the grader compiles a notebook's cells under (``runner.run_code_cells``)."""
    return f"<{notebook} cell "


def _functions(obj: Any, seen: set[int]) -> Iterable[tuple[str, types.FunctionType]]:
    """(name, function) for every Python function ``obj`` is made of."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, types.FunctionType):
        yield getattr(obj, "__qualname__", obj.__name__), obj
    elif isinstance(obj, types.MethodType):
        yield from _functions(obj.__func__, seen)
    elif isinstance(obj, functools.partial):
        yield from _functions(obj.func, seen)
    elif isinstance(obj, (staticmethod, classmethod)):
        yield from _functions(obj.__func__, seen)
    elif isinstance(obj, property):
        for f in (obj.fget, obj.fset, obj.fdel):
            if f is not None:
                yield from _functions(f, seen)
    elif isinstance(obj, type):
        for cls in obj.__mro__:
            if cls is object or cls.__module__ in ("builtins", "abc", "typing", "collections"):
                continue
            for name, value in vars(cls).items():
                if name in ("__init_subclass__", "__subclasshook__", "__class_getitem__"):
                    continue
                yield from ((f"{cls.__qualname__}.{name}", f) for _, f in _functions(value, seen))
    elif hasattr(obj, "fn") and type(obj).__name__ in ("JITFunction", "InterpretedFunction", "Autotuner"):
        yield from _functions(obj.fn, seen)  # a Triton kernel: the Python function it was written as
    elif callable(obj) and not isinstance(obj, types.BuiltinFunctionType):
        yield from _functions(type(obj), seen)  # a callable instance: its class


def foreign_code(obj: Any, notebook: str, own: Mapping[int, types.CodeType] | None = None) -> str | None:
    """None when every function ``obj`` is made of was compiled from the notebook's cells; else what is not.
    ``own``: the code objects the grader compiled from the cells (``runner.run_code_cells``); given, a function
    must run one of them, so that text compiled under a cell's file name by a cell (the solution's) is found."""
    prefix = cell_prefix(notebook)
    for name, fn in _functions(obj, set()):
        where = fn.__code__.co_filename
        if where.startswith(prefix):
            if own is not None and own.get(id(fn.__code__)) is not fn.__code__:
                return f"{name} was compiled under the name {where} from text that is not in that cell"
            continue
        if (where == "<string>" or where.startswith("namedtuple_")) and name.rsplit(".", 1)[-1] in _GENERATED:
            continue  # a dataclass's __init__, a namedtuple's __new__: written by Python for a class of yours
        module = getattr(fn, "__module__", None) or "?"
        return f"{name} comes from {module} ({where}), not from this notebook's cells"
    return None


def _named(qualname: str, names: set[str]) -> bool:
    """``KVCacheManager.can_allocate`` is named by ``KVCacheManager`` (the whole class) or by itself."""
    parts = qualname.split(".")
    return any(".".join(parts[:n]) in names for n in range(1, len(parts) + 1))


def exempt(own: Iterable[str]) -> None:
    """``Tracer.exempt`` on the tracer watching now; nothing when none is (a check cell run in Jupyter or nbval)."""
    if Tracer.active is not None:
        Tracer.active.exempt(own)


def targets(own: Iterable[str]) -> dict[str, set[str] | None]:
    """``Group.own`` as {source file: names (None: the whole module)}, for the modules that exist here. A name is a
    top-level function or class, or one method of a class (``KVCacheManager.can_allocate``)."""
    found: dict[str, set[str] | None] = {}
    for entry in own:
        module, _, names = entry.partition(":")
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.origin:
            found[spec.origin] = set(names.split(",")) if names else None
    return found


class Tracer:
    """Records the first call into ``targets`` made with a frame of the notebook's code below it."""

    active: Tracer | None = None  # the one watching now, for ``exempt``

    def __init__(self, targets: dict[str, set[str] | None], notebook: str) -> None:
        self.targets, self.prefix = targets, cell_prefix(notebook)
        self.found: str | None = None
        self._before: Any = None

    def exempt(self, own: Iterable[str]) -> None:
        """Stop watching ``own`` (``Group.own`` entries) for the rest of this group: for a check that hands the
        learner's code the package's own components on purpose (exercise 10's guided track, where the learner's
        step loop joins the package's scheduler with the learner's parts inside it). Only the grader may ask: a
        call with a frame of the notebook's code below it is refused."""
        frame: types.FrameType | None = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_filename.startswith(self.prefix):
                raise PermissionError("the notebook's code asked the grader's call tracer to look away")
            frame = frame.f_back
        for filename in targets(own):
            self.targets.pop(filename, None)

    def _hook(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if event != "call" or self.found is not None:
            return
        code = frame.f_code
        if code.co_filename not in self.targets:
            return
        names = self.targets[code.co_filename]
        qualname = getattr(code, "co_qualname", code.co_name)
        if names is not None and not _named(qualname, names):
            return
        caller = frame.f_back
        while caller is not None:
            if caller.f_code.co_filename.startswith(self.prefix):
                mine = getattr(caller.f_code, "co_qualname", caller.f_code.co_name)
                short = "/".join(code.co_filename.rsplit("/", 3)[-3:])
                self.found = f"your {mine} ({caller.f_code.co_filename.strip('<>')}) runs {qualname} of {short}"
                return
            caller = caller.f_back

    def __enter__(self) -> Tracer:
        self._before = sys.getprofile()
        sys.setprofile(self._hook)
        threading.setprofile(self._hook)
        Tracer.active = self
        return self

    def __exit__(self, *exc: object) -> None:
        Tracer.active = None
        if sys.getprofile() != self._hook and self.found is None:  # a bound method: equal, not the same object
            self.found = "the grader's call tracer was switched off by the notebook's code"
        sys.setprofile(self._before)
        threading.setprofile(None)
