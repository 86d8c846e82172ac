"""What watching the engine costs: the same batch served with no observer, with one that keeps every event, and
with an ``EngineMonitor`` redrawing (headless: its figures are updated, no browser draws them).

Two measurements, because on a shared 2-core machine a 2 % difference is within the noise of a whole run:

* **direct**: the seconds the engine's own thread spends on observers in each step — building the
  ``StepEvent`` (``events.step_event``) and queueing it (``Observers.publish``) — timed around those two calls,
  against the step's time. This is what an observer adds to a step; the observers themselves run on their own
  thread (their GIL time is in the second measurement);
* **end to end**: the whole batch's wall time and mean step time, each variant run ``--rounds`` times,
  interleaved, best round counted.

SmolLM2-135M-Instruct, float32, ``--num-prompts`` chat prompts of random tokens, ``--max-tokens`` each, greedy,
``ignore_eos``; a pool of ``--num-blocks`` blocks (small enough to preempt, so the events carry preemptions).
Results: ``assets/benchmarks/observers.json``.

    python benchmarks/bench_observers.py                 # 48 prompts x 48 tokens, 3 rounds
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")  # before torch starts its OpenMP runtime
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import machine  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--num-blocks", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import torch

    import minipaged.engine.llm as engine_module
    from minipaged import LLM, SamplingParams
    from minipaged.classroom.viz import EngineMonitor
    from minipaged.engine.events import Observers

    # Time the two calls the engine's thread makes for its observers.
    spent: list[float] = []
    build = engine_module.step_event
    publish = Observers.publish

    def timed_build(*a, **k):
        t0 = time.perf_counter()
        event = build(*a, **k)
        spent.append(time.perf_counter() - t0)
        return event

    def timed_publish(self, event):
        t0 = time.perf_counter()
        publish(self, event)
        spent[-1] += time.perf_counter() - t0

    engine_module.step_event = timed_build  # type: ignore[assignment]
    Observers.publish = timed_publish  # type: ignore[method-assign]

    llm = LLM(num_gpu_blocks_override=args.num_blocks, max_model_len=1024)
    rng = random.Random(0)
    prompts = [[{"role": "user", "content": " ".join(rng.choice(["red", "blue", "cat", "sun", "tree", "road"])
                                                    for _ in range(rng.randint(8, 80)))}] for _ in range(args.num_prompts)]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up

    def run(variant: str) -> dict:
        llm.reset()
        spent.clear()
        monitor = None
        kept: list = []
        if variant == "recorder":
            llm.observers.attach(kept.append)
        elif variant == "monitor":
            monitor = EngineMonitor(llm)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        llm.observers.flush()
        llm.observers.detach(kept.append)
        if monitor is not None:
            monitor.close()
        steps = llm.num_steps
        assert sum(len(o.outputs[0].token_ids) for o in outs) == args.num_prompts * args.max_tokens
        return dict(
            seconds=seconds,
            steps=steps,
            mean_step_ms=1000 * seconds / steps,
            preemptions=llm.scheduler.num_preemptions,
            observer_us_per_step=1e6 * statistics.mean(spent) if spent else 0.0,
            events_seen=len(kept) if variant == "recorder" else None,
            draws=monitor.num_draws if monitor is not None else None,
        )

    variants = ["none", "recorder", "monitor"]
    rounds: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in variants:
            rounds[v].append(run(v))
            print(f"round {r + 1} {v:9s} {rounds[v][-1]}", flush=True)
    best = {v: min(rs, key=lambda x: x["seconds"]) for v, rs in rounds.items()}
    base = best["none"]
    summary = {
        v: dict(
            seconds=round(b["seconds"], 3),
            mean_step_ms=round(b["mean_step_ms"], 2),
            wall_vs_none=round(b["seconds"] / base["seconds"], 4),
            observer_us_per_step=round(statistics.median(x["observer_us_per_step"] for x in rounds[v]), 1),
            direct_share_of_step=round(
                statistics.median(x["observer_us_per_step"] for x in rounds[v]) / (1000 * b["mean_step_ms"]), 5
            ),
            steps=b["steps"],
            preemptions=b["preemptions"],
            draws=b["draws"],
        )
        for v, b in best.items()
    }
    result = dict(
        date=dt.date.today().isoformat(),
        machine=machine(),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        args=vars(args),
        summary=summary,
        rounds=rounds,
    )
    out = REPO / "assets" / "benchmarks" / "observers.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    for v, s in summary.items():
        print(f"{v:9s} {s}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
