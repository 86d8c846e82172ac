"""The engine under faults and bad input: every public call completes, or raises and leaves nothing behind.

A tiny random Llama (no tokenizer: prompts are token ids) keeps this fast. After any failure the
engine must hold no request, every block must be free, and what it produces next must be token for
token what a fresh engine produces.
"""

from __future__ import annotations

import gc
import random
import tracemalloc

import numpy as np
import pytest
import torch
from conftest import PREEMPTING_PROMPTS, small_engine

from minipaged.config import parse_memory as _parse_memory
from minipaged.core.block_pool import BlockPool
from minipaged.engine.llm import LLM
from minipaged.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # injected faults in every public call: make test-slow

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def expected(tiny_model):
    return token_ids(small_engine(tiny_model).generate(PREEMPTING_PROMPTS, GREEDY))


def assert_clean(llm: LLM) -> None:
    """No request anywhere, every block back in the pool (CPU swap space too), nothing kept per request."""
    s, kv = llm.scheduler, llm.kv_cache_manager
    assert not s.requests and not s.waiting and not s.running and not kv.swap.swapped_blocks
    assert not kv.req_to_blocks and not llm._requests and not llm.sampler._generators
    assert kv.get_num_free_blocks() == llm.num_blocks - 1
    if kv.swap.cpu_pool is not None:
        assert kv.swap.cpu_pool.get_num_free_blocks() == kv.swap.num_cpu_blocks - 1


class Fault(Exception):
    pass


def fail_on_call(obj, name: str, n: int, exc: type[BaseException] = Fault):
    """Make ``obj.name`` raise on its n-th call (1-based); every other call goes through."""
    real = getattr(obj, name)
    calls = [0]

    def wrapper(*a, **k):
        calls[0] += 1
        if calls[0] == n:
            raise exc(f"injected into {name}, call {n}")
        return real(*a, **k)

    setattr(obj, name, wrapper)
    return calls


# ---- phases of a step ---------------------------------------------------------------------------
PHASES = {
    "schedule": lambda llm: (llm.scheduler, "schedule"),
    "cache copies": lambda llm: (llm.cache, "swap_out"),
    "forward": lambda llm: (llm.model, "forward"),
    "sample": lambda llm: (llm.sampler, "sample_on_device"),
    "update": lambda llm: (llm.scheduler, "update_from_output"),
}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("phase", list(PHASES))
def test_a_fault_in_any_phase_leaves_nothing_behind(tiny_model, expected, phase, mode):
    kw = dict(preemption_mode=mode, swap_space=4096 if mode == "swap" else 0)
    llm = small_engine(tiny_model, **kw)
    obj, name = PHASES[phase](llm)
    fail_on_call(obj, name, 3)  # the third step: mid-prefill, blocks hashed
    with pytest.raises(Fault, match=f"injected into {name}"):
        llm.generate(PREEMPTING_PROMPTS, GREEDY)
    assert_clean(llm)
    assert token_ids(llm.generate(PREEMPTING_PROMPTS, GREEDY)) == expected  # the same engine, unpoisoned
    assert_clean(llm)


def test_random_interrupts_of_generate_and_stream(tiny_model, expected):
    """Ctrl-C at a random step of generate, a stream closed after a random number of outputs: each time the
    engine is clean, and the next full run equals a fresh engine's."""
    rng = random.Random(0)
    llm = small_engine(tiny_model, preemption_mode="swap", swap_space=4096)
    for _trial in range(6):
        fail_on_call(llm, "step", rng.randint(1, 12), KeyboardInterrupt)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PREEMPTING_PROMPTS, GREEDY)
        del llm.step  # back to the class's method
        assert_clean(llm)
        stream = llm.stream(PREEMPTING_PROMPTS, GREEDY)
        for _ in range(rng.randint(1, 8)):
            next(stream)
        stream.close()  # the caller stops reading
        assert_clean(llm)
    assert token_ids(llm.generate(PREEMPTING_PROMPTS, GREEDY)) == expected


def test_abort_stops_requests_wherever_they_are(tiny_model):
    llm = small_engine(tiny_model)
    ids = [llm.add_request(p, GREEDY) for p in PREEMPTING_PROMPTS]
    llm.step()
    llm.step()
    assert llm.scheduler.running and llm.scheduler.waiting
    llm.abort(ids[:2])
    llm.abort(["never-added"])  # unknown ids are ignored, as in vLLM
    assert all(i not in llm.scheduler.requests for i in ids[:2])
    llm.abort(ids[2:])
    assert_clean(llm)


