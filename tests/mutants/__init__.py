"""Wrong solutions to the exercises, written the way a learner gets them wrong (issue 16, item 3).

One module per exercise (``ex01`` ... ``ex10``, ``ex03b``, ``ex04b``, ``ex05b``, ``ex05c`` and ``ex05d`` (the Triton puzzles), ``ex05e``, ``ex06b``, ``ex09b``, ``ex09c``, ``ex10b``;
``ex11``, ``ex12``, ``ex13``, ``ex14``). In each, a
function decorated with ``@mutant(target, mistake)`` is a wrong version of the exercise function
``target``; the line that differs from the reference solution is marked ``# MISTAKE``. ``CHECKS`` names the check
functions of ``minipaged.grading.exNN`` that grade ``target`` (a mutant runs through all of them,
or through the ones its ``checks=`` names), and ``HELPERS`` holds correct
copies of the functions the mutants lean on (part 1 of an exercise, used by a part 2 mutant).

``tests/test_mutants.py`` runs every mutant through its checks and asserts that none gets full
marks; ``python tests/test_mutants.py`` prints the score table.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

EXERCISES = [
    *(f"ex{n:02d}" for n in range(1, 4)),
    "ex03b",
    "ex04",
    "ex04b",
    "ex05",
    "ex05b",
    "ex05c",
    "ex05d",
    "ex05e",
    "ex06",
    "ex06b",
    "ex07",
    "ex08",
    "ex09",
    "ex09b",
    "ex09c",
    "ex10",
    "ex10b",
    "ex11",
    "ex12",
    "ex13",
    "ex14",
]


def mutant(target: str, mistake: str, checks: Sequence[str] | None = None) -> Callable[[Callable], Callable]:
    """Mark a function as a wrong version of the exercise function ``target``.

    ``checks``: the check functions that must catch it, when not all of the module's ``CHECKS[target]`` (used
    where a group is slow, e.g. the Triton interpreter's, and the mistake is about another group's cases).
    """

    def register(fn: Callable) -> Callable:
        fn.mutant_of = target
        fn.mistake = mistake
        fn.mutant_checks = None if checks is None else tuple(checks)
        return fn

    return register


@dataclass(frozen=True)
class Mutant:
    exercise: str  # "ex01"
    name: str  # the function's name in tests/mutants/exNN.py
    target: str  # the exercise function it stands in for
    mistake: str  # the learner's mistake it models, in one line
    fn: Callable
    checks: tuple[str, ...]  # check functions of minipaged.grading.exNN that grade it


def module(exercise: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{exercise}")


def collect(exercise: str) -> list[Mutant]:
    """The exercise's mutants, in the order they are defined."""
    mod = module(exercise)
    found = []
    for name, obj in vars(mod).items():
        if callable(obj) and hasattr(obj, "mutant_of"):
            checks = obj.mutant_checks or tuple(mod.CHECKS[obj.mutant_of])
            if not set(checks) <= set(mod.CHECKS[obj.mutant_of]):
                raise ValueError(f"{exercise}.{name}: {checks} are not checks of {obj.mutant_of}")
            found.append(Mutant(exercise, name, obj.mutant_of, obj.mistake, obj, checks))
    return found


def all_mutants() -> list[Mutant]:
    return [m for ex in EXERCISES for m in collect(ex)]
