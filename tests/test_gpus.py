"""The package's one table of GPUs (minipaged.gpus): the datasheet figures, the lookups, and its readers.

The simulator's cost model, the bandwidth benchmark's peak and the kernel report's occupancy limits all read this
table; a figure copied elsewhere would drift from it."""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

from minipaged import gpus
from minipaged.gpus import ARCHS, COURSE_GPUS, GPUS, arch_of, by_arch, by_device_name

REPO = Path(__file__).resolve().parents[1]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "bench_paged_attention", REPO / "benchmarks" / "bench_paged_attention.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# (key, arch, memory GB, nvidia-smi MiB, GB/s, dense fp16 TFLOP/s, SMs, warps per SM, bf16 tensor cores)
DATASHEETS = [
    ("t4", "sm_75", 16, 15360, 320.0, 65.0, 40, 32, False),  # NVIDIA T4: 320+ GB/s, 65 FP16 TFLOPS, 16 GB
    ("a100", "sm_80", 80, 81920, 2039.0, 312.0, 108, 64, True),  # A100 80GB SXM: 2,039 GB/s, 312 (624 sparse)
    ("h100", "sm_90", 80, 81559, 3350.0, 989.0, 132, 64, True),  # H100 SXM: 3.35 TB/s, 1,979 sparse
    ("h200", "sm_90", 141, 143771, 4800.0, 989.0, 132, 64, True),  # H200 SXM: 141 GB, 4.8 TB/s, 1,979 sparse
]


@pytest.mark.parametrize("key, arch, gb, mib, gbps, tflops, sms, warps, bf16", DATASHEETS, ids=lambda v: str(v))
def test_the_course_gpus_hold_their_datasheet_figures(key, arch, gb, mib, gbps, tflops, sms, warps, bf16):
    g = GPUS[key]
    assert (g.arch, g.memory_gb, g.memory_mib, g.bandwidth_gbps, g.fp16_tflops, g.sms) == (
        arch,
        gb,
        mib,
        gbps,
        tflops,
        sms,
    )
    assert (g.warps_per_sm, g.bf16_tensor_cores) == (warps, bf16)
    assert g.ridge_point == pytest.approx(tflops * 1e12 / (gbps * 1e9))
    assert g.memory_gib == pytest.approx(mib / 1024)
    assert g.source and ("datasheet" in g.source)
    assert COURSE_GPUS == ("t4", "a100", "h100", "h200")


def test_reported_memory_is_gib_and_below_the_marketed_gb():
    assert GPUS["h100"].memory_gib == pytest.approx(79.65, abs=0.01)  # 81,559 MiB of an "80 GB" card
    assert GPUS["t4"].memory_gib == 15.0  # 15,360 MiB of a "16 GB" card
    for g in GPUS.values():
        if g.memory_mib is not None and g.memory_gb is not None:
            assert g.memory_mib * 2**20 <= g.memory_gb * 1e9 * 1.08, g.key  # close to what is sold, never far over


