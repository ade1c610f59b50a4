"""One request's life on a slot of the llama.cpp runner: prompt progress and output.

A :class:`Sequence` is made when the runner admits a job to a slot and ends when the runner
ends it (finished, failed, cancelled or expired). In between, each step feeds it either a
chunk of its prompt or the token it sampled last, and :meth:`Sequence.accept` turns each new
token into output: stop token ids and end-of-generation tokens, incremental UTF-8 decoding
(a character split across tokens waits for its last byte), stop strings (text that may start
one is held back, and a match cuts the output before it), logprobs and ``max_tokens``.
With speculation its :class:`~backends._llamacpp_speculation.NgramProposer` sees every
accepted token, and the final chunk carries the proposer's
:class:`~backends.base.SpeculationStats`.
"""

from __future__ import annotations

import codecs
import time
from typing import Any

import numpy as np

from backends._llamacpp_model import LlamaModel
from backends._llamacpp_sampling import PromptLogprobs, logprob_entry
from backends._llamacpp_slot import Slot
from backends._llamacpp_speculation import NgramProposer
from backends._thread_job import ThreadJob
from backends.base import (
    EnginePhases,
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    TokenLogprob,
    Usage,
)
from core_engine.stop_checker import StopChecker

__all__ = ["Sequence", "wants_prompt_logprobs"]

#: A produced token: its id and, when asked for, its logprob entry.
_Token = tuple[int, TokenLogprob | None]


def wants_prompt_logprobs(request: GenerationRequest) -> bool:
    """Completions ``echo`` with logprobs: a logits row at every prompt position."""
    params = request.params
    wants_logprobs = params.logprobs or params.top_logprobs > 0
    return request.kind == "completion" and params.echo and wants_logprobs


class Sequence:
    """A request admitted to ``slot``; the slot's KV holds ``prompt[:num_computed]``."""

    def __init__(
        self,
        job: ThreadJob,
        slot: Slot,
        model: LlamaModel,
        *,
        prompt: list[int],
        prompt_text: str,
        num_cached: int,
        max_tokens: int,
        sampler: Any,
        queued_s: float,
        proposer: NgramProposer | None = None,
    ) -> None:
        request = job.request
        params = request.params
        self.job = job
        self.slot = slot
        self.prompt = prompt
        self.prompt_text = prompt_text
        #: Prompt tokens reused from the slot's KV (``Usage.cached_tokens``).
        self.num_cached = num_cached
        #: Prompt tokens whose KV is in the slot; the prompt is done when it reaches the end.
        self.num_computed = num_cached
        self.max_tokens = max_tokens
        #: llama.cpp sampler chain of this sequence alone (its seed, penalties' history).
        self.sampler = sampler
        self.want_logprobs = params.logprobs or params.top_logprobs > 0
        self.echo = params.echo and request.kind == "completion"
        self.prompt_logprobs = (
            PromptLogprobs(prompt, params.top_logprobs, model.piece)
            if wants_prompt_logprobs(request)
            else None
        )
        #: The token sampled last, fed to the next step (None while the prompt runs).
        self.next_token: int | None = None
        #: N-gram proposals and their counters (None: the backend does not speculate).
        self.proposer = proposer
        #: This step's proposed tokens, in the batch after ``next_token`` (verified after).
        self.drafts: list[int] = []
        self.num_generated = 0
        self.finish_reason: FinishReason = "length"
        self._model = model
        self._ignore_eos = params.ignore_eos
        self._num_top = params.top_logprobs
        self._stop_ids = frozenset(params.stop_token_ids)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop_buffer: StopChecker[_Token] = StopChecker(params.stop)
        # Tokens whose text is not out yet (a partial UTF-8 character, a held stop string).
        self._held: list[_Token] = []
        self._hit_stop_string = False
        self._queued_s = queued_s
        self._admitted_at = time.monotonic()
        self._prefill_s: float | None = None

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < len(self.prompt)

    def prompt_done(self) -> GenerationChunk | None:
        """Note the end of the prompt; the echo chunk to send first, if the request echoes."""
        self._prefill_s = time.monotonic() - self._admitted_at
        if not self.echo:
            return None
        entries = self.prompt_logprobs.entries if self.prompt_logprobs is not None else None
        return GenerationChunk(
            prompt_text=self.prompt_text,
            prompt_logprobs=tuple(entries) if entries is not None else None,
        )

    def accept(self, token: int, logprobs: np.ndarray | None) -> bool:
        """Take a sampled token (``logprobs``: its log-softmax row); True when finished."""
        if token in self._stop_ids or (token in self._model.eog_ids and not self._ignore_eos):
            self.finish_reason = "stop"
            return True
        self.num_generated += 1
        if self.proposer is not None:
            self.proposer.push(token)
        piece = self._model.piece(token)
        entry = None
        if logprobs is not None:
            entry = logprob_entry(logprobs, token, piece, self._num_top, self._model.piece)
        release = self._stop_buffer.push(self._decoder.decode(piece), (token, entry))
        self._held.extend(release.payloads)
        if release.text:
            self.job.send(self._chunk(release.text))
        if release.stopped:
            self.finish_reason = "stop"
            self._hit_stop_string = True
            return True
        if self.num_generated >= self.max_tokens:
            return True
        self.next_token = token
        return False

    def final_chunk(self) -> GenerationChunk:
        """The last chunk: what is still held, ``finish_reason``, usage and phases."""
        text = ""
        if not self._hit_stop_string:
            # Bytes of an unfinished UTF-8 character at the very end become U+FFFD.
            release = self._stop_buffer.push(self._decoder.decode(b"", final=True))
            self._held.extend(release.payloads)
            text = release.text
            if release.stopped:
                self.finish_reason = "stop"
            else:
                tail = self._stop_buffer.flush()
                text += tail.text
                self._held.extend(tail.payloads)
        has_held = bool(self._held)
        last = self._chunk(text)
        prefill_s = self._prefill_s
        decode_s = None
        if prefill_s is not None:
            decode_s = time.monotonic() - self._admitted_at - prefill_s
        return GenerationChunk(
            text=last.text,
            token_ids=last.token_ids,
            logprobs=last.logprobs if has_held else None,
            finish_reason=self.finish_reason,
            stop_sequence=self._stop_buffer.matched,
            usage=Usage(
                prompt_tokens=len(self.prompt),
                completion_tokens=self.num_generated,
                cached_tokens=self.num_cached,
            ),
            phases=EnginePhases(queued_s=self._queued_s, prefill_s=prefill_s, decode_s=decode_s),
            speculation=self.proposer.stats() if self.proposer is not None else None,
        )

    def _chunk(self, text: str) -> GenerationChunk:
        held, self._held = self._held, []
        return GenerationChunk(
            text=text,
            token_ids=tuple(token for token, _ in held),
            logprobs=tuple(e for _, e in held if e is not None) if self.want_logprobs else None,
        )
