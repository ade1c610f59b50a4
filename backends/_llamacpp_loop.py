"""The blocking half of the llama.cpp backend: one worker thread batching every sequence.

A llama.cpp context is not thread-safe, so one dedicated thread owns it and runs a
continuous-batching loop, as ``llama-server -np N`` does. The context has ``parallel`` slots
(sequence ids), each with its own KV stream of ``n_ctx`` cells. Each step:

1. **admit**: queued jobs take free slots, FIFO; each prompt goes to the free slot whose
   cached tokens share the longest prefix with it (:mod:`backends._llamacpp_slot`; only
   slots filled under the request's ``cache_salt`` count), the slot's KV past that prefix
   is removed, and the reused length is ``cached_tokens``;
2. **schedule**: one ``llama_batch`` gets one token for every sequence that is generating
   (with speculation, followed by the tokens proposed for it), then prompt chunks of the
   sequences still reading their prompt (chunked prefill, oldest first), at most ``n_batch``
   tokens in all;
3. **decode** that batch with one ``llama_decode``;
4. **sample** every sequence whose last prompt token or last generated token was in the
   batch, with its own sampler chain from its own logits row (``llama_sampler_sample(chain,
   ctx, row)``); :class:`~backends._llamacpp_sequence.Sequence` turns the token into output.

Speculative decoding (``options.speculation``; absent, none of this runs): in step 2 the
speculation policy (:class:`~core_engine.policy.SpeculationPolicy`, asked per generating
sequence and step through :class:`~backends._llamacpp_speculation.SpeculationChooser`)
gives ``k``, clipped to ``max_proposal``, to the room left in the batch, to ``n_ctx`` and to
the sequence's ``max_tokens``; the sequence's
:class:`~backends._llamacpp_speculation.NgramProposer` proposes ``d_1..d_m`` (m <= k), which
go into the batch after ``next_token`` at the following positions, each with logits. In step
4 the rows are verified in order (:meth:`LlamaRunner._verify`): the token sampled from row
``j`` is emitted, and ``d_{j+1}`` stands only if it equals that token; the first mismatch,
the last row, or a finished sequence ends the step, and the KV of the rejected proposals is
removed (``llama_memory_seq_rm``). ``n_batch`` is raised to ``parallel * (1 +
max_proposal)`` if below, so every generating sequence's full proposal fits. Models with
recurrent state cannot cut a sequence's memory: speculation stays off for them.

A sequence ends when it finishes, and at the next step when it was cancelled (its reader
closed the stream) or passed its deadline (``UpstreamTimeoutError``); its slot keeps the KV
of the tokens it evaluated, for the next prompt that starts the same way. A failed
``llama_decode`` ends the sequences of that batch with ``BackendError`` and drops their KV;
the others go on. Logprobs come from the raw logits row of the sampled position (the
model's distribution before temperature and truncation, as OpenAI's and vLLM's do);
completions ``echo`` with logprobs asks a logits row at every prompt position of that
sequence alone (and so reuses no cached prefix). Chunks travel to the event loop through
:class:`~backends._thread_job.ThreadJob`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import llama_cpp

from backends._llamacpp_batch import TokenBatch
from backends._llamacpp_model import LlamaModel
from backends._llamacpp_sampling import build_sampler, log_softmax, logits_row, mask_logits
from backends._llamacpp_sequence import Sequence, wants_prompt_logprobs
from backends._llamacpp_slot import Slot, SlotPool
from backends._llamacpp_speculation import METHODS, NgramProposer, SpeculationChooser
from backends._thread_job import ThreadJob
from backends.base import GenerationChunk, GenerationRequest
from backends.context_window import check_context
from backends.errors import (
    BackendError,
    BackendUnavailableError,
    GenerationAbortedError,
    InfermuxError,
    UpstreamTimeoutError,
)
from core_engine.policy import SpeculationContext, SpeculationPolicy

__all__ = ["LlamaRunner"]

logger = logging.getLogger(__name__)

#: A sequence's part of one step: (sequence, its first batch row, how many rows).
_Scheduled = tuple[Sequence, int, int]


class LlamaRunner:
    """One llama.cpp context serving up to ``parallel`` sequences at once; see the module.

    ``submit`` and ``stop`` may be called from any thread; everything else of the context
    happens on the runner's own worker thread. ``RuntimeError`` when the context cannot be
    created.
    """

    def __init__(
        self,
        model: LlamaModel,
        *,
        name: str,
        n_ctx: int,
        parallel: int,
        n_batch: int,
        n_threads: int,
        n_threads_batch: int,
        default_seed: int | None,
        speculation_policy: SpeculationPolicy | None = None,
        max_proposal: int = 8,
        ngram_size: int = 3,
    ) -> None:
        self.model = model
        self.name = name
        #: Context length of one sequence (prompt plus output).
        self.n_ctx = n_ctx
        self.parallel = parallel
        self.template_source = model.template_source
        # A step carries one token of every generating sequence (and, speculating, its
        # proposed tokens): they must all fit.
        n_batch = max(n_batch, parallel)
        self._speculation: SpeculationChooser | None = None
        self._ngram_size = ngram_size
        if speculation_policy is not None and self._can_cut_sequences(model):
            self._speculation = SpeculationChooser(
                speculation_policy, max_proposal=max_proposal, name=name
            )
            n_batch = max(n_batch, parallel * (1 + max_proposal))
        elif speculation_policy is not None:
            logger.warning(
                "backend %s: the model keeps recurrent state, which cannot drop rejected "
                "proposals; speculative decoding is off",
                name,
            )
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx * parallel
        params.n_batch = n_batch
        params.n_ubatch = n_batch  # one compute pass per step
        params.n_seq_max = parallel
        # One KV stream per slot (as llama-server -np N): a sequence's attention reads only
        # its own cells. A unified cache made each read every slot's cells (masked): at 16
        # streams of ~281-token prompts infermux went from 0.66x to 1.05x llama-server with
        # this change (docs/benchmarks.md, serving results).
        params.kv_unified = False
        # flash_attn_type stays llama.cpp's default (auto: on for the CPU). Off, every step
        # would also materialise n_kv x n_ubatch attention scores per head (measured with a
        # unified cache: a 646 MiB compute buffer at 16 x 2048 cells instead of 98 MiB).
        params.n_threads = n_threads
        params.n_threads_batch = n_threads_batch
        params.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(model.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {n_ctx} x {parallel}")
        self._memory = llama_cpp.llama_get_memory(self.ctx)
        self._batch = TokenBatch(n_batch)
        self._slots = SlotPool(parallel)
        self._default_seed = default_seed
        #: Admitted sequences in admission order (worker thread only).
        self._running: list[Sequence] = []
        # Shared with other threads, under ``_lock``: submitted jobs not admitted yet (with
        # their submission time), every job not ended yet, and the stop flag.
        self._lock = threading.Condition()
        self._pending: collections.deque[tuple[ThreadJob, float]] = collections.deque()
        self._live: set[ThreadJob] = set()
        self._stopping = False
        #: Tokens sampled since start, across requests (tests observe cancellation with it).
        self.num_generated_tokens = 0
        #: ``llama_decode`` calls since start, and the most sequences one of them carried.
        self.num_decode_calls = 0
        self.max_sequences_per_decode = 0
        #: Speculation since start: drafts verified, tokens proposed, tokens accepted.
        self.spec_decode_num_drafts = 0
        self.spec_decode_num_draft_tokens = 0
        self.spec_decode_num_accepted_tokens = 0
        self._thread = threading.Thread(target=self._serve, name=f"llamacpp-{name}", daemon=True)
        self._thread.start()

    @staticmethod
    def _can_cut_sequences(model: LlamaModel) -> bool:
        """Whether rejected proposals can be removed from a sequence's memory."""
        raw = model.model
        return not (llama_cpp.llama_model_is_recurrent(raw) or llama_cpp.llama_model_is_hybrid(raw))

    @property
    def speculates(self) -> bool:
        return self._speculation is not None

    def use_speculation_policy(self, policy: SpeculationPolicy) -> None:
        """Consult ``policy`` from the next step on (no effect unless speculation is on)."""
        if self._speculation is not None:
            self._speculation.use_policy(policy)

    # -- any thread -----------------------------------------------------------------------

    def submit(self, job: ThreadJob) -> None:
        """Queue ``job``; its chunks, then None (or an error), arrive on its queue."""
        with self._lock:
            if self._stopping:
                raise BackendUnavailableError(f"backend {self.name!r} is shutting down")
            self._pending.append((job, time.monotonic()))
            self._live.add(job)
            self._lock.notify_all()

    def wait_idle(self) -> None:
        """Block until every job submitted so far has ended (blocking: call it off-loop)."""
        with self._lock:
            submitted = set(self._live)
            self._lock.wait_for(lambda: self._stopping or not submitted & self._live)

    def stop(self) -> None:
        """Abort every queued and running job now; the worker exits after its current step."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            for job in self._live:
                job.cancelled.set()
                job.send(GenerationAbortedError(f"backend {self.name!r} is shutting down"))
            self._lock.notify_all()

    def close(self) -> None:
        """:meth:`stop`, wait for the worker, free the context (blocking)."""
        self.stop()
        self._thread.join()
        self._batch.free()
        if self.ctx:
            llama_cpp.llama_free(self.ctx)
            self.ctx = None
        self.model.close()

    def check_context(self, request: GenerationRequest, num_prompt: int) -> int:
        """The effective ``max_tokens``; ``ContextLengthExceededError`` when it cannot fit."""
        return check_context(request, num_prompt, self.n_ctx)

    # -- worker thread --------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            while self._has_work():
                try:
                    self._step()
                except Exception as exc:  # a bug of this loop: fail what ran, keep serving
                    logger.exception("backend %s: llama.cpp step failed", self.name)
                    for seq in list(self._running):
                        self._trim(seq.slot, 0)
                        self._end(seq, BackendError(f"llama.cpp generation failed: {exc}"))
        finally:
            for seq in list(self._running):
                self._end(seq, None)  # stop() has told their readers already

    def _has_work(self) -> bool:
        with self._lock:
            while not (self._stopping or self._pending or self._running):
                self._lock.wait()
            return not self._stopping

    def _step(self) -> None:
        """One iteration of continuous batching: admit, schedule, decode once, sample."""
        self._admit()
        scheduled = self._schedule()
        if scheduled:
            self._run(scheduled)

    def _admit(self) -> None:
        """Give free slots to queued jobs (FIFO); drop queued jobs cancelled or expired."""
        if not self._pending:  # the common case, read without the lock (a stale read waits a step)
            return
        now = time.monotonic()
        admitted: list[tuple[ThreadJob, float]] = []
        with self._lock:
            num_free = self._slots.num_free
            kept: collections.deque[tuple[ThreadJob, float]] = collections.deque()
            for job, submitted_at in self._pending:
                deadline = job.request.deadline
                if job.cancelled.is_set():
                    self._live.discard(job)
                elif deadline is not None and now > deadline:
                    job.send(UpstreamTimeoutError("the request's deadline passed in the queue"))
                    job.send(None)
                    self._live.discard(job)
                elif len(admitted) < num_free:
                    admitted.append((job, submitted_at))
                else:
                    kept.append((job, submitted_at))
            self._pending = kept
            self._lock.notify_all()
        for job, submitted_at in admitted:
            self._start(job, queued_s=now - submitted_at)

    def _start(self, job: ThreadJob, *, queued_s: float) -> None:
        """Prepare the job's prompt and sampler and put it on the best slot."""
        request = job.request
        try:
            tokens, prompt_text = self.model.prompt_tokens(request, job.chat_text)
            if request.resume is not None:  # continue another backend's partial answer
                tokens = self.model.resumed_prompt(tokens, request.resume)
            if not tokens:
                tokens = [self.model.bos_id]  # something must be evaluated to sample from
            max_tokens = self.check_context(request, len(tokens))
            sampler = build_sampler(
                request.params,
                n_vocab=self.model.n_vocab,
                n_ctx=self.n_ctx,
                eog_ids=self.model.eog_ids,
                default_seed=self._default_seed,
            )
        except InfermuxError as exc:
            self._reject(job, exc)
            return
        except Exception as exc:
            logger.exception("backend %s: preparing a llama.cpp prompt failed", self.name)
            self._reject(job, BackendError(f"llama.cpp generation failed: {exc}"))
            return
        proposer = None
        # Constrained or budgeted (the next token may be forced): no drafts.
        if self._speculation is not None and job.matcher is None and job.thinking is None:
            proposer = NgramProposer(tokens, capacity=self.n_ctx, ngram_size=self._ngram_size)
        # Only a slot filled under this request's salt shares a prefix (issue 44): another
        # tenant's prompt must neither be reported as cached nor make this one faster.
        slot, num_shared = self._slots.acquire(tokens, request.cache_salt)
        # The last prompt token is always evaluated again: its logits are sampled from. Echo
        # with logprobs needs a logits row at every prompt position, so it reuses nothing.
        num_cached = 0 if wants_prompt_logprobs(request) else min(num_shared, len(tokens) - 1)
        num_cached = self._trim(slot, num_cached)
        self._running.append(
            Sequence(
                job,
                slot,
                self.model,
                prompt=tokens,
                prompt_text=prompt_text,
                num_cached=num_cached,
                max_tokens=max_tokens,
                sampler=sampler,
                queued_s=queued_s,
                proposer=proposer,
            )
        )

    def _trim(self, slot: Slot, num_kept: int) -> int:
        """Remove the slot's KV from position ``num_kept`` on; returns what was kept."""
        if num_kept > 0 and llama_cpp.llama_memory_seq_pos_min(self._memory, slot.seq_id) > 0:
            num_kept = 0  # a sliding-window cache has dropped the start of the sequence
        if not llama_cpp.llama_memory_seq_rm(self._memory, slot.seq_id, num_kept, -1):
            # Models with recurrent state cannot cut a sequence; they drop it whole.
            llama_cpp.llama_memory_seq_rm(self._memory, slot.seq_id, -1, -1)
            num_kept = 0
        del slot.tokens[num_kept:]
        return num_kept

    def _schedule(self) -> list[_Scheduled]:
        """Fill the batch: a token (and its proposals) per generating sequence, then prompt
        chunks."""
        batch = self._batch
        batch.clear()
        scheduled: list[_Scheduled] = []
        generating: list[Sequence] = []
        now = time.monotonic()
        for seq in list(self._running):
            deadline = seq.job.request.deadline
            if seq.job.cancelled.is_set():
                self._end(seq, None)
            elif deadline is not None and now > deadline:
                self._end(seq, UpstreamTimeoutError("the request's deadline passed"))
            elif seq.next_token is not None:
                generating.append(seq)
        if self._speculation is not None:
            self._propose(generating)
        for seq in generating:
            assert seq.next_token is not None
            position = len(seq.slot.tokens)
            seq_id = seq.slot.seq_id
            row = batch.add(seq.next_token, position, seq_id, True)
            for i, token in enumerate(seq.drafts, start=1):
                batch.add(token, position + i, seq_id, True)
            scheduled.append((seq, row, 1 + len(seq.drafts)))
        for seq in self._running:
            if batch.room == 0:
                break
            if not seq.is_prefilling:
                continue
            first_row = batch.num_tokens
            start = seq.num_computed
            end = min(len(seq.prompt), start + batch.room)
            last = len(seq.prompt) - 1
            every_row = seq.prompt_logprobs is not None
            seq_id = seq.slot.seq_id
            prompt = seq.prompt
            for position in range(start, end):
                batch.add(prompt[position], position, seq_id, every_row or position == last)
            scheduled.append((seq, first_row, end - start))
        return scheduled

    def _propose(self, generating: list[Sequence]) -> None:
        """Set each generating sequence's ``drafts`` for this step, as its policy decides.

        A sequence's proposals never take it past ``n_ctx`` or its ``max_tokens`` (a step
        emits at most one token more than it proposes), and all of them fit in the batch
        beside one row per generating sequence.
        """
        assert self._speculation is not None
        room = self._batch.room - len(generating)
        for seq in generating:
            seq.drafts = []
            proposer = seq.proposer
            if proposer is None or room <= 0:
                continue
            request = seq.job.request
            k = self._speculation.choose(
                SpeculationContext(
                    req_id=request.request_id,
                    methods=METHODS,
                    num_prompt_tokens=len(seq.prompt),
                    num_output_tokens=seq.num_generated,
                    temperature=request.params.temperature,
                    num_running=len(generating),
                    num_proposed_tokens=proposer.num_draft_tokens,
                    num_accepted_tokens=proposer.num_accepted_tokens,
                    labels=request.labels,
                    tenant=request.tenant,
                )
            )
            position = len(seq.slot.tokens)  # where next_token goes
            k = min(k, room, self.n_ctx - 1 - position, seq.max_tokens - seq.num_generated - 1)
            if k <= 0:
                continue
            seq.drafts = proposer.propose(k)
            room -= len(seq.drafts)

    def _run(self, scheduled: list[_Scheduled]) -> None:
        """Decode the batch once, then move every scheduled sequence on by its rows."""
        rc = self._batch.decode(self.ctx)
        self.num_decode_calls += 1
        self.max_sequences_per_decode = max(self.max_sequences_per_decode, len(scheduled))
        if rc != 0:
            # 1: no KV room for the batch; <0 or 2: the KV may hold part of it. Either way
            # the sequences in this batch cannot go on; the ones waiting outside it can.
            logger.error("backend %s: llama_decode returned %d", self.name, rc)
            for seq, _, _ in scheduled:
                self._trim(seq.slot, 0)
                self._end(seq, BackendError(f"llama.cpp failed to decode (llama_decode={rc})"))
            return
        for seq, first_row, num_rows in scheduled:
            try:
                self._advance(seq, first_row, num_rows)
            except Exception as exc:
                logger.exception("backend %s: llama.cpp sequence failed", self.name)
                self._trim(seq.slot, 0)
                self._end(seq, BackendError(f"llama.cpp generation failed: {exc}"))

    def _advance(self, seq: Sequence, first_row: int, num_rows: int) -> None:
        slot = seq.slot
        if seq.is_prefilling:
            start = seq.num_computed
            slot.tokens.extend(seq.prompt[start : start + num_rows])
            if seq.prompt_logprobs is not None:
                for k in range(num_rows):
                    logits = logits_row(self.ctx, first_row + k, self.model.n_vocab)
                    seq.prompt_logprobs.add_row(start + k, logits)
            seq.num_computed += num_rows
            if seq.is_prefilling:
                return
            echo = seq.prompt_done()
            if echo is not None:
                seq.job.send(echo)
            if seq.max_tokens == 0:
                self._end(seq, seq.final_chunk())
                return
        elif seq.drafts:
            self._verify(seq, first_row)
            return
        else:
            assert seq.next_token is not None
            slot.tokens.append(seq.next_token)
        last_row = first_row + num_rows - 1
        logprobs = None
        if seq.want_logprobs:
            logprobs = log_softmax(logits_row(self.ctx, last_row, self.model.n_vocab))
        thinking = seq.job.thinking
        # A constraint applies once a thinking block (if any) is over.
        matcher = seq.job.matcher if thinking is None or thinking.is_done else None
        if matcher is not None:  # the llguidance mask, written into the row the sampler reads
            mask_logits(matcher, logits_row(self.ctx, last_row, self.model.n_vocab), self.model.eog_ids)
        token = llama_cpp.llama_sampler_sample(seq.sampler, self.ctx, last_row)
        if thinking is not None:
            forced = thinking.forced_token()  # a spent thinking budget: its end marker
            token = forced if forced is not None else token
            thinking.observe(token)
        if matcher is not None and not matcher.consume_token(token):
            logger.warning("backend %s: the constraint refused token %d (%s)", self.name, token, matcher.get_error())
        self.num_generated_tokens += 1
        if seq.accept(token, logprobs):
            self._end(seq, seq.final_chunk())

    def _verify(self, seq: Sequence, first_row: int) -> None:
        """Emit the tokens sampled from a speculating sequence's rows while they confirm it.

        Row ``j`` holds ``next_token`` (j = 0) or proposal ``d_j``; the token ``t_j`` sampled
        from it is emitted, and proposal ``d_{j+1}`` stands (its KV is valid) only when
        ``t_j == d_{j+1}``. The first mismatch, the last row, or a token that finishes the
        sequence ends the step. For a proposal that is one fixed token this is rejection
        sampling, so the output has the target's distribution; and the chain only ever
        accepts (penalty history, grammar) the tokens that are emitted. The KV of the
        rejected proposals is removed.
        """
        slot = seq.slot
        proposer = seq.proposer
        assert seq.next_token is not None and proposer is not None
        drafts, seq.drafts = seq.drafts, []
        slot.tokens.append(seq.next_token)
        num_accepted = 0
        for j in range(len(drafts) + 1):
            row = first_row + j
            logprobs = None
            if seq.want_logprobs:
                logprobs = log_softmax(logits_row(self.ctx, row, self.model.n_vocab))
            token = llama_cpp.llama_sampler_sample(seq.sampler, self.ctx, row)
            self.num_generated_tokens += 1
            confirmed = j < len(drafts) and token == drafts[j]
            if confirmed:
                slot.tokens.append(token)  # evaluated at this position as d_{j+1}
                num_accepted += 1
            if seq.accept(token, logprobs):
                self._record(proposer, len(drafts), num_accepted)
                self._cut(seq)
                self._end(seq, seq.final_chunk())
                return
            if not confirmed:
                break
        self._record(proposer, len(drafts), num_accepted)
        self._cut(seq)

    def _record(self, proposer: NgramProposer, num_draft_tokens: int, num_accepted: int) -> None:
        proposer.record(num_draft_tokens, num_accepted)
        self.spec_decode_num_drafts += 1
        self.spec_decode_num_draft_tokens += num_draft_tokens
        self.spec_decode_num_accepted_tokens += num_accepted

    def _cut(self, seq: Sequence) -> None:
        """Drop the KV past ``slot.tokens`` (rejected proposals); a failure fails the sequence."""
        slot = seq.slot
        if not llama_cpp.llama_memory_seq_rm(self._memory, slot.seq_id, len(slot.tokens), -1):
            raise RuntimeError("llama.cpp could not remove rejected proposals from the KV cache")

    def _end(self, seq: Sequence, outcome: GenerationChunk | InfermuxError | None) -> None:
        """The one way out of a sequence: its last item, then its sampler and slot freed."""
        self._running.remove(seq)
        llama_cpp.llama_sampler_free(seq.sampler)
        self._slots.release(seq.slot)
        if outcome is not None:
            seq.job.send(outcome)
        seq.job.send(None)
        with self._lock:
            self._live.discard(seq.job)
            self._lock.notify_all()

    def _reject(self, job: ThreadJob, error: InfermuxError) -> None:
        """A job that never got a slot (bad prompt, no room in the context)."""
        job.send(error)
        job.send(None)
        with self._lock:
            self._live.discard(job)
            self._lock.notify_all()
