"""Speculative decoding by prompt lookup against the same engine without it, in one run.

Two workloads of real chat requests to SmolLM2-135M-Instruct, greedy, ending at EOS or ``--max-tokens``:

* **lookup**: the answer copies a given text. Each request hands the model a paragraph and asks it to repeat it,
  to repeat it with one word changed, or to copy its sentences one per line: most of the answer already stands
  in the prompt, which is where prompt lookup finds its drafts;
* **chat**: open questions whose answers are not in the prompt: lookup finds few drafts, and the ones it finds
  are mostly wrong.

Each workload runs at two concurrencies: **1** (one request at a time: every step a decode of one row, bound by
reading the weights, where checking a few more rows costs little) and **the whole batch at once** (all requests
admitted together: the step is bound by arithmetic, where every extra row costs). The two engines are loaded
side by side in this process and run alternately, ``--rounds`` times each; a configuration's best round counts.
Both must produce the same tokens (greedy speculation is exact), which the script checks.

    python benchmarks/bench_spec_decode.py                   # writes assets/benchmarks/spec_decode.json
    python benchmarks/bench_spec_decode.py --rounds 1 --num-requests 4 --out /tmp   # a quick look
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path

from common import machine, write_result

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Paragraphs written for this benchmark (about the subject of the course, so nothing is borrowed).
TEXTS = [
    "A language model writes one token at a time. For every token it has already seen, each layer keeps a key "
    "and a value vector, so that the next token can attend to them without computing them again. This store is "
    "the KV cache, and it grows by the same amount for every token of every request.",
    "The block pool cuts the cache into blocks of sixteen tokens. A request holds a list of block numbers, its "
    "block table, and takes a new block only when its last one is full. When the request ends, its blocks go "
    "back to the free list, and the next request may take them at once.",
    "Continuous batching decides again at every step which requests run. A request that finishes leaves the "
    "batch at once, and a waiting request takes its place in the same step. The batch is never held back by "
    "its longest member, as it is when a whole batch must finish together.",
    "When the pool runs dry, the scheduler takes the newest running request off the device. It can throw away "
    "that request's cache and compute it again later, or copy its blocks to the main memory and bring them "
    "back when there is room. Both keep the older requests running.",
    "Prefix caching remembers full blocks by a hash of their tokens and of every token before them. A new "
    "request whose prompt starts with the same system prompt finds those blocks in the cache and skips their "
    "computation. Only the rest of its prompt goes through the model.",
    "Speculative decoding guesses several next tokens and lets the model check them all in one pass. The "
    "guesses that the model agrees with are kept, the first one it disagrees with is replaced by its own "
    "choice, and the rest are dropped. Greedy output does not change at all.",
    "Tensor parallelism splits every layer of the model across several devices. Each device holds some of the "
    "attention heads and a slice of the feed forward weights, and the devices add their partial results after "
    "each layer. Each device also keeps only the cache of its own heads.",
    "A server puts the engine behind an HTTP interface. Clients send prompts, the engine adds them to its "
    "queue, and every step streams the new tokens back to the clients that asked for them. A client that "
    "leaves early has its request aborted and its blocks freed.",
]
TASKS = [
    "Repeat the following text exactly, word for word:\n\n{text}",
    "Copy the following text, changing nothing:\n\n{text}",
    "Rewrite the following text with each sentence on its own line:\n\n{text}",
]
QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves.",
    "Give three tips for sleeping better.",
    "Explain photosynthesis to a ten year old.",
    "What are the benefits of regular exercise?",
    "Describe a day at the beach in a few sentences.",
    "Why is the sky blue?",
    "Suggest a name for a friendly robot and explain it.",
    "How do bees make honey?",
    "Write a short story opening about a lighthouse keeper.",
    "What should I pack for a weekend hiking trip?",
    "Explain what a computer program is.",
    "Give me two ideas for a rainy afternoon.",
    "What is the difference between weather and climate?",
    "Describe the taste of a lemon.",
    "Why do cats purr?",
]


def workloads(n: int) -> dict[str, list[str]]:
    lookup = [TASKS[i % len(TASKS)].format(text=TEXTS[i % len(TEXTS)]) for i in range(n)]
    return {"lookup": lookup, "chat": [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]}


def serve(llm, prompts: list[list[int]], max_tokens: int, concurrency: int) -> tuple[float, list[list[int]], dict]:
    """Seconds, each request's tokens, and the speculation counters, for the prompts served ``concurrency`` at a
    time (each group to its end before the next)."""
    from minipaged import SamplingParams

    llm.reset()  # a fresh scheduler: no prefix cache from the last round, counters from zero
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    tokens: list[list[int]] = []
    steps = 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        outs = llm.generate(prompts[i : i + concurrency], params, use_tqdm=False)
        tokens += [o.outputs[0].token_ids for o in outs]
        steps = llm.num_steps
    seconds = time.perf_counter() - t0
    spec = llm.scheduler.spec_decoding_stats
    counters = {"steps": steps} | ({} if spec is None else spec.as_dict())
    return seconds, tokens, counters


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", type=Path, default=REPO / "assets" / "benchmarks")
    args = ap.parse_args()

    import torch

    from minipaged import LLM
    from minipaged.model_loader import chat_prompt_ids

    spec_config = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_max": args.prompt_lookup_max,
    }
    common = dict(dtype=args.dtype, kv_cache_memory="1GiB", max_num_seqs=args.num_requests)
    engines = {"plain": LLM(**common), "spec": LLM(**common, speculative_config=spec_config)}
    tok = engines["plain"].tokenizer
    results = []
    for name, texts in workloads(args.num_requests).items():
        prompts = [chat_prompt_ids(tok, t) for t in texts]
        for concurrency in (1, args.num_requests):
            best: dict[str, dict] = {}
            outputs: dict[str, list[list[int]]] = {}
            for _ in range(args.rounds):
                for which, llm in engines.items():
                    seconds, tokens, counters = serve(llm, prompts, args.max_tokens, concurrency)
                    outputs[which] = tokens
                    if which not in best or seconds < best[which]["seconds"]:
                        best[which] = {"seconds": round(seconds, 3), **counters}
            if outputs["plain"] != outputs["spec"]:
                differ = sum(a != b for a, b in zip(outputs["plain"], outputs["spec"]))
                print(f"warning: {differ} of {len(prompts)} outputs differ ({name}, concurrency {concurrency})")
            num_tokens = sum(len(t) for t in outputs["plain"])
            row = {
                "workload": name,
                "concurrency": concurrency,
                "output_tokens": num_tokens,
                "same_tokens": outputs["plain"] == outputs["spec"],
                "plain_tok_s": round(num_tokens / best["plain"]["seconds"], 1),
                "spec_tok_s": round(num_tokens / best["spec"]["seconds"], 1),
                "speedup": round(best["plain"]["seconds"] / best["spec"]["seconds"], 3),
                "plain": best["plain"],
                "spec": best["spec"],
            }
            results.append(row)
            print(
                f"{name:6s} concurrency {concurrency:3d}: {row['plain_tok_s']:7.1f} -> {row['spec_tok_s']:7.1f} tok/s "
                f"({row['speedup']:.2f}x), acceptance {best['spec'].get('acceptance_rate', 0):.2f}, "
                f"{best['spec'].get('mean_acceptance_length', 1):.2f} tokens per verification, steps "
                f"{best['plain']['steps']} -> {best['spec']['steps']}",
                flush=True,
            )
    record = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "model": "SmolLM2-135M-Instruct",
        "dtype": args.dtype,
        "speculative_config": spec_config,
        "num_requests": args.num_requests,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "results": results,
    }
    write_result(args.out, "spec_decode.json", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
