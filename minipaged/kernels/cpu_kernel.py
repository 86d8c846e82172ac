"""The engine's CPU attention: ``cpu_paged_attention.cpp``, compiled on first use, read the cache in place.
(The same library holds the layer ops around it and, in AVX2 and AVX-512 builds, the decode products:
``decode_product``, ``decode_glu``.)

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
(``-march=native``: AVX-512 where there is one; ``-mcpu=native`` on Arm, where Apple's clang refuses
``-march=native``), and keeps the library in ``~/.cache/minipaged/kernels`` keyed by the source, the
compiler, the target and the CPU. ``MINIPAGED_CPU_ARCH`` picks another target: ``x86-64-v4`` (AVX-512),
``x86-64-v3`` (AVX2), ``x86-64`` (no SIMD past SSE2), ``armv8-a`` on Arm; each is its own
library, so the tests load every one this CPU can run beside the native one (``build(target)``). Its OpenMP
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
import platform
import shutil
import subprocess
import tempfile
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch

from ..profiling import profiling, span

SOURCE = Path(__file__).with_name("cpu_paged_attention.cpp")
# No -ffast-math: in a shared library GCC 12 links crtfastmath, which flushes denormals for the whole process.
# -ffp-contract=off: a*b + c stays two roundings, as in PyTorch's elementwise ops (the layer ops must round
# where PyTorch rounds); attention asks for its fused multiply-adds by name (std::fma).
# The target (-march / -mcpu) is not here: ``target_flags`` adds it.
FLAGS = [
    "-O3",
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

_state: dict[str, object] = {}  # the engine's library: "lib": ctypes.CDLL | None, "reason": why not
_builds: dict[str, tuple[ctypes.CDLL | None, str]] = {}  # build(target)'s, one per target

ARCH_ENV = "MINIPAGED_CPU_ARCH"
# x86-64 micro-architecture levels (the psABI's; v2, SSE4.2, adds nothing the kernel's loops use), each with what it
# asks of the CPU in /proc/cpuinfo's names (pni: SSE3, abm: LZCNT). Code built for a level the CPU lacks dies of
# SIGILL, so a build checks first.
_SSE4 = ("cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3")
_AVX2 = (*_SSE4, "abm", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave")
X86_LEVELS: dict[str, tuple[str, ...]] = {
    "x86-64": (),
    "x86-64-v3": _AVX2,
    "x86-64-v4": (*_AVX2, "avx512bw", "avx512cd", "avx512dq", "avx512f", "avx512vl"),
}
ARM_LEVELS = ("armv8-a",)  # every AArch64 CPU: NEON, nothing newer


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


def _machine() -> str:
    """``x86_64``, ``aarch64`` (``arm64`` on a Mac counts as it) or whatever else ``uname`` says."""
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def _cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where there is none to read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.split(":")[0].strip() in ("flags", "Features"):
            return set(line.split(":", 1)[1].split())
    return set()


def targets() -> list[str]:
    """The targets this machine can build for: ``native`` first, then its architecture's generic levels."""
    levels = {"x86_64": list(X86_LEVELS)[::-1], "aarch64": list(ARM_LEVELS)}
    return ["native", *levels.get(_machine(), [])]


def target_flags(target: str) -> tuple[list[str] | None, str]:
    """The compiler flags that pick ``target`` (``native`` or a level of ``targets()``), or None and why this
    machine cannot build it or run what it builds (another architecture's level; a CPU without its features)."""
    machine = _machine()
    if target == "native":  # Apple's clang refuses -march=native on Arm; -mcpu=native is gcc's and clang's
        return {"x86_64": ["-march=native"], "aarch64": ["-mcpu=native"]}.get(machine, []), ""
    if target in X86_LEVELS or target in ARM_LEVELS:
        family = "x86_64" if target in X86_LEVELS else "aarch64"
        if machine != family:
            return None, f"{target} is an {family} target and this machine is {machine}"
        missing = _missing_features(target)
        if missing:
            return None, f"this CPU lacks {missing}, which {target} code uses"
        return [f"-march={target}"], ""
    return None, f"unknown CPU target {target!r} (native or one of {', '.join([*X86_LEVELS, *ARM_LEVELS])})"


