"""Input processing: what a caller may pass as a prompt, turned into checked token ids, once.

A prompt is one of three things (vLLM's ``PromptType`` has the same three)::

    "Tell me a joke"                           a string: tokenized as it is
    [1, 4093, 314, ...]                        token ids (a list, or a 1-D integer tensor / numpy array)
    [{"role": "user", "content": "Hi"}, ...]   chat messages: through the model's chat template

``InputProcessor`` tells a single prompt from a batch, pairs prompts with sampling parameters and
checks every prompt (not empty, ids inside the vocabulary) before the engine queues any, so a bad
prompt anywhere in a batch is an error naming it, not a half-queued batch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from ..sampling_params import SamplingParams

Prompt = str | Sequence[int] | Sequence[dict[str, str]]
Prompts = Prompt | Sequence[Prompt]  # one prompt, or a batch
ParamsLike = SamplingParams | Sequence[SamplingParams] | None  # one for all (None: the defaults), or one each


def has_tokenizer(path: str | os.PathLike) -> bool:
    """Whether a model folder brings a tokenizer (a bare test model has none: it takes token ids)."""
    return any((Path(path) / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def model_inputs(path: str | os.PathLike, hf_config: Any) -> tuple[Any, InputProcessor, int | None]:
    """A model folder's tokenizer (None for a bare test model), its ``InputProcessor`` and its end-of-sequence id."""
    from ..model_loader import load_tokenizer

    tokenizer = load_tokenizer(path) if has_tokenizer(path) else None
    eos = getattr(hf_config, "eos_token_id", None)
    return tokenizer, InputProcessor(tokenizer, hf_config.vocab_size), eos[0] if isinstance(eos, (list, tuple)) else eos


class InputProcessor:
    """Prompts to token ids and back, for one model (its tokenizer, or None, and its vocabulary size)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def tokenize(self, prompt: Prompt) -> list[int]:
        """A string is tokenized as it is; token ids are used as they are; chat messages get the template."""
        from ..model_loader import chat_prompt_ids

        if prompt is None:
            raise ValueError("a prompt is None: pass a string, a list of token ids, or a list of chat messages")
        if isinstance(prompt, (torch.Tensor, np.ndarray)):
            if prompt.ndim != 1 or not (
                prompt.dtype in (torch.int32, torch.int64, torch.int16, torch.uint8)
                or (isinstance(prompt, np.ndarray) and prompt.dtype.kind in "iu")
            ):
                raise ValueError(
                    f"a {type(prompt).__name__} prompt must be 1-D integer token ids, got shape "
                    f"{tuple(prompt.shape)} and dtype {prompt.dtype}"
                )
            prompt = [int(t) for t in prompt.tolist()]
        if isinstance(prompt, str):
            return list(self._tokenizer()(prompt, add_special_tokens=False)["input_ids"])
        if isinstance(prompt, dict):
            raise ValueError("a chat prompt is a *list* of messages: [{'role': 'user', 'content': ...}]")
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(
                f"a prompt is a string, a list of token ids, or a list of chat messages; got {type(prompt).__name__}"
            )
        if prompt and all(isinstance(m, dict) for m in prompt):
            for i, m in enumerate(prompt):
                if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                    raise ValueError(
                        f"chat message {i} must have a 'role' and a 'content', both strings; got {sorted(m)}"
                    )
            return chat_prompt_ids(self._tokenizer(), list(prompt))
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
            raise ValueError(
                "a prompt is a string, a list of token ids, or a list of chat messages "
                "({'role': ..., 'content': ...}); this one mixes other things: "
                f"{sorted({type(t).__name__ for t in prompt})}"
            )
        return [int(t) for t in prompt]

    def _tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer: pass prompts as lists of token ids")
        return self.tokenizer

    def token_ids(self, prompt: Prompt, request_id: str) -> list[int]:
        """The prompt's token ids, checked: not empty, every id inside the vocabulary."""
        ids = self.tokenize(prompt)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if not ids or bad:
            raise ValueError(
                f"request {request_id!r}: "
                + (
                    "empty prompt"
                    if not ids
                    else f"token ids {bad[:5]} are outside the vocabulary (0..{self.vocab_size - 1})"
                )
            )
        return ids

    def decode(self, token_ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids, skip_special_tokens=True)

    @staticmethod
    def batch(prompts: Prompts, sampling_params: ParamsLike) -> list[tuple[Prompt, SamplingParams]]:
        """One prompt or a batch of them, each paired with its sampling parameters (one for all, or one each)."""
        if prompts is None:
            raise ValueError("prompts is None: pass a prompt or a list of prompts")
        single = (
            isinstance(prompts, (str, dict))
            or (isinstance(prompts, (torch.Tensor, np.ndarray)) and prompts.ndim == 1)
            or (
                isinstance(prompts, (list, tuple)) and bool(prompts) and isinstance(prompts[0], (int, np.integer, dict))
            )
        )
        batch: list[Prompt] = [cast(Prompt, prompts)] if single else list(cast(Sequence[Prompt], prompts))
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(batch):
                raise ValueError(f"{len(sampling_params)} sampling params for {len(batch)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * len(batch)
        for p in params:
            check_params(p)
        return list(zip(batch, params))


def check_params(params: object) -> SamplingParams:
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    return params
