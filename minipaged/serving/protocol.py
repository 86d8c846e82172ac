"""The OpenAI API's request bodies and error shape, as far as minipaged serves them (vLLM's
``vllm/entrypoints/openai/completion/protocol.py, chat_completion/protocol.py``).

Every request model forbids unknown fields and is strict about types (``"max_tokens": "10"`` is an error, not
10): a typo in a field name would otherwise be ignored in silence, and the client would never learn its
setting did nothing. Fields OpenAI knows but this engine cannot honour (``stop`` strings, ``logprobs``,
``tools``, penalties) are declared, so that setting one is a clear 400 "not supported by minipaged" naming it,
not an "unknown field". Responses are built as plain dicts by ``serving_completion`` and ``serving_chat``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator

PROMPT_TYPES = "prompt must be a string, a list of strings, a list of token ids, or a list of lists of token ids"


class OpenAIError(Exception):
    """An error the client gets as OpenAI writes it: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


# A field OpenAI knows and minipaged cannot do, and the values that ask for nothing (sent by some clients
# anyway). Types are compared too: ``logprobs: 0`` is a request for log-probabilities, ``logprobs: false`` is not.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "stop": (None, "", []),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "parallel_tool_calls": (None, True, False),
    "response_format": (None, {"type": "text"}),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
}
WHY_NOT = {
    "stop": "it stops at EOS, at max_tokens or at stop_token_ids (token ids; a vLLM extension)",
    "best_of": "n samples are all returned",
}


def unsupported_field(request: BaseModel) -> str | None:
    """The first field of ``request`` that asks for something the engine cannot do, or None."""
    for name in NEUTRAL:
        if name in type(request).model_fields:
            value = getattr(request, name)
            if name == "best_of" and value == getattr(request, "n", 1):
                continue  # best_of == n: the n samples, all returned
            if not any(type(value) is type(v) and value == v for v in NEUTRAL[name]):
                return name
    return None


class SamplingRequest(OpenAIBaseModel):
    """The fields both endpoints share: the model, the sampling knobs, streaming, vLLM's extensions."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = None
    temperature: float = 1.0  # OpenAI's default
    top_p: float = 1.0
    top_k: int | None = None  # vLLM extension
    n: int = 1
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM extension
    stop_token_ids: list[int] | None = None  # vLLM extension
    user: str | None = None  # accepted, ignored
    # Known to OpenAI, not done here: refused by name unless neutral (see NEUTRAL).
    stop: Any = None
    logit_bias: Any = None
    frequency_penalty: Any = None
    presence_penalty: Any = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def check_prompt(value: Any) -> str | list[str] | list[int] | list[list[int]]:
    """A prompt's four shapes, told apart by the first item and checked in Python. pydantic's union of the four would
    try each shape on every item of a long list and build an error for each (seconds for a 4 MiB body, all of
    them holding the GIL: the event loop would stall although validation runs in another thread)."""
    if type(value) is str:
        return value
    if type(value) is list:
        if not value:
            return value  # "empty prompt", said by the tokenizing step
        first = value[0]
        if type(first) is int and all(type(t) is int for t in value):  # bool is not a token id
            return value
        if type(first) is str and all(type(t) is str for t in value):
            return value
        if type(first) is list and all(type(p) is list and all(type(t) is int for t in p) for p in value):
            return value
    raise ValueError(PROMPT_TYPES)


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: one prompt or a batch (strings or token ids)."""

    prompt: Annotated[str | list[str] | list[int] | list[list[int]], PlainValidator(check_prompt)]
    logprobs: Any = None
    echo: Any = None
    suffix: Any = None
    best_of: Any = None


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``: a conversation, through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    # Bookkeeping for OpenAI's platform, nothing to do with generation: accepted, ignored (as user).
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # the prefix cache needs no key: it finds shared prefixes itself
    logprobs: Any = None
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
