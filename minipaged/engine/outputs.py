"""What the engine hands back for a request: ``RequestOutput`` (vLLM's ``vllm/outputs.py``, smaller).

A request with ``n > 1`` samples forks at its first token: the extra samples are requests of their own
(``"<id>#1"``, ``"<id>#2"``, ...) hanging off the first one's ``children``. Its output gathers them::

    RequestOutput("7", prompt_token_ids, outputs=[CompletionOutput(0, ...),   the request itself
                                                   CompletionOutput(1, ...),   7#1
                                                   CompletionOutput(2, ...)],  7#2
                  finished, metrics, error)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..core.request import Request, RequestMetrics


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None


def samples(main: Request) -> list[Request]:
    """The request and the extra samples forked from it so far."""
    return [main, *main.children]


def is_done(main: Request) -> bool:
    """Every sample finished; an n > 1 request that ended before its first token (rejected, aborted, failed)
    never forks."""
    return all(r.is_finished for r in samples(main)) and (
        len(main.children) + 1 == main.sampling_params.n or main.num_output_tokens == 0
    )


def num_output_tokens(main: Request) -> int:
    return sum(r.num_output_tokens for r in samples(main))


def request_output(main: Request, decode: Callable[[list[int]], str]) -> RequestOutput:
    """A snapshot of the request's output so far (text decoded by ``decode``)."""
    outputs = [
        CompletionOutput(i, decode(r.output_token_ids), list(r.output_token_ids), r.finish_reason)
        for i, r in enumerate(samples(main))
    ]
    return RequestOutput(
        main.request_id, list(main.prompt_token_ids), outputs, is_done(main), main.metrics(), main.error
    )
