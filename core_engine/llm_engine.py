"""The synchronous engine: requests in, :class:`~core_engine.output.RequestOutput` deltas out.

``step()`` is the whole loop body: schedule, run the model, post-process (detokenize, stop
strings, outputs). Not thread-safe: :class:`~core_engine.async_llm.AsyncLLM` drives it from one
thread.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from core_engine.chat.budget import ThinkingBudget, ThinkingParams
from core_engine.config import EngineConfig, resolve_dtype
from core_engine.errors import InvalidParamError, RequestTooLongError
from core_engine.kv_cache_manager import KVCacheManager
from core_engine.kv_offload.block_copy import tier_block_nbytes
from core_engine.kv_offload.tiers import KVTiers
from core_engine.kv_transfer.handoff import KVHandoff
from core_engine.kv_transfer.payload import PrefilledKV
from core_engine.model_runner import ModelRunner
from core_engine.output import RequestMetrics, RequestOutput, SpeculationMetrics, TokenLogprobs
from core_engine.paged_attention import KVCache
from core_engine.policy import (
    EnginePolicies,
)
from core_engine.request import Request, RequestStatus
from core_engine.sampling_params import SamplingParams
from core_engine.scheduler import Scheduler
from core_engine.spec_decode.draft import DraftProposer
from core_engine.spec_decode.ngram import NgramProposer
from core_engine.spec_decode.speculator import Speculator
from core_engine.stop_checker import StopChecker
from core_engine.tokenizer import IncrementalDetokenizer, Tokenizer
from core_engine.weight_setup import apply_quantization_policy, pack_weights, packs_from_blocks

__all__ = ["LLMEngine"]

logger = logging.getLogger(__name__)


class _OutputState:
    """Per-request post-processing state (text side)."""

    __slots__ = ("detokenizer", "stop_checker", "num_emitted_tokens", "prompt_logprobs_sent")

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special=params.skip_special_tokens)
        self.stop_checker: StopChecker[None] = StopChecker(params.stop, include_stop_str_in_output=params.include_stop_str_in_output)
        self.num_emitted_tokens = 0
        self.prompt_logprobs_sent = False


class LLMEngine:
    """Continuous-batching engine over one model (see :mod:`core_engine.scheduler`)."""

    def __init__(
        self,
        config: EngineConfig,
        model: torch.nn.Module,
        tokenizer: Tokenizer,
        *,
        dtype: torch.dtype,
        policies: EnginePolicies | None = None,
        draft_model: torch.nn.Module | None = None,
        tensor_parallel: Any = None,
    ) -> None:
        """``tensor_parallel``: the other ranks (:class:`~core_engine.distributed.launcher.
        TensorParallelRanks`) when ``model`` is rank 0's shard; the engine owns them."""
        model_config: Any = model.config  # LlamaConfig (a shard's: its heads)
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_model_len = model_config.context_window(config.max_model_len)
        block_bytes = KVCache.bytes_per_block(
            num_layers=model_config.num_layers,
            block_size=config.block_size,
            num_kv_heads=model_config.num_kv_heads,
            head_dim=model_config.head_dim,
            dtype=dtype,
            cache_dtype=config.kv_cache_dtype,
        )
        num_blocks = config.kv_cache_memory_bytes // block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"EngineConfig.kv_cache_memory_bytes={config.kv_cache_memory_bytes} is below one "
                f"KV block ({block_bytes} bytes)"
            )
        self.kv_cache_manager = KVCacheManager(
            num_blocks, config.block_size, enable_caching=config.enable_prefix_caching,
            tenant_quota=None if config.kv_tenant_quota is None else max(1, int(num_blocks * config.kv_tenant_quota)),
            pin_tenant_share=config.kv_pin_tenant_share,
        )
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
        )
        #: Ranks 1..N-1 of a tensor-parallel engine (None: one rank).
        self.tensor_parallel = tensor_parallel
        if tensor_parallel is not None:
            tensor_parallel.start_runners(num_blocks)  # rank 0 holds the most KV heads: its count fits all
        self.model_runner = ModelRunner(
            model, num_blocks=num_blocks, block_size=config.block_size, dtype=dtype,
            kv_cache_dtype=config.kv_cache_dtype, device=config.device,
            compile_decode=config.compile_decode, seed=config.seed,
            before_forward=None if tensor_parallel is None else tensor_parallel.send_step,
        )
        self.eos_token_ids = frozenset(tokenizer.stop_token_ids)
        self.model_runner.eos_token_ids = tuple(sorted(self.eos_token_ids))
        from core_engine.structured.compiler import GrammarCompiler, llguidance_tokenizer

        #: Compiles structured-output constraints (llguidance is loaded on the first one).
        self.grammars = GrammarCompiler(
            lambda: llguidance_tokenizer(tokenizer, model_config.vocab_size, sorted(self.eos_token_ids))
        )
        self._states: dict[str, _OutputState] = {}
        self.policies = policies or EnginePolicies()
        self.speculator = self._build_speculator(config, num_blocks, block_bytes, dtype, draft_model)
        self.tiers = self._build_tiers(config)
        #: Disaggregated serving: prefill-only exports and prefilled imports.
        self.handoff = KVHandoff(self.model_runner.kv_cache, self.kv_cache_manager)
        self.scheduler.finish_listeners.append(self._export_if_prefilled)
        self._prefilled: dict[str, PrefilledKV] = {}
        # Outputs of prefilled requests that finished on their first token (no step needed).
        self._ready_outputs: list[RequestOutput] = []
        logger.info(
            "KV cache: %d blocks x %d tokens (%.0f MiB, %s), max_model_len %d",
            num_blocks, config.block_size, num_blocks * block_bytes / 2**20,
            self.model_runner.kv_cache.quant.label, self.max_model_len,
        )

    def _build_speculator(
        self, config: EngineConfig, num_blocks: int, block_bytes: int, dtype: torch.dtype,
        draft_model: torch.nn.Module | None,
    ) -> Speculator | None:
        spec = config.speculation
        if spec is None:
            return None
        ngram = NgramProposer(ngram_max=spec.ngram_max, ngram_min=spec.ngram_min) if "ngram" in spec.methods else None
        draft = None
        if "draft" in spec.methods:
            if draft_model is None:
                raise ValueError("speculation.methods has 'draft' but no draft model was given")
            draft_config: Any = draft_model.config
            if draft_config.vocab_size != self.model_config.vocab_size:
                raise ValueError(
                    f"speculation.draft_model_path: the draft's vocabulary ({draft_config.vocab_size} "
                    f"tokens) is not the target's ({self.model_config.vocab_size})"
                )
            draft_block_bytes = KVCache.bytes_per_block(
                num_layers=draft_config.num_layers, block_size=config.block_size,
                num_kv_heads=draft_config.num_kv_heads, head_dim=draft_config.head_dim, dtype=dtype,
            )
            draft_blocks = (
                num_blocks
                if spec.draft_kv_cache_memory_bytes is None
                else max(1, spec.draft_kv_cache_memory_bytes // draft_block_bytes)
            )
            draft = DraftProposer(
                draft_model, num_blocks=draft_blocks, block_size=config.block_size, dtype=dtype,
                device=config.device, generator=self.model_runner.sampler.generator,
            )
            logger.info(
                "draft model: %d layers, KV %d blocks (%.0f MiB)",
                draft_config.num_layers, draft_blocks, draft_blocks * draft_block_bytes / 2**20,
            )
        speculator = Speculator(
            methods=spec.methods, max_proposal=spec.max_proposal, max_model_len=self.max_model_len,
            policy=self.policies.speculation, ngram=ngram, draft=draft,
        )
        self.scheduler.release_listeners.append(speculator.release)
        logger.info("speculative decoding: %s, at most %d tokens per proposal", ", ".join(spec.methods), spec.max_proposal)
        return speculator

    def _kv_computed_by(self, config: EngineConfig) -> str:
        """What else decides a KV block's values, for the disk tier's key: the weights' storage
        (one format, and the per-layer exceptions a budget or policy chose) and the RoPE
        tables in use (LongRoPE picks short or long factors by ``max_model_len``)."""
        model = getattr(self.model_runner, "model", None)
        if model is None:  # the ranks hold the model (tensor parallelism): what was asked for
            return f"weights={config.weight_format} max_model_len={config.max_model_len}"
        formats = ",".join(f"{name}={fmt}" for name, fmt in sorted(model.layer_formats.items()))
        rope = hashlib.blake2b(digest_size=8)
        for rotary in (getattr(model, "rotary", None), getattr(model, "local_rotary", None)):
            if rotary is not None:  # position 1's angles: the frequencies, factors and scale
                rope.update(rotary.cos[1].float().cpu().numpy().tobytes())
                rope.update(rotary.sin[1].float().cpu().numpy().tobytes())
        return f"weights={model.weight_format} formats=[{formats}] rope={rope.hexdigest()}"

    def _build_tiers(self, config: EngineConfig) -> KVTiers | None:
        """The host and disk KV tiers the config asks for (None: neither)."""
        if not config.enable_prefix_caching or (config.kv_host_memory_bytes <= 0 and config.kv_disk_dir is None):
            return None
        kv_cache = self.model_runner.kv_cache
        block_nbytes = tier_block_nbytes(kv_cache)
        host_blocks = config.kv_host_memory_bytes // block_nbytes
        if config.kv_host_memory_bytes > 0 and host_blocks < 1:
            raise ValueError(
                f"EngineConfig.kv_host_memory_bytes={config.kv_host_memory_bytes} is below one KV block "
                f"({block_nbytes} bytes)"
            )
        disk = None
        if config.kv_disk_dir is not None:
            from core_engine.kv_offload import DiskKVStore, model_fingerprint

            mc = self.model_config
            layout = (
                f"kv-v1 kv={kv_cache.quant.name} storage={kv_cache.storage.dtype} compute={kv_cache.dtype} "
                f"layers={mc.num_layers} block={config.block_size} kv_heads={mc.num_kv_heads} head_dim={mc.head_dim} "
                f"{self._kv_computed_by(config)}"
            )
            disk = DiskKVStore(
                config.kv_disk_dir,
                capacity_bytes=config.kv_disk_bytes,
                fingerprint=model_fingerprint(config.model_path, extra=layout),
                block_nbytes=block_nbytes,
                # The writer absorbs a prefill's burst of new blocks; ~256 MiB at most.
                max_pending_writes=max(64, (256 * 2**20) // block_nbytes),
                logger=logging.getLogger("core_engine.kv_offload"),
            )
        tiers = KVTiers(
            kv_cache=kv_cache, kv_manager=self.kv_cache_manager, host_blocks=host_blocks, disk=disk,
            policy=self.policies.kv_offload, tenant_quota_fraction=config.kv_tenant_quota,
        )
        self.scheduler.tiers = tiers
        logger.info(
            "KV tiers: host %d blocks (%.0f MiB)%s",
            host_blocks, host_blocks * block_nbytes / 2**20,
            f", disk {config.kv_disk_dir} (up to {config.kv_disk_bytes / 2**30:.1f} GiB)" if disk is not None else "",
        )
        return tiers

    def use_policies(self, policies: EnginePolicies) -> None:
        """Consult ``policies`` from the next step on."""
        self.policies = policies
        if self.speculator is not None:
            self.speculator.policy = policies.speculation
        if self.tiers is not None:
            self.tiers.policy = policies.kv_offload

    def close(self) -> None:
        """Release what outlives a step: queued disk writes of the KV tiers are finished, the
        other tensor-parallel ranks stopped."""
        if self.tiers is not None:
            self.tiers.close()
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()

    @classmethod
    def from_config(cls, config: EngineConfig, *, policies: EnginePolicies | None = None) -> LLMEngine:
        """Load the GGUF named by ``config.model_path`` (and a draft model) and build the engine."""
        from core_engine.gguf_loader import load_model

        if config.num_threads is not None and config.device == "cpu":
            torch.set_num_threads(config.num_threads)
        config = apply_quantization_policy(config, (policies or EnginePolicies()).quantization)
        if config.tensor_parallel_size > 1:
            return cls._from_config_tensor_parallel(config, policies)
        dtype = resolve_dtype(config.dtype, config.device, config.weight_format)
        # The context window goes to the loader too: LongRoPE models choose their factors by it.
        model, _, tokenizer = load_model(
            config.model_path, dtype=dtype, device=config.device, max_model_len=config.max_model_len,
            packs_from_blocks=lambda file_type: packs_from_blocks(config, dtype, file_type),
        )
        pack_weights(model, config, tokenizer)
        draft_model = None
        spec = config.speculation
        if spec is not None and "draft" in spec.methods:
            assert spec.draft_model_path is not None
            if os.path.realpath(spec.draft_model_path) == os.path.realpath(config.model_path):
                draft_model = model  # its own draft (exactness tests): one copy of the weights
            else:
                draft_model, _, draft_tokenizer = load_model(
                    spec.draft_model_path, dtype=dtype, device=config.device, max_model_len=config.max_model_len,
                    packs_from_blocks=lambda file_type: packs_from_blocks(config, dtype, file_type, budget=False),
                )
                pack_weights(draft_model, config, draft_tokenizer, budget=False)
                if draft_tokenizer.stop_token_ids != tokenizer.stop_token_ids:
                    raise ValueError("speculation.draft_model_path: the draft's tokenizer is not the target's")
        return cls(config, model, tokenizer, dtype=dtype, policies=policies, draft_model=draft_model)

    @classmethod
    def _from_config_tensor_parallel(cls, config: EngineConfig, policies: EnginePolicies | None) -> LLMEngine:
        """Rank 0 of ``config.tensor_parallel_size`` ranks (:mod:`core_engine.distributed`)."""
        from core_engine.distributed.launcher import TensorParallelRanks, rank_threads

        threads = rank_threads(config)
        if threads is not None:
            torch.set_num_threads(threads)
        ranks, model, dtype, tokenizer = TensorParallelRanks.start(config)
        try:
            return cls(config, model, tokenizer, dtype=dtype, policies=policies, tensor_parallel=ranks)
        except BaseException:
            ranks.close()
            raise

    # -- requests --------------------------------------------------------------------------

    def make_request(
        self,
        req_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        labels: dict[str, str] | None = None,
        tenant: str | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Validate and tokenize (no engine state touched: safe from any thread). ``labels``
        and ``tenant`` are what the speculation policy sees of the request's origin;
        ``cache_salt`` is the prefix-cache partition it may hit (see :class:`Request`)."""
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer.encode(prompt, add_special=True, parse_special=True)
        else:
            prompt_ids = list(prompt)
            vocab = self.model_config.vocab_size
            if any(not 0 <= t < vocab for t in prompt_ids):
                raise InvalidParamError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        if not prompt_ids:
            raise InvalidParamError("the prompt is empty", param="prompt")
        num_prompt = len(prompt_ids)
        room = self.max_model_len - num_prompt
        if params.max_tokens is None:
            if room < 1:
                raise RequestTooLongError(
                    f"the prompt has {num_prompt} tokens; the context window is {self.max_model_len}",
                    param="prompt",
                )
            # "Until the context is full", and never more than the whole KV pool can hold.
            kv = self.kv_cache_manager
            max_tokens = max(1, min(room, kv.num_blocks * kv.block_size - num_prompt))
        elif params.max_tokens > room:
            raise RequestTooLongError(
                f"this model's context window is {self.max_model_len} tokens; the prompt has "
                f"{num_prompt} and max_tokens asks for {params.max_tokens} more",
                param="max_tokens",
            )
        else:
            max_tokens = params.max_tokens
        kv = self.kv_cache_manager
        if kv.num_blocks_for(num_prompt + max_tokens) > kv.num_blocks:
            raise RequestTooLongError(
                f"prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) needs more KV cache "
                f"than the engine has ({kv.num_blocks * kv.block_size} tokens)",
                param="prompt" if kv.num_blocks_for(num_prompt + 1) > kv.num_blocks else "max_tokens",
            )
        request = Request(
            req_id, prompt_ids, params, max_tokens=max_tokens, eos_token_ids=self.eos_token_ids,
            arrival_time=arrival_time, labels=labels, tenant=tenant, cache_salt=cache_salt,
        )
        if params.structured_outputs is not None:
            request.matcher = self.grammars.compile(params.structured_outputs)
        if params.thinking is not None:
            request.thinking = self.thinking_budget(params.thinking)
        if params.seed is not None and params.temperature > 0.0:
            request.generator = torch.Generator(device=self.model_runner.device).manual_seed(params.seed)
        return request

    def thinking_budget(self, params: ThinkingParams) -> ThinkingBudget:
        """The per-request state of a thinking budget, over this engine's tokenizer."""
        tokenizer = self.tokenizer
        end_ids = tokenizer.encode(params.end, add_special=False, parse_special=True)
        return ThinkingBudget(params, end_ids, lambda t: tokenizer.token_to_bytes(t, skip_special=False))

    def add_request(
        self,
        req_id: str,
        prompt: str | Sequence[int] | Request,
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
    ) -> Request:
        """Queue a request (a prompt, or a :class:`Request` from :meth:`make_request`)."""
        if isinstance(prompt, Request):
            request = prompt
        else:
            request = self.make_request(req_id, prompt, params or SamplingParams(), arrival_time=arrival_time)
        if request.req_id in self.scheduler.requests:
            raise InvalidParamError(f"request id {request.req_id!r} is already running", param="request_id")
        self._states[request.req_id] = _OutputState(self.tokenizer, request.sampling_params)
        self.scheduler.add_request(request)
        return request

    def make_prefill_request(
        self,
        req_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        labels: dict[str, str] | None = None,
        tenant: str | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """A prefill-only request: validated as the whole request would be, it stops after its
        first token and its last output carries ``prefilled`` (the prompt's KV blocks and that
        token) for :meth:`add_prefilled_request` on a decode engine."""
        request = self.make_request(
            req_id, prompt, params, arrival_time=arrival_time, labels=labels, tenant=tenant, cache_salt=cache_salt
        )
        request.max_tokens = 1
        request.kv_export = True
        return request

    def _export_if_prefilled(self, request: Request) -> None:
        if request.kv_export and request.output_token_ids and request.status != RequestStatus.FINISHED_ABORTED:
            self._prefilled[request.req_id] = self.handoff.export(request)

    def add_prefilled_request(self, request: Request, kv: PrefilledKV) -> Request:
        """Continue ``request`` (from :meth:`make_request`, same prompt) from a prefill
        engine's KV: the first token is appended, the prompt's blocks are written into the pool
        (blocks the prefix cache holds already are reused) and the request decodes from the
        next step. When the pool or the batch is full it waits instead, as a preempted request
        would (recomputed, its full blocks still cached). ``ValueError`` when ``kv`` is not
        this prompt's or not this engine's layout."""
        if request.req_id in self.scheduler.requests:
            raise InvalidParamError(f"request id {request.req_id!r} is already running", param="request_id")
        self.handoff.check(request, kv)
        scheduler = self.scheduler
        now = time.monotonic()
        request.append_output_token(kv.meta.first_token_id)
        if request.matcher is not None:  # a constrained request: its grammar saw the first token there
            request.matcher.consume_token(kv.meta.first_token_id)
        request.first_scheduled_time = request.first_token_time = now
        self._states[request.req_id] = _OutputState(self.tokenizer, request.sampling_params)
        if request.check_stop(self.max_model_len):
            request.finished_time = now
            request.num_cached_tokens = 0
            self._ready_outputs.append(self._make_output(request))
            return request
        scheduler.requests[request.req_id] = request
        if not self.handoff.import_blocks(request, kv):
            self.handoff.num_deferred += 1
            scheduler.waiting.append(request)  # pool short: recomputed when there is room
            return request
        scheduler.num_prompt_tokens_admitted += request.num_prompt_tokens
        scheduler.num_prompt_tokens_cached += request.num_cached_tokens or 0
        if len(scheduler.running) >= scheduler.max_num_seqs:
            # The batch is full: the written blocks stay in the prefix cache for its turn.
            self.handoff.num_deferred += 1
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
            scheduler.waiting.append(request)
            return request
        request.status = RequestStatus.RUNNING
        scheduler.running.append(request)
        return request

    def abort_request(self, req_ids: str | Iterable[str]) -> None:
        """Finish requests now (status ``FINISHED_ABORTED``); their KV blocks are freed at once."""
        ids = [req_ids] if isinstance(req_ids, str) else list(req_ids)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for req_id in ids:
            self._states.pop(req_id, None)
            self._prefilled.pop(req_id, None)

    def embed(self, token_ids: list[list[int]], pooling: str) -> list[torch.Tensor]:
        """Embeddings of whole sequences (``ModelRunner.embed``), in as few forwards as
        ``max_num_batched_tokens`` allows (a longer sequence has a forward of its own).

        Call on the engine's thread between steps (``AsyncLLM.call``). ``RequestTooLongError``
        (param ``input[i]``) for a sequence over ``max_model_len``; ``InvalidParamError`` for a
        token id outside the vocabulary or with tensor parallelism (rank 0 holds a shard).
        """
        if self.tensor_parallel is not None:
            raise InvalidParamError("embeddings are not served with tensor_parallel_size > 1", param="model")
        vocab = self.model_config.vocab_size
        for i, ids in enumerate(token_ids):
            if len(ids) > self.max_model_len:
                raise RequestTooLongError(
                    f"this model's maximum context length is {self.max_model_len} tokens; input {i} has {len(ids)}",
                    param=f"input[{i}]",
                )
            if any(not 0 <= t < vocab for t in ids):
                raise InvalidParamError(f"token ids must be below the vocabulary size {vocab}", param=f"input[{i}]")
        budget = self.config.max_num_batched_tokens
        vectors: list[torch.Tensor] = []
        group: list[list[int]] = []
        num_tokens = 0
        for ids in token_ids:
            if group and num_tokens + len(ids) > budget:
                vectors.extend(self.model_runner.embed(group, pooling))
                group, num_tokens = [], 0
            group.append(ids)
            num_tokens += len(ids)
        if group:
            vectors.extend(self.model_runner.embed(group, pooling))
        return vectors

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._ready_outputs)

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished_requests

    # -- the loop --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step and return the news of every request that made progress."""
        tiers = self.tiers
        if tiers is not None:
            tiers.begin_step(self.scheduler.running, self.scheduler.waiting)
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        ready, self._ready_outputs = self._ready_outputs, []
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            if tiers is not None and not ready:
                tiers.wait_for_loads(0.002)  # only requests waiting on disk reads are left
            return ready
        try:
            runner_output = self.model_runner.execute_model(scheduler_output)
        except RuntimeError as exc:  # a collective or a send to a rank failed
            if self.tensor_parallel is None:
                raise
            raise self.tensor_parallel.step_failed(exc) from exc
        if tiers is not None:
            tiers.after_step()
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        return ready + [self._make_output(request) for request in updated]

    def _make_output(self, request: Request) -> RequestOutput:
        state = self._states[request.req_id]
        new_ids = request.output_token_ids[state.num_emitted_tokens :]
        checker = state.stop_checker
        if len(new_ids) > 1 and checker.stop:
            # Several tokens in one step (a verified proposal): a stop string ends the output at
            # the token that completed it, as one-token steps would have.
            text = ""
            for j, token_id in enumerate(new_ids):
                text += checker.append(state.detokenizer.add_many([token_id]))
                if checker.matched is not None:
                    self._drop_tail(request, len(new_ids) - j - 1)
                    new_ids = new_ids[: j + 1]
                    break
        else:
            text = checker.append(state.detokenizer.add_many(new_ids))
        state.num_emitted_tokens = request.num_output_tokens
        if checker.matched is None and request.is_finished:
            text += checker.append(state.detokenizer.flush())
            text += checker.flush().text
        if checker.matched is not None and request.stop_reason is None:
            request.stop_reason = checker.matched
            if request.is_finished:
                request.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish_requests([request.req_id], RequestStatus.FINISHED_STOPPED)
        logprobs: tuple[TokenLogprobs, ...] | None = None
        if request.sampling_params.logprobs is not None:
            logprobs = tuple(request.pending_logprobs)  # type: ignore[arg-type]
            request.pending_logprobs.clear()
        prompt_logprobs = None
        if (
            request.wants_prompt_logprobs
            and not state.prompt_logprobs_sent
            and len(request.prompt_logprobs) >= request.num_prompt_tokens - 1
        ):
            prompt_logprobs = (None, *request.prompt_logprobs)
            state.prompt_logprobs_sent = True
        finished = request.is_finished
        prefilled = None
        if finished:
            self._states.pop(request.req_id, None)
            prefilled = self._prefilled.pop(request.req_id, None)
        return RequestOutput(
            req_id=request.req_id,
            new_token_ids=tuple(new_ids),
            new_text=text,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            finished=finished,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            cached_tokens_by_tier=request.cached_tokens_by_tier if finished and self.tiers is not None else None,
            metrics=RequestMetrics(
                arrival_time=request.arrival_time,
                first_scheduled_time=request.first_scheduled_time,
                first_token_time=request.first_token_time,
                finished_time=request.finished_time,
            )
            if finished
            else None,
            speculation=SpeculationMetrics(
                method=request.spec_method,
                num_drafts=request.num_drafts,
                num_draft_tokens=request.num_draft_tokens,
                num_accepted_tokens=request.num_accepted_tokens,
            )
            if finished and self.speculator is not None
            else None,
            prefilled=prefilled,
        )

    @staticmethod
    def _drop_tail(request: Request, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` output tokens (past a stop string)."""
        if num_tokens <= 0:
            return
        del request.output_token_ids[-num_tokens:]
        del request.all_token_ids[-num_tokens:]
        if request.pending_logprobs:
            del request.pending_logprobs[-num_tokens:]

    # -- introspection ---------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache_manager.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_manager.num_blocks

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()
