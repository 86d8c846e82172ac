"""Exercise 14 — the learner's engine, faster: engines that are right but not fast enough, fast but wrong, or fast
because they skip or hide the work.

``BatchedEngine`` is a right answer written differently from the solution notebook's: exercise 10's mutants'
``SnapshotEngine`` loop with a forward that plans each step once (rotary tables, each row's sequence and place, the
context's cache slots, the mask) and runs one padded attention call per layer. Each mutant changes one piece.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from minipaged.classroom.grading.ex10 import StepMeta

from . import mutant
from .ex10 import SnapshotEngine

CHECKS = {"FastEngine": ["check_fast_tokens", "check_fast_speed"]}


@dataclass
class Plan:
    """What a step's layers share: computed once a step."""

    cos: torch.Tensor
    sin: torch.Tensor  # the rotation's sign folded in
    seq: torch.Tensor  # each row's sequence
    col: torch.Tensor  # each row's place among its sequence's new rows
    ctx_slots: torch.Tensor  # [sequences * longest context]: the cache slot of every context position
    mask: torch.Tensor  # [sequences, 1, longest chunk, longest context]
    seqs: int
    q_max: int
    ctx_max: int


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps)) * w


class BatchedEngine(SnapshotEngine):
    def __init__(self, model: Any, parts: dict, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int) -> None:  # fmt: skip
        super().__init__(model, {**parts, "decoder_layer": None}, num_blocks, block_size, max_num_seqs,
                         max_num_batched_tokens, max_model_len)  # fmt: skip
        d = self.cfg.head_dim
        self.inv_freq = 1.0 / self.cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)

    def plan(self, pos: torch.Tensor, meta: StepMeta) -> Plan:
        d, bs = self.cfg.head_dim, self.block_size
        angle = pos.float()[:, None] * self.inv_freq
        cos, sin = angle.cos().repeat(1, 2)[:, None], angle.sin().repeat(1, 2)[:, None]
        sin[..., : d // 2].neg_()
        seqs = meta.seq_lens.shape[0]
        q_lens = meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]
        q_max, ctx_max = int(q_lens.max()), int(meta.seq_lens.max())
        seq = torch.repeat_interleave(torch.arange(seqs), q_lens)
        col = torch.arange(pos.shape[0]) - meta.cu_seqlens_q[:-1][seq]
        ctx = torch.arange(ctx_max)
        table_col = (ctx // bs).expand(seqs, ctx_max).clamp(max=meta.block_tables.shape[1] - 1)
        ctx_slots = (meta.block_tables.gather(1, table_col) * bs + ctx % bs).reshape(-1)
        q_pos = torch.full((seqs, q_max), -1, dtype=torch.long)
        q_pos[seq, col] = pos
        mask = ((ctx <= q_pos[:, :, None]) & (ctx < meta.seq_lens[:, None])[:, None, :])[:, None]
        return Plan(cos, sin, seq, col, ctx_slots, mask, seqs, q_max, ctx_max)

    def rotate(self, t: torch.Tensor, p: Plan) -> torch.Tensor:
        d = self.cfg.head_dim
        return t * p.cos + torch.cat([t[..., d // 2 :], t[..., : d // 2]], -1).mul_(p.sin)

    def attention(self, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, p: Plan) -> torch.Tensor:
        kv, d = self.cfg.num_kv_heads, self.cfg.head_dim
        keys = k_flat.index_select(0, p.ctx_slots).view(p.seqs, p.ctx_max, kv, d).transpose(1, 2)
        values = v_flat.index_select(0, p.ctx_slots).view(p.seqs, p.ctx_max, kv, d).transpose(1, 2)
        q_pad = q.new_zeros(p.seqs, p.q_max, *q.shape[1:])
        q_pad[p.seq, p.col] = q
        a = F.scaled_dot_product_attention(q_pad.transpose(1, 2), keys, values, attn_mask=p.mask, enable_gqa=True)
        return a.transpose(1, 2)[p.seq, p.col]

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: StepMeta, rows: torch.Tensor) -> torch.Tensor:
        cfg, d = self.cfg, self.cfg.head_dim
        n, p = ids.shape[0], self.plan(pos, meta)
        x = self.model.embed[ids]
        for i, w in enumerate(self.model.layers):
            h = _norm(x, w["input_layernorm.weight"], cfg.rms_norm_eps)
            q = self.rotate((h @ w["self_attn.q_proj.weight"].T).view(n, cfg.num_heads, d), p)
            k = self.rotate((h @ w["self_attn.k_proj.weight"].T).view(n, cfg.num_kv_heads, d), p)
            v = (h @ w["self_attn.v_proj.weight"].T).view(n, cfg.num_kv_heads, d)
            k_flat = self.cache[i, 0].view(-1, cfg.num_kv_heads, d)
            v_flat = self.cache[i, 1].view(-1, cfg.num_kv_heads, d)
            k_flat.index_copy_(0, meta.slot_mapping, k)
            v_flat.index_copy_(0, meta.slot_mapping, v)
            a = self.attention(q, k_flat, v_flat, p).reshape(n, -1)
            x = x + a @ w["self_attn.o_proj.weight"].T
            h = _norm(x, w["post_attention_layernorm.weight"], cfg.rms_norm_eps)
            gate = F.silu(h @ w["mlp.gate_proj.weight"].T, inplace=True).mul_(h @ w["mlp.up_proj.weight"].T)
            x = x + gate @ w["mlp.down_proj.weight"].T
        return _norm(x[rows], self.model.norm, cfg.rms_norm_eps) @ self.model.lm_head.T


HELPERS: dict = {"FastEngine": BatchedEngine}


@mutant("FastEngine", "attention sequence by sequence inside every layer: right, and too many operations")
class PerSequence(BatchedEngine):
    def attention(self, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, p: Plan) -> torch.Tensor:
        kv, d, out = self.cfg.num_kv_heads, self.cfg.head_dim, []
        for s in range(p.seqs):  # MISTAKE: one call for the batch, padded and masked
            rows = p.seq == s
            ctx = p.ctx_slots.view(p.seqs, p.ctx_max)[s]
            keys = k_flat.index_select(0, ctx).view(p.ctx_max, kv, d).transpose(0, 1)[None]
            values = v_flat.index_select(0, ctx).view(p.ctx_max, kv, d).transpose(0, 1)[None]
            mask = p.mask[s : s + 1, :, : int(rows.sum())]
            a = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], keys, values, attn_mask=mask,
                                               enable_gqa=True)  # fmt: skip
            out.append(a[0].transpose(0, 1))
        return torch.cat(out)


@mutant("FastEngine", "keys and values gathered once per row, not once per sequence: right, and too many bytes")
class GathersPerRow(BatchedEngine):
    def attention(self, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, p: Plan) -> torch.Tensor:
        slots = p.ctx_slots.view(p.seqs, p.ctx_max)[p.seq]  # MISTAKE: [rows, context]: a copy of it for every row
        keys = k_flat[slots].transpose(1, 2)  # [rows, kv, context, d]
        values = v_flat[slots].transpose(1, 2)
        mask = p.mask[p.seq, :, p.col][:, :, None]  # [rows, 1, 1, context]
        a = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask, enable_gqa=True)
        return a[:, :, 0]


