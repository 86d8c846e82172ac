"""Checks for exercise 09c: the runner's sampler beyond greedy — the top-k/top-p mask and seeded random streams.

The learner writes, from a behaviour spec:

* ``apply_top_k_top_p(logits, top_k, top_p) -> torch.Tensor``: one row of logits with every logit outside the
  top-k and outside the top-p nucleus set to -inf, the others unchanged (``worker.sampler.apply_top_k_top_p``).
* ``Sampler``: ``sampler(logits, keys, params) -> list[int]`` and ``sampler.forget(key)``. Greedy rows take the
  argmax; a sampled row is divided by its temperature, masked with the learner's ``apply_top_k_top_p``, turned into
  probabilities and drawn with ``torch.multinomial`` from the generator of its key (one per key, seeded with
  ``params.seed`` at the key's first draw), or from torch's global generator when it has no seed. A row whose
  largest logit is not finite raises ``ValueError`` naming its key.

The spec pins the draw (generator, seed, ``torch.multinomial`` over the whole row) so that a seed gives the same
tokens in every implementation that follows it: the package's ``Sampler`` is then an exact reference.

* ``mask``: chosen cases, each named by what it tries, and seeded random rows, against the package's mask (the
  positions of -inf exactly, the kept logits unchanged); the input must come back unmodified.
* ``streams``: properties (a seeded request's tokens do not depend on the batch around it or its row; a fresh
  sampler repeats them; ``forget`` starts a stream again; two ``seed`` values differ) and the package's tokens for
  the same ``seed``.
* ``distribution``: thousands of seeded draws per setting: never outside the support, and frequencies within a
  total-variation distance of the masked softmax that a right answer meets by a wide margin whatever its draws.
* ``sample_smollm2``: SmolLM2 sampling three requests in one batch with the learner's ``Sampler``, against the
  package's ``Sampler`` in the same loop, and the first request alone.
"""

from __future__ import annotations

import dataclasses
import random
import zlib
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from ...sampling_params import SamplingParams
from ...worker.sampler import Sampler as PackageSampler
from ...worker.sampler import apply_top_k_top_p as package_mask
from .core import Check, CheckOutcome, describe_error, report

Mask = Callable[[torch.Tensor, int, float], torch.Tensor]
SamplerClass = Callable[[], Any]  # the learner's class, made with no arguments
INF = float("inf")


def _draw(sampler: Any, logits: torch.Tensor, keys: Sequence[Hashable], params: Sequence[SamplingParams]) -> list[int]:
    """One call of a sampler, its tokens as ints (one per row, or an error a check reports)."""
    tokens = [int(t) for t in sampler(logits, list(keys), list(params))]
    if len(tokens) != logits.shape[0]:
        raise ValueError(f"{len(tokens)} tokens for {logits.shape[0]} rows: one token per row")
    return tokens


def _row(name: str, step: int, vocab: int, scale: float = 2.0) -> torch.Tensor:
    """A request's logits at one step: seeded by its name and the step, the same in every run."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{step}".encode()))
    return torch.randn(vocab, generator=g) * scale


def _report_keeping_rng(group: str, checks: list[Check]) -> list[CheckOutcome]:
    """``report``, then torch's global generator as it was before: a sampler's draws leave the notebook's alone."""
    with torch.random.fork_rng(devices=[]):
        return report(group, checks)


# ---- mask ------------------------------------------------------------------------------------------------------
def _kept(mask: Mask, logits: torch.Tensor, top_k: int, top_p: float) -> Any:
    """The positions ``mask`` kept (not -inf), or what is wrong with its answer."""
    out = mask(logits.clone(), top_k, top_p)  # a clone: an in-place answer is caught by its own check
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(logits.shape):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return f"returned {shape}: expected a tensor of shape {tuple(logits.shape)}"
    kept = []
    for i, (got, was) in enumerate(zip(out.detach().float().tolist(), logits.tolist())):
        if got == -INF:
            continue
        if got != was:
            return f"logit {i} came back {got} from {was}: a masked logit becomes -inf, a kept one stays as it was"
        kept.append(i)
    return kept


def _probs_row(probs: list[float], order: list[int]) -> torch.Tensor:
    """Logits whose softmax is ``probs``, placed at the positions ``order`` (so rank is not position)."""
    row = torch.empty(len(probs))
    row[torch.tensor(order)] = torch.tensor(probs).log()
    return row


