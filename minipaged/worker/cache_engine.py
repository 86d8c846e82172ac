"""The cache engine: the real K/V tensors behind the block ids, and the copies between them.

The block pool and the scheduler only move integers around. This class owns the
memory those integers name: per layer, one key tensor and one value tensor on
the device, and a smaller pair in CPU memory for swapping::

    device, per layer:  key_cache   [num_blocks,     block_size, num_kv_heads, head_dim]
                        value_cache [num_blocks,     block_size, num_kv_heads, head_dim]
    CPU,    per layer:  key_cache   [num_cpu_blocks, block_size, num_kv_heads, head_dim]   (swap space)
                        value_cache [num_cpu_blocks, block_size, num_kv_heads, head_dim]
    CPU,    per layer:  the same again with num_offload_blocks                          (KV offloading store)

Three kinds of copy, each a list of (source block, destination block) pairs
that the scheduler hands over with a step:

* ``swap_out``: device → CPU, when a preempted request keeps its KV instead of recomputing it;
* ``swap_in``:  CPU → device, when it comes back;
* ``copy``:     device → device, copy-on-write of a shared, partly filled block;

and two for a KV connector's CPU store (``kv_connector.OffloadingConnector``): ``offload`` (device → store, a
cached block about to be evicted) and ``onload`` (store → device, an external prefix hit); ``write_offload`` puts a
block that arrived from another engine into that store (disaggregated prefill's consumer).

A model with several KV cache groups (``kv_cache_coordinator.py``) has fewer tensors than layers:
``layer_tensors[i]`` names the tensor layer ``i`` uses, and the layers of different groups share one (a block id
belongs to one group at a time). ``gpu_cache`` still has one entry per layer; ``gpu_tensors`` the distinct ones.

Every copy moves all layers' K and V of a block. Over PCIe that is the price of
swapping: ``bytes_per_block`` per block each way, and a fixed cost for each
separate copy. Here one swap is one gathered copy per layer for K and one for V,
whatever the number of blocks; vLLM v0 issued one ``cudaMemcpyAsync`` per block,
per layer, for K and for V (``swap_blocks`` in ``csrc/cache_kernels.cu``), which
is what the simulator's cost model prices (``CostModel.copies_per_block``) and
why small blocks made its swaps slow (the PagedAttention paper, §7.3).
"""

from __future__ import annotations

import torch

from ..kv_math import KVSpec, dtype_bytes

SWAP_SPACE = "swap space: this cache engine has num_cpu_blocks=0"
OFFLOAD_STORE = "a KV offloading store: this cache engine has num_offload_blocks=0"


class CacheEngine:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        num_cpu_blocks: int = 0,
        num_offload_blocks: int = 0,
        layer_tensors: list[int] | None = None,
    ) -> None:
        for name, v in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name, v in (("num_cpu_blocks", num_cpu_blocks), ("num_offload_blocks", num_offload_blocks)):
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"KV cache dtype must be float32, float16 or bfloat16, got {dtype}")
        self.spec = KVSpec(num_layers, num_kv_heads, head_dim, dtype_bytes(dtype))
        self.block_size, self.num_blocks, self.num_cpu_blocks = block_size, num_blocks, num_cpu_blocks
        self.device = torch.device(device)
        self.layer_tensors = list(range(num_layers)) if layer_tensors is None else list(layer_tensors)
        num_tensors = max(self.layer_tensors) + 1
        if len(self.layer_tensors) != num_layers or sorted(set(self.layer_tensors)) != list(range(num_tensors)):
            raise ValueError(f"layer_tensors must give each of {num_layers} layers one of 0..n-1, got {layer_tensors}")
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.gpu_tensors: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=dtype, device=self.device), torch.zeros(shape, dtype=dtype, device=self.device))
            for _ in range(num_tensors)
        ]
        self.gpu_cache = [self.gpu_tensors[t] for t in self.layer_tensors]  # layer -> its (shared) K, V
        pin = self.device.type == "cuda"  # pinned host memory makes device↔host copies asynchronous

        def host_cache(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
            cpu_shape = (n, block_size, num_kv_heads, head_dim)
            return [
                (
                    torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin),
                    torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin),
                )
                for _ in range(num_tensors if n else 0)
            ]

        self.cpu_cache = host_cache(num_cpu_blocks)
        self.offload_cache = host_cache(num_offload_blocks)
        self.num_offload_blocks = num_offload_blocks

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block, all its tensors: what one swapped block moves over the bus."""
        return self.spec.bytes_per_block(self.block_size) * len(self.gpu_tensors) // self.spec.num_layers

    @staticmethod
    def _pairs(
        pairs: list[tuple[int, int]], src_blocks: int, dst_blocks: int, what: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long)
        if len(pairs) and (
            int(src.min()) < 0 or int(src.max()) >= src_blocks or int(dst.min()) < 0 or int(dst.max()) >= dst_blocks
        ):
            raise ValueError(
                f"{what}: block id out of range in {pairs} (source has {src_blocks} blocks, destination {dst_blocks})"
            )
        if len(set(dst.tolist())) != len(pairs):
            raise ValueError(f"{what}: two copies write the same destination block in {pairs}")
        return src, dst

    def _copy(
        self,
        src_cache: list[tuple[torch.Tensor, torch.Tensor]],
        dst_cache: list[tuple[torch.Tensor, torch.Tensor]],
        pairs: list[tuple[int, int]],
        what: str,
        needs: str = "",
    ) -> None:
        """The pairs' blocks copied from ``src_cache`` to ``dst_cache``, every layer's K and V; ``needs`` says what an
        empty (absent) host cache would have had to be."""
        if not pairs:
            return
        if not src_cache or not dst_cache:
            raise ValueError(f"{what} needs {needs}")
        src, dst = self._pairs(pairs, src_cache[0][0].shape[0], dst_cache[0][0].shape[0], what)
        src_dev = src.to(src_cache[0][0].device)
        dst_dev = dst.to(dst_cache[0][0].device)
        for (sk, sv), (dk, dv) in zip(src_cache, dst_cache):
            dk[dst_dev] = sk[src_dev].to(dk.device, non_blocking=True)
            dv[dst_dev] = sv[src_dev].to(dv.device, non_blocking=True)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to CPU blocks: pairs of (device block, CPU block)."""
        self._copy(self.gpu_tensors, self.cpu_cache, pairs, "swap_out", SWAP_SPACE)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy CPU blocks back to device blocks: pairs of (CPU block, device block)."""
        self._copy(self.cpu_cache, self.gpu_tensors, pairs, "swap_in", SWAP_SPACE)

    def offload(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks into the KV offloading store: pairs of (device block, store slot)."""
        self._copy(self.gpu_tensors, self.offload_cache, pairs, "offload", OFFLOAD_STORE)

    def onload(self, pairs: list[tuple[int, int]]) -> None:
        """Copy store slots back into device blocks: pairs of (store slot, device block)."""
        self._copy(self.offload_cache, self.gpu_tensors, pairs, "onload", OFFLOAD_STORE)

    def write_offload(self, slot: int, kv: torch.Tensor) -> None:
        """Store one block that arrived from elsewhere (``kv``: ``[layers, 2, block_size, kv_heads, head_dim]``)
        in slot ``slot`` of the KV offloading store: a KV consumer's blocks (disaggregated prefill)."""
        for layer, (k, v) in enumerate(self.offload_cache):
            k[slot].copy_(kv[layer, 0])
            v[slot].copy_(kv[layer, 1])

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Device-to-device block copies (copy-on-write): pairs of (source block, destination block)."""
        self._copy(self.gpu_tensors, self.gpu_tensors, pairs, "copy")
