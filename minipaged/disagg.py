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
each step fills (``KVConnectorMetadata.sends``) and its runner ships them after the forward (``KVSender``); the
consumer's ``ReceivingConnector`` is the CPU offloading store, fed from the wire. The decode engine computes the
first output token itself, so its tokens are those of a single engine (tests/test_disagg.py).

Kept small on purpose: one producer and one consumer, single-rank engines, only full blocks travel (the last
partial block is recomputed, at most ``block_size - 1`` tokens), and a block the consumer's store has lost by
the time the request is admitted is computed again rather than fetched again.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import signal
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .block_pool import BlockHash, KVCacheBlock
from .cache_engine import CacheEngine
from .distributed import free_port, open_store
from .engine import LLM
from .inputs import Prompt
from .kv_connector import KVConnector, KVConnectorMetadata, OffloadingConnector
from .outputs import RequestOutput
from .sampling_params import SamplingParams

HASH_BYTES = 32  # a block hash: sha256
PREFILL_ONLY = SamplingParams(max_tokens=1, temperature=0)  # the producer's one sampled token is thrown away


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
        if t.numel():
            self.group.send([t], 1 - self.group.rank(), 0).wait()


def _prefill_main(model: Any, kwargs: dict[str, Any], port: int, inbox: Any, timeout_s: float, parent_pid: int) -> None:
    """The prefill engine's process: join the group, load the model, then prefill what arrives until told to
    stop (None), sending each step's blocks and each finished prefill to rank 0."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the caller, which then ends this process
    group: Any = None
    try:
        store = open_store("127.0.0.1", port, 2, False, timeout_s)
        group = dist.ProcessGroupGloo(dist.PrefixStore("disagg", store), 1, 2, datetime.timedelta(seconds=timeout_s))
        llm = LLM(model, **kwargs)
        sender = KVSender(group)
        llm.kv_connector_factory = SendingConnector
        llm.reset()
        llm.runner.kv_sender = sender
        spec = llm.cache.spec
        shape = [spec.num_layers, llm.block_size, spec.num_kv_heads, spec.head_dim, llm.dtype.itemsize]
        group.send([torch.tensor(shape, dtype=torch.long)], 0, 0).wait()  # rank 0 checks its pool matches
        while True:
            wait = not llm.scheduler.has_unfinished()
            try:
                msg = inbox.get(timeout=1.0) if wait else inbox.get_nowait()
            except queue.Empty:
                msg = ()
                if wait and os.getppid() != parent_pid:  # orphaned: the caller died without a word
                    return
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
        group.send([torch.tensor([-1, 0], dtype=torch.long)], 0, 0).wait()  # the last message: goodbye
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    finally:
        if group is not None:
            try:
                group.shutdown()
            except Exception:
                pass


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


class DisaggregatedLLM:
    """A prefill engine in a process of its own and a decode engine in this one, with ``LLM``'s calls.

    ``kwargs`` are both engines' knobs (``Config``); ``prefill`` and ``decode`` override them for one side
    (``decode`` must keep a KV store: ``kv_offloading_size``, default 256 MiB). Both need the same ``block_size``
    and ``dtype``: the producer's blocks are copied into the consumer's pool as they are. ``threads`` sets each
    process's torch threads (on one machine the two share its cores: ``(cores // 2, cores // 2)`` by default).
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        prefill: dict[str, Any] | None = None,
        decode: dict[str, Any] | None = None,
        threads: tuple[int, int] | None = None,
        timeout_s: float = 120.0,
        **kwargs: Any,
    ) -> None:
        half = max(1, (os.cpu_count() or 2) // 2)
        prefill_threads, decode_threads = threads or (half, half)
        decode_kw = {"kv_offloading_size": "256MiB", **kwargs, **(decode or {})}
        prefill_kw = {**kwargs, **(prefill or {})}
        for knob in ("block_size", "dtype"):
            if prefill_kw.get(knob) != decode_kw.get(knob):
                raise ValueError(f"the prefill and decode engines need the same {knob}")
        if any(kw.get("tensor_parallel_size", 1) != 1 for kw in (prefill_kw, decode_kw)):
            raise ValueError(
                "DisaggregatedLLM runs single-rank engines: a tensor-parallel producer would send only rank 0's "
                "heads. Leave tensor_parallel_size at 1"
            )
        self.timeout_s = timeout_s
        port = free_port()
        self._store = open_store("127.0.0.1", port, 2, True, timeout_s)
        ctx = mp.get_context("spawn")
        self._inbox_q = ctx.Queue()
        self._proc = ctx.Process(
            target=_prefill_threads_main,
            args=(prefill_threads, model, prefill_kw, port, self._inbox_q, timeout_s, os.getpid()),
            name="minipaged-prefill",
            daemon=True,
        )
        self._proc.start()
        self._group: Any = None
        try:
            self._group = self._while_alive(
                lambda: dist.ProcessGroupGloo(
                    dist.PrefixStore("disagg", self._store), 0, 2, datetime.timedelta(seconds=timeout_s)
                )
            )
            old = torch.get_num_threads()
            torch.set_num_threads(decode_threads)
            self._threads = (old, decode_threads)
            self.llm = LLM(model, **decode_kw)
            if self.llm.runner.num_offload_blocks == 0:
                raise ValueError("the decode engine needs kv_offloading_size: the producer's blocks land there")
            shape = torch.zeros(5, dtype=torch.long)
            self._while_alive(lambda: self._group.recv([shape], 1, 0).wait())
            spec = self.llm.cache.spec
            mine = [spec.num_layers, self.llm.block_size, spec.num_kv_heads, spec.head_dim, self.llm.dtype.itemsize]
            if shape.tolist() != mine:
                raise ValueError(f"the prefill engine's blocks {shape.tolist()} do not fit this pool's {mine}")
        except BaseException:
            self._end(graceful=False)
            raise
        self._block_shape = (mine[0], 2, mine[1], mine[2], mine[3])
        self.inbox = Inbox()
        self.llm.kv_connector_factory = lambda: ReceivingConnector(
            self.llm.runner.num_offload_blocks, self.llm.block_size, self.inbox, self._write
        )
        self.llm.reset()
        self._cond = threading.Condition()
        self._prefilled: set[str] = set()
        self._receiver_error: str | None = None
        self._closed = False
        self._receiver = threading.Thread(target=self._receive, name="minipaged-kv-receiver", daemon=True)
        self._receiver.start()
        self._waiting: dict[str, tuple[list[int], SamplingParams, float]] = {}  # sent to prefill, not back yet

    # ---- plumbing --------------------------------------------------------------------------------------------
    def _while_alive(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` (a wait on the prefill process), or an error as soon as that process is gone."""
        result: list[Any] = []
        failed: list[BaseException] = []

        def run() -> None:
            try:
                result.append(fn())
            except BaseException as e:
                failed.append(e)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        while t.is_alive():
            t.join(timeout=0.2)
            if t.is_alive() and not self._proc.is_alive():
                raise RuntimeError(
                    f"the prefill engine's process ended while starting (exit code {self._proc.exitcode}): its "
                    "error is printed above"
                )
        if failed:
            raise failed[0]
        return result[0]

    def _write(self, slot: int, kv: torch.Tensor) -> None:
        for layer, (k, v) in enumerate(self.llm.cache.offload_cache):
            k[slot].copy_(kv[layer, 0])
            v[slot].copy_(kv[layer, 1])

    def _receive(self) -> None:
        """Rank 0's receiver: blocks into the inbox, finished prefills into ``_prefilled``, until goodbye."""
        dtype = self.llm.dtype
        try:
            while True:
                header = torch.zeros(2, dtype=torch.long)
                self._group.recv([header], 1, 0).wait()
                n, done_bytes = header.tolist()
                if n < 0:
                    return
                if n:
                    hashes = torch.empty(n * HASH_BYTES, dtype=torch.uint8)
                    self._group.recv([hashes], 1, 0).wait()
                    layers, two, bs, heads, dim = self._block_shape
                    kv = torch.empty((layers, two, n, bs, heads, dim), dtype=dtype)
                    self._group.recv([kv.view(torch.uint8).view(-1)], 1, 0).wait()
                    raw = hashes.numpy().tobytes()
                    blocks = [(BlockHash(raw[i * HASH_BYTES : (i + 1) * HASH_BYTES]), kv[:, :, i]) for i in range(n)]
                    self.inbox.put(blocks)
                if done_bytes:
                    payload = torch.empty(done_bytes, dtype=torch.uint8)
                    self._group.recv([payload], 1, 0).wait()
                    with self._cond:
                        self._prefilled.update(payload.numpy().tobytes().decode().split("\n"))
                        self._cond.notify_all()
        except Exception as e:  # the producer died, or the group was torn down
            with self._cond:
                self._receiver_error = f"{type(e).__name__}: {e}"
                self._cond.notify_all()

    def _check_alive(self) -> None:
        if self._closed:
            raise RuntimeError("this DisaggregatedLLM is shut down")
        if not self._proc.is_alive() or self._receiver_error is not None:
            why = self._receiver_error or f"exit code {self._proc.exitcode}"
            raise RuntimeError(f"the prefill engine's process is gone ({why}); shut this engine down")

    # ---- requests --------------------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Send the prompt to the prefill engine; it joins the decode engine once its K/V has arrived. Its TTFT
        counts from ``arrival_time`` (the decode engine's clock, ``self.llm.now()``), by default now."""
        self._check_alive()
        params = params or SamplingParams()
        rid = request_id if request_id is not None else self.llm._take_ids(1)[0]
        if rid in self._waiting or rid in self.llm._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        token_ids = self.llm.processor.token_ids(prompt, rid)
        now = self.llm.now()
        self._waiting[rid] = (token_ids, params, now if arrival_time is None else min(float(arrival_time), now))
        self._inbox_q.put(("add", rid, token_ids))
        return rid

    def has_unfinished(self) -> bool:
        return bool(self._waiting) or self.llm.scheduler.has_unfinished()

    def step(self, wait_s: float | None = None) -> list[str]:
        """Admit the requests whose prefill is done, then run one decode-engine step; with nothing to decode,
        wait for a prefill to finish first (at most ``wait_s`` seconds, by default ``timeout_s``, after which
        a wait that ``timeout_s`` did not end is an error). Returns the ids that finished."""
        self._check_alive()
        with self._cond:
            if not self.llm.scheduler.has_unfinished() and self._waiting:
                self._cond.wait_for(
                    lambda: bool(self._prefilled & self._waiting.keys()) or self._receiver_error is not None,
                    timeout=self.timeout_s if wait_s is None else wait_s,
                )
            # ids no longer waiting were aborted while their prefill ran: forget them too
            ready, self._prefilled = self._prefilled & self._waiting.keys(), set()
        for rid in sorted(ready, key=lambda r: self._waiting[r][2]):
            token_ids, params, arrival = self._waiting.pop(rid)
            self.llm.add_request(token_ids, params, request_id=rid, arrival_time=arrival)
        if not self.llm.scheduler.has_unfinished():
            if self._waiting and not ready and wait_s is None:
                self._check_alive()
                raise TimeoutError(f"no prefill finished in {self.timeout_s} s")
            return []
        return self.llm.step()

    def get_output(self, request_id: str) -> RequestOutput:
        return self.llm.get_output(request_id)

    def abort(self, request_ids: Sequence[str]) -> None:
        """Stop requests wherever they are: in the prefill engine (told to drop them) or in the decode engine."""
        for rid in request_ids:
            if self._waiting.pop(rid, None) is not None and not self._closed and self._proc.is_alive():
                self._inbox_q.put(("abort", rid))
        self.llm.abort(list(request_ids))

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | None = None) -> list[RequestOutput]:
        """Serve the prompts to the end; outputs in the order of the prompts."""
        ids = [self.add_request(p, params) for p in prompts]
        try:
            while self.has_unfinished():
                self.step()
            return [self.get_output(rid) for rid in ids]
        finally:  # Ctrl-C or a failure: this call's requests leave nothing behind, on either side
            self.abort(ids)

    # ---- the end ---------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the prefill engine's process and the receiver; this object is unusable afterwards."""
        if not self._closed:
            self._closed = True
            self._end(graceful=True)
            torch.set_num_threads(self._threads[0])

    def _end(self, graceful: bool) -> None:
        if graceful and self._proc.is_alive():
            self._inbox_q.put(None)
            self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        if self._group is not None:
            try:
                self._group.shutdown() if graceful else self._group.abort()
            except Exception:
                pass
        receiver = getattr(self, "_receiver", None)
        if receiver is not None:
            receiver.join(timeout=5)

    def __enter__(self) -> DisaggregatedLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _prefill_threads_main(threads: int, *args: Any) -> None:
    torch.set_num_threads(threads)
    _prefill_main(*args)