def test_a_request_id_can_be_used_again_once_it_finished(tiny_model):
    llm = small_engine(tiny_model)
    llm.add_request([1, 2, 3], GREEDY, request_id="chat-turn")
    with pytest.raises(ValueError, match="already in use"):
        llm.add_request([4], GREEDY, request_id="chat-turn")
    while not llm.get_output("chat-turn").finished:
        llm.step()
    with pytest.raises(ValueError, match="unknown request id"):  # handed back once, then forgotten
        llm.get_output("chat-turn")
    llm.add_request([4, 5], GREEDY, request_id="chat-turn")
    while llm.scheduler.has_unfinished():
        llm.step()
    assert llm.get_output("chat-turn").outputs[0].token_ids
    assert_clean(llm)


def test_a_long_lived_engine_keeps_bounded_state(tiny_model):
    """Thousands of requests through one LLM: its containers stay empty between calls and its memory flat."""
    llm = small_engine(tiny_model, num_gpu_blocks_override=64, max_num_batched_tokens=256, max_num_seqs=64)
    params = [SamplingParams(max_tokens=2, temperature=0.8, seed=i, ignore_eos=True) for i in range(64)]
    rng = random.Random(1)

    def batch() -> None:
        prompts = [[rng.randrange(96) for _ in range(rng.randint(1, 6))] for _ in range(64)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 2 for o in outs)
        assert_clean(llm)

    for _ in range(5):  # warm-up: allocator pools, caches
        batch()
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for _ in range(30):  # 1,920 more requests
        batch()
    gc.collect()
    grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    tracemalloc.stop()
    assert grown < 2_000_000, f"{grown:,} bytes kept after 1,920 requests"  # the step log (bounded) aside
    assert len(llm.step_stats) <= llm.step_stats.maxlen


# ---- poisoned engine ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(temperature=float("nan")), "temperature must be a finite number"),
        (dict(temperature=float("inf")), "temperature must be a finite number"),
        (dict(top_p=float("nan")), "top_p must be a finite number"),
        (dict(seed=1.5), "seed must be an integer"),
        (dict(seed="7"), "seed must be an integer"),
        (dict(max_tokens=2.0), "max_tokens must be a positive integer"),
        (dict(n=True), "n must be a positive integer"),
        (dict(top_k=1.5), "top_k must be"),
        (dict(stop_token_ids=[1.5]), "stop_token_ids entry must be"),
        (dict(stop_token_ids="12"), "stop_token_ids must be a sequence"),
        (dict(ignore_eos="yes"), "ignore_eos must be True or False"),
    ],
)
def test_bad_sampling_params_are_refused_when_built(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_a_request_whose_logits_are_nan_finishes_with_an_error_alone(tiny_model, expected):
    llm = small_engine(tiny_model)
    real = llm.model.compute_logits
    poisoned = {"step": 0}

    def compute_logits(hidden):
        logits = real(hidden)
        poisoned["step"] += 1
        if poisoned["step"] == 4:
            logits[0] = float("nan")  # the first sampling row of this step
        return logits

    llm.model.compute_logits = compute_logits
    outs = llm.generate(PREEMPTING_PROMPTS, GREEDY)
    bad = [o for o in outs if o.error]
    assert len(bad) == 1 and "NaN or infinite logits" in bad[0].error and bad[0].finished
    assert bad[0].outputs[0].finish_reason == "error"
    good = [o for o in outs if not o.error]
    assert all(len(o.outputs[0].token_ids) == 6 for o in good)
    assert_clean(llm)
    llm.model.compute_logits = real
    assert token_ids(llm.generate(PREEMPTING_PROMPTS, GREEDY)) == expected


def test_the_jth_sample_of_a_seeded_request_draws_from_seed_plus_j(tiny_model):
    """Forked samples are named by (request, index), not by parsing "id#j": sample j of a request with
    seed s is the request with seed s + j drawn alone."""
    llm = small_engine(tiny_model, num_gpu_blocks_override=40)
    prompt = [5, 17, 3, 9, 40, 2]
    out = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=1.0, seed=11, n=3, ignore_eos=True))[0]
    alone = [
        llm.generate([prompt], SamplingParams(max_tokens=5, temperature=1.0, seed=11 + j, ignore_eos=True))[0]
        for j in range(3)
    ]
    assert [o.token_ids for o in out.outputs] == [a.outputs[0].token_ids for a in alone]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert_clean(llm)


# ---- the batch is checked before anything is queued -------------------------------------------
@pytest.mark.parametrize(
    "bad,match",
    [
        ([], "empty prompt"),
        ([5, 200], "outside the vocabulary"),
        (None, "a prompt is None"),
        ([5, "x"], "mixes other things"),
        ([{"role": "user"}], "must have a 'role' and a 'content'"),
        ({"role": "user", "content": "hi"}, "a chat prompt is a \\*list\\* of messages"),
        (np.zeros((2, 3), dtype=np.int64), "must be 1-D integer token ids"),
        (torch.tensor([1.0, 2.0]), "must be 1-D integer token ids"),
        (3.5, "got float"),
    ],
)
def test_a_bad_prompt_anywhere_queues_nothing(tiny_model, bad, match):
    llm = small_engine(tiny_model)
    with pytest.raises(ValueError, match=match):
        llm.generate([[5, 6, 7], bad], GREEDY)
    assert_clean(llm)
    assert not llm.scheduler.has_unfinished()


