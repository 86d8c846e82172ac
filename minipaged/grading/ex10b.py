"""Exercise 10b, the open capstone: a scheduling policy of your own, in the real engine.

A policy is up to three functions, plugged in through ``minipaged.parts`` (any left out keeps the package's
rule, vLLM's default)::

    admission_order(waiting) -> [request_id]    the order waiting requests are tried in      (first come, first served)
    preemption_order(running) -> [request_id]   the order running requests give way in       (the newest first)
    prefill_cap(request) -> int                 the most prompt tokens it takes in one step  (no cap but the budget)

The scheduler asks them once a step, before it changes anything, and keeps everything else (allocation, the
token budget, the seats); every answer is checked as it returns. So a policy can make serving slower or faster
but never wrong: the greedy tokens stay the package's, which the report card proves on SmolLM2. It then scores the policy against the package's own on
one fixed workload, on the simulator (600 ShareGPT-like requests arriving over time, a Llama-3-8B on an H100,
a pool that preemption has to make room in) and on the real engine (SmolLM2, 10 prompts at once, a 19-block
pool), by throughput, p99 time to first token and preemptions. ``leaderboard(folder)`` ranks every policy file
in a folder (``exercises/policies/`` holds three examples) by the same numbers.

The score: the geometric mean of two ratios against first come, first served on the simulator, throughput
(yours ÷ FCFS) and p99 TTFT (FCFS ÷ yours); above 1 is better than the package on both counts combined.
"""

from __future__ import annotations

import importlib.util
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import parts
from .core import Check, CheckOutcome, report

POLICY_PARTS = ("admission_order", "preemption_order", "prefill_cap")
Policy = Mapping[str, Callable[..., Any]]
FCFS: dict[str, Callable[..., Any]] = {}  # the package's own rules: nothing plugged in


def policy_parts(policy: Any) -> dict[str, Callable[..., Any]]:
    """A policy as a dict of its functions: from a dict, or from a module / namespace defining any of
    ``admission_order``, ``preemption_order``, ``prefill_cap``."""
    if isinstance(policy, Mapping):
        unknown = sorted(set(policy) - set(POLICY_PARTS))
        if unknown:
            raise ValueError(f"unknown policy function(s) {unknown}; a policy defines some of {list(POLICY_PARTS)}")
        return {k: v for k, v in policy.items() if v is not None}
    return {k: getattr(policy, k) for k in POLICY_PARTS if callable(getattr(policy, k, None))}


def _plug(policy: Any) -> dict[str, Any]:
    return dict(policy_parts(policy))


# ---- the simulator's workload ---------------------------------------------------------------------------
SIM_REQUESTS, SIM_SEED, SIM_RATE, SIM_BLOCKS = 600, 11, 0.5, 1201


def _sim_setup() -> tuple[Any, Any, Any]:
    from ..simulator import CostModel, SimConfig, requests_from_trace
    from ..workloads import sharegpt_like_trace

    trace = requests_from_trace(sharegpt_like_trace(SIM_REQUESTS, seed=SIM_SEED, arrival_rate=SIM_RATE), 0.01)
    cost = CostModel.for_model("llama-3-8b", "h100", step_overhead=0.002)
    config = SimConfig(num_gpu_blocks_override=SIM_BLOCKS, max_num_batched_tokens=2048, max_num_seqs=128)
    return trace, cost, config


@dataclass
class Run:
    """One policy on one workload."""

    throughput: float = 0.0  # output tokens per second (the simulator) or per step (the engine)
    ttft_p99: float = 0.0  # seconds (the simulator) or steps (the engine)
    preemptions: int = 0
    finished: int = 0
    tokens: list[list[int]] = field(default_factory=list)  # the engine's greedy tokens, per request
    decisions: list[tuple[float, str, str]] = field(default_factory=list)  # the simulator's events
    wall_s: float = 0.0
    error: str | None = None


def simulate(policy: Policy) -> Run:
    """The policy on the simulator's workload: the real scheduler, a cost model for the clock."""
    from ..simulator import simulate_continuous

    trace, cost, config = _sim_setup()
    start = time.perf_counter()
    try:
        with parts.use(True, **_plug(policy)):
            res = simulate_continuous(trace, cost, config, record_events=True)
    except Exception as exc:  # a PartError names the function and the call; anything else, in words
        return Run(error=f"{type(exc).__name__}: {exc}"[:600])
    s = res.summary()
    return Run(
        throughput=s["throughput_tok_s"],
        ttft_p99=s["ttft_p99_s"],
        preemptions=int(s["preemptions"]),
        finished=int(s["requests"]),
        decisions=res.events,
        wall_s=time.perf_counter() - start,
    )


# ---- the real engine's workload -------------------------------------------------------------------------
ENGINE_LENGTHS = (24, 90, 40, 150, 30, 70, 20, 110, 50, 35)  # prompt tokens: 619 in all, for a 304-token pool
ENGINE_BLOCKS = 20  # 19 usable blocks of 16: 304 tokens
ENGINE_SETTINGS: dict[str, Any] = dict(
    block_size=16,
    num_gpu_blocks_override=ENGINE_BLOCKS,
    max_num_batched_tokens=64,
    max_num_seqs=8,
    enable_prefix_caching=True,
    dtype="float32",
    max_model_len=256,
)
ENGINE_MAX_TOKENS = 10


