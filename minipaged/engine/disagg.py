"""Disaggregated prefill: one engine computes the prompts, another decodes, each in its own process.

Why (DistServe, Zhong et al. 2024; vLLM's ``docs/features/disagg_prefill.md``): in one engine a long prompt's
prefill chunk and the running decodes share a step. While the step computes a 1,000-token chunk, every decode in
it waits, and inter-token latency jumps (chapter 06). Putting the two phases on separate workers takes the
prefills out of the decodes' steps. The price: the prompt's K/V must travel, and each phase has only its own
share of the hardware::

    caller ──prompt ids──▶ prefill engine (process 1: the KV producer), max_tokens=1
                              │ after each step: the blocks it filled, with their hashes ─┐ torch.distributed
                              │ after the step:  "done: r1 r2"                            ┘ (gloo, in order)
                              ▼
                           receiver thread (process 0) ──▶ the decode engine's KV store (kv_connector.py)
    caller ◀──tokens────── decode engine (process 0: the KV consumer): the prompt's full blocks are external
                           hits, loaded into its pool; it computes the last partial block, samples, decodes

The two engines meet only through the KV connector seam: the producer's ``SendingConnector`` lists the blocks
each step fills (``KVConnectorMetadata.sends``) and its runner ships them after the forward (``KVSender``, handed
to it by ``executor.attach_kv_sender``); the consumer's ``ReceivingConnector`` is the CPU offloading store, fed
from the wire (``executor.write_offload_block``). Neither side touches a runner itself. The decode engine computes
the first output token itself, so its tokens are those of a single engine (tests/test_disagg.py).

Kept small on purpose: one producer and one consumer, single-rank engines, only full blocks travel (the last
partial block is recomputed, at most ``block_size - 1`` tokens), and a block the consumer's store has lost by
the time the request is admitted is computed again rather than fetched again.

Waits, and what bounds them. Idle is not a failure: between calls the receiver waits for the next message for
as long as the caller takes, as ``distributed``'s wait group does. What the engine asks for is bounded:
starting the prefill process (``start_timeout_s``), a prefill to finish when ``step`` has nothing else to do and
the rest of a message once it has begun (``timeout_s``), the prefill process's exit at ``shutdown`` (``SHUTDOWN_S``,
then it is killed). A prefill process that died is reported gone at once; one that is stopped (SIGSTOP, Ctrl-Z)
is reported stopped when a bounded wait runs out, and continues where it was when it is continued (SIGCONT).
"""

from __future__ import annotations

import datetime
import functools
import math
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config import DTYPES, Config
from ..core.block_pool import BlockHash, KVCacheBlock
from ..core.kv_connector import KVConnector, KVConnectorMetadata, OffloadingConnector
from ..core.request import Request
from ..distributed import FOREVER, free_port, open_store
from ..sampling_params import SamplingParams
from ..utils import check_int
from ..worker.cache_engine import CacheEngine
from .inputs import InputProcessor, ParamsLike, Prompt, Prompts, check_params
from .llm import LLM
from .outputs import RequestOutput, request_output

HASH_BYTES = 32  # a block hash: sha256
PREFILL_ONLY = SamplingParams(max_tokens=1, temperature=0)  # the producer's one sampled token is thrown away
SHUTDOWN_S = 5.0  # shutdown() lets the prefill process finish its step and leave this long, then kills it
KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the handshake names the pool's dtype by its index


# ---- the producer's side ---------------------------------------------------------------------------------------
class SendingConnector(KVConnector):
    """Scheduler side of the producer: every block a step fills with prompt tokens is to be sent after it."""

    def build_connector_meta(self, hashed: Sequence[KVCacheBlock] = ()) -> KVConnectorMetadata:
        sends = [(b.block_id, b.block_hash) for b in hashed if b.block_hash is not None]
        return KVConnectorMetadata(sends=sends)


