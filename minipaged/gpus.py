"""The GPUs the course meets, in one table: what each datasheet promises, and the per-architecture limits.

Every figure the package quotes about a GPU comes from here: the simulator's cost model (``lab.simulator``), the
bandwidth benchmark's peak (``benchmarks/bench_paged_attention.py``), the occupancy rules of the kernel report
(``classroom.kernel_report``) and chapter 05's roofline. A learner meets four of them: the T4 of a hosted notebook,
and the A100, H100 and H200 of a lab server::

    from minipaged.gpus import GPUS, by_device_name
    GPUS["t4"].bandwidth_gbps                        # 320.0
    by_device_name(torch.cuda.get_device_name())     # the row of the GPU you are on, or None

**Peak, dense, decimal.** ``bandwidth_gbps`` is the datasheet's peak memory bandwidth in GB/s (10⁹ bytes a
second); a kernel reaches 80-90 % of it at best. ``fp16_tflops`` is the *dense* 16-bit tensor-core peak: the A100,
H100 and H200 datasheets print a figure "with sparsity" (2:4 structured sparsity, which dense attention and
GEMMs do not use) beside or instead of it, twice the dense one; the T4 (Turing) has no sparsity mode, so its figure
is dense. ``memory_gb`` is the marketed size in decimal GB; ``memory_mib`` is what the device reports as its
total (``nvidia-smi``'s ``memory.total``, in MiB = 2²⁰ bytes), where known: an "80 GB" H100 reports 81,559 MiB =
79.6 GiB, a "16 GB" T4 reports 15,360 MiB = 15.0 GiB. ``torch.cuda`` may say a little less again
(``get_device_properties(0).total_memory``: 15,102 MiB on a T4).

Imports nothing from the package: any layer may read it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["ARCHS", "COURSE_GPUS", "GPU", "GPUS", "Arch", "arch_of", "by_arch", "by_device_name"]


@dataclass(frozen=True)
class Arch:
    """What one compute capability gives each SM: the limits of the CUDA occupancy rules.

    From the CUDA C++ Programming Guide, "Compute Capabilities" (technical specifications per compute
    capability) and the CUDA occupancy calculator's allocation units. A program is a thread block.
    """

    arch: str  # "sm_75"
    family: str  # "Turing", "Ampere", "Ada", "Hopper"
    max_warps: int  # resident warps per SM
    max_programs: int  # resident thread blocks per SM
    registers: int  # 32-bit registers per SM
    shared_per_sm: int  # bytes of shared memory per SM
    shared_per_program: int  # bytes one thread block may use
    shared_reserved: int  # bytes the runtime keeps per thread block (1 KiB from sm_80 on, none on sm_75)
    shared_alloc_unit: int  # shared memory is handed out in units of this many bytes
    bf16_tensor_cores: bool  # native bfloat16 tensor cores (sm_80 and up); a T4 emulates bfloat16

    @property
    def capability(self) -> tuple[int, int]:
        """(major, minor), as ``torch.cuda.get_device_capability()`` gives it."""
        digits = self.arch.removeprefix("sm_")
        return int(digits[:-1]), int(digits[-1])


ARCHS: dict[str, Arch] = {
    a.arch: a
    for a in (
        # Turing: half the warps and programs of sm_80, 64 KiB of shared memory, none of it reserved by the
        # runtime, handed out 256 bytes at a time.
        Arch("sm_75", "Turing", 32, 16, 65536, 65536, 65536, 0, 256, False),
        Arch("sm_80", "Ampere", 64, 32, 65536, 167936, 166912, 1024, 128, True),  # 164 KiB / 163 KiB
        Arch("sm_86", "Ampere", 48, 16, 65536, 102400, 101376, 1024, 128, True),  # 100 KiB / 99 KiB
        Arch("sm_89", "Ada", 48, 24, 65536, 102400, 101376, 1024, 128, True),
        Arch("sm_90", "Hopper", 64, 32, 65536, 233472, 232448, 1024, 128, True),  # 228 KiB / 227 KiB
    )
}


def arch_of(major: int, minor: int) -> str:
    """The arch name of a compute capability: ``arch_of(*torch.cuda.get_device_capability())`` -> "sm_75"."""
    return f"sm_{major}{minor}"


@dataclass(frozen=True)
class GPU:
    """One GPU as its datasheet gives it (peak figures), and how ``torch.cuda.get_device_name()`` spells it."""

    key: str  # "t4", "a100", "h100", "h200", ...
    name: str  # as the course writes it
    device_names: tuple[str, ...]  # spellings in torch.cuda.get_device_name(), matched as whole words
    arch: str  # a key of ARCHS
    bandwidth_gbps: float  # peak memory bandwidth, GB/s (10^9 bytes/s)
    memory_gb: float | None = None  # marketed size, decimal GB
    memory_type: str = ""  # "GDDR6", "HBM3", ...
    memory_mib: int | None = None  # nvidia-smi's memory.total, MiB (2^20 bytes); None where not known here
    fp16_tflops: float | None = None  # dense fp16 tensor-core peak, TFLOP/s (10^12)
    sms: int | None = None  # streaming multiprocessors
    pcie_gbps: float | None = None  # host link, GB/s in one direction (datasheets give both directions summed)
    source: str = ""  # where the figures come from

    @property
    def warps_per_sm(self) -> int:
        """Resident warps an SM can hold (its architecture's limit)."""
        return ARCHS[self.arch].max_warps

    @property
    def bf16_tensor_cores(self) -> bool:
        return ARCHS[self.arch].bf16_tensor_cores

    @property
    def memory_gib(self) -> float | None:
        """What the device reports, in GiB (2^30 bytes), where known."""
        return None if self.memory_mib is None else self.memory_mib / 1024

    @property
    def memory_bytes(self) -> int:
        """What the device reports, in bytes: an "80 GB" H100's 81,559 MiB are 85.5e9 B, 79.6 GiB."""
        if self.memory_mib is None:
            raise ValueError(f"the table of GPUs has no reported memory size for {self.name}")
        return self.memory_mib * 2**20

    @property
    def ridge_point(self) -> float | None:
        """FLOP per byte read at which the dense fp16 peak and the bandwidth peak meet (the roofline's ridge)."""
        return None if self.fp16_tflops is None else self.fp16_tflops * 1e12 / (self.bandwidth_gbps * 1e9)

    @property
    def memory(self) -> str:
        """The marketed size and type, e.g. "16 GB GDDR6"."""
        return f"{self.memory_gb:g} GB {self.memory_type}".strip() if self.memory_gb is not None else ""


GPUS: dict[str, GPU] = {
    g.key: g
    for g in (
        # The four the course compares. Their datasheets, by title (each the SXM or PCIe column named):
        #
        # NVIDIA T4 Tensor Core GPU (Turing, PCIe Gen3 x16): "Mixed Precision (FP16/FP32) 65 TFLOPS" (dense:
        # Turing has no sparsity mode), 16 GB GDDR6, 320 Turing tensor cores on 40 SMs, "Interconnect Bandwidth
        # 32 GB/sec" (both directions). Bandwidth: the T4 product page says "320+ GB/s" and the T4 board product
        # brief "up to 320 GBytes/s" (5,001 MHz GDDR6 on a 256-bit bus); the datasheet's own table rounds it to
        # "300 GB/sec". We use 320, the peak the memory's clock and bus give. No native bfloat16.
        GPU("t4", "T4 16 GB", ("T4",), "sm_75", 320.0, 16, "GDDR6", 15360, 65.0, 40, 16.0,
            "NVIDIA T4 Tensor Core GPU datasheet; T4 product page (320+ GB/s)"),
        # NVIDIA A100 Tensor Core GPU datasheet, "A100 80GB SXM" column: GPU memory bandwidth 2,039 GB/s (HBM2e);
        # "BF16 Tensor Core 312 TFLOPS | 624 TFLOPS*" and the same for FP16, * with sparsity: 312 is dense.
        # PCIe Gen4 64 GB/s (both directions). 108 SMs (NVIDIA A100 Tensor Core GPU Architecture whitepaper).
        GPU("a100", "A100-SXM4 80 GB", ("A100-SXM4-80GB", "A100 SXM4 80GB"), "sm_80", 2039.0, 80, "HBM2e",
            81920, 312.0, 108, 32.0, "NVIDIA A100 Tensor Core GPU datasheet (80 GB SXM column)"),
        # NVIDIA H100 Tensor Core GPU datasheet, "H100 SXM" column: 80 GB, GPU memory bandwidth 3.35 TB/s (HBM3);
        # "FP16 Tensor Core 1,979 teraFLOPS" and "BF16 Tensor Core 1,979 teraFLOPS", both with sparsity (the
        # footnote): dense is half. The NVIDIA H100 Tensor Core GPU Architecture whitepaper prints 1,978.9 sparse,
        # 989.4 dense; the table keeps 989 (what the course's simulator has always used). PCIe Gen5 128 GB/s
        # (both directions). 132 SMs.
        GPU("h100", "H100-SXM5 80 GB", ("H100 80GB HBM3", "H100 SXM5", "H100 SXM", "H100"), "sm_90", 3350.0, 80,
            "HBM3", 81559, 989.0, 132, 64.0, "NVIDIA H100 Tensor Core GPU datasheet (SXM column)"),
        # NVIDIA H200 Tensor Core GPU datasheet, "H200 SXM" column: 141 GB HBM3e, 4.8 TB/s; FP16 and BF16 Tensor
        # Core 1,979 TFLOPS with sparsity (the same Hopper die as the H100 SXM: 989 dense, 132 SMs); PCIe Gen5
        # 128 GB/s (both directions). nvidia-smi's total: 143,771 MiB (seen on an H200 NVL, the same memory).
        GPU("h200", "H200 141 GB", ("H200",), "sm_90", 4800.0, 141, "HBM3e", 143771, 989.0, 132, 64.0,
            "NVIDIA H200 Tensor Core GPU datasheet (SXM column)"),
        # Other GPUs the bandwidth benchmark may run on: datasheet peak bandwidth, marketed memory and the
        # architecture (for its warps per SM); nvidia-smi's total where a published nvidia-smi listing gives it.
        GPU("h200-nvl", "H200 NVL", ("H200 NVL",), "sm_90", 4800.0, 141, "HBM3e", 143771,
            source="NVIDIA H200 Tensor Core GPU datasheet (NVL column)"),
        GPU("h100-nvl", "H100 NVL", ("H100 NVL",), "sm_90", 3900.0, 94, "HBM3",
            source="NVIDIA H100 Tensor Core GPU datasheet (NVL column)"),
        GPU("h100-pcie", "H100 PCIe", ("H100 PCIe",), "sm_90", 2000.0, 80, "HBM2e",
            source="NVIDIA H100 Tensor Core GPU datasheet (PCIe column)"),
        GPU("gh200", "GH200 96 GB", ("GH200",), "sm_90", 4000.0, 96, "HBM3",
            source="NVIDIA GH200 Grace Hopper Superchip datasheet"),
        GPU("gh200-144gb", "GH200 144 GB", ("GH200 144G HBM3e",), "sm_90", 4900.0, 144, "HBM3e",
            source="NVIDIA GH200 Grace Hopper Superchip datasheet (HBM3e)"),
        GPU("a100-80gb-pcie", "A100 80 GB PCIe", ("A100 80GB PCIe", "A100-PCIE-80GB"), "sm_80", 1935.0, 80,
            "HBM2e", source="NVIDIA A100 Tensor Core GPU datasheet (80 GB PCIe column)"),
        GPU("a100-40gb", "A100 40 GB", ("A100",), "sm_80", 1555.0, 40, "HBM2", 40960,
            source="NVIDIA A100 Tensor Core GPU datasheet (40 GB columns)"),
        GPU("l40s", "L40S", ("L40S",), "sm_89", 864.0, 48, "GDDR6", 46068, source="NVIDIA L40S datasheet"),
        GPU("l4", "L4", ("L4",), "sm_89", 300.0, 24, "GDDR6", 23034, source="NVIDIA L4 Tensor Core GPU datasheet"),
        GPU("a10g", "A10G", ("A10G",), "sm_86", 600.0, 24, "GDDR6",
            source="AWS EC2 G5 instance specifications; bandwidth as the A10's"),
        GPU("a10", "A10", ("A10",), "sm_86", 600.0, 24, "GDDR6", source="NVIDIA A10 Tensor Core GPU datasheet"),
        GPU("rtx-4090", "GeForce RTX 4090", ("RTX 4090",), "sm_89", 1008.0, 24, "GDDR6X",
            source="NVIDIA GeForce RTX 4090 specifications"),
        GPU("rtx-3090", "GeForce RTX 3090", ("RTX 3090",), "sm_86", 936.0, 24, "GDDR6X",
            source="NVIDIA GeForce RTX 3090 specifications"),
    )
}  # fmt: skip

COURSE_GPUS = ("t4", "a100", "h100", "h200")  # the four every table of the course shows, smallest first


def _spelled(spelling: str, name: str) -> bool:
    """``spelling`` stands in ``name`` as whole words: "A10" is not in "A100", "L4" not in "L40S", "H200" not in
    "GH200"."""
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(spelling)}(?![A-Za-z0-9])", name, re.IGNORECASE) is not None


def by_device_name(name: str) -> GPU | None:
    """The row of ``torch.cuda.get_device_name()``'s answer ("Tesla T4", "NVIDIA H100 80GB HBM3"), or None.

    The longest spelling that matches wins: "NVIDIA H100 PCIe" is the PCIe row, not the SXM one that "H100"
    alone names."""
    found = [(len(s), g) for g in GPUS.values() for s in g.device_names if _spelled(s, name)]
    return max(found, key=lambda pair: pair[0])[1] if found else None


def by_arch(arch: str) -> list[GPU]:
    """The rows of one architecture ("sm_90": the H100s, H200s and GH200), in the table's order."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(ARCHS)}")
    return [g for g in GPUS.values() if g.arch == arch]
