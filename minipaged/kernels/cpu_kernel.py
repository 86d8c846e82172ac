"""The engine's CPU attention: ``cpu_paged_attention.cpp``, compiled on first use, read the cache in place.

Why a kernel of our own. On a CPU, attention over a paged cache is a memory problem, not
an arithmetic one: a decode step reads every context token's K and V row once and does a
few dozen flops with each. ``torch_backend`` (the fallback) gathers those rows into a
contiguous copy and hands it to SDPA, so the rows cross memory three times (read, write
the copy, read the copy). One layer of a 128-request decode step on SmolLM2's shapes
(43.8 MB of K/V; ``benchmarks/bench_cpu_attention.py``, a 2-core Zen 4, 2026-11-24)::

    reference (one sequence at a time)             57.0 ms    0.8 GB/s
    gather + SDPA, 16 length-sorted groups          11.8 ms    3.7 GB/s   the fallback
    torch.compile (inductor C++), same groups        7.4 ms    5.9 GB/s   13 s to compile
    flex_attention, BlockMask from the tables       14.0 ms    3.1 GB/s
    this kernel, in place                            2.6 ms   16.8 GB/s

so the engine compiles this one file with the machine's C++ compiler (``$CXX`` when it is set
and runs; else ``g++``, ``c++`` or ``clang++``, with one line saying why ``$CXX`` was passed over)
the first time it needs it (about a second), for this CPU
(``-march=native``: AVX-512 where there is one), and keeps the library in
``~/.cache/minipaged/kernels`` keyed by the source, the compiler and the CPU. Its OpenMP
threads are PyTorch's own (the library links the ``libgomp`` PyTorch has already loaded).
With no compiler, or a compiler that fails, the engine logs one line and runs the fallback
(``MINIPAGED_CPU_KERNEL=0`` chooses the fallback quietly); ``kernels/reference.py`` stays the
specification both are tested against (``tests/test_cpu_kernel.py``). Every compiler call has a time
limit (``VERSION_TIMEOUT_S``, ``COMPILE_TIMEOUT_S``): a compiler that hangs costs seconds, not the
session. A cached library that will not load (a truncated file, say) is built again, once.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_paged_attention.cpp")
# No -ffast-math: in a shared library GCC 12 links crtfastmath, which flushes denormals for the whole process.
# -ffp-contract=off: a*b + c stays two roundings, as in PyTorch's elementwise ops (the layer ops must round
# where PyTorch rounds); attention asks for its fused multiply-adds by name (std::fma).
FLAGS = [
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-ffp-contract=off",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-std=c++17",
]
CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
log = logging.getLogger("minipaged")

VERSION_TIMEOUT_S = 10.0  # `$CXX --version`
COMPILE_TIMEOUT_S = 300.0  # one build of the kernel (about a second on a laptop)

_state: dict[str, object] = {}  # "lib": ctypes.CDLL | None, "reason": why not


def _compiler() -> tuple[str | None, str]:
    """(the compiler to use, or None; a note when ``$CXX`` was set but passed over)."""
    note = ""
    cxx = os.environ.get("CXX")
    if cxx:
        found = shutil.which(cxx)
        if found:
            return found, ""
        note = f"CXX={cxx!r} is not an executable compiler here"
    for name in ("g++", "c++", "clang++"):
        found = shutil.which(name)
        if found:
            return found, note + (f"; using {found} instead" if note else "")
    return None, note


def _version(compiler: str) -> str | None:
    """``compiler --version``'s output, or None when it cannot run or does not return in time."""
    try:
        proc = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=VERSION_TIMEOUT_S, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout  # part of the library's cache key; a compiler that fails says so when it compiles


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
    return "\n".join(dict.fromkeys(keep))


