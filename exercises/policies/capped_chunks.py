"""Cap every prefill at 256 prompt tokens a step, whatever the budget leaves.

A long prompt then takes several steps, and the decodes that share each step wait less behind it (lower
inter-token latency), at the price of that prompt's own first token coming later.
"""

from minipaged.classroom.policy import RequestView


def prefill_cap(request: RequestView) -> int:
    return 256
