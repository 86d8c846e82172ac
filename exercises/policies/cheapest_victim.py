"""Preempt the running request with the least KV computed first: the cheapest to recompute.

FCFS preempts the newest, whatever it holds. A request that has computed little loses little when its blocks go,
so the pool is freed at the smallest recompute cost; a long request that has computed a lot keeps its place.
"""

from minipaged.classroom.policy import RequestView


def preemption_order(running: list[RequestView]) -> list[str]:
    cheapest_first = sorted(running, key=lambda r: (r.num_computed_tokens, -r.arrival_time))
    return [r.request_id for r in cheapest_first]
