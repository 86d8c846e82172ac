"""Exercise 10b, the open capstone: a scheduling policy of your own, in the real engine.

A policy is up to three functions, plugged in through ``minipaged.classroom.parts`` (any left out keeps the package's
rule, vLLM's default)::

    admission_order(waiting) -> [request_id]    the order waiting requests are tried in      (first come, first served)
    preemption_order(running) -> [request_id]   the order running requests give way in       (the newest first)
    prefill_cap(request) -> int                 the most prompt tokens it takes in one step  (no cap but the budget)

The scheduler asks them once a step, before it changes anything, and keeps everything else (allocation, the
token budget, the seats); every answer is checked as it returns. A policy is shown read-only copies of the
requests (``minipaged.classroom.policy.RequestView``: request_id, num_prompt_tokens, num_tokens, num_computed_tokens,
arrival_time, num_preemptions, sampling_params.max_tokens) and answers within ``policy.POLICY_STEP_S`` seconds
a step and ``SIM_POLICY_S`` / ``ENGINE_POLICY_S`` a run, or it is stopped and named. So a policy can make serving
slower or faster but never wrong: the greedy tokens stay the package's, which the report card proves on
SmolLM2. It then runs the policy beside the package's own on two fixed workloads: on the simulator, a burst of
400 requests in about ten seconds to a Llama-3-8B on an H100, more than it can serve as they come (85 % chat
turns of 64-400 prompt tokens, 15 % documents of 1,500-3,500), and on the real engine (SmolLM2, 10 prompts at
once, a 19-block pool). ``leaderboard(folder)`` ranks every policy file in a folder (``exercises/policies/``
holds three examples).

The score is **SLO attainment** on the simulator (DistServe's goodput, as a share): the fraction of the 400
requests whose first token came within 0.5 s plus 1 ms per prompt token of arriving and whose output tokens came
at most 50 ms apart on average. A policy must also keep the throughput at least 90 % of first come, first
served's (the floor), or it scores 0: serving fewer tokens to meet more deadlines is not a better policy.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ... import hooks
from .. import parts
from ..policy import POLICY_PARTS, policy_time_limit
from .core import Check, CheckOutcome, report

Policy = Mapping[str, Callable[..., Any]]
FCFS: dict[str, Callable[..., Any]] = {}  # the package's own rules: nothing plugged in
BASELINE_NAME = "first come, first served"


def policy_parts(policy: Any) -> dict[str, Callable[..., Any]]:
    """A policy as a dict of its functions: from a dict (``{}`` is first come first served), or from a module /
    namespace defining any of ``admission_order``, ``preemption_order``, ``prefill_cap``."""
    if isinstance(policy, Mapping):
        unknown = sorted(set(policy) - set(POLICY_PARTS), key=repr)
        if unknown:
            raise ValueError(f"unknown policy function(s) {unknown}; a policy defines some of {list(POLICY_PARTS)}")
        for k, v in policy.items():
            if v is not None and not callable(v):
                raise TypeError(f"policy[{k!r}] must be a function, got {type(v).__name__}")
        return {k: v for k, v in policy.items() if v is not None}
    found = {k: getattr(policy, k) for k in POLICY_PARTS if callable(getattr(policy, k, None))}
    if not found:
        raise TypeError(
            f"policy must be a dict of functions or a module defining some of {', '.join(POLICY_PARTS)}; "
            f"got {type(policy).__name__} {policy!r:.60}"
        )
    return found


def _plug(policy: Any) -> dict[str, Any]:
    return dict(policy_parts(policy))


# ---- the simulator's workload ---------------------------------------------------------------------------
SIM_REQUESTS, SIM_SEED, SIM_RATE, SIM_BLOCKS = 400, 1, 0.4, 1201  # arrivals per 10 ms step: 40 a second
SIM_LONG_SHARE = 0.15  # documents among the requests; the rest are chat turns (workloads.bimodal_lengths)
SLO_TTFT_S, SLO_TTFT_PER_TOKEN_S, SLO_TPOT_S = 0.5, 0.001, 0.05
THROUGHPUT_FLOOR = 0.9  # of first come, first served's, or the score is 0
# The most seconds a policy's answers may take in one run, in all (each step's: policy.POLICY_STEP_S): the
# examples take about a second of the simulator's ~5,000 steps, and a tenth of that on the engine's ~100.
SIM_POLICY_S, ENGINE_POLICY_S = 60.0, 20.0
LOAD_S = 10.0  # the most seconds a policy file may take to import


def _sim_setup() -> tuple[Any, Any, Any]:
    import numpy as np

    from ...lab.simulator import CostModel, SimConfig, requests_from_trace
    from ...lab.workloads import bimodal_lengths, make_trace

    rng = np.random.default_rng(SIM_SEED)
    prompts, outputs = bimodal_lengths(SIM_REQUESTS, rng, SIM_LONG_SHARE)
    trace = requests_from_trace(make_trace(prompts, outputs, SIM_RATE, rng), 0.01)
    cost = CostModel.for_model("llama-3-8b", "h100", step_overhead=0.002)
    config = SimConfig(
        num_gpu_blocks_override=SIM_BLOCKS, max_num_batched_tokens=2048, max_num_seqs=128, max_model_len=4096
    )
    return trace, cost, config


@dataclass
class Run:
    """One policy on one workload."""

    throughput: float = 0.0  # output tokens per second (the simulator) or per step (the engine)
    ttft_p99: float = 0.0  # seconds (the simulator) or steps (the engine)
    preemptions: int = 0
    finished: int = 0
    slo_attainment: float | None = None  # the simulator's: the share of requests within their SLO
    tokens: list[list[int]] = field(default_factory=list)  # the engine's greedy tokens, per request
    decisions: list[tuple[float, str, str]] = field(default_factory=list)  # the simulator's events
    wall_s: float = 0.0
    error: str | None = None


def _error(exc: BaseException) -> Run:
    return Run(error=f"{type(exc).__name__}: {exc}"[:600])


def simulate(policy: Policy) -> Run:
    """The policy on the simulator's workload: the real scheduler, a cost model for the clock. A policy that
    fails, runs out of time or (it should not be able to) changed a request is a run with an ``error``."""
    from ...lab.simulator import simulate_continuous

    plugged = _plug(policy)
    trace, cost, config = _sim_setup()
    start = time.perf_counter()
    try:
        with policy_time_limit(SIM_POLICY_S), parts.use(True, **plugged):
            res = simulate_continuous(trace, cost, config, record_events=True)
    except Exception as exc:  # a PartError names the function and the call; anything else, in words
        return _error(exc)
    for want, got in zip(trace, res.requests):  # every request served as the workload asked, or no score
        served = (got.prompt_len, got.output_len, len(got.token_times))
        if not got.rejected and served != (want.prompt_len, want.output_len, want.output_len):
            return Run(
                error=f"the policy changed request {want.req_id!r}: it was served {served[2]} of "
                f"{served[1]} output tokens after a {served[0]}-token prompt; the workload asks "
                f"{want.output_len} after {want.prompt_len} (a policy only orders and caps)"
            )
    s = res.summary()
    return Run(
        throughput=s["throughput_tok_s"],
        ttft_p99=s["ttft_p99_s"],
        preemptions=int(s["preemptions"]),
        finished=int(s["requests"]),
        slo_attainment=res.slo_attainment(SLO_TTFT_S, SLO_TPOT_S, SLO_TTFT_PER_TOKEN_S),
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
ENGINE_MAX_STEPS = 2000  # the workload takes about 100


def engine_prompts() -> list[list[int]]:
    import random

    rng = random.Random(10)
    return [[rng.randrange(100, 40_000) for _ in range(n)] for n in ENGINE_LENGTHS]


def engine() -> Any:
    """SmolLM2 with the workload's small pool (built once per call: the report card reuses it)."""
    from ...engine.llm import LLM

    return LLM(**ENGINE_SETTINGS)


