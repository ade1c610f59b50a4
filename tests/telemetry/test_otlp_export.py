"""OTLP/HTTP export from a running ``infermux serve``, configured only by ``OTEL_*`` variables.

A real receiver on loopback decodes ``ExportTraceServiceRequest`` with opentelemetry-proto.
When the collector is down or hangs, requests still succeed: export happens in the batch
processor's thread, from a bounded queue.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from gateway.testing import run_gateway
from plugins.builtin.tracing import TracingPlugin
from plugins.manager import create_plugin_manager
from tests.telemetry.served_process import (
    OtlpReceiver,
    ServedGateway,
    free_port,
    mock_config_toml,
    span_attributes,
)
from tests.telemetry.telemetry_util import make_config, mock

CLIENT_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{CLIENT_TRACE_ID}-b7ad6b7169203331-01"


def chat(url: str, stream: bool = False, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "model": "echo",
            "messages": [{"role": "user", "content": "trace me please"}],
            "stream": stream,
        },
        headers=headers,
        timeout=60,
    )


def wait_for(predicate: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.05)


def test_a_running_server_exports_spans_and_metrics_to_the_collector(tmp_path: Path) -> None:
    config = mock_config_toml(tmp_path / "infermux.toml", token_delay_s=0.001)
    with OtlpReceiver() as receiver:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_SERVICE_NAME": "infermux-under-test",
            "OTEL_BSP_SCHEDULE_DELAY": "50",
            "OTEL_METRIC_EXPORT_INTERVAL": "200",
            "INFERMUX_LEDGER_PATH": str(tmp_path / "ledger.sqlite3"),
        }
        with ServedGateway(config, env=env, log=tmp_path / "serve.log") as server:
            answer = chat(server.url, traceparent=TRACEPARENT)
            assert answer.status_code == 200
            request_id = answer.headers["x-request-id"]

            def request_span() -> Any:
                for resource, span in receiver.spans():
                    if span_attributes(span).get("infermux.request_id") == request_id:
                        return resource, span
                return None

            wait_for(lambda: request_span() is not None)
            wait_for(lambda: "gen_ai.server.time_to_first_token" in receiver.metric_names())
    resource, span = request_span()
    assert resource["service.name"] == "infermux-under-test"
    assert span.name == "chat echo"
    assert span.trace_id.hex() == CLIENT_TRACE_ID  # the client's trace continues here
    attributes = span_attributes(span)
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.usage.output_tokens"] == answer.json()["usage"]["completion_tokens"]
    names = {s.name for _, s in receiver.spans() if s.trace_id == span.trace_id}
    assert names == {"chat echo", "route echo", "attempt mock"}
    assert {"gen_ai.server.request.duration", "gen_ai.client.token.usage"} <= (
        receiver.metric_names()
    )


def test_with_the_collector_down_requests_succeed_and_the_server_exits_cleanly(
    tmp_path: Path,
) -> None:
    config = mock_config_toml(tmp_path / "infermux.toml")
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}",  # nothing listens
        "OTEL_BSP_SCHEDULE_DELAY": "10",
        "OTEL_METRICS_EXPORTER": "none",
        "INFERMUX_LEDGER_PATH": str(tmp_path / "ledger.sqlite3"),
    }
    server = ServedGateway(config, env=env, log=tmp_path / "serve.log").wait_ready()
    try:
        for i in range(10):
            answer = chat(server.url, stream=i % 2 == 1)
            assert answer.status_code == 200
    finally:
        code = server.stop()
    assert code == 0, server.log.read_text()
    assert "tracing on" in server.log.read_text()


class SilentCollector:
    """Accepts connections and never answers: an exporter talking to it is stuck."""

    def __init__(self) -> None:
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}/v1/traces"
        self.connections: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            self.connections.append(connection)

    def close(self) -> None:
        # shutdown() first: close() alone does not wake a thread blocked in accept(), and
        # the socket would go on accepting.
        self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(10)
        for connection in self.connections:
            connection.close()


def test_requests_do_not_wait_for_a_collector_that_hangs(tmp_path: Path) -> None:
    collector = SilentCollector()
    # What build_tracer_provider makes from OTEL_*, with the exporter kept at hand so that
    # the test can stop its retries at the end.
    exporter = OTLPSpanExporter(endpoint=collector.endpoint, timeout=30)
    provider = TracerProvider()
    provider.add_span_processor(
        BatchSpanProcessor(exporter, schedule_delay_millis=1, max_export_batch_size=1)
    )
    config = make_config(mock("a"), cost={"ledger_path": str(tmp_path / "ledger.sqlite3")})
    pm = create_plugin_manager(config=config.plugins, load_entry_points=False)
    pm.unregister(name="builtin.tracing")
    pm.register(TracingPlugin(tracer_provider=provider), name="builtin.tracing")
    try:
        with run_gateway(config, plugin_manager=pm) as gw:
            assert chat(gw).status_code == 200
            # The exporter has sent the first span batch and waits for an answer ...
            wait_for(lambda: len(collector.connections) >= 1)
            # ... and meanwhile every request is served; their spans queue up behind it.
            for i in range(20):
                assert chat(gw, stream=i % 2 == 0).status_code == 200
            assert len(collector.connections) == 1  # still the first, unanswered export
    finally:
        exporter.shutdown()  # no more retries: the provider's shutdown below is quick
        collector.close()
        provider.shutdown()
