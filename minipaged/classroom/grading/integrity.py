"""The grader's own code and report, checked after the learner's code has run.

The checks run in the same process as the learner's cells (they call the learner's functions), so a cell can
reach them. Three ways in, and what closes each:

* **Replacing the grader's code** (``ex10.check_engine = lambda *a: [...]``, a method of ``core.Check``, the
  package's reference the checks compare with, ``torch.allclose``): ``Integrity`` compares, after the cells and
  again after the checks, every function of every ``minipaged`` module (a function's ``__code__`` and the module
  attribute both) with what it ran before the first cell, or, for a module first imported since, with its file
  compiled afresh; and the library functions the checks lean on (builtins, ``torch``, ``numpy``, ``math``,
  ``json``, ``hmac`` …) with the objects they were before the first cell. The first difference is named.
* **Writing the report** (appending ``{"event": "group", ...}`` lines to the events file): the report's path and a
  key reach the worker on its standard input (not its command line, which ``/proc/self/cmdline`` shows), and
  every line carries a sequence number and an HMAC of it under that key (``Signer``); the grader drops a report
  with a line it did not sign, and says so.
* **Code that is not the notebook's own** (the solution notebook ``exec``'d under a cell's file name): the worker
  keeps the code objects it compiled from the notebook's cells before any of them ran (``runner.run_code_cells``),
  and ``ownership.foreign_code`` accepts a function only if its code is one of those.

What is left: a cell that searches the process's memory (``gc``, frames, ``ctypes``) for the key or for these
records can still forge. ``site/guide/grading.md`` says so ("What the grader defends against").
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import importlib
import importlib.machinery
import json
import os
import sys
import types
from collections.abc import Iterator
from typing import IO, Any

# Library objects the checks call, compared by identity with what they were before the first cell (not on disk as
# Python). None: every callable of the module; else the names.
_TORCH = ("allclose", "equal", "isclose", "isfinite", "tensor", "as_tensor", "stack", "cat", "randn", "rand",
          "randint", "randperm", "manual_seed", "no_grad", "inference_mode", "zeros", "full", "arange", "empty")  # fmt: skip
WATCHED: dict[str, tuple[str, ...] | None] = {
    "builtins": None, "math": None, "json": None, "hmac": None, "hashlib": None, "operator": None,
    "functools": None, "itertools": None, "copy": None, "torch": _TORCH, "torch.testing": ("assert_close",),
    "torch.random": ("fork_rng",), "numpy": ("allclose", "array_equal", "isclose", "flatnonzero"),
    "numpy.testing": ("assert_allclose", "assert_array_equal"),
}  # fmt: skip
PACKAGE = "minipaged"


def _codes(code: types.CodeType, prefix: str = "") -> Iterator[tuple[str, types.CodeType]]:
    """(qualified name, code) of every function and class body compiled in ``code``, outer ones first."""
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            name = getattr(const, "co_qualname", prefix + const.co_name)
            yield name, const
            yield from _codes(const, name + ".")


def _live(module: types.ModuleType, qualname: str) -> Any:
    obj: Any = module
    for part in qualname.split("."):
        obj = obj.__dict__.get(part) if hasattr(obj, "__dict__") else None
        if obj is None:
            return None
    return obj


def _code_of(obj: Any) -> types.CodeType | None:
    """The code a function, method, property, decorated function or Triton kernel runs (None: not Python code)."""
    for _ in range(8):  # decorators: functools.wraps' __wrapped__, a Triton kernel's fn, cached_property's func
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        elif isinstance(obj, property):
            obj = obj.fget
        elif getattr(obj, "__wrapped__", None) is not None:
            obj = obj.__wrapped__
        elif hasattr(obj, "__code__"):
            return obj.__code__
        else:
            obj = getattr(obj, "fn", None) or getattr(obj, "func", None)
            if obj is None:
                return None
    return None


def _home(module: str) -> str | None:
    """The folder of a library's top-level package (None for one built into Python, such as ``builtins``)."""
    top = sys.modules.get(module.split(".")[0])
    path = getattr(top, "__file__", None)
    return os.path.dirname(os.path.abspath(path)) + os.sep if path else None


def _rewrapped(now: Any, then: Any, home: str | None) -> bool:
    """True when the library itself wrapped its function (torch's dynamo wraps ``torch.manual_seed`` when it is
    first imported): the new object's code is in the library's folder and it wraps the old one."""
    code = getattr(now, "__code__", None)
    if home is None or code is None or not os.path.abspath(code.co_filename).startswith(home):
        return False
    for _ in range(8):
        now = getattr(now, "__wrapped__", None)
        if now is then:
            return True
    return False