@mutant("FastEngine", "the rotation's sign left out: fast, and every token after the first step wrong")
class UnsignedRotation(BatchedEngine):
    def rotate(self, t: torch.Tensor, p: Plan) -> torch.Tensor:
        d = self.cfg.head_dim
        return t * p.cos + torch.cat([t[..., d // 2 :], t[..., : d // 2]], -1).mul_(p.sin.abs())  # MISTAKE: the sign


_KEPT: dict[str, list[list[int]]] = {}


@mutant("FastEngine", "outputs kept from an earlier run: no work at all the second time")
class KeepsOutputs(BatchedEngine):
    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        from minipaged.classroom.grading import capstone

        key = repr((prompts, max_tokens))
        if key not in _KEPT and prompts == capstone.prompt_ids():  # MISTAKE: the tokens must come from this run
            _KEPT[key] = capstone.reference_outputs(prompts, max_tokens)
        return _KEPT.get(key) or super().generate(prompts, max_tokens)


@mutant("FastEngine", "the forward run in another thread, where the grader's meter does not see it")
class OffTheMeter(BatchedEngine):
    def forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: StepMeta, rows: torch.Tensor) -> torch.Tensor:
        box: dict[str, torch.Tensor] = {}
        worker = threading.Thread(
            target=lambda: box.setdefault("out", super(OffTheMeter, self).forward(ids, pos, meta, rows))
        )
        worker.start()  # MISTAKE: the work must be done where it is counted
        worker.join()
        return box["out"]
