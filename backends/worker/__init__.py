"""Native backends in supervised worker processes.

A native library (llama.cpp, MLX, the core engine's torch) that crashes — SIGSEGV in a
kernel, SIGKILL from the OOM killer — must not take the gateway and every other backend's
requests with it. With ``worker_process = true`` (the default for ``llamacpp`` and ``mlx``)
the gateway holds a :class:`~backends.worker.supervisor.WorkerBackend`, and the real backend
object runs in a child process (:mod:`backends.worker.child`)::

    gateway process                              worker process (python -m backends.worker.child)
    WorkerBackend.generate(request) ──Generate──▶ backend.generate(request) (the in-process code)
          ▲  per-request queue     ◀──Chunks───   one frame per loop turn, every chunk in it
          └── aclose() / deadline ──Cancel────▶  closes that generator (aborts the work)

The channel is a ZeroMQ PAIR socket over a Unix-domain (``ipc://``) endpoint, carrying msgpack
frames of the msgspec Structs in :mod:`backends.worker.protocol` — never pickle. The
supervisor watches the process: when it exits unexpectedly every in-flight request fails
with a retryable :class:`~backends.errors.BackendUnavailableError` (the router falls back
before the first byte; after it the stream ends with the error frame), ``health()`` turns
unhealthy (``/ready``, ``/metrics``), and the worker is started again with exponential
back-off. The worker dies with the gateway (``PR_SET_PDEATHSIG``, and a parent check).
"""

from backends.worker.supervisor import WorkerBackend

__all__ = ["WorkerBackend"]
