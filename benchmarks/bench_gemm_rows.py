"""How fast a decode step's matrix products run at each batch size, on SmolLM2's shapes.

Run by hand (about four minutes on 2 cores)::

    python benchmarks/bench_gemm_rows.py                    # -> assets/benchmarks/gemm_rows.json
    python benchmarks/bench_gemm_rows.py --dtype bfloat16   # -> assets/benchmarks/gemm_rows_bf16.json

With ``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MINIPAGED_CPU_ARCH=x86-64-v3`` it times the AVX2 paths on an
AVX-512 machine (``isa_env`` in the JSON).

A decode step multiplies one row per running sequence through every weight: at 54 rows (the engine benchmark's
mean decode batch) the products are as many FLOPs per weight byte as at 2,048 rows divided by 38, and the same
kernels run well below the rate they reach on a prefill chunk. ``bench_engine.py`` charges the whole gap to
"decode GEMMs, % of floor"; this benchmark shows where it comes from, row count by row count.

Three paths over the same random weights, in one run:

- ``products``: the engine's path up to ``layers.PRODUCT_ROWS`` rows where the build has them for the dtype
  (``layers.decode_products_on``: fp32 with AVX2 or AVX-512, bf16 with AVX512-BF16 and no AMX): the
  compiled decode products (``cpu_kernel.decode_product``, ``decode_glu``), called through ``layers.Linear`` as the
  model calls them per layer (qkv; o + residual; silu(gate) * up in one pass; down + residual), then the head;
- ``packed``: the same calls with ``MINIPAGED_DECODE_PRODUCTS=0``: oneDNN's pre-packed GEMMs with their post-ops,
  the rows padded once per step to ``packed_rows`` as the step program pads them (54 rows run as 56); the
  engine's path past ``PRODUCT_ROWS`` rows and on every other CPU;
- ``plain``: PyTorch's default, ``nn.functional.linear`` followed by the same elementwise ops (``MINIPAGED_ONEDNN=0``
  in the engine).

Each row count times 30 layers plus the output head (49,152 x 576) and reports each path's milliseconds and
GFLOP/s, and the share of the packed path's best rate over the row counts measured (the 2,048-row one, in practice).

``decode_run`` prices the engine benchmark's decode steps with these timings: its default workload (128 requests,
seed 0) runs a decode step per output position, with one row per request still generating. Interpolated between
the row counts measured, that is what its decode GEMMs would take alone; the benchmark's ``step_kinds`` says what
they took inside the engine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import ISA_VARIABLES, machine, steal_s
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from minipaged.lab.workloads import generation_workload  # noqa: E402
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


def model_step(stack: list[list[layers.Linear]], head: layers.Linear, x: torch.Tensor) -> None:
    """The products of a step as the model's modules call them (``LlamaAttention``, ``LlamaMLP``)."""
    for qkv, o, gate, up, down in stack:
        qkv(x)
        o.add(x, x)
        h = layers.Linear.glu(gate, up, x)
        down.add(up.mul(x, gate.silu(x)) if h is None else h, x)
    head(x)


def packed_step(stack: list[list[layers.Linear]], head: layers.Linear, x: torch.Tensor) -> None:
    os.environ["MINIPAGED_DECODE_PRODUCTS"] = "0"
    try:
        model_step(stack, head, layers.pad_rows(x))  # padded once per step, as the step program does
    finally:
        del os.environ["MINIPAGED_DECODE_PRODUCTS"]


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


