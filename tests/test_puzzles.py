"""The puzzle ladder's harness (``minipaged.puzzles``) and the access trace it stands on (``kernels.trace``).

Right kernels written differently from the solution notebook's get "right" on every case; kernels with a
learner's mistake (``tests/mutants/ex05c.py``, ``ex05d.py``) get a verdict that names it: a stray read in the trace, a store
outside every tensor (refused before the interpreter touches memory), a wrong number. The figure shows the same.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from minipaged.classroom import puzzles
from minipaged.classroom.kernel_trace import AccessTrace
from minipaged.classroom.viz.layout import check_layout
from minipaged.classroom.viz.trace_viz import trace_figure

sys.path.insert(0, str(Path(__file__).parent))
import mutants.ex05c as M
import mutants.ex05d as H


@triton.jit
def scatter_kernel(key, cache, slot_mapping, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t)
    if slot >= 0:
        d = tl.arange(0, HEAD_DIM)
        tl.store(cache + slot * HEAD_DIM + d, tl.load(key + t * HEAD_DIM + d))  # the flat slot is the row


@triton.jit
def gather_kernel(cache, block_table, out, seq_len, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    i = tl.program_id(0)
    block = tl.load(block_table + i)
    s = tl.arange(0, BLOCK_SIZE)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    pos = i * BLOCK_SIZE + s
    x = tl.load(cache + (block * BLOCK_SIZE + s) * HEAD_DIM + d, mask=pos < seq_len)
    tl.store(out + pos * HEAD_DIM + d, x, mask=pos < seq_len)


@triton.jit
def gather_wrong_params(cache, table, out, seq_len, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    pass


@triton.jit
def _decode(query, key_cache, value_cache, block_tables, seq_lens, out, scale, table_stride,
            BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, RESCALE: tl.constexpr):  # fmt: skip
    i = tl.program_id(0)
    n = tl.load(seq_lens + i)
    d = tl.arange(0, HEAD_DIM)
    s = tl.arange(0, BLOCK_SIZE)
    q = tl.load(query + i * HEAD_DIM + d)
    m = tl.full((), float("-inf"), tl.float32)
    total = tl.full((), 0.0, tl.float32)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for b in range(0, tl.cdiv(n, BLOCK_SIZE)):
        block = tl.load(block_tables + i * table_stride + b)
        live = b * BLOCK_SIZE + s < n
        offs = (block * BLOCK_SIZE + s[:, None]) * HEAD_DIM + d[None, :]
        k = tl.load(key_cache + offs, mask=live[:, None], other=0.0)
        v = tl.load(value_cache + offs, mask=live[:, None], other=0.0)
        scores = tl.where(live, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        alpha = tl.exp(m - m_new) if RESCALE else 1.0
        p = tl.exp(scores - m_new)
        total = total * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    tl.store(out + i * HEAD_DIM + d, acc / total)


def decode_kernel(rescale: bool):
    """``_decode`` with the puzzle's parameters (RESCALE fixed), as a learner's kernel would have them."""

    class Bound:
        arg_names = puzzles.PUZZLES["decode"].params

        def __getitem__(self, grid):
            return lambda **kw: _decode[grid](**kw, RESCALE=rescale)

    return Bound()


@pytest.mark.parametrize(
    "name, kernel",
    [
        ("scatter", scatter_kernel),
        ("gather", gather_kernel),
        ("decode", decode_kernel(True)),
    ],
    ids=["scatter", "gather", "decode"],
)
def test_right_kernels_written_differently_are_right_on_every_case(name, kernel) -> None:
    """The solution notebook's kernels are graded in test_mutants.py; these differ from them in form."""
    for case in puzzles.PUZZLES[name].cases():
        result = puzzles.run(name, kernel, case)
        assert puzzles.verdict(result) == "right", case.label


def test_a_wrong_address_is_refused_before_the_interpreter_touches_it() -> None:
    result = puzzles.run("scatter", M.scatter_writes_padding, 1)  # slot -1 between two real tokens
    assert result.error.startswith("OutOfBounds: program (1, 0, 0): 16 lane(s) of a store fall outside")
    assert "element -16 of cache" in result.error
    assert puzzles.verdict(result) == result.error


def test_a_stray_read_is_named_and_drawn() -> None:
    result = puzzles.run("gather", M.gather_reads_block_tail, 0)  # 10 tokens: the last block holds 2 of 4
    assert result.max_error("out") == 0.0  # the output alone looks right: only the trace shows the mistake
    assert puzzles.verdict(result).startswith("loads 2 cache cell(s) a right kernel never touches")
    fig = trace_figure(result)
    assert check_layout(fig) == []
    stray = [t for t in fig.data if t.name == "✗ a right kernel never touches it"]
    assert len(stray) == 1 and len(stray[0].x) == 2
    assert "loads 2 cache cell(s)" in fig.layout.title.text


def test_a_missing_rescale_is_a_wrong_number() -> None:
    verdict = puzzles.verdict(puzzles.run("decode", decode_kernel(False), 0))
    assert verdict.startswith("out differs from the reference by up to")


