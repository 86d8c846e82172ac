"""Executors: what the step driver hands a step to (``engine/step.py``'s ``Executor``). ``UniProcExecutor`` runs
the model runner in this process; ``MultiprocExecutor`` runs one runner per tensor-parallel rank: rank 0 (the
caller's process) starts the workers, feeds them each step, and ends them — cleanly, or all at once when one of
them fails (vLLM's ``MultiprocExecutor``). ``LLM`` holds one of them (``make_executor``); the runner knows
nothing of either.

::

    caller's process (rank 0)                      worker processes (ranks 1 … N−1), fresh interpreters
    ─────────────────────────                      ──────────────────────────────────────────────────────
    Scheduler.schedule() ─▶ SchedulerOutput
    executor.execute: broadcast it ──────────────▶ worker_main: receive it
    forward_step (its shard) ◀── all-reduce ──────▶ forward_step (its shard)
    gather logits, sample   ◀── logits slices ─── (nothing to sample)
    Scheduler.update_from_output()                 wait for the next message

Why the caller's process is rank 0: the scheduler, the requests and the sampler live there, and a step's output
is plain data (``scheduler_output``), small enough to pickle every step: a request's block table travels once, then
only its new block ids. The workers keep no request state but their copy of the block tables, built from the
same updates as rank 0's (``apply_block_updates``), beside their shard of the weights and of the KV cache; the
tables of requests that left are dropped on every rank (with the next step, or at once when the engine idles).

A worker is ``python -c "from minipaged.worker.executor import worker_main; …"``, which reads the engine's config from the
rendezvous store, as a worker started by hand on another machine does (``run_node``). It is not multiprocessing's
spawn: spawn re-runs the caller's main script in every worker, which fails for a script read from stdin
(``python - < script.py``) and builds a second engine in a script without an ``if __name__ == "__main__":`` guard.

Failures end everything, and every wait for a worker is bounded. At start-up each worker checks in on the store
before the groups are built, so one that dies first is named at once (its exit code or signal), one stopped after
``distributed_timeout_s``, and one that never comes a minute (``START_S``: importing torch) after that; the ranks
then load their weights at their own pace, ``START_S`` apart at most. After that a worker that dies closes its sockets, and rank 0's next
collective raises at once; one that hangs (or is stopped: SIGSTOP, a debugger) leaves rank 0 waiting
``distributed_timeout_s`` at most. Either way rank 0 names the rank at fault — its exit signal or the last line of
its traceback, or that it is stopped — before the ranks that merely gave up waiting for it, ends every other rank,
and raises; the engine is then closed, and a new ``LLM`` can be built in the same session. Ctrl-C in the caller
does the same: a step cut in half leaves the ranks in different places of their collectives, and no rank can be
brought back in step. Workers never outlive the caller: each watches its parent and leaves if it disappears, and
the engine's finalizer ends them when it is collected or Python exits.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import multiprocessing.spawn
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..config import Config
from ..core.scheduler_output import PendingOutput, Ready, RunnerOutput, SchedulerOutput
from ..distributed import START_S, TPGroup, check_tp_size, free_port, init_tp_group, open_store
from ..model import LlamaForCausalLM
from ..model.llama import read_config
from .cache_engine import CacheEngine
from .gpu_memory import GPUMemoryError, free_device_memory, gpu_memory_report
from .kv_pool_plan import KVPoolPlan
from .model_runner import KVSendFn, ModelRunner
from .sampler import Sampler
from .worker_rpc import WorkerRPC

T = TypeVar("T")
JOIN_S = 5.0  # a worker asked to stop gets this long to exit before it is killed
POLL_S = 0.05  # how often rank 0 looks at its workers while it waits for them to join


class TensorParallelError(RuntimeError):
    """A rank of a tensor-parallel engine died, hung, or the engine was already ended."""


def rendezvous(config: Config) -> tuple[str, int]:
    """Where the ranks meet: ``master_addr`` / ``master_port``, else ``$MASTER_ADDR`` / ``$MASTER_PORT``, else
    127.0.0.1 and a free port (one machine)."""
    host = config.master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = config.master_port or _env_port()
    if port:
        return host, port
    try:
        return host, free_port(host)
    except OSError as e:  # a name nobody resolves, an address of another machine
        where = "master_addr" if config.master_addr else "$MASTER_ADDR"
        raise ValueError(
            f"{where}={host!r} is not an address of this machine ({e}): rank 0 serves the ranks' rendezvous there"
        ) from None


def _env_port() -> int | None:
    text = os.environ.get("MASTER_PORT", "").strip()
    if not text:
        return None
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise ValueError(f"$MASTER_PORT={text!r} is not a port (1 … 65535): fix it, or pass master_port")
    return port


def make_executor(config: Config) -> UniProcExecutor | MultiprocExecutor:
    """The engine's executor: its model runner in this process alone, or, with ``tensor_parallel_size`` > 1,
    rank 0 of a group whose other ranks this starts. A size the model cannot be split into is refused before any
    process starts."""
    if config.tensor_parallel_size == 1:
        return UniProcExecutor(build_on_device(lambda: ModelRunner(config), config.torch_device))
    from ..model_loader import ensure_converted

    path = ensure_converted(progress=True) if config.model is None else config.model
    check_tp_size(path, config.tensor_parallel_size)
    config = dataclasses.replace(config, model=path)  # the workers load the same folder
    return MultiprocExecutor(config, read_config(path).to_dict())


class ExecutorBase:
    """What both executors answer: a step (the step driver's ``Executor``), a hand-back of requests that left,
    questions every rank answers, what the engine reads of its pool, and shutdown. ``runner``: this process's
    model runner (rank 0's); the engine (``LLM``) asks the executor, never the runner, so that how the ranks are
    run stays the executor's business."""

    runner: ModelRunner
    rpc: WorkerRPC  # rank 0's answers to ``collective_rpc``

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        raise NotImplementedError

    def launch(self, out: SchedulerOutput) -> PendingOutput:
        """Start a step; its output may still be on its way (async scheduling, ``engine/overlap.py``). Here:
        the step run to the end; a one-process GPU engine overrides it."""
        return Ready(self.execute(out))

    def release(self, request_ids: list[str], sample_keys: list[tuple[str, int]]) -> None:
        """Drop what is kept for requests that left: their block tables on every rank, their random streams
        (rank 0's runner samples alone)."""
        self.runner.release(request_ids, sample_keys)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Every rank's answer to ``WorkerRPC``'s ``method(*args)``, in rank order (vLLM's name)."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """End the other ranks, if any, then give back this rank's device memory; safe to call twice."""
        raise NotImplementedError

    def ranks(self) -> list[dict[str, Any]]:
        """What each rank holds: its device, KV heads, bytes per block, the pool its memory gave and the one all
        agreed on. One entry without tensor parallelism."""
        return self.collective_rpc("rank_info")

    def kv_blocks(self, layer: int, block_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every rank's K and V of ``block_ids`` in ``layer`` (a copy on the CPU: [blocks, block_size,
        its KV heads, head_dim] each), in rank order: what each rank's pool holds for the same block ids."""
        return self.collective_rpc("kv_blocks", layer, block_ids)

    # ---- what the engine reads and resets of rank 0's runner ----------------------------------------------------
    @property
    def released(self) -> bool:
        """Whether rank 0's device memory was given back (``shutdown``, or the engine dropped): no more steps."""
        return self.runner.released

    @property
    def pool(self) -> KVPoolPlan:
        """The KV pool every rank agreed on: its spec, dtype and device, block size, blocks of each kind (device,
        swap, offload), cache groups and ``max_model_len``."""
        return self.runner.plan

    @property
    def model_path(self) -> str | os.PathLike:
        """The model folder the ranks loaded (its tokenizer is the engine's)."""
        return self.runner.path

    @property
    def model(self) -> LlamaForCausalLM:
        """Rank 0's weights (its shard under tensor parallelism)."""
        return self.runner.model

    @property
    def cache(self) -> CacheEngine:
        """Rank 0's KV cache tensors."""
        return self.runner.cache

    @property
    def sampler(self) -> Sampler:
        """The random streams of the requests (rank 0 samples alone); a new one at every ``reset``."""
        return self.runner.sampler

    @property
    def timers(self) -> dict[str, float]:
        """Seconds per phase of the step loop so far, rank 0's (the engine adds its scheduler's to them)."""
        return self.runner.timers

    def describe(self) -> str:
        """The pool in one line (``ModelRunner.describe``)."""
        return self.runner.describe()

    def reset(self) -> None:
        """Forget every request (a new sampler, zeroed timers, no block tables); the weights and cache stay."""
        self.runner.reset()

    def free_memory(self) -> None:
        """Give back rank 0's device memory (the engine was dropped without ``shutdown``); safe to call twice."""
        self.runner.free_memory()

    # ---- disaggregated prefill: the KV connector's worker side -------------------------------------------------
    def attach_kv_sender(self, sender: KVSendFn) -> None:
        """Make this engine a KV producer: after each step's forward, ``sender(cache, sends)`` ships the blocks
        the step filled (``KVConnectorMetadata.sends``) to the engine that decodes (``engine/disagg.py``: single-rank
        engines, so rank 0 is the whole engine)."""
        self.runner.attach_kv_sender(sender)

    def write_offload_block(self, slot: int, kv: torch.Tensor) -> None:
        """Store one arrived block (``kv``: ``[layers, 2, block_size, kv_heads, head_dim]``) in slot ``slot`` of
        the KV offloading store, where a KV consumer's connector finds it (``engine/disagg.py``)."""
        self.runner.cache.write_offload(slot, kv)


class UniProcExecutor(ExecutorBase):
    """The runner of a one-process engine, as the step driver's executor."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.rpc = runner, WorkerRPC(runner)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        return self.runner.execute(out)

    def launch(self, out: SchedulerOutput) -> PendingOutput:
        return self.runner.launch(out)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [self.rpc(method, *args)]

    def shutdown(self) -> None:
        self.runner.free_memory()


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


class Worker:
    """One worker process of this machine: a ``subprocess.Popen`` with the few verbs the executor needs."""

    def __init__(self, rank: int, popen: subprocess.Popen[bytes]) -> None:
        self.rank, self.popen = rank, popen

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        """None while it runs; its exit status, or −N when signal N ended it (as ``multiprocessing``)."""
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def stopped(self) -> bool:
        """Alive but frozen: SIGSTOP, Ctrl-Z, a debugger (state T or t in ``/proc``; False where there is none)."""
        try:
            state = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        return state in ("T", "t") and self.is_alive()

    def join(self, timeout: float) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        """SIGKILL (it ends a stopped process too), then reap it (a killed process in the kernel's hands — a GPU
        driver call — may take a moment; ``JOIN_S`` at most)."""
        if self.is_alive():
            self.popen.kill()
        self.join(JOIN_S)

    def describe(self) -> str:
        code = self.exitcode
        if code is None:
            how = "is stopped (SIGSTOP or a debugger: alive, but it answers nothing)" if self.stopped() else "runs"
        elif code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited ({code})"
        return f"rank {self.rank} (pid {self.pid}) {how}"


def launch_worker(rank: int, local_rank: int, local_size: int, host: str, port: int, timeout_s: float) -> Worker:
    """Start rank ``rank`` as a fresh Python that imports minipaged and nothing of the caller's (neither its script
    nor its notebook): it reads the engine's config from the store at ``host:port``."""
    args = (rank, local_rank, local_size, host, port, timeout_s, os.getpid())
    code = (
        "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN)\n"  # Ctrl-C belongs to the caller
        f"import sys; sys.path[:] = {sys.path!r}\n"  # as spawn does: a folder the caller added finds minipaged
        f"from minipaged.worker.executor import worker_main; worker_main(*{args!r})\n"
    )
    executable = multiprocessing.spawn.get_executable()  # sys.executable, or what set_executable chose
    argv = [os.fspath(executable), "-c", code, f"minipaged-tp-rank{rank}"]  # the last: a name ``ps`` shows
    return Worker(rank, subprocess.Popen(argv, stdin=subprocess.DEVNULL))


class _Ranks:
    """What must be ended however the engine ends (kept apart from the executor, so that a ``weakref.finalize``
    can end them when the engine is garbage-collected)."""

    def __init__(self) -> None:
        self.procs: list[Worker] = []  # by rank − 1
        self.group: TPGroup | None = None
        self.store: Any = None
        self.ended = False

    def end(self, graceful: bool) -> None:
        if self.ended:
            return
        self.ended = True
        # A stopped or dead worker would hold the "stop" message for the whole timeout: end them all at once.
        if graceful and self.group is not None and all(p.is_alive() and not p.stopped() for p in self.procs):
            try:  # "stop": each worker leaves its loop and exits 0 (workers on other machines too); an idle worker
                # takes it at once, so a worker that does not take it within JOIN_S is as good as hung
                self.group.broadcast_object(None, timeout=datetime.timedelta(seconds=JOIN_S))
            except Exception:
                graceful = False
        else:
            graceful = False
        deadline = time.monotonic() + (JOIN_S if graceful else 0.2)
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:  # a worker keeps nothing worth a clean exit: one that is still there is killed
            p.kill()
        if self.group is not None:
            self.group.destroy(abort=not graceful)
        self.group, self.store = None, None  # dropping the store stops its server


class MultiprocExecutor(ExecutorBase):
    """Rank 0's side of a tensor-parallel engine: the worker processes, this process's group, and rank 0's runner
    (built once every rank has joined; a failure on any rank ends them all)."""

    def __init__(self, config: Config, hf_config: dict[str, Any]) -> None:
        self.size = config.tensor_parallel_size
        self.timeout_s = config.distributed_timeout_s
        self.host, self.port = rendezvous(config)
        self.local = self.size // config.nnodes  # ranks 0 … local − 1 run on this machine
        self.closed_because: str | None = None
        self._ranks = _Ranks()
        self._lock = threading.RLock()  # one message sequence at a time, whichever thread asks
        weakref.finalize(self, self._ranks.end, True)
        try:
            store = open_store(self.host, self.port, self.size, True, self.timeout_s)
        except dist.DistError as e:  # the port is taken, or the address is not this machine's
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            raise TensorParallelError(
                f"cannot serve the ranks' rendezvous store at master_addr={self.host!r}, master_port={self.port} "
                f"({first}): pick another master_port, or leave it out for a free one"
            ) from None
        self._ranks.store = store
        # for the workers, here and on other machines (bytes are fine: the stubs say str)
        store.set("config", pickle.dumps((config, hf_config)))  # type: ignore[arg-type]
        for rank in range(1, self.local):
            self._start(rank)
        self.group: TPGroup = self.guard("start-up", lambda: self._join(store, config))
        self._ranks.group = self.group
        self.runner = self.guard("start-up", lambda: ModelRunner(config, tp=self.group))
        self.rpc = WorkerRPC(self.runner)
        self.group.settle()  # every rank has its runner: a step waits distributed_timeout_s at most

    def _start(self, rank: int) -> None:
        try:
            p = launch_worker(rank, rank, self.local, self.host, self.port, self.timeout_s)
        except BaseException:
            self._ranks.end(graceful=False)
            raise
        self._ranks.procs.append(p)

    def _join(self, store: Any, config: Config) -> TPGroup:
        """Wait until every rank has checked in on the store, then build the groups with them. gloo's join is one
        C++ call that cannot look at the workers while it waits: a worker that dies first (a bad import, a kill)
        is caught here, at once; one stopped, after ``distributed_timeout_s``; one that runs but never checks in,
        after ``START_S`` more (importing torch may take longer than a step's timeout, which may be short)."""
        keys = {rank: f"ready/{rank}" for rank in range(1, self.size)}
        t0 = time.monotonic()
        while not store.check(list(keys.values())):
            if self._dead() or self._worker_errors():  # the latter: a rank on another machine failed
                raise TensorParallelError("a worker ended before it joined the group")
            waited = time.monotonic() - t0
            if waited > self.timeout_s and (waited > self.timeout_s + START_S or self._faulty()):
                late = [rank for rank, key in keys.items() if not store.check([key])]
                raise TensorParallelError(self._late(late, waited))
            time.sleep(POLL_S)
        return init_tp_group(0, self.size, store, config.torch_device, self.timeout_s)

    def _late(self, ranks: list[int], waited: float) -> str:
        """What to say about ranks that never checked in."""
        procs = {p.rank: p for p in self._ranks.procs}
        parts = [f"rank {r} (pid {procs[r].pid}, running)" if r in procs else f"rank {r}" for r in ranks]
        why = (
            f"{', '.join(parts)} did not join within {waited:.0f} s (distributed_timeout_s={self.timeout_s:g} s, "
            f"and {START_S:g} s more to start)"
        )
        if any(r not in procs for r in ranks):  # ranks of another machine: has it been started?
            why += (
                f" (ranks on another machine join when it runs `python -m minipaged worker --master-addr {self.host}"
                f" --master-port {self.port} --node-rank K`)"
            )
        return why

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids (ranks 1 … on this machine)."""
        return [p.pid for p in self._ranks.procs]

    def alive(self) -> list[int]:
        """The ids of this machine's workers still running (none once the engine is shut down)."""
        return [p.pid for p in self._ranks.procs if p.is_alive()]

    # ---- what rank 0 sends -------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Send the step to every worker, run rank 0's part of it (its shard of the forward pass), then sample
        here: the workers have nothing to sample."""
        runner = self.runner
        if not out.scheduled:  # no step for the workers: they still forget the tables of those that left
            self.release([*out.finished_req_ids, *out.preempted], out.finished_sample_keys)
            return RunnerOutput()
        runner.release([], out.finished_sample_keys)  # first, before anything can fail: they are sent once

        def run() -> torch.Tensor | None:
            self.group.broadcast_object(("step", out))
            return runner.forward_step(out)

        return runner.sample(out, self.guard("a step", run))

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Rank 0 answers once the workers have the call, since the answer may take part in collectives."""

        def run() -> list[Any]:
            self.group.broadcast_object(("call", method, args))
            answers = self.group.gather_objects(self.rpc(method, *args))
            assert answers is not None  # rank 0 gathers
            return answers

        return self.guard(f"a call of {method!r}", run)

    def release(self, request_ids: list[str], sample_keys: list[tuple[str, int]]) -> None:
        """As every executor does; the workers forget the tables too (one message, only with ids to forget)."""
        self.runner.release(request_ids, sample_keys)
        if request_ids and self.closed_because is None:
            try:
                self.collective_rpc("drop_tables", request_ids)
            except TensorParallelError:  # the ranks are gone, their tables with them; the next step says why
                pass

    def shutdown(self) -> None:
        """Stop every worker (they finish their loop and exit), then free rank 0's memory; safe to call twice."""
        try:
            with self._lock:
                self.closed_because = self.closed_because or "it was shut down"
                self._ranks.end(graceful=True)
        finally:
            self.runner.free_memory()

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

    def _dead(self) -> list[Worker]:
        return [p for p in self._ranks.procs if p.exitcode is not None]

    def _faulty(self) -> list[Worker]:
        return [p for p in self._ranks.procs if p.exitcode is not None or p.stopped()]

    def _why(self, exc: BaseException) -> str:
        """Which rank failed and how, the rank at fault first: one killed, one that raised an error of its own,
        or one stopped; then the ranks that only gave up waiting for it (their collective timed out or broke)."""
        if isinstance(exc, KeyboardInterrupt):
            return "interrupted (Ctrl-C) in the caller"
        deadline = time.monotonic() + 2.0  # a dead peer's sockets close before its exit code is known
        while not self._faulty() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        errors = self._worker_errors()
        at_fault, gave_up = [], []
        for p in self._faulty():
            text, waiting = errors.pop(p.rank, (None, False))
            if waiting:
                gave_up.append(f"{p.describe()}: it gave up waiting for the others ({_gave_up(text or '')})")
            elif text is not None:
                at_fault.append(f"{p.describe()}: {text}")
            elif p.exitcode is not None and p.exitcode > 0:  # before it could write to the store: an import
                at_fault.append(f"{p.describe()} (its traceback is on its stderr)")
            else:
                at_fault.append(p.describe())
        for rank, (text, waiting) in errors.items():  # ranks on other machines
            if waiting:
                gave_up.append(f"rank {rank} gave up waiting for the others ({_gave_up(text)})")
            else:
                at_fault.append(f"rank {rank} raised {text}")
        if at_fault:
            return "; ".join(at_fault + gave_up)
        if isinstance(exc, TensorParallelError):  # it names what it saw (ranks that did not join)
            return "; ".join([str(exc), *gave_up])
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        return "; ".join(
            [
                f"no rank was killed, failed on its own or was stopped, but one did not answer within "
                f"distributed_timeout_s={self.timeout_s:g} s (rank 0 itself, a rank slower than that, or one on "
                f"another machine that went away: {first})",
                *gave_up,
            ]
        )

    def _worker_errors(self) -> dict[int, tuple[str, bool]]:
        """What each rank wrote to the store as it failed: the last line of its traceback, and whether it was a
        collective's failure (the rank gave up on another, rather than failing itself)."""
        store, found = self._ranks.store, {}
        for rank in range(1, self.size):
            key = f"error/{rank}"
            try:
                if store is None or not store.check([key]):
                    continue
                raw = store.get(key).decode(errors="replace")
            except Exception:  # the store itself is gone: nothing more to learn
                break
            try:
                report = json.loads(raw)
                found[rank] = (str(report["error"]), bool(report["waiting"]))
            except (ValueError, KeyError, TypeError):
                found[rank] = (raw, False)
        return found


def _gave_up(error: str) -> str:
    """A collective's failure in a few words (gloo's own message runs to several lines of advice)."""
    low = error.lower()
    return "its wait timed out" if "timed out" in low or "timeout" in low else "a peer closed its connection"


def _collective_failed(e: BaseException) -> bool:
    """A collective broke (a peer closed its sockets, or a timeout), or a rank was found dead."""
    return isinstance(e, (TensorParallelError, dist.DistError))


# ---- the worker side ---------------------------------------------------------------------------------------
def worker_main(
    rank: int,
    local_rank: int,
    local_size: int,
    host: str,
    port: int,
    timeout_s: float,
    parent_pid: int | None,
) -> None:
    """A worker's whole life: read the engine's config from its store, check in, join the group, build its runner
    (its shard), then run what rank 0 sends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the caller, which then ends every rank
    if parent_pid is not None:
        threading.Thread(target=_leave_when_orphaned, args=(parent_pid,), daemon=True).start()
    store = tp = None
    try:
        store = open_store(host, port, None, False, timeout_s)
        config, hf_config = pickle.loads(store.get("config"))
        if config.torch_device.type == "cpu":  # share this machine's cores between its ranks
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_size))
        store.set(f"ready/{rank}", str(os.getpid()))
        tp = init_tp_group(rank, config.tensor_parallel_size, store, _device(config, local_rank), timeout_s)
        runner = ModelRunner(config, tp=tp, local_rank=local_rank, hf_config=hf_config)
        rpc = WorkerRPC(runner)
        tp.settle()
        while (msg := tp.broadcast_object()) is not None:
            if msg[0] == "step":
                runner.forward_step(msg[1])
            else:
                _, method, args = msg
                tp.gather_objects(rpc(method, *args))
    except BaseException as e:
        last = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()[-1][:500]
        try:
            if store is not None:  # a collective's failure means another rank failed first: rank 0 names that one
                store.set(f"error/{rank}", json.dumps({"error": last, "waiting": isinstance(e, dist.DistError)}))
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
    if not 0 < port < 65536:
        raise ValueError(f"master_port must be 1 … 65535, got {port}")
    if not timeout_s > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout_s}")
    try:  # waits for the engine's store to appear
        store = open_store(host, port, None, False, timeout_s)
        config, _ = pickle.loads(store.get("config"))
    except dist.DistError as e:
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise TensorParallelError(
            f"no engine answered at master_addr={host!r}, master_port={port} within {timeout_s:g} s ({first}): "
            "start the engine (nnodes > 1) first, or wait longer"
        ) from None
    local = config.tensor_parallel_size // config.nnodes
    if not 0 < node_rank < config.nnodes:
        raise ValueError(f"node_rank must be 1 … {config.nnodes - 1} (the engine's machine is node 0), got {node_rank}")
    procs: list[Worker] = []
    try:
        for i in range(local):
            procs.append(launch_worker(node_rank * local + i, i, local, host, port, config.distributed_timeout_s))
        for p in procs:
            p.popen.wait()  # as long as the engine serves
    finally:
        for p in procs:
            if p.is_alive():
                p.popen.terminate()
                p.join(JOIN_S)
            p.kill()
    return 0 if all(p.exitcode == 0 for p in procs) else 1
