"""Command line: ``python -m minipaged {prepare,demo,grade}``.

* ``prepare``: convert the SmolLM2 GGUF once into the local cache (``make setup`` runs it).
* ``demo``: the main job — answer a few prompts with SmolLM2 and print its KV-cache budget.
* ``grade [FOLDER]``: run every exercise notebook in FOLDER and print a score table.
"""
from __future__ import annotations

import argparse
import sys
import time

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the ocean.",
]


def kv_budget_table(spec, budget_bytes: int = 1 << 30, request_tokens: int = 2048,
                    block_size: int = 16, dtypes: tuple[str, ...] = ("fp32", "bf16", "fp8")) -> str:
    """The KV budget of one model as a small text table, one row per cache dtype."""
    from .kv_math import format_bytes

    header = ("KV dtype", "bytes/token", f"per {block_size}-token block", f"one {request_tokens}-token request",
              f"{request_tokens}-token requests in {format_bytes(budget_bytes, digits=0)}")
    rows = [header]
    for dt in dtypes:
        s = spec.with_dtype(dt)
        cap = s.capacity(budget_bytes, block_size, request_tokens)
        rows.append((dt, f"{s.bytes_per_token:,} B", format_bytes(s.bytes_per_block(block_size)),
                     format_bytes(s.paged_bytes_for_tokens(request_tokens, block_size)),
                     f"{cap.full_requests} ({cap.num_blocks:,} blocks)"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def cmd_prepare(args: argparse.Namespace) -> int:
    from .model_loader import ensure_converted, is_converted

    t0 = time.perf_counter()
    already = is_converted()
    path = ensure_converted(progress=True)
    state = "already cached" if already else "converted"
    print(f"SmolLM2-135M-Instruct {state} at {path} ({time.perf_counter() - t0:.1f} s)")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .kv_math import KVSpec
    from .model_loader import hf_greedy_generate, load_hf_model, load_tokenizer

    t0 = time.perf_counter()
    tokenizer, model = load_tokenizer(), load_hf_model()
    print(f"Loaded SmolLM2-135M-Instruct in {time.perf_counter() - t0:.1f} s "
          "(transformers; the paged engine replaces this in chapter 09)\n")
    t0 = time.perf_counter()
    answers = hf_greedy_generate(model, tokenizer, DEMO_PROMPTS, max_new_tokens=args.max_tokens)
    for prompt, answer in zip(DEMO_PROMPTS, answers):
        print(f"Q: {prompt}\nA: {answer}\n")
    print(f"({len(DEMO_PROMPTS)} prompts, greedy, {time.perf_counter() - t0:.1f} s)\n")
    spec = KVSpec.from_hf_config(model.config, name="SmolLM2-135M-Instruct")
    print(f"KV cache of {spec.name}: {spec.num_layers} layers × {spec.num_kv_heads} KV heads × "
          f"head_dim {spec.head_dim} ({spec.attention_kind}, {spec.num_attention_heads} query heads)")
    print(kv_budget_table(spec))
    return 0


def cmd_grade(args: argparse.Namespace) -> int:
    from .grading import format_table, grade_folder

    scores = grade_folder(args.folder)
    print(format_table(scores))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minipaged", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare", help="convert the SmolLM2 GGUF into the local cache once")
    demo = sub.add_parser("demo", help="answer a few prompts and print the KV budget")
    demo.add_argument("--max-tokens", type=int, default=32)
    grade = sub.add_parser("grade", help="grade a folder of exercise notebooks")
    grade.add_argument("folder", nargs="?", default="exercises")
    args = parser.parse_args(argv)
    return {"prepare": cmd_prepare, "demo": cmd_demo, "grade": cmd_grade}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
