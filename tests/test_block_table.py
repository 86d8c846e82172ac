"""BlockTable.resolve, slot = block * block_size + offset, batched slot mappings and block-table tensors."""

import pytest
import torch

from minipaged.worker.block_table import PAD_SLOT_ID, BlockTable, make_block_table_tensor, slot_mapping


def test_resolve_the_docstring_example():
    table = BlockTable(4, [19, 18, 5])
    assert table.resolve(0) == (19, 0)
    assert table.resolve(3) == (19, 3)
    assert table.resolve(4) == (18, 0)
    assert table.resolve(8) == (5, 0)
    assert table.resolve(10) == (5, 2)


def test_resolve_past_the_end_and_negative():
    table = BlockTable(4, [19, 18, 5])
    assert table.resolve(11) == (5, 3)  # the unfilled tail of the last block is addressable
    with pytest.raises(IndexError, match="past the end.*3 blocks x 4"):
        table.resolve(12)
    with pytest.raises(IndexError, match="non-negative"):
        table.resolve(-1)
    written = BlockTable(4, [19, 18, 5], num_tokens=11)
    with pytest.raises(IndexError, match="11 tokens"):
        written.resolve(11)


def test_slot_is_block_times_block_size_plus_offset():
    table = BlockTable(4, [19, 18, 5])
    for pos in range(12):
        block, offset = table.resolve(pos)
        assert table.slot(pos) == block * 4 + offset
    assert [table.slot(p) for p in (0, 3, 4, 10)] == [76, 79, 72, 22]


def test_fifty_tokens_with_block_16():
    """The 50-token request of "Inference at scale" (section 23.1): block_size 16 -> 4 blocks, the last holding tokens 48-49."""
    table = BlockTable(16, [42, 17, 88, 5], num_tokens=50)
    assert table.num_blocks == 4 and table.capacity == 64
    assert {table.resolve(p)[0] for p in range(48, 50)} == {5}
    assert table.resolve(49) == (5, 1)  # 2 of 16 slots used
    assert [table.resolve(p)[0] for p in (0, 15, 16, 31, 32, 47)] == [42, 42, 17, 17, 88, 88]
    with pytest.raises(ValueError, match="does not fit"):
        BlockTable(16, [42, 17, 88], num_tokens=50)


def test_append_grows_at_the_end():
    table = BlockTable(4)
    table.append(7)
    table.append([2, 9])
    assert table.block_ids == [7, 2, 9] and len(table) == 3
    assert table.resolve(5) == (2, 1)
    with pytest.raises(ValueError):
        table.append([-1])


@pytest.mark.parametrize("bad", [0, -4, 1.5, True, "16", None])
def test_block_size_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="block_size"):
        BlockTable(bad)
    with pytest.raises(ValueError, match="block_size"):
        slot_mapping([[1]], [[0]], bad)


def test_block_size_need_not_be_a_power_of_two():
    table = BlockTable(12, [3, 1])
    assert table.resolve(13) == (1, 1) and table.slot(13) == 13


def test_slot_mapping_for_a_batch_with_padding():
    tables = [BlockTable(4, [19, 18, 5]), [7]]
    slots = slot_mapping(tables, [[9, 10], [2]], 4, pad_to=4)
    assert slots.dtype == torch.int64
    assert slots.tolist() == [21, 22, 30, PAD_SLOT_ID]
    assert PAD_SLOT_ID == -1


def test_slot_mapping_prefill_and_decode_mix_matches_resolve():
    a = BlockTable(4, [3, 8, 1])
    b = BlockTable(4, [6, 2])
    pos_a, pos_b = list(range(0, 11)), [7]
    slots = slot_mapping([a, b], [pos_a, pos_b], 4).tolist()
    assert slots == [a.slot(p) for p in pos_a] + [b.slot(7)]
    assert len(set(slots)) == len(slots)  # no two tokens share a slot


def test_slot_mapping_errors():
    with pytest.raises(IndexError, match="request 1: position 4"):
        slot_mapping([[1, 2], [3]], [[0], [4]], 4)
    with pytest.raises(ValueError, match="2 block tables but 1"):
        slot_mapping([[1], [2]], [[0]], 4)
    with pytest.raises(ValueError, match="pad_to"):
        slot_mapping([[1]], [[0, 1]], 4, pad_to=1)
    assert slot_mapping([], [], 4).tolist() == []


def test_block_table_tensor_pads_with_the_null_block():
    t = make_block_table_tensor([BlockTable(4, [19, 18, 5]), [7]])
    assert t.tolist() == [[19, 18, 5], [7, 0, 0]]
    assert t.dtype == torch.int32
    wide = make_block_table_tensor([[1, 2]], max_num_blocks=4, dtype=torch.int64)
    assert wide.tolist() == [[1, 2, 0, 0]] and wide.dtype == torch.int64
    with pytest.raises(ValueError, match="max_num_blocks"):
        make_block_table_tensor([[1, 2, 3]], max_num_blocks=2)
    assert make_block_table_tensor([]).shape == (0, 0)
