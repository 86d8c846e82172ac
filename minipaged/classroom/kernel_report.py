"""Compile every Triton kernel for an NVIDIA GPU on a machine without one, and read the result.

The interpreter runs a kernel's *semantics* on a CPU; it says nothing about what a GPU
will make of it. Triton's compiler does not need a GPU to build a kernel, only a
target: ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` runs the
bundled ``ptxas`` and returns a cubin, and the bundled ``cuobjdump
--dump-resource-usage`` reads what a GPU would have to give each thread::

    REG     registers per thread (at most 255; past that values spill)
    STACK   bytes per thread spilled to local memory (slow, off-chip): must be 0
    shared  bytes of shared memory per program (Triton's pipelining buffers)

From those and ``num_warps`` the CUDA occupancy rules give how many warps an SM can
keep resident, which is what hides memory latency in a bandwidth-bound kernel::

    warps by registers = 65536 // (ceil(REG·32 / 256)·256)     rounded down to whole programs
    programs by shared = shared memory per SM // (shared + 1 KiB reserved)
    resident warps     = min(by registers, by shared, 64 warps, 32 programs) · num_warps

**Exactly what the wrapper launches.** Each configuration is built by the wrapper's own
planner (``plan_paged_decode``, ``plan_paged_prefill``, ``plan_reshape_and_cache``) on
example tensors in the engine's layouts, and specialised by Triton's own binder the way
a launch would be (pointer alignment, integers divisible by 16): the same constexprs,
warps and stages the wrapper would use. Compiling without that specialisation reports
worse code than a launch ever runs (unaligned, scalar loads). Triton's binder is private API
(``create_function_from_signature``, ``JITFunction._pack_args``); where a release drops it,
:func:`specialize_by_hand` applies the same rules to the launch's arguments (tests hold the two
equal on the planners' launches over a matrix of shapes, and decode's cubins byte for byte).

Compiling needs ``TRITON_INTERPRET=0`` before triton is imported, so the work runs in
fresh worker processes; the caller may have the interpreter on.

    python -m minipaged kernels --arch sm_75,sm_80,sm_90 [--json]

sm_75 (T4) is in the table for what it is: a GPU where Triton compiles ``tl.dot`` without tensor cores (FMA
instructions, in every dtype; each such row carries a note) and bfloat16 is emulated, which is why
``dtype="auto"`` serves float16 there (``config.cuda_computes_bf16``).
"""

from __future__ import annotations

import inspect
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..gpus import ARCHS as GPU_ARCHS
from ..gpus import Arch
from ..utils import cdiv

DTYPES = ("float16", "bfloat16", "float32")
HEAD_DIMS = (64, 128)
ARCHS = ("sm_80", "sm_90")
KERNELS = ("reshape_and_cache", "paged_decode", "paged_prefill")
DEFAULT_GROUP = 4  # GQA group of Llama-3-8B / -70B: 4 query heads per KV head
SMOLLM2 = dict(head_dim=64, group=3, num_kv_heads=3)  # 9 query heads over 3 KV heads

# Per-SM limits of the CUDA occupancy rules, by architecture: the package's table of GPUs holds them (sm_75, the
# T4's Turing: half the warps and programs, 64 KiB of shared memory, none of it reserved by the runtime).
ARCH_LIMITS: dict[str, Arch] = GPU_ARCHS
REG_ALLOC_UNIT = 256  # registers are given to a warp in chunks of 256
# A kernel with a tl.dot (tt.dot in its Triton IR) whose PTX has no mma / wgmma multiplies without tensor cores:
# what Triton does for fp32 products in full precision ("ieee") everywhere, and for every dtype on sm_75.
_TENSOR_CORE_PTX = re.compile(r"\b(?:w?gmma|mma)\.")
NO_TENSOR_CORES = (
    "no tensor cores: tl.dot compiled to FMA instructions (Triton's way for fp32 'ieee' products, and for every "
    "dtype below sm_80)"
)
TOOL_TIMEOUT_S = 60.0  # one cuobjdump call
WORKER_TIMEOUT_S = 1800.0  # one compile worker, its whole share of the configurations (about 3 min on 2 cores)


