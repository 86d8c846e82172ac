"""Decode attention bandwidth: the paged Triton kernel against its peers.

Decode attention reads every cached K and V byte once and does almost no arithmetic
with it, so its figure of merit is bandwidth: bytes read / time, as a fraction of the
GPU's peak HBM bandwidth. Measured in one run, on the same inputs:

* **paged**       — ``paged_decode_attention`` over a pool whose block tables are a shuffled permutation;
* **contiguous**  — the same kernel with the identity block table (each sequence's blocks back to back):
                    the price of paging is paged / contiguous time;
* **sdpa**        — PyTorch ``scaled_dot_product_attention`` on a contiguous ``[batch, kv_heads, ctx, d]``
                    cache (what you would run without paging);

over a grid of batch size x context length, plus a block-size sweep and a tile sweep (keys per K/V tile at the
grid's block size: 16 is one block, 32 and 64 span two and four) at one point.
Results go to ``assets/benchmarks/paged_attention_<device>.json`` and ``.png``.

    python benchmarks/bench_paged_attention.py                    # on a CUDA GPU
    python benchmarks/bench_paged_attention.py --interpret-smoke  # tiny grid on CPU, Triton interpreter

Targets (issue 4): >= 80 % of peak HBM bandwidth when >= 64 MB of KV is read per step, and paged within 5 %
of contiguous.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from minipaged.gpus import by_device_name  # noqa: E402  (the package's table of GPUs: peak bandwidth by name)

TARGET_FRACTION, TARGET_MIN_BYTES, TARGET_PAGED_RATIO = 0.80, 64 * 2**20, 1.05


def peak_for(name: str) -> float | None:
    """Peak memory bandwidth in GB/s of the GPU ``torch.cuda.get_device_name()`` calls ``name``, from the
    package's table of GPUs (``minipaged.gpus``, vendor datasheets), or None for a GPU it does not list."""
    gpu = by_device_name(name)
    return gpu.bandwidth_gbps if gpu else None


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


class DecodeSetup(NamedTuple):
    """What every point measures: one attention layer's heads in one dtype on one device (default: one layer
    of Llama-3-8B, 32 query heads over 8 KV heads of 128). A NamedTuple, not a dataclass: chapter 05 loads this
    file with importlib, outside sys.modules, where a dataclass cannot resolve its annotations."""

    device: torch.device
    dtype: torch.dtype
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128

    @property
    def elem(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()

    @property
    def scale(self) -> float:
        return float(self.head_dim**-0.5)

    def kv_bytes(self, batch: int, ctx: int) -> int:
        """K and V bytes one decode step reads for ``batch`` sequences of ``ctx`` tokens."""
        return batch * ctx * self.kv_heads * self.head_dim * 2 * self.elem


def bench_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """Median milliseconds of fn()."""
    if device.type == "cuda":
        import triton

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))  # flushes L2 per run
    fn()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def kernel_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """Median milliseconds of the GPU work of fn(), replayed from a CUDA graph: decode attention of a small
    batch takes a few microseconds on the GPU and far more in Python, and the figure of merit is the kernel's
    bandwidth. Without CUDA, fn() itself."""
    if device.type != "cuda":
        return bench_ms(fn, device)
    fn()  # compiled and warm before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench_ms(graph.replay, device)


def make_inputs(setup: DecodeSetup, batch: int, ctx: int, block_size: int, gen: torch.Generator) -> dict[str, Any]:
    """A query per sequence and a pool of random K/V: once behind a shuffled block table (paged), once with each
    sequence's blocks back to back (the identity block table, contiguous)."""
    device, dtype, hq, hkv, d = setup.device, setup.dtype, setup.q_heads, setup.kv_heads, setup.head_dim
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, hkv, d)
    kc = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    vc = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    q = torch.randn((batch, hq, d), generator=gen, device=device, dtype=torch.float32).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    paged = perm.reshape(batch, blocks_per_seq)  # sequence i's blocks scattered over the pool
    # The same tokens in a second pool where sequence i owns blocks i*n .. i*n+n-1: identity block table.
    kc_contig, vc_contig = kc[paged.flatten().long()], vc[paged.flatten().long()]
    contiguous = torch.arange(num_blocks, device=device, dtype=torch.int32).reshape(batch, blocks_per_seq)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return dict(q=q, lens=lens, paged=(kc, vc, paged), contiguous=(kc_contig, vc_contig, contiguous))


