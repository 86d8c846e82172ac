"""Every private torch / Triton API the package leans on has a fallback, and the fallback is tested by taking the
private piece away (issue: "each private torch/Triton API behind a tested fallback that still works if it
disappears").

    minipaged.model.layers.Linear           torch.ops.mkldnn._reorder_linear_weight / _linear_pointwise(.binary)
    minipaged.kernels.report               create_function_from_signature, JITFunction._pack_args; bundled ptxas
    minipaged.kernels.validation           triton.knobs, triton.runtime.interpreter.InterpretedFunction
    minipaged.grading.ex05b                 InterpretedFunction.run / JITFunction.run (launch counting)
    minipaged.profiling.span               torch._C._profiler._RecordFunctionFast (tests/test_step_program.py
                                           profiles the engine with it and with record_function in its place)

Compiling for a GPU needs TRITON_INTERPRET=0 before triton is imported, and this process has the interpreter on
(conftest), so the report's tests run their Triton side in a fresh Python, as compile_report() does.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import triton

from minipaged.classroom import kernel_report as report
from minipaged.model import layers

# ---- layers.Linear: the oneDNN packed path ----------------------------------------------------------------------


@pytest.fixture
def fresh_onednn(monkeypatch):
    """An unprobed packed path (the module's cache emptied), restored as it was after the test."""
    monkeypatch.setattr(layers, "_ONEDNN", None)
    monkeypatch.setattr(layers, "_ONEDNN_OPS", None)
    monkeypatch.setattr(layers, "_ONEDNN_FAILED_DTYPES", set())
    monkeypatch.delenv("MINIPAGED_ONEDNN", raising=False)


def _real_ops_or_skip() -> layers.OneDNNOps:
    ops, why = layers.probe_onednn()
    if ops is None:
        pytest.skip(f"this torch has no usable oneDNN packed linear: {why}")
    return ops


def _layer_and_inputs(rows: int = 5) -> tuple[layers.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    layer = layers.Linear(24, 40, bias=True)
    return layer, torch.randn(rows, 24), torch.randn(rows, 40)


def _all_results(layer: layers.Linear, x: torch.Tensor, other: torch.Tensor) -> dict[str, torch.Tensor]:
    with torch.inference_mode():
        return {"forward": layer(x), "silu": layer.silu(x), "mul": layer.mul(x, other), "add": layer.add(x, other)}


def _plain_results(layer: layers.Linear, x: torch.Tensor, other: torch.Tensor) -> dict[str, torch.Tensor]:
    """What plain PyTorch computes, never through Linear's own methods."""
    with torch.no_grad():
        y = torch.nn.functional.linear(x, layer.weight, layer.bias)
        return {"forward": y, "silu": torch.nn.functional.silu(y), "mul": y * other, "add": y + other}


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], exact: bool = False) -> None:
    for name in want:
        tol = 0.0 if exact else 1e-5
        torch.testing.assert_close(got[name], want[name], atol=tol, rtol=tol, msg=name)


class _Counting:
    """A stand-in for a torch op (and its .binary overload) that counts calls and forwards to the real one."""

    def __init__(self, op, binary=None):
        self.op, self.calls = op, 0
        if binary is not None:
            self.binary = _Counting(binary)

    def __call__(self, *args):
        self.calls += 1
        return self.op(*args)


def _missing(name: str, ops: layers.OneDNNOps) -> SimpleNamespace:
    """An mkldnn namespace with one of the three operators taken away."""
    if name == "_reorder_linear_weight":
        return SimpleNamespace(_linear_pointwise=ops.pointwise)
    if name == "_linear_pointwise":
        return SimpleNamespace(_reorder_linear_weight=ops.reorder)
    return SimpleNamespace(_reorder_linear_weight=ops.reorder, _linear_pointwise=lambda *a: ops.pointwise(*a))