MASK_CASES: list[tuple[str, torch.Tensor, int, float]] = [
    ("both off (top_k -1, top_p 1.0): nothing masked", torch.tensor([2.0, 1.0, 0.5, -1.0]), -1, 1.0),
    ("top_k 2 keeps the two largest: [0.3, 2.0, -1.0, 1.5, 0.0]", torch.tensor([0.3, 2.0, -1.0, 1.5, 0.0]), 2, 1.0),
    ("top_k ties: every logit equal to the k-th stays: [3, 2, 2, 1, 2], top_k 2",
     torch.tensor([3.0, 2.0, 2.0, 1.0, 2.0]), 2, 1.0),
    ("top_k 0 is off", torch.tensor([0.5, -0.5, 1.5]), 0, 1.0),
    ("top_k larger than the vocabulary is off: 3 logits, top_k 5", torch.tensor([1.0, 3.0, 2.0]), 5, 1.0),
    ("top_p 0.7 on probabilities 0.5, 0.3, 0.15, 0.05: the token that crosses 0.7 stays",
     _probs_row([0.5, 0.3, 0.15, 0.05], [1, 3, 0, 2]), -1, 0.7),
    ("top_p 0.45 on the same: the most likely token alone reaches it",
     _probs_row([0.5, 0.3, 0.15, 0.05], [1, 3, 0, 2]), -1, 0.45),
    # (in float32 these probabilities, summed smallest first, come to 0.99999994: below 1 - 1e-9)
    ("a tiny top_p (1e-9) keeps the most likely token alone: [3, 5, 1, 4, 2]",
     torch.tensor([3.0, 5.0, 1.0, 4.0, 2.0]), -1, 1e-9),
    ("top_p 1.0 is off, even where the tail's probability rounds to nothing: [0, -30, -30, -40]",
     torch.tensor([0.0, -30.0, -30.0, -40.0]), -1, 1.0),
    ("top-p on what top-k left, renormalised: probabilities 0.4, 0.3, 0.2, 0.1, top_k 3, top_p 0.75",
     _probs_row([0.4, 0.3, 0.2, 0.1], [2, 0, 3, 1]), 3, 0.75),
    ("a row with -inf already (a masked vocabulary): [-inf, 1, 0, -inf, 2], top_k 2, top_p 0.9",
     torch.tensor([-INF, 1.0, 0.0, -INF, 2.0]), 2, 0.9),
    ("a one-token vocabulary keeps its token: [5.0], top_k 1, top_p 0.1", torch.tensor([5.0]), 1, 0.1),
]  # fmt: skip