@dataclass(frozen=True)
class Config:
    """One point of the matrix: a kernel family on one shape, dtype and GPU."""

    kernel: str  # "reshape_and_cache" | "paged_decode" | "paged_prefill"
    dtype: str  # torch name: "float16", "bfloat16", "float32"
    head_dim: int
    block_size: int
    group: int  # query heads per KV head
    num_kv_heads: int
    arch: str  # "sm_80", "sm_90"
    addressing: str = "block"  # "block": one table lookup per block (the kernels'); "token": the first version's
    tile_n: int | None = None  # a key tile other than the kernel's table gives (experiments)


@dataclass
class Row:
    """One compiled kernel (a family may launch several: decode, its split variant and the reduce)."""

    kernel: str
    dtype: str
    head_dim: int
    block_size: int
    group: int
    arch: str
    addressing: str = "block"
    tiles: str = ""
    num_warps: int = 0
    num_stages: int = 0
    registers: int | None = None
    spill_bytes: int | None = None
    shared_bytes: int | None = None
    occupancy: int | None = None  # resident warps per SM
    occupancy_pct: float | None = None
    error: str | None = None
    note: str | None = None  # what the numbers do not say: e.g. no tensor cores on this GPU

    def as_json(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("error", "note"):
            if d[key] is None:
                d.pop(key)
        return d


def occupancy(arch: str, registers: int, shared_bytes: int, num_warps: int) -> int:
    """Resident warps per SM for a kernel with these resources (the CUDA occupancy calculator's rules)."""
    lim = ARCH_LIMITS[arch]
    regs_per_warp = cdiv(max(registers, 1) * 32, REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    by_regs = (lim.registers // regs_per_warp) // num_warps
    unit = lim.shared_alloc_unit
    shared = cdiv(shared_bytes + lim.shared_reserved, unit) * unit
    by_shared = lim.shared_per_sm // shared if shared else lim.max_programs  # sm_75 reserves none
    by_warps = lim.max_warps // num_warps
    return min(by_regs, by_shared, by_warps, lim.max_programs) * num_warps


def default_configs(
    archs: Sequence[str] = ARCHS,
    block_sizes: Sequence[int] = (16,),
    groups: Sequence[int] = (DEFAULT_GROUP,),
    dtypes: Sequence[str] = DTYPES,
    head_dims: Sequence[int] = HEAD_DIMS,
    kernels: Sequence[str] = KERNELS,
    addressing: str = "block",
    tile_n: int | None = None,
) -> list[Config]:
    """The matrix: kernels × dtypes × head_dims × block sizes × groups × archs (2 KV heads), plus
    SmolLM2's own shape (head_dim 64, 3 query heads on each of 3 KV heads) at every block size."""
    if addressing not in ("block", "token"):
        raise ValueError(f"addressing must be 'block' or 'token', got {addressing!r}")
    for k in kernels:
        if k not in KERNELS:
            raise ValueError(f"unknown kernel {k!r}; choose from {', '.join(KERNELS)}")
    for dt in dtypes:
        if dt not in DTYPES:
            raise ValueError(f"unknown dtype {dt!r}; choose from {', '.join(DTYPES)}")
    for a in archs:
        if a not in ARCH_LIMITS:
            raise ValueError(f"unknown arch {a!r}; choose from {', '.join(ARCH_LIMITS)}")
    out = [
        Config(k, dt, hd, bs, g, 2, a, addressing, tile_n)
        for k, dt, hd, bs, g, a in itertools.product(kernels, dtypes, head_dims, block_sizes, groups, archs)
    ]
    out += [
        Config(k, dt, SMOLLM2["head_dim"], bs, SMOLLM2["group"], SMOLLM2["num_kv_heads"], a, addressing, tile_n)
        for k, dt, bs, a in itertools.product(kernels, dtypes, block_sizes, archs)
    ]
    return list(dict.fromkeys(out))  # without repeats, in order


# ---- what runs in a worker (TRITON_INTERPRET=0) -----------------------------------------------------


def example_launches(cfg: Config) -> list[tuple[str, Any]]:
    """(name, Launch) for every kernel the wrapper would launch for ``cfg``, from its own planner.

    The tensors are empty CPU tensors in the engine's layouts (only shapes, dtypes, strides and
    alignment matter to the compiler). Decode is planned twice, with one segment (writes the
    output) and with several (writes fp32 partials, then the reduce kernel); prefill once per
    query-tile height its planner can pick.
    """
    import torch

    from ..kernels.cache_write import plan_reshape_and_cache
    from ..kernels.paged_decode import plan_paged_decode
    from ..kernels.paged_prefill import PREFILL_TABLE, plan_paged_prefill, prefill_config

    dtype = getattr(torch, cfg.dtype)
    kvh, hd, bs = cfg.num_kv_heads, cfg.head_dim, cfg.block_size
    per_token = cfg.addressing == "token"
    num_q_heads = kvh * cfg.group
    num_blocks, num_seqs, max_blocks = 64, 4, 16
    key_cache = torch.empty(num_blocks, bs, kvh, hd, dtype=dtype)
    value_cache = torch.empty_like(key_cache)
    tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
    seq_lens = torch.ones(num_seqs, dtype=torch.int32)
    scale = hd**-0.5
    if cfg.kernel == "reshape_and_cache":
        k = torch.empty(num_seqs, kvh, hd, dtype=dtype)
        return [
            ("reshape_and_cache", launch)
            for launch in plan_reshape_and_cache(
                k, torch.empty_like(k), key_cache, value_cache, torch.zeros(num_seqs, dtype=torch.int64)
            )
        ]
    if cfg.kernel == "paged_decode":
        q = torch.empty(num_seqs, num_q_heads, hd, dtype=dtype)
        one = plan_paged_decode(
            q,
            key_cache,
            value_cache,
            tables,
            seq_lens,
            scale,
            torch.empty_like(q),
            num_splits=1,
            per_token=per_token,
            tile_n=cfg.tile_n,
            arch=cfg.arch,
        )
        split = plan_paged_decode(
            q,
            key_cache,
            value_cache,
            tables,
            seq_lens,
            scale,
            torch.empty_like(q),
            num_splits=4,
            per_token=per_token,
            tile_n=cfg.tile_n,
            arch=cfg.arch,
        )
        return [("paged_decode", one[0]), ("paged_decode_split", split[0]), ("reduce_segments", split[1])]
    if cfg.kernel == "paged_prefill":
        largest = PREFILL_TABLE[(dtype != torch.float32, max(64, hd))].block_m
        out, seen = [], set()
        for q_len in (16, 32, 64, 128):
            if q_len > largest or prefill_config(dtype, hd, bs, q_len).block_m in seen:
                continue
            seen.add(prefill_config(dtype, hd, bs, q_len).block_m)
            q = torch.empty(num_seqs * q_len, num_q_heads, hd, dtype=dtype)
            cu = torch.arange(0, num_seqs + 1, dtype=torch.int32) * q_len
            out += [
                ("paged_prefill", launch)
                for launch in plan_paged_prefill(
                    q,
                    key_cache,
                    value_cache,
                    tables,
                    cu,
                    seq_lens,
                    scale,
                    torch.empty_like(q),
                    q_len,
                    per_token=per_token,
                    tile_n=cfg.tile_n,
                )
            ]
        return out
    raise ValueError(f"unknown kernel {cfg.kernel!r}; choose from {', '.join(KERNELS)}")


def _tiles(launch: Any) -> str:
    keys = ("BLOCK_M", "TILE_N", "GROUP_P2", "HEAD_DIM_P2", "HEADS_P2", "NUM_SEGMENTS_P2")
    return " ".join(f"{k}={launch.constexprs[k]}" for k in keys if k in launch.constexprs)


def _tool(name: str) -> Path:
    """Where ``name`` (ptxas, cuobjdump) is: ``TRITON_<NAME>_PATH``, else the triton wheel's copy, else ``PATH``.

    The same order Triton itself looks for ptxas in (its variable, then its bundled binary), and the
    system's CUDA toolkit last, for a triton build that ships no NVIDIA tools. When nothing is found,
    the wheel's path, so the error names where the tool was expected."""
    import triton

    override = os.environ.get(f"TRITON_{name.upper().replace('-', '_')}_PATH")
    if override and Path(override).is_file():
        return Path(override)
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if bundled.exists():
        return bundled
    found = shutil.which(name)
    return Path(found) if found else bundled


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG, STACK, SHARED, LOCAL of the one kernel in a cubin, read by cuobjdump."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        cmd = [str(_tool("cuobjdump")), "--dump-resource-usage", str(path)]
        try:
            text = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=TOOL_TIMEOUT_S).stdout
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"cuobjdump did not return within {TOOL_TIMEOUT_S:g} s") from None
    usage = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text))
    if "REG" not in usage:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{text}")
    return {k: int(v) for k, v in usage.items()}