@pytest.mark.parametrize("gone", ["_reorder_linear_weight", "_linear_pointwise", "_linear_pointwise.binary"])
def test_linear_without_the_onednn_ops_computes_what_pytorch_does(fresh_onednn, monkeypatch, caplog, gone):
    """An op taken away (even the .binary overload alone): the probe says which is missing, once, and every
    method of Linear gives plain PyTorch's results, bit for bit (it *is* plain PyTorch then)."""
    ops = _real_ops_or_skip()
    monkeypatch.setattr(layers, "_mkldnn_namespace", lambda: _missing(gone, ops))
    layer, x, other = _layer_and_inputs()
    with caplog.at_level(logging.INFO, logger="minipaged"):
        got = _all_results(layer, x, other)
        _all_results(layer, x, other)
    _assert_same(got, _plain_results(layer, x, other), exact=True)
    assert layers._ONEDNN is False and layer._packed is None
    lines = [r for r in caplog.records if "oneDNN" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING, lines  # one line, why, once
    assert "missing" in lines[0].getMessage() and gone.split(".")[-1] in lines[0].getMessage()


def test_linear_with_the_onednn_ops_uses_the_packed_path(fresh_onednn, monkeypatch, caplog):
    """The ops there and right: every method goes through them (counted), equal to PyTorch within fp32
    tolerance; the probe runs once and logs nothing."""
    ops = _real_ops_or_skip()
    reorder, pointwise = _Counting(ops.reorder), _Counting(ops.pointwise, ops.binary)
    namespace = SimpleNamespace(_reorder_linear_weight=reorder, _linear_pointwise=pointwise)
    monkeypatch.setattr(layers, "_mkldnn_namespace", lambda: namespace)
    probes: list[int] = []
    real_probe = layers.probe_onednn

    def counted_probe():
        probes.append(1)
        return real_probe()

    monkeypatch.setattr(layers, "probe_onednn", counted_probe)
    layer, x, other = _layer_and_inputs()
    with caplog.at_level(logging.INFO, logger="minipaged"):
        got = _all_results(layer, x, other)
    _assert_same(got, _plain_results(layer, x, other))
    assert layers._ONEDNN is True and layer._packed is not None and probes == [1]
    assert reorder.calls == 2  # the probe's weight, then this layer's (packed once, reused by all four)
    assert pointwise.calls == 2 + 2 and pointwise.binary.calls == 2 + 2  # the probe's, then forward+silu, mul+add
    assert not [r for r in caplog.records if "oneDNN" in r.getMessage()]


def test_a_wrong_or_raising_op_is_caught_by_the_probe(fresh_onednn, monkeypatch):
    """An op that is there but computes something else, or raises on fp32: the packed path stays off."""
    ops = _real_ops_or_skip()
    layer, x, other = _layer_and_inputs()

    def off_by_one(*args):
        return ops.pointwise(*args) + 1

    off_by_one.binary = ops.binary  # type: ignore[attr-defined]
    monkeypatch.setattr(
        layers,
        "_mkldnn_namespace",
        lambda: SimpleNamespace(_reorder_linear_weight=ops.reorder, _linear_pointwise=off_by_one),
    )
    found, why = layers.probe_onednn()
    assert found is None and "disagrees" in why and "'none'" in why

    def refuses(*args):
        raise RuntimeError("no kernel for this CPU")

    monkeypatch.setattr(
        layers,
        "_mkldnn_namespace",
        lambda: SimpleNamespace(_reorder_linear_weight=refuses, _linear_pointwise=ops.pointwise),
    )
    found, why = layers.probe_onednn()
    assert found is None and "raised" in why and "no kernel for this CPU" in why
    _assert_same(_all_results(layer, x, other), _plain_results(layer, x, other), exact=True)
    assert layer._packed is None


@pytest.mark.parametrize("method", ["forward", "silu", "mul", "add", "reorder"])
def test_a_packed_call_that_raises_at_run_time_falls_back(fresh_onednn, monkeypatch, caplog, method):
    """The probe passed, then an op raises on a real call (a dtype or shape it does not take): that call
    returns plain PyTorch's answer, one warning names the op, and the dtype stays on the plain path."""
    ops = _real_ops_or_skip()
    assert layers.onednn_ops() is not None  # the probe passes with the real ops

    def boom(*args):
        raise RuntimeError("unsupported here")

    pointwise = boom if method in ("forward", "silu") else ops.pointwise
    binary = boom if method in ("mul", "add") else ops.binary
    reorder = boom if method == "reorder" else ops.reorder
    monkeypatch.setattr(layers, "_ONEDNN_OPS", layers.OneDNNOps(reorder, pointwise, binary))
    layer, x, other = _layer_and_inputs()
    want = _plain_results(layer, x, other)
    with caplog.at_level(logging.INFO, logger="minipaged"), torch.inference_mode():
        call = {
            "forward": lambda: layer(x),
            "silu": lambda: layer.silu(x),
            "mul": lambda: layer.mul(x, other),
            "add": lambda: layer.add(x, other),
            "reorder": lambda: layer(x),
        }[method]
        first, second = call(), call()
    key = "forward" if method == "reorder" else method
    torch.testing.assert_close(first, want[key], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(second, want[key], atol=1e-5, rtol=1e-5)
    assert layers._ONEDNN_FAILED_DTYPES == {torch.float32}
    lines = [r for r in caplog.records if "oneDNN" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING and "unsupported here" in lines[0].getMessage()
    _assert_same(_all_results(layer, x, other), want)  # every method still right, on the plain path


def test_a_caller_error_is_pytorchs_and_leaves_the_packed_path_on(fresh_onednn):
    """x in another dtype than the weight is the caller's mistake: PyTorch's own error, the packed path stays."""
    _real_ops_or_skip()
    layer, x, _ = _layer_and_inputs()
    with torch.inference_mode(), pytest.raises(RuntimeError):
        layer(x.double())
    assert not layers._ONEDNN_FAILED_DTYPES


def test_minipaged_onednn_0_still_turns_the_packed_path_off(fresh_onednn, monkeypatch, caplog):
    monkeypatch.setenv("MINIPAGED_ONEDNN", "0")
    layer, x, other = _layer_and_inputs()
    with caplog.at_level(logging.INFO, logger="minipaged"):
        got = _all_results(layer, x, other)
    _assert_same(got, _plain_results(layer, x, other), exact=True)
    assert layers._ONEDNN is False and layer._packed is None
    (line,) = [r for r in caplog.records if "oneDNN" in r.getMessage()]
    assert line.levelno == logging.INFO and "MINIPAGED_ONEDNN=0" in line.getMessage()


def test_the_probe_leaves_the_global_random_stream_alone(fresh_onednn):
    torch.manual_seed(123)
    want = torch.rand(4)
    torch.manual_seed(123)
    layers.probe_onednn()
    assert torch.equal(torch.rand(4), want)


# ---- kernels.validation: is the Triton interpreter on? -----------------------------------------------------------


def _interpreter_pieces_gone(monkeypatch) -> None:
    """Take away what triton_interpreter_ready reads first: triton.knobs and InterpretedFunction."""
    import triton.runtime.interpreter

    monkeypatch.delattr(triton, "knobs")
    monkeypatch.delattr(triton.runtime.interpreter, "InterpretedFunction")


def test_interpreter_ready_as_triton_says_when_nothing_is_missing():
    from minipaged.kernels.validation import _helpers_interpreted, _interpret_flag, triton_interpreter_ready

    if torch.cuda.is_available():
        pytest.skip("on a GPU this process compiles kernels")
    assert _interpret_flag(triton) is True and _helpers_interpreted(triton.language) is True
    assert triton_interpreter_ready() is True


@pytest.mark.parametrize(("env", "expected"), [("1", True), ("true", True), ("0", False), (None, False)])
def test_interpreter_ready_without_knobs_or_interpreted_function(monkeypatch, env, expected):
    """Both Triton internals gone: the variable decides, and tl.zeros, by its class's name, is interpreted."""
    from minipaged.kernels.validation import triton_interpreter_ready

    if torch.cuda.is_available():
        pytest.skip("on a GPU tl.zeros is compiled")
    _interpreter_pieces_gone(monkeypatch)
    if env is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", env)
    assert triton_interpreter_ready() is expected


def test_interpreter_ready_fallback_still_sees_compiled_helpers(monkeypatch):
    """The variable set after triton was imported (the case the check exists for): tl.zeros is a JITFunction,
    so the kernels cannot be interpreted, whatever the variable says."""
    from minipaged.kernels.validation import _helpers_interpreted, triton_interpreter_ready

    _interpreter_pieces_gone(monkeypatch)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    compiled = object.__new__(triton.JITFunction)  # what tl.zeros is when triton was imported first
    monkeypatch.setattr(triton.language, "zeros", compiled)
    assert _helpers_interpreted(triton.language) is False
    assert triton_interpreter_ready() is False
    monkeypatch.setattr(triton.language, "zeros", object())  # nothing tells: the variable alone decides
    assert _helpers_interpreted(triton.language) is None
    assert triton_interpreter_ready() is True


# ---- grading.ex05b: counting Triton launches ----------------------------------------------------------------------


@pytest.fixture
def ex05b():
    if torch.cuda.is_available():
        pytest.skip("the checks run kernels in the interpreter here")
    from minipaged.classroom.grading import ex05b

    return ex05b


def _one_case(ex05b):
    return ex05b._write_cases()[0]  # one decode token: quick in the interpreter


def test_launches_are_counted_through_run(ex05b):
    from minipaged.kernels import reference, reshape_and_cache

    case = _one_case(ex05b)
    assert ex05b._run(reshape_and_cache, case) == ex05b._expected(case)
    assert ex05b._run(reference.reshape_and_cache, case).startswith("no Triton kernel ran")  # PyTorch, not Triton
    with ex05b._count_triton_launches() as launches:
        reshape_and_cache(*_inputs(case))
    assert launches.hook == "run" and len(launches) == 1 and not launches.unavailable


def _inputs(case):
    key, value, k_buf, v_buf, slots = case.inputs()
    return key, value, case.cache_view(k_buf), case.cache_view(v_buf), slots


def test_run_hook_classes_are_gone_when_triton_drops_them(ex05b, monkeypatch):
    import triton.runtime.interpreter
    import triton.runtime.jit

    assert ex05b._run_hook_classes()
    with monkeypatch.context() as m:
        m.delattr(triton.runtime.interpreter, "InterpretedFunction")
        assert ex05b._run_hook_classes() == []
    with monkeypatch.context() as m:
        m.delattr(triton.runtime.jit.JITFunction, "run")  # KernelInterface.run, a stub, is still inherited
        assert ex05b._run_hook_classes() == []
    assert ex05b._run_hook_classes()


def test_launches_are_counted_through_getitem_without_run(ex05b, monkeypatch):
    """Without the run hooks, kernel[grid] (KernelInterface.__getitem__) counts: a Triton kernel passes, PyTorch
    indexing does not, and __getitem__ is Triton's own again afterwards."""
    from triton.runtime import KernelInterface

    from minipaged.kernels import reference, reshape_and_cache

    monkeypatch.setattr(ex05b, "_run_hook_classes", lambda: [])
    original = KernelInterface.__dict__["__getitem__"]
    case = _one_case(ex05b)
    with ex05b._count_triton_launches() as launches:
        reshape_and_cache(*_inputs(case))
    assert launches.hook == "__getitem__" and len(launches) == 1
    assert KernelInterface.__dict__["__getitem__"] is original
    assert ex05b._run(reshape_and_cache, case) == ex05b._expected(case)
    assert ex05b._run(reference.reshape_and_cache, case).startswith("no Triton kernel ran")


def test_without_any_hook_the_check_fails_and_says_counting_is_unavailable(ex05b, monkeypatch):
    """Neither hook: even a correct Triton kernel fails the check, with a sentence saying why (never a pass)."""
    from minipaged.classroom.grading.core import Check, run_check
    from minipaged.kernels import reshape_and_cache

    monkeypatch.setattr(ex05b, "_run_hook_classes", lambda: [])
    monkeypatch.setattr(ex05b, "_getitem_hook_class", lambda: None)
    case = _one_case(ex05b)
    outcome = run_check(Check(case.describe(), lambda: ex05b._run(reshape_and_cache, case), ex05b._expected(case)))
    assert not outcome.passed
    assert outcome.got.startswith("launch counting is unavailable") and "cannot pass" in outcome.got
    assert ex05b._expected(case) in outcome.got  # it still says what the caches hold


# ---- kernels.report: compiling without Triton's private binder ---------------------------------------------------


def test_tool_falls_back_to_path(monkeypatch, tmp_path):
    """No bundled ptxas (a triton wheel without NVIDIA tools): TRITON_PTXAS_PATH, else the one on PATH."""
    monkeypatch.setattr(triton, "__file__", str(tmp_path / "triton" / "__init__.py"))  # a wheel without bin/
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    bin_dir = tmp_path / "cuda" / "bin"
    bin_dir.mkdir(parents=True)
    monkeypatch.setenv("PATH", str(bin_dir))
    assert not report._tool("ptxas").exists()  # nowhere: the wheel's path, for the error message
    fake = bin_dir / "ptxas"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert report._tool("ptxas") == fake
    pinned = tmp_path / "pinned-ptxas"
    pinned.write_text("#!/bin/sh\n")
    monkeypatch.setenv("TRITON_PTXAS_PATH", str(pinned))
    assert report._tool("ptxas") == pinned


def test_compile_launch_refuses_an_unknown_binder():
    with pytest.raises(ValueError, match="binder must be"):
        report.compile_launch(SimpleNamespace(kernel=None), "sm_90", binder="guess")


# A fresh Python with the interpreter off; argv[1] says what to do, the result is one JSON line.
_SCRIPT = textwrap.dedent(
    """
    import hashlib, json, sys
    import triton
    import triton.runtime.jit as jit
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    from minipaged.kernels import report

    mode = sys.argv[1]
    if mode == "same_specialization":
        import toy_kernel  # edge cases the planners never produce
        from minipaged.kernels.launch import Launch

        launches = []
        for cfg in report.default_configs(block_sizes=(1, 16, 32), groups=(1, 4), addressing="block"):
            try:
                launches += report.example_launches(cfg)
            except Exception:  # a shape the planner refuses: the report records it as an error row
                pass
        for args in toy_kernel.ARGS:
            launches.append(("toy", Launch(toy_kernel.toy, (1,), args, dict(N=4), 4, 2)))
        backend = make_backend(GPUTarget("cuda", 90, 32))
        diffs = []
        for name, launch in launches:
            a = report.specialize_with_triton(launch.kernel, launch, backend)
            b = report.specialize_by_hand(launch.kernel, launch, backend)
            if (a[0].__dict__, *a[1:]) != (b[0].__dict__, *b[1:]):
                diffs.append([name, repr(a[1:]), repr(b[1:])])
        print(json.dumps(dict(launches=len(launches), diffs=diffs)))
    else:
        if mode == "private_gone":  # what a Triton without them looks like
            del jit.create_function_from_signature
            del jit.JITFunction._pack_args
        cfg = report.Config("paged_decode", "float16", 64, 16, 3, 3, "sm_90")
        rows = []
        for name, launch in report.example_launches(cfg):
            compiled = report.compile_launch(launch, "sm_90")
            usage = report.resource_usage(compiled.asm["cubin"])
            rows.append([name, usage["REG"], hashlib.sha256(compiled.asm["cubin"]).hexdigest()])
        binder = report.triton_binder_available(launch.kernel)
        print(json.dumps(dict(rows=rows, triton_binder=binder)))
    """
)

_TOY_KERNEL = textwrap.dedent(
    """
    import torch
    import triton
    import triton.language as tl


    @triton.jit(do_not_specialize=["d", 5], do_not_specialize_on_alignment=["e", "a"])
    def toy(a, b, c, d, e, f, g, h, i, N: tl.constexpr, M: tl.constexpr = 3):
        pass


    x = torch.empty(64, dtype=torch.float16)
    ARGS = [
        (x, x[1:], 1, 1, 32, 1, 2**40, 2.5, True),  # 1s with and without specialisation, an i64, a float, a bool
        (x[1:], x, 17, 32, 33, 0, -16, 1.0, torch.empty(4, dtype=torch.bool)),
        (torch.empty(8, dtype=torch.int32), torch.empty(8, dtype=torch.bfloat16), None, 2**31 + 16, 7, 48, 2**63, 0.0, 5),
    ]
    """
)


def _fresh_python(mode: str, cwd: Path, cache: Path) -> dict:
    env = dict(
        os.environ,
        TRITON_INTERPRET="0",
        TRITON_DEFAULT_FP_FUSION="1",
        TRITON_CACHE_DIR=str(cache),
        PYTHONPATH=os.pathsep.join([str(cwd), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, env=env, cwd=cwd, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_by_hand_specialization_matches_tritons_own(tmp_path):
    """specialize_by_hand gives what Triton's private binder gives (signature, constexprs, alignment attributes,
    options) for every launch the planners make over a matrix, and for a toy kernel with every argument kind
    (do_not_specialize by name and position, an unaligned pointer, 1, i64, u64, bool, None, a default)."""
    (tmp_path / "toy_kernel.py").write_text(_TOY_KERNEL)
    result = _fresh_python("same_specialization", tmp_path, tmp_path / "cache")
    assert result["diffs"] == [] and result["launches"] > 100


@pytest.mark.skipif(not report._tool("ptxas").exists(), reason="no ptxas to compile with")
def test_compile_without_tritons_private_binder_gives_the_same_cubin(tmp_path):
    """Decode's three kernels compiled for sm_90 twice, each in a fresh Python with its own cache: with Triton's
    binder, and with it deleted (compile_launch then binds by hand): the same registers, the same cubin."""
    private = _fresh_python("private", tmp_path, tmp_path / "cache-private")
    by_hand = _fresh_python("private_gone", tmp_path, tmp_path / "cache-by-hand")
    assert private["triton_binder"] is True and by_hand["triton_binder"] is False
    assert [r[:2] for r in by_hand["rows"]] == [r[:2] for r in private["rows"]]
    assert [r[0] for r in private["rows"]] == ["paged_decode", "paged_decode_split", "reduce_segments"]
    assert all(0 < r[1] <= 255 for r in private["rows"])
    assert by_hand["rows"] == private["rows"]  # byte for byte


# ---- the packed path meets a bounded set of row counts (oneDNN keeps a kernel per row count) --------------------
def test_packed_rows_rounds_up_by_at_most_an_eighth_to_few_sizes():
    sizes = [layers.packed_rows(m) for m in range(1, 8193)]
    assert sizes[:16] == list(range(1, 17))  # small batches (decodes) run as they are
    assert all(m <= p <= m + m // 8 for m, p in enumerate(sizes, start=1))
    assert sizes == sorted(sizes) and len(set(sizes)) == 16 + 8 * 9  # 8 sizes per octave from 16 to 8192


def test_the_packed_path_sees_few_row_counts_and_gives_the_unpadded_results(fresh_onednn, monkeypatch):
    """Every row count from 1 to 600 through forward, silu, mul and add: oneDNN is asked for at most
    16 + 8 × 6 row counts (each kernel it builds is kept: fewer counts, bounded memory), and each result is
    what plain PyTorch gives for the real rows."""
    ops = _real_ops_or_skip()
    seen: set[int] = set()

    def spy(op):
        def call(*args):
            seen.add(args[0].shape[0])
            return op(*args)

        return call

    namespace = SimpleNamespace(
        _reorder_linear_weight=ops.reorder, _linear_pointwise=_Counting(spy(ops.pointwise), spy(ops.binary))
    )
    monkeypatch.setattr(layers, "_mkldnn_namespace", lambda: namespace)
    torch.manual_seed(0)
    layer = layers.Linear(24, 40, bias=True)
    layers.onednn_ops()
    seen.clear()  # the probe's own tiny GEMM
    for m in range(1, 601):
        x, other = torch.randn(m, 24), torch.randn(m, 40)
        got = _all_results(layer, x, other)
        assert all(v.shape == (m, 40) for v in got.values())
        if m in (1, 17, 100, 333, 600):
            _assert_same(got, _plain_results(layer, x, other))
    assert layers._ONEDNN is True and len(seen) <= 16 + 8 * 6 and max(seen) == layers.packed_rows(600)
