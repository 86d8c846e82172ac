"""Chapter 05 pictures: the read plans agree with the kernel wrappers, and PagedReadView driven from Python."""

import pytest
import torch

import minipaged.kernels  # noqa: F401  (before triton: the interpreter on CPU)
from minipaged.classroom.viz import PagedReadView
from minipaged.classroom.viz import kernel_viz as KV
from minipaged.classroom.viz.block_viz import FREE_COLOR
from minipaged.classroom.viz.layout import check_layout, check_mpl_layout, text_px
from minipaged.kernels import paged_decode, paged_prefill
from minipaged.kv_math import PRESETS, KVSpec


class _Spy:
    """Stands in for a @triton.jit kernel: records the grid and the arguments of each launch, runs nothing."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, args, kwargs))

        return launch


def _decode_launch(monkeypatch, block_tables, seq_lens, num_splits, block_size=16, kv_heads=2, q_heads=4, d=16):
    spy, reduce_spy = _Spy(), _Spy()
    monkeypatch.setattr(paged_decode, "_paged_decode_kernel", spy)
    monkeypatch.setattr(paged_decode, "_reduce_segments_kernel", reduce_spy)
    num_blocks = int(block_tables.max()) + 1
    cache = torch.zeros(num_blocks, block_size, kv_heads, d)
    query = torch.zeros(len(seq_lens), q_heads, d)
    paged_decode.paged_decode_attention(query, cache, cache, block_tables, seq_lens, 0.25, num_splits=num_splits)
    ((grid, args, kwargs),) = spy.launches
    return grid, args[9], kwargs  # args[9] is segment_len


def test_picture_tiles_are_the_kernels():
    # decode reads 32 keys per tile whatever the block: two blocks of 16, eight of 4
    assert KV.decode_tile(16) == paged_decode.decode_config(torch.bfloat16, 64, 16).tile_n == 32
    assert KV.decode_tile(32) == 32 and KV.decode_tile(4) == 32 and KV.decode_tile(48) == 16
    assert KV.prefill_tiles(16, 70) == (64, 16) and KV.prefill_tiles(16, 20) == (32, 16)


@pytest.mark.parametrize("width,num_splits", [(13, 1), (13, 2), (13, 4), (13, 5), (3, 3), (64, 33), (8, 64)])
def test_split_kv_segments_is_what_the_wrapper_launches(monkeypatch, width, num_splits):
    tables = torch.arange(2 * width, dtype=torch.int32).reshape(2, width)
    lens = torch.tensor([width * 16, 5], dtype=torch.int32)
    grid, segment_len, kwargs = _decode_launch(monkeypatch, tables, lens, num_splits)
    assert (segment_len, grid[2]) == KV.split_kv_segments(width * 16, num_splits, kwargs["TILE_N"])
    assert grid[:2] == (2, 2) and kwargs["TILE_N"] == KV.decode_tile(16)


def test_split_kv_segments_examples_and_errors():
    assert KV.split_kv_segments(32768, 64, 32) == (512, 64)  # chapter 05's H100 question: 64 asked, 64 made
    assert KV.split_kv_segments(32768, 33, 16) == (1008, 33)
    assert KV.split_kv_segments(32768, 33, 64) == (1024, 32)  # with 64-token tiles only 32 would fit
    assert KV.split_kv_segments(208, 4, 16) == (64, 4)
    assert KV.split_kv_segments(208, 1, 16) == (208, 1)
    with pytest.raises(ValueError):
        KV.split_kv_segments(208, 0, 16)


def test_decode_plan_matches_the_kernel_docstring_picture():
    # paged_decode.py: block_size 4, segments of 8 tokens, 19 tokens through [7, 2, 5, 0, 3]
    plan = KV.decode_read_plan([[7, 2, 5, 0, 3]], [19], block_size=4, num_splits=3, tile=4)
    assert [(p.first, p.end) for p in plan] == [(0, 8), (8, 16), (16, 19)]
    assert [p.physical_blocks for p in plan] == [[7, 2], [5, 0], [3]]
    assert plan[2].reads == ((4, 3, 3),)  # logical 4, physical 3, a masked tail of 3 tokens
    assert "seq 0 · segment 1: tokens 8–15" in KV.format_read_plan(plan)


def test_decode_plan_covers_every_token_once_and_nothing_else():
    g = torch.Generator().manual_seed(0)
    lens = [1, 37, 150, 260]
    bs = 16
    perm = torch.randperm(40, generator=g).tolist()
    tables, used = [], 0
    for n in lens:
        tables.append(perm[used : used + -(-n // bs)] + [0] * (17 - -(-n // bs)))
        used += -(-n // bs)
    for splits in (1, 3, 5):
        plan = KV.decode_read_plan(tables, lens, bs, num_splits=splits)
        segment_len, num_segments = KV.split_kv_segments(17 * bs, splits, KV.decode_tile(bs))
        assert len(plan) == len(lens) * num_segments
        for seq, n in enumerate(lens):
            mine = [p for p in plan if p.seq == seq]
            covered = {}
            for p in mine:
                assert p.num_tokens <= segment_len and p.tiles == -(-p.num_tokens // KV.decode_tile(bs))
                for logical, phys, count in p.reads:
                    assert tables[seq][logical] == phys
                    covered[logical] = covered.get(logical, 0) + count
            want = {lg: min(bs, n - lg * bs) for lg in range(-(-n // bs))}
            assert covered == want
            assert sum(p.num_tokens for p in mine) == n


def test_prefill_plan_is_what_the_wrapper_launches(monkeypatch):
    spy = _Spy()
    monkeypatch.setattr(paged_prefill, "_paged_prefill_kernel", spy)
    seq_lens, q_lens = [70, 64, 51], [70, 24, 1]
    tables = torch.arange(15, dtype=torch.int32).reshape(3, 5)
    cu = torch.tensor([0, 70, 94, 95], dtype=torch.int32)
    cache = torch.zeros(15, 16, 1, 16, dtype=torch.float16)  # the pictures show half-precision tiles
    paged_prefill.paged_prefill_attention(
        torch.zeros(95, 2, 16, dtype=torch.float16),
        cache,
        cache,
        tables,
        cu,
        torch.tensor(seq_lens, dtype=torch.int32),
        0.25,
    )
    ((grid, _, kwargs),) = spy.launches
    plan = KV.prefill_read_plan(tables, cu, seq_lens, 16)
    assert len(plan) == grid[0] * grid[2] and grid[2] == 2
    block_m = kwargs["BLOCK_M"]
    assert block_m == 64
    for p in plan:
        ctx = seq_lens[p.seq] - q_lens[p.seq]
        if p.part * block_m >= q_lens[p.seq]:
            assert p.reads == () and "returns at once" in p.describe()
        else:
            assert (p.first, p.end) == (0, min(seq_lens[p.seq], ctx + (p.part + 1) * block_m))
    # the fresh 70-token prompt: its first query tile stops at key 63 (causality), its second reads all 70
    assert [(p.end, p.tiles) for p in plan if p.seq == 0] == [(64, 4), (70, 5)]  # 16-key tiles


def test_gqa_query_tile():
    assert KV.gqa_query_tile(9, 3, 1) == [3, 4, 5] + [None] * 13  # SmolLM2
    assert KV.gqa_query_tile(128, 8, 7) == list(range(112, 128))  # G = 16: no padding
    assert len(KV.gqa_query_tile(64, 2, 0)) == 32  # G = 32: next power of two
    assert KV.gqa_query_tile(8, 8, 2) == [2] + [None] * 15  # MHA: 15 of 16 rows padding
    with pytest.raises(ValueError):
        KV.gqa_query_tile(9, 2, 0)
    with pytest.raises(ValueError):
        KV.gqa_query_tile(9, 3, 3)


def test_traffic_counts():
    llama = KVSpec.from_preset("llama-3-8b")
    t = KV.decode_traffic(32, 8, 128, 2, batch=32, context=4096, num_layers=32)
    assert t["kv_bytes"] == llama.bytes_for_tokens(32 * 4096)
    assert t["intensity"] == pytest.approx(2 * 4 / 2)  # 2·G / bytes
    for spec in PRESETS.values():
        g = spec.num_attention_heads // spec.num_kv_heads
        assert KV.decode_traffic(spec.num_attention_heads, spec.num_kv_heads, 64, 2, 1, 7)["intensity"] == g
    # prefill: count visible (query, key) pairs by brute force
    q_len, ctx = 5, 6
    pairs = sum(1 for j in range(q_len) for p in range(ctx + q_len) if p <= ctx + j)
    p = KV.prefill_traffic(2, 1, 4, 2, q_len, ctx)
    assert p["flops"] == 4 * pairs * 2 * 4
    assert p["bytes"] == 2 * 11 * 1 * 4 * 2 + 2 * 5 * 2 * 4 * 2
    assert KV.prefill_traffic(32, 8, 128, 2, 2048)["intensity"] > KV.prefill_traffic(32, 8, 128, 2, 128)["intensity"]


def test_roofline_figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = KV.roofline_figure(989.4, 3350.0, [("decode", 4.0), ("prefill", 820.0)], title="t")
    ax = fig.axes[0]
    assert len(ax.lines) == 1 + 1 + 2  # roof, ridge, two points
    assert check_mpl_layout(fig) == []
    plt.close(fig)
    # chapter 05's figure: five long labels, each inside the axes, off the roof and the ridge, apart
    points = [
        ("decode Llama-2-7B (G=1)", 1.0),
        ("decode SmolLM2-135M (G=3)", 3.0),
        ("decode Llama-3-70B (G=8)", 8.0),
        ("prefill 128 tokens (Llama-3-8B)", 51.6),
        ("prefill 2048 tokens (Llama-3-8B)", 819.6),
    ]
    fig = KV.roofline_figure(989.4, 3352.0, points, title="H100 SXM roofline, fp16 attention")
    assert check_mpl_layout(fig) == [] and len(fig.axes[0].texts) == 6
    plt.close(fig)
    # the check would have caught the old placement: a label right of the last point runs past the axes
    fig = KV.roofline_figure(989.4, 3352.0, points)
    fig.axes[0].annotate(points[-1][0], (819.6, 989.4), textcoords="offset points", xytext=(6, -4), fontsize=8)
    assert any("runs past the axes" in p for p in check_mpl_layout(fig))
    plt.close(fig)


TABLES = [[9, 25, 5, 0, 0, 0, 0], [4, 8, 21, 3, 26, 16, 6], [20, 14, 11, 10, 24, 7, 1]]
LENS = [37, 100, 110]


def test_read_view_driven_from_python():
    tables = torch.tensor(TABLES, dtype=torch.int32)
    own = PagedReadView(tables, torch.tensor(LENS), 16, num_blocks=28)  # the kernel's tile: 32 keys, two blocks
    assert own.tile == 32 and own.splits.max == 4 and own.segment_len == 128  # 112 tokens: 4 tiles of 32
    view = PagedReadView(tables, torch.tensor(LENS), 16, num_blocks=28, num_splits=1, tile=16)
    assert view.splits.max == 7 and view.segment_len == 112  # 7 blocks x 16 = 112 tokens: 7 tiles of 16
    assert [p.label for p in view.programs] == ["seq 0 · segment 0", "seq 1 · segment 0", "seq 2 · segment 0"]
    assert view.selected is view.programs[0]
    read = [c["block"] for c in view.cells if c["read"]]
    assert read == sorted([9, 25, 5])
    assert {c["block"]: c["tokens_read"] for c in view.cells if c["read"]} == {9: 16, 25: 16, 5: 5}
    assert view.cells[5]["seq"] == 0 and view.cells[5]["tokens_held"] == 5 and view.cells[2]["seq"] is None
    assert "num_splits 1" in view.caption.value and "physical [9, 25, 5]" in view.caption.value
    # the figure: the pool row plus one marker per (program, block) read; one highlight per block read + the row
    pool, reads = view.figure.data
    assert list(pool.x) == list(range(28)) and pool.marker.color[2] == FREE_COLOR
    assert len(reads.x) == sum(len(p.reads) for p in view.programs) == 3 + 7 + 7
    assert len(view.figure.layout.shapes) == 1 + 3

    view.program.value = 2  # pick seq 2
    assert view.selected.seq == 2 and [c["block"] for c in view.cells if c["read"]] == sorted(TABLES[2])

    view.splits.value = 2  # segments of 64 tokens
    assert view.segment_len == 64 and len(view.programs) == 6
    assert view.program.value == 2 and view.selected.label == "seq 1 · segment 0"  # the index is kept
    labels = [label for label, _ in view.program.options]
    assert "seq 0 · segment 1 (returns at once)" in labels
    view.program.value = labels.index("seq 0 · segment 1 (returns at once)")
    assert view.selected.reads == () and not any(c["read"] for c in view.cells)
    assert len(view.figure.layout.shapes) == 0 and "returns at once" in view.caption.value
    view.program.value = 5  # seq 2, segment 1: tokens 64–109
    assert view.selected.physical_blocks == [24, 7, 1] and view.selected.reads[-1] == (6, 1, 14)
    assert view.widget.children[1] is view.caption
    assert check_layout(view.figure) == []
    # the dropdown is wide enough for its longest option, its label wide enough for "num_splits"
    width = int(view.program.layout.width.removesuffix("px"))
    label = int(view.program.style.description_width.removesuffix("px"))
    assert width - label >= max(text_px(o) for o, _ in view.program.options) + 20
    assert label >= text_px("num_splits")
    assert view.splits.style.description_width == view.program.style.description_width


def test_read_view_rejects_a_block_outside_the_pool():
    with pytest.raises(ValueError, match="outside a pool"):
        PagedReadView([[3, 40]], [20], 16, num_blocks=10)


def test_default_split_fills_every_sm_with_four_programs(monkeypatch):
    """chapter 05's question: one 32k context, 8 KV heads, 132 SMs -> 66 splits wanted, 64 allowed."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    cuda = torch.device("cuda")
    assert paged_decode.PROGRAMS_PER_SM == 4
    assert paged_decode.default_num_splits(1, 8, 32768, cuda) == 64  # ceil(528 / 8) = 66, capped at 64
    assert paged_decode.default_num_splits(32, 8, 4096, cuda) == 3  # ceil(528 / 256)
    assert paged_decode.default_num_splits(8, 8, 2048, cuda) == 8  # ceil(528 / 64) = 9, one per 256 tokens: 8
    assert paged_decode.default_num_splits(128, 8, 8192, cuda) == 1  # 1024 programs already
    assert paged_decode.default_num_splits(1, 8, 32768, torch.device("cpu")) == 1  # the interpreter: one segment
