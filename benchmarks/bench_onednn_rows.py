"""Why the engine's memory crept: oneDNN keeps a kernel for every row count it is asked for.

Run by hand (about a minute on 2 cores)::

    python benchmarks/bench_onednn_rows.py            # -> assets/benchmarks/onednn_rows.json

Four of SmolLM2's linear layers (``layers.Linear``, the packed oneDNN path with its post-ops) are called 4,000
times with a row count that is fixed, random in 1..599 as it is, or random but rounded by ``packed_rows`` (what
the engine does now). Each mode runs in a fresh process (oneDNN's caches are per process) and reports its RSS
at the end and the seconds for the calls.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
from pathlib import Path

from common import machine

REPO = Path(__file__).resolve().parent.parent
MODES = ("fixed", "random", "rounded")

WORKER = """
import random, sys, time, torch
sys.path.insert(0, {repo!r})
from minipaged.model import layers

mode, calls = {mode!r}, {calls}
if mode == "random":
    layers.pad_rows = lambda x: x  # the rows as they come (before the fix)
torch.manual_seed(0)
layers = [layers.Linear(576, 1536, bias=False), layers.Linear(1536, 576, bias=False),
          layers.Linear(576, 576, bias=False), layers.Linear(576, 192, bias=False)]
rng = random.Random(0)
t0 = time.perf_counter()
with torch.inference_mode():
    for _ in range(calls):
        m = 37 if mode == "fixed" else rng.randrange(1, 600)
        x = torch.randn(m, 576)
        layers[1](layers[0].silu(x)); layers[2].add(x, x); layers[3](x)
seconds = time.perf_counter() - t0
rss = int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
print(rss, seconds)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=4000)
    ap.add_argument("--out", type=Path, default=REPO / "assets" / "benchmarks")
    args = ap.parse_args()
    rows = {}
    for mode in MODES:
        code = WORKER.format(repo=str(REPO), mode=mode, calls=args.calls)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
        if proc.returncode:
            print(proc.stderr[-2000:], file=sys.stderr)
            return 1
        rss, seconds = map(float, proc.stdout.split()[-2:])
        rows[mode] = dict(rss_mb=round(rss), seconds=round(seconds, 2))
        print(f"{mode:>8}: RSS {rss:6.0f} MB, {seconds:6.2f} s for {args.calls} calls")
    result = dict(
        benchmark="onednn_rows", date=dt.date.today().isoformat(), machine=machine(), calls=args.calls, rows=rows
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "onednn_rows.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
