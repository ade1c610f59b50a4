"""Sampling and logprobs for the llama.cpp backend: llama.cpp's sampler chain (one per
sequence), and logprobs computed from the raw logits row of the sampled position (the model's
distribution before temperature and truncation, as OpenAI and vLLM report them).
"""

from __future__ import annotations

import ctypes
import random
from collections.abc import Callable
from typing import Any

import llama_cpp
import numpy as np

from backends.base import SamplingParams, TokenLogprob, TopLogprob

__all__ = ["PromptLogprobs", "build_sampler", "log_softmax", "logits_row", "logprob_entry", "mask_logits"]


def build_sampler(
    params: SamplingParams,
    *,
    n_vocab: int,
    n_ctx: int,
    eog_ids: frozenset[int],
    default_seed: int | None,
) -> Any:
    """llama.cpp's sampler chain for ``params`` (the caller frees it)."""
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    add = llama_cpp.llama_sampler_chain_add
    if params.ignore_eos and eog_ids:
        biases = (llama_cpp.llama_logit_bias * len(eog_ids))(
            *(llama_cpp.llama_logit_bias(token=t, bias=float("-inf")) for t in eog_ids)
        )
        add(chain, llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(biases), biases))
    if (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    ):
        # The window covers the whole context: penalties count every generated token.
        add(
            chain,
            llama_cpp.llama_sampler_init_penalties(
                n_ctx,
                params.repetition_penalty,
                params.frequency_penalty,
                params.presence_penalty,
            ),
        )
    if params.temperature <= 0.0:
        add(chain, llama_cpp.llama_sampler_init_greedy())
        return chain
    if params.top_k:
        add(chain, llama_cpp.llama_sampler_init_top_k(params.top_k))
    if params.top_p < 1.0:
        add(chain, llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
    if params.min_p > 0.0:
        add(chain, llama_cpp.llama_sampler_init_min_p(params.min_p, 1))
    add(chain, llama_cpp.llama_sampler_init_temp(params.temperature))
    seed = params.seed if params.seed is not None else default_seed
    if seed is None:
        seed = random.getrandbits(32)
    add(chain, llama_cpp.llama_sampler_init_dist(seed & 0xFFFFFFFF))
    return chain


def logprob_entry(
    logprobs: np.ndarray, token: int, piece: bytes, num_top: int, pieces: Callable[[int], bytes]
) -> TokenLogprob:
    """``token``'s logprob and its ``num_top`` best alternatives, from a log-softmax row."""
    top: tuple[TopLogprob, ...] = ()
    if num_top > 0:
        ids = np.argpartition(-logprobs, num_top - 1)[:num_top]
        ids = ids[np.argsort(-logprobs[ids], kind="stable")]
        top = tuple(
            TopLogprob(
                token=pieces(int(i)).decode("utf-8", errors="replace"),
                logprob=float(logprobs[i]),
                token_id=int(i),
                bytes=list(pieces(int(i))),
            )
            for i in ids
        )
    return TokenLogprob(
        token=piece.decode("utf-8", errors="replace"),
        logprob=float(logprobs[token]),
        token_id=token,
        bytes=list(piece),
        top_logprobs=top,
    )


class PromptLogprobs:
    """Per prompt token: its logprob given the tokens before it (None for the first).

    Filled as chunked prefill evaluates the prompt: the logits row of position ``p`` predicts
    the token at ``p + 1`` and is read right after the decode that produced it.
    """

    def __init__(self, tokens: list[int], num_top: int, pieces: Callable[[int], bytes]) -> None:
        self._tokens = tokens
        self._num_top = num_top
        self._pieces = pieces
        self._offset = 0
        self.entries: list[TokenLogprob] = []
        first = tokens[0]
        self._append(
            TokenLogprob(
                token=pieces(first).decode("utf-8", errors="replace"),
                logprob=None,
                token_id=first,
                bytes=list(pieces(first)),
            )
        )

    def add_row(self, position: int, logits: np.ndarray) -> None:
        """The logits row computed at prompt ``position`` (ignored for the last position)."""
        if position + 1 >= len(self._tokens):
            return
        token = self._tokens[position + 1]
        entry = logprob_entry(
            log_softmax(logits), token, self._pieces(token), self._num_top, self._pieces
        )
        self._append(entry)

    def _append(self, entry: TokenLogprob) -> None:
        self.entries.append(_with_offset(entry, self._offset))
        self._offset += len(entry.token)


def _with_offset(entry: TokenLogprob, offset: int) -> TokenLogprob:
    return TokenLogprob(
        token=entry.token,
        logprob=entry.logprob,
        token_id=entry.token_id,
        bytes=entry.bytes,
        top_logprobs=entry.top_logprobs,
        text_offset=offset,
    )


def logits_row(ctx: Any, index: int, n_vocab: int) -> np.ndarray:
    """A view of the logits of batch row ``index`` of the last decode (valid until the next)."""
    pointer = llama_cpp.llama_get_logits_ith(ctx, index)
    if not pointer:
        raise IndexError(f"llama.cpp has no logits for batch row {index}")
    return np.ctypeslib.as_array(
        ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,)
    )


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def mask_logits(matcher: Any, row: np.ndarray, fallback_ids: frozenset[int]) -> None:
    """Write -inf into ``row`` (a logits view) for every token ``matcher`` forbids now: the
    same llguidance mask the core engine applies. A matcher that allows nothing (an error
    state) leaves the end-of-generation tokens."""
    words = (row.shape[0] + 31) // 32
    bitmask = np.empty(words, dtype=np.int32)
    matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, words * 4)
    allowed = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[: row.shape[0]].astype(bool)
    if not allowed.any():
        allowed[list(fallback_ids)] = True
    row[~allowed] = -np.inf
