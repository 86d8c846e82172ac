"""Tensor parallelism's plumbing: the process groups of one engine, built on ``torch.distributed`` itself.

A tensor-parallel engine is ``N`` processes, one per rank. Rank 0 is the caller's process: it runs the scheduler
and samples. Ranks 1 … N−1 are workers that only run the model on their shard. They talk through two groups:

    wait group (gloo)    rank 0 ──"a message of n bytes"──▶ every worker
    cpu group (gloo)     rank 0 ──SchedulerOutput──▶ every worker, once a step (plain data, pickled)
                         rank 0 ◀──small answers──── every worker (pool sizes, what a rank holds)
    device group         all-reduce: two per layer (after o_proj and after down_proj), one after the embedding
    (gloo on CPU,        gather: the shards of the vocabulary's logits, to rank 0
     NCCL on CUDA)

They wait differently. A worker waits for the next step for as long as the caller takes to send one (a notebook
may sit idle for an hour): once joined, its wait group never times out, and all it ever carries is a length.
Everything else is bounded by ``timeout_s``: joining any of the groups (a rank that never comes must not hold the
others forever), rank 0's every wait, and every collective on the other two groups — once a message has begun
every rank is busy, so a collective that takes longer means a rank hung or died: it times out, and rank 0 turns
that into an error that names the rank (``executor``). mini-sglang and vLLM also keep
control (a gloo group) apart from the tensors (NCCL on a GPU).

The groups are *not* torch's default group (``init_process_group``): they are objects this engine owns, built on
a ``TCPStore`` (torch's own rendezvous: ``MASTER_ADDR:MASTER_PORT``). So the caller's process keeps no global
state: two engines may live side by side, and a failed one can be torn down and built again in the same session.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import pickle
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

FOREVER = datetime.timedelta(days=365)  # a joined worker's wait for the next step (its wait group only)
START_S = 60.0  # more than ``timeout_s`` that ranks may be apart at start-up: importing torch, loading weights
F = TypeVar("F", bound=Callable[..., Any])


class CollectiveError(dist.DistError):
    """A collective of the engine's groups failed: a peer closed its sockets (it died), or it timed out."""


def _collective(method: F) -> F:
    """Raise a collective's failure as a ``CollectiveError`` (gloo raises plain RuntimeErrors, some of them
    without a word of gloo in them), so that rank 0 can tell a broken group from an error of its own."""

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except RuntimeError as e:
            if isinstance(e, CollectiveError):
                raise
            raise CollectiveError(f"{method.__name__}: {str(e).strip() or type(e).__name__}") from e

    return cast(F, wrapped)


def seconds(timeout_s: float) -> datetime.timedelta:
    """``timeout_s`` as torch's timeouts take it; a year at most (more overflows a timedelta, and means never)."""
    return datetime.timedelta(seconds=min(timeout_s, FOREVER.total_seconds()))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def open_store(host: str, port: int, world_size: int | None, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """torch's rendezvous store at ``host:port``: rank 0 serves it, every other rank connects (retrying until
    ``timeout_s``, so a worker may start before the engine does)."""
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master=is_master,
        timeout=seconds(timeout_s),
        wait_for_workers=False,
    )