def _mask_twin(mask: Mask, seed: int, rows: int = 200) -> Any:
    """``rows`` random rows (vocabularies of 1 to 200, scales 0.1 to 10, some -inf), the first that differs."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    for case in range(rows):
        vocab = rng.choice((1, 2, 3, 5, 8, 16, 50, 200))
        logits = torch.randn(vocab, generator=g) * rng.choice((0.1, 1.0, 3.0, 10.0))
        if vocab > 2 and rng.random() < 0.2:
            logits[torch.randperm(vocab, generator=g)[: vocab // 3]] = -INF
        top_k = rng.choice((-1, 0, 1, 2, rng.randint(1, vocab + 2), vocab, vocab + 5))
        top_p = rng.choice((1.0, 1.0, 0.9, 0.5, 0.1, 1e-6, round(rng.uniform(0.05, 0.99), 3)))
        where = f"case {case}: {vocab} logits, top_k {top_k}, top_p {top_p}"
        try:
            got = _kept(mask, logits, top_k, top_p)
        except Exception as exc:  # name the row that raised
            return f"{where}: {describe_error(exc)}"
        want = _kept(package_mask, logits, top_k, top_p)
        if got != want:
            if isinstance(got, str):
                return f"{where}: {got}"
            values = logits.tolist()
            differ = ", ".join(f"{t} (logit {values[t]:.4g}, rank {int((logits > values[t]).sum()) + 1})"
                               for t in sorted(set(got) ^ set(want))[:5])  # fmt: skip
            return f"{where}: you kept {len(got)} tokens, the package {len(want)}; they differ on tokens {differ}"
    return "same"


def _leaves_input(mask: Mask) -> Any:
    for logits, top_k, top_p in ((torch.tensor([0.3, 2.0, -1.0, 1.5, 0.0]), 2, 1.0),
                                 (_probs_row([0.5, 0.3, 0.15, 0.05], [1, 3, 0, 2]), -1, 0.7),
                                 (torch.tensor([1.0, 4.0, 2.0, 3.0, 0.0]), 3, 0.6)):  # fmt: skip
        given = logits.clone()
        mask(given, top_k, top_p)
        if not torch.equal(given, logits):
            return f"top_k {top_k}, top_p {top_p}: your input {logits.tolist()} became {given.tolist()}"
    return "unchanged"


def check_mask(apply_top_k_top_p: Mask) -> list[CheckOutcome]:
    """The mask, case by case (each expected list of kept positions is the package's), then random rows."""
    hint_cases = (
        "top-k keeps every logit >= the k-th largest (off when top_k <= 0 or >= vocab); top-p, on the softmax of "
        "what top-k left, drops a token when the tokens ranked before it already hold >= top_p (off at 1.0)"
    )
    checks = [
        Check(
            f"apply_top_k_top_p: {label}",
            lambda x=x, k=k, p=p: _kept(apply_top_k_top_p, x, k, p),
            _kept(package_mask, x, k, p),
            hint=hint_cases,
        )
        for label, x, k, p in MASK_CASES
    ]
    checks += [
        Check(
            f"seed {seed}: 200 random rows (vocabularies of 1 to 200, some -inf), the kept positions and values "
            "yours and the package's",
            lambda seed=seed: _mask_twin(apply_top_k_top_p, seed),
            "same",
            hint="the first row that differs is named: work it by hand with the rule",
        )
        for seed in (1, 2, 3)
    ]
    checks.append(
        Check(
            "apply_top_k_top_p leaves its input as it was",
            lambda: _leaves_input(apply_top_k_top_p),
            "unchanged",
            hint="masked_fill (not masked_fill_), or work on a clone: the caller's logits are not yours to change",
        )
    )
    return report("mask", checks)


# ---- streams ---------------------------------------------------------------------------------------------------
VOCAB, STEPS = 40, 12
SEEDED: list[tuple[str, SamplingParams]] = [
    ("a", SamplingParams(temperature=0.9, top_k=10, seed=11)),
    ("b", SamplingParams(temperature=1.2, top_p=0.9, seed=12)),
    ("c", SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=13)),
]
FILLERS: list[tuple[str, SamplingParams]] = [
    ("u1", SamplingParams(temperature=1.0)),
    ("u2", SamplingParams(temperature=0.5, top_k=5)),
    ("g", SamplingParams(temperature=0)),
    ("g-seeded", SamplingParams(temperature=0, seed=3)),
]


def _alone(make: SamplerClass, names: Sequence[str] = ("a", "b", "c"), steps: int = STEPS) -> dict[str, list[int]]:
    """Each seeded request drawn alone, one row a call, all in one sampler."""
    sampler, params = make(), dict(SEEDED)
    return {n: [_draw(sampler, _row(n, t, VOCAB)[None], [n], [params[n]])[0] for t in range(steps)] for n in names}


def _batched(make: SamplerClass, order_seed: int) -> dict[str, list[int]]:
    """The seeded requests in every step, among a changing set of other rows, in a shuffled order."""
    rng, sampler = random.Random(order_seed), make()
    out: dict[str, list[int]] = {n: [] for n, _ in SEEDED + FILLERS}
    with torch.random.fork_rng(devices=[]):  # the unseeded rows draw from the global generator: leave it as it was
        torch.manual_seed(order_seed)
        for t in range(STEPS):
            rows = SEEDED + rng.sample(FILLERS, rng.randint(0, len(FILLERS)))
            rng.shuffle(rows)
            logits = torch.stack([_row(n, t, VOCAB) for n, _ in rows])
            for (n, _), token in zip(rows, _draw(sampler, logits, [n for n, _ in rows], [p for _, p in rows])):
                out[n].append(token)
    return out


def _differ(got: dict[str, list[int]], want: dict[str, list[int]], what: str) -> str:
    for name in ("a", "b", "c"):
        if got[name] != want[name]:
            return f"request {name!r}: {got[name]}, where {what} gives {want[name]}"
    return "same"


