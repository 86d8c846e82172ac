"""Colocated against disaggregated prefill, on a workload where long prompts interrupt running decodes.

The workload (seeded): ``--decoders`` chat requests arrive at once and decode ``--decode-tokens`` tokens each
(``ignore_eos``): their inter-token latency (ITL) is what long prompts hurt. Then, one every ``--gap`` seconds,
``--long`` requests arrive with ``--long-len``-token prompts (random token ids) and ask for ``--long-out``
tokens: their time to first token (TTFT) is what disaggregation may cost.

* **colocated**: one ``LLM`` (every core), chunked prefill with a ``--budget``-token step: a long prompt's chunks
  share steps with the decodes;
* **disaggregated**: ``DisaggregatedLLM``, the prefill engine in a process of its own; each process gets half of
  the cores, so each phase runs on less hardware but never waits for the other.

Both are driven online: a request is added when its arrival time comes, with that time as its arrival. Greedy
in both, so both produce the same tokens (checked). Results: ``assets/benchmarks/disagg.json``.

    python benchmarks/bench_disagg.py
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path

import numpy as np
from common import machine, write_result

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

WORKLOAD_KNOBS = ("decoders", "decode_tokens", "long", "long_len", "long_out", "first", "gap", "budget", "seed")
QUESTIONS = [
    "Write a long story about a lighthouse keeper and a storm.",
    "Explain how a bicycle works, part by part.",
    "Describe a busy market in a small town, in detail.",
    "Give a long list of ideas for a school science fair.",
    "Tell the history of a made-up kingdom over five centuries.",
    "Describe the life cycle of a frog in many steps.",
]


def workload(args: argparse.Namespace, tokenizer, vocab: int) -> list[dict]:
    from minipaged import SamplingParams
    from minipaged.model_loader import chat_prompt_ids

    rng = np.random.default_rng(args.seed)
    reqs = [
        dict(
            rid=f"decode{i}",
            kind="decode",
            arrival=0.0,
            prompt=chat_prompt_ids(tokenizer, QUESTIONS[i % len(QUESTIONS)]),
            params=SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True),
        )
        for i in range(args.decoders)
    ]
    for j in range(args.long):
        reqs.append(
            dict(
                rid=f"long{j}",
                kind="long",
                arrival=args.first + j * args.gap,
                prompt=rng.integers(100, vocab, size=args.long_len).tolist(),
                params=SamplingParams(max_tokens=args.long_out, temperature=0, ignore_eos=True),
            )
        )
    return reqs


def drive(engine, llm, reqs: list[dict], disagg: bool) -> dict[str, object]:
    """Add each request when its time comes, step until all are done; the outputs by id."""
    pending = sorted(reqs, key=lambda r: r["arrival"])
    t0 = llm.now()
    ids: list[str] = []
    outs = {}

    def busy() -> bool:
        return engine.has_unfinished() if disagg else llm.scheduler.has_unfinished()

    while pending or busy():
        now = llm.now() - t0
        while pending and pending[0]["arrival"] <= now:
            r = pending.pop(0)
            engine.add_request(r["prompt"], r["params"], request_id=r["rid"], arrival_time=t0 + r["arrival"])
            ids.append(r["rid"])
        if not busy():
            time.sleep(min(0.01, max(0.0, pending[0]["arrival"] - now)) if pending else 0.0)
            continue
        if disagg:
            wait = max(0.0, pending[0]["arrival"] - now) if pending else None
            engine.step(wait_s=wait)
        else:
            engine.step()
    for rid in ids:
        outs[rid] = llm.get_output(rid)
    return outs


def summarise(outs: dict, reqs: list[dict], seconds: float) -> dict:
    kinds = {r["rid"]: r["kind"] for r in reqs}
    itl = np.concatenate([o.metrics.itls for rid, o in outs.items() if kinds[rid] == "decode"])
    ttft = np.array([o.metrics.ttft for rid, o in outs.items() if kinds[rid] == "long"])

    def pct(a: np.ndarray, q: float) -> float:
        return round(float(np.percentile(a, q)) * 1000, 1)

    return dict(
        seconds=round(seconds, 2),
        decode_itl_ms={"p50": pct(itl, 50), "p90": pct(itl, 90), "p99": pct(itl, 99), "max": pct(itl, 100)},
        long_ttft_ms={"p50": pct(ttft, 50), "p90": pct(ttft, 90), "max": pct(ttft, 100)},
        decode_tokens=int(sum(len(o.outputs[0].token_ids) for rid, o in outs.items() if kinds[rid] == "decode")),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decoders", type=int, default=6)
    ap.add_argument("--decode-tokens", type=int, default=160)
    ap.add_argument("--long", type=int, default=6)
    ap.add_argument("--long-len", type=int, default=1024)
    ap.add_argument("--long-out", type=int, default=8)
    ap.add_argument("--first", type=float, default=1.0, help="seconds before the first long prompt")
    ap.add_argument("--gap", type=float, default=1.5, help="seconds between long prompts")
    ap.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens of every engine")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "assets" / "benchmarks")
    args = ap.parse_args()

    import torch

    from minipaged import LLM
    from minipaged.engine.disagg import DisaggregatedLLM

    knobs = dict(dtype="float32", max_num_batched_tokens=args.budget, kv_cache_memory="1GiB", max_model_len=2048)
    cores = torch.get_num_threads()
    colocated = LLM(**knobs)
    reqs = workload(args, colocated.tokenizer, colocated.model.config.vocab_size)
    drive(colocated, colocated, reqs[:1], disagg=False)  # warm-up
    colocated.reset()
    t = time.perf_counter()
    out_c = drive(colocated, colocated, reqs, disagg=False)
    res_c = summarise(out_c, reqs, time.perf_counter() - t)
    del colocated

    half = max(1, cores // 2)
    with DisaggregatedLLM(threads=(half, half), decode={"kv_offloading_size": "512MiB"}, **knobs) as d:
        drive(d, d.llm, reqs[:1], disagg=True)  # warm-up
        d.llm.reset()
        t = time.perf_counter()
        out_d = drive(d, d.llm, reqs, disagg=True)
        res_d = summarise(out_d, reqs, time.perf_counter() - t)
        kv = d.llm.kv_cache_manager
        res_d["external_hit_tokens"] = kv.external_hits
    same = all(out_c[r].outputs[0].token_ids == out_d[r].outputs[0].token_ids for r in out_c)
    record = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "torch": torch.__version__,
        "threads": {"colocated": cores, "disaggregated": [half, half]},
        "model": "SmolLM2-135M-Instruct",
        "dtype": "float32",
        "workload": {k: getattr(args, k) for k in WORKLOAD_KNOBS},
        "same_tokens": same,
        "colocated": res_c,
        "disaggregated": res_d,
    }
    for name, r in (("colocated", res_c), ("disaggregated", res_d)):
        print(
            f"{name:14s} decode ITL p50 {r['decode_itl_ms']['p50']:6.1f} p90 {r['decode_itl_ms']['p90']:6.1f} "
            f"p99 {r['decode_itl_ms']['p99']:6.1f} max {r['decode_itl_ms']['max']:6.1f} ms | long TTFT p50 "
            f"{r['long_ttft_ms']['p50']:7.1f} max {r['long_ttft_ms']['max']:7.1f} ms | {r['seconds']} s",
            flush=True,
        )
    print(f"same tokens: {same}")
    write_result(args.out, "disagg.json", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