def interp(results: list[dict], rows: int, key: str) -> float:
    """``key`` at ``rows``, linear between the two measured row counts around it (clamped at the ends)."""
    if rows <= results[0]["rows"]:
        return float(results[0][key])
    for lo, hi in itertools.pairwise(results):
        if rows <= hi["rows"]:
            w = (rows - lo["rows"]) / (hi["rows"] - lo["rows"])
            return float(lo[key] + w * (hi[key] - lo[key]))
    return float(results[-1][key])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    ap.add_argument("--budget-s", type=float, default=1.0, help="time per row count, path and round (default 1)")
    ap.add_argument(
        "--rounds", type=int, default=3, help="sweeps over the row counts, best of each kept (default 3): a cloud "
        "VM's speed drifts by tens of percent between minutes, and a row count timed once may land in a slow one",
    )  # fmt: skip
    ap.add_argument("--out", type=Path, default=REPO / "assets" / "benchmarks")
    args = ap.parse_args()
    if any(r < 1 for r in args.rows):
        ap.error("--rows: every row count must be at least 1")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    dtype = getattr(torch, args.dtype)
    if layers.onednn_ops() is None:
        print(f"the packed path is off here: {layers.probe_onednn()[1]}", file=sys.stderr)
        return 1
    stack, head = build(dtype)
    flops_per_row = 2 * (LAYERS * HIDDEN * (QKV + HIDDEN + 2 * UNITS) + LAYERS * UNITS * HIDDEN + HIDDEN * VOCAB)
    results = []
    stolen = steal_s()
    row_counts = sorted(set(args.rows))
    # products: no padding, the decode products take any row count
    paths: dict[str, Step] = {"products": model_step, "packed": packed_step, "plain": plain_step}
    if not layers.decode_products_on(dtype):
        del paths["products"]  # none here: the engine runs oneDNN at every size
        print(f"no {args.dtype} decode products here: timing packed and plain", file=sys.stderr)
    best = {(rows, path): float("inf") for rows in row_counts for path in paths}
    with torch.inference_mode():
        for round_ in range(args.rounds):
            for rows in row_counts:
                for path, step in paths.items():
                    if path == "products" and rows > layers.PRODUCT_ROWS:
                        continue  # the engine runs oneDNN there: the packed path's time
                    t = seconds(step, stack, head, rows, dtype, args.budget_s)
                    best[rows, path] = min(best[rows, path], t)
            print(f"round {round_ + 1} of {args.rounds} done", flush=True)
    for rows in row_counts:
        row: dict = dict(rows=rows)
        for path in paths:
            t = best[rows, path]
            if t == float("inf"):
                continue
            row[f"{path}_ms"] = round(t * 1e3, 2)
            row[f"{path}_gflops"] = round(flops_per_row * rows / t / 1e9, 1)
        results.append(row)
        print(f"{rows:5d} rows: " + ", ".join(f"{p} {row[p + '_ms']:8.2f} ms" for p in paths if p + "_ms" in row))
    if stolen is not None and (now := steal_s()) is not None:
        stolen = round(now - stolen, 2)  # CPU time the hypervisor gave to other guests meanwhile: a noisy run
    top = max(r["packed_gflops"] for r in results)
    for r in results:
        r["packed_of_best"] = round(r["packed_gflops"] / top, 3)
    decode_run = None
    if len(results) > 1:
        _, outputs = generation_workload(128, VOCAB, 0, prompt_median=96, output_median=96)  # bench_engine's
        running = [sum(n > step for n in outputs) for step in range(1, max(outputs))]  # rows per decode step
        decode_run = dict(steps=len(running), rows_mean=round(sum(running) / len(running), 1))
        for path in paths:
            timed = [r for r in results if f"{path}_ms" in r]
            if len(timed) > 1 and max(running) <= timed[-1]["rows"]:
                decode_run[f"{path}_s"] = round(sum(interp(timed, m, f"{path}_ms") for m in running) / 1e3, 2)
        print(f"the engine benchmark's decode steps, products alone: {decode_run}")
    result = dict(
        benchmark="gemm_rows",
        date=dt.date.today().isoformat(),
        machine=machine(),
        isa_env={k: os.environ[k] for k in ISA_VARIABLES if k in os.environ},  # an instruction set forced lower
        dtype=args.dtype,
        threads=torch.get_num_threads(),
        rounds=args.rounds,
        stolen_s=stolen,
        flops_per_row=flops_per_row,
        weight_bytes=flops_per_row // 2 * dtype.itemsize,
        rows=results,
        decode_run=decode_run,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    name = "gemm_rows.json" if dtype == torch.float32 else "gemm_rows_bf16.json"
    (args.out / name).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