# torch dtype name -> Triton's type name for a pointer to it (as Triton's own binder writes them).
_POINTER_TYPES = {
    "float16": "fp16",
    "bfloat16": "bf16",
    "float32": "fp32",
    "float64": "fp64",
    "int8": "i8",
    "int16": "i16",
    "int32": "i32",
    "int64": "i64",
    "uint8": "u8",
    "uint16": "u16",
    "uint32": "u32",
    "uint64": "u64",
    "bool": "u1",
    "float8_e4m3fn": "fp8e4nv",
    "float8_e5m2": "fp8e5",
    "float8_e4m3fnuz": "fp8e4b8",
    "float8_e5m2fnuz": "fp8e5b16",
}
_DIVISIBILITY = 16  # Triton marks an integer or a pointer divisible by 16 so loads can be vectorised


def _param_names(kernel: Any) -> list[str]:
    """The kernel's parameter names, in order, from the Python function it wraps."""
    fn = getattr(kernel, "fn", None)
    if fn is not None:
        return list(inspect.signature(fn).parameters)
    return list(kernel.arg_names)


def _names(items: Iterable[str | int], names: Sequence[str]) -> set[str]:
    """``do_not_specialize`` lists names or positions: as names."""
    return {names[i] if isinstance(i, int) else i for i in items}


