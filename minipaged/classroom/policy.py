"""How a learner's scheduling policy is asked (exercise 10b): read-only views of the requests, and a leash.

The scheduler asks a policy once per step, before it changes anything, through its ``policy`` part
(``minipaged/core/scheduler.py``: ``SEAM``, ``Policy``). The engine trusts the answers' *shape* only: a policy can
make serving slower or faster, never wrong. This module is what stands in that part when a learner's
``admission_order``, ``preemption_order`` or ``prefill_cap`` is plugged in (``parts.use`` plugs ``ask_policy`` for
them), and what keeps a learner's code from reaching into the engine:

* it is shown read-only copies of the requests (``RequestView``), never the scheduler's own;
* it answers on a leash (``hooks.bounded``): within ``POLICY_STEP_S`` seconds a step (and, in a
  ``policy_time_limit`` block, its share of the run's), or it is stopped and named;
* whatever it raises, ``SystemExit`` included, is a ``PartError`` naming it.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from itertools import islice
from typing import Any

from .. import hooks
from ..core.request import Request
from ..core.scheduler import Policy

POLICY_PARTS = ("admission_order", "preemption_order", "prefill_cap")  # what a policy may define
POLICY_STEP_S = 3.0  # the most one step's questions may take: a sort of thousands of requests takes milliseconds


class _ReadOnly:
    __slots__: tuple[str, ...] = ()

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"a policy cannot change {self._what()} (setting {name!r}): it sees a read-only copy, and answers "
            f"with request ids and caps"
        )

    def __delattr__(self, name: str) -> None:
        self.__setattr__(name, None)

    def __getattr__(self, name: str) -> Any:  # only for names it does not have: say which it has
        raise AttributeError(f"a policy sees {', '.join(self.__slots__)} of {self._what()}, not {name!r}")

    def __copy__(self) -> Any:
        return self  # read-only: a copy is itself

    def __deepcopy__(self, memo: Any) -> Any:
        return self

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={object.__getattribute__(self, k)!r}" for k in self.__slots__)
        return f"{type(self).__name__}({fields})"

    def _what(self) -> str:
        return "a request"


class SamplingView(_ReadOnly):
    """What a policy sees of a request's ``SamplingParams``."""

    __slots__ = ("max_tokens",)
    max_tokens: int

    def __init__(self, max_tokens: int) -> None:
        object.__setattr__(self, "max_tokens", max_tokens)

    def _what(self) -> str:
        return "a request's sampling params"


class RequestView(_ReadOnly):
    """A request as a policy sees it: a read-only copy of what a policy decides on, taken when the step asks.
    Changing it raises; nothing a policy does to it reaches the scheduler's request."""

    __slots__ = (  # noqa: RUF023 (the order a policy's author reads them in)
        "request_id",
        "num_prompt_tokens",
        "num_tokens",  # prompt and outputs so far
        "num_computed_tokens",  # in its KV cache
        "arrival_time",  # seconds, on the clock of whoever serves it
        "num_preemptions",
        "sampling_params",  # its max_tokens
    )
    request_id: str
    num_prompt_tokens: int
    num_tokens: int
    num_computed_tokens: int
    arrival_time: float
    num_preemptions: int
    sampling_params: SamplingView

    def __init__(self, req: Request) -> None:
        put = object.__setattr__
        put(self, "request_id", req.request_id)
        put(self, "num_prompt_tokens", len(req.prompt_token_ids))
        put(self, "num_tokens", req.num_tokens)
        put(self, "num_computed_tokens", req.num_computed_tokens)
        put(self, "arrival_time", req.arrival_time)
        put(self, "num_preemptions", req.num_preemptions)
        put(self, "sampling_params", SamplingView(req.sampling_params.max_tokens))

    def _what(self) -> str:
        return f"request {object.__getattribute__(self, 'request_id')!r}"


@dataclass
class PolicyClock:
    """A run's time for its policy (``policy_time_limit``): ``seconds`` in all, ``spent`` so far."""

    seconds: float
    spent: float = 0.0


_clock: ContextVar[PolicyClock | None] = ContextVar("policy_clock", default=None)