def test_token_ids_as_numpy_or_torch(tiny_model, expected):
    llm = small_engine(tiny_model)
    as_lists = token_ids(llm.generate(PREEMPTING_PROMPTS[:2], GREEDY))
    assert as_lists == expected[:2]
    assert (
        token_ids(
            llm.generate(
                [np.array(PREEMPTING_PROMPTS[0]), torch.tensor(PREEMPTING_PROMPTS[1], dtype=torch.int32)], GREEDY
            )
        )
        == as_lists
    )
    assert (
        token_ids(llm.generate(np.array(PREEMPTING_PROMPTS[0], dtype=np.int64), GREEDY)) == as_lists[:1]
    )  # one prompt


# ---- a step happens, or it does not -----------------------------------------------------------
def test_update_from_output_changes_nothing_when_a_token_is_missing(tiny_model):
    llm = small_engine(tiny_model)
    for p in PREEMPTING_PROMPTS[1:4]:
        llm.add_request(p, GREEDY)
    out = llm.scheduler.schedule()
    reqs = llm.scheduler.requests  # the step names requests by id (plain data); the scheduler holds them
    before = [(reqs[s.request_id].num_computed_tokens, reqs[s.request_id].num_output_tokens) for s in out.scheduled]
    sampled = {s.request_id: [1] for s in out.scheduled if s.samples}
    assert len(sampled) == 2
    sampled.pop(list(sampled)[-1])  # the last sampling request got nothing; the first was fine
    with pytest.raises(ValueError, match="needs 1 sampled token"):
        llm.scheduler.update_from_output(out, sampled)
    assert [
        (reqs[s.request_id].num_computed_tokens, reqs[s.request_id].num_output_tokens) for s in out.scheduled
    ] == before


def test_a_request_with_nothing_to_compute_is_never_scheduled(tiny_model):
    """A zero-token row would sample another request's logits: the scheduler refuses to build one."""
    llm = small_engine(tiny_model)
    rid = llm.add_request([1, 2, 3], GREEDY)
    llm.step()
    req = llm.scheduler.requests[rid]
    req.num_computed_tokens = req.num_tokens  # a corrupted request
    with pytest.raises(RuntimeError, match="scheduled with 0 new tokens"):
        llm.step()


# ---- the block pool checks a whole free before touching anything -------------------------------
def test_free_blocks_checks_the_whole_list_first():
    pool, other = BlockPool(6, enable_caching=False), BlockPool(6, enable_caching=False)
    a, b = pool.get_new_blocks(2)
    free_before = pool.get_num_free_blocks()
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([a, b, b])
    assert (a.ref_cnt, b.ref_cnt, pool.get_num_free_blocks()) == (1, 1, free_before)  # nothing changed
    with pytest.raises(ValueError, match="does not belong to this pool"):
        pool.free_blocks([a, other.blocks[3]])
    assert a.ref_cnt == 1 and pool.get_num_free_blocks() == free_before
    pool.free_blocks([a, b])
    assert pool.get_num_free_blocks() == free_before + 2