def _specialize(value: Any, specialize: bool, align: bool) -> tuple[str, str | None]:
    """(Triton type, specialisation key) of one runtime argument, by Triton's rules: "D" divisible by 16,
    "" not, None not specialised at all; an integer 1 becomes a constexpr unless told otherwise."""
    if isinstance(value, bool):  # before int: a bool is an int to Python
        return "u1", None
    if isinstance(value, int):
        if -(2**31) <= value < 2**31:
            ty = "i32"
        elif 2**63 <= value < 2**64:
            ty = "u64"
        else:
            ty = "i64"
        if not specialize:
            return ty, None
        if value == 1:
            return "constexpr", ""
        return ty, "D" if align and value % _DIVISIBILITY == 0 else ""
    if isinstance(value, float):
        return "fp32", None
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):  # a tensor, or anything that passes for one
        dtype = str(value.dtype).removeprefix("torch.")
        if dtype not in _POINTER_TYPES:
            raise TypeError(f"no Triton pointer type for a {dtype} tensor")
        ty = "*" + _POINTER_TYPES[dtype]
        if not specialize:
            return ty, None
        return ty, "D" if align and value.data_ptr() % _DIVISIBILITY == 0 else ""
    raise TypeError(f"cannot bind a {type(value).__name__} argument by hand")


def _is_constexpr_annotation(annotation: Any) -> bool:
    import triton.language as tl

    return annotation is tl.constexpr or (isinstance(annotation, str) and "constexpr" in annotation)


