"""Checks for exercise 09b (the build track): one Llama decoder layer on the flat rows of a paged step.

The learner writes ``decoder_layer(x, positions, weights, k_cache, v_cache, meta, cfg) -> x`` from its spec:
RMSNorm, the q/k/v projections, RoPE at each row's own position, the new K/V written into the paged cache through
``meta.slot_mapping``, causal attention of each sequence's new rows over its whole context read back through its
block table (grouped-query: several query heads share a KV head), the output projection and residual, then
RMSNorm, the SwiGLU MLP and residual. The rows of one call are a mixed step: prompt chunks and decode tokens of
several sequences, laid out as ``meta.cu_seqlens_q`` says.

The reference is transformers' own ``LlamaDecoderLayer`` (eager attention), run on each whole sequence at once:
what the learner's layer computes over several steps, a chunk or a token at a time through the cache, must match
what transformers computes in one pass. Two groups:

* ``layer_spec``: small layers with random weights (plain, grouped-query with 3 query heads per KV head as in
  SmolLM2, multi-head) over step plans from one whole prompt to mixed steps of chunks and decodes, with blocks
  scattered through the pool and stale values in every slot a sequence does not own.
* ``layer_smollm2``: the learner's layer in place of each of SmolLM2's 30, layer by layer (each given
  transformers' input to that layer) and chained (each given the learner's previous output), over a chunked,
  mixed schedule; the first layer that differs is named, and the chained run's next tokens must be transformers'.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...model.llama import _rope_theta
from .core import Check, CheckOutcome, report

LayerFn = Callable[..., torch.Tensor]
RTOL = 2e-4  # max |got - want| over max |want|, float32: summation order moves the last bits, nothing more


@dataclass(frozen=True)
class LayerConfig:
    """The shapes and constants of a layer (a model's ``config.json`` holds them)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0


@dataclass
class StepMeta:
    """Where the rows of one step go and what they read (the names of ``model_runner`` and exercise 09).

    ``slot_mapping[i]``: the cache slot (``block * block_size + offset``) row ``i``'s K/V is written to.
    ``cu_seqlens_q``: sequence ``j``'s rows are ``cu_seqlens_q[j]:cu_seqlens_q[j + 1]``.
    ``seq_lens[j]``: sequence ``j``'s tokens in the cache once this step's are written (its context).
    ``block_tables[j]``: its physical blocks in order, padded with 0 (the null block)."""

    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor


Plan = list[list[tuple[int, int, int]]]  # steps; each a list of (sequence, start position, new tokens)


def hf_layer(cfg: LayerConfig, seed: int) -> Any:
    """A transformers ``LlamaDecoderLayer`` of this shape with seeded random weights, eager attention."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    values: dict[str, Any] = dict(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, num_hidden_layers=1, vocab_size=32, attn_implementation="eager",
    )  # fmt: skip
    config = LlamaConfig(**values)
    torch.manual_seed(seed)
    layer = LlamaDecoderLayer(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("layernorm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[1]))
    return layer, config


def hf_layer_outputs(layer: Any, config: Any, x: torch.Tensor) -> torch.Tensor:
    """transformers' layer on one whole sequence ``x`` [n, hidden] at positions 0..n-1, causal: [n, hidden]."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    n = x.shape[0]
    positions = torch.arange(n).unsqueeze(0)
    cos, sin = LlamaRotaryEmbedding(config)(x.unsqueeze(0), positions)
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        out = layer(x.unsqueeze(0), attention_mask=mask, position_ids=positions, position_embeddings=(cos, sin))
    return (out[0] if isinstance(out, tuple) else out)[0]


def weights_of(layer: Any) -> dict[str, torch.Tensor]:
    """A layer's weights by transformers' names (``self_attn.q_proj.weight``, ...), detached copies."""
    return {k: v.detach().clone() for k, v in layer.state_dict().items()}


class PagedRun:
    """Runs a layer function over a step plan, as an engine would: a pool of blocks (block 0 the null block, the
    others handed out shuffled), each sequence's table, every step's flat rows and ``StepMeta``."""

    def __init__(self, cfg: LayerConfig, seq_lens: list[int], block_size: int, seed: int, dtype: torch.dtype) -> None:
        rng = random.Random(seed)
        self.cfg, self.block_size = cfg, block_size
        need = [-(-n // block_size) for n in seq_lens]
        ids = list(range(1, sum(need) + 4))
        rng.shuffle(ids)
        self.tables = [[ids.pop() for _ in range(k)] for k in need]
        shape = (sum(need) + 4, block_size, cfg.num_kv_heads, cfg.head_dim)
        g = torch.Generator().manual_seed(seed)
        # Stale values everywhere: a slot read before it is written, or one not the sequence's, shows.
        self.k_cache = (torch.randn(shape, generator=g) * 50).to(dtype)
        self.v_cache = (torch.randn(shape, generator=g) * 50).to(dtype)

    def step(self, fn: LayerFn, xs: list[torch.Tensor], step: list[tuple[int, int, int]], weights: dict) -> list:
        rows, positions, slots, cu, lens = [], [], [], [0], []
        for seq, start, n in step:
            rows.append(xs[seq][start : start + n])
            pos = list(range(start, start + n))
            positions += pos
            slots += [self.tables[seq][p // self.block_size] * self.block_size + p % self.block_size for p in pos]
            cu.append(cu[-1] + n)
            lens.append(start + n)
        width = max(len(self.tables[s]) for s, _, _ in step)
        tables = [self.tables[s] + [0] * (width - len(self.tables[s])) for s, _, _ in step]
        meta = StepMeta(torch.tensor(slots), torch.tensor(cu), torch.tensor(lens), torch.tensor(tables))
        out = fn(torch.cat(rows), torch.tensor(positions), weights, self.k_cache, self.v_cache, meta, self.cfg)
        return [out[cu[i] : cu[i + 1]] for i in range(len(step))]

    def run(self, fn: LayerFn, xs: list[torch.Tensor], plan: Plan, weights: dict) -> list[torch.Tensor]:
        """Every sequence's output rows, each computed in the step the plan gives it."""
        outs = [torch.full_like(x, float("nan")) for x in xs]
        for step in plan:
            for (seq, start, n), rows in zip(step, self.step(fn, xs, step, weights)):
                outs[seq][start : start + n] = rows
        return outs


def _compare(got: list[torch.Tensor], want: list[torch.Tensor]) -> str:
    """'matches' or the first sequence and row that differ, with the error."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape:
            return f"sequence {i}: shape {tuple(g.shape)}, expected {tuple(w.shape)}"
        if not torch.isfinite(g).all():
            row = int((~torch.isfinite(g)).any(-1).nonzero()[0])
            return f"sequence {i}, position {row}: NaN or inf (a stale slot read, or a row never written?)"
        err = (g.float() - w.float()).abs()
        scale = w.float().abs().max().clamp_min(1e-6)
        if float(err.max() / scale) > RTOL:
            row = int(err.max(-1).values.argmax())
            return (
                f"sequence {i}, position {row} is the first worst: max error {float(err[row].max()):.3g} "
                f"against values up to {float(scale):.3g}"
            )
    return "matches"


# ---- layer_spec: small random layers, step plans of every kind --------------------------------------------------
SMALL = {
    "GQA 4:2": LayerConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96),
    "GQA 6:2 (SmolLM2's 3 per KV head), theta 1e5": LayerConfig(
        hidden_size=96, num_heads=6, num_kv_heads=2, head_dim=16, intermediate_size=160, rope_theta=1e5
    ),
    "MHA 2:2, head_dim 32, eps 1e-6": LayerConfig(
        hidden_size=48, num_heads=2, num_kv_heads=2, head_dim=32, intermediate_size=64, rms_norm_eps=1e-6
    ),
}

# (label, sequence lengths, plan, block size)
PLANS: list[tuple[str, list[int], Plan, int]] = [
    ("one 6-token prompt in one step", [6], [[(0, 0, 6)]], 4),
    ("a 10-token prompt in chunks of 4 and 6: the second reads the first's K/V from the cache", [10],
     [[(0, 0, 4)], [(0, 4, 6)]], 4),
    ("a 5-token prompt, then 4 decode steps of one token", [9], [[(0, 0, 5)], *[[(0, p, 1)] for p in range(5, 9)]], 4),
    (
        "a mixed step: a's last chunk, b's decode, c's whole prompt (blocks of 8)",
        [20, 12, 7],
        [[(0, 0, 8), (1, 0, 11)], [(0, 8, 12), (1, 11, 1), (2, 0, 7)]],
        8,
    ),
    (
        "four sequences over five steps: chunks, decodes and a late arrival (blocks of 2)",
        [9, 6, 5, 3],
        [
            [(0, 0, 4), (1, 0, 5)],
            [(0, 4, 4), (1, 5, 1), (2, 0, 3)],
            [(0, 8, 1), (2, 3, 1)],
            [(2, 4, 1), (3, 0, 3)],
        ],
        2,
    ),
]  # fmt: skip


@functools.cache
def _spec_reference(cfg_name: str, plan_index: int) -> tuple[dict, list[torch.Tensor], list[torch.Tensor]]:
    """A case's weights, input rows and transformers' output rows (computed once per process: they never change)."""
    cfg = SMALL[cfg_name]
    lens = PLANS[plan_index][1]
    layer, config = hf_layer(cfg, seed=plan_index)
    g = torch.Generator().manual_seed(100 + plan_index)
    xs = [torch.randn(n, cfg.hidden_size, generator=g) for n in lens]
    return weights_of(layer), xs, [hf_layer_outputs(layer, config, x) for x in xs]


def _spec_case(fn: LayerFn, cfg_name: str, plan_index: int) -> str:
    _label, lens, plan, bs = PLANS[plan_index]
    saved, xs, want = _spec_reference(cfg_name, plan_index)
    weights = {k: v.clone() for k, v in saved.items()}
    run = PagedRun(SMALL[cfg_name], lens, bs, seed=plan_index, dtype=torch.float32)
    got = run.run(fn, [x.clone() for x in xs], plan, weights)
    if any(not torch.equal(saved[k], weights[k]) for k in weights):
        return "your layer changed its weights"
    return _compare(got, want)


# One hint per rung of the ladder: what the case adds to the one before it.
PLAN_HINTS = [
    "one step, whole prompts: RMSNorm in float32 with eps inside the root; RoPE on the two halves of each head at "
    "the row's own position; each query row sees its sequence up to its own position; query head h reads KV head "
    "h // (heads / kv heads)",
    "the second chunk attends to the first chunk's K/V read back from the cache: write this step's K/V into their "
    "slots before attention reads, and give the second chunk positions 4-9, not 0-5",
    "a decode step is one query row at the sequence's last position, over every cached key up to it",
    "a mixed step: each row reads its own sequence's block table and length; the rows of a sequence are "
    "cu_seqlens_q[i]..cu_seqlens_q[i + 1]; a decode row and a prompt row must not see each other",
    "blocks of 2: a position's slot is block_table[pos // block_size] * block_size + pos % block_size, for any "
    "block size; a sequence that arrives late starts from position 0",
]


def _after_the_first(decoder_layer: LayerFn, i: int) -> Callable[[Any], str]:
    """The rung's own hint, unless the one-step case fails too: then that is where to start."""

    def hint(_got: Any) -> str:
        if _spec_case(decoder_layer, next(iter(SMALL)), 0) != "matches":
            return "the one-step case fails too: start there (its hint says what each stage must do)"
        return PLAN_HINTS[i]

    return hint


def check_layer_spec(decoder_layer: LayerFn) -> list[CheckOutcome]:
    """Small layers with random weights, each plan, against transformers' ``LlamaDecoderLayer`` on whole sequences."""
    checks = []
    for i, (label, *_rest) in enumerate(PLANS):
        for name in SMALL if i in (3, 4) else list(SMALL)[:1]:
            hint = PLAN_HINTS[0] if i == 0 else _after_the_first(decoder_layer, i)
            checks.append(Check(f"{name}: {label}", lambda n=name, i=i: _spec_case(decoder_layer, n, i), "matches",
                                hint=hint))  # fmt: skip
    return report("layer_spec", checks)


# ---- layer_smollm2: the real model, layer by layer and chained ---------------------------------------------------
_HF: dict[str, Any] = {}
PROMPTS = [
    "The capital of France is Paris, and the capital of Italy is",
    "Paged attention stores the KV cache in fixed-size blocks, so that",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
]


def _smollm2() -> tuple[Any, Any, list[list[int]]]:
    if "model" not in _HF:
        from ...model_loader import load_hf_model, load_tokenizer

        tok = load_tokenizer()
        _HF["model"] = load_hf_model()
        _HF["ids"] = [tok(p)["input_ids"] for p in PROMPTS]
    return _HF["model"], _HF["model"].config, _HF["ids"]


def smollm2_config(config: Any) -> LayerConfig:
    return LayerConfig(
        hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads, head_dim=config.hidden_size // config.num_attention_heads,
        intermediate_size=config.intermediate_size, rms_norm_eps=config.rms_norm_eps,
        rope_theta=_rope_theta(config),
    )  # fmt: skip


def _hf_trace(model: Any, ids: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Each layer's input and output rows for one sequence, and its logits at every position."""
    ins: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []

    def keep(_module: Any, args: tuple, out: Any) -> None:  # returns None: the layer's output stays as it is
        ins.append(args[0][0].detach())
        outs.append((out[0] if isinstance(out, tuple) else out)[0].detach())

    hooks = [layer.register_forward_hook(keep) for layer in model.model.layers]
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
    finally:
        for h in hooks:
            h.remove()
    return ins, outs, logits


SMOLLM2_PLAN_BLOCK = 4


def _smollm2_plan(lens: list[int]) -> Plan:
    """A chunked, mixed schedule over the prompts: the first in two chunks, the others joining as it runs."""
    a, b, c = lens
    h = a // 2
    return [[(0, 0, h)], [(0, h, a - h), (1, 0, b - 1)], [(1, b - 1, 1), (2, 0, c)]]


def _smollm2_run(fn: LayerFn) -> list[str]:
    model, config, ids = _smollm2()
    cfg = smollm2_config(config)
    traces = [_hf_trace(model, s) for s in ids]
    lens = [len(s) for s in ids]
    plan = _smollm2_plan(lens)
    layers = model.model.layers
    # Layer by layer: each layer given transformers' input to it; the first layer whose output differs.
    first_bad = "every layer matches"
    for li, layer in enumerate(layers):
        run = PagedRun(cfg, lens, SMOLLM2_PLAN_BLOCK, seed=li, dtype=torch.float32)
        got = run.run(fn, [t[0][li] for t in traces], plan, weights_of(layer))
        verdict = _compare(got, [t[1][li] for t in traces])
        if verdict != "matches":
            first_bad = f"layer {li} differs: {verdict}"
            break
    # Chained: the learner's output feeds the next layer, as in a model; then the final norm and the LM head.
    xs = [t[0][0] for t in traces]
    for li, layer in enumerate(layers):
        run = PagedRun(cfg, lens, SMOLLM2_PLAN_BLOCK, seed=li, dtype=torch.float32)
        xs = run.run(fn, xs, plan, weights_of(layer))
    with torch.no_grad():
        logits = [model.lm_head(model.model.norm(x)) for x in xs]
    mine = [int(lg[-1].argmax()) for lg in logits]
    theirs = [int(t[2][-1].argmax()) for t in traces]
    tokens = "the same next tokens" if mine == theirs else f"next tokens {mine}, transformers' {theirs}"
    return [first_bad, tokens]


def _spec_passes(decoder_layer: LayerFn) -> bool:
    """Whether every layer_spec case matches (run quietly: for a hint's condition)."""
    return all(
        _spec_case(decoder_layer, name, i) == "matches"
        for i in range(len(PLANS))
        for name in (SMALL if i in (3, 4) else list(SMALL)[:1])
    )


def check_layer_smollm2(decoder_layer: LayerFn) -> list[CheckOutcome]:
    """SmolLM2's 30 layers, each replaced by the learner's, over a chunked mixed schedule of three prompts."""
    cache: dict[str, list[str]] = {}

    def result(i: int) -> str:
        if "r" not in cache:
            cache["r"] = _smollm2_run(decoder_layer)
        return cache["r"][i]

    return report(
        "layer_smollm2",
        [
            Check(
                "SmolLM2, 3 prompts in 3 mixed steps (block size 4): each of the 30 layers given transformers' input "
                "to it; the first layer whose output differs",
                lambda: result(0),
                "every layer matches",
                hint=lambda got: (
                    "a first layer that differs while layer_spec passes: look at what SmolLM2 has that the small "
                    "layers lack (9 query heads over 3 KV heads, rope_theta 100000, 576 wide, long rows of 1536)"
                    if _spec_passes(decoder_layer)
                    else "layer_spec fails too: fix the small layers first (their checks name the case)"
                ),
            ),
            Check(
                "the 30 layers chained (each given your previous output), then transformers' final norm and LM head: "
                "the next token of each prompt",
                lambda: result(1),
                "the same next tokens",
                hint=lambda got: (
                    "layer by layer passes but chained does not: an error small in one layer grows over 30"
                    if result(0) == "every layer matches"
                    else "a layer differs given transformers' input (the check above): fix that one first"
                ),
            ),
        ],
    )
