"""A real ``infermux serve`` process and a real OTLP/HTTP receiver, both on loopback."""

from __future__ import annotations

import gzip
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

__all__ = ["OtlpReceiver", "ServedGateway", "free_port", "mock_config_toml"]

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def mock_config_toml(path: Path, **options: Any) -> Path:
    """A config file serving alias "echo" from one mock backend with ``options``."""
    lines = ["[[backends]]", 'name = "mock"', 'kind = "mock"', "[backends.options]"]
    lines += [f"{key} = {value!r}" for key, value in options.items()]
    lines += ["", "[[models]]", 'alias = "echo"', 'backends = ["mock"]', ""]
    path.write_text("\n".join(lines))
    return path


class ServedGateway:
    """``infermux serve --config ...`` in a subprocess; its log goes to a file."""

    def __init__(self, config: Path, *, env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # The usage ledger beside the log (the test's tmp_path), never ./var, unless given.
        full_env = {**os.environ, "INFERMUX_LEDGER_PATH": str(log.parent / "ledger.sqlite3"), **env}
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO), full_env.get("PYTHONPATH", "")) if p
        )
        self.log = log
        self._log_file = log.open("ab")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gateway.cli",
                "serve",
                "--config",
                str(config),
                "--port",
                str(self.port),
                "--no-access-log",
            ],
            cwd=REPO,
            env=full_env,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout_s: float = 120.0) -> ServedGateway:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"infermux exited during start-up:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"infermux not ready in {timeout_s} s:\n{self.log.read_text()}")

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM and wait; the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)
        self._log_file.close()
        return self.process.returncode

    def __enter__(self) -> ServedGateway:
        return self.wait_ready()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class OtlpReceiver:
    """An OTLP/HTTP (protobuf) collector: keeps every decoded export request."""

    def __init__(self) -> None:
        self.traces: list[ExportTraceServiceRequest] = []
        self.metrics: list[ExportMetricsServiceRequest] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path == "/v1/traces":
                    request = ExportTraceServiceRequest()
                    request.ParseFromString(body)
                    receiver.traces.append(request)
                    answer = ExportTraceServiceResponse().SerializeToString()
                elif self.path == "/v1/metrics":
                    metrics = ExportMetricsServiceRequest()
                    metrics.ParseFromString(body)
                    receiver.metrics.append(metrics)
                    answer = ExportMetricsServiceResponse().SerializeToString()
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def spans(self) -> list[tuple[dict[str, Any], Any]]:
        """``(resource attributes, span)`` for every span received so far."""
        found = []
        for request in list(self.traces):
            for resource_spans in request.resource_spans:
                resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    found.extend((resource, span) for span in scope_spans.spans)
        return found

    def metric_names(self) -> set[str]:
        return {
            metric.name
            for request in list(self.metrics)
            for resource_metrics in request.resource_metrics
            for scope_metrics in resource_metrics.scope_metrics
            for metric in scope_metrics.metrics
        }

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def span_attributes(span: Any) -> dict[str, Any]:
    """An OTLP protobuf span's attributes as plain values."""
    values: dict[str, Any] = {}
    for attribute in span.attributes:
        value = attribute.value
        kind = value.WhichOneof("value")
        values[attribute.key] = getattr(value, kind) if kind else None
    return values
