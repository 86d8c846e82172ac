"""The processes of a tensor-parallel engine: rank 0 (the caller's process) starts the workers, feeds them each
step, and ends them — cleanly, or all at once when one of them fails (vLLM's ``MultiprocExecutor``).

::

    caller's process (rank 0)                      worker processes (ranks 1 … N−1), spawned
    ─────────────────────────                      ──────────────────────────────────────────
    Scheduler.schedule() ─▶ SchedulerOutput
    executor.step: broadcast it ─────────────────▶ worker_main: receive it
    forward_step (its shard) ◀── all-reduce ──────▶ forward_step (its shard)
    gather logits, sample   ◀── logits slices ─── (nothing to sample)
    Scheduler.update_from_output()                 wait for the next message

Why the caller's process is rank 0: the scheduler, the requests and the sampler live there, and a step's output
is plain data (``scheduler_output``), small enough to pickle every step. The workers keep no request state at all:
only their shard of the weights and of the KV cache. That is also why their block tables need no syncing: rank 0
sends the same block ids to everyone.

Failures end everything. A worker that dies closes its sockets, and rank 0's next collective raises at once; one
that hangs leaves rank 0 waiting ``distributed_timeout_s`` at most. Either way rank 0 names the rank and what
happened to it (its exit signal, the last line of its traceback), ends every other rank, and raises; the engine
is then closed, and a new ``LLM`` can be built in the same session. Ctrl-C in the caller does the same: a step
cut in half leaves the ranks in different places of their collectives, and no rank can be brought back in step.
Workers never outlive the caller: each watches its parent and leaves if it disappears, and they are daemonic, so
Python ends them at exit too.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.multiprocessing as mp

from .config import Config
from .distributed import TPGroup, check_tp_size, free_port, init_tp_group, open_store
from .model.llama import read_config
from .model_runner import GPUMemoryError, ModelRunner, free_device_memory, gpu_memory_report

T = TypeVar("T")
JOIN_S = 5.0  # a worker asked to stop gets this long to exit before it is killed


class TensorParallelError(RuntimeError):
    """A rank of a tensor-parallel engine died, hung, or the engine was already ended."""


def rendezvous(config: Config) -> tuple[str, int]:
    """Where the ranks meet: ``master_addr`` / ``master_port``, else ``$MASTER_ADDR`` / ``$MASTER_PORT``, else
    127.0.0.1 and a free port (one machine)."""
    host = config.master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = config.master_port or int(os.environ.get("MASTER_PORT") or 0) or free_port(host)
    return host, port


def make_runner(config: Config) -> ModelRunner:
    """The engine's model runner: in this process alone, or, with ``tensor_parallel_size`` > 1, rank 0 of a group
    whose other ranks this starts. A size the model cannot be split into is refused before any process starts."""
    if config.tensor_parallel_size == 1:
        return build_on_device(lambda: ModelRunner(config), config.torch_device)
    from .model_loader import ensure_converted

    path = ensure_converted(progress=True) if config.model is None else config.model
    check_tp_size(path, config.tensor_parallel_size)
    config = dataclasses.replace(config, model=path)  # the workers load the same folder
    executor = MultiprocExecutor(config, read_config(path).to_dict())
    return executor.guard("start-up", lambda: ModelRunner(config, tp=executor.group, executor=executor))


def build_on_device(build: Callable[[], T], device: torch.device) -> T:
    """``build()``; on a GPU that runs out of memory, once more after unreachable engines are collected, then a
    ``GPUMemoryError`` that names the engines of this process holding the card (a traceback from deep inside
    the allocator tells a learner who re-ran a cell nothing)."""
    if device.type != "cuda":
        return build()
    why = ""
    for _ in range(2):
        try:
            return build()
        except torch.OutOfMemoryError as e:
            why = str(e).splitlines()[0][:200]
        free_device_memory(device)  # outside the except: its traceback held the half-built engine's tensors
    raise GPUMemoryError(f"building the engine ran out of GPU memory ({why}).\n" + gpu_memory_report(device))


class _Ranks:
    """What must be ended however the engine ends (kept apart from the executor, so that a ``weakref.finalize``
    can end them when the engine is garbage-collected)."""

    def __init__(self) -> None:
        self.procs: list[Any] = []  # multiprocessing.Process, by rank - 1
        self.group: TPGroup | None = None
        self.store: Any = None
        self.ended = False

    def end(self, graceful: bool) -> None:
        if self.ended:
            return
        self.ended = True
        if graceful and self.group is not None:
            try:  # "stop": each worker leaves its loop and exits 0 (workers on other machines too)
                self.group.broadcast_object(None)
            except Exception:
                graceful = False
        for p in self.procs:
            p.join(JOIN_S if graceful else 0.2)
        for p in self.procs:  # a worker keeps nothing worth a clean exit: one that is still there is killed
            if p.is_alive():
                p.kill()
                p.join()
        if self.group is not None:
            self.group.destroy(abort=not graceful)
        self.group, self.store = None, None  # dropping the store stops its server


class MultiprocExecutor:
    """Rank 0's side of a tensor-parallel engine: the worker processes and this process's group."""

    def __init__(self, config: Config, hf_config: dict[str, Any]) -> None:
        self.size = config.tensor_parallel_size
        self.timeout_s = config.distributed_timeout_s
        self.host, self.port = rendezvous(config)
        self.closed_because: str | None = None
        self._ranks = _Ranks()
        self._lock = threading.RLock()  # one message sequence at a time, whichever thread asks
        weakref.finalize(self, self._ranks.end, True)
        store = open_store(self.host, self.port, self.size, True, self.timeout_s)
        self._ranks.store = store
        # for workers started by hand on other machines (bytes are fine: the stubs say str)
        store.set("config", pickle.dumps((config, hf_config)))  # type: ignore[arg-type]
        ctx = mp.get_context("spawn")
        local = self.size // config.nnodes
        for rank in range(1, local):
            p = ctx.Process(
                target=worker_main,
                args=(config, hf_config, rank, rank, local, self.host, self.port, os.getpid()),
                name=f"minipaged-tp-rank{rank}",
                daemon=True,
            )
            self._start(p)
        self.group: TPGroup = self.guard(
            "start-up", lambda: init_tp_group(0, self.size, store, config.torch_device, self.timeout_s)
        )
        self._ranks.group = self.group

    def _start(self, p: Any) -> None:
        try:
            p.start()
        except BaseException:
            self._ranks.end(graceful=False)
            raise
        self._ranks.procs.append(p)

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids (ranks 1 … on this machine)."""
        return [p.pid for p in self._ranks.procs]

    def alive(self) -> list[int]:
        """The ids of this machine's workers still running (none once the engine is shut down)."""
        return [p.pid for p in self._ranks.procs if p.is_alive()]

    # ---- what rank 0 sends -------------------------------------------------------------------------
    def step(self, forward: Callable[[Any], T], out: Any) -> T:
        """Send the step to every worker, then run rank 0's part of it (``forward(out)``)."""

        def run() -> T:
            self.group.broadcast_object(("step", out))
            return forward(out)

        return self.guard("a step", run)

    def call(self, method: str, *args: Any, mine: Callable[[], Any]) -> list[Any]:
        """Every rank's answer to ``ModelRunner.rpc_<method>(*args)``, in rank order (``mine()``: rank 0's, run
        once the workers have the call, since it may take part in collectives)."""

        def run() -> list[Any]:
            self.group.broadcast_object(("call", method, args))
            answers = self.group.gather_objects(mine())
            assert answers is not None  # rank 0 gathers
            return answers

        return self.guard(f"a call of {method!r}", run)

    def shutdown(self) -> None:
        """Stop every worker (they finish their loop and exit); safe to call twice."""
        with self._lock:
            self.closed_because = self.closed_because or "it was shut down"
            self._ranks.end(graceful=True)

    # ---- failures ------------------------------------------------------------------------------------
    def guard(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` (a message sequence with the workers); if it fails, end every rank and say why."""
        with self._lock:
            if self.closed_because is not None:
                raise TensorParallelError(
                    f"this engine's tensor-parallel ranks are gone ({self.closed_because}): build a new LLM"
                )
            try:
                if self._dead():
                    raise TensorParallelError("a worker is not running")
                return fn()
            except BaseException as e:
                if isinstance(e, Exception) and not _collective_failed(e):
                    # rank 0's own error (a pool too small, a bad weight file): the workers meet the same, or
                    # wait mid-step for a rank 0 that will not come. End them; the error is the caller's to read.
                    self.closed_because = f"rank 0 raised {type(e).__name__} during {what}"
                    self._ranks.end(graceful=False)
                    raise
                why = self._why(e)
                self.closed_because = f"{why}, during {what}"
                self._ranks.end(graceful=False)
                if not isinstance(e, Exception):  # Ctrl-C (KeyboardInterrupt), SystemExit: theirs to handle
                    raise
                raise TensorParallelError(
                    f"tensor parallelism failed during {what}: {why}. Every rank was ended; build a new LLM to go on"
                ) from e

    def _dead(self) -> list[tuple[int, Any]]:
        return [(rank, p) for rank, p in enumerate(self._ranks.procs, start=1) if p.exitcode is not None]

    def _why(self, exc: BaseException) -> str:
        """Which rank failed and how: its exit, its own error (written to the store), or the timeout."""
        if isinstance(exc, KeyboardInterrupt):
            return "interrupted (Ctrl-C) in the caller"
        deadline = time.monotonic() + 2.0  # a dead peer's sockets close before its exit code is known
        while not self._dead() and time.monotonic() < deadline:
            time.sleep(0.05)
        errors = self._worker_errors()
        parts = []
        for rank, p in self._dead():
            how = f"was killed by {signal.Signals(-p.exitcode).name}" if p.exitcode < 0 else f"exited ({p.exitcode})"
            parts.append(f"rank {rank} (pid {p.pid}) {how}" + (f": {errors.pop(rank)}" if rank in errors else ""))
        parts += [f"rank {rank} raised {err}" for rank, err in errors.items()]  # ranks on other machines
        if not parts:
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            parts.append(
                f"a rank did not answer within distributed_timeout_s={self.timeout_s:g} s, or a rank on another "
                f"machine went away ({first})"
            )
        return "; ".join(parts)

    def _worker_errors(self) -> dict[int, str]:
        store, found = self._ranks.store, {}
        for rank in range(1, self.size):
            key = f"error/{rank}"
            try:
                if store is not None and store.check([key]):
                    found[rank] = store.get(key).decode(errors="replace")
            except Exception:  # the store itself is gone: nothing more to learn
                break
        return found


def _collective_failed(e: BaseException) -> bool:
    """A collective broke (a peer closed its sockets, or a timeout), or a rank was found dead."""
    return isinstance(e, (TensorParallelError, torch.distributed.DistError))


# ---- the worker side ---------------------------------------------------------------------------------------
def worker_main(
    config: Config,
    hf_config: dict[str, Any],
    rank: int,
    local_rank: int,
    local_size: int,
    host: str,
    port: int,
    parent_pid: int | None,
) -> None:
    """A worker's whole life: join the group, build its runner (its shard), then run what rank 0 sends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the caller, which then ends every rank
    if parent_pid is not None:
        threading.Thread(target=_leave_when_orphaned, args=(parent_pid,), daemon=True).start()
    if config.torch_device.type == "cpu":  # share this machine's cores between its ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_size))
    store = tp = None
    try:
        store = open_store(host, port, config.tensor_parallel_size, False, config.distributed_timeout_s)
        tp = init_tp_group(
            rank, config.tensor_parallel_size, store, _device(config, local_rank), config.distributed_timeout_s
        )
        runner = ModelRunner(config, tp=tp, local_rank=local_rank, hf_config=hf_config)
        while (msg := tp.broadcast_object()) is not None:
            if msg[0] == "step":
                runner.forward_step(msg[1])
            else:
                _, method, args = msg
                tp.gather_objects(getattr(runner, f"rpc_{method}")(*args))
    except BaseException as e:
        last = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()[-1][:500]
        try:
            if store is not None:
                store.set(f"error/{rank}", last)
        except Exception:
            pass
        traceback.print_exc()
        os._exit(1)
    tp.destroy()


def _device(config: Config, local_rank: int) -> torch.device:
    d = config.torch_device
    return d if d.type != "cuda" else torch.device("cuda", (d.index or 0) + local_rank)


def _leave_when_orphaned(parent_pid: int) -> None:
    """Exit once the parent is gone (the caller was killed: nothing will ever send a step again)."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(0)


def run_node(host: str, port: int, node_rank: int, timeout_s: float = 600.0) -> int:
    """Run this machine's ranks of an engine whose rank 0 is elsewhere (``python -m minipaged worker``): fetch the
    engine's config from its rendezvous store, start ranks ``node_rank · k … node_rank · k + k − 1``, wait for
    them. Returns 0 when rank 0 shut them down cleanly, else 1."""
    store = open_store(host, port, None, False, timeout_s)  # waits for the engine's store to appear
    config, hf_config = pickle.loads(store.get("config"))
    local = config.tensor_parallel_size // config.nnodes
    if not 0 < node_rank < config.nnodes:
        raise ValueError(f"node_rank must be 1 … {config.nnodes - 1} (the engine's machine is node 0), got {node_rank}")
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=worker_main,
            args=(config, hf_config, node_rank * local + i, i, local, host, port, os.getpid()),
            name=f"minipaged-tp-rank{node_rank * local + i}",
        )
        for i in range(local)
    ]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join()
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join()
    return 0 if all(p.exitcode == 0 for p in procs) else 1
