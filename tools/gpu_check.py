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

``--steps`` runs some of the steps (``kernels,engine,monitor,report,bandwidth,bench``, in that order);
each step's outcome and time land in ``gpu_check.json``, merged with the steps of an earlier run on the same
device, so a short lease can take the steps in two calls. The tests run with the suite's own options except
nbval's (``-o addopts``): they are test files, not notebooks, and a CUDA image need not carry Jupyter.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "assets" / "benchmarks" / "gpu"
STEPS = ("kernels", "engine", "monitor", "report", "bandwidth", "bench")
# The suite's addopts without nbval's flags, which only notebooks need.
PYTEST = ["-m", "pytest", "-q", "-o", "addopts=-p no:cacheprovider"]


def run(title: str, cmd: list[str], env: dict[str, str] | None = None, cwd: Path = REPO) -> None:
    print(f"\n=== {title}\n$ {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, cwd=cwd, env={**os.environ, **(env or {})})
    if proc.returncode:
        raise SystemExit(f"gpu-check: {title} failed (exit {proc.returncode})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, from {', '.join(STEPS)}")
    args = ap.parse_args(argv)
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown or not steps:
        ap.error(f"--steps: unknown {', '.join(unknown)}; choose from {', '.join(STEPS)}")
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
    import triton

    OUT.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    arch = f"sm_{props.major}{props.minor}"
    report_arch = arch if arch in ("sm_80", "sm_90") else "sm_90"
    py = sys.executable

    def report() -> None:
        print(f"\n=== compile report for {report_arch}", flush=True)
        cmd = [py, "-m", "minipaged", "kernels", "--arch", report_arch, "--json"]
        rep = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        (OUT / f"kernels_{report_arch}.jsonl").write_text(rep.stdout)
        if rep.returncode:
            raise SystemExit(f"gpu-check: compile report failed or found spills:\n{rep.stderr[-2000:]}")

    actions: dict[str, Callable[[], None]] = {
        "kernels": lambda: run("kernel tests, compiled", [py, *PYTEST, "tests/test_kernels.py"]),
        "engine": lambda: run(
            "engine equality tests, Triton backend, CUDA graphs",
            [py, *PYTEST, "tests/test_engine_triton.py", "tests/test_engine.py", "tests/test_cuda_graphs.py"],
            env={"MINIPAGED_TEST_BACKEND": "triton"},
        ),
        "monitor": lambda: run(
            "engine events and the monitor, GPU pool",
            [py, *PYTEST, "tests/test_viz_monitor.py", "tests/test_events.py"],
        ),
        "report": report,
        "bandwidth": lambda: run(
            "paged attention bandwidth", [py, "benchmarks/bench_paged_attention.py", "--out-dir", str(OUT)]
        ),
        "bench": lambda: run(
            "engine vs transformers static batching",
            [
                py,
                "bench_engine.py",
                "--device",
                "cuda",
                "--dtype",
                "bfloat16",
                "--rounds",
                "1",
                "--levers",
                "cuda_graphs",
            ]
            + ["--out", str(OUT)],
            cwd=REPO / "benchmarks",
        ),
    }
    summary_path = OUT / "gpu_check.json"
    summary = dict(
        device=torch.cuda.get_device_name(0),
        arch=arch,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        triton=triton.__version__,
        steps={},
    )
    if summary_path.is_file():  # an earlier call's steps on the same device and software are kept
        old = json.loads(summary_path.read_text())
        if all(old.get(k) == summary[k] for k in ("device", "torch", "triton")):
            summary["steps"] = old.get("steps", {})
    for name in [s for s in STEPS if s in steps]:
        start = time.perf_counter()
        record = dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
        try:
            actions[name]()
            record["passed"] = True
        except SystemExit:
            record["passed"] = False
            raise
        finally:
            record["seconds"] = round(time.perf_counter() - start, 1)
            summary["steps"][name] = record  # type: ignore[index]
            summary_path.write_text(json.dumps(summary, indent=1) + "\n")
    done = [s for s in STEPS if summary["steps"].get(s, {}).get("passed")]  # type: ignore[attr-defined]
    missing = [s for s in STEPS if s not in done]
    print(f"\ngpu-check: {', '.join(steps)} passed on {summary['device']}; results in {OUT.relative_to(REPO)}")
    print("all steps passed: commit them" if not missing else f"still to run: {', '.join(missing)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
