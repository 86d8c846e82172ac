"""The engine's compiled CPU attention (``kernels/cpu_paged_attention.cpp`` through ``kernels/cpu_kernel.py``):
against the reference and a float64 dense attention, in every shape the engine can give it, and the
clean fallback (one log line, the same numbers) when it cannot be built. Every path of the source runs on every
machine: the native build, and beside it each x86-64 level the CPU can run (``x86-64-v4``: the AVX-512 tiles;
``x86-64-v3``: the portable tiles in AVX2; ``x86-64``: the portable tiles in SSE2), each its own library; a level
the CPU cannot run is skipped, saying what the CPU lacks. The source also compiles for aarch64 (a cross compiler
checks it, as ``make kernels`` checks GPU targets without a GPU)."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from test_kernels import TOL, Case, close, naive_attention, paged_cache

from minipaged.kernels import cpu_kernel
from minipaged.kernels import reference as R
from minipaged.kernels import torch_backend as TB

needs_kernel = pytest.mark.skipif(
    cpu_kernel.unavailable_reason() is not None,
    reason=f"the CPU kernel cannot be built here: {cpu_kernel.unavailable_reason()}",
)


def test_the_kernel_builds_on_this_machine():
    """CI and the course machines have g++: the fast path must really be the one that runs there."""
    assert cpu_kernel.unavailable_reason() is None
    assert (
        TB.plan_attention(
            torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32),
            torch.ones(1, dtype=torch.int32),
            16,
            in_place=True,
        ).in_place
        is not None
    )


@needs_kernel
@pytest.mark.parametrize(
    "case",
    [
        Case(torch.float32, 16, 3, 3, 64),  # SmolLM2: 9 query heads over 3 KV heads
        Case(torch.float32, 1, 1, 2, 32),  # MHA, one token per block
        Case(torch.float32, 8, 8, 1, 128),  # MQA
        Case(torch.bfloat16, 16, 4, 2, 64),  # a bf16 cache, widened on load
        Case(torch.bfloat16, 16, 9, 3, 64),  # SmolLM2 in bf16
        Case(torch.bfloat16, 16, 8, 2, 128),  # head_dim 128 in bf16
        Case(torch.float32, 32, 2, 2, 80),  # a head_dim that is no power of two
    ],
    ids=str,
)
def test_kernel_matches_reference_decode_and_prefill(case, monkeypatch):
    """Decodes, short chunks (the kernel) and long prefills (left to SDPA) in one batch, over a NaN-filled pool:
    a read of any slot that is not the sequence's would show. The kernel's row limit is lowered from 2,048 to 120
    so that the long prefills stay a few hundred rows: the split is the same, the references 30x cheaper."""
    monkeypatch.setattr(TB, "KERNEL_MAX_Q_LEN", 120)
    bs = case.block_size
    long = TB.KERNEL_MAX_Q_LEN + 9
    seq_lens = [1, 7, bs, bs + 1, 100, 257, 30, 70, long, 3 * long]
    q_lens = [1, 1, 1, 1, 1, 1, 30, 5, long, long]
    kc, vc, tables, lens = paged_cache(case, seq_lens, seed=21)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), case.num_q_heads, case.head_dim, generator=torch.Generator().manual_seed(3))
    q = q.to(case.dtype)
    scale = case.head_dim**-0.5
    plan = TB.plan_attention(tables, cu, lens, bs, in_place=cpu_kernel.usable(kc, vc))
    assert plan.in_place is not None and not plan.decode
    assert len(plan.prefills) == 2  # only the two sequences longer than KERNEL_MAX_Q_LEN rows
    out = TB.paged_prefill_attention(q, kc, vc, tables, cu, lens, scale)
    assert not out.isnan().any()
    close(out, R.paged_prefill_attention(q, kc, vc, tables, cu, lens, scale), case.dtype)
    for i, (n, m) in enumerate(zip(seq_lens, q_lens)):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        close(
            out[rows],
            naive_attention(q[rows].float(), kc.float(), vc.float(), tables[i], n, list(range(n - m, n)), scale).to(
                case.dtype
            ),
            case.dtype,
        )
    qd = q[: len(seq_lens)].contiguous()
    close(
        TB.paged_decode_attention(qd, kc, vc, tables, lens, scale),
        R.paged_decode_attention(qd, kc, vc, tables, lens, scale),
        case.dtype,
    )


@needs_kernel
def test_kernel_on_its_own_attends_every_row_and_skips_long_ones_when_asked():
    case = Case(torch.float32, 4, 2, 2, 16)
    seq_lens = [9, 40, 6]  # a decode, a 40-row prefill, a 6-row prefill
    kc, vc, tables, lens = paged_cache(case, seq_lens, seed=4)
    cu = torch.tensor([0, 1, 41, 47], dtype=torch.int32)
    q = torch.randn(47, case.num_q_heads, case.head_dim)
    want = R.paged_prefill_attention(q, kc, vc, tables, cu, lens, 0.25)
    close(cpu_kernel.paged_attention(q, kc, vc, tables, cu, lens, 0.25), want, torch.float32)
    part = cpu_kernel.paged_attention(q, kc, vc, tables, cu, lens, 0.25, max_q_len=8)
    close(part[:1], want[:1], torch.float32)
    close(part[41:], want[41:], torch.float32)


# ---- every build this CPU can run, beside the native one ------------------------------------------------------
def use_build(target: str, monkeypatch: pytest.MonkeyPatch) -> ctypes.CDLL:
    """The kernel built for ``target`` (``cpu_kernel.targets()``), made the one the engine's calls use for this test;
    skipped, with the reason, where this CPU cannot run that build (an AVX2 CPU and ``x86-64-v4``)."""
    lib, reason = cpu_kernel.build(target)
    if lib is None:
        pytest.skip(f"the {target} build of the CPU kernel cannot run here: {reason}")
    monkeypatch.setitem(cpu_kernel._state, "lib", lib)
    monkeypatch.setitem(cpu_kernel._state, "reason", "")
    return lib


@pytest.fixture(params=cpu_kernel.targets())
def kernel_build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> ctypes.CDLL:
    return use_build(request.param, monkeypatch)


@needs_kernel
@pytest.mark.parametrize("target", cpu_kernel.targets())
def test_each_build_is_its_own_library_and_runs_the_path_it_names(target, monkeypatch):
    """What each build was compiled with, from the library itself: the native build has the AVX-512 tiles exactly
    where the CPU has AVX-512F; x86-64-v4 has them; x86-64-v3 has AVX2 and not them; x86-64 neither. The fp32
    decode products come with AVX2 and FMA (AVX-512 or AVX2 tiles), and so do the bf16 ones (vdpbf16ps where the
    target has AVX512-BF16, else widened to fp32), except where there is AMX."""
    native = cpu_kernel.build("native")[0]
    assert native is not None
    lib = use_build(target, monkeypatch)
    features, flags = lib.minipaged_features(), cpu_kernel._cpu_flags()
    expected = {"x86-64": 0, "x86-64-v3": 2 | 8 | 16, "x86-64-v4": 3 | 8 | 16, "armv8-a": 4}  # 8, 16: the products
    if target == "native":
        assert lib._name == native._name
        if flags and cpu_kernel._machine() == "x86_64":
            assert bool(features & 1) == ("avx512f" in flags) and bool(features & 2) == ("avx2" in flags)
            assert bool(features & 8) == ("avx2" in flags and "fma" in flags)  # the fp32 decode products: AVX2 on
            # and the bf16 ones, except where the CPU has AMX (oneDNN's AMX kernels multiply bf16 there)
            assert bool(features & 16) == (bool(features & 8) and "amx_bf16" not in flags)
        if cpu_kernel._machine() == "aarch64":
            assert features == 4
    else:
        assert features == expected[target], cpu_kernel.tiles(lib)
        assert lib._name != native._name and lib._handle != native._handle
        assert f"cpu_paged_attention-{target}-" in Path(lib._name).name
        monkeypatch.setenv(cpu_kernel.ARCH_ENV, target)  # the engine's own library, built for this target
        built, reason = cpu_kernel._build()
        assert built is not None and built._name == lib._name, reason
    assert cpu_kernel.describe().endswith(f"{cpu_kernel.tiles(lib)})")


def _products_build(target: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """``target``'s build in use, skipped where it has no decode products in ``dtype`` (AVX2 and FMA or AVX-512;
    bf16 not with AMX). In bf16 the native build multiplies with vdpbf16ps where the CPU has AVX512-BF16, the
    x86-64-v4 and x86-64-v3 builds widen to fp32: both ways are tested wherever the CPU runs them."""
    lib = use_build(target, monkeypatch)
    if not cpu_kernel.decode_products(lib, dtype):
        pytest.skip(f"the {target} build has no {dtype} decode products ({cpu_kernel.tiles(lib)}): oneDNN runs instead")


# fp32: PyTorch's product to fp32 rounding. bf16: both sides rounded once to bf16 from sums in another order, so one
# bf16 step (2^-8 of the value) apart at most, and the inputs are bf16 in both.
_PRODUCT_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2**-7, atol=2**-7)}


@needs_kernel
@pytest.mark.parametrize("target", ["native", "x86-64-v4", "x86-64-v3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("residual", ["none", "other", "in place"])
def test_decode_product_is_the_matmul_for_every_row_count(target, dtype, residual, monkeypatch):
    """Every row count from 1 to 27 (two full tiles of 12, four of 6 on AVX2, and each remainder), two panels'
    widths, a row stride wider than K (and an odd K in fp32; bf16 multiplies pairs, so K is even there): PyTorch's
    product, plus the residual, even when it is the output; a bf16 output is rounded once, after the add."""
    _products_build(target, dtype, monkeypatch)
    g = torch.Generator().manual_seed(0)
    k = 37 if dtype == torch.float32 else 38
    w = torch.randn(64, k, generator=g).to(dtype)
    panels = cpu_kernel.pack_panels(w)
    assert panels.shape == w.shape and panels.dtype == dtype and not torch.equal(panels, w)  # the numbers, re-laid
    assert torch.equal(panels.flatten().sort().values, w.flatten().sort().values)
    for m in range(1, 28):
        a = torch.randn(m, 45, generator=g)[:, 3 : 3 + k].to(dtype)  # rows 45 apart
        r = torch.randn(m, 64, generator=g).to(dtype)
        want = (a.double() @ w.double().T + (r.double() if residual != "none" else 0)).to(dtype)
        out = r.clone() if residual == "in place" else torch.full((m, 64), float("nan"), dtype=dtype)
        res = {"none": None, "other": r, "in place": out}[residual]
        got = cpu_kernel.decode_product(a, panels, out, res)
        assert got is out
        torch.testing.assert_close(got, want, **_PRODUCT_TOL[dtype])
        if dtype == torch.bfloat16:  # rounded once: most elements are the exact sum's nearest bf16
            assert (got == want).float().mean() > 0.9
    a = torch.randn(3, k, generator=g).to(dtype)
    a[1, 5] = float("nan")  # a NaN stays a NaN (rounding to bf16 must not carry it into an infinity or a number)
    got = cpu_kernel.decode_product(a, panels, torch.zeros(3, 64, dtype=dtype))
    assert got[1].isnan().all() and not got[[0, 2]].isnan().any()


@needs_kernel
@pytest.mark.parametrize("target", ["native", "x86-64-v4", "x86-64-v3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_glu_is_silu_of_gate_times_up_and_leaves_rows_past_its_count(target, dtype, monkeypatch):
    """silu(a Wg^T) * (a Wu^T) for every row count to 13 (two tiles of 6, four of 3 on AVX2, and each remainder),
    with logits large and small enough to reach both halves of silu; rows past ``rows`` are not written."""
    _products_build(target, dtype, monkeypatch)
    g = torch.Generator().manual_seed(1)
    wg, wu = torch.randn(96, 40, generator=g).to(dtype), torch.randn(96, 40, generator=g).to(dtype)
    gate, up = cpu_kernel.pack_panels(wg), cpu_kernel.pack_panels(wu)
    for m in range(1, 14):
        a = (torch.randn(m + 2, 40, generator=g) * 3).to(dtype)
        out = torch.full((m + 2, 96), 7.0, dtype=dtype)
        cpu_kernel.decode_glu(a, gate, up, out, rows=m)
        x = a[:m].double()
        want = torch.nn.functional.silu(x @ wg.T.double()) * (x @ wu.T.double())
        # fp32 sums of 40 terms near 10 each, in another order than PyTorch's: errors on the scale of the terms;
        # in bf16, one rounding of the result on top
        rtol = 1e-5 if dtype == torch.float32 else 2**-8
        torch.testing.assert_close(out[:m].double(), want, rtol=rtol, atol=rtol * float(want.abs().max()))
        assert (out[m:] == 7.0).all()


@needs_kernel
@pytest.mark.parametrize("target", ["native", "x86-64-v4", "x86-64-v3"])
def test_the_products_take_rows_past_a_block_of_1024(target, monkeypatch):
    """A prefill's rows are taken 1,024 at a time (kRowBlock): rows on both sides of each block's edge, with the
    residual in place and silu(gate) * up, are the same products as below it."""
    _products_build(target, torch.float32, monkeypatch)
    g = torch.Generator().manual_seed(2)
    w, wg, wu = (torch.randn(64, 24, generator=g) for _ in range(3))
    a = torch.randn(2100, 24, generator=g)
    r = torch.randn(2100, 64, generator=g)
    out = r.clone()
    cpu_kernel.decode_product(a, cpu_kernel.pack_panels(w), out, out, rows=2090)
    torch.testing.assert_close(out[:2090], a[:2090] @ w.T + r[:2090], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[2090:], r[2090:])  # rows past its count: untouched
    glu = torch.full((2100, 64), 7.0)
    cpu_kernel.decode_glu(a, cpu_kernel.pack_panels(wg), cpu_kernel.pack_panels(wu), glu, rows=2090)
    want = torch.nn.functional.silu(a[:2090] @ wg.T) * (a[:2090] @ wu.T)
    torch.testing.assert_close(glu[:2090], want, rtol=1e-4, atol=1e-4)
    assert (glu[2090:] == 7.0).all()


def _mixed_batch(case: Case, seed: int):
    """Decodes (one a block exactly, one a block and a token) and two short chunks: every row on the kernel."""
    seq_lens, q_lens = [1, 7, case.block_size, case.block_size + 1, 100, 45, 70], [1, 1, 1, 1, 1, 30, 5]
    kc, vc, tables, lens = paged_cache(case, seq_lens, seed=seed)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), case.num_q_heads, case.head_dim, generator=torch.Generator().manual_seed(seed))
    return q, kc, vc, tables, cu, lens


@needs_kernel
@pytest.mark.parametrize(
    "case",
    [
        Case(torch.float32, 16, 3, 3, 64),  # head_dim 64: the AVX-512 tile where built in, else the portable one
        Case(torch.bfloat16, 16, 3, 3, 64),
        Case(torch.float32, 16, 4, 2, 128),  # head_dim 128: the other AVX-512 tile
        Case(torch.bfloat16, 8, 4, 2, 128),
        Case(torch.bfloat16, 32, 2, 2, 80),  # any other head_dim: the portable tile in every build
    ],
    ids=str,
)
def test_every_build_matches_the_reference(kernel_build, case):
    """Each build against the reference, in the four dtype pairs the library takes (the cache's dtype with the
    query's own or the other), over a NaN-filled pool."""
    q, kc, vc, tables, cu, lens = _mixed_batch(case, seed=7)
    scale = case.head_dim**-0.5
    other = torch.bfloat16 if case.dtype == torch.float32 else torch.float32
    for q_dtype in (case.dtype, other):
        qd = q.to(q_dtype)
        out = cpu_kernel.paged_attention(qd, kc, vc, tables, cu, lens, scale)
        want = R.paged_prefill_attention(qd.float(), kc.float(), vc.float(), tables, cu, lens, scale).to(q_dtype)
        assert out.dtype == q_dtype and not out.isnan().any()
        # A bf16 cache rounds P to bf16 for P.V (as PyTorch's bf16 attention does): bf16's tolerance either way.
        tol = TOL[torch.bfloat16 if torch.bfloat16 in (q_dtype, case.dtype) else torch.float32]
        torch.testing.assert_close(out.float(), want.float(), **tol)


@pytest.mark.parametrize("target", ["x86-64-v4", "x86-64-v3"])
def test_a_level_the_cpu_lacks_is_refused_with_what_it_lacks(target, monkeypatch):
    """On an AVX2 CPU the AVX-512 build, on an older one the AVX2 build, would die of SIGILL: it is not built, and
    the reason names the missing features; PyTorch's detection stands in where there is no /proc/cpuinfo (a Mac).
    An Arm machine is never given an x86 level, and its native build is -mcpu=native (Apple's clang refuses
    -march=native)."""
    monkeypatch.setattr(cpu_kernel, "_machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_kernel, "_cpu_flags", lambda: {"sse2", "avx"})
    flags, reason = cpu_kernel.target_flags(target)
    assert flags is None and reason.startswith("this CPU lacks ") and "avx2" in reason and target in reason
    assert cpu_kernel.target_flags("x86-64") == (["-march=x86-64"], "")
    monkeypatch.setenv(cpu_kernel.ARCH_ENV, target)
    lib, reason = cpu_kernel._build()
    assert lib is None and reason.startswith(f"MINIPAGED_CPU_ARCH={target}: this CPU lacks ")

    monkeypatch.setattr(cpu_kernel, "_cpu_flags", set)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert cpu_kernel.target_flags("x86-64-v3") == (["-march=x86-64-v3"], "")
    assert (
        cpu_kernel.target_flags("x86-64-v4")[1]
        == "this CPU lacks x86-64-v4 (PyTorch finds AVX2), which x86-64-v4 code uses"
    )

    monkeypatch.setattr(cpu_kernel, "_machine", lambda: "aarch64")
    assert cpu_kernel.targets() == ["native", "armv8-a"]
    assert cpu_kernel.target_flags("native") == (["-mcpu=native"], "")
    assert cpu_kernel.target_flags(target) == (None, f"{target} is an x86_64 target and this machine is aarch64")
    assert cpu_kernel.target_flags("armv8-a") == (["-march=armv8-a"], "")


AARCH64_CXX = "aarch64-linux-gnu-g++"


@pytest.mark.skipif(
    shutil.which(AARCH64_CXX) is None,
    reason=f"no {AARCH64_CXX} here (Debian: apt-get install g++-aarch64-linux-gnu) to check the aarch64 build",
)
def test_the_kernel_compiles_for_aarch64(tmp_path):
    """What a learner on an Arm machine (an Apple-silicon Mac, a Graviton) builds: the same flags as the engine's,
    for the AArch64 baseline (a cross compiler cannot detect a CPU, so not -mcpu=native), and the library exports
    every function the engine calls."""
    out = tmp_path / "cpu_paged_attention-aarch64.so"
    proc = subprocess.run(
        [AARCH64_CXX, *cpu_kernel.FLAGS, "-march=armv8-a", str(cpu_kernel.SOURCE), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=cpu_kernel.COMPILE_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    elf = out.read_bytes()
    assert elf[:4] == b"\x7fELF" and int.from_bytes(elf[18:20], "little") == 183  # e_machine: EM_AARCH64
    for name in ("minipaged_paged_attention", "minipaged_rms_norm", "minipaged_rope_and_cache", "minipaged_features"):
        assert name.encode() in elf, name


def test_kernel_refuses_what_it_cannot_read():
    kc = torch.zeros(4, 16, 2, 32)
    assert cpu_kernel.usable(kc, kc) == (cpu_kernel.unavailable_reason() is None)
    assert not cpu_kernel.usable(kc.half(), kc.half())  # fp16: the fallback's
    assert not cpu_kernel.usable(kc.transpose(0, 1), kc.transpose(0, 1))  # not contiguous
    assert not cpu_kernel.usable(kc, kc.bfloat16())  # mixed dtypes


FALLBACK = textwrap.dedent("""
    import logging, torch
    from minipaged.kernels import cpu_kernel, reference as R, torch_backend as TB
    kc = torch.randn(6, 4, 2, 16); vc = torch.randn(6, 4, 2, 16)
    tables = torch.tensor([[3, 1, 5], [0, 2, 4]], dtype=torch.int32)
    lens = torch.tensor([10, 7], dtype=torch.int32)
    q = torch.randn(2, 4, 16)
    for _ in range(3):   # one log line, however often it is asked
        out = TB.paged_decode_attention(q, kc, vc, tables, lens, 0.3)
    torch.testing.assert_close(out, R.paged_decode_attention(q, kc, vc, tables, lens, 0.3))
    print("reason:", cpu_kernel.unavailable_reason())
""")


def run_fallback(tmp_path, **env_changes: str | None) -> subprocess.CompletedProcess:
    env = {**os.environ, "MINIPAGED_CACHE_DIR": str(tmp_path / "cache")}  # nothing built before
    for k, v in env_changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return subprocess.run([sys.executable, "-c", FALLBACK], capture_output=True, text=True, env=env, timeout=300)


def test_no_compiler_falls_back_with_one_log_line(tmp_path):
    bin_dir = tmp_path / "bin"  # PATH with python only: no g++, c++ or clang++
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    proc = run_fallback(tmp_path, PATH=str(bin_dir), CXX=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if "minipaged:" in ln]
    assert lines == [
        "minipaged: no C++ compiler found (g++, c++, clang++ or $CXX); CPU attention gathers K/V "
        "and calls SDPA instead (slower)"
    ], proc.stderr
    assert "reason: no C++ compiler found" in proc.stdout


def test_a_compiler_that_fails_falls_back_naming_it(tmp_path):
    fake = tmp_path / "broken-c++"
    fake.write_text("#!/bin/sh\necho 'fatal error: omp.h: No such file or directory' >&2\nexit 1\n")
    fake.chmod(0o755)
    proc = run_fallback(tmp_path, CXX=str(fake))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if "minipaged:" in ln]
    assert len(lines) == 1 and "broken-c++ could not compile cpu_paged_attention.cpp: fatal error: omp.h" in lines[0]
    assert not list((tmp_path / "cache").rglob("*.so"))  # no half-written library left behind


def test_switched_off_is_quiet(tmp_path):
    proc = run_fallback(tmp_path, MINIPAGED_CPU_KERNEL="0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "minipaged:" not in proc.stderr and "reason: MINIPAGED_CPU_KERNEL=0" in proc.stdout


@needs_kernel
def test_engine_gives_the_same_tokens_with_and_without_the_kernel(tiny_model, monkeypatch):
    """The whole engine, chunked prefill and prefix caching included, on the kernel and on the fallback."""
    from minipaged import LLM, SamplingParams

    prompts = [[5, 9, 2, 7, 1, 3, 8, 4, 6, 2, 9, 1, 3] * 3, [5, 9, 2, 7, 1, 3, 8, 4, 6, 2, 9, 1, 4] * 2, [11, 12]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def run() -> list[list[int]]:
        llm = LLM(tiny_model, max_num_batched_tokens=24, max_num_seqs=4, dtype="float32")
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    with_kernel = run()
    monkeypatch.setitem(cpu_kernel._state, "lib", None)
    monkeypatch.setitem(cpu_kernel._state, "reason", "switched off by the test")
    assert not cpu_kernel.usable(torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1))
    assert run() == with_kernel


# ---- every compiler call is bounded; $CXX is honoured or the notice says why; a bad cached library is rebuilt --
def _script(path, body: str):
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def test_a_compiler_that_hangs_costs_seconds_not_the_session(tmp_path, monkeypatch):
    import time

    monkeypatch.setenv("MINIPAGED_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_kernel, "VERSION_TIMEOUT_S", 0.5)
    monkeypatch.setattr(cpu_kernel, "COMPILE_TIMEOUT_S", 0.5)
    monkeypatch.setenv("CXX", str(_script(tmp_path / "hangs-on-version", "sleep 60\n")))
    t0 = time.perf_counter()
    lib, reason = cpu_kernel._build()
    assert lib is None and "--version could not run or did not return within 0.5 s" in reason
    monkeypatch.setenv("CXX", str(_script(tmp_path / "hangs-on-compile", '[ "$1" = --version ] && exit 0\nsleep 60\n')))
    lib, reason = cpu_kernel._build()
    assert lib is None and reason == "hangs-on-compile did not finish compiling cpu_paged_attention.cpp within 0.5 s"
    assert time.perf_counter() - t0 < 10
    assert not list((tmp_path / "cache").rglob("*.so"))


def test_cxx_is_honoured_or_the_notice_says_why_not(tmp_path, monkeypatch, caplog):
    import shutil

    monkeypatch.setenv("CXX", "/nonexistent/g++")
    compiler, note = cpu_kernel._compiler()
    assert compiler == shutil.which("g++")
    assert note == f"CXX='/nonexistent/g++' is not an executable compiler here; using {compiler} instead"
    wrapper = _script(tmp_path / "my-c++", f'exec {compiler} "$@"\n')
    monkeypatch.setenv("CXX", str(wrapper))
    assert cpu_kernel._compiler() == (str(wrapper), "")
    monkeypatch.setenv("MINIPAGED_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with caplog.at_level("WARNING", logger="minipaged"):
        lib, reason = cpu_kernel._build()
    assert lib is not None and reason == ""
    assert "CXX='/nonexistent/g++' is not an executable compiler here" in caplog.text


def test_a_cached_library_that_does_not_load_is_built_again_once(tmp_path, monkeypatch, caplog):
    import shutil

    monkeypatch.setenv("MINIPAGED_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CXX", raising=False)
    cached = cpu_kernel.library_path(cpu_kernel._version(shutil.which("g++")) or "")
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"\x7fELF" + bytes(4092))  # a truncated library where the build would keep its own
    with caplog.at_level("WARNING", logger="minipaged"):
        lib, reason = cpu_kernel._build()
    assert lib is not None and reason == "" and cached.stat().st_size > 4096
    assert f"the cached {cached.name} does not load" in caplog.text and "building it again" in caplog.text
