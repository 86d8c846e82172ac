"""Exercise 01 — bytes per token and block capacity: wrong solutions a learner writes."""

from __future__ import annotations

from . import mutant

CHECKS = {"bytes_per_token": ["check_bytes_per_token"], "block_capacity": ["check_block_capacity"]}
HELPERS: dict = {}


# ---- part 1: bytes_per_token ------------------------------------------------------------------
@mutant("bytes_per_token", "caches only K: forgets that V is cached too (no factor 2)")
def forgets_value(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return num_layers * num_kv_heads * head_dim * dtype_bytes  # MISTAKE


@mutant("bytes_per_token", "counts numbers, not bytes: leaves out dtype_bytes")
def counts_numbers(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return 2 * num_layers * num_kv_heads * head_dim  # MISTAKE


@mutant("bytes_per_token", "forgets the layers: one layer's K and V, not every layer's")
def one_layer_only(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return 2 * num_kv_heads * head_dim * dtype_bytes  # MISTAKE: the cache has a K and a V in every layer


# ---- part 2: block_capacity -------------------------------------------------------------------
@mutant("block_capacity", "floor instead of ceil for a request's blocks: the part-full tail block is lost")
def floor_blocks_per_request(
    budget_bytes: int, bytes_per_token: int, block_size: int, request_tokens: int
) -> tuple[int, int]:
    bytes_per_block = block_size * bytes_per_token
    num_blocks = budget_bytes // bytes_per_block
    if num_blocks < 1:
        raise ValueError("budget too small for one block")
    blocks_per_request = request_tokens // block_size  # MISTAKE
    return num_blocks, num_blocks // blocks_per_request


@mutant("block_capacity", "counts requests in tokens (budget // request bytes), as if no block were part-empty")
def requests_by_tokens(
    budget_bytes: int, bytes_per_token: int, block_size: int, request_tokens: int
) -> tuple[int, int]:
    num_blocks = budget_bytes // (block_size * bytes_per_token)
    if num_blocks < 1:
        raise ValueError("budget too small for one block")
    return num_blocks, budget_bytes // (request_tokens * bytes_per_token)  # MISTAKE


@mutant("block_capacity", "rounds the budget up to whole blocks: a block that does not fit is counted")
def ceil_num_blocks(budget_bytes: int, bytes_per_token: int, block_size: int, request_tokens: int) -> tuple[int, int]:
    bytes_per_block = block_size * bytes_per_token
    num_blocks = -(-budget_bytes // bytes_per_block)  # MISTAKE
    if num_blocks < 1:
        raise ValueError("budget too small for one block")
    blocks_per_request = -(-request_tokens // block_size)
    return num_blocks, num_blocks // blocks_per_request


@mutant("block_capacity", "a budget smaller than one block returns (0, 0) instead of raising ValueError")
def no_error(budget_bytes: int, bytes_per_token: int, block_size: int, request_tokens: int) -> tuple[int, int]:
    num_blocks = budget_bytes // (block_size * bytes_per_token)  # MISTAKE: no check for num_blocks < 1
    blocks_per_request = -(-request_tokens // block_size)
    return num_blocks, num_blocks // blocks_per_request
