"""Test utilities: quick configs and a live gateway on a free loopback port.

Importable from any test (``from gateway.testing import run_gateway, gateway_config``), and
exposed as the ``live_gateway`` fixture by ``tests/conftest.py``::

    with run_gateway(gateway_config()) as gw:      # gw is the base URL (a str)
        client = gw.openai_client()                # official client, no retries
        httpx.get(f"{gw}/health")
        gw.backend("mock").num_finished            # the live backend object

The server is uvicorn in a background thread with its own event loop, speaking real HTTP
on 127.0.0.1; the block waits until ``/ready`` is 200 and stops the server on exit. Its files
(the usage ledger, and the stored responses in it) go to ``data_dir``, or to a temporary
directory removed on exit, unless the config or ``$INFERMUX_LEDGER_PATH`` names a ledger:
a test gateway never writes the working directory's ``var/``.
"""

from __future__ import annotations

import socket
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import msgspec

from backends.base import Backend, BackendConfig
from gateway.app import create_app
from gateway.config.load import config_from_dict
from gateway.config.types import (
    AuthConfig,
    InfermuxConfig,
    LimitsConfig,
    PluginsConfig,
    ServerConfig,
)
from gateway.http.header_limit import uvicorn_header_limit
from gateway.state import GatewayState

__all__ = ["LiveGateway", "gateway_config", "mock_backend", "run_gateway"]


def mock_backend(name: str = "mock", **options: Any) -> BackendConfig:
    """A ``kind = "mock"`` backend (echo; see ``backends.mock.MockOptions``)."""
    return BackendConfig(name=name, kind="mock", options=options)


def gateway_config(
    *backends: BackendConfig,
    models: Mapping[str, list[str]] | None = None,
    strategy: str = "priority",
    max_retries: int = 2,
    resume_on_failure: tuple[str, ...] = (),
    server: ServerConfig | None = None,
    limits: LimitsConfig | None = None,
    plugins: PluginsConfig | None = None,
    auth: AuthConfig | None = None,
) -> InfermuxConfig:
    """A validated config in one line: ``gateway_config(mock_backend("a"), mock_backend("b"))``.

    Without ``backends`` there is one mock backend named "mock"; without ``models`` one
    alias "echo" is served by all backends in the given order. ``resume_on_failure``: the
    aliases that continue an answer on the next backend after a mid-stream failure.
    """
    backend_list = list(backends) or [mock_backend()]
    if models is None:
        models = {"echo": [b.name for b in backend_list]}
    raw: dict[str, Any] = {
        "backends": [msgspec.to_builtins(b) for b in backend_list],
        "models": [
            {
                "alias": alias,
                "backends": list(names),
                "strategy": strategy,
                "max_retries": max_retries,
                "resume_on_failure": alias in resume_on_failure,
            }
            for alias, names in models.items()
        ],
    }
    for key, value in (
        ("server", server),
        ("limits", limits),
        ("plugins", plugins),
        ("auth", auth),
    ):
        if value is not None:
            raw[key] = msgspec.to_builtins(value)
    # Through the real validation, so a test config is a config a user could write.
    return config_from_dict(raw)


class LiveGateway(str):
    """The base URL of a running gateway (``http://127.0.0.1:PORT``), plus handles."""

    state: GatewayState

    @property
    def openai_base_url(self) -> str:
        return f"{self}/v1"

    def openai_client(self, **kwargs: Any) -> Any:
        """The official client pointed at this gateway (no retries, so failures show)."""
        import openai

        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 60.0)
        kwargs.setdefault("api_key", "unused")  # open mode (no [[auth.keys]]) ignores it
        return openai.OpenAI(base_url=self.openai_base_url, **kwargs)

    def backend(self, name: str) -> Any:
        """The live backend object (e.g. a ``MockBackend`` with its counters)."""
        return self.state.backends[name]


@contextmanager
def run_gateway(
    config: InfermuxConfig,
    *,
    plugin_manager: Any | None = None,
    backends: Mapping[str, Backend] | None = None,
    ready_timeout_s: float = 600.0,
    allow_failed_backends: bool = False,
    wait_ready: bool = True,
    data_dir: str | Path | None = None,
) -> Iterator[LiveGateway]:
    """Serve ``config`` on a free 127.0.0.1 port until the block ends.

    Waits until ``/ready`` is 200 (``wait_ready=False``: only until it listens) and raises
    if a backend failed to start, unless ``allow_failed_backends``. ``data_dir``: where the
    ledger goes when the config names none (default: a temporary directory).
    """
    with ExitStack() as stack:
        if config.cost.ledger_path is None:
            directory = data_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="infermux-gateway-"))
            ledger = str(Path(directory) / "ledger.sqlite3")
            config = msgspec.structs.replace(config, cost=msgspec.structs.replace(config.cost, ledger_path=ledger))
        yield from _serve(config, plugin_manager, backends, ready_timeout_s, allow_failed_backends, wait_ready)


def _serve(
    config: InfermuxConfig,
    plugin_manager: Any | None,
    backends: Mapping[str, Backend] | None,
    ready_timeout_s: float,
    allow_failed_backends: bool,
    wait_ready: bool,
) -> Iterator[LiveGateway]:
    import uvicorn

    app = create_app(config, plugin_manager=plugin_manager, backends=backends)
    state: GatewayState = app.state.gateway
    # proto=IPPROTO_TCP: asyncio only sets TCP_NODELAY on accepted sockets whose proto says
    # TCP; with proto 0 every small response waits ~40 ms for a delayed ACK (Nagle).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="warning",
            lifespan="on",
            access_log=False,
            **uvicorn_header_limit(config.limits.max_header_bytes),
        )
    )
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name=f"gateway-{port}", daemon=True
    )
    thread.start()
    gateway = LiveGateway(f"http://127.0.0.1:{port}")
    gateway.state = state
    try:
        _wait_listening(server, thread, ready_timeout_s)
        if wait_ready:
            _wait_ready(gateway, ready_timeout_s, allow_failed=allow_failed_backends)
        failed = {n: s for n, s in state.backend_status.items() if s.startswith("failed")}
        if wait_ready and failed and not allow_failed_backends:
            raise RuntimeError(f"backends failed to start: {failed}")
        yield gateway
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()


def _wait_listening(server: Any, thread: threading.Thread, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the gateway exited during start-up (see the log above)")
        if time.monotonic() > deadline:
            raise TimeoutError("the gateway did not start listening")
        time.sleep(0.01)


def _wait_ready(gateway: LiveGateway, timeout_s: float, *, allow_failed: bool) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=10.0) as client:
        while True:
            answer = client.get(f"{gateway}/ready")
            if answer.status_code == 200:
                return
            body = answer.json()
            # Loading is over, and a model has no started backend (or one cannot start).
            if body.get("status") in ("failed", "unavailable"):
                if allow_failed:
                    return
                raise RuntimeError(f"the gateway failed to start: {body}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gateway was not ready in {timeout_s} s: {body}")
            time.sleep(0.02)