@contextlib.contextmanager
def policy_time_limit(seconds: float) -> Iterator[PolicyClock]:
    """While the block lasts, the policy's answers on this thread may take ``seconds`` in all (each step's still
    ``POLICY_STEP_S`` at most); the one that would go past is stopped, a ``PartError`` naming it."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"seconds must be a positive number, got {seconds!r}")
    clock = PolicyClock(float(seconds))
    token = _clock.set(clock)
    try:
        yield clock
    finally:
        _clock.reset(token)


class PolicyAsker:
    """What ``parts.use`` plugs into the scheduler's ``policy`` part: a learner's policy functions (those it
    defines of ``POLICY_PARTS``), asked through ``ask_policy``."""

    def __init__(self, fns: Mapping[str, Callable[..., Any]]) -> None:
        self.fns: dict[str, Callable[..., Any] | None] = {name: fns.get(name) for name in POLICY_PARTS}

    def __call__(
        self, running: list[Request], waiting: deque[Request], free_seats: int
    ) -> tuple[Policy, list[Request] | None]:
        return ask_policy(self.fns, running, waiting, free_seats)


def ask_policy(
    fns: Mapping[str, Callable[..., Any] | None], running: list[Request], waiting: deque[Request], free_seats: int
) -> tuple[Policy, list[Request] | None]:
    """Ask the policy functions ``fns`` (None: the package's rule) this step's questions; change nothing. Returns
    the answers and the waiting queue's new order (None: keep it). The policy sees ``RequestView`` copies and
    answers on a leash (see above)."""
    order_fn, victim_fn, cap_fn = (fns[name] for name in POLICY_PARTS)
    ask_order = order_fn is not None and len(waiting) > 1
    ask_victims = victim_fn is not None and len(running) > 1
    if not (ask_order or ask_victims or (cap_fn is not None and (running or waiting))):
        return Policy(), None
    # The prefills this step could run: running ones, and waiting ones up to the seats (in the policy's order).
    seats = max(free_seats, 0)
    running_views = [RequestView(r) for r in running] if ask_victims or cap_fn is not None else []
    waiting_views = [RequestView(r) for r in (waiting if ask_order else islice(waiting, seats) if cap_fn else ())]
    asking = ["admission_order" if ask_order else "preemption_order" if ask_victims else "prefill_cap"]

    def ask(name: str, arg: Any) -> Any:  # on the leash's thread
        asking[0] = name
        fn = fns[name]
        assert fn is not None  # asked only when the policy defines it
        try:
            return fn(arg)
        except (hooks.PartError, hooks.TimeUp):
            raise
        except BaseException as exc:  # SystemExit, KeyboardInterrupt, ... raised by the policy: its error
            raise hooks.PartError(
                name, f"raised {type(exc).__name__}: {exc}", getattr(fn, "calls", 0), None, "ex10b"
            ) from exc

    def answers() -> tuple[list[str] | None, list[str] | None, dict[str, int]]:
        # Answers leave as plain str and int (a subclass's own __hash__ or __lt__ would run off the leash).
        order = [str.__str__(r) for r in ask("admission_order", list(waiting_views))] if ask_order else None
        victims = [str.__str__(r) for r in ask("preemption_order", list(running_views))] if ask_victims else None
        caps: dict[str, int] = {}
        if cap_fn is not None:
            by_id = {v.request_id: v for v in waiting_views}
            queue = waiting_views if order is None else [by_id[rid] for rid in order]
            for view in [*running_views, *queue[:seats]]:
                if view.num_tokens - view.num_computed_tokens > 1:
                    caps[view.request_id] = int.__int__(ask("prefill_cap", view))
        return order, victims, caps

    clock = _clock.get()
    if clock is not None and clock.spent >= clock.seconds:
        name = asking[0]
        why = f"the {clock.seconds:.3g} s of policy time this run allows are used up"
        raise hooks.PartError(name, why, getattr(fns[name], "calls", 0), None, "ex10b")
    limit = POLICY_STEP_S if clock is None else min(POLICY_STEP_S, clock.seconds - clock.spent)
    start = time.perf_counter()
    try:
        order_ids, victim_ids, caps = hooks.bounded(answers, limit)
    except hooks.Overdue as late:
        name = asking[0]
        why = (
            str(late)
            if clock is None or limit >= POLICY_STEP_S
            else (f"used up the {clock.seconds:.3g} s of policy time this run allows; {late}")
        )
        raise hooks.PartError(name, why, getattr(fns[name], "calls", 0), None, "ex10b") from None
    finally:
        if clock is not None:
            clock.spent += time.perf_counter() - start
    policy = Policy(caps=caps)
    if victim_ids is not None:
        policy.victims = {rid: i for i, rid in enumerate(victim_ids)}
    if order_ids is None:
        return policy, None
    by_id = {r.request_id: r for r in waiting}
    return policy, [by_id[rid] for rid in order_ids]