def _greedy(make: SamplerClass) -> Any:
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, top_k=1, top_p=0.1),
              SamplingParams(temperature=0, seed=5), SamplingParams(temperature=0, top_k=3)]  # fmt: skip
    logits = torch.stack([_row("greedy", i, VOCAB) for i in range(len(params))])
    tokens = make()(logits, ["g0", "g1", "g2", "g3"], params)
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        return f"{tokens!r}: expected a list of Python ints (int(tensor) or .tolist())"
    return tokens


def _forget(make: SamplerClass) -> str:
    """Rows a and b for 6 steps; forget a (and a key never seen); a again from step 0, b on from step 6."""
    sampler, params = make(), dict(SEEDED)
    first: list[int] = []
    b_tokens: list[int] = []
    for t in range(6):
        logits = torch.stack([_row("a", t, VOCAB), _row("b", t, VOCAB)])
        ta, tb = _draw(sampler, logits, ["a", "b"], [params["a"], params["b"]])
        first.append(ta)
        b_tokens.append(tb)
    sampler.forget("a")
    sampler.forget("never-seen")
    again: list[int] = []
    for t in range(6):
        logits = torch.stack([_row("a", t, VOCAB), _row("b", t + 6, VOCAB)])
        ta, tb = _draw(sampler, logits, ["a", "b"], [params["a"], params["b"]])
        again.append(ta)
        b_tokens.append(tb)
    if again != first:
        return f"after forget('a'), a drew {again}: its first six draws were {first}"
    b_alone = _alone(make, ["b"])["b"]
    if b_tokens != b_alone:
        return f"b drew {b_tokens} beside a, forgotten half way; alone it draws {b_alone}: forget touched b's stream"
    return "a starts again, b goes on"


def _advances(make: SamplerClass) -> Any:
    """One seeded key, the same nearly uniform logits 20 times: how many different tokens it drew."""
    flat = torch.linspace(0.0, 0.5, 50)[None]
    sampler = make()
    return len({_draw(sampler, flat, ["s"], [SamplingParams(seed=1)])[0] for _ in range(20)}) > 1


def _two_seeds(make: SamplerClass) -> Any:
    flat = torch.linspace(0.0, 0.5, 50)  # nearly uniform over 50 tokens: two streams cannot agree by chance
    p1, p2 = SamplingParams(seed=1), SamplingParams(seed=2)
    sampler = make()
    pairs = [_draw(sampler, torch.stack([flat, flat]), ["s1", "s2"], [p1, p2]) for _ in range(20)]
    return [x for x, _ in pairs] != [y for _, y in pairs]


def _unseeded(make: SamplerClass) -> dict[str, list[int]]:
    """Two unseeded rows around a seeded one, 8 steps after torch.manual_seed(5): the unseeded rows' tokens."""
    out: dict[str, list[int]]
    rows = [("u1", SamplingParams(temperature=1.0)), ("a", dict(SEEDED)["a"]), ("u2", SamplingParams(top_k=8))]
    sampler, out = make(), {"u1": [], "u2": []}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        for t in range(8):
            logits = torch.stack([_row(n, t, VOCAB) for n, _ in rows])
            tokens = _draw(sampler, logits, [n for n, _ in rows], [p for _, p in rows])
            out["u1"].append(tokens[0])
            out["u2"].append(tokens[2])
    return out


def _masked_vocab(make: SamplerClass) -> Any:
    row = _row("masked", 0, VOCAB)
    row[::2] = -INF  # every even token is out of the vocabulary
    params = [SamplingParams(seed=4), SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0)]
    sampler, drawn = make(), set()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(6)
        for _ in range(20):
            drawn.update(_draw(sampler, torch.stack([row, row, row]), ["m0", "m1", "m2"], params))
    bad = sorted(t for t in drawn if t % 2 == 0)
    return f"drew the -inf tokens {bad}" if bad else "sampled, only finite tokens"


def _refuses(make: SamplerClass, bad_row: torch.Tensor, bad: SamplingParams) -> str:
    """A batch whose second row (key 'bad-row') cannot be sampled: a ValueError that names the key."""
    logits = torch.stack([_row("a", 0, VOCAB), bad_row])
    try:
        with torch.random.fork_rng(devices=[]):
            tokens = make()(logits, ["fine-row", "bad-row"], [dict(SEEDED)["a"], bad])
    except ValueError as exc:
        return "ValueError naming 'bad-row'" if "bad-row" in str(exc) else f"ValueError without the key: {exc}"
    return f"no error: tokens {tokens!r}"


