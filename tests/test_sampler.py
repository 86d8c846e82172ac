"""Sampling: greedy, temperature, top-k, top-p, seeds that do not depend on the batch."""

import pytest
import torch

from minipaged.sampling_params import SamplingParams
from minipaged.worker.sampler import Sampler, apply_top_k_top_p


def test_greedy_takes_the_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 4.9]])
    assert Sampler()(logits, ["a", "b"], [SamplingParams(temperature=0)] * 2) == [1, 0]


def test_top_k_and_top_p_masks():
    row = torch.tensor([4.0, 3.0, 2.0, 1.0])
    assert torch.isinf(apply_top_k_top_p(row, 2, 1.0)).tolist() == [False, False, True, True]
    probs = row.softmax(-1)  # ≈ [0.644, 0.237, 0.087, 0.032]
    assert torch.isinf(apply_top_k_top_p(row, -1, 0.5)).tolist() == [False, True, True, True]
    assert torch.isinf(apply_top_k_top_p(row, -1, float(probs[0] + 0.01))).tolist() == [False, False, True, True]
    assert not torch.isinf(apply_top_k_top_p(row, -1, 1.0)).any()


def test_sampling_only_draws_allowed_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]]).repeat(200, 1)
    params = [SamplingParams(temperature=1.0, top_k=2, seed=i) for i in range(200)]
    tokens = Sampler()(logits, [str(i) for i in range(200)], params)
    assert set(tokens) == {0, 1}


def test_seeded_request_is_independent_of_its_neighbours():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=0.8, seed=1234)
    alone = [Sampler()(logits[1:2], ["r"], [p])[0] for _ in range(1)]
    s = Sampler()
    in_batch = s(logits, ["x", "r", "y"], [SamplingParams(temperature=1.0), p, SamplingParams(temperature=0)])
    assert in_batch[1] == alone[0]
    # the generator advances: a second draw continues the same stream as a fresh sampler's second draw
    s2 = Sampler()
    s2(logits[1:2], ["r"], [p])
    assert s(logits[1:2], ["r"], [p]) == s2(logits[1:2], ["r"], [p])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-1), "temperature"),
        (dict(top_k=-5), "top_k"),
        (dict(top_p=0), "top_p"),
        (dict(n=0), "n must be"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
