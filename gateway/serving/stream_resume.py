"""Mid-stream failover that resumes (``[[models]] resume_on_failure = true``).

The router commits a request to a backend once its first chunk exists. Without this module
a failure later ends the client's stream with an error frame. With it, a retryable failure
after the first byte (the worker died, an upstream's stream broke: its process killed, a
reset, a body cut short; an idle or total timeout) hands the answer to the next backend of
the alias, which continues it:

- on a backend that serves the same model (the same model id) and honours
  ``Capabilities.resume``, from the exact token ids sent so far (the held-back ones of a
  stop-string candidate or a cut UTF-8 character included), so that a greedy answer is the
  one an unbroken stream would have given;
- on another model, from the text the client received (the partial answer as the start
  of the assistant turn);
- a plain-text completion prompt may also continue on a backend without ``resume``
  (a remote server): the received text is appended to the prompt;
- a request that itself continued the client's last assistant message
  (``continue_final_message``: it arrived with a ``resume``), from that message's text
  followed by the text streamed since (never from token ids: the client's part has none).

An ``openai`` remote honours ``resume`` when its upstream speaks vLLM's
``continue_final_message`` (the backend option of that name).

The client's stream goes on with neither duplicate nor missing text (backends/resume.py),
``max_tokens`` of the continuation is what is left, the tries of the whole answer count
against the alias's ``max_retries``, and the usage is the sum of what each
backend did: the failed one's output (its prompt as the next one counted it, when the token
ids carried over), then the next one's, whose prompt includes the re-prefilled output
(``cached_tokens`` where it had the prefix). :attr:`ResumingStream.segments` keeps each
backend's share for the cost ledger (one record, both backends' costs); every attempt goes
through the router's attempt hooks (one span each).

Requests that constrain or parse the output (tools, structured outputs, a thinking budget,
echo) are not resumed: the constraint's state does not carry over.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import msgspec

from backends.base import GenerationChunk, GenerationRequest, ResumeState, Usage
from backends.errors import BackendError, GenerationAbortedError, InfermuxError

if TYPE_CHECKING:
    from gateway.serving.router import Attempt, ModelRouter, RoutedStream

__all__ = ["ResumingStream", "can_resume"]

logger = logging.getLogger("gateway.router")


def can_resume(request: GenerationRequest) -> bool:
    """May ``request`` be continued on another backend (module docstring)?"""
    if request.kind not in ("chat", "completion") or request.params.echo:
        return False
    if request.kind == "completion" and not isinstance(request.prompt, str):
        return False
    return not (
        request.tools or request.structured_outputs is not None or request.reasoning_budget is not None
    )


class ResumingStream:
    """A routed stream that continues on the alias's next backend after a mid-stream failure.

    It has the interface of :class:`~gateway.serving.router.RoutedStream` (iterate once, ``feed``,
    ``aclose``, ``backend_name``, ``attempts``).
    """

    def __init__(self, router: ModelRouter, request: GenerationRequest, stream: RoutedStream) -> None:
        self._router = router
        self._request = request
        self._stream = stream
        self._tried = [stream.backend_name]
        #: (backend, usage) per backend that worked on the answer, in order.
        self.segments: list[tuple[str, Usage]] = []
        self._token_ids: list[int] = []
        #: Every output chunk so far carried its token ids (a native backend's).
        self._has_all_ids = True
        self._text = ""
        self._num_tokens = 0
        #: The failed backends' output tokens whose prompt is not known yet (filled in when
        #: the next backend counts the same prompt).
        self._num_unpriced_prompts = 0
        #: A last chunk made here (the failed backend had used up ``max_tokens``).
        self._final: GenerationChunk | None = None
        self._done = False

    @property
    def backend_name(self) -> str:
        """The backend serving the answer now (the last one, once it ended)."""
        return self._stream.backend_name

    @property
    def attempts(self) -> list[Attempt]:
        return self._stream.attempts

    def __aiter__(self) -> ResumingStream:
        return self

    async def __anext__(self) -> GenerationChunk:
        while True:
            if self._final is not None:
                final, self._final = self._final, None
                self._done = True
                return final
            if self._done:
                raise StopAsyncIteration
            try:
                chunk = await anext(self._stream)
            except StopAsyncIteration:
                self._done = True
                raise
            except InfermuxError as exc:
                if not _is_resumable_failure(exc) or not await self._resume(exc):
                    raise
                continue
            return self._note(chunk)

    async def feed(self, take: Callable[[GenerationChunk], None]) -> None:
        """As :meth:`RoutedStream.feed` (an answer sent in one body)."""
        async for chunk in self:
            take(chunk)

    async def aclose(self) -> None:
        self._done = True
        await self._stream.aclose()

    def _note(self, chunk: GenerationChunk) -> GenerationChunk:
        if chunk.token_ids:
            self._token_ids.extend(chunk.token_ids)
        elif chunk.text:
            self._has_all_ids = False
        self._text += chunk.text
        if chunk.token_ids or chunk.text:
            self._num_tokens += chunk.token_count or len(chunk.token_ids) or 1
        if chunk.usage is None or not self.segments and self._num_unpriced_prompts == 0:
            return chunk  # nothing resumed: the backend's own usage
        usage = chunk.usage
        if self._num_unpriced_prompts and self.segments:
            # The token ids carried over: the failed backend's prompt is this one's, less
            # the output it re-prefilled.
            name, failed = self.segments[-1]
            prompt = max(0, usage.prompt_tokens - failed.completion_tokens)
            self.segments[-1] = (name, msgspec.structs.replace(failed, prompt_tokens=prompt))
            self._num_unpriced_prompts = 0
        self.segments.append((self._stream.backend_name, usage))
        return msgspec.structs.replace(chunk, usage=_sum(u for _, u in self.segments))

    async def _resume(self, error: InfermuxError) -> bool:
        """Open the next backend on the answer so far; False when there is none."""
        failed_name = self._stream.backend_name
        num_previous = sum(u.completion_tokens for _, u in self.segments)
        self.segments.append(
            (failed_name, Usage(prompt_tokens=0, completion_tokens=self._num_tokens - num_previous))
        )
        params = self._request.params
        max_tokens = params.max_tokens
        if max_tokens is not None and self._num_tokens >= max_tokens:
            # Everything asked for was sent; only the last chunk was missing.
            self._final = GenerationChunk(finish_reason="length", usage=_sum(u for _, u in self.segments))
            return True
        remaining = None if max_tokens is None else max_tokens - self._num_tokens
        request = msgspec.structs.replace(
            self._request, params=msgspec.structs.replace(params, max_tokens=remaining)
        )
        same_model_id = self._router.model_id(failed_name)
        # A request that continued a message the client sent (continue_final_message) has
        # that text before the output and no ids for it: the next backend continues from
        # the whole text (ids of the output alone would drop the client's part).
        earlier = self._request.resume
        prefix = earlier.text if earlier is not None else ""
        num_given = earlier.num_given_chars if earlier is not None else 0
        token_ids = tuple(self._token_ids) if self._has_all_ids and earlier is None else ()

        def adapt(name: str, capable: bool) -> GenerationRequest | None:
            if capable:
                same = token_ids and self._router.model_id(name) == same_model_id
                resume = ResumeState(
                    token_ids=token_ids if same else (), text=prefix + self._text, num_given_chars=num_given
                )
                return msgspec.structs.replace(request, resume=resume)
            if request.kind == "completion" and isinstance(request.prompt, str) and earlier is None:
                return msgspec.structs.replace(request, prompt=request.prompt + self._text)
            return None

        try:
            stream = await self._router.open_resumed(
                request, exclude=self._tried, adapt=adapt, attempts=self._stream.attempts
            )
        except InfermuxError:
            self.segments.pop()
            return False
        logger.info(
            "backend %r failed mid-stream (%s); %r continues the answer after %d tokens",
            failed_name, error.message, stream.backend_name, self._num_tokens,
        )
        self._tried.append(stream.backend_name)
        resumed = stream.request_sent
        if resumed is not None and resumed.resume is not None and resumed.resume.token_ids:
            self._num_unpriced_prompts = 1
        self._stream = stream  # the failed one ended already (the router counted the failure)
        return True


def _is_resumable_failure(error: InfermuxError) -> bool:
    """A backend's retryable failure: after output the router never retries one, so here it
    means "another backend may go on" (a worker's death, an ``openai`` remote's stream broken
    or silent: ``UpstreamStreamBrokenError``, ``StreamIdleTimeoutError``). Not a cancellation."""
    return (
        isinstance(error, BackendError)
        and not isinstance(error, GenerationAbortedError)
        and error.retryable
    )


def _sum(usages: Iterable[Usage]) -> Usage:
    prompt = completion = 0
    cached: int | None = None
    reasoning: int | None = None
    for usage in usages:
        prompt += usage.prompt_tokens
        completion += usage.completion_tokens
        if usage.cached_tokens is not None:
            cached = (cached or 0) + usage.cached_tokens
        if usage.reasoning_tokens is not None:
            reasoning = (reasoning or 0) + usage.reasoning_tokens
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached, reasoning_tokens=reasoning
    )
