"""Exercise 09b — one Llama decoder layer on a paged step: layers a learner gets wrong, each one mistake away.

``FusedLayer`` is a right answer written differently from the solution notebook's (which loops over sequences
with einsum): it gathers every sequence's context into one padded batch and calls PyTorch's
``scaled_dot_product_attention`` with a mask, fuses the three projections into one matrix product, and rotates with
complex numbers. It is graded for full marks as the mutants' helper. Each mutant below changes one stage of it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from . import mutant

CHECKS = {"decoder_layer": ["check_layer_spec", "check_layer_smollm2"]}


class FusedLayer:
    """One stage per method, so that each mutant changes exactly one."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return weight * (x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps))

    def angles(self, positions: torch.Tensor, d: int, theta: float) -> torch.Tensor:
        freqs = theta ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
        return torch.outer(positions.double(), freqs)

    def rope(self, x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
        d = x.shape[-1]
        rot = torch.polar(torch.ones(1, dtype=torch.float64), self.angles(positions, d, theta))[:, None, :]
        z = torch.complex(x[..., : d // 2].double(), x[..., d // 2 :].double()) * rot
        return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)

    def write(self, cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
        cache.flatten(0, 1).index_copy_(0, slots, values)

    def expand(self, kv: torch.Tensor, num_heads: int) -> torch.Tensor:
        return kv.repeat_interleave(num_heads // kv.shape[1], dim=1)

    def mask(self, q_len: int, n: int) -> torch.Tensor:
        return torch.ones(q_len, n, dtype=torch.bool).tril(n - q_len)

    def context(self, cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
        bs = cache.shape[1]
        return cache[table[: (n + bs - 1) // bs]].flatten(0, 1)[:n]

    def attention(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: Any, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        cu = meta.cu_seqlens_q.tolist()
        for j, n in enumerate(meta.seq_lens.tolist()):
            s, e = cu[j], cu[j + 1]
            k = self.expand(self.context(kc, meta.block_tables[j], n), q.shape[1])
            v = self.expand(self.context(vc, meta.block_tables[j], n), q.shape[1])
            o = F.scaled_dot_product_attention(
                q[s:e].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=self.mask(e - s, n),
                scale=scale,
            )  # fmt: skip
            out[s:e] = o.transpose(0, 1)
        return out

    def mlp(self, h: torch.Tensor, w: dict) -> torch.Tensor:
        return (F.silu(F.linear(h, w["mlp.gate_proj.weight"])) * F.linear(h, w["mlp.up_proj.weight"])) @ w[
            "mlp.down_proj.weight"
        ].T

    def scale(self, cfg: Any) -> float:
        return 1 / cfg.head_dim**0.5

    def __call__(self, x, positions, weights, k_cache, v_cache, meta, cfg) -> torch.Tensor:  # type: ignore[no-untyped-def]
        w, hd = weights, cfg.head_dim
        h = self.rms_norm(x, w["input_layernorm.weight"], cfg.rms_norm_eps)
        qkv = F.linear(h, torch.cat([w[f"self_attn.{p}_proj.weight"] for p in "qkv"]))
        q, k, v = qkv.split([cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd], dim=-1)
        q = self.rope(q.unflatten(-1, (cfg.num_heads, hd)), positions, cfg.rope_theta)
        k = self.rope(k.unflatten(-1, (cfg.num_kv_heads, hd)), positions, cfg.rope_theta)
        self.write(k_cache, meta.slot_mapping, k)
        self.write(v_cache, meta.slot_mapping, v.unflatten(-1, (cfg.num_kv_heads, hd)))
        a = self.attention(q, k_cache, v_cache, meta, self.scale(cfg))
        x = x + F.linear(a.flatten(1), w["self_attn.o_proj.weight"])
        return x + self.mlp(self.rms_norm(x, w["post_attention_layernorm.weight"], cfg.rms_norm_eps), w)


def _layer(cls: type[FusedLayer]) -> Any:
    layer = cls()

    def decoder_layer(x, positions, weights, k_cache, v_cache, meta, cfg):  # type: ignore[no-untyped-def]
        return layer(x, positions, weights, k_cache, v_cache, meta, cfg)

    return decoder_layer


HELPERS: dict = {"decoder_layer": _layer(FusedLayer)}


class _NormWithoutEps(FusedLayer):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return weight * (x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True)))  # MISTAKE: + eps inside the root


class _LayerNorm(FusedLayer):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return weight * F.layer_norm(x, x.shape[-1:], eps=eps)  # MISTAKE: RMSNorm subtracts no mean


class _InterleavedRope(FusedLayer):
    def rope(self, x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
        d = x.shape[-1]
        rot = torch.polar(torch.ones(1, dtype=torch.float64), self.angles(positions, d, theta))[:, None, :]
        z = torch.view_as_complex(x.double().unflatten(-1, (d // 2, 2)).contiguous()) * rot  # MISTAKE: halves
        return torch.view_as_real(z).flatten(-2).to(x.dtype)


class _RowIndexRope(FusedLayer):
    def rope(self, x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
        return super().rope(x, torch.arange(x.shape[0]), theta)  # MISTAKE: each row's own position, not its index


class _RepeatNotInterleave(FusedLayer):
    def expand(self, kv: torch.Tensor, num_heads: int) -> torch.Tensor:
        return kv.repeat(1, num_heads // kv.shape[1], 1)  # MISTAKE: head h reads KV head h // group


class _NoCausalMask(FusedLayer):
    def mask(self, q_len: int, n: int) -> torch.Tensor:
        return torch.ones(q_len, n, dtype=torch.bool)  # MISTAKE: a row must not see the positions after it


class _MaskFromTheStart(FusedLayer):
    def mask(self, q_len: int, n: int) -> torch.Tensor:
        return torch.ones(q_len, n, dtype=torch.bool).tril()  # MISTAKE: the new rows are the last of the context


class _ScaleByDim(FusedLayer):
    def scale(self, cfg: Any) -> float:
        return 1 / cfg.head_dim  # MISTAKE: 1 / sqrt(head_dim)


class _SiluOnUp(FusedLayer):
    def mlp(self, h: torch.Tensor, w: dict) -> torch.Tensor:
        gate, up = F.linear(h, w["mlp.gate_proj.weight"]), F.linear(h, w["mlp.up_proj.weight"])
        return (gate * F.silu(up)) @ w["mlp.down_proj.weight"].T  # MISTAKE: silu(gate) * up


class _AttendsToTheStepOnly(FusedLayer):
    def attention(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: Any, scale: float) -> torch.Tensor:
        lens = meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]
        short = type(meta)(meta.slot_mapping, meta.cu_seqlens_q, lens, meta.block_tables)
        return super().attention(q, kc, vc, short, scale)  # MISTAKE: seq_lens, the whole context in the cache


MUTANTS = [
    ("norm_without_eps", _NormWithoutEps, "RMSNorm without eps: a row near zero blows up"),
    ("layer_norm", _LayerNorm, "LayerNorm instead of RMSNorm: the mean is subtracted"),
    ("interleaved_rope", _InterleavedRope, "RoPE on interleaved pairs (GPT-J style), not on the two halves (Llama)"),
    ("row_index_rope", _RowIndexRope, "RoPE at each row's index in the step, not its position in its sequence"),
    ("gqa_by_repeat", _RepeatNotInterleave, "GQA by repeat: query head h reads KV head h % kv_heads, not h // group"),
    ("no_causal_mask", _NoCausalMask, "no causal mask: a prompt's rows see the tokens after them"),
    ("mask_from_the_start", _MaskFromTheStart, "the causal mask anchored at position 0, not at the context's end"),
    ("scale_by_dim", _ScaleByDim, "scores scaled by 1/head_dim, not 1/sqrt(head_dim)"),
    ("silu_on_up", _SiluOnUp, "SwiGLU with silu on the up projection"),
    ("step_rows_only", _AttendsToTheStepOnly, "attention over this step's rows only: the cache is never read"),
]
for _name, _cls, _mistake in MUTANTS:  # module-level names: tests/mutants collects them by name
    globals()[_name] = mutant("decoder_layer", _mistake)(_layer(_cls))
