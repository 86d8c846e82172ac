"""Grading for the course's exercises: check groups, one summary line each, and a folder grader.

Each exercise has its own module (``minipaged.classroom.grading.ex01`` ...) whose ``check_*`` functions a notebook's
check cells call with the learner's code (so a learner sees their score while working). The folder grader
(``runner.grade_folder``, ``python -m minipaged grade``) trusts none of those printed lines: it runs the
learner's code in a fresh process and calls the same check functions itself (``exercises.EXERCISES`` says which).
"""

from .core import Check, CheckOutcome, close, parse_summaries, report
from .runner import GroupScore, format_details, format_table, grade_folder, grade_notebook

__all__ = [
    "Check",
    "CheckOutcome",
    "GroupScore",
    "close",
    "format_details",
    "format_table",
    "grade_folder",
    "grade_notebook",
    "parse_summaries",
    "report",
]