@dataclass
class TPGroup:
    """One rank's view of its engine's tensor-parallel group: who it is, and the collectives the model needs.

    ``comm_s`` and ``num_all_reduces`` add up the time spent in the device group's collectives (their wall time,
    which includes waiting for the slowest rank to arrive): the benchmark splits a step with them.
    """

    rank: int
    size: int
    device_group: Any  # torch.distributed.ProcessGroup: all-reduce and gather of tensors
    cpu_group: Any  # gloo: pickled objects (scheduler outputs, answers)
    wait_group: Any  # gloo: "a message is coming", which a worker may wait for for hours (rank 0: ``timeout``)
    store: dist.TCPStore
    timeout: datetime.timedelta  # every wait for a rank once started (``settle``); before, START_S more
    comm_s: float = 0.0
    num_all_reduces: int = 0
    bytes_all_reduced: int = 0

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    # ---- tensors (device group) -----------------------------------------------------------------
    @_collective
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over every rank, in place (each rank then holds the same sum); returns ``t``."""
        t0 = time.perf_counter()
        dist.all_reduce(t, group=self.device_group)
        self.comm_s += time.perf_counter() - t0
        self.num_all_reduces += 1
        self.bytes_all_reduced += t.numel() * t.element_size()
        return t

    @_collective
    def gather_last_dim(self, t: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``t`` concatenated along the last dimension, on rank 0 (None on the others)."""
        t = t.contiguous()
        t0 = time.perf_counter()
        parts = [torch.empty_like(t) for _ in range(self.size)] if self.is_driver else None
        dist.gather(t, parts, group_dst=0, group=self.device_group)
        self.comm_s += time.perf_counter() - t0
        return torch.cat(parts, dim=-1) if parts is not None else None

    @_collective
    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value`` (each rank sizes its own pool; all must agree on one size)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    # ---- objects (cpu group) --------------------------------------------------------------------
    @_collective
    def broadcast_object(self, obj: Any = None, timeout: datetime.timedelta | None = None) -> Any:
        """Rank 0 sends ``obj`` (pickled) to every rank; every rank returns it.

        The length goes first, on the wait group, which never times out for a worker: it may wait there for the
        next step as long as the caller likes (rank 0 waits ``timeout``, default ``self.timeout``, for the
        workers to take it). The bytes
        follow on the cpu group, which times out like the device group: once a message has begun, every rank is
        expected to take part at once."""
        if self.is_driver:
            data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
            length = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        sent = dist.broadcast(length, group_src=0, group=self.wait_group, async_op=True)
        # gloo's sender waits for each receiver to be ready: a hung worker would hold rank 0 here forever
        sent.wait(timeout or self.timeout) if self.is_driver else sent.wait()
        if not self.is_driver:
            data = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.broadcast(data, group_src=0, group=self.cpu_group)
        return obj if self.is_driver else pickle.loads(data.numpy().tobytes())

    @_collective
    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` in rank order, on rank 0 (None on the others)."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        longest = torch.tensor([data.numel()], dtype=torch.int64)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=self.cpu_group)
        n = int(longest.item())
        padded = torch.zeros(n + 8, dtype=torch.uint8)  # 8 bytes of length, then the pickle, then zeros
        padded[:8] = torch.tensor([data.numel()], dtype=torch.int64).view(torch.uint8)
        padded[8 : 8 + data.numel()] = data
        parts = [torch.empty_like(padded) for _ in range(self.size)] if self.is_driver else None
        dist.gather(padded, parts, group_dst=0, group=self.cpu_group)
        if parts is None:
            return None
        out = []
        for p in parts:
            length = int(p[:8].view(torch.int64).item())
            out.append(pickle.loads(p[8 : 8 + length].numpy().tobytes()))
        return out

    def settle(self) -> None:
        """Start-up is over (every rank built its runner): from now on a collective waits ``timeout`` at most, not
        the start-up's ``START_S`` more. A worker's wait group keeps waiting for the next step without end."""
        for g in (self.device_group, self.cpu_group) + ((self.wait_group,) if self.is_driver else ()):
            try:
                g.set_timeout(self.timeout)
            except Exception:  # a backend (or a torch) that cannot: it keeps the start-up's bound, no worse
                pass

    def destroy(self, abort: bool = False) -> None:
        """Let go of the groups (their sockets close; a peer still waiting on one gets an error). ``abort``: do
        not wait for anything in flight (a peer died or hung)."""
        for g in (self.device_group, self.cpu_group, self.wait_group):
            try:
                g.abort() if abort else g.shutdown()
            except Exception:  # already broken by a dead peer: closing it is all that is left
                pass


def init_tp_group(
    rank: int, size: int, store: dist.TCPStore, device: torch.device, timeout_s: float, prefix: str = "tp"
) -> TPGroup:
    """Build this rank's three groups on ``store``; returns once every rank has joined (or raises after
    ``timeout_s`` + ``START_S``). Every rank of the engine calls it with the same ``prefix``. Until ``settle()``
    the groups allow ``START_S`` more than ``timeout_s``: ranks load their weights at their own pace."""
    start = seconds(timeout_s + START_S)
    # Joining is bounded on every group: gloo waits for the other ranks' addresses with the group's timeout, and
    # a wait group built with FOREVER held rank 0 for a year when a worker died before it joined.
    wait = dist.ProcessGroupGloo(dist.PrefixStore(f"{prefix}/wait", store), rank, size, start)
    cpu = dist.ProcessGroupGloo(dist.PrefixStore(f"{prefix}/cpu", store), rank, size, start)
    dev: Any
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = start
        dev = dist.ProcessGroupNCCL(dist.PrefixStore(f"{prefix}/nccl", store), rank, size, options)
    else:
        dev = dist.ProcessGroupGloo(dist.PrefixStore(f"{prefix}/gloo", store), rank, size, start)
    group = TPGroup(rank, size, dev, cpu, wait, store, seconds(timeout_s))
    group.min_int(0)  # a first collective on each group: returns once every rank is there
    dist.all_reduce(torch.zeros(1, device=device), group=dev)
    if rank != 0:  # joined: from now on a worker waits for the next step as long as the caller takes
        wait.set_timeout(FOREVER)
    return group


# ---- which sizes a model can be split into -------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """What a tensor-parallel split must divide: read from a model folder's config.json, without the weights."""

    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int

    @classmethod
    def of(cls, path: str | os.PathLike) -> Shape:
        try:
            cfg = json.loads((Path(path) / "config.json").read_text())
            heads = int(cfg["num_attention_heads"])
            return cls(
                heads,
                int(cfg.get("num_key_value_heads") or heads),
                int(cfg["intermediate_size"]),
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"cannot read the model's shape from {Path(path) / 'config.json'}: {e}") from None

    def sizes_that_work(self, up_to: int = 64) -> list[int]:
        return [n for n in range(1, up_to + 1) if not self.why_not(n)]

    def why_not(self, size: int) -> str:
        """Why ``size`` ranks cannot each hold whole heads and an equal slice of the MLP ('' if they can)."""
        parts = [
            f"{what}={n}"
            for what, n in (
                ("num_key_value_heads", self.num_key_value_heads),
                ("num_attention_heads", self.num_attention_heads),
                ("intermediate_size", self.intermediate_size),
            )
            if n % size
        ]
        return " and ".join(parts)


def check_tp_size(path: str | os.PathLike, size: int) -> Shape:
    """Refuse, before any process starts, a size that does not divide the model's KV heads, query heads and MLP.

    Each rank must hold whole KV heads: a rank's paged pool then holds *its* heads of every block, and every
    rank's block table is the same. (vLLM also allows more ranks than KV heads by copying a KV head to several
    ranks; this engine does not.)"""
    shape = Shape.of(path)
    why = shape.why_not(size)
    if why:
        works = ", ".join(map(str, shape.sizes_that_work(max(size, shape.num_key_value_heads))))
        raise ValueError(
            f"tensor_parallel_size={size} does not divide {why}: each rank must hold an equal share of whole "
            f"heads and of the MLP. Sizes that work for this model: {works}"
        )
    return shape
