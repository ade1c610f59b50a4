"""AsyncLLM: the engine on a background thread, outputs fanned out to per-request queues.

One thread owns the :class:`~core_engine.llm_engine.LLMEngine` and loops: apply queued
commands (add, abort), run ``step()``, hand each output to its request's ``asyncio.Queue``
through ``loop.call_soon_threadsafe``. Callers never touch the engine directly, so it needs no
lock. Abandoning a :meth:`AsyncLLM.generate` iterator (``aclose()``, task cancelled, client
gone) queues an abort that the thread applies before its next step: the request's KV blocks
are free within one step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from core_engine.config import EngineConfig
from core_engine.errors import EngineDeadError
from core_engine.kv_transfer.payload import PrefilledKV
from core_engine.llm_engine import LLMEngine
from core_engine.output import RequestOutput
from core_engine.policy import EnginePolicies
from core_engine.request import Request
from core_engine.sampling_params import SamplingParams

__all__ = ["AsyncLLM"]

logger = logging.getLogger(__name__)

_Item = RequestOutput | BaseException


class _Stream:
    """The way back from the engine thread to one request's consumer."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[_Item] = asyncio.Queue()


class AsyncLLM:
    """Async front of one engine. Use ``async with AsyncLLM(engine) as llm`` or
    :meth:`start` / :meth:`shutdown`."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stop = False
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="infermux-engine", daemon=True)

    @classmethod
    def from_config(cls, config: EngineConfig, *, policies: EnginePolicies | None = None) -> AsyncLLM:
        """Load the model (blocking; call from a worker thread in async code) and start."""
        llm = cls(LLMEngine.from_config(config, policies=policies))
        llm.start()
        return llm

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if not self._thread.is_alive() and not self._stop:
            self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    async def shutdown(self) -> None:
        """Stop the loop (unfinished requests get ``EngineDeadError``) and join the thread."""
        self._stop = True
        self._wakeup.set()
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join)

    async def __aenter__(self) -> AsyncLLM:
        self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    # -- requests --------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | Sequence[int] | Request,
        params: SamplingParams | None = None,
        req_id: str | None = None,
        *,
        prefilled: PrefilledKV | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; the last has ``finished=True``.

        Validation errors (``InvalidParamError``, ``RequestTooLongError``) raise before the
        first output. Closing the iterator early aborts the request. With ``prefilled`` (a
        prefill engine's KV of the request's prompt) the request continues from it
        (:meth:`LLMEngine.add_prefilled_request`).
        """
        self._check_alive()
        if isinstance(prompt, Request):
            request = prompt
        else:
            if req_id is None:
                raise ValueError("req_id is required")
            request = self.engine.make_request(req_id, prompt, params or SamplingParams())
        loop = asyncio.get_running_loop()
        stream = _Stream(loop)
        added: asyncio.Future[None] = loop.create_future()
        rid = request.req_id

        def add() -> None:
            try:
                if prefilled is not None:
                    self.engine.add_prefilled_request(request, prefilled)
                else:
                    self.engine.add_request(rid, request)
            except BaseException as exc:  # duplicate id, foreign KV: report to the caller, keep serving
                loop.call_soon_threadsafe(_settle, added, exc)
                return
            self._streams[rid] = stream
            loop.call_soon_threadsafe(_settle, added, None)

        self._submit(add)
        finished = False
        try:
            await added
        except asyncio.CancelledError:
            self._submit(lambda: self._abort_if_mine(rid, stream))
            raise
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._submit(lambda: self._abort_if_mine(rid, stream))

    async def abort(self, req_id: str) -> None:
        """Abort ``req_id`` and return once its blocks are free (no-op if already finished)."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def abort() -> None:
            self._abort_now(req_id)
            loop.call_soon_threadsafe(_settle, done, None)

        self._submit(abort)
        await done

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps (introspection, tests)."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except BaseException as exc:
                loop.call_soon_threadsafe(_settle, done, exc)
            else:
                loop.call_soon_threadsafe(_settle_value, done, result)

        self._submit(run)
        return await done

    # -- engine thread ---------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self._dead!r}") from self._dead
        if self._stop:
            raise EngineDeadError("the engine is shut down")
        if not self._thread.is_alive():
            raise EngineDeadError("the engine is not started (call start())")

    def _submit(self, command: Callable[[], None]) -> None:
        with self._lock:
            self._commands.append(command)
        self._wakeup.set()

    def _abort_if_mine(self, req_id: str, stream: _Stream) -> None:
        # A failed add (duplicate id) must not abort the other request of that id.
        if self._streams.get(req_id) is stream:
            self._abort_now(req_id)

    def _abort_now(self, req_id: str) -> None:
        self._streams.pop(req_id, None)
        self.engine.abort_request(req_id)

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop:
                with self._lock:
                    commands, self._commands = self._commands, []
                    if not commands and not engine.has_unfinished_requests():
                        self._wakeup.clear()
                for command in commands:
                    command()
                if not engine.has_unfinished_requests():
                    if not commands:
                        self._wakeup.wait()
                    continue
                self._dispatch(engine.step())
        except BaseException as exc:  # the loop must never die silently
            logger.exception("engine loop crashed")
            self._dead = exc
        finally:
            try:
                engine.close()  # queued KV disk writes reach the disk before the thread ends
            except Exception:
                logger.exception("closing the engine failed")
            error = EngineDeadError(f"the engine loop stopped: {self._dead!r}" if self._dead else "engine shut down")
            for stream in self._streams.values():
                _send(stream, error)
            self._streams.clear()
            with self._lock:
                commands, self._commands = self._commands, []
            for command in commands:  # settle pending futures (add/abort) rather than hang them
                try:
                    command()
                except BaseException:
                    pass
            for stream in self._streams.values():
                _send(stream, error)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[_Item], _Item]]] = {}
        for out in outputs:
            stream = self._streams.get(out.req_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.req_id]
            by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop is closed: its consumers are gone
                for _, delivered in items:
                    if isinstance(delivered, RequestOutput) and not delivered.finished:
                        self._abort_now(delivered.req_id)


def _deliver(items: list[tuple[asyncio.Queue[_Item], _Item]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _send(stream: _Stream, item: _Item) -> None:
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
    except RuntimeError:
        pass


def _settle(future: asyncio.Future[Any], exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)


def _settle_value(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)
