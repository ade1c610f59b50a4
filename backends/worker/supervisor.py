"""The gateway side of a worker-process backend: spawn, channel, crash handling, restart.

:class:`WorkerBackend` implements the :class:`~backends.base.Backend` contract over a child
process that runs the real backend (see :mod:`backends.worker`). Its states::

    starting ──Started──▶ up ──worker exits──▶ restarting ──(back-off, spawn)──▶ up
        │                                          ▲   │ spawn failed: longer back-off
        └── start failed: start() raises           └───┘
    any ──aclose()──▶ closed

While it is not ``up``, ``generate`` raises a retryable ``BackendUnavailableError`` and
``health()`` is not ok. The back-off starts at 0.5 s and doubles up to 30 s while the worker
keeps dying within a minute of starting.

Policies (:class:`~core_engine.policy.EnginePolicies`, the plugins' hooks) are objects of
a process and do not cross the channel. When the backend consults policies (it has
``use_policies``), :meth:`WorkerBackend.use_policy_source` keeps a
:class:`~backends.worker.protocol.PolicySource` — the gateway's plugin selection — and every
worker incarnation builds its own policies from it before its model loads, so the hooks run
in the engine's process on the engine's step path (:mod:`backends.worker.child`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import msgspec
import zmq
import zmq.asyncio

from backends.base import (
    Backend,
    BackendConfig,
    GenerationChunk,
    GenerationRequest,
    HealthStatus,
    ModelInfo,
)
from backends.errors import (
    BackendUnavailableError,
    GenerationAbortedError,
    InfermuxError,
)
from backends.prefix_cache import PrefixCacheIndex
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
    from_wire,
)

__all__ = ["WorkerBackend", "factory_path"]

logger = logging.getLogger(__name__)

_BACKOFF_FIRST_S = 0.5
_BACKOFF_MAX_S = 30.0
#: A worker that lived this long before dying starts the back-off over.
_STABLE_AFTER_S = 60.0
_STOP_TIMEOUT_S = 10.0
_PROGRESS_EVERY_S = 10.0
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])

#: What a request's queue carries: chunks, an error, or None at the end.
_Item = list[GenerationChunk] | BaseException | None


def factory_path(factory: Callable[..., Any]) -> str:
    """``module:qualname`` of a backend factory, importable in the worker process."""
    module = getattr(factory, "__module__", None)
    qualname = getattr(factory, "__qualname__", "")
    if not module or not qualname or "<" in qualname:
        raise ValueError(
            f"backend factory {factory!r} cannot run in a worker process (it must be a "
            "module-level function or class); set worker_process = false"
        )
    return f"{module}:{qualname}"


class _Incarnation:
    """One worker process and its channel."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: zmq.asyncio.Socket, tmpdir: str):
        self.proc = proc
        self.sock = sock
        self.tmpdir = tmpdir
        self.started_at = time.monotonic()
        self.exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.ready: asyncio.Future[Started] = asyncio.get_running_loop().create_future()
        self.reader: asyncio.Task[None] | None = None

    def send(self, message: Any) -> None:
        self.sock.send(encode_frame([message]), copy=False)

    def dispose(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
        self.sock.close(linger=0)
        shutil.rmtree(self.tmpdir, ignore_errors=True)


class WorkerBackend:
    """A backend whose model runs in a supervised worker process; see the module docstring."""

    def __init__(self, config: BackendConfig, factory: Callable[..., Any], local: Backend):
        """``local`` is the backend built in this process (options validated, nothing loaded):
        its kind, capabilities and model info stand in until the worker reports its own."""
        self.name = config.name
        self.kind = local.kind
        self.config = config
        self.capabilities = local.capabilities
        self._factory = factory_path(factory)
        self._model_info = local.model_info()
        self._state = "stopped"
        self._detail = "not started"
        self._worker: _Incarnation | None = None
        self._pending: dict[int, asyncio.Queue[_Item]] = {}
        self._next_id = 0
        self._backoff_attempt = 0
        self._restart_task: asyncio.Task[None] | None = None
        self._stats: dict[str, float] = {}
        #: The worker engine's prefix cache, from its KVEvents; None: it reports none.
        self._prefix_cache: PrefixCacheIndex | None = (
            PrefixCacheIndex() if callable(getattr(local, "take_kv_events", None)) else None
        )
        self._recovery_listeners: list[Callable[[], None]] = []
        #: Whether the backend consults engine policies (then the worker builds them).
        self.takes_policies = callable(getattr(local, "use_policies", None))
        self._policy_source: PolicySource | None = None
        #: Times the worker was started again after it died.
        self.restarts = 0
        #: How the last worker ended ("killed by SIGSEGV"), or None.
        self.last_exit: str | None = None

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn the worker and wait until its model is loaded (it logs its progress)."""
        if self._state == "up":
            return
        self._state = "starting"
        self._detail = "starting its worker process"
        try:
            await self._spawn()
        except BaseException:
            self._state = "stopped"
            raise

    async def _spawn(self) -> None:
        tmpdir = tempfile.mkdtemp(prefix="infermux-worker-")
        endpoint = f"ipc://{tmpdir}/channel"
        sock = zmq.asyncio.Context.instance().socket(zmq.PAIR)
        sock.bind(endpoint)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        env.setdefault(
            "INFERMUX_WORKER_LOG_LEVEL", logging.getLevelName(logging.getLogger().getEffectiveLevel())
        )
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "backends.worker.child", endpoint],
                stdin=subprocess.DEVNULL,
                env=env,
            )
        except OSError as exc:
            sock.close(linger=0)
            shutil.rmtree(tmpdir, ignore_errors=True)
            raise BackendUnavailableError(f"backend {self.name!r}: cannot start a worker: {exc}") from exc
        worker = _Incarnation(proc, sock, tmpdir)
        loop = asyncio.get_running_loop()

        def wait_exit() -> None:
            code = proc.wait()
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to tell
                loop.call_soon_threadsafe(_resolve, worker.exited, code)

        threading.Thread(target=wait_exit, name=f"worker-wait-{self.name}", daemon=True).start()
        worker.reader = asyncio.create_task(self._read(worker), name=f"worker-read-{self.name}")
        config = msgspec.structs.replace(self.config, worker_process=None)  # it runs in that process
        worker.send(Start(config=config, factory=self._factory, policies=self._policy_source))
        logger.info("backend %s: worker process %d started", self.name, proc.pid)
        began = time.monotonic()
        while True:
            done, _ = await asyncio.wait(
                {cast("asyncio.Future[object]", worker.ready), cast("asyncio.Future[object]", worker.exited)},
                timeout=_PROGRESS_EVERY_S,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if worker.ready in done:
                break
            if worker.exited in done:
                worker.dispose()
                raise BackendUnavailableError(
                    f"backend {self.name!r}: its worker process {_describe_exit(worker.exited.result())} "
                    "while loading the model"
                )
            logger.info(
                "backend %s: worker %d still loading (%.0f s)", self.name, proc.pid, time.monotonic() - began
            )
        try:
            started = worker.ready.result()
        except InfermuxError:
            await _reap(worker)
            raise
        self.capabilities = started.capabilities
        self._model_info = started.model_info
        self._worker = worker
        self._state = "up"
        self._detail = f"worker process {proc.pid} up"
        worker.exited.add_done_callback(lambda _: self._on_exit(worker))

    async def _read(self, worker: _Incarnation) -> None:
        while True:
            try:
                frame = await worker.sock.recv()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            for message in decode_frame(frame):
                if isinstance(message, Chunks):
                    queue = self._pending.get(message.id)
                    if queue is not None:
                        queue.put_nowait(message.chunks)
                elif isinstance(message, Finished):
                    queue = self._pending.pop(message.id, None)
                    if queue is not None:
                        queue.put_nowait(None)
                elif isinstance(message, Failed):
                    queue = self._pending.pop(message.id, None)
                    if queue is not None:
                        queue.put_nowait(from_wire(message.error))
                elif isinstance(message, Stats):
                    self._stats = message.values
                elif isinstance(message, KVEvents) and self._prefix_cache is not None:
                    self._prefix_cache.apply(message.events)
                elif isinstance(message, Started):
                    _resolve(worker.ready, message)
                elif isinstance(message, StartFailed):
                    if not worker.ready.done():
                        worker.ready.set_exception(from_wire(message.error))

    def _on_exit(self, worker: _Incarnation) -> None:
        """The worker ended: fail what it was running, then start it again unless closing."""
        if self._worker is not worker:
            return
        if self._prefix_cache is not None:
            self._prefix_cache.clear()  # a new worker starts with an empty cache
        self._worker = None
        worker.dispose()
        if self._state == "closed":
            return
        reason = _describe_exit(worker.exited.result())
        self.last_exit = reason
        lived = time.monotonic() - worker.started_at
        if lived >= _STABLE_AFTER_S:
            self._backoff_attempt = 0
        logger.error(
            "backend %s: worker process %d %s after %.1f s; %d in-flight request(s) failed",
            self.name, worker.proc.pid, reason, lived, len(self._pending),
        )  # fmt: skip
        self._fail_pending(
            BackendUnavailableError(
                f"backend {self.name!r}: its worker process {reason}; it is being restarted",
                retry_after=1,
            )
        )
        self._state = "restarting"
        self._restart_task = asyncio.create_task(self._restart(), name=f"worker-restart-{self.name}")

    async def _restart(self) -> None:
        while self._state == "restarting":
            delay = min(_BACKOFF_MAX_S, _BACKOFF_FIRST_S * 2**self._backoff_attempt)
            self._backoff_attempt += 1
            self._detail = f"worker {self.last_exit}; restarting (back-off {delay:.1f} s)"
            await asyncio.sleep(delay)
            if self._state != "restarting":
                return
            try:
                await self._spawn()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.last_exit = f"failed to restart: {exc}"
                logger.error("backend %s: %s", self.name, self.last_exit)
                continue
            self.restarts += 1
            logger.info("backend %s: worker restarted (restart %d)", self.name, self.restarts)
            for listener in self._recovery_listeners:
                listener()

    def _fail_pending(self, error: BaseException) -> None:
        pending, self._pending = self._pending, {}
        for queue in pending.values():
            queue.put_nowait(error)

    async def aclose(self) -> None:
        """Stop the worker (it closes its backend), failing whatever is still in flight."""
        if self._state == "closed":
            return
        self._state = "closed"
        self._detail = "closed"
        if self._restart_task is not None:
            self._restart_task.cancel()
        self._fail_pending(GenerationAbortedError(f"backend {self.name!r} is shutting down"))
        worker, self._worker = self._worker, None
        if worker is not None:
            with contextlib.suppress(zmq.ZMQError):
                worker.send(Stop())
            await _reap(worker)

    # -- policies ---------------------------------------------------------------------------

    def use_policy_source(self, source: PolicySource) -> None:
        """Build the backend's policies in the worker from ``source`` (from its next start;
        call before :meth:`start`). Ignored when the backend takes no policies."""
        if self.takes_policies:
            self._policy_source = source

    # -- the Backend contract ---------------------------------------------------------------

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream one choice from the worker; closing the iterator cancels it there."""
        return self._generate(request)

    async def _generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        worker = self._worker
        if worker is None or self._state != "up":
            raise BackendUnavailableError(f"backend {self.name!r}: {self._detail}", retry_after=1)
        self._next_id += 1
        request_id = self._next_id
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._pending[request_id] = queue
        worker.send(Generate(id=request_id, request=request))
        try:
            while True:
                item = await queue.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                for chunk in item:
                    yield chunk
        finally:
            if self._pending.pop(request_id, None) is not None and self._worker is worker:
                with contextlib.suppress(zmq.ZMQError):
                    worker.send(Cancel(id=request_id))

    def model_info(self) -> ModelInfo:
        return self._model_info

    async def health(self) -> HealthStatus:
        """Ok while the worker is up; otherwise why not (restarting after SIGSEGV...)."""
        return HealthStatus(ok=self._state == "up", detail=self._detail)

    def stats(self) -> dict[str, float]:
        """The worker's own ``stats()`` (as last reported), its state and restart count."""
        return self._stats | {
            "worker_up": 1.0 if self._state == "up" else 0.0,
            "worker_restarts": float(self.restarts),
        }

    def prefix_cache(self) -> PrefixCacheIndex | None:
        """The worker engine's cached block hashes as last reported (None: its backend
        reports no cache)."""
        return self._prefix_cache

    def add_recovery_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` each time the worker is up again after a crash (the router
        closes the backend's circuit)."""
        self._recovery_listeners.append(listener)

    # -- for tests and operators ------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The worker's process id while it runs."""
        worker = self._worker
        return worker.proc.pid if worker is not None else None

    @property
    def state(self) -> str:
        """"starting", "up", "restarting", "stopped" or "closed"."""
        return self._state

    @property
    def health_detail(self) -> str:
        """What ``health()`` would say (no await needed)."""
        return self._detail

    @property
    def num_generated_tokens(self) -> int:
        """The worker backend's token counter, as last reported (every 100 ms at most)."""
        return int(self._stats.get("num_generated_tokens", 0))


def _resolve(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


async def _reap(worker: _Incarnation) -> None:
    """Wait for the worker to exit (it was told to stop), killing it after a while."""
    try:
        await asyncio.wait_for(asyncio.shield(worker.exited), _STOP_TIMEOUT_S)
    except TimeoutError:
        logger.warning("worker process %d did not stop; killing it", worker.proc.pid)
        with contextlib.suppress(ProcessLookupError):
            worker.proc.kill()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(worker.exited), _STOP_TIMEOUT_S)
    worker.dispose()


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"
