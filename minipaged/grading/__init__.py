"""Grading for the course's exercises: check groups, one summary line each, and a folder grader.

Each exercise has its own module (``minipaged.grading.ex01`` ...) whose ``check_*``
functions a notebook's check cells call with the learner's code.
"""
from .core import Check, CheckOutcome, close, parse_summaries, report
from .runner import GroupScore, format_table, grade_folder, grade_notebook

__all__ = ["Check", "CheckOutcome", "GroupScore", "close", "format_table", "grade_folder",
           "grade_notebook", "parse_summaries", "report"]
