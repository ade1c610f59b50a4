"""The faults of test_upstream_faults.py over ``https://``: the same tests, against upstreams
that serve TLS with a certificate of a CA made for the run (``test_ca``), reached through the
``openai`` backend's httpx client trusting that CA (``ca_bundle``). Plus what only TLS has: a
handshake that never completes, and a certificate the backend does not trust.

The imported tests run here with this module's ``upstream_servers`` (TLS servers); their
``remote()`` finds each server's CA through ``backend_tls_options``.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from reliability_util import assert_still_serving, envelope
from test_upstream_faults import (  # noqa: F401  (collected here again, over TLS)
    ask,
    assert_connect_timeout_falls_back_to_b,
    config_with,
    remote,
    test_a_dropped_connection_falls_back_before_the_first_byte,
    test_a_stalled_stream_ends_with_stream_idle_timeout_and_cancels_upstream,
    test_client_disconnect_before_the_first_byte_aborts_upstream,
    test_client_disconnect_mid_stream_aborts_upstream_and_records_once,
    test_first_byte_timeout_falls_back_to_the_next_backend,
    test_first_byte_timeout_is_504_and_cancels_the_upstream_request,
    test_total_timeout_cuts_a_slow_stream,
    test_upstream_5xx_is_retried_elsewhere_else_502,
    test_upstream_death_mid_stream_is_an_error_frame_with_partial_usage_once,
    test_upstream_death_without_stream_is_502_with_partial_usage_once,
)
from upstream_server import Behaviour, TLSFiles, UpstreamServer

from backends._option import BackendOptionError
from backends.base import BackendConfig
from backends.openai_compat import OpenAICompatBackend


@pytest.fixture
def upstream_servers(test_ca: TLSFiles) -> Iterator[Callable[..., UpstreamServer]]:
    """The reliability suite's factory, serving TLS with ``test_ca``'s certificate."""
    started: list[UpstreamServer] = []

    def start(behaviour: Behaviour | None = None, *, name: str = "upstream") -> UpstreamServer:
        server = UpstreamServer(behaviour, name=name, tls=test_ca).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def test_the_servers_here_speak_tls(upstream_servers: Callable[..., UpstreamServer]) -> None:
    a = upstream_servers(name="a")
    assert a.base_url.startswith("https://127.0.0.1:")
    with pytest.raises(httpx.RemoteProtocolError):  # plain HTTP to a TLS port
        httpx.get(a.base_url.replace("https://", "http://") + "/models", timeout=10)


@pytest.fixture
def silent_tls_url() -> Iterator[str]:
    """An https URL whose server accepts TCP connections and never answers the handshake."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield f"https://127.0.0.1:{server.getsockname()[1]}/v1"
    server.close()


def test_a_handshake_that_never_completes_is_a_connect_timeout_and_falls_back(
    live_gateway: Any, upstream_servers: Callable[..., UpstreamServer], silent_tls_url: str
) -> None:
    b = upstream_servers(name="b")
    config = config_with(remote("a", silent_tls_url, connect_timeout=0.3), remote("b", b.base_url))
    with live_gateway(config) as gw:
        assert_connect_timeout_falls_back_to_b(gw)


def test_an_untrusted_certificate_fails_at_once_naming_the_certificate(
    live_gateway: Any, upstream_servers: Callable[..., UpstreamServer]
) -> None:
    a = upstream_servers(name="a")
    # The system trust store does not know the test CA.
    untrusted = BackendConfig(
        name="a", kind="openai", options={"base_url": a.base_url}, connect_timeout=30
    )
    with live_gateway(config_with(untrusted, max_retries=0)) as gw:
        response = ask(gw)
        error = envelope(response, 503)
        assert error["code"] == "backend_unavailable"
        assert "certificate verify failed" in error["message"]
        assert a.num_requests == 0  # nothing was sent over the unverified connection
        assert_still_serving(gw)


def test_ca_bundle_is_checked_when_the_backend_is_configured(
    test_ca: TLSFiles, tmp_path: Any
) -> None:
    def backend(**options: Any) -> OpenAICompatBackend:
        return OpenAICompatBackend(BackendConfig(name="r", kind="openai", options=options))

    assert backend(base_url="https://127.0.0.1:9/v1", ca_bundle=test_ca.ca_bundle)
    cases = [
        (
            {"base_url": "https://127.0.0.1:9/v1", "ca_bundle": str(tmp_path / "none.pem")},
            "cannot load",
        ),
        ({"base_url": "http://127.0.0.1:9/v1", "ca_bundle": test_ca.ca_bundle}, "https://"),
        (
            {
                "base_url": "https://127.0.0.1:9/v1",
                "ca_bundle": test_ca.ca_bundle,
                "verify_tls": False,
            },
            "verify_tls",
        ),
    ]
    for options, words in cases:
        with pytest.raises(BackendOptionError) as raised:
            backend(**options)
        assert "backends.r.options.ca_bundle" in str(raised.value) and words in str(raised.value)
