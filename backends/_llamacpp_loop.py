"""The blocking half of the llama.cpp backend: prompt preparation and the token loop.

Everything here runs on the backend's one worker thread (a llama.cpp context is not
thread-safe). Sampling uses llama.cpp's own sampler chain; logprobs are computed from the
raw logits of the position being sampled, so they describe the model's distribution before
temperature and truncation, as OpenAI's and vLLM's do.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable
from typing import Any

import llama_cpp

from backends._llamacpp_sampling import (
    build_sampler,
    last_logits,
    logprob_entry,
    prompt_logprobs,
)
from backends._stop import StopBuffer
from backends.base import (
    EnginePhases,
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    TokenLogprob,
    Usage,
)
from backends.errors import (
    BackendError,
    ContextLengthExceededError,
    InvalidRequestError,
    UpstreamTimeoutError,
)
from core_engine.chat_template import FALLBACK_CHATML_TEMPLATE, ChatTemplate, ChatTemplateError

__all__ = ["LlamaRunner"]

#: A produced token: its id and, when asked for, its logprob entry.
_Token = tuple[int, TokenLogprob | None]


class LlamaRunner:
    """Prepares prompts and runs generations on llama.cpp contexts of one model.

    ``llm`` is the serving context (last-position logits only). ``make_echo_llm`` builds, on
    first use, a second context with ``logits_all=True`` for completions ``echo`` with
    logprobs: keeping every position's logits costs an extra LM-head pass per prompt token
    and an ``n_ctx x n_vocab`` score buffer, which ordinary requests should not pay.
    """

    def __init__(self, llm: Any, *, make_echo_llm: Callable[[], Any], default_seed: int | None):
        self.llm = llm
        self._make_echo_llm = make_echo_llm
        self._echo_llm: Any | None = None
        self._default_seed = default_seed
        self.n_ctx: int = llm.n_ctx()
        self.n_vocab: int = llm.n_vocab()
        metadata: dict[str, str] = dict(llm.metadata)
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        # End-of-generation tokens (eos, eot, <|endoftext|>...): scanning once is ~40 ms.
        self.eog_ids = frozenset(
            i for i in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)
        )
        self.add_bos = metadata.get("tokenizer.ggml.add_bos_token", "true") == "true"
        self.bos_id: int = llm.token_bos()
        bos_text = self._special_text(metadata.get("tokenizer.ggml.bos_token_id"))
        eos_text = self._special_text(metadata.get("tokenizer.ggml.eos_token_id"))
        self.template_source = metadata.get("tokenizer.chat_template")
        self.template = ChatTemplate(
            self.template_source or FALLBACK_CHATML_TEMPLATE,
            bos_token=bos_text,
            eos_token=eos_text,
        )
        self._bos_text = bos_text
        self._pieces: dict[int, bytes] = {}
        #: Tokens sampled since start, across requests (tests observe cancellation with it).
        self.num_generated_tokens = 0

    def close(self) -> None:
        for llm in (self.llm, self._echo_llm):
            if llm is not None:
                llm.close()
        self._echo_llm = None

    # -- prompt ---------------------------------------------------------------------------

    def prompt_tokens(self, request: GenerationRequest) -> tuple[list[int], str]:
        """Token ids and text of the request's prompt (chat rendered with the model template)."""
        if request.kind == "chat":
            messages = [
                {"role": m.role, "content": m.content}
                | ({"name": m.name} if m.name is not None else {})
                for m in request.messages or ()
            ]
            try:
                text = self.template.render(messages, add_generation_prompt=True)
            except ChatTemplateError as exc:
                raise InvalidRequestError(str(exc), param="messages") from exc
            add_bos = self.add_bos and not (self._bos_text and text.startswith(self._bos_text))
            return self._tokenize(text, add_bos=add_bos), text
        prompt = request.prompt
        if isinstance(prompt, tuple):
            bad = next((t for t in prompt if not 0 <= t < self.n_vocab), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"token id {bad} is outside the vocabulary (0..{self.n_vocab - 1})",
                    param="prompt",
                )
            tokens = list(prompt)
            return tokens, self.llm.detokenize(tokens).decode("utf-8", errors="replace")
        text = prompt or ""
        return self._tokenize(text, add_bos=self.add_bos), text

    def _tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        tokens: list[int] = self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)
        return tokens

    def _special_text(self, token_id: str | None) -> str:
        if token_id is None:
            return ""
        return self.llm.detokenize([int(token_id)], special=True).decode("utf-8", errors="replace")

    def check_context(self, request: GenerationRequest, num_prompt: int) -> int:
        """The effective ``max_tokens``; ``ContextLengthExceededError`` when it cannot fit."""
        param = "messages" if request.kind == "chat" else "prompt"
        if num_prompt >= self.n_ctx:
            raise ContextLengthExceededError(
                f"this model's maximum context length is {self.n_ctx} tokens; the {param} "
                f"has {num_prompt} tokens, leaving no room for output",
                param=param,
            )
        max_tokens = request.params.max_tokens
        if max_tokens is None:
            return self.n_ctx - num_prompt
        if num_prompt + max_tokens > self.n_ctx:
            raise ContextLengthExceededError(
                f"this model's maximum context length is {self.n_ctx} tokens; you requested "
                f"{num_prompt + max_tokens} ({num_prompt} in the {param}, {max_tokens} for "
                f"the completion). Reduce the length of the {param} or of max_tokens.",
                param="max_tokens",
            )
        return max_tokens

    # -- generation -----------------------------------------------------------------------

    def run(
        self,
        request: GenerationRequest,
        emit: Callable[[GenerationChunk], None],
        is_cancelled: Callable[[], bool],
    ) -> None:
        """Generate one choice, handing each chunk to ``emit``; returns early when cancelled."""
        params = request.params
        tokens, prompt_text = self.prompt_tokens(request)
        if not tokens:
            tokens = [self.bos_id]  # something must be evaluated to have logits to sample from
        max_tokens = self.check_context(request, len(tokens))
        want_logprobs = params.logprobs or params.top_logprobs > 0
        needs_prompt_logprobs = params.echo and want_logprobs and request.kind == "completion"
        llm = self._echo_context() if needs_prompt_logprobs else self.llm

        started = time.monotonic()
        num_cached = self._evaluate_prompt(llm, tokens, is_cancelled, request.deadline)
        if num_cached is None:
            return
        prefill_s = time.monotonic() - started
        if params.echo and request.kind == "completion":
            echoed = (
                prompt_logprobs(llm.scores, tokens, params.top_logprobs, self._piece)
                if needs_prompt_logprobs
                else None
            )
            emit(GenerationChunk(prompt_text=prompt_text, prompt_logprobs=echoed))

        sampler = build_sampler(
            params,
            n_vocab=self.n_vocab,
            n_ctx=self.n_ctx,
            eog_ids=self.eog_ids,
            default_seed=self._default_seed,
        )
        try:
            self._decode(
                llm, request, sampler, max_tokens, want_logprobs, emit, is_cancelled,
                num_prompt=len(tokens), num_cached=num_cached, prefill_s=prefill_s,
            )  # fmt: skip
        finally:
            llama_cpp.llama_sampler_free(sampler)

    def _decode(
        self,
        llm: Any,
        request: GenerationRequest,
        sampler: Any,
        max_tokens: int,
        want_logprobs: bool,
        emit: Callable[[GenerationChunk], None],
        is_cancelled: Callable[[], bool],
        *,
        num_prompt: int,
        num_cached: int,
        prefill_s: float,
    ) -> None:
        params = request.params
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        stop_buffer: StopBuffer[_Token] = StopBuffer(params.stop)
        stop_ids = set(params.stop_token_ids)
        held: list[_Token] = []  # tokens whose text is not out yet (partial UTF-8, held stop)
        num_generated = 0
        finish_reason: FinishReason = "length"
        hit_stop_string = False
        started = time.monotonic()
        while num_generated < max_tokens:
            if is_cancelled():
                return
            _check_deadline(request.deadline)
            logits = last_logits(llm, self.n_vocab) if want_logprobs else None
            token = llama_cpp.llama_sampler_sample(sampler, llm.ctx, -1)
            self.num_generated_tokens += 1
            if token in stop_ids or (token in self.eog_ids and not params.ignore_eos):
                finish_reason = "stop"
                break
            num_generated += 1
            piece = self._piece(token)
            entry = None
            if logits is not None:
                entry = logprob_entry(logits, token, piece, params.top_logprobs, self._piece)
            release = stop_buffer.push(decoder.decode(piece), (token, entry))
            held.extend(release.payloads)
            if release.text:
                emit(_chunk(release.text, held, want_logprobs))
                held = []
            if release.stopped:
                finish_reason = "stop"
                hit_stop_string = True
                break
            if num_generated < max_tokens:
                _eval(llm, [token])
        text = ""
        if not hit_stop_string:
            # Bytes of an unfinished UTF-8 character at the very end become U+FFFD.
            release = stop_buffer.push(decoder.decode(b"", final=True))
            held.extend(release.payloads)
            text = release.text
            if release.stopped:
                finish_reason = "stop"
            else:
                tail = stop_buffer.flush()
                text += tail.text
                held.extend(tail.payloads)
        last = _chunk(text, held, want_logprobs)
        emit(
            GenerationChunk(
                text=last.text,
                token_ids=last.token_ids,
                logprobs=last.logprobs if held else None,
                finish_reason=finish_reason,
                usage=Usage(
                    prompt_tokens=num_prompt,
                    completion_tokens=num_generated,
                    cached_tokens=num_cached,
                ),
                phases=EnginePhases(prefill_s=prefill_s, decode_s=time.monotonic() - started),
            )
        )

    def _evaluate_prompt(
        self,
        llm: Any,
        tokens: list[int],
        is_cancelled: Callable[[], bool],
        deadline: float | None,
    ) -> int | None:
        """Evaluate the prompt, reusing the common prefix already in the context.

        Returns how many prompt tokens came from the context (``cached_tokens``), or None when
        cancelled midway.
        """
        num_cached = 0
        for previous, current in zip(llm.input_ids[: llm.n_tokens].tolist(), tokens, strict=False):
            if previous != current:
                break
            num_cached += 1
        # The last prompt token is always evaluated again: its logits are sampled from.
        num_cached = min(num_cached, len(tokens) - 1)
        llm.n_tokens = num_cached  # eval() drops the KV cache past n_tokens
        batch = max(1, llm.n_batch)
        for start in range(num_cached, len(tokens), batch):
            if is_cancelled():
                return None
            _check_deadline(deadline)
            _eval(llm, tokens[start : start + batch])
        return num_cached

    def _echo_context(self) -> Any:
        if self._echo_llm is None:
            self._echo_llm = self._make_echo_llm()
        return self._echo_llm

    def _piece(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            piece = self.llm.detokenize([token])
            self._pieces[token] = piece
        return piece


def _eval(llm: Any, tokens: list[int]) -> None:
    try:
        llm.eval(tokens)
    except RuntimeError as exc:  # llama_decode failures (out of KV slots, compute errors)
        raise BackendError(f"llama.cpp failed to evaluate tokens: {exc}") from exc


def _check_deadline(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise UpstreamTimeoutError("the request's deadline passed during generation")


def _chunk(text: str, tokens: list[_Token], want_logprobs: bool) -> GenerationChunk:
    return GenerationChunk(
        text=text,
        token_ids=tuple(token for token, _ in tokens),
        logprobs=tuple(e for _, e in tokens if e is not None) if want_logprobs else None,
    )
