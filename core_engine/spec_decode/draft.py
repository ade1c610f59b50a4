"""Draft-model proposals: a smaller model with the target's vocabulary guesses ``k`` tokens.

The draft runs in the same engine with its own paged KV pool (:class:`~core_engine.
paged_attention.KVCache` and block tables of its own) and keeps, per request, the tokens whose
K/V it holds. Each step, for the batch of requests that speculate with it:

1. **catch up**: one forward over each request's tokens the draft has not seen (the whole
   prompt the first time; then the target's last token, plus an accepted proposal the draft
   never fed) — single tokens as batched decodes, longer runs as prefill chunks;
2. **k - 1 more forwards**, each one batched decode of the previous proposal of every request
   that still proposes; ``k`` varies per request.

Greedy and seeded requests take the draft's argmax (a point-mass proposal, see
:mod:`core_engine.spec_decode.rejection`); other sampled requests draw from the draft's
distribution under their own temperature / top-k / top-p / min-p and hand it to the
verification as ``q``. Rejected proposals are found at the next step (the draft's tokens
differ from the request's) and their blocks freed; when the draft pool is full a request
simply does not speculate that step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from core_engine.block_pool import BlockPool, KVCacheBlock
from core_engine.paged_attention import KVCache, PagedAttention, build_attention_metadata
from core_engine.sampler import SamplingMetadata, sampling_probs

__all__ = ["DraftProposer"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class DraftProposer:
    """Proposals from a draft model; see the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        generator: torch.Generator | None = None,
    ) -> None:
        config: Any = model.config
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        self.vocab_size: int = config.vocab_size
        self.kv_cache = KVCache(
            num_layers=config.num_layers, num_blocks=num_blocks, block_size=block_size,
            num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=dtype, device=self.device,
        )
        self.attn = PagedAttention(self.kv_cache, num_heads=config.num_heads)
        self.pool = BlockPool(num_blocks, enable_caching=False)
        self.generator = generator
        self._blocks: dict[str, list[KVCacheBlock]] = {}
        #: Per request: the tokens whose K/V the draft holds, and how many of them were known
        #: (not proposals) when fed.
        self._tokens: dict[str, list[int]] = {}
        self._num_known: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def release(self, request: Any) -> None:
        blocks = self._blocks.pop(request.req_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))
        self._tokens.pop(request.req_id, None)
        self._num_known.pop(request.req_id, None)

    def _num_valid(self, request: Any) -> int:
        """Tokens of the draft's cache for ``request`` that are still its real tokens."""
        have = self._tokens.get(request.req_id)
        if not have:
            return 0
        known = min(self._num_known[request.req_id], request.num_tokens)
        tail, real = have[known:], request.all_token_ids[known : len(have)]
        n = 0
        while n < len(tail) and n < len(real) and tail[n] == real[n]:
            n += 1
        return known + n

    def _reserve(self, request: Any, num_valid: int, num_positions: int) -> bool:
        """Keep the blocks of ``num_valid`` tokens, make room for ``num_positions``."""
        blocks = self._blocks.setdefault(request.req_id, [])
        keep = _cdiv(num_valid, self.block_size)
        if len(blocks) > keep:
            self.pool.free_blocks(reversed(blocks[keep:]))
            del blocks[keep:]
        need = _cdiv(num_positions, self.block_size) - len(blocks)
        if need > self.pool.num_free_blocks:
            return False
        if need > 0:
            blocks.extend(self.pool.get_new_blocks(need))
        return True

    @torch.inference_mode()
    def propose(self, requests: Sequence[Any], ks: Sequence[int]) -> list[tuple[list[int], Tensor | None]]:
        """Per request: up to ``ks[i]`` tokens, and the draft's (k, vocab) distribution when it
        sampled them (None: argmax proposals)."""
        out: list[tuple[list[int], Tensor | None]] = [([], None) for _ in requests]
        live: list[int] = []
        feeds: list[tuple[int, list[int]]] = []  # (first position, tokens) per live request
        for i, (request, k) in enumerate(zip(requests, ks, strict=True)):
            valid = self._num_valid(request)
            # The last proposal is never fed: K/V for num_tokens + k - 1 positions.
            if not self._reserve(request, valid, request.num_tokens + k - 1):
                self.release(request)
                continue
            live.append(i)
            feeds.append((valid, request.all_token_ids[valid:]))
            self._tokens[request.req_id] = list(request.all_token_ids)
            self._num_known[request.req_id] = request.num_tokens
        if not live:
            return out
        point_mass = [
            requests[i].sampling_params.temperature == 0.0 or requests[i].generator is not None for i in live
        ]
        md = SamplingMetadata.from_requests([requests[i] for i in live], self.vocab_size, self.device)
        drafts: list[list[int]] = [[] for _ in live]
        q_rows: list[list[Tensor]] = [[] for _ in live]
        active = list(range(len(live)))
        for step in range(max(ks[i] for i in live)):
            logits = self._forward([feeds[a] for a in active], [self._blocks[requests[live[a]].req_id] for a in active])
            tokens, probs = self._pick(logits, md, active, point_mass)
            next_active = []
            for j, a in enumerate(active):
                drafts[a].append(tokens[j])
                if probs is not None and not point_mass[a]:
                    q_rows[a].append(probs[j])
                if len(drafts[a]) < ks[live[a]]:
                    request = requests[live[a]]
                    self._tokens[request.req_id].append(tokens[j])
                    feeds[a] = (request.num_tokens + step, [tokens[j]])
                    next_active.append(a)
            active = next_active
            if not active:
                break
        for a, i in enumerate(live):
            out[i] = (drafts[a], torch.stack(q_rows[a]) if q_rows[a] else None)
        return out

    def _pick(
        self, logits: Tensor, md: SamplingMetadata, active: list[int], point_mass: list[bool]
    ) -> tuple[list[int], Tensor | None]:
        argmax = logits.argmax(dim=-1).tolist()
        if all(point_mass[a] for a in active):
            return argmax, None
        index = torch.tensor(active, device=logits.device)
        sub = _select_rows(md, index)
        probs = sampling_probs(logits, sub)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        drawn = torch.multinomial(probs, 1, generator=self.generator).squeeze(1).tolist()
        tokens = [argmax[j] if point_mass[a] else drawn[j] for j, a in enumerate(active)]
        return tokens, probs

    def _forward(self, feeds: list[tuple[int, list[int]]], tables: list[list[KVCacheBlock]]) -> Tensor:
        """One draft forward; the logits of each feed's last token, (len(feeds), vocab)."""
        order = [i for i, (start, toks) in enumerate(feeds) if len(toks) == 1 and start > 0]
        order += [i for i, (start, toks) in enumerate(feeds) if not (len(toks) == 1 and start > 0)]
        input_ids: list[int] = []
        positions: list[int] = []
        decodes: list[tuple[int, list[int]]] = []
        prefills: list[tuple[int, int, list[int]]] = []
        last_rows = [0] * len(feeds)
        for i in order:
            start, toks = feeds[i]
            block_ids = [b.block_id for b in tables[i]]
            input_ids.extend(toks)
            positions.extend(range(start, start + len(toks)))
            last_rows[i] = len(input_ids) - 1
            if len(toks) == 1 and start > 0:
                decodes.append((start, block_ids))
            else:
                prefills.append((start, len(toks), block_ids))
        self.attn.prepare(
            build_attention_metadata(
                block_size=self.block_size, decodes=decodes, prefills=prefills, device=self.device,
                use_kernel=self.attn.uses_kernel,
            )
        )
        return self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            self.attn,
            logits_indices=torch.tensor(last_rows, dtype=torch.long, device=self.device),
        )


def _select_rows(md: SamplingMetadata, index: Tensor) -> SamplingMetadata:
    """The metadata of a subset of rows (only what :func:`sampling_probs` reads)."""

    def pick(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.index_select(0, index)

    return SamplingMetadata(
        num_rows=len(index), all_greedy=False, greedy_mask=None, temperature=pick(md.temperature),
        top_k=pick(md.top_k), max_top_k=md.max_top_k, top_p=pick(md.top_p), min_p=pick(md.min_p),
        generators={}, presence=None, frequency=None, repetition=None, output_token_ids=None,
        prompt_token_ids=None, max_num_logprobs=None, num_logprobs=[None] * len(index),
    )