def _build() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get("MINIPAGED_CPU_KERNEL", "1") == "0":
        return None, "MINIPAGED_CPU_KERNEL=0"
    compiler, note = _compiler()
    if note:
        log.warning("minipaged: %s", note)
    if compiler is None:
        return None, note or "no C++ compiler found (g++, c++, clang++ or $CXX)"
    version = _version(compiler)
    if version is None:
        return None, f"{compiler} --version could not run or did not return within {VERSION_TIMEOUT_S:g} s"
    lib_path = library_path(version)
    for attempt in range(2):
        if not lib_path.is_file():
            reason = _compile(compiler, lib_path)
            if reason:
                return None, reason
        try:
            lib = ctypes.CDLL(str(lib_path))
            break
        except OSError as e:  # a truncated or foreign file in the cache: build it again, once
            if attempt:
                return None, f"the freshly built {lib_path} does not load: {e}"
            log.warning("minipaged: the cached %s does not load (%s): building it again", lib_path.name, e)
            lib_path.unlink(missing_ok=True)
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    signatures = {
        "minipaged_paged_attention": [ptr] * 5
        + [i64]
        + [ptr] * 2
        + [i64] * 5
        + [ctypes.c_float, i64]
        + [ctypes.c_int] * 2,
        "minipaged_rms_norm": [ptr, i64, ptr, ptr, i64, i64, ctypes.c_float, ctypes.c_int],
        "minipaged_rope_and_cache": [ptr, i64] + [ptr] * 6 + [i64] * 4 + [ctypes.c_int],
        "minipaged_features": [],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = None, argtypes
    lib.minipaged_features.restype = ctypes.c_int
    return lib, ""


def library_path(compiler_version: str) -> Path:
    """Where the library built by this compiler, from this source, for this CPU is kept."""
    from ..model_loader import cache_dir

    parts = [SOURCE.read_text(), compiler_version, *FLAGS, _cpu_signature()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    return cache_dir() / "kernels" / f"cpu_paged_attention-{key[:16]}.so"


def _compile(compiler: str, lib_path: Path) -> str:
    """Build the library at ``lib_path``; "" on success, else why not (one line)."""
    lib_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib_path.parent)  # other processes may build it too
    os.close(fd)
    try:
        try:
            proc = subprocess.run(
                [compiler, *FLAGS, str(SOURCE), "-o", tmp],
                capture_output=True,
                text=True,
                timeout=COMPILE_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            return f"{Path(compiler).name} did not finish compiling {SOURCE.name} within {COMPILE_TIMEOUT_S:g} s"
        if proc.returncode:
            first = (proc.stderr.strip().splitlines() or ["no output"])[0]
            return f"{Path(compiler).name} could not compile {SOURCE.name}: {first}"
        os.replace(tmp, lib_path)
        return ""
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on the first call; None (and one logged line, once) where it cannot be."""
    if "lib" not in _state:
        try:
            lib, reason = _build()
        except (OSError, subprocess.SubprocessError) as e:  # an unwritable cache, a library that will not load
            lib, reason = None, f"could not build or load {SOURCE.name}: {e}"
        _state.update(lib=lib, reason=reason)
        if lib is None:
            level = logging.INFO if reason == "MINIPAGED_CPU_KERNEL=0" else logging.WARNING
            log.log(level, "minipaged: %s; CPU attention gathers K/V and calls SDPA instead (slower)", reason)
    return _state["lib"]  # type: ignore[return-value]


def unavailable_reason() -> str | None:
    """Why the kernel is not in use, or None when it is."""
    return None if library() is not None else str(_state["reason"])


def describe() -> str:
    """One line for logs and benchmarks: the attention path this process runs."""
    lib = library()
    if lib is None:
        return f"gather + SDPA ({unavailable_reason()})"
    tiles = "AVX-512 tiles" if lib.minipaged_features() & 1 else "portable C++ tiles"
    return f"in place: compiled CPU kernel (kernels/cpu_paged_attention.cpp; {tiles})"


def usable(key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """True when the kernel can read these caches: on the CPU, fp32 or bf16, contiguous, and it compiled."""
    return (
        key_cache.device.type == "cpu"
        and key_cache.dtype in CACHE_DTYPES
        and value_cache.dtype == key_cache.dtype
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
        and library() is not None
    )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_q_len: int | None = None,
    num_rows: int | None = None,
) -> torch.Tensor:
    """``reference.paged_prefill_attention``'s result (a decode is a prefill of one row), unchecked.

    The caller has checked the arguments (``validation.check_paged_prefill``) and ``usable``.
    Sequences with more than ``max_q_len`` query rows are skipped: their output rows are left
    unwritten, for the caller to fill (``torch_backend`` gives long prefills to SDPA). A fp32 or bf16
    query is read as it is and the output has its dtype (computed in fp32, rounded once); any other
    dtype goes through fp32. ``num_rows``: the step's rows when ``query`` has padding rows after them (a GEMM
    padded to its row bucket); those rows of the output are zeros.
    """
    lib = library()
    assert lib is not None and usable(key_cache, value_cache), "call usable() first"
    q = query.contiguous() if query.dtype in CACHE_DTYPES else query.contiguous().float()
    out = torch.empty_like(q)
    tables = block_tables.to(torch.int32).contiguous()
    cu = cu_seqlens_q.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    lib.minipaged_paged_attention(
        q.data_ptr(),
        out.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        tables.data_ptr(),
        tables.shape[1] if tables.dim() == 2 else 0,
        cu.data_ptr(),
        lens.data_ptr(),
        lens.shape[0],
        q.shape[1],
        num_kv_heads,
        head_dim,
        key_cache.shape[1],
        float(scale),
        q.shape[0] if max_q_len is None else max_q_len,
        CACHE_DTYPES[key_cache.dtype],
        CACHE_DTYPES[q.dtype],
    )
    if num_rows is not None and num_rows < out.shape[0]:
        out[num_rows:].zero_()
    return out if out.dtype == query.dtype else out.to(query.dtype)


def fits_layer_ops(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """True when ``rms_norm`` / ``rope_and_cache`` can take these tensors: CPU, fp32 or bf16, one dtype, no
    autograd, and the library built. Anywhere else the model runs its PyTorch ops (which compute the same)."""
    return (
        x.device.type == "cpu"
        and x.dtype in CACHE_DTYPES
        and all(o.dtype == x.dtype and o.device.type == "cpu" for o in others)
        and not torch.is_grad_enabled()
        and library() is not None
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm``'s result in one pass (fp32 inside, rounded as PyTorch's ops round): x [rows, dim], its rows
    evenly spaced (a slice of a wider tensor is fine); weight [dim]. The caller has checked ``fits_layer_ops``."""
    lib = library()
    assert lib is not None and x.dim() == 2 and x.stride(1) == 1 and weight.is_contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    lib.minipaged_rms_norm(
        x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps, CACHE_DTYPES[x.dtype]
    )
    return out


def rope_and_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    num_q_heads: int,
) -> torch.Tensor:
    """RoPE on q and k and the K/V write, in one pass: the rotated queries [num_tokens, num_q_heads, head_dim].

    ``qkv`` is the fused projection's output, ``[num_tokens, (num_q_heads + 2 · num_kv_heads) · head_dim]`` (q,
    then k, then v); each token's rotated k and its v go to its slot of the caches (``slots`` int64, one per
    token, -1: write nothing). ``cos``/``sin`` ``[num_tokens, head_dim]``. The caller has checked
    ``fits_layer_ops`` and ``usable``, and the slots (``validation.check_reshape_and_cache``). ``qkv`` may have
    padding rows after the step's tokens (one per slot): their queries come back as zeros."""
    lib = library()
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    n = slots.shape[0]
    assert lib is not None and qkv.stride(1) == 1 and qkv.shape[1] == (num_q_heads + 2 * num_kv_heads) * head_dim
    assert cos.is_contiguous() and sin.is_contiguous() and slots.dtype == torch.int64 and slots.is_contiguous()
    assert cos.shape == (n, head_dim) == sin.shape and qkv.shape[0] >= n
    q = torch.empty(qkv.shape[0], num_q_heads, head_dim, dtype=qkv.dtype)
    if n < q.shape[0]:
        q[n:].zero_()
    lib.minipaged_rope_and_cache(
        qkv.data_ptr(),
        qkv.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        q.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        slots.data_ptr(),
        n,
        num_q_heads,
        num_kv_heads,
        head_dim,
        CACHE_DTYPES[qkv.dtype],
    )
    return q


