"""Checks for exercise 12: a tensor-parallel MLP, whose all-reduce is the learner's own ring.

The learner writes three functions:

* ``all_reduce(tensors, send) -> list[Tensor]``: ``tensors[r]`` is rank ``r``'s tensor; every rank must end with
  their sum. Data moves between ranks only through ``send(src, dst, tensor)``, which the grader provides and
  watches: the ring algorithm (a reduce-scatter, then an all-gather, each ``N - 1`` rounds in which every rank
  sends one ``1/N`` chunk to the next rank) sends ``2 (N - 1) / N`` of the tensor per rank, the least any
  all-reduce can (Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations",
  JPDC 2009), and only between neighbours.
* ``shard_mlp(weights, rank, world_size) -> dict``: rank ``r``'s slice of a Llama MLP, Megatron-LM's split (as
  ``minipaged/model/parallel.py`` and vLLM's ``ColumnParallelLinear`` / ``RowParallelLinear`` make it):
  ``gate_proj`` and ``up_proj`` column-parallel (a slice of their output rows), ``down_proj`` row-parallel (the
  matching slice of its input columns).
* ``mlp_partial(x, shard) -> Tensor``: rank ``r``'s partial output, ``down_r(silu(gate_r x) * up_r x)``.

``ring``: sums, links and bytes on groups of 2 to 5 ranks and tensors whose size ``N`` divides or not.
``tp_mlp``: the learner's shards and partials, summed by the learner's all-reduce, against the whole MLP (random
weights of SmolLM2's shape, 576 → 1536 → 576), with each rank holding ``1/N`` of the weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .core import Check, CheckOutcome, report

AllReduce = Callable[[list[torch.Tensor], Callable[[int, int, torch.Tensor], torch.Tensor]], list[torch.Tensor]]
HIDDEN, INTER = 576, 1536  # SmolLM2-135M's MLP


class Ring:
    """A group of ``n`` simulated ranks whose only channel is ``send``: it hands over a copy and counts, per rank,
    the messages and elements sent and the ranks sent to."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.messages = [0] * n
        self.elements = [0] * n
        self.to: list[set[int]] = [set() for _ in range(n)]

    def send(self, src: int, dst: int, tensor: torch.Tensor) -> torch.Tensor:
        if not (0 <= src < self.n and 0 <= dst < self.n) or src == dst:
            raise ValueError(f"send({src}, {dst}): ranks are 0..{self.n - 1}, and a rank does not send to itself")
        self.messages[src] += 1
        self.elements[src] += tensor.numel()
        self.to[src].add(dst)
        return tensor.detach().clone()


def ring_run(all_reduce: AllReduce, n: int, shape: tuple[int, ...], seed: int) -> dict[str, Any]:
    """Run the learner's all-reduce on ``n`` seeded tensors; what it returned and what it sent."""
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(shape, generator=g) for _ in range(n)]
    before = [t.clone() for t in tensors]
    ring = Ring(n)
    out = all_reduce([t for t in tensors], ring.send)
    return {"tensors": before, "after": tensors, "out": out, "ring": ring, "want": torch.stack(before).sum(0)}


def _sums(r: dict[str, Any]) -> str:
    out, want = r["out"], r["want"]
    if not isinstance(out, (list, tuple)) or len(out) != len(r["tensors"]):
        return f"expected a list of {len(r['tensors'])} tensors, got {type(out).__name__}"
    for rank, t in enumerate(out):
        if not isinstance(t, torch.Tensor) or t.shape != want.shape:
            return f"rank {rank}: {getattr(t, 'shape', type(t).__name__)}, expected shape {tuple(want.shape)}"
        if not torch.allclose(t, want, atol=1e-5, rtol=1e-5):
            return f"rank {rank}'s result is not the sum (off by up to {float((t - want).abs().max()):.3g})"
    if any(not torch.equal(a, b) for a, b in zip(r["after"], r["tensors"])):
        return "an input tensor was changed: each rank's own tensor is read, not written"
    return "the sum on every rank"


def _links(r: dict[str, Any]) -> str:
    ring: Ring = r["ring"]
    for rank, dsts in enumerate(ring.to):
        if dsts != {(rank + 1) % ring.n}:
            return f"rank {rank} sent to {sorted(dsts)}: a ring sends only to the next rank, {(rank + 1) % ring.n}"
    return "each rank sends only to the next"