class KVSender:
    """Worker side of the producer: gathers the blocks a step filled and sends them to rank 0, in one message.

    A message is a header ``[num_blocks, num_done_bytes]`` (int64), then the hashes (``num_blocks x 32`` bytes)
    and the blocks' K and V (``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``, as bytes), or the ids of
    the requests whose prefill is done (utf-8, one per line)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def __call__(self, cache: CacheEngine, sends: list[tuple[int, BlockHash]]) -> None:
        ids = torch.tensor([b for b, _ in sends], dtype=torch.long, device=cache.device)
        kv = torch.stack([torch.stack((k[ids], v[ids])) for k, v in cache.gpu_cache]).cpu().contiguous()
        hashes = torch.frombuffer(bytearray(b"".join(h for _, h in sends)), dtype=torch.uint8)
        self._send(torch.tensor([len(sends), 0], dtype=torch.long))
        self._send(hashes)
        self._send(kv.view(torch.uint8).flatten())

    def done(self, request_ids: list[str]) -> None:
        payload = "\n".join(request_ids).encode()
        self._send(torch.tensor([0, len(payload)], dtype=torch.long))
        self._send(torch.frombuffer(bytearray(payload), dtype=torch.uint8))

    def _send(self, t: torch.Tensor) -> None:
        # gloo's send waits for rank 0 to take it: as long as rank 0 lives (a caller stopped in a debugger is not
        # a failure; a dead one closes the sockets, and this raises)
        if t.numel():
            self.group.send([t], 1 - self.group.rank(), 0).wait(FOREVER)


def _prefill_main(model: Any, kwargs: dict[str, Any], port: int, inbox: Any, start_s: float, parent_pid: int) -> None:
    """The prefill engine's process: join the group, load the model, then prefill what arrives until told to
    stop (None), sending each step's blocks and each finished prefill to rank 0."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the caller, which then ends this process
    group: Any = None
    try:
        store = open_store("127.0.0.1", port, 2, False, start_s)
        group = dist.ProcessGroupGloo(dist.PrefixStore("disagg", store), 1, 2, datetime.timedelta(seconds=start_s))
        llm = LLM(model, **kwargs)
        sender = KVSender(group)
        llm.kv_connector_factory = SendingConnector
        llm.reset()
        llm.executor.attach_kv_sender(sender)  # the connector's worker side: it ships what each step filled
        sender._send(torch.tensor(_block_shape(llm), dtype=torch.long))  # rank 0 checks its pool matches
        while True:
            wait = not llm.scheduler.has_unfinished()
            try:
                msg = inbox.get(timeout=1.0) if wait else inbox.get_nowait()
            except queue.Empty:
                msg = ()
                if wait and os.getppid() != parent_pid:  # orphaned: the caller died without a word
                    os._exit(0)
            if msg is None:
                break
            if msg and msg[0] == "abort":  # the caller gave up on it: stop spending this engine's time on it
                llm.abort(msg[1])
                continue
            if msg:
                _, request_id, token_ids = msg
                llm.add_request(token_ids, PREFILL_ONLY, request_id=request_id)
                if llm.get_output(request_id).finished:  # rejected (too long, say): the decode side decides
                    sender.done([request_id])
                continue  # take everything that is waiting before the next step
            if llm.scheduler.has_unfinished():
                finished = llm.step()
                for rid in finished:
                    llm.get_output(rid)  # hand it back: the engine forgets it
                if finished:
                    sender.done(finished)
        sender._send(torch.tensor([-1, 0], dtype=torch.long))  # the last message: goodbye
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    finally:
        if group is not None:
            try:
                group.shutdown()
            except Exception:
                pass
    # Nothing here is worth the interpreter's teardown (torch's takes seconds): leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _prefill_threads_main(threads: int, *args: Any) -> None:
    torch.set_num_threads(threads)
    _prefill_main(*args)


def _block_shape(llm: LLM) -> list[int]:
    """What a block of the engine's pool is: ``[layers, block_size, kv_heads, head_dim, dtype]`` (dtype as
    ``KV_DTYPES``'s index, -1 for another)."""
    spec = llm.cache.spec
    code = KV_DTYPES.index(llm.dtype) if llm.dtype in KV_DTYPES else -1
    return [spec.num_layers, llm.block_size, spec.num_kv_heads, spec.head_dim, code]


