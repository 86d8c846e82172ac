"""Host work per engine step, without a GPU: minipaged's steps beside vLLM v1's scheduler, in one run.

A GPU step of a small model takes a few milliseconds; whatever the host does between two of them (schedule,
build the inputs, read the tokens back, update the requests) is added to every step unless it is hidden under
the device's work. This benchmark measures that host work on the CPU with a device that does no model work:

* **minipaged**: the engine's own step driver and scheduler, with ``lab.fake_device.FakeDeviceExecutor``,
  which does the runner's host work for each step (the persistent input batch brought up to the step, the
  step's arrays, the copies into the input buffers) and "runs" each step for ``--executor-ms`` on a virtual
  device. Plain steps (``run_step``) and the overlap loop (``StepPipeline``, async scheduling).
* **vLLM 0.32**: its ``Scheduler`` (and ``AsyncScheduler``) driven as ``EngineCore`` drives them, by
  ``benchmarks/vllm_host_step.py`` in the vLLM venv (``--vllm-python``). vLLM's input preparation lives in its
  GPU model runner and cannot run alone, so its host time is the scheduler's: ``schedule()`` +
  ``update_from_output()``. Ours is reported both ways: the scheduler's alone, and with input preparation.

The workload is the same on both sides: N requests (128 / 256 / 512) with distinct 128-token prompts, greedy,
ignore_eos, effectively endless, prefix caching on, 16-token blocks, ``max_num_seqs = N``, 8192 tokens a step,
a pool no request is ever preempted from; all prefilled, ``--warmup`` decode steps untimed, then ``--steps``
timed decode steps. Medians over the timed steps; the two sides alternate, ``--rounds`` times, best kept.

With a 5 ms executor: ``step_ms`` is the wall time of a whole step (the mean: a slow step counts); plain, it is
5 ms plus the host's time; with overlap, the host's time hides under the device's, and ``hidden`` is the share
of a plain step's host time that no longer adds to the step: ``(plain step - overlap step) / (plain step - 5)``.
Both sides freeze what lives through the run out of the garbage collector's way after set-up, as vLLM's engine
core does (a full collection of 100,000 live objects otherwise stalls a step for 100 ms now and then).

Results: ``assets/benchmarks/host_step.json``.

    python benchmarks/bench_host_step.py
    python benchmarks/bench_host_step.py --running 256 --steps 500 --rounds 3 --vllm-python /tmp/vllm-venv/bin/python
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import statistics
import subprocess
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
from minipaged.engine.overlap import StepPipeline  # noqa: E402
from minipaged.engine.step import run_step  # noqa: E402
from minipaged.lab.fake_device import FakeDeviceExecutor  # noqa: E402
from minipaged.sampling_params import SamplingParams  # noqa: E402

PROMPT_LEN = 128
BLOCK_SIZE = 16
BUDGET = 8192


def setup(num_running: int, steps: int, step_s: float, prepare: bool) -> tuple[Scheduler, FakeDeviceExecutor]:
    """N requests added, as the vLLM side adds them (same prompts, same pool rule)."""
    max_len = PROMPT_LEN + steps + 64
    num_blocks = num_running * (-(-max_len // BLOCK_SIZE)) + 16
    kv = KVCacheManager(BLOCK_SIZE, num_blocks, enable_caching=True, watermark=0.0)
    max_model_len = max(8192, max_len)
    sched = Scheduler(SchedulerConfig(max_num_seqs=num_running, max_num_batched_tokens=BUDGET,
                                      max_model_len=max_model_len), kv)  # fmt: skip
    for i in range(num_running):
        prompt = [1 + i] + [(7 * i + j) % 32000 for j in range(1, PROMPT_LEN)]
        params = SamplingParams(max_tokens=max_model_len, ignore_eos=True, temperature=0)
        sched.add_request(Request(str(i), prompt, sampling_params=params))
    dev = FakeDeviceExecutor(BLOCK_SIZE, num_running, BUDGET, -(-max_model_len // BLOCK_SIZE), step_s, prepare)
    return sched, dev


def measure(num_running: int, executor_ms: float, overlap: bool, prepare: bool, args: argparse.Namespace) -> dict:
    """One point on our side: median host parts per timed decode step, and the mean wall time of a step."""
    sched, dev = setup(num_running, args.steps + args.warmup, executor_ms / 1e3, prepare)
    pipeline = StepPipeline()

    def step():
        if overlap:
            return pipeline.step(sched, dev, time.perf_counter)
        return run_step(sched, dev, time.perf_counter)

    while any(r.num_output_tokens == 0 for r in sched.requests.values()):  # prefill, chunked by the budget
        step()
    for _ in range(args.warmup):
        step()
    # What stays for the whole run (the requests, the pool's blocks) out of the collector's way, as vLLM's engine
    # core does after start-up (``freeze_gc_heap``; the vLLM side does the same): else a full collection of
    # them now and then stalls one step for 100 ms.
    gc.collect()
    gc.freeze()
    schedule, update, execute, wall = [], [], [], []
    t_start = time.perf_counter()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        res = step()
        wall.append(time.perf_counter() - t0)
        assert len(res.output.scheduled) == num_running and res.output.total_num_scheduled_tokens == num_running
        schedule.append(res.schedule_s)
        update.append(res.update_s)
        execute.append(res.execute_s)
    elapsed = time.perf_counter() - t_start
    gc.unfreeze()
    assert sched.num_preemptions == 0 and len(sched.running) == num_running
    us = 1e6
    return {
        "schedule_us": statistics.median(schedule) * us,
        "update_us": statistics.median(update) * us,
        "scheduler_us_per_step": (statistics.median(schedule) + statistics.median(update)) * us,
        "host_us_per_step": statistics.median(wall) * us if executor_ms == 0 else None,
        "step_ms": elapsed / args.steps * 1e3,
        "step_ms_median": statistics.median(wall) * 1e3,
    }


def ours(num_running: int, executor_ms: float, args: argparse.Namespace) -> dict:
    plain = measure(num_running, executor_ms, overlap=False, prepare=True, args=args)
    out = {"running": num_running, "executor_ms": executor_ms, "plain": plain}
    if executor_ms:
        out["overlap"] = measure(num_running, executor_ms, overlap=True, prepare=True, args=args)
    return out


def run_vllm(args: argparse.Namespace, async_scheduling: bool) -> dict | None:
    if not Path(args.vllm_python).exists():
        return None
    cmd = [args.vllm_python, str(Path(__file__).with_name("vllm_host_step.py")), "--running",
           *map(str, args.running), "--steps", str(args.steps), "--warmup", str(args.warmup), "--prompt-len",
           str(PROMPT_LEN), "--block-size", str(BLOCK_SIZE), "--executor-ms", *map(str, args.executor_ms)]  # fmt: skip
    if async_scheduling:
        cmd.append("--async-scheduling")
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(REPO), timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"the vLLM worker failed:\n{proc.stderr[-3000:]}")
    line = next(ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{"))  # logs may follow it
    return json.loads(line)


def hidden_share(step_plain_ms: float, step_overlap_ms: float, executor_ms: float) -> float:
    """The share of a plain step's host time (its time beyond the device's) that the overlap loop hides."""
    return (step_plain_ms - step_overlap_ms) / (step_plain_ms - executor_ms)


def best(a: dict | None, b: dict, keys: tuple[str, ...]) -> dict:
    """The lower of two rounds' figures, key by key (noise only ever adds time)."""
    if a is None:
        return b
    return {k: (min(a[k], b[k]) if k in keys and a[k] is not None else a[k]) for k in a}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--running", type=int, nargs="+", default=[128, 256, 512])
    ap.add_argument("--executor-ms", type=float, nargs="+", default=[0.0, 5.0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    ap.add_argument("--out", type=Path, default=REPO / "assets" / "benchmarks" / "host_step.json")
    args = ap.parse_args()

    keys = ("schedule_us", "update_us", "scheduler_us_per_step", "host_us_per_step", "step_ms")
    mine: dict[tuple[int, float], dict] = {}
    theirs: dict[tuple[int, float, bool], dict] = {}
    version = None
    for r in range(args.rounds):  # the sides alternate: a busy moment of the machine hits both
        for n in args.running:
            for ms in args.executor_ms:
                point = ours(n, ms, args)
                prev = mine.get((n, ms))
                point["plain"] = best(prev and prev["plain"], point["plain"], keys)
                if "overlap" in point:
                    point["overlap"] = best(prev and prev["overlap"], point["overlap"], keys)
                mine[(n, ms)] = point
                print(f"round {r + 1} minipaged N={n} executor {ms} ms: {json.dumps(point)}", flush=True)
        for async_scheduling in (False, True):
            v = run_vllm(args, async_scheduling)
            if v is None:
                print(f"no vLLM interpreter at {args.vllm_python}: vLLM's side is left out", flush=True)
                break
            version = v["version"]
            for p in v["points"]:
                key = (p["running"], float(p["executor_ms"]), async_scheduling)
                theirs[key] = best(theirs.get(key), p, ("host_us_per_step", "schedule_us", "update_us", "step_ms"))
            print(f"round {r + 1} vLLM async={async_scheduling}: done", flush=True)

    results = []
    for (n, ms), point in sorted(mine.items()):
        row: dict = {"running": n, "executor_ms": ms, "minipaged": point}
        plain, ahead = theirs.get((n, ms, False)), theirs.get((n, ms, True))
        if plain is not None:
            row["vllm"] = {"plain": plain, "async": ahead}
            row["scheduler_ratio_vs_vllm"] = point["plain"]["scheduler_us_per_step"] / plain["host_us_per_step"]
        if ms and "overlap" in point:
            step_plain, step_overlap = point["plain"]["step_ms"], point["overlap"]["step_ms"]
            row["overlap_step_ms"] = step_overlap
            row["hidden"] = hidden_share(step_plain, step_overlap, ms)
        results.append(row)
    out = {
        "benchmark": "host_step",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "python": platform.python_version(),
        "minipaged": __version__,
        "vllm": version,
        "workload": dict(
            prompt_len=PROMPT_LEN,
            block_size=BLOCK_SIZE,
            max_num_batched_tokens=BUDGET,
            steps=args.steps,
            warmup=args.warmup,
            rounds=args.rounds,
        ),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    for row in results:
        p = row["minipaged"]["plain"]
        line = f"N={row['running']:4d} executor {row['executor_ms']:.0f} ms: ours scheduler {p['scheduler_us_per_step']:.0f} µs"
        if p["host_us_per_step"] is not None:
            line += f", host with inputs {p['host_us_per_step']:.0f} µs"
        if "vllm" in row:
            line += f"; vLLM scheduler {row['vllm']['plain']['host_us_per_step']:.0f} µs"
            line += f" (ratio {row['scheduler_ratio_vs_vllm']:.2f})"
        if "overlap_step_ms" in row:
            line += f"; step plain {p['step_ms']:.2f} ms, overlap {row['overlap_step_ms']:.2f} ms"
            if row["vllm"]["async"] if "vllm" in row else False:
                line += f" (vLLM {row['vllm']['plain']['step_ms']:.2f} / async {row['vllm']['async']['step_ms']:.2f})"
        print(line)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
