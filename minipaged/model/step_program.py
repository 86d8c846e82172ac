"""A step on the CPU as a fixed program: per layer, nine compiled calls and no Python decisions between them.

The model's modules decide at every call which path to take: is oneDNN there, is this weight packed yet, does
the input need padding, is a learner's kernel plugged in, is there tensor parallelism. On SmolLM2 that is about
twenty Python-level calls per layer, thirty layers a step, and at a small batch their overhead (14 ms of a 35 ms
decode step, measured on a 2-core Xeon) weighs as much as the matrix products that need the time. A CUDA graph
removes it on a GPU by recording the kernels once and replaying them; this is the CPU's version of the same idea,
made by hand: every decision is taken once, when the program is built, and a step only calls the kernels::

    per layer, rows padded once to their bucket (``packed_rows``: the oneDNN kernels' row count)
      h   = rms_norm(x)                               compiled (cpu_kernel)
      qkv = h @ [Wq | Wk | Wv]^T                      oneDNN, one GEMM (MergedLinear's packed weight)
      q   = rope_and_cache(qkv) -> K/V to their slots compiled
      a   = paged_attention(q)                        compiled
      x   = a @ Wo^T + x                              oneDNN, the residual added in the GEMM
      h   = rms_norm(x)                               compiled
      g   = silu(h @ Wgate^T)                         oneDNN, silu in the GEMM
      x   = (h @ Wup^T) * g @ Wdown^T + x             oneDNN, two GEMMs with their multiply and add

A step of at most ``PRODUCT_ROWS`` rows (every step at the engine's defaults) runs its products on the compiled
decode products instead, where the build has them for the dtype (``layers.decode_products_on``), with no padding:
at a few dozen rows oneDNN's kernels lose a fifth of their rate and each call through PyTorch costs a dispatch and
a fork and join, and at 2,048 rows the products are still a few per cent faster (``benchmarks/bench_gemm_rows.py``)::

      qkv = h @ [Wq | Wk | Wv]^T                      decode product (the modules' own panels: Linear.decode_panels)
      x   = a @ Wo^T + x                              decode product, the residual added in its tile
      g   = silu(h @ Wgate^T) * (h @ Wup^T)           one pass over both weights' panels
      x   = g @ Wdown^T + x                           decode product, the residual added in its tile

Same kernels, same weights, same padding as the modules' own path: the same numbers, bit for bit
(``tests/test_step_program.py``). The row buckets are the bounded set of shapes a step can have (about 70 up to
2048 rows); they are what a CUDA-graph runner would capture once each. The program is rebuilt when a weight
changes, and the modules' path runs wherever a piece is missing (no oneDNN, a GPU, tensor parallelism, a
learner's attention kernel plugged in: ``PagedAttention.build_metadata`` says, in ``meta.fused``; a bf16 model on
a CPU whose oneDNN has no bf16 GEMMs, such as an AVX2-only Zen 3: ``onednn_runs``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..kernels import cpu_kernel, torch_backend
from ..profiling import profiling as profiler_on
from ..profiling import span
from .layers import PRODUCT_ROWS, decode_products_on

if TYPE_CHECKING:
    from .attention import TorchAttentionMetadata
    from .layers import OneDNNOps


@dataclass(frozen=True)
class LayerProgram:
    """One decoder layer's weights, resolved: norms as they are, projections packed for oneDNN (and for the
    decode products, where they run)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv: torch.Tensor
    o: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    biases: tuple[torch.Tensor | None, ...]  # qkv, o, gate, up, down
    panels: tuple[torch.Tensor, ...] | None = None  # qkv, o, gate, up, down for the decode products, or None


