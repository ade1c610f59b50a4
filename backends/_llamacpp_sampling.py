"""Sampling and logprobs for the llama.cpp backend: llama.cpp's sampler chain, and logprobs
computed from the raw logits of the sampled position (the model's distribution before
temperature and truncation, as OpenAI and vLLM report them).
"""

from __future__ import annotations

import ctypes
import random
from collections.abc import Callable, Sequence
from typing import Any

import llama_cpp
import numpy as np

from backends.base import SamplingParams, TokenLogprob, TopLogprob

__all__ = ["build_sampler", "last_logits", "logprob_entry", "prompt_logprobs"]


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
    logits: np.ndarray, token: int, piece: bytes, num_top: int, pieces: Callable[[int], bytes]
) -> TokenLogprob:
    """The sampled token's logprob and its ``num_top`` best alternatives, from raw logits."""
    logprobs = log_softmax(logits)  # (n_vocab,)
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


def prompt_logprobs(
    scores: np.ndarray, tokens: Sequence[int], num_top: int, pieces: Callable[[int], bytes]
) -> tuple[TokenLogprob, ...]:
    """Per prompt token: its logprob given the tokens before it (None for the first)."""
    entries = []
    offset = 0
    for position, token in enumerate(tokens):
        piece = pieces(token)
        if position == 0:
            entry = TokenLogprob(
                token=piece.decode("utf-8", errors="replace"),
                logprob=None,
                token_id=token,
                bytes=list(piece),
            )
        else:
            # Row p-1 of the score buffer holds the logits that predicted position p.
            logits = np.asarray(scores[position - 1], dtype=np.float32)
            entry = logprob_entry(logits, token, piece, num_top, pieces)
        entries.append(with_offset(entry, offset))
        offset += len(piece.decode("utf-8", errors="replace"))
    return tuple(entries)


def with_offset(entry: TokenLogprob, offset: int) -> TokenLogprob:
    return TokenLogprob(
        token=entry.token,
        logprob=entry.logprob,
        token_id=entry.token_id,
        bytes=entry.bytes,
        top_logprobs=entry.top_logprobs,
        text_offset=offset,
    )


def last_logits(llm: Any, n_vocab: int) -> np.ndarray:
    pointer = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    # A copy: the buffer is overwritten by the next decode.
    return np.ctypeslib.as_array(
        ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,)
    ).copy()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())
