"""How one Llama is cut into ``N`` shards, one per tensor-parallel rank (Megatron-LM's split, as vLLM does it).

Attention heads are independent until ``o_proj`` mixes them, and the MLP's 1536 hidden units are independent until
``down_proj`` sums them. So each rank takes a slice of the heads and a slice of the MLP, and the ranks need to talk
only where those slices are summed back — twice a layer::

                 column-parallel (no talk)         row-parallel          all-reduce
    x ─┬─▶ q/k/v: rank r's heads only ─▶ attention ─▶ o_proj: its rows ─▶ Σ over ranks ─▶ + x ─▶ …
       │   (SmolLM2 at N = 3: 3 of 9 query heads, 1 of 3 KV heads)
    h ─┴─▶ gate/up: its 512 of 1536 units ─▶ silu · ─▶ down_proj: its rows ─▶ Σ over ranks ─▶ + h

A column-parallel linear (vLLM's ``ColumnParallelLinear``) holds a slice of W's output rows: each rank computes
its own outputs, nothing to sum. A row-parallel one (``RowParallelLinear``) holds the matching slice of the input
columns: each rank's product is a partial sum of the full one, and an all-reduce adds them up.

The KV cache follows the heads: rank r stores only its KV heads, in its own paged pool. The scheduler hands out
block ids without knowing any of this, so every rank's block table is the same, and block 7 on every rank holds
the same tokens — each rank a different slice of their heads.

The vocabulary is split too (vLLM's ``VocabParallelEmbedding`` / ``ParallelLMHead``): rank r holds rows
[r·V/N, (r+1)·V/N) of the embedding (tied to the LM head in SmolLM2). An embedding lookup is then a sum over ranks
(the one rank that holds a token's row contributes it, the others zeros: one more all-reduce), and the logits are
gathered from the ranks' slices on rank 0, which samples. Replicating them instead would be simpler, but the LM
head is a fifth of SmolLM2's multiply-adds per decoded token (576 × 49,152 = 28 M, against about 106 M in its 30
layers): each rank would spend that much compute on logits it need not make.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from ..distributed import TPGroup
    from .layers import Linear


def tp_size(tp: TPGroup | None) -> int:
    return 1 if tp is None else tp.size


def vocab_shard(vocab_size: int, tp: TPGroup | None) -> tuple[int, int]:
    """(first row, rows per rank) of this rank's slice of the vocabulary; the last slice is padded with zero
    rows when ``N`` does not divide the vocabulary (their logits are cut off after the gather)."""
    if tp is None:
        return 0, vocab_size
    per_rank = -(-vocab_size // tp.size)
    return tp.rank * per_rank, per_rank


def row_parallel(linear: Linear, x: torch.Tensor, residual: torch.Tensor | None, tp: TPGroup | None) -> torch.Tensor:
    """``linear(x) (+ residual)`` for a row-parallel linear: this rank's partial product, summed over the ranks.

    The residual is added by rank 0 alone (fused into its GEMM), so the sum holds it once; the bias, likewise,
    lives on rank 0 only (``shard_state_dict``)."""
    if tp is None:
        return linear(x) if residual is None else linear.add(x, residual)
    y = linear.add(x, residual) if residual is not None and tp.rank == 0 else linear(x)
    return tp.all_reduce(y)


class VocabParallelEmbedding(nn.Embedding):
    """An embedding whose rows are split over the ranks: each looks up the tokens it holds, an all-reduce adds
    the ranks' answers (exactly one rank holds each token, the others add zeros)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup | None) -> None:
        self.start, rows = vocab_shard(vocab_size, tp)
        super().__init__(rows, hidden_size)
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return super().forward(ids)
        local = ids - self.start
        mine = (local >= 0) & (local < self.num_embeddings)
        x = super().forward(torch.where(mine, local, 0))
        return self.tp.all_reduce(x.masked_fill_(~mine[:, None], 0))


def gather_logits(local: torch.Tensor, vocab_size: int, tp: TPGroup | None) -> torch.Tensor | None:
    """The full rows of logits from each rank's slice of the vocabulary: on rank 0; None on the others."""
    if tp is None:
        return local
    full = tp.gather_last_dim(local)
    return None if full is None else full[..., :vocab_size]


# Where each weight is cut: (name ends with, dimension split; None: every rank keeps all of it).
_COLUMN = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")
_COLUMN_BIAS = ("q_proj.bias", "k_proj.bias", "v_proj.bias", "gate_proj.bias", "up_proj.bias")
_ROW = ("o_proj.weight", "down_proj.weight")
_ROW_BIAS = ("o_proj.bias", "down_proj.bias")
_VOCAB = ("embed_tokens.weight", "lm_head.weight")


def shard_state_dict(state: dict[str, torch.Tensor], config: Any, tp: TPGroup | None) -> dict[str, torch.Tensor]:
    """This rank's slice of a full checkpoint. Heads are cut whole: q_proj's rows come in blocks of ``head_dim``
    per head, so rank r's contiguous slice of rows is exactly its heads (and k/v's, its KV heads)."""
    if tp is None:
        return state
    r, n = tp.rank, tp.size
    out: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        if name.endswith(_COLUMN + _COLUMN_BIAS):
            w = w.chunk(n, dim=0)[r]
        elif name.endswith(_ROW):
            w = w.chunk(n, dim=1)[r]
        elif name.endswith(_ROW_BIAS):
            w = w if r == 0 else torch.zeros_like(w)  # added once, by rank 0
        elif name.endswith(_VOCAB):
            start, rows = vocab_shard(config.vocab_size, tp)
            w = w[start : start + rows]
            if len(w) < rows:  # the last slice of a vocabulary N does not divide
                w = torch.cat([w, w.new_zeros(rows - len(w), *w.shape[1:])])
        out[name] = w.contiguous()
    return out
