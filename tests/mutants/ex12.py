"""Exercise 12 — a tensor-parallel MLP with a ring all-reduce: versions a learner gets wrong, one mistake each.

The helpers are right answers written differently from the solution notebook's: ``ring_by_rounds`` keeps each
rank's chunks as a dict and indexes rounds from the receiving side; ``interleaved_shards`` gives rank ``r`` the
hidden units ``r, r + N, r + 2N, …`` (any split that keeps a unit's gate row, up row and down column together is
right); ``partial_by_linear`` uses ``F.linear``. Each mutant is one mistake away from one of them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from . import mutant

CHECKS = {"all_reduce": ["check_ring"], "shard_mlp": ["check_shards"], "mlp_partial": ["check_partial"]}


def ring_by_rounds(tensors: list[torch.Tensor], send: Any) -> list[torch.Tensor]:
    n = len(tensors)
    parts = [dict(enumerate(t.flatten().clone().tensor_split(n))) for t in tensors]
    for s in range(n - 1):
        got = {(r + 1) % n: send(r, (r + 1) % n, parts[r][(r - s) % n]) for r in range(n)}
        for r, chunk in got.items():
            parts[r][(r - 1 - s) % n] = parts[r][(r - 1 - s) % n] + chunk
    for s in range(n - 1):
        got = {(r + 1) % n: send(r, (r + 1) % n, parts[r][(r + 1 - s) % n]) for r in range(n)}
        for r, chunk in got.items():
            parts[r][(r - s) % n] = chunk
    return [torch.cat([p[i] for i in range(n)]).view_as(t) for p, t in zip(parts, tensors)]


def interleaved_shards(weights: dict, rank: int, world_size: int) -> dict:
    units = torch.arange(rank, weights["gate_proj"].shape[0], world_size)
    return {"gate_proj": weights["gate_proj"][units], "up_proj": weights["up_proj"][units],
            "down_proj": weights["down_proj"][:, units]}  # fmt: skip


def partial_by_linear(x: torch.Tensor, shard: dict) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, shard["gate_proj"])) * F.linear(x, shard["up_proj"]), shard["down_proj"])


HELPERS: dict = {"all_reduce": ring_by_rounds, "shard_mlp": interleaved_shards, "mlp_partial": partial_by_linear}


@mutant("all_reduce", "every rank sends its whole tensor to every other rank: N - 1 times the ring's bytes")
def all_to_all(tensors: list[torch.Tensor], send: Any) -> list[torch.Tensor]:
    n = len(tensors)
    out = []
    for r in range(n):
        total = tensors[r].clone()
        for q in range(n):
            if q != r:
                total = total + send(q, r, tensors[q])  # MISTAKE: a ring sends 1/N chunks to the next rank only
        out.append(total)
    return out


@mutant("all_reduce", "reduce to rank 0, then broadcast: rank 0's link carries everything")
def through_rank_0(tensors: list[torch.Tensor], send: Any) -> list[torch.Tensor]:
    n = len(tensors)
    total = tensors[0].clone()
    for q in range(1, n):
        total = total + send(q, 0, tensors[q])  # MISTAKE: a ring spreads the work over every link
    return [total] + [send(0, q, total) for q in range(1, n)]


@mutant("all_reduce", "the reduce-scatter alone: each rank holds one summed chunk, the rest stay partial")
def no_all_gather(tensors: list[torch.Tensor], send: Any) -> list[torch.Tensor]:
    n = len(tensors)
    chunks = [list(t.flatten().clone().tensor_split(n)) for t in tensors]
    for step in range(n - 1):
        sent = [send(r, (r + 1) % n, chunks[r][(r - step) % n]) for r in range(n)]
        for r in range(n):
            c = (r - 1 - step) % n
            chunks[r][c] = chunks[r][c] + sent[(r - 1) % n]
    return [torch.cat(c).view_as(t) for c, t in zip(chunks, tensors)]  # MISTAKE: N - 1 rounds of all-gather


@mutant("all_reduce", "the chunk sent in round s is chunk s, not (r - s) mod N: ranks add the wrong chunks")
def same_chunk_everywhere(tensors: list[torch.Tensor], send: Any) -> list[torch.Tensor]:
    n = len(tensors)
    chunks = [list(t.flatten().clone().tensor_split(n)) for t in tensors]
    for step in range(n - 1):
        sent = [send(r, (r + 1) % n, chunks[r][step % n]) for r in range(n)]  # MISTAKE: (r - step) % n
        for r in range(n):
            c = (r - 1 - step) % n
            chunks[r][c] = chunks[r][c] + sent[(r - 1) % n]
    for step in range(n - 1):
        sent = [send(r, (r + 1) % n, chunks[r][(r + 1 - step) % n]) for r in range(n)]
        for r in range(n):
            chunks[r][(r - step) % n] = sent[(r - 1) % n]
    return [torch.cat(c).view_as(t) for c, t in zip(chunks, tensors)]


@mutant("shard_mlp", "down_proj split by its output rows, like gate and up: the shapes no longer chain")
def down_by_rows(weights: dict, rank: int, world_size: int) -> dict:
    out = interleaved_shards(weights, rank, world_size)
    rows = torch.arange(rank, weights["down_proj"].shape[0], world_size)
    out["down_proj"] = weights["down_proj"][rows]  # MISTAKE: row-parallel takes input columns
    return out


@mutant("shard_mlp", "gate and up split differently: a unit's gate and up end up on different ranks")
def mismatched_gate_up(weights: dict, rank: int, world_size: int) -> dict:
    out = interleaved_shards(weights, rank, world_size)
    inter = weights["up_proj"].shape[0]
    lo, hi = rank * inter // world_size, (rank + 1) * inter // world_size
    out["up_proj"] = weights["up_proj"][lo:hi]  # MISTAKE: the same units as gate_proj
    return out


@mutant("shard_mlp", "every rank keeps the whole MLP: right sums after dividing, N times the memory")
def replicated(weights: dict, rank: int, world_size: int) -> dict:
    down = weights["down_proj"] / world_size  # MISTAKE: 1/N of the units each, not all of them scaled
    return {"gate_proj": weights["gate_proj"], "up_proj": weights["up_proj"], "down_proj": down}


@mutant("mlp_partial", "silu after the down projection: the nonlinearity lands on a partial sum")
def silu_late(x: torch.Tensor, shard: dict) -> torch.Tensor:
    gated = F.linear(x, shard["gate_proj"]) * F.linear(x, shard["up_proj"])
    return F.silu(F.linear(gated, shard["down_proj"]))  # MISTAKE: silu(gate x) * up x, then down


@mutant("mlp_partial", "the residual added on every rank: the sum holds it N times")
def residual_everywhere(x: torch.Tensor, shard: dict) -> torch.Tensor:
    return x + partial_by_linear(x, shard)  # MISTAKE: the layer adds the residual once, after the all-reduce


@mutant("all_reduce", "the ring's messages sent, but the sum taken from every rank's tensor in the list")
def sums_locally(tensors: list[torch.Tensor], send: Any) -> list[torch.Tensor]:
    n = len(tensors)
    for step in range(2 * (n - 1)):  # the ring's messages, chunk for chunk, to satisfy the counters
        for r in range(n):
            send(r, (r + 1) % n, tensors[r].flatten().tensor_split(n)[(r - step) % n])
    total = torch.stack(tensors).sum(0)  # MISTAKE: the sum of what the ring delivered
    return [total.clone() for _ in range(n)]
