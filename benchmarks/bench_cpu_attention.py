"""CPU paged attention: four ways to read K/V through the block tables, on SmolLM2's shapes, in one run.

Why this benchmark exists: it is how the engine's CPU attention was chosen (issue 18 ranked the
options torch.compile > flex_attention > a kernel of our own, "if neither reaches the target").
One decode step of ``--batch`` sequences (9 query heads over 3 KV heads, head_dim 64, block 16,
context lengths uniform in ``--min-len``..``--max-len``, block tables a shuffled permutation of a
pool bigger than the L3 cache), one layer's attention, timed five ways:

* **reference**        ``kernels/reference.py``: one sequence at a time (the specification);
* **gather + SDPA**    ``torch_backend`` without the kernel: length-sorted groups, ``index_select`` + SDPA;
* **torch.compile**    inductor's C++ code for the same math written as mul + sum over ``key_cache[slots]``
                       (the indexing fuses into the loops: nothing is gathered), on the same length groups;
* **flex_attention**   compiled, with a ``BlockMask`` whose KV blocks are the block tables (``kv_indices``)
                       and a mask_mod that cuts each sequence at its length;
* **kernel**           ``kernels/cpu_paged_attention.cpp``: the block table walked in place, online softmax.

Then the prefill crossover: 16 sequences of N new tokens each (N = 16..512), kernel against gather +
SDPA, which is why ``torch_backend.KERNEL_MAX_Q_LEN`` sends long prefills to SDPA. Every result is
checked against the reference first. Writes ``assets/benchmarks/cpu_attention.json``.

    python benchmarks/bench_cpu_attention.py
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import torch  # noqa: E402
from common import machine  # noqa: E402

from minipaged.kernels import cpu_kernel, reference, torch_backend  # noqa: E402


def best_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(min(times) * 1e3, 3)


def mul_sum_attention(
    q: torch.Tensor,
    flat_k: torch.Tensor,
    flat_v: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention as pointwise products and sums, for inductor to fuse ``flat_k[slots]`` into its loops."""
    n, hq, d = q.shape
    hkv = flat_k.shape[1]
    qf = q.float().view(n, 1, hkv, hq // hkv, d)
    s = (qf * flat_k[slots].float()[:, :, :, None, :]).sum(-1) * scale  # [n, L, hkv, g]
    valid = torch.arange(slots.shape[1], device=q.device)[None, :] < seq_lens[:, None]
    p = torch.softmax(s.masked_fill(~valid[:, :, None, None], float("-inf")), dim=1)
    return (p[..., None] * flat_v[slots].float()[:, :, :, None, :]).sum(1).reshape(n, hq, d).to(q.dtype)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--min-len", type=int, default=20)
    ap.add_argument("--max-len", type=int, default=400)
    ap.add_argument("--pool-blocks", type=int, default=6000)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=REPO / "assets" / "benchmarks" / "cpu_attention.json")
    args = ap.parse_args()

    torch.manual_seed(0)
    bs, hkv, hq, d, scale = 16, 3, 9, 64, 0.125
    kc = torch.randn(args.pool_blocks, bs, hkv, d)
    vc = torch.randn(args.pool_blocks, bs, hkv, d)
    n = args.batch
    lens = torch.randint(args.min_len, args.max_len + 1, (n,), dtype=torch.int32)
    width = int((lens.max() + bs - 1) // bs)
    tables = torch.randperm(args.pool_blocks)[: n * width].view(n, width).to(torch.int32)
    q = torch.randn(n, hq, d)
    cu = torch.arange(n + 1, dtype=torch.int32)
    spec = reference.paged_decode_attention(q, kc, vc, tables, lens, scale)
    kv_mb = 2 * int(lens.sum()) * hkv * d * 4 / 1e6
    rows: dict[str, dict] = {}

    def record(name: str, fn, reps: int = args.reps, note: str = "") -> None:
        err = float((fn() - spec).abs().max())
        assert err < 1e-4, f"{name} disagrees with the reference: {err}"
        ms = best_ms(fn, reps)
        rows[name] = dict(ms=ms, gb_per_s=round(kv_mb / ms, 2), max_abs_error=err, note=note)
        print(f"{name:<16}{ms:>9.2f} ms {kv_mb / ms:>7.2f} GB/s  {note}", flush=True)

    print(f"decode: {n} sequences, {int(lens.sum())} context tokens, {kv_mb:.1f} MB of K/V per layer")
    record("reference", lambda: reference.paged_decode_attention(q, kc, vc, tables, lens, scale), reps=3)
    plan = torch_backend.plan_attention(tables, cu, lens, bs, in_place=False)
    record(
        "gather + SDPA", lambda: torch_backend.attend(plan, q, kc, vc, scale), note=f"{len(plan.decode)} length groups"
    )

    compiled = torch.compile(mul_sum_attention, dynamic=True, fullgraph=True)
    flat_k, flat_v = kc.view(-1, hkv, d), vc.view(-1, hkv, d)
    groups = [(dec.rows, dec.slots, lens[dec.rows]) for dec in plan.decode]  # the same length groups

    def inductor() -> torch.Tensor:
        out = torch.empty_like(q)
        for r, slots, ln in groups:
            out[r] = compiled(q[r], flat_k, flat_v, slots, ln, scale)
        return out

    t0 = time.perf_counter()
    inductor()
    compile_s = time.perf_counter() - t0
    record("torch.compile", inductor, note=f"inductor C++, first call (compile) {compile_s:.0f} s")

    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    num_blocks = args.pool_blocks
    need = (lens + bs - 1) // bs
    logical = torch.full((n, num_blocks), -1, dtype=torch.int32)  # physical block -> its place in the sequence
    for i in range(n):
        logical[i, tables[i, : need[i]].long()] = torch.arange(int(need[i]), dtype=torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        pos = logical[q_idx, kv_idx // bs]
        return (pos >= 0) & (pos * bs + kv_idx % bs < lens[q_idx])

    kv_indices = torch.zeros(1, 1, n, num_blocks, dtype=torch.int32)
    kv_indices[0, 0, :, :width] = tables
    block_mask = BlockMask.from_kv_blocks(
        need.to(torch.int32)[None, None],
        kv_indices,
        BLOCK_SIZE=(1, bs),
        mask_mod=mask_mod,
        seq_lengths=(n, num_blocks * bs),
    )
    flex = torch.compile(flex_attention, dynamic=False)
    Q, K, V = q.view(1, n, hq, d).transpose(1, 2), flat_k[None].transpose(1, 2), flat_v[None].transpose(1, 2)
    t0 = time.perf_counter()
    flex(Q, K, V, block_mask=block_mask, enable_gqa=True, scale=scale)
    compile_s = time.perf_counter() - t0
    record(
        "flex_attention",
        lambda: flex(Q, K, V, block_mask=block_mask, enable_gqa=True, scale=scale)[0].transpose(0, 1),
        note=f"paged BlockMask (built once, not timed), compile {compile_s:.0f} s",
    )

    if cpu_kernel.unavailable_reason() is None:
        record(
            "kernel",
            lambda: cpu_kernel.paged_attention(q, kc, vc, tables, cu, lens, scale),
            note="cpu_paged_attention.cpp, in place",
        )
    else:
        print("kernel: not built here:", cpu_kernel.unavailable_reason())

    prefill = []
    print("\nprefill: 16 sequences of N new tokens (their whole context)")
    for N in (16, 32, 48, 64, 128, 256, 512):
        cu_p = torch.arange(17, dtype=torch.int32) * N
        lens_p = torch.full((16,), N, dtype=torch.int32)
        qp = torch.randn(16 * N, hq, d)
        tp = torch.randperm(args.pool_blocks)[: 16 * ((N + bs - 1) // bs)].view(16, -1).to(torch.int32)
        plan_p = torch_backend.plan_attention(tp, cu_p, lens_p, bs, in_place=False)
        row = dict(
            new_tokens=N,
            sdpa_ms=best_ms(lambda plan_p=plan_p, qp=qp: torch_backend.attend(plan_p, qp, kc, vc, scale), 5),
        )
        if cpu_kernel.unavailable_reason() is None:
            got = cpu_kernel.paged_attention(qp, kc, vc, tp, cu_p, lens_p, scale)
            assert float((got - torch_backend.attend(plan_p, qp, kc, vc, scale)).abs().max()) < 1e-4
            row["kernel_ms"] = best_ms(
                lambda qp=qp, tp=tp, cu_p=cu_p, lens_p=lens_p: cpu_kernel.paged_attention(
                    qp, kc, vc, tp, cu_p, lens_p, scale
                ),
                5,
            )
        prefill.append(row)
        print(f"  N={N:<4} SDPA {row['sdpa_ms']:8.2f} ms   kernel {row.get('kernel_ms', float('nan')):8.2f} ms")

    result = dict(
        benchmark="cpu_attention",
        date=dt.date.today().isoformat(),
        machine=machine(),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        omp_wait_policy=os.environ["OMP_WAIT_POLICY"],
        decode=dict(
            batch=n,
            context_tokens=int(lens.sum()),
            kv_mb=round(kv_mb, 1),
            num_q_heads=hq,
            num_kv_heads=hkv,
            head_dim=d,
            block_size=bs,
            pool_blocks=args.pool_blocks,
            results=rows,
        ),
        prefill=prefill,
        kernel_max_q_len=torch_backend.KERNEL_MAX_Q_LEN,
    )
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