def specialize_by_hand(
    kernel: Any, launch: Any, backend: Any
) -> tuple[Any, dict[str, str], dict[tuple[int, ...], Any], dict[tuple[int, ...], Any]]:
    """(options, signature, constexprs, attrs) for ``ASTSource``, built from the launch's own arguments.

    The fallback for :func:`specialize_with_triton`, which calls Triton's private binder: the same
    rules, written out. Positional ``launch.args`` are runtime arguments (tensor -> ``*fp16`` ..., int ->
    ``i32``/``i64``, float -> ``fp32``), ``launch.constexprs`` are the constexprs, and Triton's
    specialisation is applied as a launch would: 16-byte aligned pointers and integers divisible by
    16 are marked so, an integer 1 becomes a constexpr, both unless the kernel's ``do_not_specialize``
    (or ``..._on_alignment``) names the parameter. Only ``backend.parse_options``, public, is Triton's.
    """
    names = _param_names(kernel)
    if len(launch.args) > len(names):
        raise TypeError(f"{len(launch.args)} arguments for a kernel of {len(names)} parameters")
    runtime_names = names[: len(launch.args)]
    unknown = [k for k in launch.constexprs if k not in names or k in runtime_names]
    if unknown:
        raise KeyError(f"keyword argument(s) {unknown} are not constexpr parameters of the kernel")
    no_spec = _names(getattr(kernel, "do_not_specialize", None) or (), names)
    no_align = _names(getattr(kernel, "do_not_specialize_on_alignment", None) or (), names)
    fn = getattr(kernel, "fn", None)
    params = inspect.signature(fn).parameters if fn is not None else {}
    signature: dict[str, str] = {}
    constexprs: dict[tuple[int, ...], Any] = {}
    attrs: dict[tuple[int, ...], Any] = {}
    for i, name in enumerate(names):
        if i < len(launch.args):
            value, is_constexpr = launch.args[i], False
        elif name in launch.constexprs:
            value, is_constexpr = launch.constexprs[name], True
        elif name in params and params[name].default is not inspect.Parameter.empty:
            value, is_constexpr = params[name].default, _is_constexpr_annotation(params[name].annotation)
        else:
            raise TypeError(f"missing argument {name!r}")
        key: str | None = ""
        if is_constexpr or value is None:  # Triton folds a None argument into the code, as a constexpr
            ty = "constexpr"
        else:
            ty, key = _specialize(value, name not in no_spec, name not in no_align)
        signature[name] = ty
        if ty == "constexpr":
            constexprs[(i,)] = value
        if key is not None:
            attrs[(i,)] = [["tt.divisibility", _DIVISIBILITY]] if key == "D" else []
    kwargs = dict(launch.constexprs, num_warps=launch.num_warps, num_stages=launch.num_stages)
    return backend.parse_options(kwargs), signature, constexprs, attrs


def specialize_with_triton(
    kernel: Any, launch: Any, backend: Any
) -> tuple[Any, dict[str, str], dict[tuple[int, ...], Any], dict[tuple[int, ...], Any]]:
    """(options, signature, constexprs, attrs) from Triton's own launcher code: exactly what a launch does.

    Private API (``create_function_from_signature``, ``JITFunction._pack_args``): Triton may change it
    in any release, so :func:`compile_launch` takes :func:`specialize_by_hand` when it is gone."""
    from triton.runtime.jit import create_function_from_signature

    kwargs = dict(launch.constexprs, num_warps=launch.num_warps, num_stages=launch.num_stages)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, opts = binder(*launch.args, **kwargs)
    return kernel._pack_args(backend, kwargs, bound, specialization, opts)


def triton_binder_available(kernel: Any) -> bool:
    """True when Triton's private binder (what :func:`specialize_with_triton` calls) is there for ``kernel``."""
    try:
        from triton.runtime.jit import create_function_from_signature  # noqa: F401
    except ImportError:
        return False
    return all(hasattr(kernel, a) for a in ("_pack_args", "signature", "params"))


