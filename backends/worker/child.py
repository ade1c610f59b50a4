"""The worker process of a native backend: ``python -m backends.worker.child ENDPOINT``.

It connects to the supervisor's ZeroMQ endpoint, waits for :class:`~backends.worker.protocol.Start`,
builds the backend with the named factory and starts it (the model loads here, logging its
progress to the inherited stderr), then serves: one task per
:class:`~backends.worker.protocol.Generate`, whose chunks go back in frames gathered per loop
turn; :class:`~backends.worker.protocol.Cancel` cancels the task, which closes the backend's
generator and so aborts the work exactly as in-process. It exits when told to stop, when the
gateway process is gone, when its backend reports itself broken for good (a ``fatal``
reason: the core engine's loop died, e.g. a tensor-parallel rank was lost; status 3), or
when it crashes — the last two the supervisor handles by starting a fresh worker.

A backend that consults engine policies (it has ``use_policies``) gets them before it
starts, built here by the :class:`~backends.worker.protocol.PolicySource` of ``Start``: the
gateway's plugin selection loaded again in this process (built-ins, entry points, config
modules, settings), so the quantization, KV-offload and speculation hooks are answered
in the engine's process, per load, step and request, exactly as in-process. Plugins an
embedding program registered by code in the gateway's plugin manager do not exist here.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from backends.base import Backend, GenerationChunk, GenerationRequest
from backends.errors import BackendConfigError, BackendError, InfermuxError
from backends.worker.protocol import (
    Cancel,
    Chunks,
    Failed,
    Finished,
    Generate,
    KVEvents,
    PolicySource,
    Start,
    Started,
    StartFailed,
    Stats,
    Stop,
    decode_frame,
    encode_frame,
    to_wire,
)

__all__ = ["main"]

logger = logging.getLogger("backends.worker")

_STATS_EVERY_S = 0.1
#: Exit status when the backend reports itself broken (``backend.fatal``).
_EXIT_FATAL = 3
_PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    """Serve one backend over the endpoint in ``argv[1]`` until told to stop."""
    if len(argv) != 2:
        print("usage: python -m backends.worker.child ENDPOINT", file=sys.stderr)
        return 2
    _die_with_parent()
    # Ctrl-C reaches the whole process group; the gateway drains, then stops this worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=os.environ.get("INFERMUX_WORKER_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)-7s %(name)s[worker %(process)d]: %(message)s",
    )
    return asyncio.run(_Worker(argv[1]).serve())


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the gateway's thread that started it exits."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _give_policies(backend: Backend, source: PolicySource) -> None:
    """``backend.use_policies(<what source's factory builds>)``, when the backend takes them."""
    use_policies = getattr(backend, "use_policies", None)
    if not callable(use_policies):
        return
    use_policies(_load_factory(source.factory)(source.plugins))


def _load_factory(path: str) -> Callable[..., Any]:
    module_name, _, attribute = path.partition(":")
    target: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    return target  # type: ignore[no-any-return]


class _Worker:
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.parent_pid = os.getppid()
        self.backend: Backend | None = None
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.outbox: list[Any] = []
        self.sock: zmq.asyncio.Socket | None = None
        self.stopping = asyncio.Event()

    async def serve(self) -> int:
        context = zmq.asyncio.Context()
        self.sock = context.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.connect(self.endpoint)
        try:
            if not await self._start():
                return 1
            watch = asyncio.create_task(self._watch())
            reader = asyncio.create_task(self._read())
            await self.stopping.wait()
            reader.cancel()
            watch.cancel()
            for task in list(self.tasks.values()):
                task.cancel()
            if self.backend is not None:
                await self.backend.aclose()
            return 0
        finally:
            self._flush()
            self.sock.close()
            context.term()

    async def _start(self) -> bool:
        assert self.sock is not None
        messages = decode_frame(await self.sock.recv())
        start = messages[0]
        if not isinstance(start, Start):
            logger.error("expected Start, got %s", type(start).__name__)
            return False
        try:
            factory = _load_factory(start.factory)
            try:
                self.backend = factory(start.config)
            except ValueError as exc:
                raise BackendConfigError(str(exc)) from exc
            if start.policies is not None:
                _give_policies(self.backend, start.policies)
            await self.backend.start()
        except InfermuxError as exc:
            self._post(StartFailed(error=to_wire(exc)))
            return False
        except Exception as exc:
            logger.exception("backend %r failed to start", start.config.name)
            self._post(StartFailed(error=to_wire(BackendError(f"{type(exc).__name__}: {exc}"))))
            return False
        backend = self.backend
        self._post(
            Started(
                pid=os.getpid(),
                capabilities=backend.capabilities,
                model_info=backend.model_info(),
            )
        )
        return True

    async def _read(self) -> None:
        assert self.sock is not None
        while True:
            for message in decode_frame(await self.sock.recv()):
                if isinstance(message, Generate):
                    task = asyncio.create_task(self._generate(message.id, message.request))
                    self.tasks[message.id] = task
                elif isinstance(message, Cancel):
                    running = self.tasks.get(message.id)
                    if running is not None:
                        running.cancel()
                elif isinstance(message, Stop):
                    self.stopping.set()
                    return

    async def _generate(self, request_id: int, request: GenerationRequest) -> None:
        assert self.backend is not None
        stream = self.backend.generate(request)
        try:
            async for chunk in stream:
                self._post_chunk(request_id, chunk)
            # The blocks it cached are known to the gateway before its next request routes.
            self._post_kv_events()
            self._post(Finished(id=request_id))
        except asyncio.CancelledError:
            pass  # the gateway closed the stream; it expects nothing more
        except InfermuxError as exc:
            self._post(Failed(id=request_id, error=to_wire(exc)))
        except Exception as exc:
            logger.exception("generation failed")
            error = BackendError(f"{self.backend.kind} generation failed: {exc}")
            self._post(Failed(id=request_id, error=to_wire(error)))
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
            self.tasks.pop(request_id, None)

    async def _watch(self) -> None:
        """Send changed stats; exit when the gateway process is gone."""
        last: dict[str, float] = {}
        while True:
            await asyncio.sleep(_STATS_EVERY_S)
            if os.getppid() != self.parent_pid:
                logger.error("the gateway process is gone; exiting")
                os._exit(1)
            fatal = getattr(self.backend, "fatal", None)
            if isinstance(fatal, str) and not self.stopping.is_set():
                await asyncio.sleep(_STATS_EVERY_S)  # the failed requests' frames go out first
                self._flush()
                logger.error("backend %s; exiting so that the gateway starts it again", fatal)
                os._exit(_EXIT_FATAL)
            self._post_kv_events()
            values = self._probe()
            if values != last:
                self._post(Stats(values=values))
                last = values

    def _probe(self) -> dict[str, float]:
        backend = self.backend
        values: dict[str, float] = {"worker_tasks": float(len(self.tasks))}
        stats_of = getattr(backend, "stats", None)
        if callable(stats_of):
            with contextlib.suppress(Exception):
                for key, value in stats_of().items():
                    if isinstance(value, int | float) and not isinstance(value, bool):
                        values[key] = float(value)
        generated = getattr(backend, "num_generated_tokens", None)
        if isinstance(generated, int):
            values["num_generated_tokens"] = float(generated)
        return values

    def _post_kv_events(self) -> None:
        """The engine's prefix-cache changes since the last call, if it reports them."""
        take = getattr(self.backend, "take_kv_events", None)
        if not callable(take):
            return
        events = take()
        if events is not None:
            self._post(KVEvents(events=events))

    # -- sending: one frame per loop turn ---------------------------------------------------

    def _post_chunk(self, request_id: int, chunk: GenerationChunk) -> None:
        last = self.outbox[-1] if self.outbox else None
        if isinstance(last, Chunks) and last.id == request_id:
            last.chunks.append(chunk)
        else:
            self._post(Chunks(id=request_id, chunks=[chunk]))

    def _post(self, message: Any) -> None:
        if not self.outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self.outbox.append(message)

    def _flush(self) -> None:
        if self.outbox and self.sock is not None:
            frame = encode_frame(self.outbox)
            self.outbox = []
            self.sock.send(frame, copy=False)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
