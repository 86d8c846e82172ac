"""Shortest job first: try the waiting request with the least work left (prompt and outputs so far) first.

Short requests reach their first token sooner and leave sooner, which frees their blocks for the rest; a long
prompt may wait behind a stream of short ones (starvation), which p99 TTFT shows.
"""

from minipaged.classroom.policy import RequestView


def admission_order(waiting: list[RequestView]) -> list[str]:
    by_work = sorted(waiting, key=lambda r: (r.num_tokens - r.num_computed_tokens, r.arrival_time))
    return [r.request_id for r in by_work]