def compile_launch(launch: Any, arch: str, *, binder: str = "auto") -> Any:
    """Compile one planned launch for ``arch`` ("sm_90"), specialised as Triton's launcher would.

    ``binder``: "triton" (Triton's private launcher code), "by_hand" (:func:`specialize_by_hand`), or
    "auto": Triton's when it is there, by hand when it is gone or no longer takes these arguments
    (a TypeError or AttributeError from its changed signature)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    if binder not in ("auto", "triton", "by_hand"):
        raise ValueError(f"binder must be 'auto', 'triton' or 'by_hand', got {binder!r}")
    kernel = launch.kernel
    if not isinstance(kernel, triton.JITFunction):  # the interpreter's InterpretedFunction cannot be compiled
        raise RuntimeError(
            "kernels are interpreted in this process (TRITON_INTERPRET=1): compile in a fresh "
            "process with TRITON_INTERPRET=0, as compile_report() does"
        )
    target = GPUTarget("cuda", int(arch.removeprefix("sm_")), 32)
    backend = make_backend(target)
    if binder == "triton" or (binder == "auto" and triton_binder_available(kernel)):
        try:
            options, signature, constexprs, attrs = specialize_with_triton(kernel, launch, backend)
        except (TypeError, AttributeError):
            if binder == "triton":
                raise
            options, signature, constexprs, attrs = specialize_by_hand(kernel, launch, backend)
    else:
        options, signature, constexprs, attrs = specialize_by_hand(kernel, launch, backend)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def compile_config(cfg: Config) -> list[Row]:
    """Every kernel of one configuration, compiled and measured (errors become rows with ``error``)."""
    base: dict[str, Any] = dict(
        dtype=cfg.dtype,
        head_dim=cfg.head_dim,
        block_size=cfg.block_size,
        group=cfg.group,
        arch=cfg.arch,
        addressing=cfg.addressing,
    )
    try:
        launches = example_launches(cfg)
    except Exception as e:  # a configuration the planner refuses is a finding, not a crash of the report
        return [Row(cfg.kernel, **base, error=f"{type(e).__name__}: {e}")]
    return [
        measure(
            Row(name, **base, tiles=_tiles(launch), num_warps=launch.num_warps, num_stages=launch.num_stages), launch
        )
        for name, launch in launches
    ]


def measure(row: Row, launch: Any) -> Row:
    """Compile ``launch`` for ``row.arch`` and fill in its registers, spills, shared memory and occupancy (or
    the error that stopped it: a kernel that does not compile is a finding, not a crash of the report)."""
    try:
        compiled = compile_launch(launch, row.arch)
        usage = resource_usage(compiled.asm["cubin"])
        row.registers = usage["REG"]
        if "tt.dot" in compiled.asm.get("ttir", "") and not _TENSOR_CORE_PTX.search(compiled.asm.get("ptx", "")):
            row.note = NO_TENSOR_CORES
        row.spill_bytes = usage.get("STACK", 0) + usage.get("LOCAL", 0)
        row.shared_bytes = max(int(compiled.metadata.shared), usage.get("SHARED", 0))
        limit = ARCH_LIMITS[row.arch].shared_per_program
        if row.shared_bytes > limit:
            row.error = f"needs {row.shared_bytes} B of shared memory, more than the {limit} B a program may use"
        else:
            row.occupancy = occupancy(row.arch, row.registers, row.shared_bytes, launch.num_warps)
            row.occupancy_pct = round(100 * row.occupancy / ARCH_LIMITS[row.arch].max_warps, 1)
    except Exception as e:
        row.error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    return row


# ---- a kernel given as source (the puzzle ladder's: a learner's kernel, defined in a notebook) -------------------
@dataclass(frozen=True)
class SourceJob:
    """A ``@triton.jit`` function's source and one launch's arguments, by parameter name: a tensor is given by its
    dtype (``{"tensor": "float32"}``), an int or a float by a value; which are constexprs the function says."""

    name: str  # the function's name in ``source``
    source: str
    args: dict[str, Any]
    arch: str
    dtype: str = "float32"
    head_dim: int = 0
    block_size: int = 0
    group: int = 1
    num_warps: int = 4
    num_stages: int = 3


def _jit_from_source(source: str, name: str, folder: Path) -> Any:
    """Import ``source`` as a module (Triton reads a kernel's source through ``inspect``, so it needs a file)."""
    import importlib.util

    path = folder / f"{name}.py"
    path.write_text("import triton\nimport triton.language as tl\n\n\n" + source)
    spec = importlib.util.spec_from_file_location(f"minipaged_source_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def compile_job(job: SourceJob, folder: Path) -> Row:
    """One ``SourceJob`` compiled (in a process with the interpreter off) and measured."""
    import torch

    from ..kernels.launch import Launch

    row = Row(job.name, job.dtype, job.head_dim, job.block_size, job.group, job.arch, addressing="-",
              num_warps=job.num_warps, num_stages=job.num_stages)  # fmt: skip
    try:
        kernel = _jit_from_source(job.source, job.name, folder)
        params = inspect.signature(kernel.fn).parameters
        missing = [p for p in params if p not in job.args]
        if missing:
            raise TypeError(f"no value for parameter(s) {missing}")
        runtime, constexprs = [], {}
        for p, param in params.items():
            value = job.args[p]
            if isinstance(value, dict):  # a tensor: a small one of the right dtype (alignment is what counts)
                value = torch.zeros(16, dtype=getattr(torch, value["tensor"]))
            if _is_constexpr_annotation(param.annotation):
                constexprs[p] = value
            else:
                runtime.append(value)
        launch = Launch(kernel, (1,), tuple(runtime), constexprs, job.num_warps, job.num_stages)
    except Exception as e:
        row.error = f"{type(e).__name__}: {e}"
        return row
    return measure(row, launch)


def _source_worker_main() -> None:
    """``python -m minipaged.classroom.kernel_report --source``: SourceJobs as JSON on stdin, rows as JSON lines out."""
    import warnings

    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory(prefix="minipaged-source-") as folder:
        for index, job in json.load(sys.stdin):
            row = compile_job(SourceJob(**job), Path(folder))
            print(json.dumps(dict(index=index, row=asdict(row))), flush=True)


def compile_sources(jobs: Sequence[SourceJob], *, timeout_s: float = WORKER_TIMEOUT_S) -> list[Row]:
    """Compile kernels given as source, in one fresh worker process (the caller may have the interpreter on)."""
    for j in jobs:
        if j.arch not in ARCH_LIMITS:
            raise ValueError(f"unknown arch {j.arch!r}; choose from {', '.join(ARCH_LIMITS)}")
    return _run_workers("--source", [list(enumerate(asdict(j) for j in jobs))], timeout_s) if jobs else []


def _worker_main() -> None:
    """``python -m minipaged.classroom.kernel_report --worker``: configs as JSON on stdin, rows as JSON lines out."""
    import warnings

    warnings.filterwarnings("ignore")
    for index, cfg in json.load(sys.stdin):
        for row in compile_config(Config(**cfg)):
            print(json.dumps(dict(index=index, row=asdict(row))), flush=True)


# ---- the caller's side ------------------------------------------------------------------------------


def compile_report(
    configs: Iterable[Config] | None = None, *, processes: int | None = None, timeout_s: float = WORKER_TIMEOUT_S
) -> list[Row]:
    """Compile ``configs`` (default: :func:`default_configs`) in fresh worker processes; rows in order.
    A worker still running after ``timeout_s`` is killed and the report fails, saying so.

    Workers are plain subprocesses (``python -m minipaged.classroom.kernel_report --worker``) started with
    ``TRITON_INTERPRET=0``, so this works from a notebook or a script that has the interpreter on.
    """
    configs = list(default_configs() if configs is None else configs)
    for c in configs:
        if c.arch not in ARCH_LIMITS:
            raise ValueError(f"unknown arch {c.arch!r}; choose from {', '.join(ARCH_LIMITS)}")
    if not configs:
        return []
    processes = max(1, min(len(configs), processes or os.cpu_count() or 1))
    numbered = list(enumerate(asdict(c) for c in configs))
    return _run_workers("--worker", [numbered[i::processes] for i in range(processes)], timeout_s)


def _run_workers(mode: str, chunks: list[list[tuple[int, Any]]], timeout_s: float) -> list[Row]:
    """Feed each chunk of ``(index, job)`` to its own ``python -m minipaged.classroom.kernel_report <mode>`` process;
    their rows, in index order. A worker still running after ``timeout_s`` is killed and the report fails."""
    ptxas = _tool("ptxas")
    if not ptxas.exists():
        raise RuntimeError(
            f"no ptxas: not in this triton build ({ptxas}), not on PATH, and TRITON_PTXAS_PATH is not set; "
            "install the CUDA toolkit's ptxas or a triton wheel that bundles it"
        )
    # Each worker imports triton with the interpreter off, and fuses multiply-adds as a launch would.
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    # Triton looks for ptxas in TRITON_PTXAS_PATH, then in its wheel only: hand it the one found (on PATH, say).
    if not Path(env.get("TRITON_PTXAS_PATH", "")).is_file():
        env["TRITON_PTXAS_PATH"] = str(ptxas)
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "minipaged.classroom.kernel_report", mode],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in chunks
    ]

    def run(worker: subprocess.Popen, chunk: list) -> tuple[str, str]:
        try:
            return worker.communicate(json.dumps(chunk), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            worker.kill()
            raise RuntimeError(f"a compile worker did not finish within {timeout_s:g} s") from None

    try:
        with ThreadPoolExecutor(len(workers)) as pool:  # feed and drain every worker at once
            outputs = list(pool.map(lambda wc: run(*wc), zip(workers, chunks)))
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    by_index: dict[int, list[Row]] = {}
    for w, (out, err) in zip(workers, outputs):
        if w.returncode != 0:
            raise RuntimeError(f"a compile worker failed (exit {w.returncode}):\n{err[-3000:]}")
        for line in out.splitlines():
            item = json.loads(line)
            by_index.setdefault(item["index"], []).append(Row(**item["row"]))
    return [row for i in sorted(by_index) for row in by_index[i]]  # the caller's order


COLUMNS = (
    ("kernel", 18),
    ("dtype", 8),
    ("head_dim", 8),
    ("block_size", 10),
    ("group", 5),
    ("arch", 5),
    ("addressing", 5),
    ("tiles", 30),
    ("num_warps", 5),
    ("num_stages", 6),
    ("registers", 4),
    ("spill_bytes", 5),
    ("shared_bytes", 6),
    ("occupancy", 9),
)
HEADERS = dict(
    head_dim="head_dim",
    block_size="block",
    addressing="addr",
    num_warps="warps",
    num_stages="stages",
    registers="regs",
    spill_bytes="spill",
    shared_bytes="shared",
    occupancy="warps/SM",
)


def format_table(rows: Sequence[Row]) -> str:
    """The report as an aligned text table, one compiled kernel a line."""

    def cell(row: Row, key: str) -> str:
        if key == "occupancy":
            return "-" if row.occupancy is None else f"{row.occupancy} ({row.occupancy_pct:.0f}%)"
        v = getattr(row, key)
        return "-" if v is None else str(v)

    table = [[HEADERS.get(k, k) for k, _ in COLUMNS]] + [[cell(r, k) for k, _ in COLUMNS] for r in rows]
    widths = [max(w, *(len(t[i]) for t in table)) for i, (_, w) in enumerate(COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(t, widths)).rstrip() for t in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for r in rows:
        if r.error:
            lines.append(
                f"error: {r.kernel} {r.dtype} head_dim {r.head_dim} block {r.block_size} group {r.group} "
                f"{r.arch}: {r.error}"
            )
    for arch, dtype, note in sorted({(r.arch, r.dtype, r.note) for r in rows if r.note and not r.error}):
        kernels = sorted({r.kernel for r in rows if (r.arch, r.dtype, r.note) == (arch, dtype, note)})
        lines.append(f"note: {', '.join(kernels)} {dtype} on {arch}: {note}")
    return "\n".join(lines)


def summary(rows: Sequence[Row]) -> str:
    """One line: how many compiled, how many spill, the lowest occupancy."""
    ok = [r for r in rows if r.error is None]
    spilling = [r for r in ok if r.spill_bytes]
    worst = min(ok, key=lambda r: r.occupancy or 0, default=None)
    text = (
        f"{len(ok)} of {len(rows)} kernels compiled; {len(spilling)} spill registers; "
        f"most registers {max((r.registers or 0 for r in ok), default=0)}"
    )
    if worst is not None:
        text += (
            f"; lowest occupancy {worst.occupancy} warps/SM ({worst.kernel} {worst.dtype} d{worst.head_dim} "
            f"{worst.arch})"
        )
    return text


def rows_to_json_lines(rows: Sequence[Row]) -> str:
    return "\n".join(json.dumps(r.as_json()) for r in rows)


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker_main()
elif __name__ == "__main__" and sys.argv[1:] == ["--source"]:
    _source_worker_main()