class StepProgram:
    """``LlamaModel``'s layers as a program of compiled calls (see the module docstring); ``build`` says if it can."""

    def __init__(
        self,
        ops: OneDNNOps,
        pad: Callable[[torch.Tensor], torch.Tensor],
        layers: list[LayerProgram],
        num_heads: int,
        scale: float,
        params: list[torch.Tensor],
    ) -> None:
        self.ops, self.pad, self.layers, self.num_heads, self.scale = ops, pad, layers, num_heads, scale
        self.params, self.key = params, self.weights_key(params)

    @staticmethod
    def weights_key(params: list[torch.Tensor]) -> tuple[int, list[int], list[int]]:
        """How many parameters the process has assigned so far, and the parameters' versions and addresses."""
        return _ASSIGNED[0], list(map(_VERSION, params)), list(map(torch.Tensor.data_ptr, params))

    def is_current(self) -> bool:
        """True while the model's weights are the ones the program was built from: none changed in place (its
        version), had its storage swapped (its address) or was replaced by a new parameter (a module's weight
        assigned, ``load_state_dict(assign=True)``: counted process-wide). Asked every step, so it reads a kept
        list instead of walking the model's modules: about 0.3 ms a step on SmolLM2 (271 parameters, read
        cache-cold after the GEMMs; a 2-core Xeon)."""
        return self.key == self.weights_key(self.params)

    def run(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: TorchAttentionMetadata,
    ) -> torch.Tensor:
        """The layers on ``x`` [num_tokens, hidden] (before the final norm): hidden states [num_tokens, hidden]."""
        n = x.shape[0]
        x = self.pad(x)
        pointwise, binary = self.ops.pointwise, self.ops.binary
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        plan = meta.plan
        kc0 = kv_caches[0][0]
        bound = None
        if plan.in_place is not None and not plan.prefills:  # every sequence on the kernel: bind the step once
            bound = cpu_kernel.BoundStep(
                x.shape[0], x.shape[1], x.dtype, cos, sin, slots, plan.in_place, self.num_heads, kc0.shape[2],
                kc0.shape[3], kc0.shape[1], self.scale,
            )  # fmt: skip
        norm = bound.rms_norm if bound is not None else cpu_kernel.rms_norm
        attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
        if bound is not None:
            attend = bound.rope_write_attend
        else:

            def attend(qkv: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
                q = cpu_kernel.rope_and_cache(qkv, cos, sin, kc, vc, slots, self.num_heads)
                return torch_backend.attend(plan, q, kc, vc, self.scale).view(q.shape[0], -1)

        # Named spans cost µs each: only under a profiler, which then tells the compiled calls from the glue.
        profiling = profiler_on()
        if profiling:
            norm = _spanned("rms_norm", norm)
            attend = _spanned("paged_attention", attend)
        # where the modules' Linear takes them too (decode_panels: the same rows, switch and build)
        if n <= PRODUCT_ROWS and self.layers[0].panels is not None and decode_products_on(x.dtype):
            return self._on_decode_products(x if x.shape[0] > n else x.clone(), n, norm, attend, kv_caches)[:n]
        for layer, (kc, vc) in zip(self.layers, kv_caches, strict=True):
            b_qkv, b_o, b_gate, b_up, b_down = layer.biases
            h = norm(x, layer.input_norm, layer.eps)
            a = attend(pointwise(h, layer.qkv, b_qkv, "none", [], ""), kc, vc)
            x = binary(a, x, layer.o, b_o, "add")
            h = norm(x, layer.post_norm, layer.eps)
            g = pointwise(h, layer.gate, b_gate, "swish", [], "")
            x = binary(binary(h, g, layer.up, b_up, "mul"), x, layer.down, b_down, "add")
        return x[:n]

    def _on_decode_products(
        self,
        x: torch.Tensor,
        n: int,
        norm: Callable[..., torch.Tensor],
        attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """``run``'s layers for a step of at most ``PRODUCT_ROWS`` rows, on the decode products
        (``cpu_kernel.decode_product``/``decode_glu``): the residual adds and silu(gate) * up are done in the
        products' tiles. ``x`` is the step's own, padded; it is updated in place, its first ``n`` rows only."""
        first = self.layers[0]
        assert first.panels is not None
        qkv_out = torch.zeros(x.shape[0], first.panels[0].shape[0], dtype=x.dtype)  # padding rows stay zero
        glu_out = torch.zeros(x.shape[0], first.panels[2].shape[0], dtype=x.dtype)
        product, glu = cpu_kernel.decode_product, cpu_kernel.decode_glu  # each names itself to a profiler
        for layer, (kc, vc) in zip(self.layers, kv_caches, strict=True):
            assert layer.panels is not None
            w_qkv, w_o, w_gate, w_up, w_down = layer.panels
            a = attend(product(norm(x, layer.input_norm, layer.eps), w_qkv, qkv_out, None, n), kc, vc)
            product(a, w_o, x, x, n)
            product(glu(norm(x, layer.post_norm, layer.eps), w_gate, w_up, glu_out, n), w_down, x, x, n)
        return x


def onednn_runs(dtype: torch.dtype) -> bool:
    """True where this CPU's oneDNN has packed GEMMs in ``dtype``, which the program is made of. fp32: wherever
    oneDNN is. bf16: where PyTorch says so (``torch.ops.mkldnn._is_mkldnn_bf16_supported``: AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT on x86, bf16 on Arm), the check behind the error a bf16 weight's reorder raises elsewhere (an
    AVX2-only CPU such as a Zen 3). There the modules run the model; their ``Linear`` layers meet that error once
    and multiply with PyTorch's own bf16 GEMM from then on."""
    if dtype != torch.bfloat16:
        return True
    try:  # a private operator: a PyTorch without it is taken to have no bf16 kernels
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


# Parameters registered on any module of this process, counted by a global hook: a program built before the
# last registration may hold a replaced weight, so it is built again (packing is cached per weight: cheap).
_ASSIGNED = [0]
_VERSION = operator.attrgetter("_version")


def _count_assigned(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
    _ASSIGNED[0] += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_count_assigned)


def _spanned(name: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn`` inside a profiler span called ``name`` (a ctypes call is invisible to the profiler otherwise)."""

    def call(*args: Any) -> torch.Tensor:
        with span(name):
            return fn(*args)

    return call