def _missing_features(target: str) -> str:
    """What this CPU lacks of what the x86-64 level ``target`` uses ("" for none, and for Arm's levels)."""
    needs = X86_LEVELS.get(target, ())
    flags = _cpu_flags()
    if flags or not needs:
        return " ".join(f for f in needs if f not in flags)
    # No /proc/cpuinfo (an Intel Mac): PyTorch's own detection, which tells AVX-512 and AVX2 from neither.
    capability = torch.backends.cpu.get_cpu_capability()
    reached = {"AVX512": 4, "AVX2": 3}.get(capability, 1)
    return "" if int(target[-1]) <= reached else f"{target} (PyTorch finds {capability})"


def engine_target() -> str:
    """The target the engine's library is built for: ``$MINIPAGED_CPU_ARCH``, else ``native``."""
    return os.environ.get(ARCH_ENV) or "native"


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
    return "\n".join(dict.fromkeys(keep))


def _build(target: str | None = None) -> tuple[ctypes.CDLL | None, str]:
    """Build (or find in the cache) and load the library for ``target`` (None: ``engine_target()``)."""
    if os.environ.get("MINIPAGED_CPU_KERNEL", "1") == "0":
        return None, "MINIPAGED_CPU_KERNEL=0"
    from_env = target is None
    target = engine_target() if target is None else target
    arch, why_not = target_flags(target)
    if arch is None:
        return None, f"{ARCH_ENV}={target}: {why_not}" if from_env else why_not
    compiler, note = _compiler()
    if note:
        log.warning("minipaged: %s", note)
    if compiler is None:
        return None, note or "no C++ compiler found (g++, c++, clang++ or $CXX)"
    version = _version(compiler)
    if version is None:
        return None, f"{compiler} --version could not run or did not return within {VERSION_TIMEOUT_S:g} s"
    lib_path = library_path(version, target)
    for attempt in range(2):
        if not lib_path.is_file():
            reason = _compile(compiler, lib_path, arch)
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
        "minipaged_pack_panels": [ptr, ptr, i64, i64, ctypes.c_int],
        "minipaged_decode_product": [ptr, i64, ptr, i64, i64, ptr, i64, ptr, i64, i64, ctypes.c_int],
        "minipaged_decode_glu": [ptr, i64, ptr, ptr, i64, i64, ptr, i64, i64, ctypes.c_int],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = None, argtypes
    lib.minipaged_features.restype = ctypes.c_int
    return lib, ""


def library_path(compiler_version: str, target: str = "native") -> Path:
    """Where the library built by this compiler, from this source, for this target (and CPU: native) is kept."""
    from ..model_loader import cache_dir

    arch = target_flags(target)[0] or []
    cpu = _cpu_signature() if target == "native" else ""  # a named level is the same code on every CPU
    parts = [SOURCE.read_text(), compiler_version, *FLAGS, *arch, cpu]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    return cache_dir() / "kernels" / f"cpu_paged_attention-{target}-{key[:16]}.so"