# ---- the consumer's side -------------------------------------------------------------------------------------
class Inbox:
    """Blocks that arrived from the producer, waiting for the decode engine's next step to store them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: list[tuple[BlockHash, torch.Tensor]] = []  # hash, [layers, 2, block_size, heads, dim]

    def put(self, blocks: list[tuple[BlockHash, torch.Tensor]]) -> None:
        with self._lock:
            self._blocks.extend(blocks)

    def take(self) -> list[tuple[BlockHash, torch.Tensor]]:
        with self._lock:
            blocks, self._blocks = self._blocks, []
        return blocks


class ReceivingConnector(OffloadingConnector):
    """Scheduler side of the consumer: the offloading store, also fed by the producer. Arrived blocks are stored
    when a step starts (``commit_step``), on the scheduler's own thread: a lookup and the allocation after it
    always see the same store."""

    def __init__(self, num_slots: int, block_size: int, inbox: Inbox, write: Callable[[int, torch.Tensor], None]):
        super().__init__(num_slots, block_size)
        self.inbox, self.write = inbox, write
        self.num_received = 0

    def commit_step(self) -> None:
        super().commit_step()
        for block_hash, kv in self.inbox.take():
            if block_hash in self.index:
                self.index.move_to_end(block_hash)
                continue
            slot = self._take_slot()
            if slot is None:
                break
            self.write(slot, kv)
            self.index[block_hash] = slot
            self.num_received += 1


def process_state(pid: int) -> str:
    """The process's state letter in ``/proc`` ("R" running, "S" sleeping, "T" stopped, "t" stopped by a
    tracer, "Z" dead), or "" where it cannot be read (gone, or no ``/proc``: not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]  # the name, in parentheses, may hold spaces
    except (OSError, IndexError):
        return ""


