"""A compact Llama forward pass that reads and writes a paged KV cache.

The engine flattens every scheduled token of every request into one row per
token (no padding, no batch dimension), so one step can mix a 300-token prefill
chunk with fifty single-token decodes::

    input_ids  [ p0 p1 p2 … p299 | d0 | d1 | … | d49 ]     num_tokens rows
    positions  [  0  1  2 … 299  | 17 | 42 | … | 8  ]     absolute position in its own sequence

Everything except attention is per token, so it runs on those rows as they are.
Attention is the one place where tokens of a sequence meet their past: each
layer scatters the new K/V into its cache (``slot_mapping``), then reads the
whole context back through the block table (``AttentionMetadata``).

The module names mirror transformers' ``LlamaForCausalLM``, so its state dict
(from the safetensors cache of ``minipaged.model_loader``) loads as it is.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from torch import nn

from ..kv_cache_coordinator import kv_cache_groups, layer_groups
from .attention import AttentionMetadata, PagedAttention, TorchAttentionMetadata
from .parallel import VocabParallelEmbedding, gather_logits, row_parallel, shard_state_dict, tp_size

if TYPE_CHECKING:
    from ..distributed import TPGroup
    from .step_program import StepProgram

log = logging.getLogger("minipaged")


def sliding_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window (None: it sees its whole context), as transformers reads the config: Qwen2 and
    Gemma-style ``layer_types`` ("sliding_attention" layers see the last ``sliding_window`` positions), or a
    Mistral-style ``sliding_window`` for every layer::

        Qwen2, use_sliding_window, max_window_layers 2, 4 layers   [None, None, 4096, 4096]
        Mistral-7B-v0.1 (sliding_window 4096)                      [4096, 4096, ..., 4096]
    """
    n, window = config.num_hidden_layers, getattr(config, "sliding_window", None)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        if getattr(config, "layer_types", None) is not None or getattr(config, "model_type", "llama") == "mistral":
            raise ValueError(f"config.json: sliding_window must be a positive number of positions, got {window!r}")
    types = getattr(config, "layer_types", None)
    if types is not None:
        return [window if t == "sliding_attention" else None for t in types[:n]]
    if getattr(config, "model_type", "llama") == "mistral" and window is not None:
        return [window] * n
    return [None] * n


def _rope_theta(config: Any) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") not in ("default", None):
        raise ValueError(f"rope_type {params['rope_type']!r} is not supported (only the default RoPE)")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("config has no rope_theta")
    return float(theta)