def _engine_arg(llm: Any) -> Any:
    """``llm`` (an ``LLM``, ideally built by ``engine()``), or a new ``engine()`` for None."""
    from ...engine.llm import LLM

    if llm is None:
        return engine()
    if not isinstance(llm, LLM):
        raise TypeError(f"llm must be an LLM (ex10b.engine()) or None, got {type(llm).__name__}")
    return llm


def serve(policy: Policy, llm: Any = None) -> Run:
    """The policy on the engine: all prompts at once, stepped here so time to first token is counted in steps
    (deterministic, unlike the wall clock). ``llm`` is reset first; whatever happens, the run's requests leave
    it (aborted if they did not finish), so its pool and queues end as they began."""
    from ...sampling_params import SamplingParams
    from ...serving.load import percentile

    plugged = _plug(policy)
    llm = _engine_arg(llm)
    llm.reset()
    params = SamplingParams(max_tokens=ENGINE_MAX_TOKENS, temperature=0, ignore_eos=True)
    prompts = engine_prompts()
    start = time.perf_counter()
    ids: list[str] = []
    outs: dict[str, Any] = {}  # finished, handed back by the engine once
    first: dict[str, int] = {}  # the step each request's first token came in
    steps = 0
    try:
        with policy_time_limit(ENGINE_POLICY_S), parts.use(True, **plugged):
            for prompt in prompts:
                ids.append(llm.add_request(prompt, params))
            while len(outs) < len(ids) and steps < ENGINE_MAX_STEPS:
                llm.step()
                steps += 1
                for rid in ids:
                    if rid not in outs:
                        out = llm.get_output(rid)
                        if out.outputs[0].token_ids:
                            first.setdefault(rid, steps)
                        if out.finished:
                            outs[rid] = out
    except Exception as exc:
        return _error(exc)
    finally:  # failed, stopped or interrupted (Ctrl-C): the run's requests leave, their blocks go back
        llm.abort([rid for rid in ids if rid not in outs])
    if len(outs) < len(ids):
        return Run(error=f"{len(ids) - len(outs)} of {len(ids)} requests unfinished after {steps} steps")
    for rid, prompt in zip(ids, prompts):  # every request served as the workload asked, or no score
        out = outs[rid]
        if out.error or out.prompt_token_ids != prompt or len(out.outputs[0].token_ids) != ENGINE_MAX_TOKENS:
            return Run(
                error=f"request {rid!r} was not served as the workload asks ({len(prompt)} prompt tokens, "
                f"{ENGINE_MAX_TOKENS} output tokens): {len(out.prompt_token_ids)} and "
                f"{len(out.outputs[0].token_ids)}{f', {out.error}' if out.error else ''}"
            )
    tokens = [list(outs[r].outputs[0].token_ids) for r in ids]
    return Run(
        throughput=sum(map(len, tokens)) / steps,
        ttft_p99=float(percentile([float(first[r]) for r in ids if r in first], 99) or 0.0),
        preemptions=llm.scheduler.num_preemptions,
        finished=len(outs),
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
    """The simulator run's SLO attainment, if its throughput is at least ``THROUGHPUT_FLOOR`` of the base's
    (first come, first served); else 0. A failed run scores 0."""
    if run.error or base.error or run.slo_attainment is None or not base.throughput:
        return 0.0
    return run.slo_attainment if run.throughput >= THROUGHPUT_FLOOR * base.throughput else 0.0


def slo_text() -> str:
    """The objective, in words (the report card and the leaderboard print it)."""
    return (
        f"the first token within {SLO_TTFT_S:g} s + {SLO_TTFT_PER_TOKEN_S * 1e3:g} ms per prompt token, "
        f"at most {SLO_TPOT_S * 1e3:g} ms per output token on average; "
        f"a throughput under {THROUGHPUT_FLOOR:.0%} of first come, first served's scores 0"
    )


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
            slo = " " * 16 if r.slo_attainment is None else f"SLO met {r.slo_attainment:6.1%}  "
            return (
                f"  {label:<28} {slo}{r.throughput:>9.1f} {unit_tp:<10} p99 TTFT {r.ttft_p99:>7.2f} {unit_ttft:<6} "
                f"{r.preemptions:>4} preemptions  {r.finished} finished"
            )

        lines = [
            f"Report card: {self.name}",
            f"simulator ({SIM_REQUESTS} chat turns and documents in a burst, Llama-3-8B on an H100, "
            f"{SIM_BLOCKS - 1} blocks):",
            row("first come, first served", self.sim_base, "tok/s", "s"),
            row(self.name, self.sim, "tok/s", "s"),
            f"engine (SmolLM2, {len(ENGINE_LENGTHS)} prompts at once, {ENGINE_BLOCKS - 1} blocks of 16):",
            row("first come, first served", self.eng_base, "tok/step", "steps"),
            row(self.name, self.eng, "tok/step", "steps"),
            f"token for token the package's greedy output: {'yes' if self.exact else 'NO'}",
            f"score (the share of requests within the SLO, on the simulator): {score(self.sim, self.sim_base):.3f}",
            f"SLO: {slo_text()}",
        ]
        return "\n".join(lines)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


def report_card(policy: Policy, name: str = "your policy", llm: Any = None) -> ReportCard:
    if not isinstance(name, str):
        raise TypeError(f"name must be a string, got {type(name).__name__}")
    policy_parts(policy)  # refused here, by name, not as two failed runs
    llm = _engine_arg(llm)
    return ReportCard(name, simulate(policy), baseline_sim(), serve(policy, llm), baseline_serve(llm))


# ---- the leaderboard ------------------------------------------------------------------------------------
def _learners(what: str, fn: Callable[[], Any], seconds: float) -> Any:
    """``fn()``, a learner's code, within ``seconds`` (``hooks.bounded``); whatever it raises (``SystemExit``
    too) or a timeout is a ``ValueError`` naming ``what``."""

    def run() -> Any:
        try:
            return fn()
        except hooks.TimeUp:
            raise
        except BaseException as exc:  # SystemExit, KeyboardInterrupt... raised by the learner's code: its error
            raise ValueError(f"{what} raised {type(exc).__name__}: {exc}") from exc

    try:
        return hooks.bounded(run, seconds)
    except hooks.Overdue as late:
        raise ValueError(f"{what} {late}") from None


def load_policy(path: str | Path) -> dict[str, Callable[..., Any]]:
    """The policy a ``.py`` file defines (any of the three functions). Its import may take ``LOAD_S`` seconds;
    one that fails, exits or runs past that is a ``ValueError`` naming the file."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be the path of a .py file, got {type(path).__name__}")
    path = Path(path)
    spec = importlib.util.spec_from_file_location(f"policy_{path.stem}", path)
    if path.suffix != ".py" or spec is None or spec.loader is None:
        raise ValueError(f"{path} is not a Python file")
    if not path.is_file():
        raise ValueError(f"{path} is not a file")
    module = importlib.util.module_from_spec(spec)
    loader = spec.loader
    _learners(f"importing {path.name}", lambda: loader.exec_module(module), LOAD_S)
    found = {k: getattr(module, k) for k in POLICY_PARTS if callable(getattr(module, k, None))}
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

    @property
    def failure(self) -> str | None:
        """Why it is not ranked: its simulator run or its engine run failed, or the engine's tokens changed."""
        if self.sim.error:
            return self.sim.error
        if self.eng is not None and self.eng.error:
            return f"on the engine: {self.eng.error}"
        if self.exact is False:
            return "on the engine: NOT token for token the package's greedy output"
        return None


@dataclass
class Leaderboard:
    entries: list[Entry]  # best first; those that failed last, unranked

    def __str__(self) -> str:
        head = f"{'#':>2}  {'policy':<26}{'score':>7}{'tok/s':>8}{'p99 TTFT':>10}{'preempt':>9}  engine"
        lines = [head]
        floor = next((e.sim.throughput for e in self.entries if e.name == BASELINE_NAME and not e.failure), None)
        for i, e in enumerate(self.entries, 1):
            if e.failure:
                lines.append(f"{'-':>2}  {e.name:<26} failed: {e.failure[:100]}")
                continue
            eng = "not run" if e.exact is None else "token-exact"
            low = floor is not None and e.sim.throughput < THROUGHPUT_FLOOR * floor
            lines.append(
                f"{i:>2}  {e.name:<26}{e.score:>7.3f}{e.sim.throughput:>8.0f}{e.sim.ttft_p99:>9.2f}s"
                f"{e.sim.preemptions:>9}  {eng}" + ("  (under the throughput floor)" if low else "")
            )
        return "\n".join(lines + [f"score: the share of requests within the SLO: {slo_text()}"])

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


def leaderboard(
    folder: str | Path, extra: Mapping[str, Policy] | None = None, with_engine: bool = True, llm: Any = None
) -> Leaderboard:
    """Every policy file in ``folder`` (and ``extra``, e.g. yours), with first come first served, ranked by
    score on the simulator; each is also run on the engine and marked token-exact or not (``with_engine``).
    A file that fails to load, a policy that fails or runs out of time on either workload, and one whose engine
    tokens are not the package's are not ranked: they are listed last, with why."""
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"folder must be the path of a directory of policy files, got {type(folder).__name__}")
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"folder {str(folder)!r} is not a directory of policy files")
    if extra is not None and not isinstance(extra, Mapping):
        raise TypeError(f"extra must be a dict from name to policy, got {type(extra).__name__}")
    for key, value in (extra or {}).items():
        if not isinstance(key, str):
            raise TypeError(f"extra's names must be strings, got {key!r}")
        try:
            policy_parts(value)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"extra[{key!r}]: {exc}") from None
    if not isinstance(with_engine, bool):
        raise TypeError(f"with_engine must be True or False, got {with_engine!r}")
    policies: dict[str, Any] = {BASELINE_NAME: FCFS}
    for path in sorted(folder.glob("*.py")):
        try:
            policies[path.stem] = load_policy(path)
        except Exception as exc:
            policies[path.stem] = exc
    policies.update(extra or {})
    base = baseline_sim()
    llm = _engine_arg(llm) if with_engine else None
    eng_base = baseline_serve(llm) if llm is not None else None
    entries = []
    for name, policy in policies.items():
        if isinstance(policy, Exception):
            entries.append(Entry(name, Run(error=f"{type(policy).__name__}: {policy}"), None, None, 0.0))
            continue
        sim = base if policy is FCFS else simulate(policy)
        eng = None if llm is None else (eng_base if policy is FCFS else serve(policy, llm))
        exact = None if eng is None or eng_base is None else (not eng.error and eng.tokens == eng_base.tokens)
        entry = Entry(name, sim, eng, exact, 0.0)
        entry.score = 0.0 if entry.failure else score(sim, base)
        entries.append(entry)
    entries.sort(key=lambda e: (e.failure is not None, -e.score))
    return Leaderboard(entries)


# ---- the graded checks ------------------------------------------------------------------------------------
def check_policy(my_policy: Callable[[], Policy]) -> list[CheckOutcome]:
    """``my_policy() -> {name: function}``: it plugs in, serves both workloads to the end, decides differently
    from first come first served and scores above it on the simulator, and the engine's tokens stay the
    package's."""
    hint = (
        "each function must answer as its signature says (a permutation of the waiting ids; a permutation of the "
        "running ids; a cap of at least 1 token), within a few seconds, reading the requests it is shown and "
        "changing none; the error names the function and the call"
    )
    cache: dict[str, Any] = {}

    def got() -> dict[str, Callable[..., Any]]:
        if "policy" not in cache:
            cache["policy"] = policy_parts(_learners("my_policy()", my_policy, LOAD_S))
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
            "…and meets the SLO for more of its requests than first come, first served does, at no less than "
            f"{THROUGHPUT_FLOOR:.0%} of its throughput (the report card's score)",
            lambda: score(sim(), baseline_sim()) > score(baseline_sim(), baseline_sim()),
            True,
            hint="a different order is not yet a better one: the report card shows which requests miss their "
            "objective under your policy, and why first come, first served misses them",
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
