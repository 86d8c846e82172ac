"""``make gpu-check``: everything that needs a real NVIDIA GPU, in one command.

On a machine with CUDA it runs, in order, and stops at the first failure:

1. the kernel tests compiled on the GPU (``tests/test_kernels.py``: every kernel against the
   PyTorch reference, bf16 included, which the CPU interpreter cannot run);
2. the engine's equality tests on the Triton backend (``tests/test_engine_triton.py``,
   and ``tests/test_engine.py`` with ``MINIPAGED_TEST_BACKEND=triton``: token for token
   against transformers, preemption and prefix caching included);
3. the engine's events and ``EngineMonitor`` on an engine whose pool is on the GPU
   (``tests/test_viz_monitor.py``, ``tests/test_events.py``);
4. the compile report for this GPU's own architecture (registers, spills, occupancy);
5. ``benchmarks/bench_paged_attention.py`` (decode bandwidth against peak, paged vs contiguous);
6. ``benchmarks/bench_engine.py --device cuda --dtype bfloat16`` (the engine against static
   batching with transformers, same workload, same run).

Results (JSON and plots, with the device name and date) go to ``assets/benchmarks/gpu/``;
commit them. Without CUDA it says so and exits 1: none of these figures can be made up.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "assets" / "benchmarks" / "gpu"


def run(title: str, cmd: list[str], env: dict[str, str] | None = None, cwd: Path = REPO) -> None:
    print(f"\n=== {title}\n$ {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, cwd=cwd, env={**os.environ, **(env or {})})
    if proc.returncode:
        raise SystemExit(f"gpu-check: {title} failed (exit {proc.returncode})")


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print(
            "gpu-check needs an NVIDIA GPU with CUDA, and this machine has none "
            f"(torch {torch.__version__}, torch.cuda.is_available() is False). Run it where a GPU is, with a "
            "CUDA build of torch; on this machine `python -m minipaged kernels` compiles the kernels for "
            "sm_80/sm_90 and reads their registers and spills without one.",
            file=sys.stderr,
        )
        return 1
    OUT.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    arch = f"sm_{props.major}{props.minor}"
    py = sys.executable
    run("kernel tests, compiled", [py, "-m", "pytest", "-q", "tests/test_kernels.py"])
    run(
        "engine equality tests, Triton backend",
        [py, "-m", "pytest", "-q", "tests/test_engine_triton.py", "tests/test_engine.py"],
        env={"MINIPAGED_TEST_BACKEND": "triton"},
    )
    run(
        "engine events and the monitor, GPU pool",
        [py, "-m", "pytest", "-q", "tests/test_viz_monitor.py", "tests/test_events.py"],
    )
    report_arch = arch if arch in ("sm_80", "sm_90") else "sm_90"
    print(f"\n=== compile report for {report_arch}", flush=True)
    rep = subprocess.run(
        [py, "-m", "minipaged", "kernels", "--arch", report_arch, "--json"], cwd=REPO, capture_output=True, text=True
    )
    (OUT / f"kernels_{report_arch}.jsonl").write_text(rep.stdout)
    if rep.returncode:
        raise SystemExit(f"gpu-check: compile report failed or found spills:\n{rep.stderr[-2000:]}")
    run("paged attention bandwidth", [py, "benchmarks/bench_paged_attention.py", "--out-dir", str(OUT)])
    run(
        "engine vs transformers static batching",
        [py, "bench_engine.py", "--device", "cuda", "--dtype", "bfloat16", "--rounds", "1", "--out", str(OUT)],
        cwd=REPO / "benchmarks",
    )
    (OUT / "gpu_check.json").write_text(
        json.dumps(
            dict(
                device=torch.cuda.get_device_name(0),
                arch=arch,
                date=dt.datetime.now(dt.timezone.utc).isoformat(),
                torch=torch.__version__,
                cuda=torch.version.cuda,
            ),
            indent=1,
        )
        + "\n"
    )
    print(f"\ngpu-check passed on {torch.cuda.get_device_name(0)}; results in {OUT.relative_to(REPO)}: commit them")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
