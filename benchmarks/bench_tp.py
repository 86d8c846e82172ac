"""Tensor parallelism on this machine: SmolLM2 in one process against SmolLM2 split over three, a step cut into
compute and all-reduce — and what a GPU node's NVLink would change, as arithmetic.

Both engines serve the same batch: ``--num-prompts`` chat prompts of random tokens, ``--max-tokens`` each, greedy,
``ignore_eos``, float32, after a warm-up batch. For the split engine, every rank reports the seconds it spent in
its forward passes and, within them, in collectives (``TPGroup.comm_s``: the all-reduces after the embedding,
o_proj and down_proj, and the logits' gather, timed around each call). A collective's time includes waiting for
the slowest rank to arrive, so the script also times the all-reduce alone (every rank calling it back to back, no
rank late: ``WorkerRPC.time_all_reduce``) at a decode step's size, [batch, 576].

The NVLink lines are not measurements: they apply a bandwidth and a per-call latency (``--link-gbps``,
``--link-latency-us``; defaults: 450 GB/s a direction, an H100 SXM's NVLink 4, and 10 µs a call) to the bytes this
run's all-reduces moved, to show which of the two terms a GPU node pays.

    python benchmarks/bench_tp.py                  # 16 prompts x 64 tokens, TP = 1 and 3

Results: ``assets/benchmarks/tensor_parallel.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import machine  # noqa: E402


def serve(size: int, prompts: list[list[int]], max_tokens: int) -> dict:
    from minipaged import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm = LLM(dtype="float32", tensor_parallel_size=size, kv_cache_memory="256MiB", max_model_len=1024)
    start_s = time.perf_counter() - t0
    try:
        llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up: oneDNN's kernels, gloo's buffers
        before = llm.executor.collective_rpc("comm")
        steps0 = llm.num_steps
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        after = llm.executor.collective_rpc("comm")
        steps = llm.num_steps - steps0
        ranks = []
        for b, a in zip(before, after):
            d = {k: a[k] - b[k] for k in a}
            ranks.append(
                {
                    "model_ms_per_step": 1e3 * d["model_s"] / steps,
                    "comm_ms_per_step": 1e3 * d["comm_s"] / steps,
                    "compute_ms_per_step": 1e3 * (d["model_s"] - d["comm_s"]) / steps,
                    "all_reduces_per_step": d["num_all_reduces"] / steps,
                    "bytes_all_reduced_per_step": d["bytes_all_reduced"] / steps,
                }
            )
        alone = llm.executor.collective_rpc("time_all_reduce", (len(prompts), 576), 200)
        return {
            "tensor_parallel_size": size,
            "start_s": start_s,
            "tokens": [o.outputs[0].token_ids for o in outs],
            "wall_s": wall,
            "steps": steps,
            "step_ms": 1e3 * wall / steps,
            "output_tok_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
            "ranks": ranks,
            "all_reduce_alone_us": [1e6 * s for s in alone],
        }
    finally:
        llm.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 3])
    ap.add_argument("--link-gbps", type=float, default=450.0, help="GB/s a direction (an assumption)")
    ap.add_argument("--link-latency-us", type=float, default=10.0, help="µs per all-reduce call (an assumption)")
    ap.add_argument("--out", default=str(REPO / "assets" / "benchmarks" / "tensor_parallel.json"))
    args = ap.parse_args()

    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(rng.randrange(24, 96))] for _ in range(args.num_prompts)]
    runs = [serve(n, prompts, args.max_tokens) for n in args.sizes]
    base = runs[0]
    print(f"SmolLM2-135M fp32, {args.num_prompts} prompts x {args.max_tokens} tokens, greedy")
    print(f"{'TP':>3} {'start s':>8} {'tok/s':>7} {'ratio':>6} {'step ms':>8} {'rank':>5} {'compute ms':>11} "
          f"{'collectives ms':>15} {'all-reduces':>12} {'alone µs':>9}")  # fmt: skip
    for r in runs:
        r["same_tokens_as_first"] = r["tokens"] == base["tokens"]
        for i, rank in enumerate(r["ranks"]):
            head = (
                f"{r['tensor_parallel_size']:>3} {r['start_s']:>8.1f} {r['output_tok_per_s']:>7.1f} "
                f"{r['output_tok_per_s'] / base['output_tok_per_s']:>6.2f} {r['step_ms']:>8.1f}"
                if i == 0
                else " " * 37
            )
            print(f"{head} {i:>5} {rank['compute_ms_per_step']:>11.1f} {rank['comm_ms_per_step']:>15.1f} "
                  f"{rank['all_reduces_per_step']:>12.1f} {r['all_reduce_alone_us'][i]:>9.0f}")  # fmt: skip
        print(f"    same greedy tokens as TP = {base['tensor_parallel_size']}: {r['same_tokens_as_first']}")

    split = next((r for r in runs if r["tensor_parallel_size"] > 1), None)
    nvlink = None
    if split is not None:
        n = split["tensor_parallel_size"]
        rank0 = split["ranks"][0]
        calls = rank0["all_reduces_per_step"]
        # A decode step's all-reduce: [batch, hidden] in bf16 on a GPU; a ring all-reduce sends 2 (n - 1) / n of it
        # from each rank.
        tensor = args.num_prompts * 576 * 2
        wire = calls * 2 * (n - 1) / n * tensor
        nvlink = {
            "assumed_link_gbps": args.link_gbps,
            "assumed_latency_us": args.link_latency_us,
            "all_reduces_per_step": calls,
            "decode_all_reduce_bytes_bf16": tensor,
            "bytes_sent_per_rank_per_decode_step": wire,
            "bandwidth_term_us": 1e6 * wire / (args.link_gbps * 1e9),
            "latency_term_us": calls * args.link_latency_us,
            "measured_here_ms": rank0["comm_ms_per_step"],
            "measured_here_back_to_back_ms": calls * split["all_reduce_alone_us"][0] / 1e3,
        }
        print(
            f"\nNVLink arithmetic (assumed {args.link_gbps:g} GB/s, {args.link_latency_us:g} µs a call), TP = {n}, "
            f"a decode step of {args.num_prompts}: {calls:.0f} all-reduces of {tensor / 1e3:.1f} kB send "
            f"{wire / 1e3:.0f} kB a rank -> {nvlink['bandwidth_term_us']:.1f} µs of bandwidth + "
            f"{nvlink['latency_term_us']:.0f} µs of latency; here {rank0['comm_ms_per_step']:.0f} ms a step in "
            f"collectives ({nvlink['measured_here_back_to_back_ms']:.0f} ms of it the all-reduces' own cost)"
        )
    for r in runs:
        del r["tokens"]
    out = {
        "date": dt.date.today().isoformat(),
        "machine": machine(),
        "command": "python benchmarks/bench_tp.py " + " ".join(sys.argv[1:]),
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "runs": runs,
        "nvlink_arithmetic": nvlink,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {Path(args.out).relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
