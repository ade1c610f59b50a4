"""The blocking half of the MLX backend: prompts, the prompt cache and the token loop.

Everything here runs on the backend's one worker thread, which owns the single prompt cache.
MLX's random state is global to the process, so generations run one after another, across
MLX backends too (a seeded request is reproducible only if nothing else draws from the RNG
meanwhile).

The token loop is mlx-lm's ``generate_step`` (prefill in chunks, then one token per step with
the next step computed while the current token is handed out); this module adds stop strings
and stop ids, logprobs, usage, cancellation and the prompt cache. Logprobs describe the
model's distribution after penalties, before temperature and truncation.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step, generation_stream

from backends.base import (
    EnginePhases,
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    ResumeState,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from backends.chat_plan import ChatOptions, ChatPlan, load_chat, plan_chat
from backends.context_window import check_context
from backends.errors import (
    InvalidRequestError,
    UpstreamTimeoutError,
)
from backends.mlx import sampling
from backends.mlx.prompt_cache import PromptCache
from backends.mlx.tokenizer import MLXTokenizer
from backends.resume import resumed_prompt
from core_engine.chat.content_text import ControlTexts
from core_engine.stop_checker import StopChecker

__all__ = ["MLXRunner"]

#: A produced token: its id and, when asked for, its logprob entry.
_Token = tuple[int, TokenLogprob | None]


#: MLX's random state is process-wide: generations of every MLX backend in this process take
#: turns, so that a seeded request is reproducible even with two MLX backends configured.
_GENERATION_LOCK = threading.Lock()


class _Cancelled(Exception):
    """Raised inside the prefill callback to leave ``generate_step`` early."""


class MLXRunner:
    """Runs generations of one loaded model, keeping the KV cache of the last one for reuse."""

    def __init__(
        self,
        model: Any,
        tokenizer: MLXTokenizer,
        *,
        n_ctx: int,
        prefill_step_size: int,
        use_prompt_cache: bool,
        default_seed: int | None,
        chat: ChatOptions | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        #: Structured-output constraints over this vocabulary (built on first use).
        self._grammars: Any = None
        self.n_ctx = n_ctx
        self.n_vocab: int = int(model.args.vocab_size)
        self._prefill_step_size = prefill_step_size
        self._default_seed = default_seed
        self.template, self.chat_format = load_chat(
            chat, tokenizer.chat_template, bos_token=tokenizer.bos_text, eos_token=tokenizer.eos_text,
            control_texts=ControlTexts(tokenizer.control_texts()),
        )
        self._prompt_cache = PromptCache(enabled=use_prompt_cache)
        #: Tokens sampled since start, across requests (tests observe cancellation with it).
        self.num_generated_tokens = 0

    def close(self) -> None:
        """Free the model and the cache on this (the worker) thread, where MLX made them."""
        self._prompt_cache.clear()
        self.model = None
        mx.synchronize()
        mx.clear_cache()

    # -- prompt ---------------------------------------------------------------------------

    def prompt_tokens(self, request: GenerationRequest, plan: ChatPlan | None = None) -> list[int]:
        """Token ids of the request's prompt (a chat: its plan's rendered text)."""
        tokenizer = self.tokenizer
        if request.kind == "chat":
            if plan is None:
                plan = plan_chat(request, self.template, self.chat_format)
            text = plan.text
            # The template writes BOS itself when the model wants one at the very start.
            add_bos = tokenizer.add_bos and not (
                tokenizer.bos_text and text.startswith(tokenizer.bos_text)
            )
            # The content's control-token texts are text (core_engine.chat.content_text).
            return self.template.control_texts.encode(
                text,
                lambda piece, add_special, parse_special: tokenizer.encode(
                    piece, add_bos=add_special, parse_special=parse_special
                ),
                add_special=add_bos,
            )
        prompt = request.prompt
        if isinstance(prompt, tuple):
            bad = next((t for t in prompt if not 0 <= t < self.n_vocab), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"token id {bad} is outside the vocabulary (0..{self.n_vocab - 1})",
                    param="prompt",
                )
            return list(prompt)
        return tokenizer.encode(prompt or "", add_bos=tokenizer.add_bos)

    def resumed_prompt(self, tokens: list[int], resume: ResumeState) -> list[int]:
        """The prompt followed by the earlier backend's output (backends/resume.py)."""
        return resumed_prompt(
            tokens, resume, lambda text: self.tokenizer.encode(text, add_bos=False, parse_special=False)
        )

    def check_context(self, request: GenerationRequest, num_prompt: int) -> int:
        """The effective ``max_tokens``; ``ContextLengthExceededError`` when it cannot fit."""
        return check_context(request, num_prompt, self.n_ctx)

    # -- generation -----------------------------------------------------------------------

    def _compile(self, structured: dict[str, Any]) -> Any:
        """The llguidance matcher of a request's constraint (the core engine's compiler over
        this tokenizer's vocabulary); ``InvalidRequestError`` naming the field."""
        from core_engine.errors import InvalidParamError
        from core_engine.structured import GrammarCompiler, StructuredOutput

        if self._grammars is None:
            tokenizer, n_vocab = self.tokenizer, self.n_vocab

            def make_tokenizer() -> Any:
                eos = sorted(t for t in tokenizer.eos_token_ids if t < n_vocab)
                core = getattr(tokenizer, "core", None)
                if core is not None:  # GGUF: the core engine's tokenizer
                    from core_engine.structured.compiler import llguidance_tokenizer

                    return llguidance_tokenizer(core, n_vocab, eos)
                from llguidance.hf import from_tokenizer

                return from_tokenizer(tokenizer.hf, n_vocab=n_vocab, eos_token=eos)  # type: ignore[attr-defined]  # the HF tokenizer of a non-GGUF MLX model

            self._grammars = GrammarCompiler(make_tokenizer)
        try:
            return self._grammars.compile(StructuredOutput.from_request(structured))
        except InvalidParamError as exc:
            raise InvalidRequestError(exc.message, param=exc.param) from exc

    def run(
        self,
        request: GenerationRequest,
        emit: Callable[[GenerationChunk], None],
        is_cancelled: Callable[[], bool],
        *,
        plan: ChatPlan | None = None,
    ) -> None:
        """Generate one choice, handing each chunk to ``emit``; returns early when cancelled."""
        with _GENERATION_LOCK:
            if not is_cancelled():
                self._run(request, emit, is_cancelled, plan)

    def _run(
        self,
        request: GenerationRequest,
        emit: Callable[[GenerationChunk], None],
        is_cancelled: Callable[[], bool],
        plan: ChatPlan | None,
    ) -> None:
        params = request.params
        tokens = self.prompt_tokens(request, plan)
        if request.resume is not None:  # continue another backend's partial answer
            tokens = self.resumed_prompt(tokens, request.resume)
        structured = plan.structured_outputs if plan is not None else request.structured_outputs
        matcher = None if structured is None else self._compile(structured)
        if not tokens:
            if self.tokenizer.bos_token_id is None:
                raise InvalidRequestError("the prompt is empty", param="prompt")
            tokens = [self.tokenizer.bos_token_id]
        max_tokens = self.check_context(request, len(tokens))
        if max_tokens == 0:
            emit(_last_chunk("", [], False, "length", len(tokens), 0, 0, None, 0.0))
            return
        seed = params.seed if params.seed is not None else self._default_seed
        mx.random.seed(seed if seed is not None else random.getrandbits(32))

        # Only the prompt cache of this request's salt is reused (issue 44).
        cache, num_cached = self._prompt_cache.take(self.model, tokens, request.cache_salt)
        fed: list[int] = tokens[:num_cached]  # what the cache holds, then what is fed to it
        suffix = tokens[num_cached:]
        fed.extend(suffix)
        banned = () if not params.ignore_eos else self.tokenizer.eos_token_ids
        processors = sampling.logits_processors(
            params,
            prompt_ids=tokens,
            num_fed_prompt=len(suffix),
            vocab_size=self.n_vocab,
            banned_ids=[t for t in banned if t < self.n_vocab],
        )
        if matcher is not None:
            eos = [t for t in self.tokenizer.eos_token_ids if t < self.n_vocab]
            processors.append(sampling.ConstraintProcessor(matcher, len(suffix), eos))

        def on_prefill_progress(done: int, total: int) -> None:
            if is_cancelled():
                raise _Cancelled
            _check_deadline(request.deadline)

        started = time.monotonic()
        steps = generate_step(
            mx.array(suffix),
            self.model,
            max_tokens=max_tokens,
            sampler=sampling.sampler(params),
            logits_processors=processors or None,
            prompt_cache=cache,
            prefill_step_size=self._prefill_step_size,
            prompt_progress_callback=on_prefill_progress,
        )
        try:
            self._decode(
                request, steps, emit, is_cancelled, fed,
                max_tokens=max_tokens, num_prompt=len(tokens), num_cached=num_cached,
                started=started,
            )  # fmt: skip
        except _Cancelled:
            pass  # cancelled during prefill: the cache holds the chunks done so far
        except BaseException:
            self._prompt_cache.clear()  # state unknown: start afresh next time
            raise
        finally:
            steps.close()
            # generate_step computes one step ahead; let it finish here rather than race the
            # next request (or interpreter exit, which MLX's worker threads do not survive).
            mx.synchronize(generation_stream)
        self._prompt_cache.keep(cache, fed)

    def _decode(
        self,
        request: GenerationRequest,
        steps: Any,
        emit: Callable[[GenerationChunk], None],
        is_cancelled: Callable[[], bool],
        fed: list[int],
        *,
        max_tokens: int,
        num_prompt: int,
        num_cached: int,
        started: float,
    ) -> None:
        params = request.params
        want_logprobs = params.logprobs or params.top_logprobs > 0
        decoder = self.tokenizer.text_stream(fed[:num_prompt])
        stop_buffer: StopChecker[_Token] = StopChecker(params.stop)
        stop_ids = set(params.stop_token_ids)
        eos_ids = frozenset() if params.ignore_eos else self.tokenizer.eos_token_ids
        held: list[_Token] = []  # tokens whose text is not out yet (partial UTF-8, held stop)
        num_generated = 0
        finish_reason: FinishReason = "length"
        hit_stop_string = False
        prefill_s: float | None = None
        for token, logprobs in steps:
            if prefill_s is None:
                prefill_s = time.monotonic() - started
            fed.append(token)
            self.num_generated_tokens += 1
            if is_cancelled():
                return
            _check_deadline(request.deadline)
            if token in stop_ids or token in eos_ids:
                finish_reason = "stop"
                break
            num_generated += 1
            entry = None
            if want_logprobs:
                entry = self._logprob_entry(logprobs, token, params.top_logprobs)
            release = stop_buffer.push(decoder.add(token), (token, entry))
            held.extend(release.payloads)
            if release.text:
                emit(_chunk(release.text, held, want_logprobs))
                held = []
            if release.stopped:
                finish_reason = "stop"
                hit_stop_string = True
                break
            if num_generated >= max_tokens:
                break
        text = ""
        if not hit_stop_string:
            release = stop_buffer.push(decoder.flush())
            held.extend(release.payloads)
            text = release.text
            if release.stopped:
                finish_reason = "stop"
            else:
                tail = stop_buffer.flush()
                text += tail.text
                held.extend(tail.payloads)
        emit(
            _last_chunk(
                text,
                held,
                want_logprobs,
                finish_reason,
                num_prompt,
                num_generated,
                num_cached,
                prefill_s,
                time.monotonic() - started - (prefill_s or 0.0),
                stop_sequence=stop_buffer.matched,
            )  # fmt: skip
        )

    # -- logprobs -------------------------------------------------------------------------

    def _logprob_entry(self, logprobs: mx.array, token: int, num_top: int) -> TokenLogprob:
        values = np.asarray(logprobs.astype(mx.float32))  # (vocab,)
        piece = self.tokenizer.token_bytes(token)
        top: tuple[TopLogprob, ...] = ()
        if num_top > 0:
            ids = np.argpartition(-values, num_top - 1)[:num_top]
            ids = ids[np.argsort(-values[ids], kind="stable")]
            top = tuple(self._top_entry(int(i), float(values[i])) for i in ids)
        return TokenLogprob(
            token=piece.decode("utf-8", errors="replace"),
            logprob=float(values[token]),
            token_id=token,
            bytes=list(piece),
            top_logprobs=top,
        )

    def _top_entry(self, token_id: int, logprob: float) -> TopLogprob:
        piece = self.tokenizer.token_bytes(token_id)
        return TopLogprob(
            token=piece.decode("utf-8", errors="replace"),
            logprob=logprob,
            token_id=token_id,
            bytes=list(piece),
        )


def _check_deadline(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise UpstreamTimeoutError("the request's deadline passed during generation")


def _chunk(text: str, tokens: list[_Token], want_logprobs: bool) -> GenerationChunk:
    return GenerationChunk(
        text=text,
        token_ids=tuple(token for token, _ in tokens),
        logprobs=tuple(e for _, e in tokens if e is not None) if want_logprobs else None,
    )


def _last_chunk(
    text: str,
    tokens: list[_Token],
    want_logprobs: bool,
    finish_reason: FinishReason,
    num_prompt: int,
    num_generated: int,
    num_cached: int,
    prefill_s: float | None,
    decode_s: float,
    *,
    stop_sequence: str | None = None,
) -> GenerationChunk:
    last = _chunk(text, tokens, want_logprobs)
    return GenerationChunk(
        text=last.text,
        token_ids=last.token_ids,
        logprobs=last.logprobs if tokens else None,
        finish_reason=finish_reason,
        stop_sequence=stop_sequence,
        usage=Usage(
            prompt_tokens=num_prompt, completion_tokens=num_generated, cached_tokens=num_cached
        ),
        phases=EnginePhases(prefill_s=prefill_s, decode_s=decode_s),
    )
