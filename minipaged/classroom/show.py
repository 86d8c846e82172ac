"""Show the package's own source in a chapter, so that what the learner reads is what runs.

A chapter that teaches ``slot_mapping`` ends with::

    from minipaged.classroom.show import show_source
    from minipaged.worker.block_table import slot_mapping
    show_source(slot_mapping)

which prints the function as it is in ``minipaged/worker/block_table.py`` today, under a header naming it, its
file and its line numbers (``# slot_mapping in minipaged/worker/block_table.py, lines 99-129``), so a chapter
can never drift from the code (a pasted copy would). In JupyterLab the code is highlighted; everywhere
else (a terminal, nbval, GitHub's viewer) it is plain text.

It takes functions, methods (``BlockPool.get_new_blocks``, or bound to an instance), properties,
static and class methods, classes, modules, and Triton kernels (a ``@triton.jit`` function, or one
wrapped by ``triton.autotune``/``triton.heuristics``, is shown as the Python function it was written
as). Anything with no Python source (a built-in, a number, an instance) is refused with a TypeError.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from pathlib import Path
from typing import Any

_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # minipaged/


class Source:
    """The source of one or more objects: plain text as its repr, highlighted HTML in Jupyter."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text

    def _repr_html_(self) -> str:
        try:
            from pygments import highlight
            from pygments.formatters import HtmlFormatter
            from pygments.lexers import PythonLexer
        except ImportError:  # pragma: no cover - pygments comes with IPython
            import html

            return f"<pre>{html.escape(self.text)}</pre>"
        formatter = HtmlFormatter(noclasses=True, nobackground=True)
        return highlight(self.text, PythonLexer(), formatter)


def _target(obj: Any) -> Any:
    """The Python object whose source ``inspect`` can find for ``obj``."""
    for _ in range(8):  # each wrapper peels one layer; no real object nests deeper
        if isinstance(obj, property):
            obj = obj.fget
        elif isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        elif isinstance(obj, (functools.cached_property, functools.partialmethod)):
            obj = obj.func
        elif inspect.ismethod(obj):
            obj = obj.__func__
        elif type(obj).__module__.split(".")[0] == "triton" and hasattr(obj, "fn"):
            obj = obj.fn  # triton.jit (JITFunction / InterpretedFunction), triton.autotune, triton.heuristics
        else:
            return inspect.unwrap(obj)
    return obj


def _name(obj: Any, target: Any) -> str:
    """``Class.method`` for a method, the function's or class's own name otherwise."""
    if inspect.ismodule(target):
        return target.__name__
    return getattr(target, "__qualname__", None) or getattr(obj, "__qualname__", None) or repr(obj)


def _where(path: Path, target: Any) -> str:
    """``minipaged/<folder>/<module>.py`` for the package's files, ``torch/nn/functional.py`` for another package's."""
    try:
        return (Path(_PACKAGE_DIR.name) / path.relative_to(_PACKAGE_DIR)).as_posix()
    except ValueError:
        pass
    name = getattr(target, "__module__", None) or getattr(target, "__name__", None) or ""
    module = sys.modules.get(name.split(".")[0])
    top = getattr(module, "__file__", None)
    if top:
        root = Path(top).resolve().parent
        if Path(top).name == "__init__.py":
            root = root.parent
        try:
            return path.relative_to(root).as_posix()
        except ValueError:
            pass
    return path.name


def _no_source(obj: Any, why: str) -> TypeError:
    return TypeError(
        f"show_source: {obj!r} has no Python source to show ({why}); "
        "pass a function, method, class or module, e.g. show_source(BlockPool.get_new_blocks)"
    )


def source_of(obj: Any) -> str:
    """``obj``'s source under a header: ``# slot_mapping in minipaged/worker/block_table.py, lines 99-129``."""
    target = _target(obj)
    if inspect.isbuiltin(target) or (inspect.ismethoddescriptor(target) and not inspect.isfunction(target)):
        raise _no_source(obj, "it is built in, written in C")
    if not (
        inspect.isfunction(target) or inspect.isclass(target) or inspect.ismodule(target) or inspect.iscode(target)
    ):
        kind = type(target)
        if kind.__module__ == "builtins":
            raise _no_source(obj, f"it is a value of type {kind.__name__}, not a function, method, class or module")
        raise _no_source(obj, f"it is an instance of {kind.__qualname__}: pass the class, or one of its methods")
    try:
        lines, first = inspect.getsourcelines(target)
        path = Path(inspect.getsourcefile(target) or "?").resolve()
    except TypeError as exc:  # e.g. a class defined in C, or in __main__ with no file
        raise _no_source(obj, str(exc)) from None
    except OSError as exc:
        raise OSError(f"show_source: the source of {obj!r} cannot be read ({exc})") from None
    if inspect.isfunction(target) and target.__name__ != "<lambda>":
        _check_current(obj, target, lines)
    first = max(first, 1)  # a module starts at line 0 for inspect
    header = f"# {_name(obj, target)} in {_where(path, target)}, lines {first}-{first + len(lines) - 1}"
    return header + "\n" + _dedent(lines)


def _check_current(obj: Any, target: Any, lines: list[str]) -> None:
    """Refuse to print the wrong lines: a function's line numbers are those of the file as it was
    imported, the text is the file as it is now. If the file was edited since, they disagree."""
    starts_right = bool(lines) and lines[0].lstrip().startswith(("@", "def ", "async "))
    for line in lines if starts_right else ():
        m = re.match(r"\s*(?:async\s+)?def\s+(\w+)", line)
        if m:
            if m[1] == target.__name__:
                return
            break
    raise OSError(
        f"show_source: {_name(obj, target)}'s file changed since it was imported, so its lines have "
        "moved; restart the kernel (or importlib.reload its module) to see the current code"
    )


def _dedent(lines: list[str]) -> str:
    """Remove the indent of the first line (a method's class indent) from every line that has it.

    Unlike ``textwrap.dedent``, a string literal reaching column 0 inside a method does not stop the
    rest from being dedented.
    """
    first = lines[0]
    indent = first[: len(first) - len(first.lstrip(" \t"))]
    out = [line[len(indent) :] if line.startswith(indent) else line for line in lines]
    return "".join(out).rstrip("\n")


def show_source(*objs: Any) -> Source:
    """The source of each object (function, method, class, Triton kernel), as the package has it now.

    Returns an object whose repr is the plain source with one header line per object; Jupyter shows it
    highlighted. Raises TypeError for an object without Python source (a built-in, an int, an instance).
    """
    if not objs:
        raise TypeError("show_source needs at least one function, method or class")
    return Source("\n\n".join(source_of(o) for o in objs))