def sdpa_inputs(
    setup: DecodeSetup, inputs: dict[str, Any], batch: int, ctx: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same tokens as a contiguous [batch, kv_heads, ctx, d] cache, for SDPA."""
    kc, vc, _ = inputs["contiguous"]
    k, v = (c.view(batch, -1, setup.kv_heads, setup.head_dim)[:, :ctx].transpose(1, 2).contiguous() for c in (kc, vc))
    return inputs["q"][:, :, None, :], k, v


def run_point(
    setup: DecodeSetup,
    batch: int,
    ctx: int,
    block_size: int,
    *,
    peak: float | None = None,
    with_sdpa: bool = True,
    tile_n: int | None = None,
) -> dict[str, Any]:
    """One point: the paged kernel, the same kernel on contiguous blocks and (``with_sdpa``) PyTorch SDPA on a
    contiguous cache, timed on the same inputs; GB/s, and the fraction of ``peak`` GB/s when given."""
    from minipaged.kernels import paged_decode_attention
    from minipaged.kernels.paged_decode import plan_paged_decode

    device, elem, scale = setup.device, setup.elem, setup.scale
    gen = torch.Generator(device=device).manual_seed(batch * 100003 + ctx * 7 + block_size)
    inputs = make_inputs(setup, batch, ctx, block_size, gen)
    q, lens = inputs["q"], inputs["lens"]
    kv_bytes = setup.kv_bytes(batch, ctx)
    total_bytes = kv_bytes + 2 * q.numel() * elem + inputs["paged"][2].numel() * 4 + lens.numel() * 4
    row: dict[str, Any] = dict(batch=batch, context=ctx, block_size=block_size, kv_bytes=kv_bytes,
                               bytes_read=total_bytes)  # fmt: skip
    outs = {}
    for label in ("paged", "contiguous"):
        kc, vc, table = inputs[label]
        outs[label] = torch.empty_like(q)
        launches = plan_paged_decode(q, kc, vc, table, lens, scale, outs[label], tile_n=tile_n)
        row["tile_n"], row["num_segments"] = launches[0].constexprs["TILE_N"], launches[0].grid[2]

        def run_launches(launches: list[Any] = launches) -> None:
            for launch in launches:
                launch.run()

        row[f"{label}_ms"] = kernel_ms(run_launches, device)
    out_paged, out_contig = outs["paged"], outs["contiguous"]
    kc, vc, table = inputs["paged"]

    def call() -> torch.Tensor:
        return paged_decode_attention(q, kc, vc, table, lens, scale)

    if tile_n is None:  # the wrapper, checks included, computes what its plan computes
        assert torch.equal(call(), out_paged)
    # What one call of the wrapper costs, checks and planning on the host included (the engine plans once
    # a step and skips the checks after its first layer, so its layers pay the kernel time above).
    row["paged_call_ms"] = bench_ms(call, device)
    if with_sdpa:
        qs, ks, vs = sdpa_inputs(setup, inputs, batch, ctx)

        def sdpa() -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, scale=scale, enable_gqa=True)

        ref = sdpa()[:, :, 0]
        row["max_abs_err_vs_sdpa"] = float((out_paged.float() - ref.float()).abs().max())
        row["sdpa_ms"] = kernel_ms(sdpa, device)
        del qs, ks, vs
    row["paged_equals_contiguous"] = bool(torch.equal(out_paged, out_contig))
    for label in ("paged", "contiguous", "sdpa"):
        if f"{label}_ms" in row:
            gbps = total_bytes / (row[f"{label}_ms"] * 1e-3) / 1e9
            row[f"{label}_gbps"] = gbps
            row[f"{label}_frac_peak"] = gbps / peak if peak else None
    row["paged_over_contiguous"] = row["paged_ms"] / row["contiguous_ms"]
    if with_sdpa:
        row["paged_over_sdpa"] = row["paged_ms"] / row["sdpa_ms"]
    del inputs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--interpret-smoke",
        action="store_true",
        help="tiny grid on CPU under TRITON_INTERPRET=1, to prove the script runs (no GPU needed)",
    )
    p.add_argument("--peak-gbps", type=float, default=None, help="peak HBM bandwidth in GB/s (default: by device name)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    p.add_argument(
        "--block-sizes",
        type=int,
        nargs="+",
        default=[8, 16, 32, 64, 128],
        help="block-size sweep at --sweep-batch x --sweep-context",
    )
    p.add_argument("--block-size", type=int, default=16, help="block size of the batch x context grid")
    p.add_argument(
        "--tile-sizes",
        type=int,
        nargs="+",
        default=[16, 32, 64],
        help="keys per K/V tile at --block-size, --sweep-batch x --sweep-context (the kernel's own tile is in the "
        "block-size sweep and every grid row)",
    )
    p.add_argument("--sweep-batch", type=int, default=32)
    p.add_argument("--sweep-context", type=int, default=4096)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8, help="default 32/8/128: one layer of Llama-3-8B")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    p.add_argument("--max-kv-gib", type=float, default=8.0, help="skip grid points whose KV exceeds this")
    p.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="default assets/benchmarks (a temporary folder for --interpret-smoke)",
    )
    args = p.parse_args()
    if args.interpret_smoke:
        args.batches, args.contexts = [1, 3], [40, 100]
        args.block_sizes, args.block_size, args.sweep_batch, args.sweep_context = [16, 32], 16, 2, 64
        args.tile_sizes = [16, 32]
        args.q_heads, args.kv_heads, args.head_dim, args.dtype = 4, 2, 64, "float32"
    return args


def main() -> int:
    args = parse_args()
    if args.interpret_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before minipaged.kernels defines its kernels
    if not args.interpret_smoke and not torch.cuda.is_available():
        print(
            "bench_paged_attention: no CUDA GPU here. This benchmark measures HBM bandwidth and needs one;\n"
            "run it on a GPU machine, or pass --interpret-smoke to check the script on CPU (tiny grid, no timing "
            "worth reading).",
            file=sys.stderr,
        )
        return 2
    import triton

    import minipaged

    device = torch.device("cpu" if args.interpret_smoke else "cuda")
    dtype = getattr(torch, args.dtype)
    setup = DecodeSetup(device, dtype, args.q_heads, args.kv_heads, args.head_dim)
    hq, hkv, d = args.q_heads, args.kv_heads, args.head_dim
    name = "cpu-triton-interpreter" if args.interpret_smoke else torch.cuda.get_device_name(device)
    peak = args.peak_gbps if args.peak_gbps is not None else (None if args.interpret_smoke else peak_for(name))
    if peak is None and not args.interpret_smoke:
        print(f"unknown peak bandwidth for {name!r}: pass --peak-gbps; reporting GB/s only", file=sys.stderr)

    def run(batch: int, ctx: int, block_size: int, with_sdpa: bool, tile_n: int | None = None) -> dict[str, Any]:
        return run_point(setup, batch, ctx, block_size, peak=peak, with_sdpa=with_sdpa, tile_n=tile_n)

    def show(row: dict) -> None:
        frac = row.get("paged_frac_peak")
        print(
            f"  batch {row['batch']:>4}  ctx {row['context']:>6}  bs {row['block_size']:>3}  tile {row['tile_n']:>3}  "
            f"KV {row['kv_bytes'] / 2**20:9.1f} MiB  paged {row['paged_ms'] * 1e3:9.1f} us "
            f"{row['paged_gbps']:8.1f} GB/s"
            + (f" ({frac:5.1%} of peak)" if frac else "")
            + f"  call {row['paged_call_ms'] * 1e3:7.1f} us"
            + f"  paged/contig {row['paged_over_contiguous']:.3f}"
            + (f"  paged/sdpa {row['paged_over_sdpa']:.3f}" if "paged_over_sdpa" in row else ""),
            flush=True,
        )

    print(f"device: {name}   peak: {peak or 'unknown'} GB/s   {dtype}   heads {hq}/{hkv}   head_dim {d}")
    grid = []
    print(f"batch x context grid (block_size {args.block_size}):")
    for batch in args.batches:
        for ctx in args.contexts:
            if setup.kv_bytes(batch, ctx) > args.max_kv_gib * 2**30:
                print(f"  batch {batch:>4}  ctx {ctx:>6}  skipped (KV over {args.max_kv_gib} GiB)")
                continue
            row = run(batch, ctx, args.block_size, with_sdpa=True)
            grid.append(row)
            show(row)
    sweep = []
    print(f"block-size sweep (batch {args.sweep_batch}, context {args.sweep_context}):")
    for bs in args.block_sizes:
        row = run(args.sweep_batch, args.sweep_context, bs, with_sdpa=False)
        sweep.append(row)
        show(row)
    tile_sweep = []
    print(f"tile sweep (block size {args.block_size}, batch {args.sweep_batch}, context {args.sweep_context}):")
    for tile in args.tile_sizes:
        row = run(args.sweep_batch, args.sweep_context, args.block_size, with_sdpa=False, tile_n=tile)
        tile_sweep.append(row)
        show(row)

    min_bytes = 0 if args.interpret_smoke else TARGET_MIN_BYTES  # the smoke grid is tiny: summarise all of it
    big = [r for r in grid if r["kv_bytes"] >= min_bytes]
    summary = {}
    if big:
        summary = dict(
            summarised_points=len(big),
            summarised_min_kv_bytes=min_bytes,
            max_abs_err_vs_sdpa=max(r["max_abs_err_vs_sdpa"] for r in big),
            paged_equals_contiguous=all(r["paged_equals_contiguous"] for r in grid + sweep + tile_sweep),
            tile_n=big[0]["tile_n"],
            min_paged_frac_peak=min(r["paged_frac_peak"] for r in big) if peak else None,
            median_paged_frac_peak=statistics.median(r["paged_frac_peak"] for r in big) if peak else None,
            max_paged_over_contiguous=max(r["paged_over_contiguous"] for r in big),
            median_paged_over_sdpa=statistics.median(r["paged_over_sdpa"] for r in big),
        )
        if peak:
            summary["meets_bandwidth_target"] = summary["min_paged_frac_peak"] >= TARGET_FRACTION
        summary["meets_paged_vs_contiguous_target"] = summary["max_paged_over_contiguous"] <= TARGET_PAGED_RATIO
    print("summary:", json.dumps(summary))

    result = dict(
        benchmark="paged_decode_attention",
        device=name,
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        mode="triton-interpreter (smoke test, timings meaningless)" if args.interpret_smoke else "cuda",
        peak_gbps=peak,
        peak_source="--peak-gbps" if args.peak_gbps is not None else "minipaged.gpus (device-name table)",
        versions=dict(
            python=platform.python_version(),
            torch=torch.__version__,
            triton=triton.__version__,
            cuda=torch.version.cuda,
            minipaged=minipaged.__version__,
        ),
        config=dict(
            dtype=args.dtype,
            q_heads=hq,
            kv_heads=hkv,
            head_dim=d,
            grid_block_size=args.block_size,
            sweep_batch=args.sweep_batch,
            sweep_context=args.sweep_context,
            timing="triton.testing.do_bench median of CUDA graph replays (kernel time), L2 flushed; "
            "paged_call_ms: one Python call of paged_decode_attention, checks and planning included"
            if device.type == "cuda"
            else "perf_counter median of 3",
        ),
        targets=dict(
            fraction_of_peak=TARGET_FRACTION, min_kv_bytes=TARGET_MIN_BYTES, paged_over_contiguous=TARGET_PAGED_RATIO
        ),
        summary=summary,
        grid=grid,
        block_size_sweep=sweep,
        tile_sweep=tile_sweep,
    )
    out_dir = args.out_dir or (
        Path(tempfile.mkdtemp(prefix="bench_paged_")) if args.interpret_smoke else REPO / "assets" / "benchmarks"
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"paged_attention_{slug(name)}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, stem.with_suffix(".png"))
    print(f"wrote {stem}.json and {stem}.png")
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peak = result["peak_gbps"]
    metric, ylabel = ("frac_peak", "fraction of peak HBM bandwidth") if peak else ("gbps", "GB/s")
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ax = axes[0]
    batches = sorted({r["batch"] for r in result["grid"]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, b in enumerate(batches):
        rows = sorted((r for r in result["grid"] if r["batch"] == b), key=lambda r: r["kv_bytes"])
        x = [r["kv_bytes"] / 2**20 for r in rows]
        c = colors[i % len(colors)]
        ax.plot(x, [r[f"paged_{metric}"] for r in rows], "o-", color=c, label=f"paged, batch {b}")
        ax.plot(x, [r[f"contiguous_{metric}"] for r in rows], "x--", color=c, alpha=0.7)
        ax.plot(x, [r[f"sdpa_{metric}"] for r in rows], "s:", color=c, alpha=0.5)
    if peak:
        ax.axhline(TARGET_FRACTION, color="grey", lw=0.8)
        ax.axvline(TARGET_MIN_BYTES / 2**20, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("KV read per step (MiB)")
    ax.set_ylabel(ylabel)
    ax.set_title("decode bandwidth (o paged, x contiguous, s SDPA)")
    ax.legend(fontsize=7)

    ax = axes[1]
    rows = sorted(result["grid"], key=lambda r: r["kv_bytes"])
    x = [r["kv_bytes"] / 2**20 for r in rows]
    ax.plot(x, [r["paged_over_contiguous"] for r in rows], "o", label="paged / contiguous (same kernel)")
    ax.plot(x, [r["paged_over_sdpa"] for r in rows], "s", label="paged / SDPA contiguous")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(TARGET_PAGED_RATIO, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log")
    if max(r["paged_over_sdpa"] for r in rows) > 10:  # the interpreter smoke test: orders of magnitude
        ax.set_yscale("log")
    ax.set_xlabel("KV read per step (MiB)")
    ax.set_ylabel("time ratio (lower is faster)")
    ax.set_title("the price of paging")
    ax.legend(fontsize=7)

    ax = axes[2]
    sweep = result["block_size_sweep"] + result.get("tile_sweep", [])  # runs before the tile sweep have none
    labels = [f"{r['block_size']}/{r['tile_n']}" if "tile_n" in r else str(r["block_size"]) for r in sweep]
    ax.bar(labels, [r[f"paged_{metric}"] for r in sweep], label="paged")
    ax.plot(labels, [r[f"contiguous_{metric}"] for r in sweep], "kx", label="contiguous")
    ax.set_xlabel("block size / keys per tile (tokens)")
    ax.set_ylabel(ylabel)
    cfg = result["config"]
    ax.set_title(f"block size (batch {cfg['sweep_batch']}, context {cfg['sweep_context']})")
    ax.legend(fontsize=7)

    fig.suptitle(
        f"paged decode attention — {result['device']} — {result['date'][:10]} — {cfg['dtype']}, "
        f"{cfg['q_heads']}/{cfg['kv_heads']} heads, head_dim {cfg['head_dim']}"
        + (" — INTERPRETER SMOKE TEST" if "interpreter" in result["mode"] else "")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