def _leaves_logits(make: SamplerClass) -> str:
    rows = SEEDED + FILLERS
    logits = torch.stack([_row(n, 0, VOCAB) for n, _ in rows])
    given = logits.clone()
    with torch.random.fork_rng(devices=[]):
        _draw(make(), given, [n for n, _ in rows], [p for _, p in rows])
    return "unchanged" if torch.equal(given, logits) else "the logits you were given changed"


def check_streams(Sampler: SamplerClass) -> list[CheckOutcome]:
    """Greedy rows, seeded streams by their properties and against the package's, unseeded rows, bad rows."""
    hint_streams = "a stream belongs to the request's key, made at its first draw from its own seed and kept"
    nan_row = _row("nan", 0, VOCAB)
    nan_row[7] = float("nan")
    inf_row = _row("inf", 0, VOCAB)
    inf_row[3] = INF
    return _report_keeping_rng(
        "streams",
        [
            Check("greedy rows (temperature 0, whatever top_k, top_p and seed) take the argmax, as Python ints",
                  lambda: _greedy(Sampler),
                  torch.stack([_row("greedy", i, VOCAB) for i in range(4)]).argmax(-1).tolist(),
                  hint="no temperature, mask or draw for a greedy row: its argmax"),
            Check("a row with -inf logits (a masked vocabulary) is sampled, and never gives a -inf token",
                  lambda: _masked_vocab(Sampler), "sampled, only finite tokens",
                  hint="only a row whose largest logit is not finite is refused; -inf elsewhere is a masked token"),
            Check(f"three seeded requests, {STEPS} steps: the same tokens alone as among other rows, shuffled",
                  lambda: _differ(_batched(Sampler, 1), _alone(Sampler), "drawing it alone"), "same",
                  hint=hint_streams + ": a stream must not depend on the rows around it or its row number"),
            Check("a fresh Sampler gives the same tokens again",
                  lambda: _differ(_batched(Sampler, 2), _batched(Sampler, 2), "a second fresh Sampler"), "same",
                  hint="keep the generators in the instance (self), not in the class or the module"),
            Check("forget(key) starts that key's stream again from its seed, and leaves the others' alone",
                  lambda: _forget(Sampler), "a starts again, b goes on",
                  hint="forget drops the key's generator; the next draw makes a new one from params.seed"),
            Check("a stream advances: one seeded key, the same nearly uniform logits 20 times, not one token 20 times",
                  lambda: _advances(Sampler), True,
                  hint="make the key's generator once and keep it: each draw moves it on"),
            Check("two seed values, the same nearly uniform logits, 20 draws: different tokens",
                  lambda: _two_seeds(Sampler), True, hint="each key's generator is seeded with its own params.seed"),
            Check("the package's Sampler, same seed values and rows: the same tokens (the draw the spec pins)",
                  lambda: _differ(_batched(Sampler, 3), _batched(PackageSampler, 3), "the package's Sampler"),
                  "same",
                  hint="the spec pins the draw (Sampler, step 3, and 'Why the draw is pinned'): the same "
                       "probabilities, the same call, the key's generator; nothing else may draw from it"),
            Check("unseeded rows draw from torch's global generator: after torch.manual_seed(5), the package's tokens",
                  lambda: _unseeded(Sampler), _unseeded(PackageSampler),
                  hint="generator=None for a row without a seed, drawn in row order; draw nothing else globally"),
            Check("a NaN in a sampled row: ValueError naming its key",
                  lambda: _refuses(Sampler, nan_row, SamplingParams(seed=1)), "ValueError naming 'bad-row'",
                  hint="test the row's largest logit: max() is NaN when any logit is"),
            Check("a +inf in a greedy row: ValueError naming its key",
                  lambda: _refuses(Sampler, inf_row, SamplingParams(temperature=0)), "ValueError naming 'bad-row'",
                  hint="greedy rows too: an argmax of +inf means the model failed, not that it is sure"),
            Check("a row of nothing but -inf: ValueError naming its key",
                  lambda: _refuses(Sampler, torch.full((VOCAB,), -INF), SamplingParams(temperature=0.7)),
                  "ValueError naming 'bad-row'", hint="a row with no finite logit has nothing to draw from"),
            Check("the logits it was given are left as they were",
                  lambda: _leaves_logits(Sampler), "unchanged",
                  hint="divide into a new tensor (row / t, not row /= t) and mask with a function that returns one"),
        ],
    )  # fmt: skip


