"""A long seeded fuzz of the scheduler: at least 100,000 random steps, every one checked.

The same fuzz as ``tests/test_scheduler.py`` (one copy: ``minipaged.testing.fuzz``),
run ten times longer: random configurations (block sizes 1-16, pools down to 3
usable blocks, token budgets down to 1, both preemption modes, swap space down to
one block, prefix caching on or off, speculation, an offloading store, a hybrid model's sliding-window group
beside its full-attention one) and random workloads (shared prefixes, n > 1,
EOS, prompts too long for ``max_model_len`` or the pool). After every step the
driver reads every scheduled request's context back from a real ``CacheEngine``
and checks the pool invariants and the token budget; at the end of each round every
request must have finished exactly once with the right number of tokens and every
block must be free. Any failure raises, with the seed to replay it.

Results: ``assets/benchmarks/fuzz_scheduler.json``.

    python benchmarks/fuzz_scheduler.py                  # 100,000 steps, seed 0
    python benchmarks/fuzz_scheduler.py --steps 1000000 --seed 7
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import machine  # noqa: E402

from minipaged import __version__  # noqa: E402
from minipaged.lab.checking_driver import fuzz  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, default=REPO / "assets" / "benchmarks")
    args = ap.parse_args()
    if not __debug__:
        raise SystemExit("the fuzz checks are assert statements: run without python -O")

    t0 = time.perf_counter()
    try:
        seen = fuzz(args.steps, seed=args.seed)
    except AssertionError as exc:
        raise SystemExit(f"fuzz FAILED (seed {args.seed}): {exc!r}") from exc
    elapsed = time.perf_counter() - t0
    print(
        f"fuzz: {seen['steps']:,} steps in {seen['rounds']:,} random configurations, {elapsed:.1f} s "
        f"({seen['steps'] / elapsed:,.0f} steps/s), all checks passed"
    )
    print("exercised:", ", ".join(f"{k}={v:,}" for k, v in seen.items() if k not in ("steps", "rounds")))

    import numpy
    import torch

    result = {
        "benchmark": "scheduler fuzz",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": {
            "minipaged": __version__,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "numpy": numpy.__version__,
        },
        "config": {
            "steps_requested": args.steps,
            "seed": args.seed,
            "checks": "data read back through every block table each step; ref counts, free queue, swap "
            "space, token budget, max_num_seqs, one slot per token; each request finished once "
            "with its token count; no block leaked; in hybrid rounds, a sliding-window group's table read "
            "only inside its window and null behind it, no slot written by two groups",
        },
        "result": {**seen, "seconds": round(elapsed, 1), "steps_per_s": round(seen["steps"] / elapsed)},
        "passed": True,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / "fuzz_scheduler.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