# ---- errors that say what went wrong ------------------------------------------------------------
@pytest.mark.parametrize(
    "text,value",
    [
        ("2GiB", 2 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("64KiB", 65536),
        ("64KB", 64000),
        ("1TB", 10**12),
        ("1TiB", 2**40),
        ("1073741824", 2**30),
        (" 8 mib ", 8 * 2**20),
        (1e9, 10**9),
        (4096, 4096),
    ],
)
def test_memory_sizes(text, value):
    assert _parse_memory(text) == value


@pytest.mark.parametrize("bad", ["lots", "2 parsecs", "-1GiB", -5, float("nan"), True, None])
def test_bad_memory_sizes_name_the_problem(bad):
    with pytest.raises(ValueError, match="swap_space"):
        _parse_memory(bad, "swap_space")


def test_engine_arguments_are_checked_and_explained(tiny_model):
    with pytest.raises(ValueError, match="longer than the model's max_position_embeddings=128"):
        small_engine(tiny_model, max_model_len=256, num_gpu_blocks_override=80)
    assert (
        small_engine(
            tiny_model, max_model_len=256, num_gpu_blocks_override=80, allow_long_max_model_len=True
        ).max_model_len
        == 256
    )
    with pytest.warns(UserWarning, match="max_model_len lowered from 128 to 44 tokens"):
        llm = LLM(model=tiny_model, block_size=4, num_gpu_blocks_override=12)
    assert llm.max_model_len == 44
    with pytest.raises(ValueError, match="needs swap space on the CPU: pass swap_space"):
        small_engine(tiny_model, preemption_mode="swap")
    with pytest.raises(ValueError, match="holds no block"):
        small_engine(tiny_model, preemption_mode="swap", swap_space=10)
    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer"):
        small_engine(tiny_model, max_num_seqs=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA GPU"):
            small_engine(tiny_model, device="cuda")
    with pytest.raises(ValueError, match="device must be"):
        small_engine(tiny_model, device="tpu")
    with pytest.raises(ValueError, match="unknown engine argument\\(s\\) 'blocksize'"):
        LLM(model=tiny_model, blocksize=16)
    with pytest.raises(ValueError, match="watermark must be a fraction in \\[0, 1\\)"):
        small_engine(tiny_model, watermark=1.5)


def test_cuda_ranks_need_a_gpu_each(tiny_model, monkeypatch):
    """Tensor parallelism on CUDA gives each rank of this machine its own GPU: asking for more ranks than GPUs
    (or for a GPU index past the last) is refused when the engine is built, before any worker starts."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 puts 3 rank\(s\) on this machine.*sees 2 GPU"):
        small_engine(tiny_model, device="cuda", tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"cuda:1 to cuda:2\), but torch sees 2 GPU"):
        small_engine(tiny_model, device="cuda:1", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"device='cuda:2' was asked for, but torch sees 2 GPU"):
        small_engine(tiny_model, device="cuda:2")
    with pytest.raises(ValueError, match=r"puts 2 rank\(s\).*cuda:1 to cuda:2"):  # 4 ranks over 2 machines
        small_engine(tiny_model, device="cuda:1", tensor_parallel_size=4, nnodes=2, master_addr="10.0.0.1")


def test_cli_checks_its_arguments_before_loading_the_model(monkeypatch, capsys):
    from minipaged import __main__ as cli
    from minipaged.engine import llm as engine_module

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(engine_module.LLM, "__init__", no_model)
    assert cli.main(["generate", "hello", "--temperature", "nan"]) == 2
    assert "temperature must be a finite number" in capsys.readouterr().err
    for argv, match in (
        (["bench", "--num-prompts", "0"], "must be a positive integer, got 0"),
        (["generate", "x", "--max-tokens", "-3"], "must be a positive integer"),
    ):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2 and match in capsys.readouterr().err


# ---- one engine, several threads: their calls run as one batch, each gets its own outputs ------------------------
def test_eight_threads_share_one_small_engine(tiny_model, expected):
    import threading

    llm = small_engine(tiny_model, num_gpu_blocks_override=40)
    results: dict[int, object] = {}
    barrier = threading.Barrier(8)

    def caller(i: int) -> None:
        barrier.wait()  # all eight at once
        try:
            if i % 2:
                results[i] = token_ids(llm.generate(PREEMPTING_PROMPTS, GREEDY))
            else:  # a streaming caller beside them: its last snapshot of each request is the final one
                last = {}
                for out in llm.stream(PREEMPTING_PROMPTS, GREEDY):
                    last[out.request_id] = out
                results[i] = [last[k].outputs[0].token_ids for k in sorted(last, key=int)]
        except BaseException as e:
            results[i] = e

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread is stuck"
    assert all(results[i] == expected for i in range(8)), results
    assert_clean(llm)
    # They were served together: far fewer steps than eight engines one after another would take.
    alone = small_engine(tiny_model, num_gpu_blocks_override=40)
    alone.generate(PREEMPTING_PROMPTS, GREEDY)
    assert llm.num_steps < 8 * alone.num_steps


# ---- the command line -----------------------------------------------------------------------------------------
def test_cli_refuses_to_stream_several_answers_before_loading_the_model(monkeypatch, capsys):
    from minipaged import __main__ as cli
    from minipaged.engine import llm as engine_module

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(engine_module.LLM, "__init__", no_model)
    argv = ["generate", "Name a color.", "-n", "2", "--temperature", "0.8", "--seed", "1", "--stream"]
    assert cli.main(argv) == 2
    assert "--stream writes one answer" in capsys.readouterr().err
    assert cli.main(["generate", "one", "two", "--stream"]) == 2


def test_cli_prints_prompts_as_text_and_every_sample(capsys):
    from minipaged import __main__ as cli

    argv = ["generate", "Name a color.", "-n", "2", "--temperature", "0.8", "--seed", "1", "--max-tokens", "4"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "> Name a color."
    assert [ln.split(")")[0] for ln in out[1:3]] == ["(sample 0", "(sample 1"]
    assert "['" not in "\n".join(out)