def test_wrong_parameters_and_a_plain_function_are_named() -> None:
    got = puzzles.verdict(puzzles.run("gather", gather_wrong_params, 0))
    assert got == (
        "the kernel's parameters must be (cache, block_table, out, seq_len, BLOCK_SIZE, HEAD_DIM); yours are "
        "(cache, table, out, seq_len, BLOCK_SIZE, HEAD_DIM)"
    )
    assert "not a @triton.jit kernel" in puzzles.verdict(puzzles.run("gather", lambda *a: None, 0))


def test_the_trace_records_per_program_cells_and_counts() -> None:
    case = puzzles.PUZZLES["gather"].cases()[0]
    result = puzzles.run("gather", gather_kernel, case)
    by_program = result.trace.by_program("cache", "load")
    table = case.tensors["block_table"].tolist()
    assert by_program == {
        (0, 0, 0): {(table[0], s) for s in range(4)},
        (1, 0, 0): {(table[1], s) for s in range(4)},
        (2, 0, 0): {(table[2], s) for s in range(2)},
    }
    assert result.trace.count("cache", "load") == 10 * 16  # every element once, masked lanes not counted
    assert result.trace.count("out", "store") == 10 * 16


def test_traces_refuse_bad_tensors_and_nesting() -> None:
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        AccessTrace(x=torch.zeros(4, 4).T)
    with AccessTrace(x=torch.zeros(4)), pytest.raises(RuntimeError, match="cannot nest"):
        with AccessTrace(y=torch.zeros(4)):
            pass
    with AccessTrace(x=torch.zeros(4)):  # released after the error: a new trace starts
        pass


