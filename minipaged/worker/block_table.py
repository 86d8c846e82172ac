"""Block tables and slot mappings: from a token's position to a place in the KV pool.

A request sees its KV cache as one contiguous run of token positions. The pool
stores it in scattered physical blocks. The **block table** is the indirection,
like an OS page table: entry ``i`` names the physical block holding logical
block ``i``, i.e. positions ``i*block_size .. (i+1)*block_size - 1``::

    block_size = 4, block table [19, 18, 5], 11 tokens

    position:   0  1  2  3 | 4  5  6  7 | 8  9 10
    logical:    ---- 0 ---- ---- 1 ---- --- 2 ---
    physical:   --- 19 ---- --- 18 ---- --- 5 ---      resolve(10) = (5, 2)

    pool slots: block p holds slots p*block_size .. p*block_size + block_size - 1
                position 10 -> slot 5*4 + 2 = 22

The attention kernels never see blocks: each step, the write side gets a
**slot mapping** (one flat slot index per new token, ``slot = p * block_size + o``,
what vLLM passes to ``reshape_and_cache``), and the read side gets the block
tables of the batch as one padded 2-D tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ..utils import check_int

# vLLM's name for "this token is padding, write it nowhere".
PAD_SLOT_ID = -1
# Block tables are padded with the null block: a valid id whose contents are never read as real tokens.
NULL_BLOCK_ID = 0


def _check_block_size(block_size: int) -> int:
    return check_int("block_size", block_size, 1)


class BlockTable:
    """The physical block ids of one request, in logical order.

    ``num_tokens`` is optional: when given, ``resolve`` also refuses positions past
    the tokens actually written (not just past the last block).
    """

    def __init__(self, block_size: int, block_ids: Iterable[int] = (), num_tokens: int | None = None) -> None:
        self.block_size = _check_block_size(block_size)
        self.block_ids: list[int] = []
        self.append(block_ids)
        self.num_tokens = num_tokens
        if num_tokens is not None and not 0 <= num_tokens <= self.capacity:
            raise ValueError(
                f"num_tokens={num_tokens} does not fit in {len(self.block_ids)} blocks "
                f"of {block_size} (capacity {self.capacity})"
            )

    def append(self, block_ids: int | Iterable[int]) -> None:
        """Add blocks at the end (a request only ever grows its table at the end)."""
        ids = [block_ids] if isinstance(block_ids, int) else list(block_ids)
        for b in ids:
            check_int("a block id", b, 0)
        self.block_ids.extend(ids)

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def capacity(self) -> int:
        """Token slots the table covers: whole blocks, the unfilled tail included."""
        return len(self.block_ids) * self.block_size

    def resolve(self, position: int) -> tuple[int, int]:
        """``position`` -> ``(physical block, offset in block)``."""
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise IndexError(f"position must be a non-negative integer, got {position!r}")
        limit = self.capacity if self.num_tokens is None else self.num_tokens
        if position >= limit:
            what = (
                f"{self.num_tokens} tokens"
                if self.num_tokens is not None
                else f"{len(self.block_ids)} blocks x {self.block_size} = {self.capacity} slots"
            )
            raise IndexError(f"position {position} is past the end of the block table ({what})")
        logical_block, offset = divmod(position, self.block_size)
        return self.block_ids[logical_block], offset

    def slot(self, position: int) -> int:
        """Flat slot index of ``position`` in the pool: ``block * block_size + offset``."""
        block, offset = self.resolve(position)
        return block * self.block_size + offset

    def __len__(self) -> int:
        return len(self.block_ids)

    def __repr__(self) -> str:
        return f"BlockTable(block_size={self.block_size}, block_ids={self.block_ids})"


def _ids(table: BlockTable | Sequence[int]) -> list[int]:
    return table.block_ids if isinstance(table, BlockTable) else [int(b) for b in table]


def slot_mapping(
    block_tables: Sequence[BlockTable | Sequence[int]],
    positions: Sequence[Sequence[int]],
    block_size: int,
    pad_to: int | None = None,
) -> torch.Tensor:
    """Flat pool slot of every token a step writes, for a whole batch.

    ``positions[i]`` are the positions request ``i`` writes this step (a prefill
    chunk, or one position when decoding). The result concatenates them request
    after request, as the model's flattened token batch is laid out, and pads
    with ``-1`` up to ``pad_to`` tokens (fixed shapes, e.g. for CUDA graphs)::

        tables [[19, 18, 5], [7]], positions [[9, 10], [2]], block_size 4, pad_to 4
        -> [5*4+1, 5*4+2, 7*4+2, -1] = [21, 22, 30, -1]

    Returns a ``torch.int64`` tensor (slot ids outgrow int32 in large pools).
    """
    bs = _check_block_size(block_size)
    if len(block_tables) != len(positions):
        raise ValueError(f"{len(block_tables)} block tables but {len(positions)} position lists")
    slots: list[int] = []
    for i, (table, pos) in enumerate(zip(block_tables, positions)):
        ids = _ids(table)
        for p in pos:
            p = int(p)
            if p < 0 or p >= len(ids) * bs:
                raise IndexError(f"request {i}: position {p} is past its block table ({len(ids)} blocks x {bs} slots)")
            slots.append(ids[p // bs] * bs + p % bs)
    if pad_to is not None:
        if pad_to < len(slots):
            raise ValueError(f"pad_to={pad_to} is smaller than the {len(slots)} tokens of the batch")
        slots.extend([PAD_SLOT_ID] * (pad_to - len(slots)))
    return torch.tensor(slots, dtype=torch.int64)


def make_block_table_tensor(
    block_tables: Sequence[BlockTable | Sequence[int]],
    max_num_blocks: int | None = None,
    pad_id: int = NULL_BLOCK_ID,
    dtype: torch.dtype = torch.int32,
) -> torch.Tensor:
    """The batch's block tables as one ``[batch, max_num_blocks]`` tensor, the read side's input.

    Short rows are padded with the null block (id 0): the kernel only reads as
    many entries as the request's length says, and a padded entry still names a
    real block, so even a stray read stays inside the pool::

        [[19, 18, 5],          [[19, 18, 5],
         [7]]           ->      [ 7,  0, 0]]
    """
    rows = [_ids(t) for t in block_tables]
    width = max((len(r) for r in rows), default=0) if max_num_blocks is None else max_num_blocks
    if any(len(r) > width for r in rows):
        raise ValueError(f"a block table has more than max_num_blocks={width} entries")
    out = torch.full((len(rows), width), pad_id, dtype=dtype)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out
