"""What prompt lookup costs the scheduler per step, at hundreds of decoding requests.

Speculative decoding by prompt lookup scans every decoding request's context at every step
(``spec_decode.NgramProposer``). This measures one step's proposals for 256 running requests, each having just
gained one token, against the textbook way in the same run: convert the whole token list to an array, then scan
once per n-gram length (``prompt_lookup_max`` down to ``prompt_lookup_min``). Both give the same drafts for every
request (checked). Three token mixes: uniform over SmolLM2's 49,152 ids (the last token rarely recurs); a
Zipf-like mix where a few ids are very common (as in text: the last token recurs often, many places to check);
and a copy, whose second half repeats its first (every request finds drafts).

    python benchmarks/bench_ngram_proposer.py      # writes assets/benchmarks/ngram_proposer.json
"""

from __future__ import annotations

import datetime as dt
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import machine, write_result  # noqa: E402
from minipaged.config import SpeculativeConfig  # noqa: E402
from minipaged.core.spec_decode import NgramProposer  # noqa: E402

K, LO, HI, REQUESTS, ROUNDS = 4, 2, 4, 256, 5


def textbook(token_ids: Sequence[int]) -> list[int]:
    """The peer: the whole list converted, one sliding-window scan per n-gram length, longest first."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(HI, len(tokens) - 1), LO - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return tokens[start : start + K].tolist()
    return []


def contexts(mix: str, length: int, rng: random.Random) -> list[list[int]]:
    if mix == "uniform":
        return [[rng.randrange(49152) for _ in range(length)] for _ in range(REQUESTS)]
    weights = [1 / (r + 1) for r in range(5000)]  # Zipf: the id of rank r drawn with weight 1 / (r + 1)
    if mix == "zipf":
        return [rng.choices(range(5000), weights, k=length) for _ in range(REQUESTS)]
    halves = [rng.choices(range(5000), weights, k=length // 2) for _ in range(REQUESTS)]
    return [h + h[: length - len(h) - 1] for h in halves]  # copying: the next token continues the first half


def best_ms(fn) -> float:
    times = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> None:
    rng = random.Random(0)
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=K, prompt_lookup_min=LO, prompt_lookup_max=HI))
    rows = []
    for mix in ("uniform", "zipf", "copy"):
        for length in (512, 2048, 8192):
            reqs = contexts(mix, length, rng)
            owners = [object() for _ in reqs]
            for i, tokens in enumerate(reqs):  # the steps before: each request's array is built once
                proposer.propose_for(str(i), owners[i], tokens, None)
            for tokens in reqs:  # this step: one new token each (the copy's own next token)
                tokens.append(tokens[len(tokens) - length // 2] if mix == "copy" else rng.randrange(5000))

            def step_ours(reqs: list[list[int]] = reqs, owners: list[object] = owners) -> list[list[int]]:
                return [proposer.propose_for(str(i), owners[i], t, None) for i, t in enumerate(reqs)]

            def step_textbook(reqs: list[list[int]] = reqs) -> list[list[int]]:
                return [textbook(t) for t in reqs]

            ours = step_ours()
            assert ours == step_textbook(), "the two searches disagree"
            row = {
                "mix": mix,
                "context_tokens": length,
                "requests_with_drafts": sum(bool(d) for d in ours),
                "textbook_ms": round(best_ms(step_textbook), 2),
                "ours_ms": round(best_ms(step_ours), 2),
            }
            row["speedup"] = round(row["textbook_ms"] / row["ours_ms"], 1)
            rows.append(row)
            print(
                f"{mix:8} {length:5} tokens: textbook {row['textbook_ms']:7.2f} ms, ours {row['ours_ms']:6.2f} ms "
                f"per step of {REQUESTS} requests ({row['speedup']}x); {row['requests_with_drafts']} with drafts"
            )
    write_result(
        REPO / "assets" / "benchmarks",
        "ngram_proposer.json",
        {
            "benchmark": "prompt-lookup proposals per step",
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(),
            "versions": {"numpy": np.__version__, "python": sys.version.split()[0]},
            "config": {"requests": REQUESTS, "k": K, "prompt_lookup": [LO, HI], "best_of": ROUNDS},
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
