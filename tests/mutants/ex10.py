"""Exercise 10 — the learner's engine: step loops a learner gets wrong, each one mistake from a right one.

``SnapshotEngine`` is a right answer written differently from the solution notebook's: its inputs are built with
tensor operations from the block tables, its rollback keeps a shallow copy of every object a step can change, found through the garbage collector, and its forward pass keeps the
last-row logits only. It is graded (on the tiny model, with the package's pieces behind the build track's
interfaces) for full marks as the mutants' helper. Each mutant below changes one method of it.
"""

from __future__ import annotations

import copy
import gc
import pickle
import types
from collections import deque
from typing import Any

import torch

from minipaged.classroom.grading.ex10 import StepMeta, make_request, rms_norm

from . import mutant

CHECKS = {"Engine": ["check_engine_inputs", "check_engine_tiny", "check_engine_rollback"]}


class SnapshotEngine:
    def __init__(self, model: Any, parts: dict, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int) -> None:  # fmt: skip
        self.model, self.block_size, self.cfg = model, block_size, model.cfg
        self.kv_cache_manager = parts["KVCacheManager"](parts["BlockPool"](num_blocks), block_size, watermark_blocks=0)
        self.scheduler = parts["Scheduler"](self.kv_cache_manager, max_num_seqs, max_num_batched_tokens, max_model_len)
        self.layer = parts["decoder_layer"]
        shape = (len(model.layers), 2, num_blocks, block_size, self.cfg.num_kv_heads, self.cfg.head_dim)
        self.cache = torch.zeros(shape)
        self.requests: dict[str, Any] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int], max_tokens: int) -> None:
        self.requests[request_id] = make_request(
            request_id, prompt_token_ids, max_tokens, self.model.eos_token_id, self.block_size
        )
        self.scheduler.add_request(self.requests[request_id])

    def positions(self, start: int, n: int) -> torch.Tensor:
        return torch.arange(start, start + n)

    def context_len(self, start: int, n: int) -> int:
        return start + n

    def samples(self, req: Any, start: int, n: int) -> bool:
        return start + n >= req.num_tokens

    def slots(self, table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def prepare_inputs(self, scheduled: list[tuple[str, int]]) -> Any:
        parts: dict[str, list] = {"ids": [], "pos": [], "slots": [], "rows": []}
        lens, tables, cu = [], [], [0]
        for rid, n in scheduled:
            req = self.requests[rid]
            start = req.num_computed_tokens
            pos = self.positions(start, n)
            table = torch.tensor(self.kv_cache_manager.get_block_ids(rid))
            parts["ids"].append(torch.tensor(req.all_token_ids[start : start + n]))
            parts["pos"].append(pos)
            parts["slots"].append(self.slots(table, pos))
            cu.append(cu[-1] + n)
            lens.append(self.context_len(start, n))
            tables.append(table)
            if self.samples(req, start, n):
                parts["rows"].append(cu[-1] - 1)
        block_tables = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True, padding_value=0)
        meta = StepMeta(torch.cat(parts["slots"]), torch.tensor(cu), torch.tensor(lens), block_tables)
        return torch.cat(parts["ids"]), torch.cat(parts["pos"]), meta, torch.tensor(parts["rows"], dtype=torch.long)

    def final(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.model.norm, self.cfg.rms_norm_eps)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: StepMeta, rows: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.embedding(ids, self.model.embed)
        for i, w in enumerate(self.model.layers):
            x = self.layer(x, pos, w, self.cache[i, 0], self.cache[i, 1], meta, self.cfg)
        return torch.nn.functional.linear(self.final(x.index_select(0, rows)), self.model.lm_head)

    def sample(self, logits: torch.Tensor) -> list[int]:
        return [int(row.argmax()) for row in logits]

    def snapshot(self) -> list[tuple[Any, Any]]:
        """A shallow copy of every mutable object the scheduler and the requests reach, found through the garbage
        collector's referents with a stack (a 10,000-block free list is too deep for recursion)."""
        saved, seen, todo = [], set(), [self.scheduler, self.requests]
        while todo:
            obj = todo.pop()
            if id(obj) in seen or isinstance(obj, (type, types.FunctionType, types.ModuleType, torch.Tensor)):
                continue
            seen.add(id(obj))
            todo.extend(gc.get_referents(obj))
            if hasattr(obj, "__dict__") and not isinstance(obj, type):
                todo.append(vars(obj))  # saved as a dict (3.11 keeps attributes inline, out of get_referents' sight)
            if isinstance(obj, (dict, list, deque, set)) or hasattr(type(obj), "__slots__"):
                saved.append((obj, copy.copy(obj)))
        return saved

    def restore(self, saved: list[tuple[Any, Any]]) -> None:
        for obj, was in saved:
            if isinstance(obj, (dict, set)):
                obj.clear()
                obj.update(was)
            elif isinstance(obj, (list, deque)):
                obj.clear()
                obj.extend(was)
            else:
                for c in type(obj).__mro__:
                    for name in c.__dict__.get("__slots__", ()):
                        if hasattr(was, name):
                            object.__setattr__(obj, name, getattr(was, name))

    def run_step(self) -> list[tuple[str, int]]:
        scheduled, _ = self.scheduler.schedule()
        if not scheduled:
            return []
        ids, pos, meta, rows = self.prepare_inputs(scheduled)
        with torch.no_grad():
            tokens = self.sample(self.forward(ids, pos, meta, rows))
        who = [
            rid for rid, n in scheduled if self.samples(self.requests[rid], self.requests[rid].num_computed_tokens, n)
        ]
        self.scheduler.update_from_output(scheduled, dict(zip(who, tokens)))
        return list(zip(who, tokens))

    def step(self) -> list[tuple[str, int]]:
        saved = self.snapshot()
        try:
            return self.run_step()
        except BaseException:
            self.restore(saved)
            raise

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        ids = [f"g{len(self.requests) + i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts):
            self.add_request(rid, p, max_tokens)
        while self.scheduler.has_unfinished():
            self.step()
        return [self.requests[rid].output_token_ids for rid in ids]


HELPERS: dict = {"Engine": SnapshotEngine}


@mutant("Engine", "positions restart at 0 every step: RoPE turns a chunk's and a decode's keys by the wrong angle")
class PositionsFromZero(SnapshotEngine):
    def positions(self, start: int, n: int) -> torch.Tensor:
        return torch.arange(n)  # MISTAKE: start + i, the token's place in its sequence


@mutant("Engine", "seq_lens holds the step's new tokens only: attention never reads the cached context")
class ContextOfTheStep(SnapshotEngine):
    def context_len(self, start: int, n: int) -> int:
        return n  # MISTAKE: start + n, the context once this step's tokens are written


@mutant("Engine", "every scheduled request samples: a prompt chunk gets a token it has not earned")
class ChunksSample(SnapshotEngine):
    def samples(self, req: Any, start: int, n: int) -> bool:
        return True  # MISTAKE: only when start + n reaches num_tokens


@mutant("Engine", "slots counted by the block's index in the table, not its physical id")
class SlotsByIndex(SnapshotEngine):
    def slots(self, table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return pos  # MISTAKE: table[pos // block_size] * block_size + pos % block_size


@mutant("Engine", "no final norm before the LM head")
class NoFinalNorm(SnapshotEngine):
    def final(self, x: torch.Tensor) -> torch.Tensor:
        return x  # MISTAKE: RMSNorm with the model's norm weight


@mutant("Engine", "no rollback: a failed step leaves its allocations and preemptions behind")
class NoRollback(SnapshotEngine):
    def step(self) -> list[tuple[str, int]]:
        return self.run_step()  # MISTAKE: snapshot first, restore on any exception


@mutant("Engine", "a failed step rolled back and swallowed: the caller never learns it failed")
class SwallowsTheError(SnapshotEngine):
    def step(self) -> list[tuple[str, int]]:
        saved = self.snapshot()
        try:
            return self.run_step()
        except BaseException:
            self.restore(saved)
            return []  # MISTAKE: raise: a step that failed must say so


@mutant("Engine", "only Exception rolled back: Ctrl-C in the middle of a step leaves it half done")
class ExceptionOnly(SnapshotEngine):
    def step(self) -> list[tuple[str, int]]:
        saved = self.snapshot()
        try:
            return self.run_step()
        except Exception:  # MISTAKE: BaseException (KeyboardInterrupt is not an Exception)
            self.restore(saved)
            raise


@mutant(
    "Engine",
    "rollback by pickling (as copy.deepcopy): right on a small pool, RecursionError along a 10,000-block free list",
)
class DeepcopyRollback(SnapshotEngine):
    def snapshot(self) -> Any:
        return pickle.dumps((self.scheduler, self.requests))  # MISTAKE: recursion along the free list's links

    def restore(self, saved: Any) -> None:
        self.scheduler, self.requests = pickle.loads(saved)
        self.kv_cache_manager = self.scheduler.kv_cache_manager
