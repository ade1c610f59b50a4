"""Per-request sampling for a whole batch in a few tensor ops.

Order of operations per row: raw logprobs (for ``logprobs``) -> the structured-output mask
of constrained rows (forbidden tokens at -inf) -> penalties (repetition over
prompt + output, presence/frequency over output) -> greedy rows take the argmax; the others are
divided by their temperature, cut by top-k, top-p and min-p, and drawn with ``multinomial``.
Seeded rows draw with their request's own ``torch.Generator``, so a seed reproduces the same
tokens whatever else shares the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from core_engine.output import TokenLogprobs
from core_engine.request import Request

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata", "compute_prompt_logprobs", "sampling_probs"]


def _padded(rows: Sequence[Sequence[int]], pad: int, device: torch.device) -> Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([list(r) + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


@dataclass(slots=True)
class SamplingMetadata:
    """The batch's sampling parameters as tensors (built once per step)."""

    num_rows: int
    all_greedy: bool
    #: (B,) True for greedy rows; None when no row is greedy.
    greedy_mask: Tensor | None
    #: (B, 1) temperatures (1.0 on greedy rows so that the division is harmless).
    temperature: Tensor | None
    #: (B, 1) k per row (vocab size where disabled); None when no row uses top-k.
    top_k: Tensor | None
    max_top_k: int
    #: (B,) top-p per row; None when every row has top_p == 1.
    top_p: Tensor | None
    #: (B, 1) min-p per row; None when unused.
    min_p: Tensor | None
    #: Row -> generator, for seeded random rows.
    generators: dict[int, torch.Generator]
    #: Penalty inputs (None when no row has penalties).
    presence: Tensor | None
    frequency: Tensor | None
    repetition: Tensor | None
    output_token_ids: list[list[int]] | None
    prompt_token_ids: list[list[int]] | None
    #: Most top-logprobs any row asked for; None when no row wants logprobs.
    max_num_logprobs: int | None
    #: Per row: how many top alternatives to return (None: no logprobs for this row).
    num_logprobs: list[int | None]
    #: (B, ceil(V / 32)) int32 allowed-token bits of constrained rows (all ones elsewhere);
    #: None when no row is constrained (:mod:`core_engine.structured.masks`).
    token_bitmask: Tensor | None = None
    #: Tokens a constrained row falls back to when its mask allows none (end of sequence).
    fallback_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_requests(cls, requests: Sequence[Request], vocab_size: int, device: torch.device) -> SamplingMetadata:
        params = [r.sampling_params for r in requests]
        n = len(params)
        greedy = [p.temperature == 0.0 for p in params]
        all_greedy = all(greedy)
        any_greedy = any(greedy)
        temperature = top_k = top_p = min_p = None
        max_top_k = 0
        generators: dict[int, torch.Generator] = {}
        if not all_greedy:
            temperature = torch.tensor(
                [1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)], device=device
            ).unsqueeze(1)
            ks = [p.top_k if p.top_k and p.top_k < vocab_size and not g else 0 for g, p in zip(greedy, params, strict=True)]
            max_top_k = max(ks)
            if max_top_k:
                top_k = torch.tensor([k or vocab_size for k in ks], device=device).unsqueeze(1)
            if any(p.top_p < 1.0 for p in params):
                top_p = torch.tensor([p.top_p for p in params], device=device)
            if any(p.min_p > 0.0 for p in params):
                min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
            generators = {
                i: r.generator for i, r in enumerate(requests) if r.generator is not None and not greedy[i]
            }
        presence = frequency = repetition = None
        output_ids = prompt_ids = None
        if any(p.has_penalties for p in params):
            presence = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)
            frequency = torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1)
            repetition = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)
            output_ids = [r.output_token_ids for r in requests]
            prompt_ids = [r.prompt_token_ids for r in requests]
        num_logprobs = [p.logprobs for p in params]
        wanted = [k for k in num_logprobs if k is not None]
        return cls(
            num_rows=n,
            all_greedy=all_greedy,
            greedy_mask=torch.tensor(greedy, device=device) if any_greedy and not all_greedy else None,
            temperature=temperature,
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=top_p,
            min_p=min_p,
            generators=generators,
            presence=presence,
            frequency=frequency,
            repetition=repetition,
            output_token_ids=output_ids,
            prompt_token_ids=prompt_ids,
            max_num_logprobs=max(wanted) if wanted else None,
            num_logprobs=num_logprobs,
        )


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: list[int]
    #: Per row (None where the row did not ask for logprobs).
    logprobs: list[TokenLogprobs | None] | None


def apply_penalties(logits: Tensor, md: SamplingMetadata) -> Tensor:
    """Repetition (prompt + output, HF rule), frequency and presence (output) penalties."""
    assert md.output_token_ids is not None and md.prompt_token_ids is not None
    assert md.presence is not None and md.frequency is not None and md.repetition is not None
    num_rows, vocab = logits.shape
    device = logits.device
    out_ids = _padded(md.output_token_ids, vocab, device)  # (B, Lo), padded with vocab
    counts = torch.zeros(num_rows, vocab + 1, device=device, dtype=logits.dtype)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
    counts = counts[:, :vocab]  # (B, V)
    if bool((md.repetition != 1.0).any()):
        prompt_ids = _padded(md.prompt_token_ids, vocab, device)  # (B, Lp)
        seen = torch.zeros(num_rows, vocab + 1, device=device, dtype=torch.bool)
        seen.scatter_(1, prompt_ids, True)
        seen = seen[:, :vocab] | (counts > 0)  # (B, V)
        penalized = torch.where(logits > 0, logits / md.repetition, logits * md.repetition)
        logits = torch.where(seen, penalized, logits)
    return logits - md.frequency * counts - md.presence * (counts > 0).to(logits.dtype)