@pytest.mark.parametrize(
    "device_name, key",
    [
        ("Tesla T4", "t4"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA H100 PCIe", "h100-pcie"),  # the longest spelling wins over "H100"
        ("NVIDIA H100 NVL", "h100-nvl"),
        ("NVIDIA H200 NVL", "h200-nvl"),
        ("NVIDIA GH200 480GB", "gh200"),  # "H200" is not a word of "GH200"
        ("NVIDIA A100-PCIE-40GB", "a100-40gb"),
        ("NVIDIA A100 80GB PCIe", "a100-80gb-pcie"),
        ("NVIDIA A10", "a10"),  # "A10" is not in "A100", nor "A100" in "A10"
        ("NVIDIA A10G", "a10g"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA L40S", "l40s"),  # nor "L4" in "L40S"
        ("nvidia h100 80gb hbm3", "h100"),  # case does not matter
    ],
)
def test_lookup_by_torch_device_name(device_name, key):
    found = by_device_name(device_name)
    assert found is not None and found.key == key


@pytest.mark.parametrize("device_name", ["NVIDIA GeForce GTX 1080", "NVIDIA L40", "NVIDIA T400", "cpu", ""])
def test_an_unknown_device_name_finds_nothing(device_name):
    assert by_device_name(device_name) is None


def test_lookup_by_arch():
    assert [g.key for g in by_arch("sm_75")] == ["t4"]
    assert {"h100", "h200"} <= {g.key for g in by_arch("sm_90")}
    assert all(g.arch in ARCHS for g in GPUS.values())  # every row has its architecture's limits
    assert arch_of(7, 5) == "sm_75" and ARCHS["sm_90"].capability == (9, 0)
    assert (ARCHS["sm_75"].max_warps, ARCHS["sm_80"].max_warps, ARCHS["sm_90"].max_warps) == (32, 64, 64)
    with pytest.raises(ValueError, match="unknown arch"):
        by_arch("sm_42")


def test_the_table_imports_nothing_from_the_package():
    tree = ast.parse(Path(gpus.__file__).read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m.startswith("minipaged") or m.startswith(".")]
    assert all(n.level == 0 for n in ast.walk(tree) if isinstance(n, ast.ImportFrom))


# ---- its readers --------------------------------------------------------------------------------------------
def test_the_simulator_reads_the_table():
    from minipaged.lab.simulator import HARDWARE, Hardware, gpu_hardware

    for key in COURSE_GPUS:
        g, hw = GPUS[key], HARDWARE[key]
        assert g.fp16_tflops is not None and g.pcie_gbps is not None and g.memory_gb is not None
        assert (hw.name, hw.mem_bandwidth, hw.flops) == (g.name, g.bandwidth_gbps * 1e9, g.fp16_tflops * 1e12)
        # the memory the device reports (nvidia-smi's MiB), not the marketed decimal GB: an "80 GB" H100 holds 85.5e9 B
        assert (hw.swap_bandwidth, hw.memory_bytes) == (g.pcie_gbps * 1e9, g.memory_mib * 2**20)
        assert gpu_hardware(key) == hw
    # the entries the chapters' checked outputs were computed with, to the last bit
    assert HARDWARE["a100"] == Hardware("A100-SXM4 80 GB", 2.039e12, 312e12, 32e9, 81920 * 2**20, 5e-6)
    assert HARDWARE["h100"] == Hardware("H100-SXM5 80 GB", 3.35e12, 989e12, 64e9, 81559 * 2**20, 5e-6)
    with pytest.raises(ValueError, match="no FLOP/s"):
        gpu_hardware("l4")  # a row with bandwidth only


def test_the_benchmark_reads_the_table():
    bench = _bench()
    assert not hasattr(bench, "PEAK_GBPS")  # no table of its own
    for name in ("Tesla T4", "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA L4"):
        found = by_device_name(name)
        assert found is not None and bench.peak_for(name) == found.bandwidth_gbps
    assert bench.peak_for("NVIDIA GeForce GTX 1080") is None


def test_the_kernel_report_reads_the_table():
    from minipaged.classroom import kernel_report as report

    assert report.ARCH_LIMITS is ARCHS
    assert report.occupancy("sm_75", 30, 0, 4) == GPUS["t4"].warps_per_sm == 32
    assert report.occupancy("sm_90", 32, 0, 4) == GPUS["h100"].warps_per_sm == 64


def test_the_benchmark_point_the_chapter_calls_runs_on_a_cpu():
    """Chapter 05's live sweep calls the benchmark's run_point; here it runs in the interpreter on a tiny shape."""
    bench = _bench()
    setup = bench.DecodeSetup(torch.device("cpu"), torch.float32, q_heads=4, kv_heads=2, head_dim=64)
    row = bench.run_point(setup, 1, 40, 16, peak=GPUS["t4"].bandwidth_gbps, with_sdpa=False)
    assert row["kv_bytes"] == setup.kv_bytes(1, 40) == 40 * 2 * 64 * 2 * 4
    assert row["paged_equals_contiguous"] and row["paged_gbps"] > 0
    assert row["paged_frac_peak"] == pytest.approx(row["paged_gbps"] / 320.0)


def test_the_bandwidth_figure_labels_each_machine_and_divides_by_its_own_peak():
    import matplotlib

    matplotlib.use("Agg")
    from minipaged.classroom.viz.kernel_viz import BandwidthSeries, bandwidth_runs_figure
    from minipaged.classroom.viz.layout import check_mpl_layout

    path = REPO / "assets" / "benchmarks" / "gpu" / "paged_attention_nvidia-h100-80gb-hbm3.json"
    recorded = BandwidthSeries.from_result(json.loads(path.read_text()), batch=32)
    assert recorded.label == "NVIDIA H100 80GB HBM3, 2026-11-25 (recorded)"
    assert recorded.peak_gbps == GPUS["h100"].bandwidth_gbps and recorded.fractions is not None
    assert list(recorded.kv_bytes) == sorted(recorded.kv_bytes) and len(recorded.kv_bytes) >= 3
    rows = [dict(batch=32, kv_bytes=2**26 * k, paged_gbps=80.0 * k) for k in (1, 2, 4)]
    t4 = BandwidthSeries.from_rows("Tesla T4", "2026-12-01T10:00:00+00:00", rows, "this run")
    assert t4.date == "2026-12-01" and t4.fractions == (0.25, 0.5, 1.0)
    unknown = BandwidthSeries.from_rows("NVIDIA GeForce GTX 1080", "2026-12-01", rows, "this run")
    assert unknown.peak_gbps is None and unknown.fractions is None
    fig = bandwidth_runs_figure([recorded, t4, unknown], title="paged decode attention")
    assert check_mpl_layout(fig) == []
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == [
        "NVIDIA H100 80GB HBM3, 2026-11-25 (recorded): peak 3,350 GB/s",
        "Tesla T4, 2026-12-01 (this run): peak 320 GB/s",
        "NVIDIA GeForce GTX 1080, 2026-12-01 (this run): peak not in minipaged.gpus",
    ]
    left, right = fig.axes
    assert len(left.lines) == 5  # three machines, and the peaks of the two the table knows, dashed
    assert len(right.lines) == 3  # the two machines with a known peak, and the 80 % line
    assert bandwidth_runs_figure([recorded]).axes[0].get_ylabel()
