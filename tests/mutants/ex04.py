"""Exercise 04 — slot mapping and the admission inequality: wrong solutions a learner writes."""

from __future__ import annotations

from . import mutant

CHECKS = {"slot_mapping": ["check_slot_mapping"], "would_allocate": ["check_would_allocate"]}
HELPERS: dict = {}


# ---- part 1: slot_mapping ---------------------------------------------------------------------
@mutant("slot_mapping", "adds the offset to the block id without scaling the block id by block_size")
def block_not_scaled(block_tables, positions, block_size, pad_to=None):
    slots = []
    for table, request_positions in zip(block_tables, positions):
        for position in request_positions:
            logical, offset = divmod(position, block_size)
            if logical >= len(table):
                raise IndexError(f"position {position} is past the block table")
            slots.append(table[logical] + offset)  # MISTAKE
    if pad_to is not None:
        slots += [-1] * (pad_to - len(slots))
    return slots


@mutant("slot_mapping", "uses the logical block (position // block_size) as if it were the physical one")
def ignores_block_table(block_tables, positions, block_size, pad_to=None):
    slots = []
    for table, request_positions in zip(block_tables, positions):
        for position in request_positions:
            logical, offset = divmod(position, block_size)
            if logical >= len(table):
                raise IndexError(f"position {position} is past the block table")
            slots.append(logical * block_size + offset)  # MISTAKE: the table maps logical to physical
    if pad_to is not None:
        slots += [-1] * (pad_to - len(slots))
    return slots


@mutant("slot_mapping", "pads with 0 instead of -1: padding tokens would overwrite slot 0 of block 0")
def pads_with_zero(block_tables, positions, block_size, pad_to=None):
    slots = []
    for table, request_positions in zip(block_tables, positions):
        for position in request_positions:
            logical, offset = divmod(position, block_size)
            if logical >= len(table):
                raise IndexError(f"position {position} is past the block table")
            slots.append(table[logical] * block_size + offset)
    if pad_to is not None:
        slots += [0] * (pad_to - len(slots))  # MISTAKE
    return slots


@mutant("slot_mapping", "numbers a request's positions from 0 in each step (ignores the positions given)")
def positions_from_zero(block_tables, positions, block_size, pad_to=None):
    slots = []
    for table, request_positions in zip(block_tables, positions):
        for position in range(len(request_positions)):  # MISTAKE
            logical, offset = divmod(position, block_size)
            if logical >= len(table):
                raise IndexError(f"position {position} is past the block table")
            slots.append(table[logical] * block_size + offset)
    if pad_to is not None:
        slots += [-1] * (pad_to - len(slots))
    return slots


# ---- part 2: would_allocate -------------------------------------------------------------------
@mutant("would_allocate", "applies the watermark to every request, not only to new admissions")
def watermark_for_everyone(manager, request, num_new_tokens: int) -> bool:
    held = manager.get_num_blocks(request.request_id)
    total_blocks = -(-(request.num_computed_tokens + num_new_tokens) // manager.block_size)
    needed = max(0, total_blocks - held)
    watermark = manager.watermark_blocks  # MISTAKE
    return needed + watermark <= manager.get_num_free_blocks() - manager.reserved_blocks


@mutant("would_allocate", "needs blocks for the new tokens alone, ignoring free slots in the blocks it holds")
def blocks_for_new_tokens_only(manager, request, num_new_tokens: int) -> bool:
    held = manager.get_num_blocks(request.request_id)
    needed = -(-num_new_tokens // manager.block_size)  # MISTAKE
    watermark = manager.watermark_blocks if held == 0 else 0
    return needed + watermark <= manager.get_num_free_blocks() - manager.reserved_blocks


@mutant("would_allocate", "floor instead of ceil: a part-full last block is not counted")
def floor_blocks(manager, request, num_new_tokens: int) -> bool:
    held = manager.get_num_blocks(request.request_id)
    total_blocks = (request.num_computed_tokens + num_new_tokens) // manager.block_size  # MISTAKE
    needed = max(0, total_blocks - held)
    watermark = manager.watermark_blocks if held == 0 else 0
    return needed + watermark <= manager.get_num_free_blocks() - manager.reserved_blocks


@mutant("would_allocate", "forgets the reserved blocks: all free blocks are available")
def ignores_reserved(manager, request, num_new_tokens: int) -> bool:
    held = manager.get_num_blocks(request.request_id)
    total_blocks = -(-(request.num_computed_tokens + num_new_tokens) // manager.block_size)
    needed = max(0, total_blocks - held)
    watermark = manager.watermark_blocks if held == 0 else 0
    return needed + watermark <= manager.get_num_free_blocks()  # MISTAKE


@mutant("would_allocate", "strict inequality: refuses when the request needs exactly what is left")
def strict_inequality(manager, request, num_new_tokens: int) -> bool:
    held = manager.get_num_blocks(request.request_id)
    total_blocks = -(-(request.num_computed_tokens + num_new_tokens) // manager.block_size)
    needed = max(0, total_blocks - held)
    watermark = manager.watermark_blocks if held == 0 else 0
    return needed + watermark < manager.get_num_free_blocks() - manager.reserved_blocks  # MISTAKE
