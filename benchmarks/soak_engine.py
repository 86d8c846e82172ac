"""Soak: one engine serving many short random calls; the process's memory must stay flat after warm-up.

Run by hand (about 45 minutes on 2 cores for the default 10,000 calls)::

    python benchmarks/soak_engine.py                       # -> assets/benchmarks/soak.json and soak.png
    python benchmarks/soak_engine.py --calls 500 --out /tmp/soak   # a quick look

One ``LLM`` (SmolLM2, 64 MiB of KV) serves ``--calls`` calls of 1-3 random token-id prompts (5-80 tokens) with
1-8 output tokens, sampled (temperature 0.7, a seed per call), so prompt lengths, batch sizes and prefill
chunks vary all the time. Every ``--every`` calls it records the process's RSS and checks that nothing is left
per request (scheduler, KV manager, sampler, the engine's own table) and that every block is free. The verdict:
the growth of RSS from the end of warm-up (``--warmup`` calls) to the end, as a share of RSS then (target: within
5 %). At the end, ``malloc_trim(0)`` shows how much of the rest was free heap glibc had kept.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import json
import os
import random
import sys
import time
from pathlib import Path

from common import machine

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=10_000)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=1_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "assets" / "benchmarks")
    args = ap.parse_args()
    if not 0 < args.warmup < args.calls:
        ap.error("--warmup must be between 0 and --calls")

    import torch

    from minipaged import LLM, SamplingParams

    llm = LLM(kv_cache_memory="64MiB", device="cpu")
    rng = random.Random(args.seed)
    vocab = llm.model.config.vocab_size
    rows: list[dict] = []
    t0 = time.perf_counter()
    for call in range(1, args.calls + 1):
        prompts = [[rng.randrange(100, vocab) for _ in range(rng.randrange(5, 81))] for _ in range(rng.randrange(1, 4))]
        params = SamplingParams(max_tokens=rng.randrange(1, 9), temperature=0.7, seed=call)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert len(outs) == len(prompts) and all(o.finished and not o.error for o in outs)
        if call % args.every == 0:
            s, kv = llm.scheduler, llm.kv_cache_manager
            left = dict(
                requests=len(s.requests) + len(s.waiting) + len(s.running) + len(s.swapped),
                req_to_blocks=len(kv.req_to_blocks),
                engine_requests=len(llm._requests),
                sampler_streams=len(llm.sampler._generators),
                used_blocks=kv.num_blocks - 1 - kv.get_num_free_blocks(),
            )
            assert not any(left.values()), left  # nothing kept per request, every block back
            rows.append(dict(call=call, rss_mb=round(rss_mb(), 1), seconds=round(time.perf_counter() - t0, 1)))
            print(f"call {call:>6}: RSS {rows[-1]['rss_mb']:8.1f} MB  ({rows[-1]['seconds']:.0f} s)", flush=True)
    before_trim = rss_mb()
    trimmed = ctypes.CDLL("libc.so.6").malloc_trim(0) if sys.platform.startswith("linux") else 0
    after_trim = rss_mb()
    at_warmup = next(r["rss_mb"] for r in rows if r["call"] >= args.warmup)
    end = rows[-1]["rss_mb"]
    result = dict(
        benchmark="soak_engine",
        date=dt.date.today().isoformat(),
        machine=machine(),
        torch=torch.__version__,
        calls=args.calls,
        warmup=args.warmup,
        rss_at_warmup_mb=at_warmup,
        rss_end_mb=end,
        growth_after_warmup=round((end - at_warmup) / at_warmup, 4),
        malloc_trim=dict(released=bool(trimmed), before_mb=round(before_trim, 1), after_mb=round(after_trim, 1)),
        rows=rows,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out / "soak.png")
    print(
        f"RSS {at_warmup:.0f} MB after {args.warmup} calls, {end:.0f} MB after {args.calls}: "
        f"{100 * result['growth_after_warmup']:+.1f} %; malloc_trim {before_trim:.0f} -> {after_trim:.0f} MB"
    )
    return 0 if abs(result["growth_after_warmup"]) <= 0.05 else 1


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    calls = [r["call"] for r in result["rows"]]
    rss = [r["rss_mb"] for r in result["rows"]]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(calls, rss, color="#1f77b4", label="process RSS")
    ax.axvline(result["warmup"], color="#555555", linestyle=":", label="end of warm-up")
    band = result["rss_at_warmup_mb"] * 1.05
    ax.axhline(band, color="#d62728", linestyle="--", label="+5 % over RSS at warm-up")
    ax.set_xlabel("calls served (1-3 random prompts each)")
    ax.set_ylabel("RSS (MB)")
    ax.set_ylim(0, max(max(rss), band) * 1.15)
    ax.set_title(f"One LLM, {result['calls']:,} calls: RSS {100 * result['growth_after_warmup']:+.1f} % after warm-up")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
