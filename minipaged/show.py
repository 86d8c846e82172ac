"""Show the package's own source in a chapter, so that what the learner reads is what runs.

A chapter that teaches ``slot_mapping`` ends with::

    from minipaged.show import show_source
    from minipaged.block_table import slot_mapping
    show_source(slot_mapping)

which prints the function as it is in ``minipaged/block_table.py`` today, with the file and the line
numbers, so a chapter can never drift from the code (a pasted copy would). In JupyterLab the code is
highlighted; everywhere else (a terminal, nbval, GitHub's viewer) it is plain text.
"""
from __future__ import annotations

import inspect
import textwrap
from pathlib import Path
from typing import Any

_PACKAGE_ROOT = Path(__file__).resolve().parent.parent


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


def source_of(obj: Any) -> str:
    """``obj``'s source with a header line: ``# minipaged/block_table.py, lines 99-131``."""
    target = inspect.unwrap(obj)
    if isinstance(target, property):
        target = target.fget
    try:
        lines, first = inspect.getsourcelines(target)
        path = Path(inspect.getsourcefile(target) or "?").resolve()
    except (TypeError, OSError) as exc:
        raise TypeError(f"show_source: no Python source for {obj!r} ({exc})") from None
    try:
        where = path.relative_to(_PACKAGE_ROOT).as_posix()
    except ValueError:
        where = path.name
    header = f"# {where}, lines {first}-{first + len(lines) - 1}"
    return header + "\n" + textwrap.dedent("".join(lines)).rstrip("\n")  # a method loses its class indent


def show_source(*objs: Any) -> Source:
    """The source of each object (function, method, class), as the package has it now."""
    if not objs:
        raise TypeError("show_source needs at least one function, method or class")
    return Source("\n\n".join(source_of(o) for o in objs))
