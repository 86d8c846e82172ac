"""The cache engine moves real K/V blocks: swap out, swap in, copy-on-write."""

import pytest
import torch

from minipaged.worker.cache_engine import CacheEngine


def _fill(engine: CacheEngine) -> None:
    torch.manual_seed(0)
    for k, v in engine.gpu_cache:
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))


def test_swap_out_and_back_in_restores_the_blocks():
    e = CacheEngine(num_layers=3, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8, num_cpu_blocks=5)
    _fill(e)
    before = [(k.clone(), v.clone()) for k, v in e.gpu_cache]
    e.swap_out([(6, 0), (2, 3)])
    for layer, (k, v) in enumerate(e.cpu_cache):
        assert torch.equal(k[0], before[layer][0][6]) and torch.equal(v[3], before[layer][1][2])
    for k, v in e.gpu_cache:  # the device blocks are reused by someone else meanwhile
        k[[6, 2]] = 0
        v[[6, 2]] = 0
    e.swap_in([(0, 1), (3, 7)])  # back into other device blocks
    for layer, (k, v) in enumerate(e.gpu_cache):
        assert torch.equal(k[1], before[layer][0][6]) and torch.equal(v[7], before[layer][1][2])
        assert torch.equal(k[4], before[layer][0][4])  # untouched blocks stay as they were


def test_copy_on_write_duplicates_a_block_on_device():
    e = CacheEngine(num_layers=2, num_blocks=4, block_size=4, num_kv_heads=1, head_dim=4)
    _fill(e)
    e.copy([(1, 3)])
    for k, v in e.gpu_cache:
        assert torch.equal(k[3], k[1]) and torch.equal(v[3], v[1])


def test_bytes_per_block_is_what_a_swap_moves():
    e = CacheEngine(num_layers=30, num_blocks=2, block_size=16, num_kv_heads=3, head_dim=64)
    assert e.bytes_per_block == 16 * 46_080
    assert e.gpu_cache[0][0].shape == (2, 16, 3, 64)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda e: e.swap_out([(0, 9)]), "out of range"),
        (lambda e: e.copy([(0, 2), (1, 2)]), "same destination"),
        (lambda e: CacheEngine(1, 2, 4, 1, 4).swap_out([(0, 0)]), "needs swap space"),
        (lambda e: CacheEngine(1, 0, 4, 1, 4), "num_blocks"),
        (lambda e: CacheEngine(1, 2, 4, 1, 4, dtype=torch.int8), "dtype"),
    ],
)
def test_bad_copies_are_refused(call, message):
    e = CacheEngine(num_layers=1, num_blocks=4, block_size=4, num_kv_heads=1, head_dim=4, num_cpu_blocks=2)
    with pytest.raises(ValueError, match=message):
        call(e)