class Integrity:
    """Taken before the learner's first cell; ``problem()`` is None while nothing the checks rely on changed."""

    def __init__(self) -> None:
        # (label, the module or class, its callables then, the library's folder): a patch changes the object's dict
        self._library: list[tuple[str, Any, dict[str, Any], str | None]] = []
        for name, names in WATCHED.items():
            with contextlib.suppress(ImportError):  # now: a cell that imports it first could patch it first
                importlib.import_module(name)
            if name in sys.modules:
                found = vars(sys.modules[name]).items()
                then = {a: o for a, o in found if callable(o) and (names is None or a in names)}
                self._library.append((name, sys.modules[name], then, _home(name)))
        torch = sys.modules.get("torch")
        if torch is not None:  # the comparisons a check makes on tensors go through these classes' methods
            for cls in (torch.Tensor, torch._C.TensorBase):
                self._library.append((f"torch.{cls.__name__}", cls, dict(vars(cls)), _home("torch")))
        self._disk: dict[str, tuple[list[tuple[str, types.CodeType]], set[types.CodeType]]] = {}
        self._modules = {n: m for n, m in sys.modules.items() if self._ours(n) and m is not None}
        # The package's functions as loaded (by whatever loader: pytest's rewrites asserts), by qualified name.
        self._then = {n: self._functions(m) for n, m in self._modules.items()}

    @staticmethod
    def _ours(name: str) -> bool:
        return name == PACKAGE or name.startswith(PACKAGE + ".")

    def _compiled(self, module: types.ModuleType) -> tuple[list[tuple[str, types.CodeType]], set[types.CodeType]]:
        """(qualified name, code) of the file's named functions and classes, and every code object in it."""
        path = getattr(module, "__file__", None) or ""
        if path not in self._disk:
            named: list[tuple[str, types.CodeType]] = []
            try:
                with open(path, "rb") as f:  # the file as the package ships it, not what the module now holds
                    named = list(_codes(compile(f.read(), path, "exec", dont_inherit=True)))
            except (OSError, SyntaxError, ValueError):
                pass
            self._disk[path] = ([(n, c) for n, c in named if "<" not in n], {c for _, c in named})
        return self._disk[path]

    def _functions(self, module: types.ModuleType) -> dict[str, Any]:
        """{qualified name: the code it runs now, or the object when that is not Python code} for every function
        and class the module's file defines (classes themselves left out: their methods are in the table)."""
        found: dict[str, Any] = {}
        for qualname, _ in self._compiled(module)[0]:
            live = _live(module, qualname)
            if live is not None and not isinstance(live, type):
                code = _code_of(live)
                found[qualname] = code if code is not None else live
        return found

    def problem(self) -> str | None:
        """The first thing the checks rely on that is not what it was, in a sentence; None if all is as it was."""
        for label, owner, then, home in self._library:
            now = vars(owner)
            for attr, obj in then.items():
                if now.get(attr) is not obj and not _rewrapped(now.get(attr), obj, home):
                    return f"{label}.{attr} was replaced"
        for name, module in list(sys.modules.items()):
            if not self._ours(name) or module is None:
                continue
            if name in self._modules:
                if module is not self._modules[name]:
                    return f"the module {name} was replaced"
                then = self._then[name]
                for qualname, now in self._functions(module).items():
                    if qualname in then and now != then[qualname]:
                        return f"{name}.{qualname} is not the code in {name.replace('.', '/')}.py"
                continue
            # First imported after the snapshot: compared with its file, if it was loaded from it as Python loads
            # a source file (not, say, by pytest's assert rewriting, which only the course's tests use).
            if type(getattr(module, "__loader__", None)) is not importlib.machinery.SourceFileLoader:
                continue
            every = self._compiled(module)[1]
            for qualname, now in self._functions(module).items():
                if not isinstance(now, types.CodeType) and callable(now):
                    return f"{name}.{qualname} was replaced by a {type(now).__name__}"
                if isinstance(now, types.CodeType) and now not in every:
                    return f"{name}.{qualname} is not the code in {name.replace('.', '/')}.py"
        return None


class Signer:
    """Writes the worker's report, one JSON object a line, each with its sequence number and an HMAC under ``key``."""

    def __init__(self, stream: IO[str], key: bytes) -> None:
        self._stream, self._key, self._seq = stream, key, 0

    def __call__(self, event: str, **fields: Any) -> None:
        body = json.dumps({"event": event, **fields, "seq": self._seq}, sort_keys=True)
        mac = hmac.new(self._key, body.encode(), hashlib.sha256).hexdigest()
        self._stream.write(json.dumps({"body": body, "mac": mac}) + "\n")
        self._stream.flush()
        self._seq += 1


def read_signed(text: str, key: bytes) -> tuple[list[dict[str, Any]], str | None]:
    """The events of a report and None, or the events before the first line the worker did not write and why.
    A last line cut short (the worker killed while writing it) is not a forgery: the events before it stand."""
    events: list[dict[str, Any]] = []
    lines = text.splitlines()
    for n, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            body, mac = record["body"], record["mac"]
            event = json.loads(body)
        except (json.JSONDecodeError, KeyError, TypeError):
            if n == len(lines) and not text.endswith("\n"):
                break  # cut short by a kill
            return events, f"line {n} of the grader's report is not one the grader wrote"
        good = hmac.compare_digest(hmac.new(key, body.encode(), hashlib.sha256).hexdigest(), str(mac))
        if not good or event.get("seq") != len(events):
            return events, f"line {n} of the grader's report is not one the grader wrote"
        events.append(event)
    return events, None


__all__ = ["Integrity", "Signer", "read_signed"]
