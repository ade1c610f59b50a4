"""Per-request sampling parameters of the core engine (vLLM's ``SamplingParams`` names)."""

from __future__ import annotations

import math

import msgspec

from core_engine.chat.budget import ThinkingParams
from core_engine.errors import InvalidParamError
from core_engine.structured.spec import StructuredOutput

__all__ = ["MAX_LOGPROBS", "SamplingParams"]

#: Most alternatives per position the engine returns (OpenAI's own cap is 20).
MAX_LOGPROBS = 20


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not (math.isfinite(value) and low <= value <= high):
        raise InvalidParamError(f"{name} must be in [{low}, {high}], got {value!r}", param=name)


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to sample one sequence. Validated on construction (``InvalidParamError``).

    ``temperature == 0`` means greedy. ``logprobs=None`` returns no logprobs, ``0`` the sampled
    token's logprob only, ``N`` also the top ``N`` alternatives; ``prompt_logprobs`` likewise for
    each prompt token (completions ``echo``; such requests bypass the prefix cache because
    every prompt position's logits are needed).
    """

    #: Tokens to generate; None: until EOS or the context window is full.
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    #: None or 0: disabled.
    top_k: int | None = None
    min_p: float = 0.0
    #: Same seed, same prompt, same parameters: same output (a per-request generator).
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: HF-style multiplicative penalty over prompt and output tokens (1.0: off).
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    #: Keep the matched stop string in the output text (OpenAI: no).
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    #: Constrain the output to a JSON schema, regex, choice or grammar
    #: (:mod:`core_engine.structured`); None: unconstrained.
    structured_outputs: StructuredOutput | None = None
    #: A thinking budget (:mod:`core_engine.chat.budget`): the end-of-thinking marker is
    #: forced after ``budget`` reasoning tokens, and a constraint applies from there on.
    thinking: ThinkingParams | None = None
    #: Prompt prefixes to keep in the prefix cache after the request: ``(num_tokens, ttl_s)``
    #: pairs (Anthropic's ``cache_control`` breakpoints).
    pin_prefix: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidParamError(
                f"max_tokens must be at least 1, got {self.max_tokens}", param="max_tokens"
            )
        _check_range("temperature", self.temperature, 0.0, 1e4)
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise InvalidParamError(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        if self.top_k is not None and self.top_k < 0:
            raise InvalidParamError(f"top_k must be >= 0, got {self.top_k}", param="top_k")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if not (math.isfinite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0):
            raise InvalidParamError(
                f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}",
                param="repetition_penalty",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidParamError(
                    f"{name} must be in [0, {MAX_LOGPROBS}], got {value}", param=name
                )
        if any(not s for s in self.stop):
            raise InvalidParamError("stop strings must not be empty", param="stop")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidParamError("stop_token_ids must be >= 0", param="stop_token_ids")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