# ---- distribution ----------------------------------------------------------------------------------------------
# Ten tokens, ranked apart from their positions; softmax at temperature 1: 0.31 0.19 0.14 0.11 0.08 ...
DIST_ROW = torch.tensor([0.6, 2.0, -1.0, 1.0, 0.0, 1.5, -2.0, 0.3, 1.2, -0.5])
DIST_SETTINGS: list[tuple[str, SamplingParams]] = [
    ("temperature 0.5", SamplingParams(temperature=0.5)),
    ("temperature 2.0, top_k 4", SamplingParams(temperature=2.0, top_k=4)),
    ("temperature 0.6, top_p 0.8", SamplingParams(temperature=0.6, top_p=0.8)),
    ("temperature 1.5, top_k 6, top_p 0.7", SamplingParams(temperature=1.5, top_k=6, top_p=0.7)),
]
DIST_KEYS, DIST_STEPS = 2000, 4  # 8,000 draws a setting: 2,000 seeded streams, 4 draws each
# Total variation distance allowed. Over 8,000 draws a right sampler's distance is 0.006 to 0.009 on average,
# whatever its random numbers (standard deviation 0.003; 0.028 the worst of 20,000 simulated runs per setting):
# 0.05 is twelve standard deviations away. A wrong temperature (multiplied, left out, after the mask) moves the
# distribution by 0.085 to 0.39.
TV_TOL = 0.05


def target_probs(params: SamplingParams) -> list[float]:
    """What a sampled row of ``DIST_ROW`` must follow: the softmax of the package's mask at the temperature."""
    return package_mask(DIST_ROW / params.temperature, params.top_k, params.top_p).softmax(-1).tolist()


def _counts(make: SamplerClass, index: int, params: SamplingParams) -> list[int]:
    keys = [f"d{index}-{i}" for i in range(DIST_KEYS)]
    seeded = [dataclasses.replace(params, seed=100_000 * (index + 1) + i) for i in range(DIST_KEYS)]
    sampler, counts = make(), [0] * len(DIST_ROW)
    logits = DIST_ROW.repeat(DIST_KEYS, 1)
    for _ in range(DIST_STEPS):
        for t in _draw(sampler, logits, keys, seeded):
            counts[t] += 1
    return counts


def check_distribution(Sampler: SamplerClass) -> list[CheckOutcome]:
    """Per setting: the support, then the frequencies against the masked softmax at that temperature."""
    cache: dict[int, Any] = {}

    def counts(i: int) -> Any:
        if i not in cache:
            try:
                cache[i] = _counts(Sampler, i, DIST_SETTINGS[i][1])
            except Exception as exc:  # a learner's error is an answer, for both checks of the setting
                cache[i] = describe_error(exc)
        return cache[i]

    def support(i: int) -> str:
        c = counts(i)
        if isinstance(c, str):
            return c
        probs = target_probs(DIST_SETTINGS[i][1])
        outside = {t: n for t, n in enumerate(c) if n and probs[t] == 0}
        return f"drew masked tokens (token: times) {outside}" if outside else "never outside"

    def frequencies(i: int) -> str:
        c = counts(i)
        if isinstance(c, str):
            return c
        probs, n = target_probs(DIST_SETTINGS[i][1]), sum(c)
        tv = 0.5 * sum(abs(k / n - p) for k, p in zip(c, probs))
        if tv <= TV_TOL:
            return f"within {TV_TOL}"
        freq = [round(k / n, 3) for k in c]
        return f"frequencies {freq} where the masked softmax gives {[round(p, 3) for p in probs]}: distance {tv:.3f}"

    checks = []
    for i, (label, params) in enumerate(DIST_SETTINGS):
        kept = [t for t, p in enumerate(target_probs(params)) if p > 0]
        checks.append(
            Check(
                f"{label}, {DIST_KEYS * DIST_STEPS} seeded draws: only the tokens the mask keeps {kept}",
                lambda i=i: support(i),
                "never outside",
                hint="temperature first, then the mask: top-p is measured on the tempered distribution",
            )
        )
        checks.append(
            Check(
                f"{label}: the frequencies are the softmax of the masked logits / temperature, within a "
                f"total variation distance of {TV_TOL}",
                lambda i=i: frequencies(i),
                f"within {TV_TOL}",
                hint="divide by the temperature (do not multiply), mask, then softmax: probs sum to 1",
            )
        )
    return _report_keeping_rng("distribution", checks)


