"""The worker process of a native backend: ``python -m backends.worker.child ENDPOINT``.

It connects to the supervisor's ZeroMQ endpoint, waits for :class:`~backends.worker.protocol.Start`,
builds the backend with the named factory and starts it (the model loads here, logging its
progress to the inherited stderr), then serves: one task per
:class:`~backends.worker.protocol.Generate`, whose chunks go back in frames gathered per loop
turn; :class:`~backends.worker.protocol.Cancel` cancels the task, which closes the backend's
generator and so aborts the work exactly as in-process. It exits when told to stop, when the
gateway process is gone, or when it crashes — which the supervisor handles.

A backend that speculates (``use_policies`` and a non-empty ``speculation_methods``) gets,
before it starts, a :class:`RelayedSpeculationPolicy`: per step it answers for a request
from the decision its ``Generate`` frame carried (the gateway's policy, asked once at
submit): off for the whole request when that decision was off (method None or 0 tokens),
otherwise this worker's own ``AdaptiveSpeculationPolicy(max_tokens=<relayed k>)`` — so the
acceptance rate and the batch size still steer each step here, under the gateway's cap. A
frame without a decision gets ``AdaptiveSpeculationPolicy()``'s answer. Requests are told
apart by ``request_id``: two running at once under the same id share the later decision.
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
import threading
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
    Start,
    Started,
    StartFailed,
    Stats,
    Stop,
    decode_frame,
    encode_frame,
    to_wire,
)
from core_engine.policy import (
    AdaptiveSpeculationPolicy,
    EnginePolicies,
    SpeculationContext,
    SpeculationDecision,
)

__all__ = ["RelayedSpeculationPolicy", "main"]

logger = logging.getLogger("backends.worker")

_STATS_EVERY_S = 0.1
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


def _load_factory(path: str) -> Callable[..., Backend]:
    module_name, _, attribute = path.partition(":")
    target: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    return target  # type: ignore[no-any-return]


class RelayedSpeculationPolicy:
    """Answers per step from each request's relayed decision; see the module docstring.

    :meth:`hold` and :meth:`release` run on the event loop, :meth:`choose_speculation` on
    the backend's own thread: the table is guarded by a lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._decisions: dict[str, list[SpeculationDecision | None]] = {}
        self._default = AdaptiveSpeculationPolicy()
        self._capped: dict[int, AdaptiveSpeculationPolicy] = {}

    def hold(self, req_id: str, decision: SpeculationDecision | None) -> None:
        with self._lock:
            self._decisions.setdefault(req_id, []).append(decision)

    def release(self, req_id: str, decision: SpeculationDecision | None) -> None:
        with self._lock:
            held = self._decisions.get(req_id)
            if held is None:
                return
            held.remove(decision)
            if not held:
                del self._decisions[req_id]

    def choose_speculation(self, context: SpeculationContext) -> SpeculationDecision:
        with self._lock:
            held = self._decisions.get(context.req_id)
            decision = held[-1] if held else None
            if decision is None:
                policy = self._default
            elif decision.method is None or decision.num_speculative_tokens <= 0:
                return SpeculationDecision()
            else:
                k = decision.num_speculative_tokens
                policy = self._capped.get(k) or self._capped.setdefault(
                    k, AdaptiveSpeculationPolicy(max_tokens=k)
                )
        return policy.choose_speculation(context)


class _Worker:
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.parent_pid = os.getppid()
        self.backend: Backend | None = None
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.outbox: list[Any] = []
        self.sock: zmq.asyncio.Socket | None = None
        self.stopping = asyncio.Event()
        #: Installed in a backend that speculates (None: the backend does not).
        self.speculation: RelayedSpeculationPolicy | None = None

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
            self._relay_speculation(self.backend)
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

    def _relay_speculation(self, backend: Backend) -> None:
        use_policies = getattr(backend, "use_policies", None)
        if callable(use_policies) and getattr(backend, "speculation_methods", None):
            self.speculation = RelayedSpeculationPolicy()
            use_policies(EnginePolicies(speculation=self.speculation))

    async def _read(self) -> None:
        assert self.sock is not None
        while True:
            for message in decode_frame(await self.sock.recv()):
                if isinstance(message, Generate):
                    task = asyncio.create_task(
                        self._generate(message.id, message.request, message.speculation)
                    )
                    self.tasks[message.id] = task
                elif isinstance(message, Cancel):
                    task = self.tasks.get(message.id)
                    if task is not None:
                        task.cancel()
                elif isinstance(message, Stop):
                    self.stopping.set()
                    return

    async def _generate(
        self,
        request_id: int,
        request: GenerationRequest,
        speculation: SpeculationDecision | None,
    ) -> None:
        assert self.backend is not None
        relay = self.speculation
        if relay is not None:
            relay.hold(request.request_id, speculation)
        stream = self.backend.generate(request)
        try:
            async for chunk in stream:
                self._post_chunk(request_id, chunk)
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
            if relay is not None:
                relay.release(request.request_id, speculation)
            self.tasks.pop(request_id, None)

    async def _watch(self) -> None:
        """Send changed stats; exit when the gateway process is gone."""
        last: dict[str, float] = {}
        while True:
            await asyncio.sleep(_STATS_EVERY_S)
            if os.getppid() != self.parent_pid:
                logger.error("the gateway process is gone; exiting")
                os._exit(1)
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