class _Link:
    """This process's end of the pair: the prefill process, the group to it, the receiver thread and what it has
    received. It never refers to the ``DisaggregatedLLM``: the receiver thread keeps only the link alive, so an
    engine dropped without ``shutdown()`` is collected, and its ``weakref.finalize`` ends the link."""

    def __init__(self, timeout_s: float, start_s: float) -> None:
        self.timeout_s, self.start_s = timeout_s, start_s
        self.proc: Any = None  # multiprocessing.Process
        self.queue: Any = None  # the prefill process's inbox: ("add", id, token ids), ("abort", id), None
        self.store: Any = None
        self.group: Any = None
        self.receiver: threading.Thread | None = None
        self.inbox = Inbox()
        self.cond = threading.Condition()
        self.prefilled: set[str] = set()  # ids whose prefill is done, not yet admitted
        self.error: str | None = None  # why the receiver stopped early
        self.ended = False
        self.deadline = math.inf

    def start(self, threads: int, model: Any, kwargs: dict[str, Any]) -> None:
        """Start the prefill process and join a group with it, within ``start_timeout_s``."""
        port = free_port()
        self.store = open_store("127.0.0.1", port, 2, True, self.start_s)
        ctx = mp.get_context("spawn")
        self.queue = ctx.Queue()
        # its feeder thread may hold prompts a stopped or dead process never reads: never wait for it at exit
        self.queue.cancel_join_thread()
        self.proc = ctx.Process(
            target=_prefill_threads_main,
            args=(threads, model, kwargs, port, self.queue, self.start_s, os.getpid()),
            name="minipaged-prefill",
            daemon=True,
        )
        self.proc.start()
        self.deadline = time.monotonic() + self.start_s  # of the start as a whole: joining, then loading
        store, timeout = self.store, datetime.timedelta(seconds=self.start_s)
        self.group = self.while_starting(
            "joining the group", lambda: dist.ProcessGroupGloo(dist.PrefixStore("disagg", store), 0, 2, timeout)
        )

    def check_block_shape(self, mine: list[int]) -> None:
        """The handshake: the producer sends its block shape (``_block_shape``) once its model is loaded; its
        blocks are copied into this engine's pool as they are, so the two must be the same."""
        shape, group, timeout = torch.zeros(5, dtype=torch.long), self.group, datetime.timedelta(seconds=self.start_s)
        self.while_starting("loading its model", lambda: group.recv([shape], 1, 0).wait(timeout))
        theirs = shape.tolist()
        if theirs != mine:
            names = ("layers", "block_size", "kv_heads", "head_dim", "dtype")
            diff = ", ".join(
                f"{n} {_shape_value(n, a)} there, {_shape_value(n, b)} here"
                for n, a, b in zip(names, theirs, mine)
                if a != b
            )
            raise ValueError(f"the prefill engine's blocks do not fit the decode engine's pool: {diff}")

    def start_receiver(self, block_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Receive what the producer sends, on a thread of its own, until goodbye (``receive``)."""
        self.receiver = threading.Thread(
            target=self.receive, args=(block_shape, dtype), name="minipaged-kv-receiver", daemon=True
        )
        self.receiver.start()

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def stopped(self) -> bool:
        return process_state(self.pid) in ("T", "t")

    def how_ended(self) -> str:
        code = self.proc.exitcode
        if code is not None and code < 0:
            return f"it was killed by {signal.Signals(-code).name}"
        return f"it exited with code {code} (its error is printed above)" if code else "it exited"

    def while_starting(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, a wait on the starting prefill process: an error as soon as that process is gone, and a
        TimeoutError once ``start_timeout_s`` has passed since it started (``fn``'s thread is then left to its
        own timeout, which the process's end cuts short)."""
        result: list[Any] = []
        failed: list[BaseException] = []

        def run() -> None:
            try:
                result.append(fn())
            except BaseException as e:
                failed.append(e)

        t = threading.Thread(target=run, name="minipaged-prefill-start", daemon=True)
        t.start()
        while t.is_alive() and self.proc.exitcode is None and time.monotonic() < self.deadline:
            t.join(timeout=0.2)
        if self.proc.exitcode is not None and not result:
            raise RuntimeError(f"the prefill engine's process (pid {self.pid}) ended while {what}: {self.how_ended()}")
        # gloo's own wait (bounded by start_timeout_s too) may be the one that ran out
        timed_out = bool(failed) and isinstance(failed[0], Exception) and "time" in str(failed[0]).lower()
        if t.is_alive() or timed_out:
            stopped = self.stopped()
            state = "it is stopped (SIGSTOP)" if stopped else "it is running: a slow start? Raise start_timeout_s"
            why = f" ({type(failed[0]).__name__}: {str(failed[0]).strip()[:200]})" if failed else ""
            raise TimeoutError(
                f"the prefill engine's process (pid {self.pid}) did not finish {what} within "
                f"start_timeout_s={self.start_s:g} s: {state}{why}"
            )
        if failed:
            raise failed[0]
        return result[0]

    def receive(self, block_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """The receiver thread: blocks into the inbox, finished prefills into ``prefilled``, until goodbye."""
        body = datetime.timedelta(seconds=self.timeout_s)  # a begun message's rest follows at once
        try:
            while True:
                header = torch.zeros(2, dtype=torch.long)
                # no bound: the next message comes when the caller next asks for a prefill, maybe in an hour
                self.group.recv([header], 1, 0).wait(FOREVER)
                n, done_bytes = header.tolist()
                if n < 0:
                    return
                if n:
                    hashes = torch.empty(n * HASH_BYTES, dtype=torch.uint8)
                    self.group.recv([hashes], 1, 0).wait(body)
                    layers, two, bs, heads, dim = block_shape
                    kv = torch.empty((layers, two, n, bs, heads, dim), dtype=dtype)
                    self.group.recv([kv.view(torch.uint8).view(-1)], 1, 0).wait(body)
                    raw = hashes.numpy().tobytes()
                    blocks = [(BlockHash(raw[i * HASH_BYTES : (i + 1) * HASH_BYTES]), kv[:, :, i]) for i in range(n)]
                    self.inbox.put(blocks)
                if done_bytes:
                    payload = torch.empty(done_bytes, dtype=torch.uint8)
                    self.group.recv([payload], 1, 0).wait(body)
                    with self.cond:
                        self.prefilled.update(payload.numpy().tobytes().decode().split("\n"))
                        self.cond.notify_all()
        except Exception as e:  # the producer died or stopped mid-message, or the group was torn down
            with self.cond:
                self.error = f"{type(e).__name__}: {str(e).strip()[:300]}"
                self.cond.notify_all()

    def trouble(self) -> str | None:
        """Why the prefill engine can no longer answer (None while it can)."""
        if self.proc.exitcode is None and self.error is not None:
            deadline = time.monotonic() + 1.0  # a dead peer's sockets close before its exit code is known
            while self.proc.exitcode is None and time.monotonic() < deadline:
                time.sleep(0.05)
        if self.proc.exitcode is not None:
            return f"the prefill engine's process (pid {self.pid}) is gone: {self.how_ended()}"
        if self.error is None:
            return None
        if self.stopped():
            return (
                f"a message from the prefill engine's process (pid {self.pid}) broke off: the process is stopped "
                f"(SIGSTOP) and sent nothing more within timeout_s={self.timeout_s:g} s ({self.error})"
            )
        return f"the link to the prefill engine's process (pid {self.pid}, still running) broke ({self.error})"

    def end(self, graceful: bool) -> None:
        """Stop the prefill process (told to leave and given ``SHUTDOWN_S`` when ``graceful`` and it runs;
        killed otherwise, stopped or not), then the group and the receiver. Safe to call twice."""
        if self.ended:
            return
        self.ended = True
        proc = self.proc
        if proc is not None:
            if graceful and proc.is_alive() and not self.stopped():
                try:
                    self.queue.put(None)
                except Exception:  # the queue is broken: the kill below ends it all the same
                    pass
                deadline = time.monotonic() + SHUTDOWN_S
                while proc.is_alive() and time.monotonic() < deadline and not self.stopped():  # it may stop now
                    proc.join(0.1)
            if proc.is_alive():
                proc.kill()  # SIGKILL: a stopped process ends too
                proc.join(SHUTDOWN_S)
        if self.group is not None:
            try:  # a clean goodbye leaves nothing in flight; else abort does not wait for what is
                self.group.shutdown() if proc is not None and proc.exitcode == 0 else self.group.abort()
            except Exception:
                pass
        if self.receiver is not None and self.receiver is not threading.current_thread():
            self.receiver.join(SHUTDOWN_S)  # its recv fails once the peer's sockets are closed
        if self.queue is not None:
            self.queue.close()
        self.group = self.store = None  # dropping the store stops its server


def _connect_consumer(llm: LLM, link: _Link) -> None:
    """Make the decode engine the KV consumer of ``link``: its connector is the offloading store, fed with what
    the receiver thread takes off the wire. The connector writes through the executor, not the ``LLM``: one that
    referred to its ``LLM`` would keep it alive."""
    executor = llm.executor
    llm.kv_connector_factory = functools.partial(
        ReceivingConnector, executor.pool.num_offload_blocks, llm.block_size, link.inbox, executor.write_offload_block
    )
    llm.reset()
    layers, block_size, heads, dim, _ = _block_shape(llm)
    link.start_receiver((layers, 2, block_size, heads, dim), llm.dtype)


def _free_decode_engine(llm: LLM, threads: int) -> None:
    llm.shutdown()
    torch.set_num_threads(threads)


def _check_threads(threads: tuple[int, int] | None) -> tuple[int, int]:
    """Each process's torch threads, (prefill, decode): as given, or half the machine's cores each (on one
    machine the two share them)."""
    if threads is None:
        half = max(1, (os.cpu_count() or 2) // 2)
        threads = (half, half)
    elif not isinstance(threads, (tuple, list)) or len(threads) != 2:
        raise ValueError(f"threads must be a pair (prefill threads, decode threads), got {threads!r}")
    return (
        check_int("threads[0] (the prefill process's)", threads[0], 1),
        check_int("threads[1] (the decode engine's)", threads[1], 1),
    )


def _check_seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def engine_kwargs(
    model: str | os.PathLike | None,
    kwargs: dict[str, Any],
    prefill: dict[str, Any] | None,
    decode: dict[str, Any] | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each side's engine arguments, every value checked (``Config``) and the two sides checked against each
    other, without loading anything: ``DisaggregatedLLM`` refuses a bad argument before any process starts."""
    for side, side_kw in (("prefill", prefill), ("decode", decode)):
        if side_kw is not None and not isinstance(side_kw, dict):
            raise ValueError(f"{side} must be a dict of engine arguments for the {side} engine alone, got {side_kw!r}")
    sides = {
        "prefill": {**kwargs, **(prefill or {})},
        "decode": {"kv_offloading_size": "256MiB", **kwargs, **(decode or {})},
    }
    configs: dict[str, Config] = {}
    for side, kw in sides.items():
        try:
            configs[side] = Config.from_kwargs(model, kw)
        except ValueError as e:
            raise ValueError(f"the {side} engine's arguments: {e}") from None
    given = functools.partial(_given, kwargs, prefill, decode)
    _check_blocks_travel(configs["prefill"], configs["decode"], given)
    _check_roles(configs["prefill"], configs["decode"], given)
    return sides["prefill"], sides["decode"]


def _given(
    kwargs: dict[str, Any], prefill: dict[str, Any] | None, decode: dict[str, Any] | None, side: str, knob: str
) -> str:
    """Where ``side``'s value of ``knob`` came from, as the caller wrote it: the side's own dict, the shared
    arguments, or the default (an error message names what to change)."""
    mine = prefill if side == "prefill" else decode
    if mine is not None and knob in mine:
        return f"{side}={{{knob!r}: {mine[knob]!r}}}"
    return f"{knob}={kwargs[knob]!r}" if knob in kwargs else "the default"


def _check_blocks_travel(p: Config, d: Config, given: Callable[[str, str], str]) -> None:
    """The producer's blocks are copied into the consumer's pool as they are: the same ``block_size`` and
    ``dtype`` on both sides."""
    if p.block_size != d.block_size:
        raise ValueError(
            f"block_size differs: the prefill engine's is {p.block_size} ({given('prefill', 'block_size')}), the "
            f"decode engine's {d.block_size} ({given('decode', 'block_size')}). The prefill engine's blocks are "
            "copied into the decode engine's pool as they are: give both the same block_size (one block_size= "
            "serves both)"
        )
    # "auto" is float32 on a CPU; on a GPU it depends on the card and the model: the handshake checks that
    dtypes = [DTYPES[c.dtype] or (torch.float32 if c.torch_device.type == "cpu" else None) for c in (p, d)]
    if None not in dtypes and dtypes[0] != dtypes[1]:
        raise ValueError(
            f"dtype differs: the prefill engine's is {p.dtype!r} ({given('prefill', 'dtype')}) on {p.torch_device}, "
            f"the decode engine's {d.dtype!r} ({given('decode', 'dtype')}) on {d.torch_device}. The prefill "
            "engine's blocks are copied into the decode engine's pool as they are: give both the same dtype"
        )


def _check_roles(p: Config, d: Config, given: Callable[[str, str], str]) -> None:
    """Each side can play its part: single-rank engines, a producer that hashes its blocks (prefix caching),
    a consumer with a KV store to receive them in."""
    for side, c in (("prefill", p), ("decode", d)):
        if c.tensor_parallel_size != 1:
            raise ValueError(
                f"tensor_parallel_size={c.tensor_parallel_size} ({given(side, 'tensor_parallel_size')}): "
                "DisaggregatedLLM runs single-rank engines (a tensor-parallel producer would send only rank 0's "
                "heads). Leave tensor_parallel_size at 1"
            )
    if not p.enable_prefix_caching:
        raise ValueError(
            f"enable_prefix_caching=False ({given('prefill', 'enable_prefix_caching')}): the prefill engine sends "
            "its blocks under their prefix-cache hashes, so it needs prefix caching on"
        )
    if not d.kv_offloading_bytes:
        raise ValueError(
            f"kv_offloading_size={d.kv_offloading_size!r} ({given('decode', 'kv_offloading_size')}): the decode "
            "engine needs a KV store, where the prefill engine's blocks land (default 256MiB)"
        )


def _model_path(model: str | os.PathLike | None) -> str | os.PathLike:
    """The model folder both engines load: converted once here (not twice at once), or checked to exist."""
    if model is None:
        from ..model_loader import ensure_converted

        return ensure_converted(progress=True)
    if not isinstance(model, (str, os.PathLike)) or not (Path(model) / "config.json").is_file():
        raise ValueError(
            f"model={model!r} is not a model folder (no config.json in it): pass a transformers Llama folder, or "
            "None for SmolLM2"
        )
    return model


class DisaggregatedLLM:
    """A prefill engine in a process of its own and a decode engine in this one, with ``LLM``'s calls.

    ``kwargs`` are both engines' knobs (``Config``); ``prefill`` and ``decode`` override them for one side
    (``decode`` must keep a KV store: ``kv_offloading_size``, default 256 MiB). Both need the same ``block_size``
    and ``dtype``: the producer's blocks are copied into the consumer's pool as they are. ``threads`` sets each
    process's torch threads (on one machine the two share its cores: ``(cores // 2, cores // 2)`` by default).
    ``timeout_s`` bounds what the engine waits for once it has asked: a prefill to finish (``step``), the rest of
    a message. ``start_timeout_s`` bounds the prefill process's start (torch's import, the model's load). An idle
    engine waits for nothing: it lives as long as it is referenced. Every argument is checked before any process
    starts. ``shutdown()`` (or ``with``) ends both engines; dropping the engine ends them too.
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        prefill: dict[str, Any] | None = None,
        decode: dict[str, Any] | None = None,
        threads: tuple[int, int] | None = None,
        timeout_s: float = 120.0,
        start_timeout_s: float = 300.0,
        **kwargs: Any,
    ) -> None:
        self.timeout_s = _check_seconds("timeout_s", timeout_s)
        start_s = _check_seconds("start_timeout_s", start_timeout_s)
        prefill_threads, decode_threads = _check_threads(threads)
        prefill_kw, decode_kw = engine_kwargs(model, kwargs, prefill, decode)
        path = _model_path(model)

        self._closed = False
        self._waiting: dict[str, tuple[list[int], SamplingParams, float]] = {}  # sent to prefill, not back yet
        self._link = link = _Link(self.timeout_s, start_s)
        old_threads = torch.get_num_threads()
        llm: LLM | None = None
        try:
            link.start(prefill_threads, path, prefill_kw)
            torch.set_num_threads(decode_threads)
            llm = LLM(path, **decode_kw)
            link.check_block_shape(_block_shape(llm))
        except BaseException:
            link.end(graceful=False)
            if llm is not None:
                llm.shutdown()
            torch.set_num_threads(old_threads)
            raise
        self.llm = llm
        # Dropped without shutdown(): the prefill process is killed (at exit too), the decode engine freed.
        self._end_link = weakref.finalize(self, link.end, False)
        self._free_decode = weakref.finalize(self, _free_decode_engine, llm, old_threads)
        self._free_decode.atexit = False  # as LLM's own: nothing to give back to a process that is ending
        _connect_consumer(llm, link)

    @property
    def prefill_pid(self) -> int:
        """The prefill engine's process id."""
        return self._link.pid

    def _check_alive(self) -> None:
        if self._closed:
            raise RuntimeError("this DisaggregatedLLM is shut down")
        why = self._link.trouble()
        if why is not None:
            raise RuntimeError(f"{why}; shut this engine down (shutdown()) and build a new one")

    # ---- requests --------------------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Send the prompt to the prefill engine; it joins the decode engine once its K/V has arrived. Its TTFT
        counts from ``arrival_time`` (the decode engine's clock, ``self.llm.now()``), by default now. Everything
        is checked here: a bad argument raises and sends nothing."""
        self._check_alive()
        params = SamplingParams() if params is None else check_params(params)
        if request_id is not None and (not isinstance(request_id, str) or not request_id or "#" in request_id):
            raise ValueError(f"request_id must be a non-empty string without '#', got {request_id!r}")
        if arrival_time is not None and (
            isinstance(arrival_time, bool)
            or not isinstance(arrival_time, (int, float))
            or not math.isfinite(arrival_time)
        ):
            raise ValueError(
                f"arrival_time must be a number of seconds on the decode engine's clock (llm.now()), got "
                f"{arrival_time!r}"
            )
        rid = request_id if request_id is not None else self.llm._take_ids(1)[0]
        if rid in self._waiting or rid in self.llm._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        token_ids = self.llm.processor.token_ids(prompt, rid)
        now = self.llm.now()
        self._waiting[rid] = (token_ids, params, now if arrival_time is None else min(float(arrival_time), now))
        self._link.queue.put(("add", rid, token_ids))
        return rid

    def has_unfinished(self) -> bool:
        return bool(self._waiting) or self.llm.scheduler.has_unfinished()

    def step(self, wait_s: float | None = None) -> list[str]:
        """Admit the requests whose prefill is done, then run one decode-engine step; with nothing to decode,
        wait for a prefill to finish first: at most ``wait_s`` seconds (then return ``[]``), or by default
        ``timeout_s``, after which it raises a TimeoutError that says whether the prefill process is stopped or
        just slow (the requests still wait: ``step()`` again, or ``abort()`` them). Returns the ids that
        finished. A prefill process that died is an error at once."""
        self._check_alive()
        if wait_s is not None and (
            isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not math.isfinite(wait_s) or wait_s < 0
        ):
            raise ValueError(f"wait_s must be a finite number of seconds >= 0 (or None: timeout_s), got {wait_s!r}")
        link = self._link
        with link.cond:
            if not self.llm.scheduler.has_unfinished() and self._waiting:
                deadline = time.monotonic() + (self.timeout_s if wait_s is None else float(wait_s))
                # in slices: a process that died is noticed at once, even before its sockets say so
                while not (link.prefilled & self._waiting.keys()) and link.error is None:
                    left = deadline - time.monotonic()
                    if left <= 0 or link.proc.exitcode is not None:
                        break
                    link.cond.wait(min(left, 0.25))
            # ids no longer waiting were aborted while their prefill ran: forget them too
            ready, link.prefilled = link.prefilled & self._waiting.keys(), set()
        for rid in sorted(ready, key=lambda r: self._waiting[r][2]):
            token_ids, params, arrival = self._waiting.pop(rid)
            self.llm.add_request(token_ids, params, request_id=rid, arrival_time=arrival)
        if not self.llm.scheduler.has_unfinished():
            if self._waiting and not ready:
                self._check_alive()
                if wait_s is None:
                    state = (
                        f"is stopped (SIGSTOP; `kill -CONT {link.pid}` continues it)"
                        if link.stopped()
                        else "is running, just slow (a long prompt, a busy machine?)"
                    )
                    raise TimeoutError(
                        f"no prefill finished within timeout_s={self.timeout_s:g} s: the prefill engine's process "
                        f"(pid {link.pid}) {state}. Its {len(self._waiting)} request(s) still wait: step() again, "
                        "or abort() them"
                    )
            return []
        return self.llm.step()

    def get_output(self, request_id: str) -> RequestOutput:
        """The request's output so far: no tokens yet while its prefill runs (see ``LLM.get_output``)."""
        if self._closed:
            raise RuntimeError("this DisaggregatedLLM is shut down")
        if request_id in self._waiting:
            token_ids, params, arrival = self._waiting[request_id]
            req = Request(request_id, token_ids, sampling_params=params, arrival_time=arrival)
            return request_output(req, self.llm.processor.decode)
        return self.llm.get_output(request_id)

    def abort(self, request_ids: str | Sequence[str]) -> None:
        """Stop requests wherever they are: in the prefill engine (told to drop them) or in the decode engine.
        Unknown ids are ignored, as in ``LLM``."""
        if self._closed:
            raise RuntimeError("this DisaggregatedLLM is shut down")
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            if self._waiting.pop(rid, None) is not None and self._link.proc.is_alive():
                self._link.queue.put(("abort", rid))
        self.llm.abort(ids)

    def generate(self, prompts: Prompts, params: ParamsLike = None) -> list[RequestOutput]:
        """Serve the prompts (one, or a list; one ``SamplingParams`` for all or one each) to the end; outputs in
        the order of the prompts. Every prompt is checked before any is sent."""
        self._check_alive()
        batch = InputProcessor.batch(prompts, params)
        checked = [self.llm.processor.token_ids(p, f"prompt {i}") for i, (p, _) in enumerate(batch)]
        ids: list[str] = []
        try:
            for token_ids, (_, p) in zip(checked, batch):
                ids.append(self.add_request(token_ids, p))
            while self.has_unfinished():
                self.step()
            return [self.get_output(rid) for rid in ids]
        finally:  # Ctrl-C or a failure: this call's requests leave nothing behind, on either side
            if not self._closed:
                self.abort(ids)

    # ---- the end ---------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the prefill engine's process (given ``SHUTDOWN_S`` seconds to leave, killed at once if it is
        stopped) and the receiver, and free the decode engine; this object is unusable afterwards."""
        if not self._closed:
            self._closed = True
            self._waiting.clear()
            self._link.end(graceful=True)
            self._end_link()
            self._free_decode()

    def __enter__(self) -> DisaggregatedLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _shape_value(name: str, value: int) -> str:
    if name == "dtype":
        return str(KV_DTYPES[value]).removeprefix("torch.") if 0 <= value < len(KV_DTYPES) else "another dtype"
    return str(value)