def _volume(r: dict[str, Any]) -> tuple[str, str]:
    ring: Ring = r["ring"]
    n, numel = ring.n, r["want"].numel()
    rounds = ["2(N - 1) messages each" if m == 2 * (n - 1) else f"rank {i}: {m} messages" for i, m in
              enumerate(ring.messages)]  # fmt: skip
    msg = next((x for x in rounds if x.startswith("rank")), rounds[0])
    chunk = -(-numel // n)
    total_ok = sum(ring.elements) == 2 * (n - 1) * numel
    most = max(ring.elements)
    vol = (
        "2(N - 1)/N of the tensor per rank"
        if total_ok and most <= 2 * (n - 1) * chunk
        else f"elements sent per rank {ring.elements} for {numel}-element tensors: a ring sends 2(N - 1) chunks of "
        f"about numel/N ({2 * (n - 1) * numel} in all)"
    )
    return msg, vol


RING_CASES = [(2, (8,)), (3, (12, 4)), (4, (10,)), (5, (7, 3)), (3, (2,))]  # sizes N divides, and not


def check_ring(all_reduce: AllReduce) -> list[CheckOutcome]:
    """The learner's all-reduce on groups of 2 to 5 ranks: sums, links, messages and volume, as a ring has them."""
    cache: dict[int, dict[str, Any]] = {}

    def run(i: int) -> dict[str, Any]:
        if i not in cache:
            n, shape = RING_CASES[i]
            cache[i] = ring_run(all_reduce, n, shape, seed=i)
        return cache[i]

    def verdict(i: int) -> list[str]:
        r = run(i)
        return [_sums(r), _links(r), *_volume(r)]

    want = ["the sum on every rank", "each rank sends only to the next", "2(N - 1) messages each",
            "2(N - 1)/N of the tensor per rank"]  # fmt: skip
    hint = (
        "the first entry that differs names the trouble: sums (the chunks a rank adds or keeps: replay the spec's "
        "3-rank table round by round), links (only to the next rank), messages and volume (one chunk per round, "
        "a reduce-scatter then an all-gather)"
    )

    def label(n: int, shape: tuple[int, ...]) -> str:
        kind = "N divides the size" if torch.Size(shape).numel() % n == 0 else "chunks of unequal size"
        return f"{n} ranks, tensors of shape {shape} ({kind}): [sums, links, messages, volume]"

    checks = [
        Check(label(n, shape), lambda i=i: verdict(i), want, hint=hint) for i, (n, shape) in enumerate(RING_CASES)
    ]
    checks.append(
        Check(
            "3 ranks, shape (12, 4), through a send that delivers zeros: no rank may end with the true sum",
            lambda: _carried(all_reduce),
            CARRIED,
            hint="each rank knows the others' tensors only through what send hands it: add what it returns, never "
            "the other ranks' tensors from the list",
        )
    )
    return report("ring", checks)


CARRIED = "the result follows what the ring carried"


class _ZeroRing(Ring):
    """A ring whose links lose every payload: it delivers zeros of the same shape."""

    def send(self, src: int, dst: int, tensor: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(super().send(src, dst, tensor))


def _carried(all_reduce: AllReduce) -> str:
    """A sum computed from the list of every rank's tensor, not from what the ring delivered, is the same whatever
    the ring carries: with a ring that delivers zeros, a real ring's ranks cannot reach the sum."""
    g = torch.Generator().manual_seed(12)
    tensors = [torch.randn(12, 4, generator=g) for _ in range(3)]
    want = torch.stack(tensors).sum(0)
    out = all_reduce([t.clone() for t in tensors], _ZeroRing(3).send)
    for rank, t in enumerate(out):
        if isinstance(t, torch.Tensor) and t.shape == want.shape and torch.allclose(t, want, atol=1e-5):
            return (f"rank {rank} ended with the sum though every message it received held zeros: the sum was taken "
                    "from the other ranks' tensors, not from the ring")  # fmt: skip
    return CARRIED


# ---- the tensor-parallel MLP -------------------------------------------------------------------------------------
def mlp_weights(seed: int) -> dict[str, torch.Tensor]:
    """Random weights of SmolLM2's MLP shape, transformers' names (``gate_proj``, ``up_proj``, ``down_proj``)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "gate_proj": torch.randn(INTER, HIDDEN, generator=g) / HIDDEN**0.5,
        "up_proj": torch.randn(INTER, HIDDEN, generator=g) / HIDDEN**0.5,
        "down_proj": torch.randn(HIDDEN, INTER, generator=g) / INTER**0.5,
    }


def full_mlp(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    return (F.silu(x @ w["gate_proj"].T) * (x @ w["up_proj"].T)) @ w["down_proj"].T


def _tp_case(shard_mlp: Callable, mlp_partial: Callable, all_reduce: AllReduce, n: int, rows: int) -> list[str]:
    w = mlp_weights(seed=n)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(10 + n))
    shards = [shard_mlp({k: v.clone() for k, v in w.items()}, r, n) for r in range(n)]
    held = [sum(t.numel() for t in s.values()) for s in shards]
    size = sum(t.numel() for t in w.values())
    memory = "1/N of the weights each" if held == [size // n] * n else f"elements held per rank {held} of {size}"
    partials = [mlp_partial(x.clone(), s) for s in shards]
    ring = Ring(n)
    summed = all_reduce(partials, ring.send)
    want = full_mlp(x, w)
    err = max(float((t - want).abs().max()) for t in summed)
    scale = float(want.abs().max())
    same = (
        "the whole MLP's output on every rank"
        if err <= 1e-4 * scale
        else f"off by up to {err:.3g} (values ~{scale:.2g})"
    )
    return [same, memory]


def reference_shard(weights: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """Megatron-LM's split, as ``model/parallel.py`` makes it: contiguous slices of the hidden units."""
    inter = weights["gate_proj"].shape[0]
    lo, hi = rank * inter // world_size, (rank + 1) * inter // world_size
    return {"gate_proj": weights["gate_proj"][lo:hi], "up_proj": weights["up_proj"][lo:hi],
            "down_proj": weights["down_proj"][:, lo:hi]}  # fmt: skip


def reference_partial(x: torch.Tensor, shard: dict[str, torch.Tensor]) -> torch.Tensor:
    return full_mlp(x, shard)


def sum_all_reduce(tensors: list[torch.Tensor], send: Any) -> list[torch.Tensor]:
    """Not a ring: the sum handed to every rank, for the checks that grade the other two functions alone."""
    total = torch.stack(tensors).sum(0)
    return [total.clone() for _ in tensors]


def check_shards(shard_mlp: Callable) -> list[CheckOutcome]:
    """The learner's shards with the package's partial and sum: the whole MLP, 1/N of the weights per rank. Any
    split that keeps each hidden unit's gate row, up row and down column together on one rank is right."""
    hint = "a hidden unit's gate row, up row and down column must live on the same rank; N ranks, 1/N of them each"
    return report(
        "shards",
        [
            Check(f"{n} ranks: [output, weights held]",
                  lambda n=n: _tp_case(shard_mlp, reference_partial, sum_all_reduce, n, 3),
                  ["the whole MLP's output on every rank", "1/N of the weights each"], hint=hint)
            for n in (2, 3, 4)
        ],
    )  # fmt: skip


def check_partial(mlp_partial: Callable) -> list[CheckOutcome]:
    """The learner's partial output on the package's shards, summed: the whole MLP."""
    hint = (
        "the spec's MLP on this rank's units alone, the nonlinearity before the last projection; no residual, no sum "
        "over ranks: the all-reduce adds the partials up, once"
    )
    return report(
        "partial",
        [
            Check(f"{n} ranks, {rows} rows: [output, weights held]",
                  lambda n=n, rows=rows: _tp_case(reference_shard, mlp_partial, sum_all_reduce, n, rows),
                  ["the whole MLP's output on every rank", "1/N of the weights each"], hint=hint)
            for n, rows in ((2, 4), (3, 1))
        ],
    )  # fmt: skip


def check_tp_mlp(shard_mlp: Callable, mlp_partial: Callable, all_reduce: AllReduce) -> list[CheckOutcome]:
    """The learner's shards and partial outputs, summed by the learner's all-reduce, against the whole MLP."""
    hint = (
        "your three functions together: the ring, shards and partial checks above name the one that is wrong (a "
        "unit's gate row, up row and down column on one rank; a partial with no residual and no sum)"
    )
    return report(
        "tp_mlp",
        [
            Check(f"SmolLM2-shaped MLP ({HIDDEN} → {INTER} → {HIDDEN}, random weights) on {n} ranks, {rows} rows, "
                  "summed by your all_reduce: [output, weights held]",
                  lambda n=n, rows=rows: _tp_case(shard_mlp, mlp_partial, all_reduce, n, rows),
                  ["the whole MLP's output on every rank", "1/N of the weights each"], hint=hint)
            for n, rows in ((2, 5), (3, 1), (4, 7))
        ],
    )  # fmt: skip
