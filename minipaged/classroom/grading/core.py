"""The checks behind every graded exercise.

A check cell in an exercise notebook calls one ``check_*`` function of this
package, which runs a group of small checks against the learner's code and
prints exactly one summary line::

    bytes_per_token: 6/6 checks passed

That line is stored in the notebook as the expected output (``# NBVAL_CHECK_OUTPUT``),
so ``pytest --nbval-lax`` grades the notebook, and ``python -m minipaged grade``
reads the same lines to build a score table. When a check fails, more lines
follow, one block per failed check: what was tried, what was expected, what came
back, and a hint. The expected values are computed by the package's own
reference implementation, never typed in.
"""

from __future__ import annotations

import operator
import re
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

# The one line per check group that grading reads back.
SUMMARY_RE = re.compile(r"^(?P<group>[A-Za-z0-9_.\-]+): (?P<passed>\d+)/(?P<total>\d+) checks passed$")


class Thunk(Protocol):
    """What a check runs: a callable taken with no arguments. ``Callable[[], Any]`` would say the same, but mypy
    cannot infer a lambda that binds loop variables as defaults (``lambda s=s: ...``) against it."""

    def __call__(self) -> Any: ...


@dataclass
class Check:
    """One thing to try: call ``run`` and compare what it returns with ``expected``."""

    tried: str  # shown on failure, e.g. "bytes_per_token(80, 8, 128, 2)"
    run: Thunk
    expected: Any
    # Shown on failure. A hint whose advice holds only in some failures is a function of what the check got,
    # returning the advice that fits (or "" for none): a hint that says "X passes but this fails" must not be
    # printed when X fails too.
    hint: str | Callable[[Any], str] = ""
    same: Callable[[Any, Any], bool] = field(default=operator.eq)


@dataclass
class CheckOutcome:
    check: Check
    passed: bool
    got: Any


def describe_error(exc: BaseException) -> str:
    if isinstance(exc, NotImplementedError):
        return "NotImplementedError: the stub is still there; write your code in place of `raise NotImplementedError`"
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f" (line {frame.lineno} of {frame.name})" if frame else ""
    return f"{type(exc).__name__}: {exc}{where}"


def run_check(check: Check) -> CheckOutcome:
    try:
        got = check.run()
    except Exception as exc:  # a learner's bug is a failed check, never a crashed grader
        return CheckOutcome(check, False, describe_error(exc))
    try:
        ok = bool(check.same(got, check.expected))
    except Exception as exc:
        return CheckOutcome(check, False, f"{got!r} (could not be compared: {describe_error(exc)})")
    return CheckOutcome(check, ok, got)


class Outcomes(list):
    """What a check group returned, one ``CheckOutcome`` per check: the grader scores these. In a notebook a check
    cell's result shows nothing (the printed summary line is what a learner reads, and what nbval compares)."""

    def _ipython_display_(self) -> None:
        pass


def report(group: str, checks: Sequence[Check]) -> Outcomes:
    """Run a group of checks and print its summary line, then one block per failure."""
    if not SUMMARY_RE.match(f"{group}: 0/0 checks passed"):
        raise ValueError(f"check group name {group!r} must be letters, digits, '_', '.' or '-'")
    outcomes = Outcomes(run_check(c) for c in checks)
    passed = sum(o.passed for o in outcomes)
    lines = [f"{group}: {passed}/{len(outcomes)} checks passed"]
    for o in outcomes:
        if o.passed:
            continue
        got = o.got if isinstance(o.got, str) and o.got.split(":")[0].endswith("Error") else repr(o.got)
        lines.append(f"  ✗ tried    {o.check.tried}")
        lines.append(f"    expected {o.check.expected!r}")
        lines.append(f"    got      {got}")
        first = _first_difference(o.got, o.check.expected)
        if first:
            lines.append(f"    first    {first}")
        hint = _hint(o)
        if hint:
            lines.append(f"    hint     {hint}")
    print("\n".join(lines))
    return outcomes


def _first_difference(got: Any, expected: Any) -> str:
    """Where a trace (a list of steps or observations) first parts from the expected one: the line that marks the
    first wrong step, so that a long trace need not be read side by side."""
    if not isinstance(got, (list, tuple)) or not isinstance(expected, (list, tuple)) or len(expected) < 2:
        return ""
    for i, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            inner = _first_difference(a, b)
            return f"item {i} differs: got {a!r}, expected {b!r}" + (f"; within it, {inner}" if inner else "")
    if len(got) != len(expected):
        return f"the first {min(len(got), len(expected))} items agree; got {len(got)} items, expected {len(expected)}"
    return ""


def _hint(outcome: CheckOutcome) -> str:
    """The check's hint for this failure: its text, or what its function says of the value the check got."""
    hint = outcome.check.hint
    if not callable(hint):
        return hint
    try:
        return hint(outcome.got)
    except Exception as exc:  # a hint that cannot decide gives none, rather than hide the failure behind an error
        return f"(no hint: deciding which one fits raised {describe_error(exc)})"


def parse_summaries(text: str) -> list[tuple[str, int, int]]:
    """All ``group: passed/total checks passed`` lines in some printed text."""
    found = []
    for line in text.splitlines():
        m = SUMMARY_RE.match(line.strip())
        if m:
            found.append((m["group"], int(m["passed"]), int(m["total"])))
    return found


def close(rel: float = 1e-9) -> Callable[[Any, Any], bool]:
    """A comparison for floats: equal up to a relative tolerance."""

    def same(got: Any, expected: Any) -> bool:
        return abs(float(got) - float(expected)) <= rel * max(1.0, abs(float(expected)))

    return same
