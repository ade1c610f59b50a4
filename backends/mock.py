"""A mock/echo backend for gateway tests: no model, deterministic, fault-injectable.

It answers with the request's own words: the last user message (chat) or the prompt
(completion), one word per token. Options (``[backends.options]``) make it slow or make it
fail before the first token or in the middle of the stream, so that routing, retries, the
circuit breaker and SSE error frames can be tested without a real upstream.
"""

from __future__ import annotations

import asyncio
import random
import zlib
from collections import deque
from collections.abc import AsyncIterator
from typing import Literal

import msgspec

from backends._option import decode_options
from backends.base import (
    BackendConfig,
    Capabilities,
    GenerationChunk,
    GenerationRequest,
    HealthStatus,
    ModelInfo,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from backends.errors import (
    BackendError,
    BackendUnavailableError,
    ContextLengthExceededError,
    InfermuxError,
    InvalidRequestError,
    UpstreamRateLimitError,
    UpstreamStatusError,
    UpstreamTimeoutError,
)
from core_engine.stop_checker import StopChecker

__all__ = ["MockBackend", "MockOptions", "create_backend"]

ErrorKind = Literal[
    "unavailable", "upstream_status", "rate_limit", "timeout", "invalid_request", "backend_error"
]

_ERRORS: dict[str, type[InfermuxError]] = {
    "unavailable": BackendUnavailableError,
    "upstream_status": UpstreamStatusError,
    "rate_limit": UpstreamRateLimitError,
    "timeout": UpstreamTimeoutError,
    "invalid_request": InvalidRequestError,
    "backend_error": BackendError,
}


#: A produced token: its id and, when asked for, its logprob entry.
_Token = tuple[int, TokenLogprob | None]


class MockOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of a ``kind = "mock"`` backend."""

    #: Name reported by ``model_info().id`` (default: ``mock-<backend name>``).
    model_id: str | None = None
    #: Pause before each token (simulates decode speed; lets tests cancel mid-stream).
    token_delay_s: float = 0.0
    #: Pause before the first token (simulates a slow prefill / a stalled upstream).
    first_token_delay_s: float = 0.0
    #: Raise this error kind instead of producing the first token.
    fail_before_first_token: ErrorKind | None = None
    #: Raise ``fail_after_error`` after this many tokens were streamed.
    fail_after_tokens: int | None = None
    fail_after_error: ErrorKind = "backend_error"
    #: ``Retry-After`` seconds carried by injected ``rate_limit`` errors.
    retry_after_s: float = 1.0
    context_length: int = 2048
    #: Instead of echoing, draw words from the input with ``random.Random(seed)``: same seed,
    #: same output; different choices of ``n`` (seed + i) differ.
    sample_words: bool = False
    #: What ``health()`` reports.
    healthy: bool = True
    #: Serve ``/tokenize``, ``/detokenize`` and ``count_tokens`` (a word is a token; the text
    #: of ids is the ids), after ``first_token_delay_s``: admission tests without a model.
    tokenize: bool = False


class MockBackend:
    """Echoes the input back word by word; see :class:`MockOptions` for fault injection.

    Counters (``num_started``, ``num_finished``, ``num_aborted``, ``num_failed``) and the last
    requests received (``received``) let tests observe what reached the backend.
    """

    kind = "mock"

    def __init__(self, config: BackendConfig) -> None:
        self.name = config.name
        self.config = config
        self.options = decode_options(config, MockOptions)
        self.capabilities = Capabilities(
            logprobs=True, echo=True, max_top_logprobs=20, tokenize=self.options.tokenize
        )
        self.received: deque[GenerationRequest] = deque(maxlen=1000)
        self.num_started = 0
        self.num_finished = 0
        self.num_aborted = 0
        self.num_failed = 0
        self.num_active = 0
        self._started = False

    async def start(self) -> None:
        """Nothing to load."""
        self._started = True

    def stats(self) -> dict[str, float]:
        """The counters, as ``/metrics`` and a worker process's supervisor read them."""
        return {
            "num_started": float(self.num_started),
            "num_finished": float(self.num_finished),
            "num_aborted": float(self.num_aborted),
            "num_failed": float(self.num_failed),
            "num_running": float(self.num_active),
        }

    def model_info(self) -> ModelInfo:
        """The mock's id and configured context length."""
        return ModelInfo(
            id=self.options.model_id or f"mock-{self.name}",
            context_length=self.options.context_length,
        )

    async def health(self) -> HealthStatus:
        """Reports ``options.healthy``."""
        return HealthStatus(ok=self.options.healthy, detail="mock")

    async def aclose(self) -> None:
        """Nothing to free."""
        self._started = False

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream the echoed words (see the module docstring)."""
        return self._generate(request)

    async def _generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        self.received.append(request)
        self.num_started += 1
        self.num_active += 1
        finished = False
        try:
            async for chunk in self._produce(request):
                yield chunk
            finished = True
            self.num_finished += 1
        except InfermuxError:
            finished = True
            self.num_failed += 1
            raise
        finally:
            self.num_active -= 1
            if not finished:
                self.num_aborted += 1

    async def _produce(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        options = self.options
        if request.kind in ("tokenize", "detokenize"):
            if options.first_token_delay_s > 0:
                await asyncio.sleep(options.first_token_delay_s)
            yield _token_answer(request)
            return
        params = request.params
        source_text, prompt_words = _input_words(request)
        prompt_tokens = len(prompt_words)
        if prompt_tokens > options.context_length:
            raise ContextLengthExceededError(
                f"this model's maximum context length is {options.context_length} tokens; "
                f"the input has {prompt_tokens}",
                param="messages" if request.kind == "chat" else "prompt",
            )
        if (
            params.max_tokens is not None
            and prompt_tokens + params.max_tokens > options.context_length
        ):
            raise ContextLengthExceededError(
                f"this model's maximum context length is {options.context_length} tokens; "
                f"the input has {prompt_tokens} and max_tokens asks for {params.max_tokens}",
                param="max_tokens",
            )
        if options.first_token_delay_s > 0:
            await asyncio.sleep(options.first_token_delay_s)
        if options.fail_before_first_token is not None:
            raise self._error(options.fail_before_first_token, "before the first token")

        words = _output_words(request, prompt_words, options.sample_words)
        max_tokens = params.max_tokens if params.max_tokens is not None else len(words)
        rng = random.Random(params.seed)
        stop_buffer: StopChecker[_Token] = StopChecker(params.stop)
        want_logprobs = params.logprobs or params.top_logprobs > 0

        if params.echo and request.kind == "completion":
            prompt_logprobs = None
            if want_logprobs:
                prompt_logprobs = tuple(
                    _fake_logprob(word, i, rng, params.top_logprobs, first=i == 0)
                    for i, word in enumerate(_as_tokens(prompt_words))
                )
            yield GenerationChunk(prompt_text=source_text, prompt_logprobs=prompt_logprobs)

        emitted = 0
        finish_reason: Literal["stop", "length"] = "stop"
        stopped = False
        for index, word in enumerate(_as_tokens(words)):
            if emitted >= max_tokens:
                finish_reason = "length"
                break
            if options.fail_after_tokens is not None and emitted >= options.fail_after_tokens:
                raise self._error(options.fail_after_error, f"after {emitted} tokens")
            if options.token_delay_s > 0:
                await asyncio.sleep(options.token_delay_s)
            emitted += 1
            entry = _fake_logprob(word, index, rng, params.top_logprobs) if want_logprobs else None
            release = stop_buffer.push(word, (_token_id(word), entry))
            if release.text or release.payloads:
                yield _chunk(release.text, release.payloads, want_logprobs)
            if release.stopped:
                stopped = True
                break
        if not stopped:
            tail = stop_buffer.flush()
            if tail.text or tail.payloads:
                yield _chunk(tail.text, tail.payloads, want_logprobs)
        yield GenerationChunk(
            finish_reason=finish_reason,
            stop_sequence=stop_buffer.matched,
            usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=emitted, cached_tokens=0),
        )

    def _error(self, kind: str, when: str) -> InfermuxError:
        message = f"mock backend {self.name!r} injected {kind} {when}"
        if kind == "rate_limit":
            return UpstreamRateLimitError(message, retry_after=self.options.retry_after_s)
        return _ERRORS[kind](message)


def _input_words(request: GenerationRequest) -> tuple[str, list[str]]:
    """The text the mock echoes and all input words (the prompt-token count)."""
    if request.kind == "chat":
        messages = request.messages or ()
        all_words = [w for m in messages for w in m.content.split()]
        last_user = next((m.content for m in reversed(messages) if m.role == "user"), "")
        return last_user, all_words
    prompt = request.prompt
    if isinstance(prompt, tuple):
        text = " ".join(str(token_id) for token_id in prompt)
    else:
        text = prompt or ""
    return text, text.split()


def _token_answer(request: GenerationRequest) -> GenerationChunk:
    """A ``tokenize`` request's word ids, or a ``detokenize`` request's ids as text."""
    if request.kind == "detokenize":
        ids = request.prompt if isinstance(request.prompt, tuple) else ()
        return GenerationChunk(text=" ".join(str(token_id) for token_id in ids), finish_reason="stop")
    if request.messages is not None:
        words = [w for m in request.messages for w in m.content.split()]
    else:
        words = _input_words(request)[1]
    return GenerationChunk(
        token_ids=tuple(_token_id(word) for word in words),
        finish_reason="stop",
        usage=Usage(prompt_tokens=len(words), completion_tokens=0),
    )


def _output_words(request: GenerationRequest, prompt_words: list[str], sample: bool) -> list[str]:
    if request.kind == "chat":
        source = next(
            (m.content for m in reversed(request.messages or ()) if m.role == "user"), ""
        ).split()
    else:
        source = prompt_words
    if not sample or not source:
        return source
    rng = random.Random(request.params.seed)
    return [rng.choice(source) for _ in range(len(source))]


def _as_tokens(words: list[str]) -> list[str]:
    # Word tokens carry their leading space, as BPE tokens do, so joined output reads naturally.
    return [word if i == 0 else " " + word for i, word in enumerate(words)]


def _token_id(token: str) -> int:
    return zlib.crc32(token.encode("utf-8")) % 50_000


def _fake_logprob(
    token: str, index: int, rng: random.Random, num_top: int, *, first: bool = False
) -> TokenLogprob:
    """A well-formed logprob entry: the chosen token has the highest logprob, all <= 0."""
    chosen = -rng.random() * 0.5
    alternatives = [
        TopLogprob(
            token=token if rank == 0 else f"{token.strip()}~{rank}",
            logprob=chosen if rank == 0 else chosen - rank - rng.random(),
            token_id=_token_id(token) if rank == 0 else _token_id(f"{token}~{rank}"),
            bytes=list((token if rank == 0 else f"{token.strip()}~{rank}").encode("utf-8")),
        )
        for rank in range(num_top)
    ]
    return TokenLogprob(
        token=token,
        logprob=None if first else chosen,
        token_id=_token_id(token),
        bytes=list(token.encode("utf-8")),
        top_logprobs=tuple(alternatives),
    )


def _chunk(text: str, payloads: list[_Token], want_logprobs: bool) -> GenerationChunk:
    return GenerationChunk(
        text=text,
        token_ids=tuple(token_id for token_id, _ in payloads),
        logprobs=tuple(e for _, e in payloads if e is not None) if want_logprobs else None,
    )


def create_backend(config: BackendConfig) -> MockBackend:
    """Factory registered for kind ``"mock"``."""
    return MockBackend(config)