def apply_top_k(logits: Tensor, top_k: Tensor, max_top_k: int) -> Tensor:
    """Keep each row's ``top_k`` largest logits (ties at the threshold are kept)."""
    values = logits.topk(max_top_k, dim=-1).values  # (B, max_k), descending
    kth = values.gather(1, (top_k.clamp(max=max_top_k) - 1))  # (B, 1)
    disabled = top_k > max_top_k
    kth = kth.masked_fill(disabled, float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: Tensor, top_p: Tensor) -> Tensor:
    """Nucleus filter on the rows with ``top_p < 1`` (keeps at least the most likely token)."""
    rows = (top_p < 1.0).nonzero().squeeze(1)
    sub = logits.index_select(0, rows)  # (R, V)
    sorted_logits, order = sub.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    drop = before > top_p.index_select(0, rows).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    sub = torch.empty_like(sub).scatter_(1, order, sorted_logits)
    return logits.index_copy(0, rows, sub)


def sampling_probs(logits: Tensor, md: SamplingMetadata) -> Tensor:
    """The distribution a random row draws from: temperature, then top-k, top-p, min-p.

    (B, V) penalised logits -> (B, V) probabilities (unnormalised after min-p: ``multinomial``
    normalises). Rows with temperature 0 get the temperature-1 distribution (callers take the
    argmax there).
    """
    assert md.temperature is not None
    x = logits / md.temperature  # (B, V)
    if md.top_k is not None:
        x = apply_top_k(x, md.top_k, md.max_top_k)
    if md.top_p is not None:
        x = apply_top_p(x, md.top_p)
    probs = x.softmax(dim=-1)
    if md.min_p is not None:
        peak = probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < md.min_p * peak, 0.0)
    return probs


class Sampler:
    """Samples one token per row of the batch's logits. ``generator`` (optional) drives the rows
    of requests that bring no seed of their own (an engine-wide seed)."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, logits: Tensor, md: SamplingMetadata) -> SamplerOutput:
        """logits: (B, V) float32, one row per sampling request, in metadata order."""
        raw_logprobs = logits.log_softmax(dim=-1) if md.max_num_logprobs is not None else None
        if md.token_bitmask is not None:
            from core_engine.structured.masks import apply_token_bitmask

            logits = apply_token_bitmask(logits, md.token_bitmask, md.fallback_token_ids)
        if md.presence is not None:
            logits = apply_penalties(logits, md)
        if md.all_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            sampled = self._sample_random(logits, md)
        sampled_list = sampled.tolist()
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, sampled_list, md)
        return SamplerOutput(sampled_token_ids=sampled_list, logprobs=logprobs)

    def _sample_random(self, logits: Tensor, md: SamplingMetadata) -> Tensor:
        probs = sampling_probs(logits, md)
        if md.generators:
            sampled = torch.empty(md.num_rows, dtype=torch.long, device=logits.device)
            unseeded = [i for i in range(md.num_rows) if i not in md.generators]
            if unseeded:
                idx = torch.tensor(unseeded, device=logits.device)
                sampled[idx] = torch.multinomial(probs.index_select(0, idx), 1, generator=self.generator).squeeze(1)
            for i, gen in md.generators.items():
                sampled[i] = torch.multinomial(probs[i], 1, generator=gen)[0]
        else:
            sampled = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)  # (B,)
        if md.greedy_mask is not None:
            sampled = torch.where(md.greedy_mask, logits.argmax(dim=-1), sampled)
        return sampled


def gather_logprobs(
    raw: Tensor, sampled: Tensor, sampled_list: list[int], md: SamplingMetadata
) -> list[TokenLogprobs | None]:
    token_lp = raw.gather(1, sampled.unsqueeze(1)).squeeze(1).tolist()  # (B,)
    top_ids: list[list[int]] = [[] for _ in sampled_list]
    top_lps: list[list[float]] = [[] for _ in sampled_list]
    if md.max_num_logprobs:
        values, ids = raw.topk(md.max_num_logprobs, dim=-1)  # (B, k)
        top_ids, top_lps = ids.tolist(), values.tolist()
    out: list[TokenLogprobs | None] = []
    for i, k in enumerate(md.num_logprobs):
        if k is None:
            out.append(None)
            continue
        out.append(
            TokenLogprobs(
                token_id=sampled_list[i],
                logprob=token_lp[i],
                top=tuple(zip(top_ids[i][:k], top_lps[i][:k], strict=True)),
            )
        )
    return out


def compute_prompt_logprobs(logits: Tensor, target_ids: Sequence[int], num_top: int) -> list[TokenLogprobs]:
    """Logprob of each next prompt token. logits: (N, V) for positions whose next token is
    ``target_ids[i]``; returns N records with ``num_top`` alternatives each."""
    logprobs = logits.float().log_softmax(dim=-1)  # (N, V)
    targets = torch.tensor(list(target_ids), dtype=torch.long, device=logits.device)
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
    if num_top:
        values, ids = logprobs.topk(num_top, dim=-1)
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    else:
        tops = [()] * len(chosen)
    return [
        TokenLogprobs(token_id=t, logprob=lp, top=top)
        for t, lp, top in zip(target_ids, chosen, tops, strict=True)
    ]
