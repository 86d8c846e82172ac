"""The layers a Llama is built of, shared by ``llama.py``, ``parallel.py`` and the compiled CPU step
(``step_program.py``): ``Linear`` (with oneDNN's pre-packed GEMM on a CPU, and the probe that decides whether it
can run), ``MergedLinear`` (q, k, v as one GEMM), ``RMSNorm`` and ``RotaryEmbedding``.

Why a module of their own: the model, its tensor-parallel pieces and the step program all use them, and each of
those imports this one, never each other (``tests/test_imports.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..kernels import cpu_kernel

log = logging.getLogger("minipaged")

# Products of up to this many rows run on the compiled decode products where the build has them
# (``decode_products_on``); beyond it, on oneDNN. Written for decode steps, where oneDNN loses most, they also beat
# it on a Zen 4 at every row count measured up to 2,048, the engine's default step (``max_num_batched_tokens``),
# with AVX-512 and with AVX2 (``benchmarks/bench_gemm_rows.py``); past that nothing was measured.
PRODUCT_ROWS = 2048


def decode_products_on(dtype: torch.dtype = torch.float32) -> bool:
    """True where products in ``dtype`` of up to ``PRODUCT_ROWS`` rows run on the compiled decode products
    (``kernels/cpu_paged_attention.cpp``: AVX-512 or AVX2 builds; bf16 not where the CPU has AMX): the library has
    them and ``MINIPAGED_DECODE_PRODUCTS`` is not ``0`` (``0``: oneDNN for every size, the path every other CPU
    runs)."""
    on = os.environ.get("MINIPAGED_DECODE_PRODUCTS", "1") != "0"
    return on and cpu_kernel.decode_products(cpu_kernel.library(), dtype)


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

    At up to ``PRODUCT_ROWS`` rows (a decode step, a prefill chunk) an fp32 or bf16 weight without bias multiplies
    on the compiled decode products instead, where the build has them for its dtype (``decode_products_on``): its
    own panels (``decode_panels``), the residual of ``add`` in the product's tile, and ``glu`` for silu(gate) * up
    in one pass. oneDNN's kernels lose rate at a few dozen rows, and each of its calls through PyTorch costs more
    than the product of a small one.

    The packed path rests on private ``torch.ops.mkldnn`` operators, so it is only ever an
    optimisation: :func:`onednn_ops` checks them once against the plain path, and a packed
    call that raises falls back to the plain path and turns the packed path off for that
    weight dtype (see :func:`_packed_failed`).
    """

    _packed: tuple[int, int, torch.Tensor] | None = None  # (weight version, data pointer, packed weight)
    _panels: tuple[int, int, torch.Tensor] | None = None  # the same for the decode products' panels

    def decode_panels(self, x: torch.Tensor) -> torch.Tensor | None:
        """This weight packed for the decode products, where ``x``'s product runs on them: an fp32 or bf16
        weight without bias on the CPU, whole panels of output columns (and an even number of input features in
        bf16, which multiplies them in pairs), ``x`` 2-D of the weight's dtype with 1 to ``PRODUCT_ROWS`` rows, no
        gradients, ``decode_products_on(dtype)``. Else None: oneDNN or PyTorch multiplies. Packed on first use,
        again when the weight changes."""
        w = self.weight
        if not (
            x.dim() == 2
            and 1 <= x.shape[0] <= PRODUCT_ROWS
            and x.dtype == w.dtype
            and x.device.type == w.device.type == "cpu"
            and self.bias is None
            and self.out_features % cpu_kernel.PANEL == 0
            and (w.dtype != torch.bfloat16 or self.in_features % 2 == 0)
            and not torch.is_grad_enabled()
            and decode_products_on(w.dtype)
        ):
            return None
        key = (w._version, w.data_ptr())
        if self._panels is None or self._panels[:2] != key:
            self._panels = (*key, cpu_kernel.pack_panels(w))
        return self._panels[2]

    @staticmethod
    def glu(gate: Linear, up: Linear, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate(x)) * up(x)`` in one pass of the decode products, or None where they do not run (the
        caller then uses ``up.mul(x, gate.silu(x))``)."""
        g, u = gate.decode_panels(x), up.decode_panels(x)
        if g is None or u is None or g.shape != u.shape:
            return None
        return cpu_kernel.decode_glu(x.contiguous(), g, u, x.new_empty(x.shape[0], g.shape[0]))

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
        panels = self.decode_panels(x)
        if panels is not None:
            return cpu_kernel.decode_product(x.contiguous(), panels, x.new_empty(x.shape[0], self.out_features))
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
        residual_fits = other.shape == (x.shape[0], self.out_features) and other.dtype == x.dtype
        panels = self.decode_panels(x) if op == "add" and residual_fits and other.device.type == "cpu" else None
        if panels is not None:
            out = x.new_empty(x.shape[0], self.out_features)
            return cpu_kernel.decode_product(x.contiguous(), panels, out, residual=other.contiguous())
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