class Linear(nn.Linear):
    """``nn.Linear`` that, on a CPU at inference time, multiplies with oneDNN on a pre-packed weight.

    PyTorch's default fp32 CPU GEMM here is MKL, which on some AMD CPUs runs far below
    the machine's peak; oneDNN (PyTorch's other CPU backend, the one its compiler
    uses) on a weight re-laid-out once for its kernels is as fast or faster at every
    batch size we serve, from 1 to 2048 rows (2–2.5× on a Zen 5, about equal on a Zen 4;
    ``benchmarks/bench_engine.py``; vLLM's CPU backend does the same). The packed copy is
    made on first use and re-made if the weight changes; with gradients on, or off the
    CPU, this is plain ``nn.Linear`` (and everywhere with ``MINIPAGED_ONEDNN=0``).

    oneDNN also applies an elementwise step to the product while it is still in cache
    ("post-ops"): ``silu(x)`` is ``silu(x W^T)``, ``mul(x, y)`` is ``(x W^T) * y`` and
    ``add(x, y)`` is ``(x W^T) + y`` (a new tensor; ``y`` is left as it was). Each saves a
    pass over a [tokens, features] tensor: on a 2048-token prefill the MLP took 8 % less
    time here. The plain path computes the same with separate PyTorch ops.

    The packed path rests on private ``torch.ops.mkldnn`` operators, so it is only ever an
    optimisation: :func:`onednn_ops` checks them once against the plain path, and a packed
    call that raises falls back to the plain path and turns the packed path off for that
    weight dtype (see :func:`_packed_failed`).
    """

    _packed: tuple[int, int, torch.Tensor] | None = None  # (weight version, data pointer, packed weight)

    def _packed_weight(self, x: torch.Tensor) -> tuple[OneDNNOps, torch.Tensor] | None:
        """The oneDNN operators and this weight packed for them, or None where the plain path must run.

        ``x`` must match the weight's dtype and device: a mismatch is the caller's error, which the
        plain path reports in PyTorch's words (and which must not turn the packed path off)."""
        w = self.weight
        if (
            w.device.type != "cpu"
            or w.dtype not in (torch.float32, torch.bfloat16)
            or x.dtype != w.dtype
            or x.device != w.device
            or torch.is_grad_enabled()
            or w.dtype in _ONEDNN_FAILED_DTYPES
        ):
            return None
        ops = onednn_ops()
        if ops is None:
            return None
        key = (w._version, w.data_ptr())
        if self._packed is None or self._packed[:2] != key:
            try:
                packed = ops.reorder(w.detach(), 32)
            except Exception as e:  # the op refused this weight: compute it the plain way, from now on
                _packed_failed(w.dtype, "_reorder_linear_weight", e)
                return None
            self._packed = (*key, packed)
        return ops, self._packed[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        found = self._packed_weight(x)
        if found is not None:
            ops, packed = found
            try:
                return ops.pointwise(pad_rows(x), packed, self.bias, "none", [], "")[: len(x)]
            except Exception as e:
                _packed_failed(x.dtype, "_linear_pointwise", e)
        return nn.functional.linear(x, self.weight, self.bias)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        found = self._packed_weight(x)
        if found is not None:
            ops, packed = found
            try:
                return ops.pointwise(pad_rows(x), packed, self.bias, "swish", [], "")[: len(x)]
            except Exception as e:
                _packed_failed(x.dtype, "_linear_pointwise (swish)", e)
        return nn.functional.silu(self(x))

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return self._binary(x, other, "mul")

    def add(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return self._binary(x, other, "add")

    def _binary(self, x: torch.Tensor, other: torch.Tensor, op: str) -> torch.Tensor:
        found = self._packed_weight(x)
        if found is not None and other.dtype == x.dtype and other.shape == (*x.shape[:-1], self.out_features):
            ops, packed = found
            try:
                return ops.binary(pad_rows(x), pad_rows(other.contiguous()), packed, self.bias, op)[: len(x)]
            except Exception as e:
                _packed_failed(x.dtype, f"_linear_pointwise.binary ({op})", e)
        # Also where the fused op cannot take `other` (shape, dtype): the GEMM, then the op. Linear.forward, not
        # self(x): a subclass's forward may do more than the GEMM.
        y = Linear.forward(self, x)
        return y * other if op == "mul" else y + other


def packed_rows(m: int) -> int:
    """The row count a packed GEMM runs with for ``m`` rows: ``m`` up to 16, else ``m`` rounded up to three
    significant bits (17 → 18, 100 → 104, 1000 → 1024: at most 1/8 more rows, 8 sizes per octave).

    Why: oneDNN builds a kernel for each row count it meets and keeps it, in its primitive cache and in
    PyTorch's ideep cache, about half a megabyte each; an engine meets hundreds of different row counts
    (every prefill chunk, every batch size), and a process serving short random calls grew by 400 MB over
    1,300 of them. Rounding the rows bounds the kernels to about 70 per weight shape and post-op, all built
    in the first calls; the padded rows are zeros, and their results are cut off.
    """
    if m <= 16:
        return m
    step = 1 << (m.bit_length() - 4)
    return -(-m // step) * step


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` with zero rows appended up to ``packed_rows`` (a 2-D tensor; anything else as it is)."""
    if x.dim() != 2 or (m := packed_rows(len(x))) == len(x):
        return x
    return nn.functional.pad(x, (0, 0, 0, m - len(x)))


@dataclass(frozen=True)
class OneDNNOps:
    """The three private oneDNN operators the packed path calls, as found and checked by :func:`probe_onednn`."""

    reorder: Callable[..., torch.Tensor]  # _reorder_linear_weight(weight, batch_size_hint) -> packed weight
    pointwise: Callable[..., torch.Tensor]  # _linear_pointwise(x, packed, bias, post_op, scalars, algorithm)
    binary: Callable[..., torch.Tensor]  # _linear_pointwise.binary(x, other, packed, bias, "mul" | "add")


_OPTED_OUT = "MINIPAGED_ONEDNN=0"
_NO_ONEDNN = "this PyTorch build has no oneDNN (torch.backends.mkldnn.is_available() is False)"


def _mkldnn_namespace() -> Any:
    """``torch.ops.mkldnn``, looked up here only, so a test can hand the probe a namespace without the ops."""
    return torch.ops.mkldnn


def probe_onednn() -> tuple[OneDNNOps | None, str]:
    """Find the packed path's operators and check them on a tiny fp32 GEMM: (ops, "") or (None, why not).

    The operators are private (``torch.ops.mkldnn._*``): a PyTorch release may drop, rename or change
    them. All three are looked up, then each post-op is run once against ``nn.functional.linear`` (plus
    ``silu`` / ``*`` / ``+``); anything missing, raising or disagreeing leaves the packed path off, and
    the plain path, which computes the same, runs instead. Uncached: :func:`onednn_ops` caches it.
    """
    if os.environ.get("MINIPAGED_ONEDNN", "1") == "0":  # the engine benchmark's ablation row
        return None, _OPTED_OUT
    if not torch.backends.mkldnn.is_available():
        return None, _NO_ONEDNN
    namespace = _mkldnn_namespace()
    try:  # torch.ops raises AttributeError for an unknown op; any error means "not usable"
        pointwise = namespace._linear_pointwise
        ops = OneDNNOps(namespace._reorder_linear_weight, pointwise, pointwise.binary)
    except Exception as e:
        return None, f"an operator is missing ({type(e).__name__}: {e})"
    # A generator of its own: the probe must not move the global RNG that seeded tests and sampling rely on.
    # Device and dtype spelled out: a default set elsewhere (set_default_dtype, a device context) must not leak in.
    g = torch.Generator().manual_seed(0)
    x, other, w, b = (
        torch.randn(*shape, generator=g, dtype=torch.float32, device="cpu")
        for shape in ((3, 16), (3, 8), (8, 16), (8,))
    )
    with torch.no_grad():
        y = nn.functional.linear(x, w, b)
        expected = {"none": y, "swish": nn.functional.silu(y), "mul": y * other, "add": y + other}
        try:
            packed = ops.reorder(w, 32)
            got = {
                "none": ops.pointwise(x, packed, b, "none", [], ""),
                "swish": ops.pointwise(x, packed, b, "swish", [], ""),
                "mul": ops.binary(x, other, packed, b, "mul"),
                "add": ops.binary(x, other, packed, b, "add"),
            }
        except Exception as e:
            return None, f"an operator raised on a tiny fp32 GEMM ({type(e).__name__}: {e})"
    for name, want in expected.items():
        out = got[name]
        if not isinstance(out, torch.Tensor) or out.shape != want.shape or out.dtype != want.dtype:
            return None, f"post-op {name!r} returned {type(out).__name__} {getattr(out, 'shape', '')}, not {want.shape}"
        if not torch.allclose(out, want, atol=1e-4, rtol=1e-4):
            err = float((out - want).abs().max())
            return None, f"post-op {name!r} disagrees with the plain path (max abs difference {err:.3g})"
    return ops, ""


# The probe's result, computed on first use: _ONEDNN is None until then (not yet known, not "off").
_ONEDNN: bool | None = None
_ONEDNN_OPS: OneDNNOps | None = None
# Weight dtypes on which a packed call raised at run time: those run the plain path from then on.
_ONEDNN_FAILED_DTYPES: set[torch.dtype] = set()


def onednn_ops() -> OneDNNOps | None:
    """The checked oneDNN operators, or None when the packed path is off; probes once, logs why once."""
    global _ONEDNN, _ONEDNN_OPS
    if _ONEDNN is None:
        _ONEDNN_OPS, why = probe_onednn()
        _ONEDNN = _ONEDNN_OPS is not None
        if why:  # asked for, or a build without oneDNN: a note; the ops gone or wrong: a warning
            level = logging.INFO if why in (_OPTED_OUT, _NO_ONEDNN) else logging.WARNING
            log.log(level, "minipaged: oneDNN packed linear off (%s); Linear runs PyTorch's default GEMM", why)
    return _ONEDNN_OPS


def _packed_failed(dtype: torch.dtype, op: str, exc: BaseException) -> None:
    """A packed call raised after the probe passed (a dtype or shape the op does not take): off for ``dtype``.

    Off for that dtype only, not everywhere: the probe proved fp32, and a CPU may lack, say, the bf16
    kernels. One log line, then every Linear of that dtype takes the plain path."""
    if dtype not in _ONEDNN_FAILED_DTYPES:
        _ONEDNN_FAILED_DTYPES.add(dtype)
        log.warning(
            "minipaged: oneDNN packed linear off for %s (%s raised %s: %s); Linear runs PyTorch's default GEMM",
            str(dtype).replace("torch.", ""),
            op,
            type(exc).__name__,
            exc,
        )


class MergedLinear:
    """Several ``Linear`` layers that read the same input, run as one GEMM (vLLM's ``QKVParallelLinear`` and
    ``MergedColumnParallelLinear``): their weights stacked along the output, so a layer's q, k and v come from one
    call. The model keeps the separate layers (their names are the checkpoint's; tensor parallelism shards them);
    the stacked copy is made on first use and again whenever one of them changes. A plain object, not a module:
    it adds nothing to the state dict::

        q_proj [576, 576] ┐                 x [n, 576] @ W^T = [ q | k | v ]   [n, 960]
        k_proj [192, 576] ├─ W [960, 576]
        v_proj [192, 576] ┘
    """

    def __init__(self, *parts: Linear) -> None:
        self.parts = parts
        self._merged: tuple[tuple[int, ...], Linear] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.merged(x)

    @property
    def merged(self) -> Linear:
        """The one ``Linear`` with the stacked weights, up to date with the parts'."""
        params = [t for p in self.parts for t in (p.weight, p.bias) if t is not None]
        key = tuple(v for t in params for v in (t._version, t.data_ptr()))
        if self._merged is None or self._merged[0] != key:
            # Outside inference mode: the copy must be a normal tensor, whose version Linear's packing reads.
            with torch.inference_mode(False), torch.no_grad():
                w = torch.cat([p.weight.detach() for p in self.parts])
                merged = Linear(w.shape[1], w.shape[0], bias=self.parts[0].bias is not None, device="meta")
                merged.weight = nn.Parameter(w, requires_grad=False)
                if self.parts[0].bias is not None:
                    merged.bias = nn.Parameter(torch.cat([p.bias.detach() for p in self.parts]), requires_grad=False)
            self._merged = (key, merged)
        return self._merged[1]


class RMSNorm(nn.Module):
    """x / rms(x) · weight, computed in fp32 like the reference implementation. On a CPU at inference time one
    compiled pass does it (``cpu_kernel.rms_norm``: the same roundings as the eight PyTorch ops below)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..kernels import cpu_kernel

        if x.dim() == 2 and x.stride(1) == 1 and cpu_kernel.fits_layer_ops(x, self.weight):
            return cpu_kernel.rms_norm(x, self.weight.contiguous(), self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding: rotate pairs of dimensions by an angle that grows with position.

    Position enters attention only through these rotations, which is why K can
    be cached *after* rotation: a cached key never needs to know where later
    queries sit.
    """

    inv_freq: torch.Tensor  # a buffer: typed here, or mypy sees register_buffer's Tensor | Module

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """x: [num_tokens, heads, head_dim]; cos/sin: [num_tokens, head_dim]."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]


class LlamaAttention(nn.Module):
    """Self-attention on the paged cache. Under tensor parallelism (``tp``) it holds this rank's heads only:
    q/k/v are column-parallel, o_proj row-parallel, one all-reduce (``model.parallel``)."""

    def __init__(
        self, config: Any, attention: PagedAttention, tp: TPGroup | None = None, sliding_window: int | None = None
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads = config.num_attention_heads // tp_size(tp)
        self.num_kv_heads = config.num_key_value_heads // tp_size(tp)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.sliding_window = sliding_window  # None: the whole context; else only that many positions back
        bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = bias or getattr(config, "model_type", "llama") == "qwen2"  # Qwen2: q, k and v have biases, o not
        h = config.hidden_size
        self.q_proj = Linear(h, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = Linear(h, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = Linear(h, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.scale = self.head_dim**-0.5
        self.attention = attention
        self.qkv_proj = MergedLinear(self.q_proj, self.k_proj, self.v_proj)  # the compiled CPU path's one GEMM

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention's output, plus ``residual`` when given (added by o_proj's GEMM: ``Linear.add``).

        Where the compiled CPU kernels run the step (``meta.fused``), q, k and v come from one GEMM and RoPE, the
        K/V write and attention from two compiled calls (``PagedAttention.rope_write_attend``); elsewhere (a GPU,
        a learner's kernel plugged in) the same computation runs as PyTorch ops and the backend's kernels."""
        n = x.shape[0]
        if isinstance(meta, TorchAttentionMetadata) and meta.fused:
            out = self.attention.rope_write_attend(
                self.qkv_proj(x), cos, sin, kv_cache[0], kv_cache[1], meta, self.num_heads, self.scale
            )
            return row_parallel(self.o_proj, out.reshape(n, -1), residual, self.tp)
        q = RotaryEmbedding.apply(self.q_proj(x).reshape(n, self.num_heads, self.head_dim), cos, sin)
        k = RotaryEmbedding.apply(self.k_proj(x).reshape(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).reshape(n, self.num_kv_heads, self.head_dim)
        out = self.attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale).reshape(n, -1)
        return row_parallel(self.o_proj, out, residual, self.tp)


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) · up(x)). Under tensor parallelism, this rank's slice of the hidden units:
    gate/up column-parallel, down row-parallel, one all-reduce."""

    def __init__(self, config: Any, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        bias = bool(getattr(config, "mlp_bias", False))
        units = config.intermediate_size // tp_size(tp)
        self.gate_proj = Linear(config.hidden_size, units, bias=bias)
        self.up_proj = Linear(config.hidden_size, units, bias=bias)
        self.down_proj = Linear(units, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP's output, plus ``residual`` when given. silu, the product and the addition ride on the
        GEMMs (``Linear.silu/mul/add``): no separate pass over the [tokens, 1536] activations."""
        h = self.up_proj.mul(x, self.gate_proj.silu(x))
        return row_parallel(self.down_proj, h, residual, self.tp)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: Any, attention: PagedAttention, tp: TPGroup | None = None, sliding_window: int | None = None
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, attention, tp, sliding_window)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


class LlamaModel(nn.Module):
    def __init__(self, config: Any, attention: PagedAttention, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.attention = attention
        self.num_heads = config.num_attention_heads // tp_size(tp)  # this rank's
        self.windows = sliding_windows(config)
        # Which KV cache group's block table each layer reads (one group unless windows differ).
        self.layer_groups = layer_groups(kv_cache_groups(self.windows), len(self.windows))
        # Each group once: (its first layer, whose cache the step's metadata is checked against; its window).
        self.group_heads = {g: (i, w) for i, (g, w) in reversed(list(enumerate(zip(self.layer_groups, self.windows))))}
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, attention, tp, w) for w in self.windows)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary_emb = RotaryEmbedding(head_dim, _rope_theta(config))
        self._program: StepProgram | Literal[False] | None = None  # None: not built yet; False: cannot run

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata | Sequence[AttentionMetadata],
    ) -> torch.Tensor:
        """Embed, run every decoder layer on its own layer of the paged cache, normalise: hidden states.

        ``meta`` is the step's attention metadata, or one per KV cache group for a model with several (sliding-
        window layers beside full ones: each group has its own block tables). One metadata for such a model
        serves every group alike (a throw-away cache whose groups share block ids, as in a profiling run).
        It is checked and planned once, here, for every layer (once per group, for a model whose layers differ:
        each layer then reads the plan of its own group and window)."""
        x = self.embed_tokens(input_ids)
        num_groups = len(self.group_heads)
        given = [meta] if isinstance(meta, AttentionMetadata) else list(meta)
        if len(given) not in (1, num_groups):
            raise ValueError(f"{len(given)} attention metadata for a model of {num_groups} KV cache groups")
        per_group = given * num_groups if len(given) == 1 else given
        metas = {
            g: self.attention.build_metadata(per_group[g], *kv_caches[i], self.num_heads, x.dtype, w)
            for g, (i, w) in self.group_heads.items()
        }
        meta = metas[self.layer_groups[0]]
        cos, sin = self.rotary_emb(positions, x.dtype)
        uniform = len(metas) == 1 and self.windows[0] is None  # the step program knows whole-context layers only
        program = self.step_program() if uniform and isinstance(meta, TorchAttentionMetadata) and meta.fused else None
        if program is not None and isinstance(meta, TorchAttentionMetadata):
            try:
                return self.norm(program.run(x, cos, sin, kv_caches, meta))
            except RuntimeError as e:  # a oneDNN op refused something the probe did not try: the modules' path
                log.warning("minipaged: the CPU step program failed (%s); running the model's modules instead", e)
                self._program = False  # rerunning the step is safe: it writes the same K/V to the same slots
        for layer, kv_cache, g in zip(self.layers, kv_caches, self.layer_groups, strict=True):
            x = layer(x, cos, sin, kv_cache, metas[g])
        return self.norm(x)

    def step_program(self) -> StepProgram | None:
        """The layers as a program of compiled calls (``step_program``), built on first use and again when a
        weight changes; None where it cannot run (the modules then run the step)."""
        from .step_program import StepProgram

        if self._program is False or os.environ.get("MINIPAGED_STEP_PROGRAM", "1") == "0":  # 0: the ablation
            return None
        if self._program is None or not self._program.is_current():
            # a piece missing now is missing for good
            self._program = StepProgram.build(self, onednn_ops(), pad_rows) or False
        return self._program if self._program is not False else None


class LlamaForCausalLM(nn.Module):
    """Llama on a paged KV cache: ``forward`` returns hidden states, ``compute_logits`` the scores.

    Only the rows that sample a token (the last token of each sequence in this
    step) go through the output head: a 300-token prefill chunk needs one row of
    logits, not 300.
    """

    def __init__(self, config: Any, backend: str = "torch", tp: TPGroup | None = None) -> None:
        super().__init__()
        if getattr(config, "model_type", "llama") not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"model_type {config.model_type!r} is not a Llama-architecture model")
        if backend != "torch" and any(w is not None for w in sliding_windows(config)):
            raise ValueError(
                f"this model has sliding-window layers, which run on the PyTorch backend's kernels only, not on "
                f"{backend!r}: use attention_backend='torch'"
            )
        if config.num_attention_heads % config.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        self.config = config
        self.tp = tp
        self.attention = PagedAttention(backend)
        self.model = LlamaModel(config, self.attention, tp)
        # The LM head: this rank's slice of the vocabulary (all of it without tensor parallelism)
        self.lm_head = Linear(config.hidden_size, self.model.embed_tokens.num_embeddings, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def num_kv_heads(self) -> int:
        """The KV heads this rank holds (all of them without tensor parallelism): its cache's width."""
        return self.config.num_key_value_heads // tp_size(self.tp)

    @property
    def head_dim(self) -> int:
        return cast(LlamaDecoderLayer, self.model.layers[0]).self_attn.head_dim

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata | Sequence[AttentionMetadata],
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits for ``hidden``'s rows, in fp32. Under tensor parallelism every rank computes its slice of the
        vocabulary and rank 0 gathers them: rank 0 gets the logits, the other ranks None."""
        return gather_logits(self.lm_head(hidden).float(), self.config.vocab_size, self.tp)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        backend: str = "torch",
        tp: TPGroup | None = None,
        config: Any = None,
    ) -> LlamaForCausalLM:
        """Build from a transformers Llama folder (config.json + safetensors), e.g. the SmolLM2 cache; with
        ``tp``, this rank's shard of it (every rank reads the whole checkpoint and keeps its slice). ``config``:
        the folder's config as another process read it (``read_config``): a tensor-parallel worker gets rank
        0's, and so never imports transformers (3 of the 4.5 seconds a worker needs to start)."""
        from safetensors.torch import load_file

        from ..model_loader import repair_hint

        folder = Path(path)
        if not (folder / "config.json").is_file():
            raise ValueError(f"{folder} is not a model folder: no config.json")
        config = config if config is not None else read_config(folder)
        with torch.device("meta"):
            model = cls(config, backend=backend, tp=tp)
        state: dict[str, torch.Tensor] = {}
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{folder} has no .safetensors weights")
        for f in files:
            try:
                state.update(load_file(str(f)))
            except Exception as e:  # safetensors' own error type: a truncated, empty or foreign file
                raise ValueError(
                    f"{f} is not a readable safetensors file ({_first_line(e)}){repair_hint(folder)}"
                ) from None
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        state = shard_state_dict(state, config, tp)
        try:
            model.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as e:  # missing or unexpected tensors, wrong shapes: not this config's weights
            raise ValueError(f"the weights in {folder} do not fit its config.json: {_first_line(e, 2)}") from None
        if getattr(config, "tie_word_embeddings", False):
            model.lm_head.weight = model.model.embed_tokens.weight
        model.model.rotary_emb = RotaryEmbedding(model.head_dim, _rope_theta(config))
        return model.to(device=device, dtype=dtype).eval()


def read_config(folder: str | os.PathLike) -> Any:
    """A model folder's config.json through transformers' ``AutoConfig`` (its defaults filled in), or a clear
    error."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError, TypeError) as e:  # invalid JSON, a missing or wrong model_type
        raise ValueError(f"{Path(folder) / 'config.json'} cannot be read as a model config: {_first_line(e)}") from None


def config_from_dict(values: dict[str, Any]) -> Any:
    """A config read elsewhere (``read_config(...).to_dict()``), as an object with the same attributes."""
    return SimpleNamespace(name_or_path=values.get("_name_or_path", ""), **values)


def _first_line(exc: BaseException, lines: int = 1) -> str:
    """The start of an error's message, on one line (a library's message can run to dozens)."""
    text = " ".join(ln.strip() for ln in str(exc).strip().splitlines()[:lines])
    return (text or type(exc).__name__)[:300]
