"""The backend streams behind one HTTP request (one per choice) and their bookkeeping.

A :class:`ChoiceRun` opens every choice through the router concurrently and merges their
chunks in arrival order. Its steps :meth:`~ChoiceRun.abort` (stop unfinished upstream work),
:meth:`~ChoiceRun.end_request` (``on_request_end``, a summary of outcomes, usage and timings)
and :meth:`~ChoiceRun.report` (``on_response`` when a choice finished, ``on_error`` when it
failed, was abandoned because a sibling failed, or the client went away) are each run once,
in that order, by the request's owner, :class:`~gateway.serving.request_life.RequestLife`.
A choice that failed or was abandoned after streaming tokens is reported with partial usage
(:meth:`~gateway.serving.choice_state.ChoiceState.usage_so_far`).

``on_request_start`` comes when :meth:`ChoiceRun.open` begins; when opening fails, ``open``
itself reports ``on_request_end`` and abandons what opened (:meth:`ChoiceRun.abandon`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from backends.base import GenerationChunk, GenerationRequest, Usage
from backends.errors import (
    GenerationAbortedError,
    InfermuxError,
    ModelNotFoundError,
)
from gateway.serving.choice_state import ChoiceState
from gateway.serving.failure import as_infermux_error
from gateway.serving.stream_resume import ResumingStream, can_resume
from gateway.serving.summary import RequestClock, failure_summary, openai_usage, run_summary

if TYPE_CHECKING:
    from gateway.serving.router import ModelRouter, RoutedStream
    from plugins.manager import PluginHooks

__all__ = ["ChoiceRun"]

logger = logging.getLogger("gateway")

# Chunks buffered per request when the client reads slower than the backends produce.
_MERGE_QUEUE_SIZE = 64


class ChoiceRun:
    """The open choices of one request; iterate :meth:`events`, then :meth:`aclose`."""

    def __init__(
        self,
        hooks: PluginHooks,
        choices: list[ChoiceState],
        *,
        n: int,
        clock: RequestClock | None = None,
    ) -> None:
        self.hooks = hooks
        self.choices = choices
        self.n = n
        self._tasks: list[asyncio.Task[None]] = []
        #: The request's start; None for the runs ``open`` builds only to abandon streams.
        self._clock = clock

    @classmethod
    async def open(
        cls,
        *,
        router: ModelRouter,
        hooks: PluginHooks,
        requests: Sequence[GenerationRequest],
        n: int,
        pinned_backend: str | None = None,
        capture_output: bool = False,
    ) -> ChoiceRun:
        """Transform and route every choice; if one cannot open, close the others and raise.

        ``on_request_start`` comes first; when opening fails, ``on_request_end`` is
        reported here before the error propagates. ``capture_output`` keeps the output
        text for the request summary (tracing's opt-in content recording).
        """
        clock = RequestClock()
        await hooks.on_request_start(requests=requests)
        transformed: list[GenerationRequest] = []
        try:
            for r in requests:
                transformed.append(await hooks.transform_request(request=r))
            choices = await cls._open_choices(
                router, hooks, transformed, n, pinned_backend, capture_output
            )
        except BaseException as exc:
            routed = len(transformed) == len(requests)
            summary = failure_summary(
                clock, transformed if routed else requests, exc, routed=routed
            )
            await hooks.on_request_end(summary=summary)
            raise
        return cls(hooks, choices, n=n, clock=clock)

    @classmethod
    async def _open_choices(
        cls,
        router: ModelRouter,
        hooks: PluginHooks,
        transformed: list[GenerationRequest],
        n: int,
        pinned_backend: str | None,
        capture_output: bool,
    ) -> list[ChoiceState]:
        if len(transformed) == 1:
            request = transformed[0]
            try:
                stream = await _open(router, request, pinned_backend)
            except InfermuxError as exc:
                await _report_open_failure(hooks, request, exc)
                raise
            except asyncio.CancelledError:
                await _report_abandoned(hooks, [request])
                raise
            return [ChoiceState(request, stream, capture_output=capture_output)]

        tasks = [
            asyncio.ensure_future(_open(router, r, pinned_backend))
            for r in transformed
        ]
        # When each choice got its first chunk (the tasks finish at different times).
        opened_at: dict[int, float] = {}

        def stamp(position: int) -> Callable[[object], None]:
            def done(_: object) -> None:
                opened_at.setdefault(position, time.monotonic())

            return done

        for position, task in enumerate(tasks):
            task.add_done_callback(stamp(position))
        try:
            _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except BaseException:
            # Cancelled (client gone): abandon whatever opened meanwhile.
            await _settle(tasks)
            await cls(hooks, _opened(transformed, tasks), n=n).abandon()
            await _report_abandoned(hooks, _unopened(transformed, tasks))
            raise
        if not pending and all(t.exception() is None for t in tasks):
            return [
                ChoiceState(
                    r,
                    t.result(),
                    first_chunk_at=opened_at.get(position),
                    capture_output=capture_output,
                )
                for position, (r, t) in enumerate(zip(transformed, tasks, strict=True))
            ]
        # One choice failed: the whole request fails. Abandon the siblings.
        await _settle(tasks)
        await cls(hooks, _opened(transformed, tasks), n=n).abandon()
        failures = [
            (request, task.exception())
            for request, task in zip(transformed, tasks, strict=True)
            if not task.cancelled() and task.exception() is not None
        ]
        for request, error in failures:
            if isinstance(error, InfermuxError):
                await _report_open_failure(hooks, request, error)
        await _report_abandoned(
            hooks, [r for r, t in zip(transformed, tasks, strict=True) if t.cancelled()]
        )
        first_error = failures[0][1]
        assert first_error is not None
        raise first_error

    @property
    def backend_names(self) -> list[str]:
        """The backends that serve the choices, without repeats, in choice order."""
        return list(dict.fromkeys(c.backend_name for c in self.choices))

    async def events(self) -> AsyncIterator[tuple[int, GenerationChunk]]:
        """``(choice position, chunk)`` in arrival order; raises the first choice error."""
        if len(self.choices) == 1:
            choice = self.choices[0]
            try:
                async for chunk in choice.stream:
                    _account(choice, chunk)
                    yield 0, chunk
            except Exception as exc:
                raise self._fail(choice, exc) from exc
            choice.outcome = "finished"
            return

        queue: asyncio.Queue[tuple[int, GenerationChunk | None, BaseException | None]] = (
            asyncio.Queue(_MERGE_QUEUE_SIZE)
        )
        self._tasks = [
            asyncio.create_task(_pump(position, choice.stream, queue))
            for position, choice in enumerate(self.choices)
        ]
        remaining = len(self.choices)
        while remaining:
            position, item, error = await queue.get()
            choice = self.choices[position]
            if item is not None:
                _account(choice, item)
                yield position, item
            elif error is not None:
                raise self._fail(choice, error) from error
            else:
                choice.outcome = "finished"
                remaining -= 1

    async def collect(self, add: Callable[[int, GenerationChunk], None]) -> None:
        """Hand every chunk to ``add(position, chunk)`` in arrival order (an answer sent in
        one body); raises the first choice error, as :meth:`events` does. A single choice's
        stream pushes its chunks (:meth:`RoutedStream.feed`): no iterator step, generator
        layer and exception per chunk."""
        if len(self.choices) != 1:
            async for position, chunk in self.events():
                add(position, chunk)
            return
        choice = self.choices[0]

        def take(chunk: GenerationChunk) -> None:
            _account(choice, chunk)
            add(0, chunk)

        try:
            await choice.stream.feed(take)
        except Exception as exc:
            raise self._fail(choice, exc) from exc
        choice.outcome = "finished"

    def total_usage(self) -> Usage:
        """OpenAI's accounting (:func:`~gateway.serving.summary.openai_usage`) of what the
        choices reported; the wire's ``usage`` is :func:`gateway.openai.schemas.usage_info`."""
        return openai_usage([choice.usage for choice in self.choices], self.n)

    async def abandon(self) -> None:
        """For the streams ``open`` opened before a sibling failed (no request of their own
        to end): stop them upstream, then report each choice."""
        await self.abort()
        await self.report()

    async def abort(self) -> None:
        """Stop the upstream work of every unfinished choice; their usage becomes what they
        streamed (run once, first)."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        failed = next((c for c in self.choices if c.outcome == "failed"), None)
        for choice in self.choices:
            if choice.outcome == "open":
                choice.outcome = "aborted"
                choice.error = GenerationAbortedError(
                    "aborted: another choice of this request failed"
                    if failed is not None
                    else "aborted: the client went away before the response finished"
                )
            try:
                await choice.stream.aclose()
            except Exception:
                logger.exception("closing the stream of %s failed", choice.request.request_id)
            if choice.outcome != "finished":
                choice.usage = choice.usage_so_far()

    async def end_request(self) -> None:
        """Tell the plugins the request ended (``on_request_end``; run once, after
        :meth:`abort`, before the response's final bytes)."""
        assert self._clock is not None, "a run built to abandon streams has no request to end"
        await self.hooks.on_request_end(summary=run_summary(self._clock, self.choices, n=self.n))

    async def report(self) -> None:
        """Tell the plugins how every choice ended (run once, last)."""
        for choice in self.choices:
            if choice.outcome == "finished":
                await self.hooks.on_response(
                    request=choice.request,
                    backend_name=choice.backend_name,
                    usage=choice.usage,
                    finish_reason=choice.finish_reason,
                )
            elif choice.error is not None:
                await self.hooks.on_error(
                    request=choice.request,
                    backend_name=choice.backend_name,
                    error=choice.error,
                    usage=choice.usage,
                )

    def _fail(self, choice: ChoiceState, exc: BaseException) -> InfermuxError:
        error = as_infermux_error(exc, choice.request.request_id)
        choice.outcome = "failed"
        choice.error = error
        return error


def _account(choice: ChoiceState, chunk: GenerationChunk) -> None:
    if chunk.token_ids or chunk.text or chunk.reasoning or chunk.tool_calls:
        choice.num_streamed_tokens += chunk.token_count or len(chunk.token_ids) or 1
        now = time.monotonic()
        if choice.last_output_at is not None:
            choice.output_gaps.append(now - choice.last_output_at)
        choice.last_output_at = now
        if choice.text_parts is not None and chunk.text:
            choice.text_parts.append(chunk.text)
    if chunk.usage is not None:
        choice.usage = chunk.usage
    if chunk.finish_reason is not None:
        choice.finish_reason = chunk.finish_reason
    if chunk.phases is not None:
        choice.phases = chunk.phases
    if chunk.speculation is not None:
        choice.speculation = chunk.speculation


async def _pump(
    position: int,
    stream: RoutedStream | ResumingStream,
    queue: asyncio.Queue[tuple[int, GenerationChunk | None, BaseException | None]],
) -> None:
    try:
        async for chunk in stream:
            await queue.put((position, chunk, None))
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        await queue.put((position, None, exc))
        return
    await queue.put((position, None, None))


async def _open(
    router: ModelRouter, request: GenerationRequest, pinned_backend: str | None
) -> RoutedStream | ResumingStream:
    """The routed stream of ``request``; one that resumes after a mid-stream failure when
    its alias says so (``resume_on_failure``)."""
    stream = await router.open(request, pinned_backend=pinned_backend)
    if pinned_backend is None and router.resumes_on_failure(request.model) and can_resume(request):
        return ResumingStream(router, request, stream)
    return stream


async def _report_open_failure(
    hooks: PluginHooks, request: GenerationRequest, error: InfermuxError
) -> None:
    # Routing refusals (unknown alias, unknown pinned backend, rejected by a plugin) never
    # reached a backend; everything else did and gets its one on_error.
    if isinstance(error, ModelNotFoundError) or error.code == "unknown_backend":
        return
    backend_name: Any = getattr(error, "backend_name", None)
    await hooks.on_error(
        request=request,
        backend_name=backend_name if isinstance(backend_name, str) else None,
        error=error,
        usage=None,
    )


async def _settle(tasks: Sequence[asyncio.Future[RoutedStream | ResumingStream]]) -> None:
    """Cancel the tasks still opening and wait until every task has ended."""
    for task in tasks:
        if not task.done():
            task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _unopened(
    requests: Sequence[GenerationRequest], tasks: Sequence[asyncio.Future[RoutedStream | ResumingStream]]
) -> list[GenerationRequest]:
    return [request for request, task in zip(requests, tasks, strict=True) if task.cancelled()]


async def _report_abandoned(hooks: PluginHooks, requests: Sequence[GenerationRequest]) -> None:
    # Cancelled while the router was still waiting for a first chunk: the backend (if any)
    # was already told to stop by the router; the choice still gets its one report.
    for request in requests:
        await hooks.on_error(
            request=request,
            backend_name=None,
            error=GenerationAbortedError("aborted before the first token"),
            usage=None,
        )


def _opened(
    requests: Sequence[GenerationRequest], tasks: Sequence[asyncio.Future[RoutedStream | ResumingStream]]
) -> list[ChoiceState]:
    return [
        ChoiceState(request, task.result())
        for request, task in zip(requests, tasks, strict=True)
        if task.done() and not task.cancelled() and task.exception() is None
    ]
