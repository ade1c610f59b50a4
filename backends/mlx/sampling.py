"""A request's sampling parameters as mlx-lm's sampler and logits processors.

Truncation and temperature come from ``mlx_lm.sample_utils.make_sampler`` (top-p, min-p,
top-k, then a categorical draw from MLX's global RNG; temperature 0 is greedy). The penalties
are our own processors, because mlx-lm's look only at a window of the tokens it was handed
(with a prompt cache, not the cached part of the prompt): here the repetition penalty covers
the whole prompt and output (as in vLLM and Hugging Face), presence and frequency penalties
count the output only (OpenAI's definition).

A processor receives ``tokens``, every token fed to the model in this generation (the
uncached prompt suffix, then each sampled token), and logits of shape ``(1, vocab)``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

from backends.base import SamplingParams

__all__ = ["ConstraintProcessor", "LogitsProcessor", "logits_processors", "sampler"]

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def sampler(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    """Token choice from log-probabilities ``(1, vocab)`` for ``params``."""
    top_p = params.top_p if 0.0 < params.top_p < 1.0 else 0.0
    return make_sampler(
        temp=max(params.temperature, 0.0),
        top_p=top_p,
        min_p=params.min_p,
        top_k=params.top_k or 0,
    )


def logits_processors(
    params: SamplingParams,
    *,
    prompt_ids: Sequence[int],
    num_fed_prompt: int,
    vocab_size: int,
    banned_ids: Collection[int] = (),
) -> list[LogitsProcessor]:
    """Processors for ``params``; ``num_fed_prompt`` prompt tokens precede the output in ``tokens``."""
    processors: list[LogitsProcessor] = []
    if banned_ids:
        banned = mx.array(sorted(banned_ids))

        def ban(tokens: mx.array, logits: mx.array) -> mx.array:
            logits[:, banned] = -float("inf")
            return logits

        processors.append(ban)
    if params.repetition_penalty != 1.0:
        processors.append(_RepetitionPenalty(params.repetition_penalty, prompt_ids, num_fed_prompt))
    if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
        processors.append(
            _OutputPenalty(
                params.presence_penalty, params.frequency_penalty, num_fed_prompt, vocab_size
            )
        )
    return processors


class _RepetitionPenalty:
    """Divides positive (multiplies negative) logits of every token seen in prompt or output."""

    def __init__(self, penalty: float, prompt_ids: Sequence[int], num_fed_prompt: int) -> None:
        self._penalty = penalty
        self._seen = set(prompt_ids)
        self._num_fed_prompt = num_fed_prompt
        self._num_output = 0

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        output: list[int] = tokens[self._num_fed_prompt :].tolist()  # type: ignore[assignment]
        self._seen.update(output[self._num_output :])
        self._num_output = len(output)
        if not self._seen:
            return logits
        ids = mx.array(sorted(self._seen))
        selected = logits[:, ids]  # (1, num_seen)
        logits[:, ids] = mx.where(selected < 0, selected * self._penalty, selected / self._penalty)
        return logits


class _OutputPenalty:
    """OpenAI presence and frequency penalties over the tokens generated so far."""

    def __init__(self, presence: float, frequency: float, num_fed_prompt: int, vocab: int) -> None:
        self._presence = presence
        self._frequency = frequency
        self._num_fed_prompt = num_fed_prompt
        self._counts = mx.zeros((vocab,), dtype=mx.float32)  # (vocab,)
        self._num_output = 0

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        output = tokens[self._num_fed_prompt :]
        new = output[self._num_output :]
        if new.size:
            self._counts = self._counts.at[new].add(1.0)
            self._num_output = output.size
        if self._num_output == 0:
            return logits
        counts = self._counts[: logits.shape[-1]]
        penalty = self._frequency * counts + self._presence * (counts > 0)  # (vocab,)
        return logits - penalty[None, :].astype(logits.dtype)


class ConstraintProcessor:
    """A structured-output constraint as a logits processor: the llguidance matcher takes
    the tokens sampled since its last call, then its mask sets every forbidden logit to -inf
    (the core engine's and llama.cpp's masks, from the same compiler)."""

    def __init__(self, matcher: object, num_fed_prompt: int, fallback_ids: Collection[int]) -> None:
        self._matcher = matcher
        self._num_fed_prompt = num_fed_prompt
        self._num_consumed = 0
        self._fallback = sorted(fallback_ids)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        import numpy as np

        output: list[int] = tokens[self._num_fed_prompt :].tolist()  # type: ignore[assignment]
        for token in output[self._num_consumed :]:
            self._matcher.consume_token(token)  # type: ignore[attr-defined]
        self._num_consumed = len(output)
        vocab = logits.shape[-1]
        words = (vocab + 31) // 32
        bitmask = np.empty(words, dtype=np.int32)
        self._matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, words * 4)  # type: ignore[attr-defined]
        allowed = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab].astype(bool)
        if not allowed.any():
            allowed[self._fallback] = True
        return mx.where(mx.array(allowed)[None, :], logits, mx.array(-float("inf"), dtype=logits.dtype))