def _compile(compiler: str, lib_path: Path, arch: list[str]) -> str:
    """Build the library at ``lib_path``; "" on success, else why not (one line)."""
    lib_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib_path.parent)  # other processes may build it too
    os.close(fd)
    try:
        try:
            proc = subprocess.run(
                [compiler, *FLAGS, *arch, str(SOURCE), "-o", tmp],
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


def build(target: str) -> tuple[ctypes.CDLL | None, str]:
    """The library for ``target`` (see ``targets()``) and "", or None and why not; built once per process, not
    logged and not the engine's (``library()`` is). The tests load each build beside the native one with it:
    a separate file and a separate handle, whose calls the wrappers below make once it is put in ``_state``."""
    if target not in _builds:
        try:
            _builds[target] = _build(target)
        except (OSError, subprocess.SubprocessError) as e:
            _builds[target] = None, f"could not build or load {SOURCE.name} for {target}: {e}"
    return _builds[target]


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
    return f"in place: compiled CPU kernel (kernels/cpu_paged_attention.cpp; {tiles(lib)})"


def tiles(lib: ctypes.CDLL) -> str:
    """Which of the source's paths a build runs, from what it was compiled with (``minipaged_features``)."""
    features = lib.minipaged_features()
    if features & 1:
        return "AVX-512 tiles"
    simd = "AVX2" if features & 2 else "NEON" if features & 4 else "the baseline ISA (SSE2 on x86-64)"
    return f"portable C++ tiles, compiled for {simd}"


PANEL = 32  # output columns per packed panel of the decode products (kPanel in the source)
# minipaged_features' bit for each dtype's decode products: fp32 with AVX-512, or AVX2 and FMA; bf16 in the same
# builds except where there is AMX (oneDNN's AMX kernels multiply bf16 there)
_PRODUCT_BITS = {torch.float32: 8, torch.bfloat16: 16}


def decode_products(lib: ctypes.CDLL | None, dtype: torch.dtype = torch.float32) -> bool:
    """True when this build has the decode-sized products in ``dtype`` (``minipaged_features``' bit for it)."""
    bit = _PRODUCT_BITS.get(dtype, 0)
    return lib is not None and bool(lib.minipaged_features() & bit)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] (fp32 or bf16, N a multiple of ``PANEL``, K even in bf16) re-laid-out for the decode
    products: N / 32 panels of K x 32 elements (the source's diagram), in a tensor of the weight's shape. The
    caller has checked ``decode_products`` for the dtype."""
    lib = library()
    w = weight.detach().contiguous()
    assert lib is not None and w.dtype in _PRODUCT_BITS and w.dim() == 2 and w.shape[0] % PANEL == 0
    assert w.dtype != torch.bfloat16 or w.shape[1] % 2 == 0
    out = torch.empty_like(w)
    lib.minipaged_pack_panels(w.data_ptr(), out.data_ptr(), w.shape[0], w.shape[1], CACHE_DTYPES[w.dtype])
    return out


def decode_product(
    a: torch.Tensor,
    panels: torch.Tensor,
    out: torch.Tensor,
    residual: torch.Tensor | None = None,
    rows: int | None = None,
) -> torch.Tensor:
    """``out = a @ W^T`` (``+ residual``, which may be ``out`` itself) over the first ``rows`` rows (all of
    ``a``'s by default), W packed into ``panels`` by ``pack_panels``. Every tensor of the panels' dtype, on the CPU,
    2-D, its rows contiguous; the caller has checked ``decode_products``. Returns ``out``."""
    lib = library()
    n, k = panels.shape
    m = a.shape[0] if rows is None else rows
    assert lib is not None and a.shape[1] == k and a.stride(1) == 1 and out.shape[1] == n and out.stride(1) == 1
    assert out.shape[0] >= m and (residual is None or (residual.shape[0] >= m and residual.shape[1] == n))
    assert a.dtype == out.dtype == panels.dtype and (residual is None or residual.dtype == a.dtype)
    add, add_stride = (residual.data_ptr(), residual.stride(0)) if residual is not None else (None, 0)
    with _product_span():
        lib.minipaged_decode_product(
            a.data_ptr(), a.stride(0), panels.data_ptr(), n, k, out.data_ptr(), out.stride(0), add, add_stride, m,
            CACHE_DTYPES[a.dtype],
        )  # fmt: skip
    return out


def _product_span() -> AbstractContextManager:
    """Under a profiler, a span named as a product (``decode_linear``: a ctypes call is invisible to the profiler,
    and ``bench_engine.py`` counts names with "linear" as matrix products); else nothing."""
    return span("decode_linear") if profiling() else nullcontext()


def decode_glu(
    a: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor, rows: int | None = None
) -> torch.Tensor:
    """``out = silu(a @ Wgate^T) * (a @ Wup^T)`` over the first ``rows`` rows, both weights packed by
    ``pack_panels``; as ``decode_product`` otherwise. Returns ``out``."""
    lib = library()
    n, k = gate.shape
    m = a.shape[0] if rows is None else rows
    assert lib is not None and up.shape == gate.shape and a.shape[1] == k and a.stride(1) == 1
    assert out.shape[0] >= m and out.shape[1] == n and out.stride(1) == 1
    assert a.dtype == out.dtype == gate.dtype == up.dtype
    with _product_span():
        lib.minipaged_decode_glu(
            a.data_ptr(), a.stride(0), gate.data_ptr(), up.data_ptr(), n, k, out.data_ptr(), out.stride(0), m,
            CACHE_DTYPES[a.dtype],
        )  # fmt: skip
    return out


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
