"""Runs one scheduled step: flat inputs -> model forward over the paged KV cache -> sampling.

Stateless across steps apart from the KV pool: every step rebuilds its inputs from the
:class:`~core_engine.scheduler.SchedulerOutput` (a handful of tensor constructions, cheap next
to the forward pass).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, cast

import msgspec
import torch

from core_engine.attention import PackedAttention
from core_engine.paged_attention import KVCache, PagedAttention, build_attention_metadata
from core_engine.sampler import Sampler, SamplingMetadata, compute_prompt_logprobs
from core_engine.scheduler import ModelRunnerOutput, SchedulerOutput
from core_engine.spec_decode.rejection import verify_proposals

__all__ = ["ForwardBatch", "ModelRunner"]

logger = logging.getLogger(__name__)


class ForwardBatch(msgspec.Struct, frozen=True, array_like=True):
    """What one step's forward pass needs, flat (and what rank 0 of a tensor-parallel engine
    sends every other rank before the step; :mod:`core_engine.distributed`).

    ``decodes``/``prefills`` are :func:`~core_engine.paged_attention.build_attention_metadata`'s
    arguments; ``logits_indices`` the rows whose logits are wanted.
    """

    input_ids: list[int]
    positions: list[int]
    #: ``(position, block_ids)`` or ``(position, block_ids, num_tokens)`` per decode.
    #: (msgspec decodes one tuple shape per field: the union of the two lengths is spelled loosely)
    decodes: list[tuple[int | list[int], ...]]
    prefills: list[tuple[int, int, list[int]]]
    logits_indices: list[int]
    #: Run the compiled decode forward (a pure-decode step of an engine that compiled one).
    compiled: bool = False


class ModelRunner:
    """Owns the model, the KV pool and the sampler; :meth:`execute_model` runs one step.

    ``dtype`` is the compute dtype; ``kv_cache_dtype`` how the pool stores K/V
    (:mod:`core_engine.kv_quant`).
    """

    def __init__(
        self,
        model: Any,  # LlamaModel or a subclass (final_norm, hidden_states, forward)
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
        device: torch.device | str = "cpu",
        compile_decode: bool = False,
        seed: int | None = None,
        before_forward: Callable[[ForwardBatch], None] | None = None,
    ) -> None:
        config: Any = model.config  # LlamaConfig
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        self.vocab_size: int = config.vocab_size
        self.kv_cache = KVCache(
            num_layers=config.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=dtype,
            cache_dtype=kv_cache_dtype,
            device=self.device,
        )
        self.attn = PagedAttention(self.kv_cache, num_heads=config.num_heads)
        self.sampler = Sampler(None if seed is None else torch.Generator(device=self.device).manual_seed(seed))
        #: Called with each step's batch before its forward pass (a tensor-parallel engine's
        #: rank 0 sends it to the other ranks there).
        self.before_forward = before_forward
        from core_engine.structured.masks import TokenMasks, overlaps_forward

        self.token_masks = TokenMasks(self.vocab_size, overlap=overlaps_forward(self.device))
        #: Where a constrained row with nothing allowed goes (set by the engine: its EOS ids).
        self.eos_token_ids: tuple[int, ...] = ()
        # Pure-decode steps (the steady state) may run a torch.compile'd forward: inductor fuses
        # the norms, rotary and activation ops around the matmuls and removes most per-op
        # dispatch. Steps with prefill chunks stay eager (their shapes vary too much).
        self._decode_forward: Any = None
        if compile_decode:
            self._decode_forward = torch.compile(model, dynamic=True)
            self._warm_up_decode()

    @torch.inference_mode()
    def _warm_up_decode(self) -> None:
        """Compile now rather than on the first request: batch 1 and batch >1 specialise."""
        started = time.perf_counter()
        # Distinct sizes (3 sequences, 7 context tokens): dynamo gives equal sizes one symbol,
        # and a graph traced with batch == context length would be recompiled later.
        for num_seqs, position in ((1, 4), (3, 6)):
            logger.info("compiling the decode step for batch %s (one-off, may take minutes)", "1" if num_seqs == 1 else "N")
            self.attn.prepare(
                build_attention_metadata(
                    block_size=self.block_size,
                    decodes=[(position, [0] * (position // self.block_size + 1))] * num_seqs,
                    prefills=[],
                    device=self.device,
                    use_kernel=self.attn.uses_kernel,
                )
            )
            ids = torch.zeros(num_seqs, dtype=torch.long, device=self.device)
            self._decode_forward(ids, ids + position, self.attn, logits_indices=torch.arange(num_seqs, device=self.device))
        logger.info("decode step compiled in %.0f s", time.perf_counter() - started)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Forward the step's tokens, sample where a chunk reaches the end of its known tokens,
        and verify proposed tokens (:mod:`core_engine.spec_decode.rejection`)."""
        scheduled = scheduler_output.scheduled
        input_ids: list[int] = []
        positions: list[int] = []
        decodes: list[tuple[int, list[int]] | tuple[int, list[int], int]] = []
        prefills: list[tuple[int, int, list[int]]] = []
        logits_indices: list[int] = []
        # Per scheduled request: (first logits row, number of prompt-logprob rows) or None.
        prompt_rows: list[tuple[int, int] | None] = [None] * len(scheduled)
        sample_items: list[int] = []
        sample_rows: list[int] = []
        # Speculative items: (item index, first logits row); their 1 + k rows are consecutive.
        spec_items: list[tuple[int, int]] = []
        # Attention wants all decodes before the prefill chunks; the Triton decode kernel takes
        # one token per decode, so there a multi-token decode runs as a (short) prefill chunk.
        multi_as_prefill = self.attn.uses_kernel
        is_decode = [
            it.num_computed_tokens > 0
            and it.num_new_tokens - len(it.spec_token_ids) == 1
            and not (it.spec_token_ids and multi_as_prefill)
            for it in scheduled
        ]
        order = [i for i in range(len(scheduled)) if is_decode[i]] + [
            i for i in range(len(scheduled)) if not is_decode[i]
        ]
        for i in order:
            item = scheduled[i]
            request = item.request
            start, num_new = item.num_computed_tokens, item.num_new_tokens
            end = start + num_new
            spec = item.spec_token_ids
            if spec:
                input_ids.extend(request.all_token_ids[start : end - len(spec)])
                input_ids.extend(spec)
            else:
                input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            token_offset = len(input_ids) - num_new
            if is_decode[i]:
                decodes.append((start, item.block_ids, num_new) if spec else (start, item.block_ids))
            else:
                prefills.append((start, num_new, item.block_ids))
            if request.wants_prompt_logprobs:
                # Position p predicts prompt token p + 1; skip rows already computed before a
                # preemption (the list only grows).
                first = max(start, len(request.prompt_logprobs))
                last = min(end, request.num_prompt_tokens - 1)
                if first < last:
                    prompt_rows[i] = (len(logits_indices), last - first)
                    logits_indices.extend(range(token_offset + first - start, token_offset + last - start))
            if spec:
                spec_items.append((i, len(logits_indices)))
                logits_indices.extend(range(len(input_ids) - num_new, len(input_ids)))
            elif item.sample:
                sample_rows.append(len(logits_indices))
                logits_indices.append(len(input_ids) - 1)
                sample_items.append(i)

        sample_reqs = [scheduled[i].request for i in sample_items]
        # Constrained rows' masks: on llguidance's threads while the model runs, where that
        # does not take the forward's cores (core_engine/structured/masks.py), else now.
        matchers = [r.active_matcher for r in sample_reqs]
        masks = self.token_masks.start(matchers) if any(m is not None for m in matchers) else None
        batch = ForwardBatch(
            input_ids, positions, cast("list[tuple[int | list[int], ...]]", decodes), prefills, logits_indices,
            compiled=self._decode_forward is not None and not prefills and not spec_items,
        )
        if self.before_forward is not None:
            self.before_forward(batch)
        logits = self.run_forward(batch)  # (N, vocab) float32

        device = self.device
        sampled: list[int | None] = [None] * len(scheduled)
        logprobs: list[object | None] | None = None
        if sample_items:
            rows = logits if len(sample_rows) == logits.shape[0] else logits[sample_rows]
            metadata = SamplingMetadata.from_requests(sample_reqs, self.vocab_size, device)
            if masks is not None:
                metadata.token_bitmask = masks.result()
                metadata.fallback_token_ids = self.eos_token_ids
            out = self.sampler(rows, metadata)
            for j, request in enumerate(sample_reqs):
                # A spent thinking budget: the end-of-thinking marker replaces the sample.
                forced = request.thinking.forced_token() if request.thinking is not None else None
                if forced is not None:
                    out.sampled_token_ids[j] = forced
            if masks is not None:
                for matcher, request, token in zip(matchers, sample_reqs, out.sampled_token_ids, strict=True):
                    if matcher is not None and not matcher.consume_token(token):
                        logger.warning("request %s: the constraint refused token %d (%s)", request.req_id,
                                       token, matcher.get_error())
            if out.logprobs is not None:
                logprobs = [None] * len(scheduled)
            for j, i in enumerate(sample_items):
                sampled[i] = out.sampled_token_ids[j]
                if logprobs is not None and out.logprobs is not None:
                    logprobs[i] = out.logprobs[j]

        output = ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs)
        if spec_items:
            row_index = [r for i, row0 in spec_items for r in range(row0, row0 + len(scheduled[i].spec_token_ids) + 1)]
            groups = [
                (scheduled[i].request, scheduled[i].spec_token_ids, scheduled[i].request.spec_draft_probs)
                for i, _ in spec_items
            ]
            verified = verify_proposals(
                logits[row_index], groups, self.vocab_size, generator=self.sampler.generator
            )
            for (i, _), (tokens, records) in zip(spec_items, verified, strict=True):
                output.spec_token_ids[i] = tokens
                if records is not None:
                    output.spec_logprobs[i] = records

        if any(r is not None for r in prompt_rows):
            prompt_logprobs: list[list[object] | None] = [None] * len(scheduled)
            for i, (item, rows_span) in enumerate(zip(scheduled, prompt_rows, strict=True)):
                if rows_span is None:
                    continue
                row0, count = rows_span
                request = item.request
                first = max(item.num_computed_tokens, len(request.prompt_logprobs))
                targets = request.prompt_token_ids[first + 1 : first + 1 + count]
                num_top = request.sampling_params.prompt_logprobs or 0
                prompt_logprobs[i] = list(compute_prompt_logprobs(logits[row0 : row0 + count], targets, num_top))
            output.prompt_logprobs = prompt_logprobs
        return output

    @torch.inference_mode()
    def run_forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The forward pass of ``batch`` over the paged KV cache: (N, vocab) fp32 logits."""
        device = self.device
        self.attn.prepare(
            build_attention_metadata(
                block_size=self.block_size,
                decodes=cast("list[tuple[int, list[int]]]", batch.decodes),
                prefills=batch.prefills,
                device=device,
                use_kernel=self.attn.uses_kernel,
                # The C++ CPU decode reads the block tables; a compiled forward traces torch's.
                decode_gather=batch.compiled or not self.attn.uses_cpu_kernel,
            )
        )
        forward = self._decode_forward if batch.compiled else self.model
        return forward(
            torch.tensor(batch.input_ids, dtype=torch.long, device=device),
            torch.tensor(batch.positions, dtype=torch.long, device=device),
            self.attn,
            logits_indices=torch.tensor(batch.logits_indices, dtype=torch.long, device=device),
        )

    @torch.inference_mode()
    def embed(self, token_ids: list[list[int]], pooling: str) -> torch.Tensor:
        """Pooled, L2-normalised final hidden states of whole sequences, in ONE forward:
        (B,) lists of ids -> (B, hidden) fp32. ``pooling``: "mean" over each sequence's
        tokens, or "last" (its last token's row). Touches neither the KV pool nor the sampler.
        """
        device = self.device
        lengths = [len(ids) for ids in token_ids]
        attn = PackedAttention(lengths, device=device)
        flat = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.long, device=device)  # (T,)
        hidden = self.model.hidden_states(flat, attn.positions, attn)  # (T, hidden)
        if pooling == "last":
            ends = torch.tensor(lengths, device=device).cumsum(0) - 1  # (B,)
            pooled = self.model.final_norm(hidden[ends]).float()  # (B, hidden)
        else:
            rows = self.model.final_norm(hidden).float()  # (T, hidden)
            seq = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
            sums = torch.zeros(len(lengths), rows.shape[1], device=device).index_add_(0, seq, rows)
            pooled = sums / torch.tensor(lengths, device=device, dtype=torch.float32).unsqueeze(1)
        return torch.nn.functional.normalize(pooled, dim=-1)
