"""Verification: which proposed tokens the target model accepts, and its own next token.

For one request with proposals ``d_1..d_k`` the target forward gives ``k + 1`` logits rows;
row ``j`` is the target's distribution ``p_j`` for the token after ``d_1..d_j``. Each row is
processed exactly as plain decoding would process it at that point (penalties see the output
*with* ``d_1..d_j``; then temperature, top-k, top-p, min-p), so that:

* **greedy** rows accept while ``argmax p_j == d_{j+1}`` and emit the argmax after the last
  accepted token: token for token the output of plain greedy decoding;
* **point-mass proposals** (n-gram lookup, or a draft model that proposed its argmax) draw
  ``t_j ~ p_j`` and accept while ``t_j == d_{j+1}``. That is the standard rule for a one-hot
  draft distribution ``q`` (accept with probability ``min(1, p(d)/q(d)) = p(d)``; on
  rejection the emitted ``t_j`` is distributed as ``p`` without ``d``, the normalised
  residual), and a seeded request draws with its own generator once per emitted token, as
  plain decoding does: the same seed gives the same tokens with or without speculation;
* **sampled draft proposals** (the draft drew ``d_j ~ q_j``) use the standard rule:
  accept ``d_j`` with probability ``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection emit
  a draw from ``max(0, p_j - q_j)`` normalised; when all are accepted, a bonus draw from
  ``p_k``. The emitted tokens are distributed as the target's own samples.

Everything is batched over the rows of all requests (one penalty pass, one softmax, one
``multinomial`` for the unseeded point-mass rows); the per-request work is list slicing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from core_engine.output import TokenLogprobs
from core_engine.sampler import SamplingMetadata, apply_penalties, sampling_probs

__all__ = ["verify_proposals"]

#: (request, proposed token ids, the draft's (k, vocab) probabilities or None for point mass).
Group = tuple[Any, Sequence[int], Tensor | None]


class _Row:
    """One verification row as the sampling metadata sees a request: its history so far."""

    __slots__ = ("sampling_params", "output_token_ids", "prompt_token_ids", "generator")

    def __init__(self, request: Any, output_token_ids: list[int]) -> None:
        self.sampling_params = request.sampling_params
        self.output_token_ids = output_token_ids
        self.prompt_token_ids = request.prompt_token_ids
        self.generator = None  # seeded rows are drawn here, one at a time


def verify_proposals(
    logits: Tensor,
    groups: Sequence[Group],
    vocab_size: int,
    *,
    generator: torch.Generator | None = None,
) -> list[tuple[list[int], list[TokenLogprobs] | None]]:
    """Verify every group's proposal against its ``1 + k`` rows of ``logits`` (in order).

    Returns per group the emitted tokens (accepted proposals, then the target's token: 1 to
    ``k + 1`` of them) and their logprob records when the request asked for logprobs.
    """
    rows: list[_Row] = []
    offsets: list[int] = []
    for request, drafts, _ in groups:
        offsets.append(len(rows))
        history = request.output_token_ids
        penalised = request.sampling_params.has_penalties
        for j in range(len(drafts) + 1):
            rows.append(_Row(request, history + list(drafts[:j]) if penalised and j else history))
    md = SamplingMetadata.from_requests(rows, vocab_size, logits.device)  # type: ignore[arg-type]
    raw = logits.log_softmax(dim=-1) if md.max_num_logprobs is not None else None
    x = apply_penalties(logits, md) if md.presence is not None else logits
    argmax = x.argmax(dim=-1).tolist()
    probs = None if md.all_greedy else sampling_probs(x, md)

    # One multinomial for all unseeded point-mass rows.
    batch_rows = [
        offsets[g] + j
        for g, (request, drafts, q) in enumerate(groups)
        if request.sampling_params.temperature > 0.0 and q is None and request.generator is None
        for j in range(len(drafts) + 1)
    ]
    drawn: dict[int, int] = {}
    if batch_rows:
        assert probs is not None
        index = torch.tensor(batch_rows, device=logits.device)
        tokens = torch.multinomial(probs.index_select(0, index), 1, generator=generator).squeeze(1).tolist()
        drawn = dict(zip(batch_rows, tokens, strict=True))

    results: list[tuple[list[int], list[TokenLogprobs] | None]] = []
    for g, (request, drafts, q) in enumerate(groups):
        o, k = offsets[g], len(drafts)
        temperature = request.sampling_params.temperature
        if temperature == 0.0:
            emitted = _accept_while_equal(drafts, argmax[o : o + k + 1])
        elif q is None and request.generator is None:
            emitted = _accept_while_equal(drafts, [drawn[o + j] for j in range(k + 1)])
        elif q is None:
            assert probs is not None
            emitted = _accept_while_equal(drafts, _draws(probs[o : o + k + 1], request.generator))
        else:
            assert probs is not None
            emitted = _accept_rejection(drafts, probs[o : o + k + 1], q, generator)
        records = None
        num_top = request.sampling_params.logprobs
        if num_top is not None and raw is not None:
            records = _records(raw[o : o + len(emitted)], emitted, num_top)
        results.append((emitted, records))
    return results


def _accept_while_equal(drafts: Sequence[int], targets: Iterable[int]) -> list[int]:
    """Accept ``drafts[j]`` while the target's ``j``-th token equals it; then emit that token.

    ``targets`` may be lazy (:func:`_draws`): nothing past the first mismatch is drawn.
    """
    out: list[int] = []
    for j, token in enumerate(targets):
        out.append(token)
        if j == len(drafts) or token != drafts[j]:
            break
    return out


def _draws(probs: Tensor, generator: torch.Generator) -> Iterator[int]:
    """One draw per row with a request's own generator, as plain decoding draws per token."""
    for row in probs:
        yield int(torch.multinomial(row, 1, generator=generator)[0])


def _accept_rejection(drafts: Sequence[int], p: Tensor, q: Tensor, generator: torch.Generator | None) -> list[int]:
    """The standard rule for drafts drawn from ``q`` (k, V); ``p`` is (k + 1, V)."""
    k = len(drafts)
    p = p / p.sum(dim=-1, keepdim=True)
    d = torch.tensor(list(drafts), device=p.device)
    rows = torch.arange(k, device=p.device)
    p_d, q_d = p[rows, d], q[rows, d]
    u = torch.rand(k, generator=generator, device=p.device)
    accepted = (u * q_d <= p_d).tolist()
    m = accepted.index(False) if False in accepted else k
    if m < k:
        residual = (p[m] - q[m]).clamp(min=0.0)
        if float(residual.sum()) <= 0.0:
            residual = p[m]
    else:
        residual = p[k]
    last = int(torch.multinomial(residual, 1, generator=generator)[0])
    return [*drafts[:m], last]


def _records(raw: Tensor, tokens: list[int], num_top: int) -> list[TokenLogprobs]:
    ids = torch.tensor(tokens, device=raw.device)
    chosen = raw.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
    if num_top:
        values, top_ids = raw.topk(num_top, dim=-1)
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(top_ids.tolist(), values.tolist(), strict=True)]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprobs(token_id=t, logprob=lp, top=top) for t, lp, top in zip(tokens, chosen, tops, strict=True)]
