"""Sampling-side ops on a batch of logits: greedy pick with its logprob, and the fused
temperature / top-k / top-p / min-p filter that precedes random sampling.

Filter semantics (one row, ``x = logits / temperature`` in fp32, ``m = max(x)``):

1. top-k keeps ``x >= v_k``, the k-th largest value (ties with it are kept too);
2. top-p then keeps a token iff the probability mass of the top-k survivors *strictly above*
   it is ``< top_p`` (renormalised over the survivors) — the smallest nucleus reaching
   ``top_p``, ties kept together; the most likely token always survives;
3. min-p keeps ``exp(x - m) >= min_p``, i.e. probability >= ``min_p`` times the top one;

everything removed becomes ``-inf``. Neutral settings are plain values, not sentinels:
``top_k >= vocab``, ``top_p == 1`` and ``min_p == 0`` keep everything, ``temperature == 1``
scales nothing. Temperatures must be > 0 (greedy rows go to :func:`greedy_sample`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from core_engine.kernels.dispatch import use_triton

__all__ = ["filter_logits", "filter_logits_reference", "greedy_sample", "greedy_sample_reference"]


def _check_logits(logits: Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be (num_seqs, vocab_size), got shape {tuple(logits.shape)}")


def greedy_sample_reference(logits: Tensor) -> tuple[Tensor, Tensor]:
    """Torch reference: ``(argmax ids (B,) int64, their log-softmax (B,) fp32)``.

    Of equal maxima the first index wins.
    """
    logits32 = logits.float()
    token_ids = logits32.argmax(dim=-1)  # (B,)
    logprobs = torch.log_softmax(logits32, dim=-1).gather(1, token_ids[:, None]).squeeze(1)  # (B,)
    return token_ids, logprobs


def greedy_sample(logits: Tensor) -> tuple[Tensor, Tensor]:
    """Most likely token of each row of logits (B, V) and its logprob under softmax(logits).

    One pass over the vocabulary (running max, argmax and sum of exponentials) on CUDA.
    """
    _check_logits(logits)
    if use_triton(logits.device):
        from core_engine.kernels.triton_ops.sampling import greedy_sample_triton

        return greedy_sample_triton(logits)
    return greedy_sample_reference(logits)


def filter_logits_reference(
    logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor
) -> Tensor:
    """Torch reference (sort-based); see the module docstring for the semantics."""
    vocab_size = logits.shape[1]
    x = logits.float() / temperature.float()[:, None]  # (B, V)
    sorted_x = x.sort(dim=-1, descending=True).values  # (B, V)
    m = sorted_x[:, :1]  # (B, 1)
    kth = sorted_x.gather(1, top_k.long().clamp(1, vocab_size)[:, None] - 1)  # (B, 1)
    is_top_k = sorted_x >= kth  # (B, V), a prefix of each sorted row
    weights = torch.where(is_top_k, torch.exp(sorted_x - m), 0.0)  # (B, V)
    total = weights.sum(dim=-1, keepdim=True)
    mass_above = (
        weights.cumsum(dim=-1) - weights
    )  # exclusive: first of a tie run = mass strictly above
    top_p_col = top_p.float()[:, None]
    in_nucleus = (mass_above < top_p_col * total) | (top_p_col >= 1.0)
    in_nucleus[:, 0] = True
    num_kept = (in_nucleus & is_top_k).sum(dim=-1, keepdim=True)  # (B, 1), >= 1
    threshold = sorted_x.gather(1, num_kept - 1)  # smallest kept value
    keep = (x >= threshold) & (torch.exp(x - m) >= min_p.float()[:, None])
    return x.masked_fill(~keep, float("-inf"))


def filter_logits(
    logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor
) -> Tensor:
    """Temperature-scaled logits (B, V) fp32 with the tokens that top-k, top-p and min-p remove
    set to ``-inf``, ready for softmax and sampling.

    temperature, top_p, min_p: (B,) float; top_k: (B,) int. On CUDA no sort is needed: each
    threshold is found by a multi-way search over the order-preserving integer image of the
    fp32 values, exact after 8 passes over the row.
    """
    _check_logits(logits)
    num_seqs = logits.shape[0]
    for name, param in (
        ("temperature", temperature),
        ("top_k", top_k),
        ("top_p", top_p),
        ("min_p", min_p),
    ):
        if param.shape != (num_seqs,):
            raise ValueError(f"{name} must be ({num_seqs},), got {tuple(param.shape)}")
    if use_triton(logits.device):
        from core_engine.kernels.triton_ops.sampling import filter_logits_triton

        return filter_logits_triton(logits, temperature, top_k, top_p, min_p)
    return filter_logits_reference(logits, temperature, top_k, top_p, min_p)
