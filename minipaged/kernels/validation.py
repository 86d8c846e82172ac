"""Input checks shared by the PyTorch references and the Triton wrappers.

A Triton kernel does not check anything: a wrong stride or an out-of-range block id
reads someone else's memory and returns a plausible-looking wrong answer. So every
entry point, reference or kernel, calls the one checker below for its operation and
fails early with a ``ValueError`` that names the argument and says what was expected.

Two kinds of check:

* **shapes, dtypes, devices** — metadata, free to read, always checked;
* **values** (slot range, ``seq_len`` against the block table's capacity, block ids
  inside the pool, ``cu_seqlens_q`` increasing) — these read the tensors' contents. On
  the CPU that costs nothing; on a GPU it would copy them back and stall the launch
  queue (and cannot happen inside a CUDA graph), so the Triton wrappers skip it there
  (``check_values=False``) exactly as vLLM's kernels trust their scheduler.

Layouts (vLLM's FlashAttention layout, one layer)::

    key_cache, value_cache   [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables   int32     [num_seqs, max_blocks]      logical block -> physical block
    seq_lens       int32     [num_seqs]                  every token of a sequence, cached and new
    cu_seqlens_q   int32     [num_seqs + 1]              prefix sums of the new tokens per sequence
    slot_mapping   int32/64  [num_tokens]                block * block_size + offset, -1 = padding
"""

from __future__ import annotations

import numbers
import os
from typing import Any, NoReturn

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _fail(msg: str) -> NoReturn:
    raise ValueError(msg)


