"""The KV cache is not one cache: KV cache groups, one manager each, and a coordinator over them.

A model whose layers differ in what they read (full attention beside a sliding window) gets one block table per
request *per group of layers of one type*; every group draws on the same ``BlockPool`` (vLLM v1:
``vllm/v1/core/kv_cache_coordinator.py``, ``kv_cache_utils.py``).

**Grouping** (vLLM's ``_get_kv_cache_groups_uniform_page_size``). The layers of each type are cut into groups of
``group_size`` layers, the smallest type's layer count, so that every group's block holds the same bytes. The
memory is ``group_size`` tensors per K and V; tensor ``j`` is shared by the ``j``-th layer of every group. A block id
belongs to one group at a time, so the same slot of tensor ``j`` holds layer ``j`` of whichever group owns that
block. Qwen2 with 4 layers, the last 2 windowed (``max_window_layers=2``)::

    layers      0 full   1 full   2 window   3 window
    groups      group 0 = (0, 1)           group 1 = (2, 3)           group_size 2: 2 tensors, not 4
    tensor 0    layer 0's K/V in group 0's blocks, layer 2's in group 1's blocks
    tensor 1    layer 1's K/V in group 0's blocks, layer 3's in group 1's blocks

so a block costs ``group_size`` layers' bytes, and a request holds one block per group per ``block_size`` tokens:
full-attention groups all of them, sliding-window groups only those inside the window. Full-attention groups come
first: group 0 of a model with any full-attention layer is one of them, and its block tables and prefix-cache keys
are exactly what a model without windows would have. A model of one type (SmolLM2, Mistral's all-window layers) has
one group.

**Prefix hits** (``find_longest_cache_hit``): each group has its own rule, and the hit is the longest length every
group accepts. A full-attention hit is closed under shortening; a sliding-window one is not (it must end with
a whole window), so the coordinator asks each group again with the shorter length until all agree.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

from .block_pool import BlockPool, KVCacheBlock
from .request import Request
from .single_type_kv_cache_manager import SingleTypeKVCacheManager, make_manager


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """The layers that share one block table, and what they read (``sliding_window`` None: everything)."""

    layer_ids: tuple[int, ...]
    sliding_window: int | None = None


def kv_cache_groups(windows: Sequence[int | None]) -> list[KVCacheGroupSpec]:
    """The KV cache groups of a model whose layer ``i`` has window ``windows[i]`` (``model.llama.sliding_windows``).
    A type whose layer count is not a multiple of the group size ends with a smaller group; its block still costs
    ``group_size`` layers (vLLM pads it the same way)::

        [None] * 30                      -> one group of 30 layers (SmolLM2)
        [None, None, 8, 8]               -> (0, 1) full, (2, 3) window 8
        [8, 8, 8, None, 8, 8, 8, None]   -> (3, 7) full, (0, 1) (2, 4) (5, 6) window 8
    """
    if not windows:
        raise ValueError("a model needs at least one layer")
    same_type: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        same_type.setdefault(window, []).append(layer)
    group_size = min(len(layers) for layers in same_type.values())
    order = sorted(same_type, key=lambda w: (w is not None, w or 0))  # full attention first, then by window
    return [
        KVCacheGroupSpec(tuple(same_type[w][i : i + group_size]), w)
        for w in order
        for i in range(0, len(same_type[w]), group_size)
    ]


def layer_tensors(groups: Sequence[KVCacheGroupSpec], num_layers: int) -> list[int]:
    """Which of the shared K/V tensors each layer uses: its place in its group."""
    tensor = [-1] * num_layers
    for group in groups:
        for j, layer in enumerate(group.layer_ids):
            tensor[layer] = j
    if -1 in tensor:
        raise ValueError(f"layer {tensor.index(-1)} is in no KV cache group of {list(groups)}")
    return tensor


def layer_groups(groups: Sequence[KVCacheGroupSpec], num_layers: int) -> list[int]:
    """Which group each layer's block table comes from."""
    group_of = [-1] * num_layers
    for g, group in enumerate(groups):
        for layer in group.layer_ids:
            group_of[layer] = g
    return group_of


@dataclass(eq=False)
class KVCacheBlocks(Sequence[KVCacheBlock]):
    """What the scheduler gets from and gives to the KV cache manager: one block list per KV cache group (vLLM:
    ``KVCacheBlocks``). The scheduler never looks inside; as a sequence it is group 0's list, so code written for a
    model of one attention type reads it as the list it always was."""

    blocks: tuple[list[KVCacheBlock], ...]

    @overload
    def __getitem__(self, i: int) -> KVCacheBlock: ...
    @overload
    def __getitem__(self, i: slice) -> list[KVCacheBlock]: ...
    def __getitem__(self, i: int | slice) -> KVCacheBlock | list[KVCacheBlock]:
        return self.blocks[0][i]

    def __len__(self) -> int:
        return len(self.blocks[0])

    def __iter__(self) -> Iterator[KVCacheBlock]:
        return iter(self.blocks[0])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, KVCacheBlocks):
            return self.blocks == other.blocks
        return isinstance(other, list) and len(self.blocks) == 1 and self.blocks[0] == other

    __hash__ = None  # type: ignore[assignment]  # mutable, like the lists it holds


class KVCacheCoordinator:
    """One ``SingleTypeKVCacheManager`` per KV cache group over one pool; calls that concern a request go to all."""

    def __init__(self, groups: Sequence[KVCacheGroupSpec], block_pool: BlockPool, block_size: int) -> None:
        self.groups = list(groups)
        self.managers: list[SingleTypeKVCacheManager] = [
            make_manager(block_pool, block_size, g, spec.sliding_window) for g, spec in enumerate(self.groups)
        ]

    def find_longest_cache_hit(self, request: Request, max_num_blocks: int) -> KVCacheBlocks:
        """Each group's hit, all of the longest length every group accepts (at most ``max_num_blocks`` blocks)."""
        hit = max_num_blocks
        while True:
            found = []
            for manager in self.managers:
                found.append(manager.find_longest_cache_hit(request, hit))
                if len(found[-1]) > hit:  # asked again with the same cap, it would answer the same: for ever
                    raise ValueError(
                        f"{type(manager).__name__} found {len(found[-1])} blocks, more than the {hit} asked for"
                    )
                hit = min(hit, len(found[-1]))
            if all(len(f) == hit for f in found):
                return KVCacheBlocks(tuple(found))

    def max_num_blocks(self, num_tokens: int, max_new_tokens: int) -> int:
        """The most blocks, all groups together, that a request of ``num_tokens`` tokens holds at once."""
        return sum(m.max_num_blocks(num_tokens, max_new_tokens) for m in self.managers)

    def fork(self, parent_id: str, child_id: str) -> None:
        for manager in self.managers:
            manager.fork(parent_id, child_id)

    def trim(self, request_id: str, num_tokens: int) -> int:
        return sum(m.trim(request_id, num_tokens) for m in self.managers)

    def free(self, request_id: str) -> None:
        for manager in self.managers:
            manager.free(request_id)