def engine_prompts() -> list[list[int]]:
    import random

    rng = random.Random(10)
    return [[rng.randrange(100, 40_000) for _ in range(n)] for n in ENGINE_LENGTHS]


def engine() -> Any:
    """SmolLM2 with the workload's small pool (built once per call: the report card reuses it)."""
    from ..engine import LLM

    return LLM(**ENGINE_SETTINGS)


def serve(policy: Policy, llm: Any = None) -> Run:
    """The policy on the engine: all prompts at once, stepped here so time to first token is counted in steps
    (deterministic, unlike the wall clock)."""
    from ..sampling_params import SamplingParams

    llm = llm or engine()
    llm.reset()
    params = SamplingParams(max_tokens=ENGINE_MAX_TOKENS, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    first: dict[str, int] = {}
    try:
        with parts.use(True, **_plug(policy)):
            ids = [llm.add_request(p, params) for p in engine_prompts()]
            steps, done = 0, set[str]()
            while len(done) < len(ids) and steps < 2000:
                done.update(llm.step())
                steps += 1
                for rid in ids:
                    if rid not in first and llm.get_output(rid).outputs[0].token_ids:
                        first[rid] = steps
            outs = [llm.get_output(rid) for rid in ids]
    except Exception as exc:
        llm.reset()
        return Run(error=f"{type(exc).__name__}: {exc}"[:600])
    from ..serving.load import percentile

    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return Run(
        throughput=sum(map(len, tokens)) / steps,
        ttft_p99=float(percentile([float(first[r]) for r in ids if r in first], 99) or 0.0),
        preemptions=llm.scheduler.num_preemptions,
        finished=sum(o.finished for o in outs),
        tokens=tokens,
        wall_s=time.perf_counter() - start,
    )


_BASELINE: dict[str, Run] = {}


def baseline_sim() -> Run:
    """First come, first served on the simulator: computed once per process (the workload is fixed and seeded)."""
    if "sim" not in _BASELINE:
        _BASELINE["sim"] = simulate(FCFS)
    return _BASELINE["sim"]


def baseline_serve(llm: Any) -> Run:
    """First come, first served on the engine's workload, once per process (greedy and stepped: deterministic)."""
    if "eng" not in _BASELINE:
        _BASELINE["eng"] = serve(FCFS, llm)
    return _BASELINE["eng"]


def score(run: Run, base: Run) -> float:
    """Geometric mean of throughput (yours ÷ base) and p99 TTFT (base ÷ yours): 1.0 is the base's."""
    if run.error or not run.throughput or not run.ttft_p99:
        return 0.0
    return math.sqrt(run.throughput / base.throughput * base.ttft_p99 / run.ttft_p99)


# ---- the report card ------------------------------------------------------------------------------------
@dataclass
class ReportCard:
    name: str
    sim: Run
    sim_base: Run
    eng: Run
    eng_base: Run

    @property
    def exact(self) -> bool:
        return not self.eng.error and self.eng.tokens == self.eng_base.tokens

    def __str__(self) -> str:
        def row(label: str, r: Run, unit_tp: str, unit_ttft: str) -> str:
            if r.error:
                return f"  {label:<28} failed: {r.error}"
            return (
                f"  {label:<28} {r.throughput:>9.1f} {unit_tp:<10} p99 TTFT {r.ttft_p99:>7.2f} {unit_ttft:<6} "
                f"{r.preemptions:>4} preemptions  {r.finished} finished"
            )

        lines = [
            f"Report card: {self.name}",
            f"simulator ({SIM_REQUESTS} ShareGPT-like requests, Llama-3-8B on an H100, {SIM_BLOCKS - 1} blocks):",
            row("first come, first served", self.sim_base, "tok/s", "s"),
            row(self.name, self.sim, "tok/s", "s"),
            f"engine (SmolLM2, {len(ENGINE_LENGTHS)} prompts at once, {ENGINE_BLOCKS - 1} blocks of 16):",
            row("first come, first served", self.eng_base, "tok/step", "steps"),
            row(self.name, self.eng, "tok/step", "steps"),
            f"token for token the package's greedy output: {'yes' if self.exact else 'NO'}",
            f"score (simulator, vs first come first served): {score(self.sim, self.sim_base):.3f}",
        ]
        return "\n".join(lines)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


def report_card(policy: Policy, name: str = "your policy", llm: Any = None) -> ReportCard:
    llm = llm or engine()
    return ReportCard(name, simulate(policy), baseline_sim(), serve(policy, llm), baseline_serve(llm))


# ---- the leaderboard ------------------------------------------------------------------------------------
def load_policy(path: str | Path) -> dict[str, Callable[..., Any]]:
    """The policy a ``.py`` file defines (any of the three functions)."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(f"policy_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found = policy_parts(module)
    if not found:
        raise ValueError(f"{path.name} defines none of {', '.join(POLICY_PARTS)}")
    return found


@dataclass
class Entry:
    name: str
    sim: Run
    eng: Run | None
    exact: bool | None
    score: float
    doc: str = ""


@dataclass
class Leaderboard:
    entries: list[Entry]  # best first

    def __str__(self) -> str:
        head = f"{'#':>2}  {'policy':<26}{'score':>7}{'tok/s':>8}{'p99 TTFT':>10}{'preempt':>9}  engine"
        lines = [head]
        for i, e in enumerate(self.entries, 1):
            if e.sim.error:
                lines.append(f"{i:>2}  {e.name:<26} failed: {e.sim.error[:80]}")
                continue
            eng = "not run" if e.exact is None else ("token-exact" if e.exact else "NOT token-exact")
            lines.append(
                f"{i:>2}  {e.name:<26}{e.score:>7.3f}{e.sim.throughput:>8.0f}{e.sim.ttft_p99:>9.2f}s"
                f"{e.sim.preemptions:>9}  {eng}"
            )
        return "\n".join(lines)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


def leaderboard(
    folder: str | Path, extra: Mapping[str, Policy] | None = None, with_engine: bool = True, llm: Any = None
) -> Leaderboard:
    """Every policy file in ``folder`` (and ``extra``, e.g. yours), with first come first served, ranked by
    score on the simulator; each is also run on the engine and marked token-exact or not (``with_engine``).
    A file that fails to load or to serve is listed last, with its error."""
    policies: dict[str, Any] = {"first come, first served": FCFS}
    for path in sorted(Path(folder).glob("*.py")):
        try:
            policies[path.stem] = load_policy(path)
        except Exception as exc:
            policies[path.stem] = exc
    policies.update(extra or {})
    base = baseline_sim()
    llm = (llm or engine()) if with_engine else None
    eng_base = baseline_serve(llm) if llm is not None else None
    entries = []
    for name, policy in policies.items():
        if isinstance(policy, Exception):
            entries.append(Entry(name, Run(error=f"{type(policy).__name__}: {policy}"), None, None, 0.0))
            continue
        sim = base if policy is FCFS else simulate(policy)
        eng = None if llm is None else (eng_base if policy is FCFS else serve(policy, llm))
        exact = None if eng is None or eng_base is None else (not eng.error and eng.tokens == eng_base.tokens)
        entries.append(Entry(name, sim, eng, exact, score(sim, base) if exact is not False else 0.0))
    entries.sort(key=lambda e: (e.sim.error is not None, -e.score))
    return Leaderboard(entries)


# ---- the graded checks ------------------------------------------------------------------------------------
def check_policy(my_policy: Callable[[], Policy]) -> list[CheckOutcome]:
    """``my_policy() -> {name: function}``: it plugs in, serves both workloads to the end, decides differently
    from first come first served, and the engine's tokens stay the package's."""
    hint = (
        "each function must answer as its signature says (a permutation of the waiting ids; a permutation of the "
        "running ids; a cap of at least 1 token); the error names the function and the call"
    )
    cache: dict[str, Any] = {}

    def got() -> dict[str, Callable[..., Any]]:
        if "policy" not in cache:
            cache["policy"] = policy_parts(my_policy())
            with parts.use(True, **_plug(cache["policy"])):  # the signatures, checked by parts.use
                pass
        return cache["policy"]

    def sim() -> Run:
        if "sim" not in cache:
            cache["sim"] = simulate(got())
        return cache["sim"]

    def eng() -> Run:
        if "eng" not in cache:
            llm = engine()
            cache["eng"], cache["eng_base"] = serve(got(), llm), baseline_serve(llm)
        return cache["eng"]

    def differs() -> bool:
        run = sim()
        return run.error is None and run.decisions != baseline_sim().decisions

    checks = [
        Check(
            "my_policy()  # it defines some of admission_order, preemption_order, prefill_cap",
            lambda: sorted(got()) and True,
            True,
            hint="return a dict with at least one of the three functions, each taking the arguments shown",
        ),
        Check(
            f"the simulator's workload ({SIM_REQUESTS} requests) with your policy; then (error, requests finished)",
            lambda: (sim().error, sim().finished),
            (None, SIM_REQUESTS),
            hint=hint,
        ),
        Check(
            "your policy decides differently from first come, first served somewhere in that workload",
            differs,
            True,
            hint="an open task: change an order, the victims or a cap, and see what it does to the numbers",
        ),
        Check(
            f"SmolLM2 serves {len(ENGINE_LENGTHS)} prompts with your policy; then (error, finished)",
            lambda: (eng().error, eng().finished),
            (None, len(ENGINE_LENGTHS)),
            hint=hint,
        ),
        Check(
            "…token for token what the engine serves with the package's policy",
            lambda: eng().error is None and eng().tokens == cache["eng_base"].tokens,
            True,
            hint="a policy only reorders work: if tokens differ, an answer let the step go wrong (report it!)",
        ),
    ]
    return report("policy", checks)
