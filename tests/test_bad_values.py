"""Issue 42's bad values and the hang they caused, refused at the call by name (each test failed before its fix):
a learner's prefix lookup that gives every token of a prompt back as cached, a ``top_p`` that float32 rounds to 0,
a seed torch cannot take, a memory size under one byte, a sliding window of 0 positions. And issue 55's: a prompt
lookup length named as given, a KV offloading store larger than the machine's RAM, a server's slow-client
deadline that is not a positive number of seconds."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import small_engine

from minipaged import LLM, SamplingParams
from minipaged import config as config_module
from minipaged.classroom import parts
from minipaged.config import Config, SpeculativeConfig, parse_memory
from minipaged.core.kv_cache_manager import find_prefix_hits
from minipaged.kv_math import GiB
from minipaged.model.llama import sliding_windows
from minipaged.serving import build_app, start_server
from minipaged.worker.sampler import apply_top_k_top_p

GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


def off_by_one(pool: Any, block_hashes: Any, num_tokens: int, block_size: int) -> list[int]:
    """A plausible learner's lookup: hits capped at num_tokens // block_size, not (num_tokens - 1) // block_size."""
    hits = []
    for h in block_hashes[: num_tokens // block_size]:
        block = pool.get_cached_block(h)
        if block is None:
            break
        hits.append(block.block_id)
    return hits


@pytest.mark.parametrize("check", [False, True], ids=["unchecked", "checked"])
def test_a_lookup_that_leaves_nothing_to_compute_is_named_and_the_engine_is_as_before(tiny_model, check):
    """Unchecked, the engine itself refuses the answer (it looped for good before); checked, the part's probes
    catch it first. Either way the error names the part, and the pool and the queues are as they were."""
    llm = small_engine(tiny_model)
    prompt = [5, 17, 3, 9, 40, 2, 8, 61]  # two full blocks of 4: both cached after the first run
    llm.generate([prompt], GREEDY)
    free = llm.kv_cache_manager.block_pool.get_num_free_blocks()
    outcome: list[BaseException | None] = []

    def serve() -> None:
        try:
            with parts.use(find_prefix_hits=off_by_one, check=check):
                llm.generate([prompt], GREEDY)
            outcome.append(None)
        except BaseException as e:  # the error is the outcome
            outcome.append(e)

    worker = threading.Thread(target=serve, daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "the engine hung on a lookup that returned every block of the prompt"
    (error,) = outcome
    assert error is not None and "find_prefix_hits" in str(error), error
    assert check or "at most (num_tokens - 1) // block_size = 1" in str(error), error
    assert not llm.scheduler.has_unfinished() and llm.kv_cache_manager.block_pool.get_num_free_blocks() == free
    assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids  # and it serves on, with the package's lookup
    assert find_prefix_hits is not off_by_one


def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.5])
    for top_p in (1e-46, 1e-45, 1e-30):
        kept = apply_top_k_top_p(logits, -1, top_p).isfinite()
        assert kept.tolist() == [False, True, False, False], top_p


def test_a_seed_torch_cannot_take_is_refused_at_the_call():
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=-(2**63) - 1)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64 - 1, n=2)  # sample 1 would draw from 2**64
    SamplingParams(seed=2**64 - 2, n=2)
    SamplingParams(seed=-(2**63))


def test_a_memory_size_under_one_byte_is_refused_not_read_as_off():
    assert parse_memory(0, "kv_offloading_size") == 0 and parse_memory("1.5KiB") == 1536
    with pytest.raises(ValueError, match=r"kv_offloading_size=0.5 is less than one byte: give 0 to turn it off"):
        Config(kv_offloading_size=0.5, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        Config(kv_cache_memory="0.2")


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ({"prompt_lookup_max": 0}, "prompt_lookup_max"),  # alone: was named prompt_lookup_min, never given
        ({"prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"prompt_lookup_min": 2, "prompt_lookup_max": -1}, "prompt_lookup_max"),
    ],
)
def test_a_bad_prompt_lookup_length_is_named_as_given(given, named):
    with pytest.raises(ValueError, match=rf"^speculative_config {named} must be a positive integer"):
        Config(speculative_config={"method": "ngram", "num_speculative_tokens": 4, **given})
    alone = {k: 3 for k in given}  # one given alone is also the other (vLLM's rule), as before
    spec = SpeculativeConfig(num_speculative_tokens=4, **alone)
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (3, 3)


def test_a_kv_offloading_store_larger_than_the_ram_is_refused_before_anything_is_allocated(monkeypatch):
    """It named neither the knob nor the machine: the allocator's own error, after the model had loaded."""
    with pytest.raises(ValueError, match=r"^kv_offloading_size='100TiB' asks for 102400\.00 GiB .* this machine has"):
        LLM(kv_offloading_size="100TiB")  # refused by its Config, before the model is read
    monkeypatch.setattr(config_module, "host_memory_bytes", lambda: 2 * GiB)
    with pytest.raises(ValueError, match=r"'3GiB' asks for 3\.00 GiB .* this machine has 2\.00 GiB .* of RAM"):
        Config(kv_offloading_size="3GiB")
    with pytest.raises(ValueError, match=r"2 ranks on this machine, each keeping a store of 1\.50 GiB, ask for 3\.00"):
        Config(kv_offloading_size="1.5GiB", tensor_parallel_size=2, device="cpu")
    assert Config(kv_offloading_size="1.5GiB").kv_offloading_bytes == 3 * GiB // 2
    monkeypatch.setattr(config_module, "host_memory_bytes", lambda: None)  # an OS that does not say: not refused
    assert Config(kv_offloading_size="3GiB").kv_offloading_bytes == 3 * GiB


@pytest.mark.parametrize("name", ["header_deadline_s", "body_deadline_s", "body_timeout_s"])
@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), True, "10", None])
def test_a_bad_slow_client_deadline_is_refused_at_start_naming_it(name, value):
    """Checked before the engine is looked at (``None`` stands for it) or the app is built."""
    with pytest.raises(ValueError, match=rf"^{name} must be a positive number of seconds"):
        start_server(None, **{name: value})  # type: ignore[arg-type]
    if name != "header_deadline_s":  # the header block's deadline is the server's, not the app's
        with pytest.raises(ValueError, match=rf"^{name} must be a positive number of seconds"):
            build_app(None, "m", **{name: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("window", [0, -4, 2.5, True])
def test_a_sliding_window_that_is_not_a_positive_count_is_refused_at_load(window):
    for config in (
        SimpleNamespace(num_hidden_layers=2, sliding_window=window, model_type="mistral"),
        SimpleNamespace(num_hidden_layers=2, sliding_window=window, layer_types=["full_attention"] * 2),
    ):
        with pytest.raises(ValueError, match=r"sliding_window must be a positive number of positions"):
            sliding_windows(config)
    assert sliding_windows(SimpleNamespace(num_hidden_layers=2, sliding_window=8, model_type="mistral")) == [8, 8]
