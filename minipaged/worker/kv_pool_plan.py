"""The KV pool's plan, made once at start-up, before any cache tensor exists (vLLM: ``kv_cache_utils.py``'s
``get_kv_cache_config``, from the memory ``gpu_worker.py`` found).

- ``KVPoolPlan``: what one rank's pool holds (its KV heads, its cache groups, bytes per block) and how many blocks
  of each kind it gets (device, CPU swap space, offloading store), agreed with the other ranks; then the longest
  sequence that pool allows.
- ``resolve_max_model_len``: ``max_model_len`` as asked, or the model's, fitted to the pool.

Why a plan apart from the runner: sizing is arithmetic on the config, the model's shape and the device's memory,
done once; the runner then allocates what the plan says and never sizes anything again.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import TYPE_CHECKING, Any

import torch

from ..config import Config
from ..core.kv_cache_coordinator import KVCacheGroupSpec, kv_cache_groups, layer_tensors
from ..kv_math import GiB, KVSpec
from ..utils import cdiv
from .gpu_memory import num_gpu_blocks

if TYPE_CHECKING:
    from ..distributed import TPGroup
    from ..model import LlamaForCausalLM


def resolve_max_model_len(config: Config, max_pos: int | None, num_blocks: int) -> int:
    """``max_model_len`` as asked (not past the model's positions unless allowed), or the model's (at most
    8192), lowered with a warning to what the pool can hold."""
    block_size, usable = config.block_size, num_blocks - 1
    asked = config.max_model_len
    if asked is not None and max_pos is not None and asked > max_pos and not config.allow_long_max_model_len:
        raise ValueError(
            f"max_model_len={asked} is longer than the model's max_position_embeddings="
            f"{max_pos}: positions past it were never trained. Lower it, or pass "
            "allow_long_max_model_len=True if you know the model extrapolates"
        )
    max_model_len = asked or min(max_pos or 8192, 8192)
    if asked is None and max_model_len > usable * block_size:
        # Not asked for: fit the longest sequence the pool can hold (a small CPU budget is a fine choice).
        warnings.warn(
            f"max_model_len lowered from {max_model_len} to {usable * block_size} tokens: the KV "
            f"pool holds {usable} blocks of {block_size}. Give the cache more memory for longer "
            "sequences",
            stacklevel=7,
        )
        max_model_len = usable * block_size
    if cdiv(max_model_len, block_size) > usable:
        raise ValueError(
            f"max_model_len={max_model_len} needs {cdiv(max_model_len, block_size)} "
            f"blocks of {block_size} tokens but the KV pool has only {usable}: lower "
            "max_model_len or give the cache more memory"
        )
    return max_model_len


class KVPoolPlan:
    """One rank's KV pool, sized: the spec it holds, its cache groups, and its pools in blocks (the null block
    included), the same on every rank.

    Device blocks: ``num_gpu_blocks_override`` if given; else, on a CPU or with ``kv_cache_memory``, what that
    byte budget (default 1 GiB) holds; else, on a GPU, what ``gpu_memory_utilization`` of the card leaves
    (``gpu_memory.num_gpu_blocks``). Under tensor parallelism every rank sizes its pool from its own memory, and
    the block tables are shared, so all take the smallest (``tp.min_int``).
    """

    def __init__(
        self, config: Config, model: LlamaForCausalLM, dtype: torch.dtype, device: torch.device, tp: TPGroup | None
    ) -> None:
        hf = model.config
        spec = KVSpec(
            hf.num_hidden_layers,
            hf.num_key_value_heads,
            model.head_dim,
            dtype_bytes=dtype.itemsize,
            num_attention_heads=hf.num_attention_heads,
            name=getattr(hf, "name_or_path", "") or "model",
        )
        self.dtype, self.device = dtype, device
        self.spec = spec if tp is None else spec.per_rank(tp.size)  # this rank's KV heads: what its pool holds
        # KV cache groups (kv_cache_coordinator.py): one for SmolLM2; a hybrid model's groups share group_size
        # tensors, so a block holds group_size layers, not all of them.
        self.kv_cache_groups: list[KVCacheGroupSpec] = kv_cache_groups(model.model.windows)
        self.layer_tensors = layer_tensors(self.kv_cache_groups, hf.num_hidden_layers)
        self.page_spec = dataclasses.replace(self.spec, num_layers=max(self.layer_tensors) + 1)
        self.block_size = config.block_size
        own, own_cpu, own_offload = (
            self._device_blocks(config, model),
            self._cpu_blocks(config),
            self._offload_blocks(config),
        )
        agree = (lambda n: n) if tp is None else tp.min_int  # checked first on every rank: then they agree
        self.num_blocks, self.num_cpu_blocks, self.num_offload_blocks = agree(own), agree(own_cpu), agree(own_offload)
        self.max_model_len = resolve_max_model_len(
            config, getattr(hf, "max_position_embeddings", None), self.num_blocks
        )
        self.rank_info: dict[str, Any] = {  # what this rank holds, for ``ranks`` (chapter 01's per-rank KV bytes)
            "rank": 0 if tp is None else tp.rank,
            "pid": os.getpid(),
            "device": str(device),
            "num_kv_heads": self.spec.num_kv_heads,
            "num_attention_heads": model.model.num_heads,
            "bytes_per_block": self.page_spec.bytes_per_block(self.block_size),
            "own_num_blocks": own,
            "num_blocks": self.num_blocks,
        }

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block, every layer's tensors: what a block of this rank's pool costs."""
        return self.page_spec.bytes_per_block(self.block_size)

    def _device_blocks(self, config: Config, model: LlamaForCausalLM) -> int:
        """This rank's own pool, before the ranks agree (see the class docstring)."""
        if config.num_gpu_blocks_override is not None:
            return config.num_gpu_blocks_override
        if config.kv_cache_bytes is not None or self.device.type != "cuda":
            budget = config.kv_cache_bytes if config.kv_cache_bytes is not None else GiB
            return self.page_spec.capacity(budget, config.block_size).num_blocks  # raises if < one block
        return num_gpu_blocks(config, model, self.page_spec, self.dtype, self.device)

    def _cpu_blocks(self, config: Config) -> int:
        """The CPU swap pool: as asked, or what ``swap_space`` holds (plus the unused block 0), or none."""
        if config.num_cpu_blocks_override is not None:
            return config.num_cpu_blocks_override
        num = config.swap_space_bytes // self.bytes_per_block + 1 if config.swap_space_bytes else 0
        if config.preemption_mode == "swap" and num < 2:
            raise ValueError(
                f"swap_space={config.swap_space!r} holds no block of {self.bytes_per_block:,} bytes: give it at "
                f"least {self.bytes_per_block:,} bytes"
            )
        return num

    def _offload_blocks(self, config: Config) -> int:
        """The KV offloading store (``kv_offloading_size``), in blocks: none if not asked for."""
        num = config.kv_offloading_bytes // self.bytes_per_block
        if config.kv_offloading_bytes and not num:
            raise ValueError(
                f"kv_offloading_size={config.kv_offloading_size!r} holds no block of "
                f"{self.spec.bytes_per_block(self.block_size):,} bytes"
            )
        return num
