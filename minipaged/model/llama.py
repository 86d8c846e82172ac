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

import dataclasses
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from torch import nn

from ..core.kv_cache_coordinator import kv_cache_groups, layer_groups
from ..kernels import cpu_kernel
from . import step_program
from .attention import AttentionMetadata, PagedAttention, TorchAttentionMetadata
from .layers import Linear, MergedLinear, OneDNNOps, RMSNorm, RotaryEmbedding, onednn_ops, pad_rows
from .parallel import VocabParallelEmbedding, gather_logits, row_parallel, shard_state_dict, tp_size
from .step_program import LayerProgram, StepProgram

if TYPE_CHECKING:
    from ..distributed import TPGroup

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
        h = Linear.glu(self.gate_proj, self.up_proj, x)  # at decode sizes, both in one pass
        if h is None:
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
        if self._program is False or os.environ.get("MINIPAGED_STEP_PROGRAM", "1") == "0":  # 0: the ablation
            return None
        if self._program is None or not self._program.is_current():
            # a piece missing now is missing for good
            self._program = self._build_program(onednn_ops()) or False
        return self._program if self._program is not False else None

    def _build_program(self, ops: OneDNNOps | None) -> StepProgram | None:
        """The program for the current weights, or None where a piece is missing (its path runs instead): each
        layer's norms, and its projections packed for oneDNN (``ops``; None: off)."""
        decoder_layers = cast("list[LlamaDecoderLayer]", list(self.layers))
        first = decoder_layers[0].self_attn
        dtype = first.q_proj.weight.dtype
        if ops is None or self.embed_tokens.tp is not None or cpu_kernel.library() is None:
            return None
        if not step_program.onednn_runs(dtype):  # on the module: the tests play a CPU without bf16 GEMMs
            return None
        probe = torch.zeros(1, self.embed_tokens.embedding_dim, dtype=dtype)

        def probe_of(lin: Linear) -> torch.Tensor:  # one row of the projection's input
            return torch.zeros(1, lin.in_features, dtype=dtype)

        layers: list[LayerProgram] = []
        for layer in decoder_layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj(probe)  # makes the merged weight
            linears: list[Linear] = [attn.qkv_proj.merged, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
            packed = []
            for lin in linears:
                found = lin._packed_weight(probe_of(lin))
                if found is None:
                    return None
                packed.append(found[1])
            norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
            if not cpu_kernel.fits_layer_ops(probe, norm1.weight, norm2.weight) or norm1.eps != norm2.eps:
                return None
            qkv, o, gate, up, down = packed
            biases = tuple(lin.bias for lin in linears)
            # The modules' own panels (Linear.decode_panels): the same numbers, no second copy.
            panels = [p for lin in linears if (p := lin.decode_panels(probe_of(lin))) is not None]
            layers.append(
                LayerProgram(
                    norm1.weight.contiguous(), norm2.weight.contiguous(), norm1.eps, qkv, o, gate, up, down, biases,
                    tuple(panels) if len(panels) == len(linears) else None,
                )
            )  # fmt: skip
        if any(layer.panels is None for layer in layers):  # all layers or none: a decode step runs one way
            layers = [dataclasses.replace(layer, panels=None) for layer in layers]
        return StepProgram(ops, pad_rows, layers, first.num_heads, first.scale, list(self.layers.parameters()))


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
