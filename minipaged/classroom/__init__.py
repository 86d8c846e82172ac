"""What teaches and grades: a learner's parts plugged into the engine, the Triton puzzles, the kernel report and
access traces, the glossary, self-checks, ``show`` and ``sources``, the exercise checks (``classroom/grading/``)
and the widgets (``classroom/viz/``). It may import every layer below; nothing in the package imports it but
``__main__``."""