@triton.jit
def scatter_into_key(key, cache, slot_mapping, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A right scatter that also writes over its input (zeros into ``key``)."""
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t)
    d = tl.arange(0, HEAD_DIM)
    tl.store(cache + slot * HEAD_DIM + d, tl.load(key + t * HEAD_DIM + d))
    tl.store(key + t * HEAD_DIM + d, tl.zeros([HEAD_DIM], tl.float32))


def test_a_store_into_an_input_is_named() -> None:
    assert puzzles.verdict(puzzles.run("scatter", scatter_into_key, 0)) == (
        "stores into key, which the kernel must only read"
    )


def test_a_kernel_that_does_not_pack_is_right_but_reads_k_and_v_g_times() -> None:
    result = puzzles.run("gqa", H.gqa_head_by_head, 0)  # 8 query heads over 2 KV heads: G = 4
    assert result.max_error("out") < 1e-4
    once = (20 + 5 + 33) * 2 * 16
    assert puzzles.verdict(result) == (
        f"loads {4 * once:,} elements of key_cache, 4x the {once:,} a kernel reading each element once needs"
    )


def test_the_engine_check_fails_a_kernel_the_probes_catch(capsys) -> None:
    """A prefill kernel that ignores causality (and a decode stub) never get to serve: the part probes refuse the
    first, every engine check fails, naming the part."""
    from minipaged.classroom.grading import ex05d

    @triton.jit
    def stub(query, key_cache, value_cache, block_tables, seq_lens, out, scale, table_stride,
             NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, Q_ROWS: tl.constexpr,
             BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
        pass

    outcomes = ex05d.check_engine(stub, H.prefill_not_causal)
    assert [o.passed for o in outcomes] == [False, False, False]
    assert "PartError: part 'paged_decode_attention'" in outcomes[0].got
    assert capsys.readouterr().out.startswith("engine: 0/3 checks passed")


def test_puzzle_kernels_compile_for_a_gpu_and_a_broken_one_says_why() -> None:
    """``compile_kernels`` compiles a learner's kernel from its source, in a process with the interpreter off."""
    from minipaged.classroom.kernel_report import format_table

    @triton.jit
    def broken(cache, block_table, out, seq_len, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
        tl.store(out + tl.arange(0, HEAD_DIM), helper_nobody_defined(cache))  # noqa: F821

    rows = puzzles.compile_kernels({"scatter": scatter_kernel, "gather": broken}, archs=("sm_90",))
    assert [(r.kernel, r.arch, r.head_dim, r.block_size) for r in rows] == [
        ("scatter_kernel", "sm_90", 64, 16),
        ("broken", "sm_90", 64, 16),
    ]
    assert rows[0].error is None and rows[0].registers > 0 and rows[0].spill_bytes == 0
    assert rows[0].occupancy > 0
    assert rows[1].registers is None and "helper_nobody_defined" in rows[1].error
    assert "error: broken" in format_table(rows)


# ---- where the kernel runs: the interpreter here, compiled on CUDA tensors on a GPU -----------------------------
class _Recorder:
    """A stand-in for a @triton.jit kernel with a puzzle's parameters: records the device of every tensor it is
    launched with, then fails (a meta tensor has no data to compute with)."""

    def __init__(self, puzzle: str, error: str = "stop") -> None:
        self.arg_names = puzzles.PUZZLES[puzzle].params
        self.devices: list[torch.device] = []
        self.error = error

    def __getitem__(self, grid):
        def launch(**kwargs):
            self.devices += [v.device for v in kwargs.values() if isinstance(v, torch.Tensor)]
            self.options = {k: v for k, v in kwargs.items() if k not in self.arg_names}
            self.f32 = os.environ.get("TRITON_F32_DEFAULT")
            raise ValueError(self.error)

        return launch


def test_a_learners_fp32_dot_is_full_fp32_on_a_gpu_as_in_the_interpreter(monkeypatch) -> None:
    """On an NVIDIA GPU a plain ``tl.dot`` of fp32 tiles rounds them to TF32 (errors near 1e-3, ten times a puzzle's
    tolerance; seen on an H200: the GQA and prefill solutions failed). The harness launches inside
    ``learner_dots``: TRITON_F32_DEFAULT=ieee while the kernel compiles, and a launch option that keeps a copy
    compiled earlier in TF32 out of the way. Nothing changes on a CPU, and the variable is given back."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.backends.nvidia.compiler import CUDAOptions

    from minipaged.kernels import launch

    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    with launch.learner_dots(torch.device("cpu")) as options:
        assert options == {} and "TRITON_F32_DEFAULT" not in os.environ
    with launch.learner_dots(torch.device("cuda")) as options:
        assert options == {"default_dot_input_precision": "ieee"} and os.environ["TRITON_F32_DEFAULT"] == "ieee"
        assert get_cache_invalidating_env_vars().get("TRITON_F32_DEFAULT") == "ieee"  # part of the compile key
        assert (
            set(options) <= set(CUDAOptions.__dataclass_fields__) and "ieee" in CUDAOptions.allowed_dot_input_precisions
        )
    assert "TRITON_F32_DEFAULT" not in os.environ
    monkeypatch.setenv("TRITON_F32_DEFAULT", "tf32x3")  # a learner's own choice comes back afterwards
    with launch.learner_dots(torch.device("cuda")):
        pass
    assert os.environ["TRITON_F32_DEFAULT"] == "tf32x3"
    # The harness launches inside it: a "cuda" device here (the meta device carries the tensors)
    monkeypatch.delenv("TRITON_F32_DEFAULT")
    real = launch.learner_dots
    monkeypatch.setattr(launch, "kernel_device", lambda: torch.device("meta"))
    monkeypatch.setattr(launch, "learner_dots", lambda device: real(torch.device("cuda")))
    kernel = _Recorder("gqa")
    assert puzzles.run("gqa", kernel).error == "ValueError: stop"
    assert kernel.options == {"default_dot_input_precision": "ieee"} and kernel.f32 == "ieee"
    assert "TRITON_F32_DEFAULT" not in os.environ


@pytest.mark.parametrize("name", list(puzzles.PUZZLES))
def test_every_tensor_goes_to_the_kernel_device(name, monkeypatch) -> None:
    """On a GPU (``kernel_device()`` says cuda) the harness builds every input there, and there is no trace; the
    meta device stands in for cuda here: a tensor left on the CPU would show as one."""
    from minipaged.kernels import launch

    monkeypatch.setattr(launch, "kernel_device", lambda: torch.device("meta"))
    for case in puzzles.PUZZLES[name].cases():
        kernel = _Recorder(name)
        result = puzzles.run(name, kernel, case)
        assert result.trace is None and result.error == "ValueError: stop"
        tensors = len(case.tensors)
        assert kernel.devices == [torch.device("meta")] * tensors, case.label


def test_a_cpu_tensor_given_to_a_compiled_kernel_is_reported_without_the_puzzles_hint(capsys) -> None:
    from minipaged.classroom.grading import ex05c
    from minipaged.kernels.launch import DEVICE_PROBLEM

    outcomes = ex05c.check_scatter(
        _Recorder("scatter", "Pointer argument cannot be accessed from Triton (cpu tensor?)")
    )
    assert not any(o.passed for o in outcomes)
    assert all(o.got.startswith(DEVICE_PROBLEM) and "(cpu tensor?)" in o.got for o in outcomes)
    printed = capsys.readouterr().out
    assert "hint" not in printed and ex05c.HINTS["scatter"] not in printed


def test_without_a_trace_the_verdict_rests_on_outputs_inputs_and_guards() -> None:
    """What a GPU checks (no trace), tried in the interpreter with the trace off: a store before the cache or into
    an input is still named from the guarded buffers; a stray read whose value is thrown away cannot be seen."""

    for name, kernel in (("scatter", scatter_kernel), ("gather", gather_kernel), ("decode", decode_kernel(True))):
        for case in puzzles.PUZZLES[name].cases():
            assert puzzles.verdict(puzzles.run(name, kernel, case, trace=False)) == "right", case.label
    padded = puzzles.run("scatter", M.scatter_writes_padding, 1, trace=False)
    assert padded.trace is None
    assert puzzles.verdict(padded) == "stores outside every tensor: into the memory just before cache"
    assert puzzles.verdict(puzzles.run("scatter", scatter_into_key, 0, trace=False)) == (
        "stores into key, which the kernel must only read"
    )
    assert puzzles.verdict(puzzles.run("gather", M.gather_reads_block_tail, 0, trace=False)) == "right"
    assert puzzles.verdict(puzzles.run("decode", decode_kernel(False), 0, trace=False)).startswith("out differs")
