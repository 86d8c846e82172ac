"""Scheduler overhead: microseconds per ``schedule()`` and per ``update_from_output()`` call.

The scheduler runs on the CPU between two forward passes, in pure Python here as
in vLLM, so its cost is pure overhead on every step. The workload, per point:

    N requests with distinct 128-token prompts (ignore_eos, effectively endless), all
    admitted and prefilled first; then T steady-state decode steps: each step every
    request gets one token and, every 16 tokens, a new 16-token block.

Each step is timed in two parts: ``schedule()`` (budget, seats, ``allocate_slots``,
block tables) and ``update_from_output()`` (append the sampled token, hash full
blocks when prefix caching is on, finish checks). Reported: the median over the
steps of a run, best of ``--repeat`` runs; N = 256 is the headline (vLLM's default
``max_num_seqs``). The peer in the same run is the work the overhead sits beside:
the cost model's step time for Llama-3-8B on an H100-like GPU with the same batch
(``minipaged.simulator.CostModel``), so the JSON also says what fraction of a step
the scheduler would add if it did not overlap with the GPU.

Results: ``assets/benchmarks/scheduler.json`` and ``scheduler.png``.

    python benchmarks/bench_scheduler.py
    python benchmarks/bench_scheduler.py --running 256 --steps 2000 --repeat 5
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import machine  # noqa: E402  (benchmarks/common.py: run as a script from this folder)

from minipaged import __version__  # noqa: E402
from minipaged.core.kv_cache_manager import KVCacheManager  # noqa: E402
from minipaged.core.request import Request  # noqa: E402
from minipaged.core.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from minipaged.lab.simulator import CostModel, fake_samples  # noqa: E402
from minipaged.sampling_params import SamplingParams  # noqa: E402

PROMPT_LEN = 128
BLOCK_SIZE = 16


def setup(num_running: int, caching: bool, steps: int) -> Scheduler:
    """N requests admitted and prefilled: from the next step on, every step is N decodes."""
    max_len = PROMPT_LEN + steps + 64
    num_blocks = num_running * (-(-max_len // BLOCK_SIZE)) + 2
    kv = KVCacheManager(BLOCK_SIZE, num_blocks, enable_caching=caching, watermark=0.0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=num_running, max_num_batched_tokens=8192, max_model_len=max_len), kv)
    for i in range(num_running):
        prompt = [1 + i] + [(7 * i + j) % 32000 for j in range(1, PROMPT_LEN)]
        sched.add_request(
            Request(f"r{i}", prompt, sampling_params=SamplingParams(max_tokens=steps + 32, ignore_eos=True))
        )
    step = 0
    while any(r.num_output_tokens == 0 for r in sched.requests.values()):
        out = sched.schedule()
        step += 1
        sched.update_from_output(out, fake_samples(out, 5), now=float(step))
    assert len(sched.running) == num_running and not sched.waiting
    return sched


def measure(num_running: int, caching: bool, steps: int) -> dict:
    sched = setup(num_running, caching, steps)
    t_sched, t_update = [], []
    perf = time.perf_counter
    for step in range(steps):
        t0 = perf()
        out = sched.schedule()
        t1 = perf()
        sampled = fake_samples(out, 5)  # the "model": not timed
        t2 = perf()
        sched.update_from_output(out, sampled, now=float(step))
        t3 = perf()
        assert len(out.scheduled) == num_running and not out.preempted
        t_sched.append(t1 - t0)
        t_update.append(t3 - t2)
    ctx = statistics.mean(r.num_tokens for r in sched.running)
    return {
        "schedule_us": statistics.median(t_sched) * 1e6,
        "update_us": statistics.median(t_update) * 1e6,
        "schedule_us_mean": statistics.mean(t_sched) * 1e6,
        "update_us_mean": statistics.mean(t_update) * 1e6,
        "mean_context_tokens": ctx,
    }


def versions() -> dict:
    import numpy
    import torch

    return {
        "minipaged": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=110)
    for caching, style in ((True, "-"), (False, "--")):
        pts = [p for p in result["results"] if p["caching"] == caching]
        ns = [p["running"] for p in pts]
        tag = "caching on" if caching else "caching off"
        ax.plot(
            ns, [p["schedule_us"] / 1e3 for p in pts], style, marker="o", color="#2b6cb0", label=f"schedule() ({tag})"
        )
        ax.plot(
            ns,
            [p["update_us"] / 1e3 for p in pts],
            style,
            marker="s",
            color="#dd6b20",
            label=f"update_from_output() ({tag})",
        )
    pts = [p for p in result["results"] if p["caching"]]
    ax.plot(
        [p["running"] for p in pts],
        [p["modeled_step_ms"] for p in pts],
        ":",
        color="#555",
        label="modeled GPU step (Llama-3-8B, H100)",
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("running requests (all decoding)")
    ax.set_ylabel("ms per call")
    ax.set_title("Scheduler overhead per step (median; lower is better)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--running", type=int, nargs="*", default=[16, 64, 256, 1024])
    ap.add_argument("--steps", type=int, default=1000, help="timed decode steps per run (fewer for large N)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per point; the best median is kept")
    ap.add_argument("--out-dir", type=Path, default=REPO / "assets" / "benchmarks")
    args = ap.parse_args()

    cost = CostModel.for_model("llama-3-8b", "h100")
    results = []
    for caching in (True, False):
        for n in args.running:
            steps = max(200, min(args.steps, 256 * args.steps // n))
            runs = [measure(n, caching, steps) for _ in range(args.repeat)]
            best = {k: min(r[k] for r in runs) for k in runs[0]}
            modeled = cost.step_time(n * best["mean_context_tokens"], n) * 1e3
            point = {
                "running": n,
                "caching": caching,
                "steps": steps,
                **{k: round(v, 1) for k, v in best.items()},
                "total_us": round(best["schedule_us"] + best["update_us"], 1),
                "us_per_request": round((best["schedule_us"] + best["update_us"]) / n, 2),
                "modeled_step_ms": round(modeled, 3),
                "overhead_fraction_of_step": round((best["schedule_us"] + best["update_us"]) / 1e3 / modeled, 3),
            }
            results.append(point)
            print(
                f"caching={'on ' if caching else 'off'} running={n:>5}: schedule {point['schedule_us']:>9.1f} us, "
                f"update {point['update_us']:>9.1f} us ({point['us_per_request']:.2f} us/request); modeled GPU "
                f"step {modeled:.2f} ms -> overhead {point['overhead_fraction_of_step']:.0%} of a step"
            )
    head = next((p for p in results if p["running"] == 256 and p["caching"]), results[0])
    result = {
        "benchmark": "scheduler overhead per step",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": versions(),
        "config": {
            "prompt_len": PROMPT_LEN,
            "block_size": BLOCK_SIZE,
            "max_num_batched_tokens": 8192,
            "workload": "N requests all decoding (one token each per step, a new block every 16 steps)",
            "statistic": "median over the timed steps of a run, best of repeat runs",
            "repeat": args.repeat,
            "peer": f"modeled step time of {cost.name} (minipaged.simulator)",
        },
        "headline": {
            "running": head["running"],
            "caching": head["caching"],
            "schedule_us": head["schedule_us"],
            "update_from_output_us": head["update_us"],
            "total_us": head["total_us"],
            "modeled_step_ms": head["modeled_step_ms"],
            "overhead_fraction_of_step": head["overhead_fraction_of_step"],
        },
        "results": results,
        "note": "vLLM's own scheduler is not run here: it needs a full VllmConfig (model config, KV cache config) "
        "to construct. The scheduler overhead overlaps with the GPU step in engines that schedule step "
        "t+1 while step t runs; minipaged's engine does not.",
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "scheduler.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out_dir / "scheduler.png")
    print(
        f"headline (256 running, caching on): schedule() {head['schedule_us']:.0f} us + update_from_output() "
        f"{head['update_us']:.0f} us = {head['total_us']:.0f} us per step"
    )
    print(f"wrote {args.out_dir / 'scheduler.json'} and scheduler.png")


if __name__ == "__main__":
    main()