# ---- sample_smollm2 --------------------------------------------------------------------------------------------
SYS_REQUESTS: list[tuple[str, str, SamplingParams]] = [
    ("poem", "Write one line of a poem about the sea.", SamplingParams(temperature=0.8, top_p=0.95, seed=0)),
    ("colour", "Describe your favourite colour.", SamplingParams(temperature=1.0, top_k=20, seed=7)),
    ("france", "What is the capital of France?", SamplingParams(temperature=0)),
]
SYS_TOKENS = 12
_HF: dict[str, Any] = {}


def _smollm2() -> tuple[Any, list[list[int]]]:
    if "model" not in _HF:
        from ...model_loader import chat_prompt_ids, load_hf_model, load_tokenizer

        tokenizer = load_tokenizer()
        _HF.update(model=load_hf_model(), ids=[chat_prompt_ids(tokenizer, text) for _, text, _ in SYS_REQUESTS])
    return _HF["model"], _HF["ids"]


@torch.inference_mode()
def sampled_generate(
    model: Any, prompts: list[list[int]], keys: list[str], params: list[SamplingParams], sampler: Any, steps: int
) -> list[list[int]]:
    """Each request its own transformers KV cache; each step one ``sampler`` call over all requests' last rows."""
    last, caches = [], []
    for ids in prompts:
        out = model(torch.tensor([ids]), use_cache=True)
        last.append(out.logits[0, -1].float())
        caches.append(out.past_key_values)
    tokens: list[list[int]] = [[] for _ in prompts]
    for step in range(steps):
        for i, t in enumerate(_draw(sampler, torch.stack(last), keys, params)):
            tokens[i].append(t)
            if step + 1 < steps:  # the last step's tokens need no forward pass
                out = model(torch.tensor([[t]]), past_key_values=caches[i], use_cache=True)
                last[i], caches[i] = out.logits[0, -1].float(), out.past_key_values
    return tokens


def package_tokens() -> list[list[int]]:
    """The package's ``Sampler`` in the loop: what the learner's must give for the same ``seed`` values."""
    if "package" not in _HF:
        model, ids = _smollm2()
        keys, params = [k for k, _, _ in SYS_REQUESTS], [p for _, _, p in SYS_REQUESTS]
        _HF["package"] = sampled_generate(model, ids, keys, params, PackageSampler(), SYS_TOKENS)
    return _HF["package"]


def check_sample_smollm2(Sampler: SamplerClass) -> list[CheckOutcome]:
    """SmolLM2 sampling three requests in one batch with the learner's Sampler, then the first one alone."""
    cache: dict[str, Any] = {}
    keys, params = [k for k, _, _ in SYS_REQUESTS], [p for _, _, p in SYS_REQUESTS]

    def batch() -> Any:
        if "batch" not in cache:
            model, ids = _smollm2()
            try:
                cache["batch"] = sampled_generate(model, ids, keys, params, Sampler(), SYS_TOKENS)
            except Exception as exc:  # once: the second check reports the same error without a second run
                cache["batch"] = exc
        if isinstance(cache["batch"], Exception):
            raise cache["batch"]
        return cache["batch"]

    def alone() -> Any:
        model, ids = _smollm2()
        (tokens,) = sampled_generate(model, ids[:1], keys[:1], params[:1], Sampler(), SYS_TOKENS)
        together = batch()[0]
        return "the batch's tokens" if tokens == together else f"{tokens}, where in the batch it drew {together}"

    described = "; ".join(
        f"{k}: " + ("greedy" if p.greedy else f"temperature {p.temperature}, top_k {p.top_k}, top_p {p.top_p}, "
                    f"seed {p.seed}") for k, _, p in SYS_REQUESTS
    )  # fmt: skip
    return _report_keeping_rng(
        "sample_smollm2",
        [
            Check(f"SmolLM2, three chat requests sampled in one batch ({described}), {SYS_TOKENS} tokens each: "
                  "your Sampler's tokens", batch, package_tokens(),
                  hint="the package's Sampler drew these tokens for the same seed values: the streams group names what "
                  "differs"),
            Check(f"the first request alone, with a fresh Sampler: the {SYS_TOKENS} tokens it drew in the batch",
                  alone, "the batch's tokens",
                  hint="a seeded request's stream must not depend on the other rows of the batch"),
        ],
    )  # fmt: skip
