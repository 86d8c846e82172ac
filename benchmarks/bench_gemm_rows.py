"""How fast a decode step's matrix products run at each batch size, on SmolLM2's shapes.

Run by hand (one to two minutes on 2 cores)::

    python benchmarks/bench_gemm_rows.py                    # -> assets/benchmarks/gemm_rows.json
    python benchmarks/bench_gemm_rows.py --dtype bfloat16   # -> assets/benchmarks/gemm_rows_bf16.json

A decode step multiplies one row per running sequence through every weight: at 54 rows (the engine benchmark's
mean decode batch) the products are as many FLOPs per weight byte as at 2,048 rows divided by 38, and the same
kernels run well below the rate they reach on a prefill chunk. ``bench_engine.py`` charges the whole gap to
"decode GEMMs, % of floor"; this benchmark shows where it comes from, row count by row count.

Two paths over the same random weights, in one run:

- ``packed``: the engine's path, ``layers.Linear`` on oneDNN's pre-packed weights with its post-ops, called as
  the step program calls them per layer (qkv; o + residual; silu(gate); up * that; down + residual), the rows
  padded once per step to ``packed_rows`` (54 rows run as 56);
- ``plain``: PyTorch's default, ``nn.functional.linear`` followed by the same elementwise ops (``MINIPAGED_ONEDNN=0``
  in the engine).

Each row count times 30 layers plus the output head (49,152 x 576) and reports GFLOP/s, the share of the packed
path's best rate over the row counts measured (the 2,048-row one, in practice), and packed over plain.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import machine
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from minipaged.model import layers  # noqa: E402

HIDDEN, UNITS, QKV, VOCAB, LAYERS = 576, 1536, 576 + 2 * 192, 49152, 30  # SmolLM2-135M
ROWS = (1, 4, 8, 16, 24, 32, 48, 54, 64, 96, 128, 256, 2048)


def build(dtype: torch.dtype) -> tuple[list[list[layers.Linear]], layers.Linear]:
    """Thirty layers' projections (qkv, o, gate, up, down) and the head, random, as the engine holds them."""
    torch.manual_seed(0)

    def linear(i: int, o: int) -> layers.Linear:
        lin = layers.Linear(i, o, bias=False)
        nn.init.normal_(lin.weight, std=0.02)
        return lin.to(dtype)

    stack = [
        [
            linear(HIDDEN, QKV),
            linear(HIDDEN, HIDDEN),
            linear(HIDDEN, UNITS),
            linear(HIDDEN, UNITS),
            linear(UNITS, HIDDEN),
        ]
        for _ in range(LAYERS)
    ]
    return stack, linear(HIDDEN, VOCAB)


def packed_step(stack: list[list[layers.Linear]], head: layers.Linear, x: torch.Tensor) -> None:
    x = layers.pad_rows(x)  # once per step, as the step program does: each call below then runs as it is
    for qkv, o, gate, up, down in stack:
        qkv(x)
        o.add(x, x)
        h = up.mul(x, gate.silu(x))
        down.add(h, x)
    head(x)


def plain_step(stack: list[list[layers.Linear]], head: layers.Linear, x: torch.Tensor) -> None:
    f = nn.functional
    for qkv, o, gate, up, down in stack:
        f.linear(x, qkv.weight)
        f.linear(x, o.weight) + x
        h = f.linear(x, up.weight) * f.silu(f.linear(x, gate.weight))
        f.linear(h, down.weight) + x
    f.linear(x, head.weight)


Step = Callable[[list[list[layers.Linear]], layers.Linear, torch.Tensor], None]


def seconds(
    step: Step, stack: list[list[layers.Linear]], head: layers.Linear, rows: int, dtype: torch.dtype, budget_s: float
) -> float:
    """Best of several timed steps (at least three, about ``budget_s`` in all) after one warm-up."""
    x = torch.randn(rows, HIDDEN, dtype=dtype)
    t0 = time.perf_counter()
    step(stack, head, x)  # warm-up: packs the weights, builds oneDNN's kernels for this row count
    first = time.perf_counter() - t0
    best = float("inf")
    for _ in range(max(3, int(budget_s / max(first, 1e-3)))):
        t0 = time.perf_counter()
        step(stack, head, x)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    ap.add_argument("--budget-s", type=float, default=1.5, help="time per row count and path (default 1.5)")
    ap.add_argument("--out", type=Path, default=REPO / "assets" / "benchmarks")
    args = ap.parse_args()
    if any(r < 1 for r in args.rows):
        ap.error("--rows: every row count must be at least 1")
    dtype = getattr(torch, args.dtype)
    if layers.onednn_ops() is None:
        print(f"the packed path is off here: {layers.probe_onednn()[1]}", file=sys.stderr)
        return 1
    stack, head = build(dtype)
    flops_per_row = 2 * (LAYERS * HIDDEN * (QKV + HIDDEN + 2 * UNITS) + LAYERS * UNITS * HIDDEN + HIDDEN * VOCAB)
    results = []
    with torch.inference_mode():
        for rows in sorted(set(args.rows)):
            packed = seconds(packed_step, stack, head, rows, dtype, args.budget_s)
            plain = seconds(plain_step, stack, head, rows, dtype, args.budget_s)
            results.append(
                dict(
                    rows=rows,
                    packed_ms=round(packed * 1e3, 2),
                    plain_ms=round(plain * 1e3, 2),
                    packed_gflops=round(flops_per_row * rows / packed / 1e9, 1),
                    plain_gflops=round(flops_per_row * rows / plain / 1e9, 1),
                    packed_over_plain=round(plain / packed, 2),
                )
            )
            r = results[-1]
            print(
                f"{rows:5d} rows: packed {r['packed_ms']:8.2f} ms {r['packed_gflops']:6.1f} GFLOP/s, "
                f"plain {r['plain_ms']:8.2f} ms {r['plain_gflops']:6.1f} GFLOP/s",
                flush=True,
            )
    top = max(r["packed_gflops"] for r in results)
    for r in results:
        r["packed_of_best"] = round(r["packed_gflops"] / top, 3)
    result = dict(
        benchmark="gemm_rows",
        date=dt.date.today().isoformat(),
        machine=machine(),
        dtype=args.dtype,
        threads=torch.get_num_threads(),
        flops_per_row=flops_per_row,
        weight_bytes=flops_per_row // 2 * dtype.itemsize,
        rows=results,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    name = "gemm_rows.json" if dtype == torch.float32 else "gemm_rows_bf16.json"
    (args.out / name).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