class BoundStep:
    """One step's compiled calls with every argument that stays the same across its layers bound once.

    A step calls the layer ops thirty times each, between matrix products that stream megabytes of weights
    through the caches, and each Python-level wrapper call then runs cache-cold: measured on a 2-core Xeon,
    ``rms_norm`` took 59 µs right after a GEMM, its bare library call 12 µs. So ``model.step_program`` binds
    the step here (its index tensors' addresses, the output buffers, the shapes) and each layer passes only
    what changes: its cache and the tensor just computed. The outputs are buffers reused by every layer
    (``h``, ``q``, ``attn``: each is read by the next GEMM before the next layer writes it); rows past
    ``num_rows`` (padding up to the GEMMs' row bucket) stay zero. The caller has checked what the wrappers
    above check: ``fits_layer_ops``, ``usable``, the index tensors against the cache, and that every sequence
    has at most ``max_q_len`` rows (the kernel attends them all).
    """

    def __init__(
        self,
        rows: int,
        hidden: int,
        dtype: torch.dtype,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        in_place: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        scale: float,
    ) -> None:
        lib = library()
        assert lib is not None and dtype in CACHE_DTYPES and slots.dtype == torch.int64 and slots.is_contiguous()
        self.lib, self.code, self.num_rows = lib, CACHE_DTYPES[dtype], slots.shape[0]
        self.h = torch.empty(rows, hidden, dtype=dtype)
        self.q = torch.zeros(rows, num_q_heads, head_dim, dtype=dtype)
        self.attn = torch.zeros(rows, num_q_heads * head_dim, dtype=dtype)
        self.keep = (cos, sin, slots, *in_place)  # the addresses below point into these
        tables, cu, lens = in_place
        self.hidden, self.heads = hidden, (num_q_heads, num_kv_heads, head_dim)
        self.rope_args = (cos.data_ptr(), sin.data_ptr(), self.q.data_ptr())
        self.slots = slots.data_ptr()
        self.attn_args = (
            tables.data_ptr(),
            tables.shape[1] if tables.dim() == 2 else 0,
            cu.data_ptr(),
            lens.data_ptr(),
            lens.shape[0],
            num_q_heads,
            num_kv_heads,
            head_dim,
            block_size,
            float(scale),
            self.num_rows,
            self.code,
            self.code,
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``rms_norm(x)`` into ``h`` (x: [rows, hidden], contiguous)."""
        self.lib.minipaged_rms_norm(
            x.data_ptr(), self.hidden, weight.data_ptr(), self.h.data_ptr(), x.shape[0], self.hidden, eps, self.code
        )
        return self.h

    def rope_write_attend(self, qkv: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> torch.Tensor:
        """``rope_and_cache`` then ``paged_attention`` for one layer: its attention output, ``attn``."""
        cos, sin, q = self.rope_args
        kc, vc = key_cache.data_ptr(), value_cache.data_ptr()
        self.lib.minipaged_rope_and_cache(
            qkv.data_ptr(), qkv.stride(0), cos, sin, q, kc, vc, self.slots, self.num_rows, *self.heads, self.code
        )
        self.lib.minipaged_paged_attention(q, self.attn.data_ptr(), kc, vc, *self.attn_args)
        return self.attn