def _tensor(name: str, x: object, ndim: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        _fail(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    return x


def _index(name: str, x: object, ndim: int, dtypes: tuple[torch.dtype, ...] = (torch.int32,)) -> torch.Tensor:
    x = _tensor(name, x, ndim)
    if x.dtype not in dtypes:
        want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        _fail(
            f"{name} must be {want}, got {str(x.dtype).replace('torch.', '')} "
            f"(convert with .to(torch.{str(dtypes[0]).replace('torch.', '')}))"
        )
    return x


def _same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        _fail("all tensors must be on the same device, got " + ", ".join(f"{n} on {d}" for n, d in devices.items()))


def check_kv_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Both caches ``[num_blocks, block_size, num_kv_heads, head_dim]``, same shape and float dtype.

    Returns ``(num_blocks, block_size, num_kv_heads, head_dim)``.
    """
    _tensor("key_cache", key_cache, 4)
    _tensor("value_cache", value_cache, 4)
    if key_cache.shape != value_cache.shape:
        _fail(
            f"key_cache and value_cache must have the same shape, got {tuple(key_cache.shape)} "
            f"and {tuple(value_cache.shape)}"
        )
    if key_cache.dtype != value_cache.dtype:
        _fail(f"key_cache and value_cache must have the same dtype, got {key_cache.dtype} and {value_cache.dtype}")
    if key_cache.dtype not in FLOAT_DTYPES:
        _fail(f"the KV cache must be float32, float16 or bfloat16, got {key_cache.dtype}")
    if min(key_cache.shape) == 0:
        _fail(f"the KV cache must not be empty, got shape {tuple(key_cache.shape)}")
    return tuple(key_cache.shape)  # type: ignore[return-value]


def check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, *, check_values: bool = True) -> None:
    """Checks for ``reshape_and_cache``: new K/V ``[num_tokens, num_kv_heads, head_dim]`` and their slots."""
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_caches(key_cache, value_cache)
    _tensor("key", key, 3)
    _tensor("value", value, 3)
    if key.shape != value.shape:
        _fail(f"key and value must have the same shape, got {tuple(key.shape)} and {tuple(value.shape)}")
    if tuple(key.shape[1:]) != (num_kv_heads, head_dim):
        _fail(
            f"key must be [num_tokens, num_kv_heads={num_kv_heads}, head_dim={head_dim}] to match the cache, "
            f"got {tuple(key.shape)}"
        )
    if key.dtype != key_cache.dtype or value.dtype != key_cache.dtype:
        _fail(f"key/value dtype ({key.dtype}/{value.dtype}) must match the cache dtype ({key_cache.dtype})")
    _index("slot_mapping", slot_mapping, 1, (torch.int64, torch.int32))
    if slot_mapping.shape[0] != key.shape[0]:
        _fail(f"slot_mapping must have one slot per token ({key.shape[0]}), got {slot_mapping.shape[0]}")
    _same_device(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping)
    if not check_values or slot_mapping.numel() == 0:
        return
    slots = slot_mapping.cpu()
    num_slots = num_blocks * block_size
    bad = (slots < -1) | (slots >= num_slots)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        _fail(
            f"slot_mapping[{i}] = {int(slots[i])} is outside the pool: slots run from 0 to {num_slots - 1} "
            f"({num_blocks} blocks x block_size {block_size}); -1 marks a padding token"
        )
    real = slots[slots >= 0]
    if real.unique().numel() != real.numel():
        uniq, counts = real.unique(return_counts=True)
        _fail(f"slot_mapping writes slot {int(uniq[counts > 1][0])} more than once; each slot holds one token")


def _check_attention_common(
    query, key_cache, value_cache, block_tables, seq_lens, scale, *, num_seqs: int | None
) -> tuple[int, int, int, int, int]:
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_caches(key_cache, value_cache)
    _tensor("query", query, 3)
    if query.dtype != key_cache.dtype:
        _fail(f"query dtype ({query.dtype}) must match the cache dtype ({key_cache.dtype})")
    if query.shape[2] != head_dim:
        _fail(f"query head_dim ({query.shape[2]}) must match the cache head_dim ({head_dim})")
    num_q_heads = query.shape[1]
    if num_q_heads == 0 or num_q_heads % num_kv_heads:
        _fail(
            f"num_q_heads ({num_q_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads}): "
            f"grouped-query attention shares each KV head among an integer number of query heads"
        )
    _index("block_tables", block_tables, 2)
    _index("seq_lens", seq_lens, 1)
    if num_seqs is None:  # decode: one query token per sequence
        num_seqs = query.shape[0]
        if seq_lens.shape[0] != num_seqs:
            _fail(
                f"query must have one token per sequence: query has {num_seqs} rows, "
                f"seq_lens has {seq_lens.shape[0]} sequences"
            )
    if seq_lens.shape[0] != num_seqs:
        _fail(f"seq_lens must have one entry per sequence ({num_seqs}), got {seq_lens.shape[0]}")
    if block_tables.shape[0] != num_seqs:
        _fail(f"block_tables must have one row per sequence ({num_seqs}), got {block_tables.shape[0]}")
    if block_tables.shape[1] == 0:
        _fail("block_tables must have at least one column (max_blocks >= 1)")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        _fail(f"scale must be a Python float (usually head_dim ** -0.5), got {type(scale).__name__}")
    return num_blocks, block_size, num_kv_heads, head_dim, num_q_heads


def _check_table_values(block_tables, seq_lens, block_size: int, num_blocks: int, min_len: int) -> None:
    """Every sequence's length and the blocks it reads, checked in a few whole-table passes (the engine checks
    each step: a loop over 128 sequences cost a millisecond a step). The first bad sequence is reported, and
    for it the first of: too short, longer than its table, a block id outside the pool."""
    lens = seq_lens.cpu().long()
    tables = block_tables.cpu().long()
    if lens.numel() == 0:
        return
    capacity = tables.shape[1] * block_size
    used = torch.arange(tables.shape[1])[None, :] < (lens[:, None] + block_size - 1) // block_size
    outside = used & ((tables < 0) | (tables >= num_blocks))
    short, long_, bad_block = lens < min_len, lens > capacity, outside.any(1)
    bad = short | long_ | bad_block
    if not bool(bad.any()):
        return
    i = int(bad.nonzero()[0, 0])
    n = int(lens[i])
    if short[i]:
        _fail(f"seq_lens[{i}] = {n}: a sequence needs at least {min_len} token(s)")
    if long_[i]:
        _fail(
            f"seq_lens[{i}] = {n} exceeds the block table's capacity: {tables.shape[1]} blocks x "
            f"block_size {block_size} = {capacity} tokens"
        )
    j = int(outside[i].nonzero()[0, 0])
    _fail(
        f"block_tables[{i}, {j}] = {int(tables[i, j])} is not a block of the pool (0..{num_blocks - 1}) "
        f"but sequence {i} ({n} tokens) reads logical block {j}"
    )


def check_paged_decode(
    query, key_cache, value_cache, block_tables, seq_lens, scale, *, check_values: bool = True
) -> None:
    """Checks for ``paged_decode_attention``: one query token per sequence, ``[num_seqs, num_q_heads, head_dim]``."""
    num_blocks, block_size, *_ = _check_attention_common(
        query, key_cache, value_cache, block_tables, seq_lens, scale, num_seqs=None
    )
    _same_device(
        query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables, seq_lens=seq_lens
    )
    if check_values:
        _check_table_values(block_tables, seq_lens, block_size, num_blocks, min_len=1)


def check_paged_prefill(
    query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, *, check_values: bool = True
) -> None:
    """Checks for ``paged_prefill_attention``: packed new tokens ``[total_new_tokens, num_q_heads, head_dim]``."""
    _index("cu_seqlens_q", cu_seqlens_q, 1)
    if cu_seqlens_q.shape[0] < 2:
        _fail(f"cu_seqlens_q must have num_seqs + 1 >= 2 entries, got {cu_seqlens_q.shape[0]}")
    num_seqs = cu_seqlens_q.shape[0] - 1
    num_blocks, block_size, *_ = _check_attention_common(
        query, key_cache, value_cache, block_tables, seq_lens, scale, num_seqs=num_seqs
    )
    _same_device(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens,
    )
    if not check_values:
        return
    cu = cu_seqlens_q.cpu().long()
    if int(cu[0]) != 0:
        _fail(f"cu_seqlens_q must start at 0, got {int(cu[0])}")
    q_lens = cu[1:] - cu[:-1]
    if bool((q_lens < 0).any()):
        i = int((q_lens < 0).nonzero()[0, 0])
        _fail(
            f"cu_seqlens_q must not decrease: cu_seqlens_q[{i + 1}] = {int(cu[i + 1])} < "
            f"cu_seqlens_q[{i}] = {int(cu[i])}"
        )
    if int(cu[-1]) != query.shape[0]:
        _fail(f"cu_seqlens_q[-1] = {int(cu[-1])} must equal the number of query tokens ({query.shape[0]})")
    lens = seq_lens.cpu().long()
    too_long = q_lens > lens
    if bool(too_long.any()):
        i = int(too_long.nonzero()[0, 0])
        _fail(
            f"sequence {i} has {int(q_lens[i])} new tokens but seq_lens[{i}] = {int(lens[i])}: the new tokens "
            f"are the last q_len of seq_len tokens, so q_len <= seq_len"
        )
    _check_table_values(block_tables, seq_lens, block_size, num_blocks, min_len=0)


def triton_interpreter_ready() -> bool:
    """True when Triton runs kernels in its interpreter, its own ``tl.*`` helpers included.

    ``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is *defined*, and
    ``triton.language`` defines its helpers (``tl.zeros``, ``tl.sum``, ...) when ``triton`` is
    first imported: setting the variable after that gives interpreted kernels calling
    compiled helpers, which fails.

    Both halves read Triton internals (``triton.knobs``, ``InterpretedFunction``) that a release
    may move; each has a fallback, so a moved name degrades the answer to "what the environment
    says" instead of raising (see :func:`_interpret_flag` and :func:`_helpers_interpreted`).
    """
    import triton
    import triton.language as tl

    return _interpret_flag(triton) and _helpers_interpreted(tl) is not False


_TRUTHY = ("1", "true", "on", "yes", "y")  # the spellings of "on" Triton 3.9 accepts, in any case


def _interpret_flag(triton: Any) -> bool:
    """Triton's own reading of ``TRITON_INTERPRET`` (``triton.knobs``), or the variable itself without it."""
    try:
        return bool(triton.knobs.runtime.interpret)
    except AttributeError:
        return os.environ.get("TRITON_INTERPRET", "").lower() in _TRUTHY


def _helpers_interpreted(tl: Any) -> bool | None:
    """Is ``tl.zeros`` (a helper defined when triton was imported) interpreted? None when nothing tells.

    The helper's class says it: the interpreter's ``InterpretedFunction``, or the compiler's
    ``JITFunction`` (triton imported before the variable was set). Without the first, a
    ``JITFunction`` still means "compiled", and a class named like the interpreter's means
    "interpreted"; anything else leaves the answer to the variable alone (None)."""
    import triton

    zeros = getattr(tl, "zeros", None)
    try:
        from triton.runtime.interpreter import InterpretedFunction

        return isinstance(zeros, InterpretedFunction)
    except ImportError:
        pass
    jit_function = getattr(triton, "JITFunction", None)
    if isinstance(jit_function, type) and isinstance(zeros, jit_function):
        return False
    if "Interpret" in type(zeros).__name__:
        return True
    return None


def check_triton_runtime(dtype: torch.dtype, device: torch.device) -> None:
    """Can the Triton kernels run on these tensors? CUDA compiles them; elsewhere the interpreter must be on."""
    if device.type == "cuda":
        return
    if not triton_interpreter_ready():
        raise RuntimeError(
            f"the Triton kernels cannot run on {device} tensors here: without a CUDA GPU they need the Triton "
            "interpreter, and TRITON_INTERPRET=1 must be set before triton is first imported. Import "
            "minipaged.kernels before anything imports triton (it sets the variable when there is no GPU), or "
            "export TRITON_INTERPRET=1; or use the reference: get_attention_backend('torch')."
        )
    if dtype == torch.bfloat16:
        _fail(
            "bfloat16 is not supported by the Triton interpreter (numpy has no bfloat16 arithmetic); "
            "use float16 or float32 on CPU, or run on a CUDA GPU"
        )


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    """The Triton kernels take every stride but the last: ``head_dim`` must be contiguous (stride 1)."""
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            _fail(
                f"{name} must be contiguous in its last dimension (head_dim), got strides {t.stride()}; "
                f"call .contiguous() first"
            )
