"""Self-checks: three questions at the end of every chapter, their answers computed by the package.

Each question is a function of a random generator: it draws its own numbers (a model, a pool, a batch),
asks, and computes the answer with the package's own code (``kv_math``, ``BlockPool``, the real
``Scheduler`` through ``lab.checking_driver.Driver``, ``RequestMetrics``, ...) at the moment it is asked. Nothing is
written down: the notebook holds only ``selfcheck.quiz("03")``, and the answer exists in the kernel's memory
until the learner asks to see it. A new seed draws new numbers, for another try::

    q = selfcheck.questions("01", seed=0)[0]
    print(q.prompt)                       # How many bytes of KV cache does one token cost in ...
    selfcheck.check(q, "61440").right     # what the widget's Check button calls

Some wrong answers are the mistakes a learner makes (K counted but not V, the null block forgotten, hashes taken as
independent): those get their own explanation instead of a bare "not yet". ``minipaged.classroom.viz.quiz.Quiz`` is
the widget; ``tests/test_selfcheck.py`` checks every question on many random draws: the right answer passes, written
several ways, and every listed mistake fails.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ..core.request import RequestMetrics
from ..kv_math import KVSpec

CHAPTERS = ("01", "02", "03", "04", "05", "06", "07", "08", "09", "09b", "10", "11", "12", "13")
GiB, MiB = 2**30, 2**20


@dataclass(frozen=True)
class Asked:
    """One question as drawn: what the learner reads, and (in memory only) its answer."""

    prompt: str
    answer: float | str  # a number, or one of ``choices``
    explain: str  # why, shown once the answer is right or asked for
    hint: str  # where to look, shown on a wrong answer: never the answer
    choices: tuple[str, ...] = ()  # a choice question when not empty
    unit: str = ""
    rel_tol: float = 0.0  # 0: the exact number (integers); else a relative tolerance
    mistakes: dict[float | str, str] = field(default_factory=dict)  # a known wrong answer -> why it is wrong

    @property
    def is_choice(self) -> bool:
        return bool(self.choices)

    def shown(self) -> str:
        """The answer as the widget prints it when asked."""
        if isinstance(self.answer, str):
            return self.answer
        text = f"{self.answer:,}" if float(self.answer).is_integer() else f"{self.answer:,.4g}"
        return f"{text} {self.unit}".strip()


@dataclass(frozen=True)
class Verdict:
    right: bool
    message: str


def parse_number(text: str) -> float | None:
    """A number as a learner types it: ``61440``, ``61,440``, ``6.1e4``, ``12.5 %``, ``1 234``; None if none."""
    cleaned = re.sub(r"(?<=\d)[,_\s](?=\d{3}(?!\d))", "", text.strip())  # thousands separators only
    m = re.fullmatch(r"\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)(?![.\d])\s*([^\d]*)", cleaned)
    return float(m.group(1)) if m else None


def _same(value: float, target: float, rel_tol: float) -> bool:
    if rel_tol == 0:
        return value == target
    return math.isclose(value, target, rel_tol=rel_tol, abs_tol=1e-12)


def check(asked: Asked, response: str) -> Verdict:
    """Is ``response`` (what the learner typed or picked) the answer? The message says why, or where to look."""
    if asked.is_choice:
        if response not in asked.choices:
            return Verdict(False, "Pick one of the choices.")
        if response == asked.answer:
            return Verdict(True, f"Right. {asked.explain}")
        return Verdict(False, asked.mistakes.get(response, f"Not this one. {asked.hint}"))
    value = parse_number(response)
    if value is None:
        return Verdict(False, f"Type a number{' in ' + asked.unit if asked.unit else ''} (e.g. 1234 or 1.5e3).")
    assert not isinstance(asked.answer, str)
    if _same(value, float(asked.answer), asked.rel_tol):
        return Verdict(True, f"Right. {asked.explain}")
    for wrong, why in asked.mistakes.items():
        if not isinstance(wrong, str) and _same(value, float(wrong), asked.rel_tol):
            return Verdict(False, why)
    return Verdict(False, f"Not yet. {asked.hint}")


def _mistakes(answer: float, pairs: list[tuple[float, str]]) -> dict[float | str, str]:
    """Known wrong answers, leaving out any that happen to equal the right one for these numbers."""
    return {w: why for w, why in pairs if not math.isclose(w, answer, rel_tol=1e-9, abs_tol=1e-12)}


def _spec(rng: random.Random, names: tuple[str, ...] = ("llama-3-8b", "mistral-7b", "llama-2-7b")) -> KVSpec:
    return KVSpec.from_preset(rng.choice(names), dtype=rng.choice(["bf16", "fp32"]))


def _heads(s: KVSpec) -> str:
    dtype = {2: "bf16", 4: "fp32", 1: "fp8"}[s.dtype_bytes]
    return f"{s.name} in {dtype} ({s.num_layers} layers, {s.num_kv_heads} KV heads of {s.head_dim})"


# ---- chapter 01: KV bytes -------------------------------------------------------------------------
def _bytes_per_token(rng: random.Random) -> Asked:
    s = _spec(rng)
    b = s.bytes_per_token
    pairs = [
        (b / 2, "That is K alone: every layer caches V too, the same size."),
        (b / s.num_layers, "That is one layer: each of them keeps its own K and V."),
    ]
    if s.num_attention_heads and s.num_attention_heads != s.num_kv_heads:
        pairs.append((b // s.num_kv_heads * s.num_attention_heads, "The cache holds KV heads, not query heads."))
    return Asked(
        f"How many bytes of KV cache does one token cost in {_heads(s)}?",
        b,
        f"2 (K and V) · {s.num_layers} layers · {s.num_kv_heads} heads · {s.head_dim} · {s.dtype_bytes} bytes.",
        "Section 2: bytes per token.",
        unit="bytes",
        mistakes=_mistakes(b, pairs),
    )


def _tokens_in_budget(rng: random.Random) -> Asked:
    s, gib = _spec(rng), rng.choice([8, 16, 24, 40])
    n = gib * GiB // s.bytes_per_token
    return Asked(
        f"{gib} GiB is left for the KV cache of {_heads(s)}. How many tokens fit, at most?",
        n,
        f"{gib} · 2^30 bytes ÷ {s.bytes_per_token:,} bytes per token, rounded down.",
        "Section 6: divide the budget by the bytes of one token (a GiB is 2^30 bytes).",
        unit="tokens",
        mistakes=_mistakes(n, [(gib * 10**9 // s.bytes_per_token, "A GiB is 2^30 bytes, not 10^9.")]),
    )


def _gqa_saving(rng: random.Random) -> Asked:
    s = _spec(rng, ("llama-3-8b", "mistral-7b", "llama-3-70b", "smollm2-135m"))
    assert s.num_attention_heads is not None
    mha = s.with_kv_heads(s.num_attention_heads)
    factor = mha.bytes_per_token / s.bytes_per_token
    return Asked(
        f"{s.name} has {s.num_attention_heads} query heads sharing {s.num_kv_heads} KV heads (GQA). How many times "
        "larger would its KV cache be with one KV head per query head (MHA)?",
        factor,
        f"{mha.bytes_per_token:,} ÷ {s.bytes_per_token:,} bytes per token: the group size, query heads ÷ KV heads.",
        "Section 4: compare the bytes per token of the two head counts.",
        unit="×",
        rel_tol=1e-3,
        mistakes=_mistakes(factor, [(1 / factor, "That is how much smaller MHA would be: it is larger.")]),
    )


# ---- chapter 02: fragmentation ----------------------------------------------------------------------
def _trace_request(rng: random.Random) -> tuple[int, int, int]:
    max_len = rng.choice([1024, 2048, 4096])
    prompt = rng.randrange(40, 400)
    output = rng.randrange(20, 300)
    return max_len, prompt, output


def _max_waste(rng: random.Random) -> Asked:
    from ..lab.contiguous import reservation_size
    from ..lab.workloads import TraceRequest

    max_len, prompt, output = _trace_request(rng)
    r = TraceRequest("r", 0, prompt, output)
    reserved = reservation_size(r, "max", max_len)
    pct = 100 * (reserved - r.total_len) / reserved
    return Asked(
        f"A contiguous allocator reserves max_model_len = {max_len} slots for every request. A request finishes "
        f"with {prompt} prompt and {output} output tokens. What percentage of its reservation never held a token?",
        pct,
        f"({reserved} − {r.total_len}) ÷ {reserved}: the reservation is sized for the longest request possible.",
        "Section 1: compare the slots reserved with the tokens the request ended with.",
        unit="%",
        rel_tol=5e-3,
        mistakes=_mistakes(
            pct, [(100 * output / reserved, "The prompt's slots hold tokens too: only the unused tail is waste.")]
        ),
    )


def _pow2_reservation(rng: random.Random) -> Asked:
    from ..lab.contiguous import reservation_size
    from ..lab.workloads import TraceRequest

    max_len, prompt, output = _trace_request(rng)
    r = TraceRequest("r", 0, prompt, output)
    reserved = reservation_size(r, "pow2", max_len)
    return Asked(
        f"The pow2 policy (Orca (Pow2) in the PagedAttention paper) knows each output length to within 2×. How "
        f"many slots does it reserve for a request of {prompt} prompt and {output} output tokens "
        f"(max_model_len {max_len})?",
        reserved,
        f"The prompt plus the output rounded up to a power of two: {prompt} + {reserved - prompt}.",
        "Section 4: the three reservation rules; the prompt is not rounded.",
        unit="slots",
        mistakes=_mistakes(
            reserved, [(1 << (r.total_len - 1).bit_length(), "Only the output is rounded up, not the prompt.")]
        ),
    )


def _paged_waste(rng: random.Random) -> Asked:
    bs = rng.choice([8, 16, 32])
    n = rng.randrange(50, 900)
    if n % bs == 0:
        n += 1
    spec = KVSpec(1, 1, 1)
    empty = spec.blocks_for_tokens(n, bs) * bs - n
    return Asked(
        f"Paged with blocks of {bs} tokens, a request holds {n} tokens. How many of its slots are empty?",
        empty,
        f"{spec.blocks_for_tokens(n, bs)} blocks · {bs} − {n}: only the last block is partly empty, under {bs} slots.",
        "Count the whole blocks it needs, then the slots they hold.",
        unit="slots",
        mistakes=_mistakes(empty, [(n % bs, "That is how full the last block is, not how empty.")]),
    )


# ---- chapter 03: the block pool ---------------------------------------------------------------------
def _free_after(rng: random.Random) -> Asked:
    from ..core.block_pool import BlockPool

    n, a, b = rng.randrange(16, 65), rng.randrange(2, 7), rng.randrange(2, 7)
    pool = BlockPool(n)
    pool.get_new_blocks(a)
    pool.get_new_blocks(b)
    free = pool.get_num_free_blocks()
    return Asked(
        f"A BlockPool of {n} blocks hands {a} blocks to one request and {b} to another. How many are free now?",
        free,
        f"{n} − 1 (block 0, the null block, is never handed out) − {a} − {b}.",
        "Section 5: one block of the pool is not for requests.",
        unit="blocks",
        mistakes=_mistakes(free, [(n - a - b, "Block 0 is the null block: it is never free to hand out.")]),
    )


def _reuse_order(rng: random.Random) -> Asked:
    from ..core.block_pool import BlockPool

    a, b = rng.randrange(3, 6), rng.randrange(2, 5)
    pool = BlockPool(1 + a + b)  # exactly full once both hold their blocks
    first = pool.get_new_blocks(a)
    pool.get_new_blocks(b)
    ids = [blk.block_id for blk in first]
    pool.free_blocks(reversed(first))  # as KVCacheManager.free does: last block first
    got = pool.get_new_blocks(1)[0].block_id
    return Asked(
        f"A full pool: request A holds blocks {ids} (in order), request B the rest. A finishes and its blocks are "
        "freed the way KVCacheManager.free does it. B then needs one more block. Which block id does it get?",
        got,
        "A's blocks join the free queue's tail last block first, and the pool pops from the head: the last block "
        "comes back first, the first blocks (a shared prefix, most often) stay cached longest.",
        "Section 2: the order blocks go back to the free queue, and the end get_new_blocks takes from.",
        unit="",
        mistakes=_mistakes(got, [(ids[0], "That is A's first block: the free order is last block first.")]),
    )


def _ref_count(rng: random.Random) -> Asked:
    from ..core.block_pool import BlockPool

    users = rng.randrange(3, 6)
    done = rng.randrange(1, users)
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(2)  # the first user
    for _ in range(users - 1):
        pool.touch(blocks)  # each later user of the same cached prefix
    for _ in range(done):
        pool.free_blocks(reversed(blocks))
    count = blocks[0].ref_cnt
    return Asked(
        f"{users} running requests share the same two cached prompt blocks. {done} of them finish. What is the ref "
        "count of the first shared block now?",
        count,
        f"Each user adds one (get_new_blocks for the first, touch for the others); each finish takes one away: "
        f"{users} − {done}.",
        "Section 4: what a ref count counts.",
        mistakes=_mistakes(
            count, [(users, "Finishing gives a reference back."), (0, "The block is still used by the others.")]
        ),
    )


# ---- chapter 04: block tables and slots -------------------------------------------------------------
def _table(rng: random.Random, blocks: int) -> list[int]:
    return rng.sample(range(1, 60), blocks)


def _slot_of(rng: random.Random) -> Asked:
    from ..worker.block_table import slot_mapping

    bs = rng.choice([4, 8, 16])
    table = _table(rng, 4)
    p = rng.randrange(bs, 4 * bs)
    slot = int(slot_mapping([table], [[p]], bs)[0])
    return Asked(
        f"Block size {bs}; a request's block table is {table}. Which pool slot does the token at position {p} write?",
        slot,
        f"table[{p} // {bs}] · {bs} + {p} % {bs} = {table[p // bs]} · {bs} + {p % bs}.",
        "Section 3: a slot is a block id times the block size, plus the offset in the block.",
        mistakes=_mistakes(
            slot,
            [
                (table[p // bs] + p % bs, "Multiply the block id by the block size first."),
                (p, "That is the logical position; the table maps it to a physical slot."),
            ],
        ),
    )


def _position_of(rng: random.Random) -> Asked:
    from ..worker.block_table import slot_mapping

    bs = rng.choice([4, 8, 16])
    table = _table(rng, 3)
    positions = list(range(3 * bs))
    slots = slot_mapping([table], [positions], bs).tolist()
    p = rng.randrange(len(positions))
    return Asked(
        f"Block size {bs}; a request's block table is {table}. Which position of the request lives in slot {slots[p]}?",
        p,
        f"slot {slots[p]} is block {slots[p] // bs}, offset {slots[p] % bs}; block {slots[p] // bs} is entry "
        f"{table.index(slots[p] // bs)} of the table: position {table.index(slots[p] // bs)} · {bs} + {slots[p] % bs}.",
        "Work backwards: which block is the slot in, and where is that block in the table?",
        mistakes=_mistakes(
            p, [(slots[p] % bs, "That is the offset inside the block; add where the block sits in the table.")]
        ),
    )


def _new_blocks(rng: random.Random) -> Asked:
    bs = rng.choice([4, 8, 16])
    computed = rng.randrange(1, 6 * bs)
    new = rng.randrange(1, 3 * bs)
    spec = KVSpec(1, 1, 1)
    need = spec.blocks_for_tokens(computed + new, bs) - spec.blocks_for_tokens(computed, bs)
    return Asked(
        f"Block size {bs}. A request has {computed} tokens in its cache and is scheduled {new} new ones. How many "
        "new blocks must allocate_slots give it?",
        need,
        f"ceil({computed + new} / {bs}) − ceil({computed} / {bs}): the room left in its last block is used first.",
        "Section 5: blocks for all its tokens, minus the blocks it holds.",
        unit="blocks",
        mistakes=_mistakes(
            need,
            [(spec.blocks_for_tokens(new, bs), "Its last block may still have room: count blocks for all tokens.")],
        ),
    )


# ---- chapter 05: the kernels ------------------------------------------------------------------------
def _decode_read(rng: random.Random) -> Asked:
    s = _spec(rng)
    batch, ctx = rng.choice([8, 16, 32, 64]), rng.choice([1024, 2048, 4096])
    gib = s.bytes_for_tokens(batch * ctx) / GiB
    return Asked(
        f"One decode step of {batch} sequences of {ctx} tokens on {_heads(s)}: how many GiB of KV does attention "
        "read, over all layers?",
        gib,
        f"{batch} · {ctx} tokens · {s.bytes_per_token:,} bytes each, every one read once.",
        "Section 1: decode reads every cached token of every sequence.",
        unit="GiB",
        rel_tol=1e-3,
        mistakes=_mistakes(
            gib,
            [
                (gib / 2, "K alone: decode reads V too."),
                (gib / s.num_layers, "One layer: every layer reads its own cache."),
            ],
        ),
    )


def _segments(rng: random.Random) -> Asked:
    seg = rng.choice([64, 128, 256, 512])
    n = rng.randrange(seg + 1, 12 * seg)
    parts = KVSpec(1, 1, 1).blocks_for_tokens(n, seg)
    return Asked(
        f"Split-KV decode cuts each sequence's keys into segments of {seg} tokens, one program each. How many "
        f"partial results must the merge combine for a sequence of {n} tokens?",
        parts,
        f"ceil({n} / {seg}): the last segment is partial.",
        "Section 4: one partial result (max, sum, output) per segment.",
        unit="segments",
        mistakes=_mistakes(parts, [(n // seg, "Round up: the last, shorter segment is a segment too.")]),
    )


def _intensity(rng: random.Random) -> Asked:
    s = _spec(rng, ("llama-3-8b", "mistral-7b", "llama-3-70b", "llama-2-7b"))
    assert s.num_attention_heads is not None
    group = s.num_attention_heads // s.num_kv_heads
    flop_per_byte = 2 * group / s.dtype_bytes
    return Asked(
        f"Decode attention on {_heads(s)}, {s.num_attention_heads} query heads: how many FLOP does it do per byte "
        "of KV it reads (one query token per sequence)?",
        flop_per_byte,
        f"Each K or V element ({s.dtype_bytes} bytes) meets the {group} query heads of its group in a multiply-add "
        f"(2 FLOP): 2 · {group} ÷ {s.dtype_bytes}. Far below a GPU's hundreds of FLOP per byte: bandwidth-bound.",
        "Section 7: count the multiply-adds each loaded element takes part in.",
        unit="FLOP/byte",
        rel_tol=1e-3,
        mistakes=_mistakes(flop_per_byte, [(2 / s.dtype_bytes, "GQA: each KV head serves several query heads.")]),
    )


# ---- chapters 06-08: the scheduler, run for real on a fake model ------------------------------------
def _driver(**kw: object):  # lab.checking_driver imports torch: keep it off this module's import path
    from ..lab.checking_driver import Driver

    return Driver(**kw)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 40) for _ in range(n)]


def _chunk(rng: random.Random) -> Asked:
    budget = rng.choice([16, 24, 32, 48])
    lens = [rng.randrange(4, budget - 2), rng.randrange(budget // 2, 2 * budget)]
    d = _driver(block_size=4, num_blocks=128, budget=budget, max_num_seqs=8, caching=False)
    for i, n in enumerate(lens):
        d.add(f"r{i}", _prompt(rng, n), max_tokens=4, ignore_eos=True)
    out = d.step()
    got = {s.request_id: s.num_new_tokens for s in out.scheduled}.get("r1", 0)
    return Asked(
        f"Token budget {budget} per step, chunked prefill on, nothing running. Two prompts wait: r0 of {lens[0]} "
        f"tokens, then r1 of {lens[1]}. How many of r1's tokens run in the first step?",
        got,
        f"r0 takes {lens[0]} of the {budget}; r1 gets what is left, at most its own length: a chunk.",
        "Section 4: the budget is shared in arrival order, and a prompt may be cut.",
        unit="tokens",
        mistakes=_mistakes(
            got,
            [
                (lens[1], "The budget caps the step: a long prompt is chunked."),
                (0, "Chunked prefill lets r1 start in the leftover budget."),
            ],
        ),
    )


def _prefill_steps(rng: random.Random) -> Asked:
    budget = rng.choice([8, 16, 32])
    n = rng.randrange(budget + 1, 5 * budget)
    d = _driver(block_size=4, num_blocks=256, budget=budget, max_num_seqs=4, caching=False, max_model_len=512)
    req = d.add("r", _prompt(rng, n), max_tokens=3, ignore_eos=True)
    steps = 0
    while not req.output_token_ids:
        d.step()
        steps += 1
    return Asked(
        f"A prompt of {n} tokens arrives alone; the token budget is {budget} per step. In which step (counting "
        "from 1) is its first token sampled?",
        steps,
        f"ceil({n} / {budget}) steps of prefill chunks; the last chunk's step samples the first token.",
        "Section 4: how many chunks does the prompt take?",
        mistakes=_mistakes(
            steps, [(steps + 1, "The step that computes the last prompt chunk samples the first token: no extra step.")]
        ),
    )


def _seats(rng: random.Random) -> Asked:
    seats, waiting = rng.randrange(2, 6), rng.randrange(6, 10)
    blocks = rng.randrange(3, 9)  # a small pool: blocks, not seats, may be what stops admission
    d = _driver(block_size=4, num_blocks=blocks + 1, budget=512, max_num_seqs=seats, caching=False, watermark_blocks=0)
    for i in range(waiting):
        d.add(f"r{i}", _prompt(rng, 6), max_tokens=2, ignore_eos=True)
    admitted = len(d.step().scheduled)
    return Asked(
        f"max_num_seqs = {seats}, a pool of {blocks} usable blocks of 4 slots, a large token budget, no watermark. "
        f"{waiting} prompts of 6 tokens wait. How many are admitted in the first step?",
        admitted,
        f"Each needs 2 blocks, so {blocks} blocks admit {blocks // 2}; the seats admit {seats}: the smaller wins.",
        "Section 3: admission needs a seat and the blocks for the prompt.",
        mistakes=_mistakes(
            admitted,
            [
                (seats, "Seats are not all: each prompt also needs its blocks."),
                (blocks, "Each prompt of 6 tokens needs two blocks of 4."),
            ],
        ),
    )


def _victim(rng: random.Random) -> Asked:
    names = rng.sample(["A", "B", "C", "D", "E"], 3)
    d = _driver(block_size=4, num_blocks=10, budget=64, max_num_seqs=4, caching=False, watermark_blocks=0)
    for name in names:
        d.add(name, _prompt(rng, 7), max_tokens=20, ignore_eos=True)
    victim = None
    for _ in range(40):
        out = d.step()
        if out.preempted:
            victim = out.preempted[0]
            break
    assert victim is not None, "the pool is small enough that someone is preempted"
    return Asked(
        f"Three requests arrive in the order {', '.join(names)} with 7-token prompts, asking for 20 tokens each; the "
        "pool has 9 usable blocks of 4. Decoding, they run out of blocks. Which request is preempted first?",
        victim,
        "The one admitted last: vLLM's FCFS policy preempts the newest running request, so the oldest keep going.",
        "Section 1: which end of the running queue gives way?",
        choices=tuple(names),
        mistakes={names[0]: "The oldest request keeps its blocks under first-come-first-served."},
    )


def _recompute_tokens(rng: random.Random) -> Asked:
    from ..core.request import Request

    prompt, generated = rng.randrange(20, 400), rng.randrange(5, 200)
    req = Request("v", list(range(prompt)))
    for t in range(generated):
        req.append_output_token_ids(t)
    n = req.num_tokens
    return Asked(
        f"A request with a {prompt}-token prompt has generated {generated} tokens when it is preempted by "
        "recompute. With no prefix cache, how many tokens must be prefilled when it is admitted again?",
        n,
        f"Its KV is gone, so the prompt and every token it generated run again as one prompt: {prompt} + {generated}.",
        "Section 2: what does recompute throw away?",
        unit="tokens",
        mistakes=_mistakes(n, [(prompt, "Its generated tokens' KV was dropped as well.")]),
    )


def _swap_bytes(rng: random.Random) -> Asked:
    s = _spec(rng)
    n = rng.randrange(100, 3000)
    if n % 16 == 0:
        n += 1
    mib = s.paged_bytes_for_tokens(n, 16) / MiB
    return Asked(
        f"A request holding {n} tokens of {_heads(s)} in blocks of 16 is swapped out. How many MiB cross to the CPU?",
        mib,
        f"Swap copies whole blocks: {s.blocks_for_tokens(n, 16)} blocks · {s.bytes_per_block(16):,} bytes.",
        "Section 3: what unit does swap_out copy?",
        unit="MiB",
        rel_tol=1e-9,
        mistakes=_mistakes(
            mib, [(s.bytes_for_tokens(n) / MiB, "Swap moves whole blocks, the last one's empty slots too.")]
        ),
    )


def _cached_start(cached: list[int], new: list[int], bs: int, cache_salt: str | None = None) -> int:
    """Tokens of ``new`` served from the prefix cache once ``cached`` has run (the real scheduler)."""
    from ..core.request import Request
    from ..sampling_params import SamplingParams

    d = _driver(block_size=bs, num_blocks=128, budget=512, max_num_seqs=4, caching=True)
    d.add("first", cached, max_tokens=1, ignore_eos=True)
    d.run()
    second = Request(
        "second", new, cache_salt=cache_salt, sampling_params=SamplingParams(max_tokens=1, ignore_eos=True)
    )
    d.sched.add_request(second)
    d.requests["second"] = second
    return next(s.start for s in d.step().scheduled if s.request_id == "second")


def _prefix_hit(rng: random.Random) -> Asked:
    bs = rng.choice([4, 8])
    shared = rng.randrange(bs + 1, 6 * bs)
    if shared % bs == 0:
        shared += 1
    first = _prompt(rng, shared + rng.randrange(2, 10))
    second = first[:shared] + [t + 40 for t in _prompt(rng, rng.randrange(bs + 1, 3 * bs))]
    start = _cached_start(first, second, bs)
    return Asked(
        f"Prefix caching on, blocks of {bs}. A {len(first)}-token prompt has run. A new {len(second)}-token prompt "
        f"shares its first {shared} tokens. How many of the new prompt's tokens come from the cache?",
        start,
        f"Only full blocks are cached: ⌊{shared} / {bs}⌋ · {bs}.",
        "Section 1: what unit is hashed and cached?",
        unit="tokens",
        mistakes=_mistakes(start, [(shared, "A partly shared block is not a hit: only full blocks are cached.")]),
    )


def _chained(rng: random.Random) -> Asked:
    bs = 4
    nblocks = rng.randrange(4, 8)
    first = _prompt(rng, nblocks * bs + 2)
    changed = rng.randrange(bs, (nblocks - 1) * bs)
    second = list(first)
    second[changed] += 40
    start = _cached_start(first, second, bs)
    return Asked(
        f"Prefix caching on, blocks of 4. A {len(first)}-token prompt has run. The same prompt comes again with only "
        f"token {changed} (counting from 0) changed. How many tokens come from the cache?",
        start,
        f"Hashes are chained: block {changed // bs} and every block after it hash differently, so the hit stops at "
        f"{changed // bs} blocks.",
        "Section 1: what goes into a block's hash besides its own tokens?",
        unit="tokens",
        mistakes=_mistakes(
            start,
            [((nblocks - 1) * bs, "Each block's hash includes its parent's: the change misses every later block too.")],
        ),
    )


def _salted(rng: random.Random) -> Asked:
    bs = 4
    first = _prompt(rng, rng.randrange(3, 7) * bs + 1)
    start = _cached_start(first, list(first), bs, cache_salt="user-b")
    return Asked(
        f"Prefix caching on, blocks of 4. A {len(first)}-token prompt has run with no cache_salt. The same prompt "
        "comes from another tenant with cache_salt='user-b'. How many tokens come from the cache?",
        start,
        "The salt goes into the first block's hash, and the chain carries it into every block: nothing matches.",
        "Section 5: what does a salt change?",
        unit="tokens",
        mistakes=_mistakes(
            start, [((len(first) // bs) * bs, "The salt changes every block's hash: no block matches.")]
        ),
    )


# ---- chapter 09: the engine -------------------------------------------------------------------------
def _written(rng: random.Random) -> Asked:
    s = KVSpec.from_preset("smollm2-135m", dtype=rng.choice(["bf16", "fp32"]))
    n = rng.randrange(20, 500)
    written = s.bytes_for_tokens(n)
    return Asked(
        f"A step runs a prefill chunk of {n} tokens through {_heads(s)}. How many bytes does it write into the KV "
        "pool, all layers together?",
        written,
        f"Every layer writes K and V for each of the {n} tokens: {n} · {s.bytes_per_token:,} bytes.",
        "Section 4: what one decoder layer writes into the paged cache, then all thirty.",
        unit="bytes",
        mistakes=_mistakes(
            written,
            [
                (written / s.num_layers, "That is one layer: each of the thirty writes its own K and V."),
                (written / 2, "K and V are both written."),
            ],
        ),
    )


def _chunked(rng: random.Random, first_step: int):  # -> (n, budget, step, ScheduledRequest)
    """A prompt prefilled alone in chunks of the token budget, run by the real scheduler up to a drawn step:
    (its length, the budget, the step, that step's chunk)."""
    budget = rng.choice([8, 16, 32])
    n = rng.randrange(2 * budget + 1, 5 * budget)
    step = rng.randrange(first_step, -(-n // budget) + 1)
    d = _driver(block_size=4, num_blocks=256, budget=budget, max_num_seqs=4, caching=False, max_model_len=512)
    d.add("r", _prompt(rng, n), max_tokens=3, ignore_eos=True)
    for _ in range(step):
        out = d.step()
    (chunk,) = out.scheduled
    return n, budget, step, chunk


def _samples(rng: random.Random) -> Asked:
    n, budget, step, chunk = _chunked(rng, 1)
    sampled = chunk.num_samples
    return Asked(
        f"A {n}-token prompt is prefilled alone in chunks of {budget} tokens (the budget). How many tokens does the "
        f"engine sample (rows of logits it needs) in step {step}?",
        sampled,
        "Only a step that reaches the prompt's end samples, one token; a mid-prompt chunk samples none, so its "
        "logits are never computed.",
        "Section 6: which rows of a step need logits?",
        unit="tokens",
        mistakes=_mistakes(sampled, [(budget, "Logits are needed only where a token is sampled, not for every row.")]),
    )


def _positions(rng: random.Random) -> Asked:
    n, budget, step, chunk = _chunked(rng, 2)
    last = chunk.start + chunk.num_new_tokens - 1
    return Asked(
        f"A {n}-token prompt is prefilled alone in chunks of {budget} tokens. In step {step}, the runner builds the "
        "model's position ids for the chunk. What is the last of them?",
        last,
        f"The chunk starts where the cache ends ({chunk.start} tokens computed) and runs {chunk.num_new_tokens} "
        f"tokens: positions {chunk.start} … {last}. RoPE needs the true positions, not 0 … {chunk.num_new_tokens - 1}.",
        "Sections 3 and 6: positions continue from the tokens already computed.",
        mistakes=_mistakes(
            last,
            [
                (chunk.num_new_tokens - 1, "Positions do not restart with each chunk."),
                (last + 1, "Positions count from 0."),
            ],
        ),
    )


# ---- chapter 10: the capstone's seams -----------------------------------------------------------------
def _seam(rng: random.Random) -> Asked:
    from .grading.capstone import capstone_parts

    parts = capstone_parts()
    name = rng.choice(sorted(parts))
    part = parts[name]
    where = part.where.split(":")[0]
    options = sorted({p.exercise for p in parts.values()})
    return Asked(
        f"The capstone plugs your parts into the engine. Which exercise's part does the engine call in {where} "
        f"({part.where.split(':', 1)[1].strip() if ':' in part.where else part.where})?",
        part.exercise,
        f"{name}, the part of {part.exercise}: {part.signature}.",
        "Section 1: the table of parts.",
        choices=tuple(options),
    )


def _part_count(rng: random.Random) -> Asked:
    from .grading.capstone import capstone_parts

    parts = capstone_parts()
    ex = rng.choice(sorted({p.exercise for p in parts.values()}))
    n = sum(p.exercise == ex for p in parts.values())
    return Asked(
        f"How many of the capstone's parts come from {ex}?",
        n,
        f"{', '.join(sorted(k for k, p in parts.items() if p.exercise == ex))}.",
        "Section 1: the table of parts, by exercise.",
        unit="parts",
    )


def _checked(rng: random.Random) -> Asked:
    options = (
        "the first wrong call raises PartError, naming the part and the call",
        "the engine finishes and the outputs show the error",
        "the wrong part is skipped and the package's own runs instead",
    )
    from .. import hooks
    from . import parts
    from .parts import PartError

    def wrong_slot_mapping(block_tables, positions, block_size, pad_to=None):
        return [p for pos in positions for p in pos]  # the logical positions: the table is not read

    raised = False
    try:  # what parts.use does with it, asked now rather than written down
        with parts.use(slot_mapping=wrong_slot_mapping):
            hooks.plugged("slot_mapping")([[3, 1]], [[0, 5]], 4)
    except PartError:
        raised = True
    answer = options[0] if raised else options[1]
    return Asked(
        "With parts.use(...) in its default checked mode, what happens when your part returns a wrong result "
        "inside the engine?",
        answer,
        "Every call of a plugged part is checked as it returns; the first wrong one stops with a PartError that "
        "names the part, its exercise and the call (check=False runs it as it is).",
        "Section 2: a wrong part, caught.",
        choices=options,
    )


# ---- chapter 11: serving ------------------------------------------------------------------------------
def _streamed(rng: random.Random) -> RequestMetrics:
    """A streamed request's clock: arrival, then 4-7 tokens."""
    arrival = round(rng.uniform(0, 1), 3)
    t = arrival + rng.uniform(0.05, 0.5)
    times = []
    for _ in range(rng.randrange(4, 8)):
        times.append(round(t, 3))
        t += rng.uniform(0.01, 0.06)
    return RequestMetrics("r", arrival, 10, len(times), first_token=times[0], finish=times[-1], token_times=times)


def _ttft(rng: random.Random) -> Asked:
    m = _streamed(rng)
    arrival, times = m.arrival, m.token_times
    ms = float(m.ttft or 0) * 1000
    return Asked(
        f"A streamed request arrives at t = {arrival} s; its tokens arrive at {times} s. TTFT, in ms?",
        ms,
        "From arrival to the first token.",
        "Section 4: where TTFT starts and stops.",
        unit="ms",
        rel_tol=1e-3,
        mistakes=_mistakes(ms, [((times[1] - times[0]) * 1000, "That is the first inter-token gap.")]),
    )


def _itl(rng: random.Random) -> Asked:
    m = _streamed(rng)
    arrival, times = m.arrival, m.token_times
    ms = float(m.mean_itl or 0) * 1000
    return Asked(
        f"The same kind of request: arrival t = {arrival} s, tokens at {times} s. Its mean inter-token latency, in ms?",
        ms,
        f"{len(times) - 1} gaps between {len(times)} tokens, averaged: (last − first) ÷ {len(times) - 1}.",
        "Section 4: ITL counts the gaps between tokens, not the wait for the first.",
        unit="ms",
        rel_tol=1e-3,
        mistakes=_mistakes(
            ms,
            [
                (
                    (times[-1] - arrival) / len(times) * 1000,
                    "The wait for the first token is TTFT, not an inter-token gap.",
                )
            ],
        ),
    )


def _p99(rng: random.Random) -> Asked:
    from ..serving.load import percentile

    values = sorted(round(rng.uniform(20, 400)) for _ in range(rng.choice([11, 21, 51])))
    p = percentile(values, 99)
    assert p is not None
    return Asked(
        f"TTFTs of {len(values)} requests, in ms, sorted: {values}. Their p99, linearly interpolated (numpy's "
        "default)?",
        p,
        f"Rank (n − 1) · 0.99 = {(len(values) - 1) * 0.99:g} in the sorted list, between two neighbours.",
        "Section 4: the percentile's rank, then interpolate.",
        unit="ms",
        rel_tol=1e-3,
        mistakes=_mistakes(p, [(values[-1], "That is the maximum; p99 interpolates below it.")]),
    )


# ---- chapter 12: tensor parallelism ----------------------------------------------------------------
def _tp(rng: random.Random) -> tuple[KVSpec, int]:
    s = _spec(rng, ("llama-3-8b", "llama-3-70b", "mistral-7b", "llama-2-7b"))
    return s, rng.choice([2, 4, 8, 16])


def _heads_per_rank(rng: random.Random) -> Asked:
    s, tp = _tp(rng)
    heads, how = s.kv_heads_per_rank(tp)
    return Asked(
        f"{s.name} ({s.num_kv_heads} KV heads) over tensor_parallel_size = {tp}. How many KV heads does each rank "
        "store?",
        heads,
        f"{how}.",
        "Section 4, and chapter 01 section 7 for more ranks than heads: those are replicated.",
        unit="heads",
        mistakes=_mistakes(
            heads,
            [
                (
                    s.num_kv_heads / tp,
                    "A rank cannot hold part of a head: with more ranks than heads, heads are replicated.",
                )
            ],
        ),
    )


def _bytes_per_rank(rng: random.Random) -> Asked:
    s, tp = _tp(rng)
    b = s.per_rank(tp).bytes_per_token
    return Asked(
        f"{_heads(s)} over tensor_parallel_size = {tp}: how many bytes of KV does one token cost on each rank?",
        b,
        f"Each rank stores {s.kv_heads_per_rank(tp)[0]} KV head(s): 2 · {s.num_layers} · heads · {s.head_dim} · "
        f"{s.dtype_bytes}.",
        "Chapter 01 section 7: the heads each rank stores, then the bytes-per-token formula.",
        unit="bytes",
        mistakes=_mistakes(
            b,
            [
                (
                    s.bytes_per_token / tp,
                    "Not a plain division when heads are replicated: count the heads each rank stores.",
                )
            ],
        ),
    )


def _copies(rng: random.Random) -> Asked:
    s, tp = _tp(rng)
    heads, _ = s.kv_heads_per_rank(tp)
    copies = tp * heads / s.num_kv_heads
    return Asked(
        f"{s.name} ({s.num_kv_heads} KV heads) over tensor_parallel_size = {tp}: across all ranks, how many copies "
        "of each KV head are stored?",
        copies,
        f"{tp} ranks · {heads} head(s) each ÷ {s.num_kv_heads} distinct heads.",
        "Chapter 01 section 7: ranks times heads per rank, against the heads there are.",
        unit="copies",
        rel_tol=1e-9,
        mistakes=_mistakes(copies, [(float(tp), "Each rank holds only some of the heads.")]),
    )


# ---- chapter 13: what vLLM v1 adds ----------------------------------------------------------------------
def _verified(rng: random.Random) -> Asked:
    import torch

    from ..sampling_params import SamplingParams
    from ..worker.sampler import Sampler, verify

    k = rng.randint(3, 5)
    drafts = [rng.randrange(10, 60) for _ in range(k)]
    agree = rng.randint(0, k)
    targets = drafts[:agree] + [rng.randrange(60, 99) for _ in range(k + 1 - agree)]
    logits = torch.zeros(k + 1, 100)
    logits[torch.arange(k + 1), torch.tensor(targets)] = 1.0
    tokens, _ = verify(Sampler(), logits, drafts, ("quiz", 0), SamplingParams(temperature=0))
    return Asked(
        f"Greedy speculative decoding. A request's drafts are {drafts}; after its last real token and after each "
        f"draft, the model's own choices are {targets}. How many tokens does this step add to the request?",
        len(tokens),
        f"The first {agree} draft(s) agree with the model, then one token of the model's own: {tokens}.",
        "Section 1: drafts are kept up to the first disagreement, and the model's token there is kept too.",
        unit="tokens",
        mistakes=_mistakes(
            len(tokens),
            [(float(agree), "The model's own token at the first disagreement (or after the last draft) counts too.")],
        ),
    )


def _window_blocks(rng: random.Random) -> Asked:
    from ..core.kv_cache_coordinator import kv_cache_groups
    from ..core.kv_cache_manager import KVCacheManager
    from ..core.request import Request

    num_window, num_full = rng.choice([(25, 5), (24, 8), (2, 2), (20, 20), (6, 2)])
    window, bs = rng.choice([256, 512, 1024]), rng.choice([16, 32])
    n = rng.randint(window + bs, 4 * window)
    groups = kv_cache_groups([window] * num_window + [None] * num_full)
    # The package's own manager does it: the prompt, then room for position n.
    mgr = KVCacheManager(
        bs, 3 * len(groups) * (n // bs + 2), enable_caching=False, watermark=0.0, kv_cache_groups=groups
    )
    req = Request("quiz", [1] * n)
    mgr.allocate_slots(req, n)
    req.num_computed_tokens = n
    mgr.allocate_slots(req, 1)
    held = sum(not b.is_null for _, _, blocks in mgr.held_blocks() for b in blocks)
    full_groups = sum(g.sliding_window is None for g in groups)
    window_groups = len(groups) - full_groups
    all_blocks = -(-(n + 1) // bs)
    in_window = all_blocks - (n - window + 1) // bs
    return Asked(
        f"A hybrid model has {num_full} full-attention layers and {num_window} sliding-window layers (window "
        f"{window} positions), block size {bs}. A request has {n} tokens computed and the pool has just made room "
        f"for position {n}. How many blocks does it hold, all its KV cache groups together?",
        held,
        f"Groups of {min(num_full, num_window)} layers: {full_groups} full group(s) of {all_blocks} blocks each and "
        f"{window_groups} window group(s) holding only blocks from position {n} − {window} + 1 on: {in_window} each. "
        f"{full_groups}·{all_blocks} + {window_groups}·{in_window} = {held}.",
        "Section 4: each type is cut into groups of the smaller type's layer count; a full group keeps every block, "
        "a window group gives back the blocks wholly before the window of the token it computes.",
        unit="blocks",
        mistakes=_mistakes(
            held,
            [
                (float(all_blocks + in_window), "Each type has several groups here, each with its own table."),
                (float(len(groups) * all_blocks), "A window group gives back the blocks behind its window."),
            ],
        ),
    )


def _pass_speedup(rng: random.Random) -> Asked:
    length = rng.choice([1.5, 2.0, 2.5, 3.0, 4.0])
    cost = rng.choice([1.1, 1.25, 1.5, 2.0])
    ratio = length / cost
    return Asked(
        f"With speculation a verification step emits {length} tokens per request on average (the mean acceptance "
        f"length) and takes {cost}× as long as a plain decode step. How many times the plain decode's tokens per "
        "second does it give?",
        ratio,
        f"{length} tokens per step ÷ {cost}× the time = {ratio:.3g}×. Below 1, speculation loses.",
        "Section 1: tokens per step against the step's cost.",
        unit="×",
        rel_tol=0.01,
        mistakes=_mistakes(ratio, [(length, "The longer step costs time too: divide by its cost.")]),
    )


# SmolLM2-135M's layer matrices, rounded: its parameters less the (tied) embedding (tests/test_selfcheck.py counts them)
SMOLLM2_LAYER_WEIGHTS = 106_000_000


# ---- chapter 09, part 2: the engine serving a batch ----------------------------------------------------------------
def _pool_blocks(rng: random.Random) -> Asked:
    s = KVSpec.from_preset("smollm2-135m", dtype=rng.choice(["bf16", "fp32"]))
    mib, bs = rng.choice([64, 128, 256, 512]), rng.choice([16, 32])
    blocks = mib * MiB // s.bytes_per_block(bs)
    return Asked(
        f"LLM(kv_cache_memory='{mib}MiB', block_size={bs}) serves {_heads(s)}. How many blocks does its pool have, "
        "the null block included?",
        blocks,
        f"A block holds {bs} tokens of K and V in every layer: {bs} · {s.bytes_per_token:,} = "
        f"{s.bytes_per_block(bs):,} bytes; {mib} MiB holds {blocks:,} of them.",
        "Section 7: the pool is a byte budget divided by the bytes of one block.",
        unit="blocks",
        mistakes=_mistakes(
            blocks,
            [
                (mib * MiB // (s.bytes_per_block(bs) // 2), "A block holds K and V."),
                (mib * MiB // (s.bytes_per_block(bs) // s.num_layers), "A block holds its tokens in every layer."),
            ],
        ),
    )


def _static_idle(rng: random.Random) -> Asked:
    outs = [rng.randrange(4, 60) for _ in range(rng.choice([3, 4, 5]))]
    idle = len(outs) * max(outs) - sum(outs)
    return Asked(
        f"A static batch of {len(outs)} requests wants {', '.join(map(str, outs))} output tokens. It runs until its "
        "longest output is done. How many token slots (a row in one step) does it compute that nobody asked for?",
        idle,
        f"Every row runs {max(outs)} steps; the requests asked for {sum(outs)} tokens of the "
        f"{len(outs)} · {max(outs)} = {len(outs) * max(outs)} computed.",
        "Section 9: finished rows keep computing until the batch's longest output is done.",
        unit="slots",
        mistakes=_mistakes(
            idle,
            [
                (max(outs) - min(outs), "Every request shorter than the longest idles, not only the shortest."),
                (0, "A finished request keeps its row in a static batch: that is the waste."),
            ],
        ),
    )


def _layer_flops(rng: random.Random) -> Asked:
    weights = SMOLLM2_LAYER_WEIGHTS
    tokens = rng.randrange(8, 400)
    gflop = 2 * weights * tokens / 1e9
    return Asked(
        f"SmolLM2's 30 layers hold about {weights / 1e6:.0f} million weights in their matrices. A step computes "
        f"{tokens} tokens. About how many GFLOP do those matrices cost (attention's own products aside)?",
        gflop,
        f"Each weight is one multiply and one add for each computed token: 2 · {weights / 1e6:.0f}e6 · {tokens}.",
        "Section 10: what every computed token costs in the layers' matrices.",
        unit="GFLOP",
        rel_tol=0.005,  # the arithmetic, to its rounding: v ± 1 and 1.05 v are wrong for every drawn step
        mistakes=_mistakes(gflop, [(gflop / 2, "A multiply-add is two floating-point operations.")]),
    )


QUESTIONS: dict[str, tuple[Callable[[random.Random], Asked], ...]] = {
    "01": (_bytes_per_token, _tokens_in_budget, _gqa_saving),
    "02": (_max_waste, _pow2_reservation, _paged_waste),
    "03": (_free_after, _reuse_order, _ref_count),
    "04": (_slot_of, _position_of, _new_blocks),
    "05": (_decode_read, _segments, _intensity),
    "06": (_chunk, _prefill_steps, _seats),
    "07": (_victim, _recompute_tokens, _swap_bytes),
    "08": (_prefix_hit, _chained, _salted),
    "09": (_written, _samples, _positions),
    "09b": (_pool_blocks, _static_idle, _layer_flops),
    "10": (_seam, _part_count, _checked),
    "11": (_ttft, _itl, _p99),
    "12": (_heads_per_rank, _bytes_per_rank, _copies),
    "13": (_verified, _window_blocks, _pass_speedup),
}


def questions(chapter: str, seed: int = 0) -> list[Asked]:
    """The chapter's questions, drawn with ``seed`` (each question from its own stream, so they are independent)."""
    if chapter not in QUESTIONS:
        raise ValueError(f"no self-check for chapter {chapter!r}; chapters: {', '.join(CHAPTERS)}")
    return [make(random.Random(f"{chapter}/{i}/{seed}")) for i, make in enumerate(QUESTIONS[chapter])]
