"""Graceful drain on SIGTERM: ``infermux serve`` in a subprocess with a slow mock backend."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from reliability_util import envelope, wait_until

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serving(
    tmp_path: Path, *, drain_timeout_s: float
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    config = tmp_path / "slow.toml"
    config.write_text(
        f"[server]\ndrain_timeout_s = {drain_timeout_s}\n"
        '[[backends]]\nname = "slow"\nkind = "mock"\n'
        "[backends.options]\ntoken_delay_s = 0.05\n"
        '[[models]]\nalias = "echo"\nbackends = ["slow"]\n'
    )
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "serve",
            "--config",
            str(config),
            "--port",
            str(port),
        ],
        cwd=REPO,
        env={**os.environ, "INFERMUX_LEDGER_PATH": str(tmp_path / "ledger.sqlite3")},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.05)
        yield process, base
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


class StreamReader(threading.Thread):
    """Streams one long completion in the background, keeping every frame."""

    def __init__(self, base: str, num_words: int) -> None:
        super().__init__(daemon=True)
        self.base = base
        self.prompt = " ".join(f"w{i}" for i in range(num_words))
        self.frames: list[str] = []
        self.started_streaming = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"model": "echo", "prompt": self.prompt, "max_tokens": 1000, "stream": True}
        try:
            with httpx.stream("POST", f"{self.base}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.frames.append(line[len("data: ") :])
                        self.started_streaming.set()
        except httpx.HTTPError as exc:  # the connection may be cut when the window is over
            self.error = exc

    @property
    def text(self) -> str:
        return "".join(
            json.loads(f)["choices"][0]["text"]
            for f in self.frames
            if f != "[DONE]" and "error" not in json.loads(f) and json.loads(f)["choices"]
        )


def test_sigterm_drains_in_flight_streams_then_exits_0(tmp_path: Path) -> None:
    with serving(tmp_path, drain_timeout_s=30) as (process, base):
        reader = StreamReader(base, num_words=40)  # about 2 s of tokens
        reader.start()
        assert reader.started_streaming.wait(30)
        process.send_signal(signal.SIGTERM)

        wait_until(lambda: httpx.get(f"{base}/ready").status_code == 503, timeout_s=10)
        assert httpx.get(f"{base}/ready").json()["status"] == "draining"
        refused = httpx.post(f"{base}/v1/completions", json={"model": "echo", "prompt": "x"})
        error = envelope(refused, 503)
        assert error["code"] == "server_is_overloaded"
        assert refused.headers["retry-after"] == "1"
        assert httpx.get(f"{base}/health").status_code == 200  # alive while draining

        reader.join(timeout=60)
        assert reader.error is None
        assert reader.frames[-1] == "[DONE]"  # the in-flight stream finished completely
        assert reader.text == reader.prompt
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 0, stderr
        assert "draining" in stderr and "drained in" in stderr


def test_the_drain_window_bounds_the_wait_and_still_exits_0(tmp_path: Path) -> None:
    with serving(tmp_path, drain_timeout_s=0.5) as (process, base):
        reader = StreamReader(base, num_words=600)  # about 30 s of tokens
        reader.start()
        assert reader.started_streaming.wait(30)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
        assert process.returncode == 0, stderr
        assert "drain window of 0.5 s is over: cancelling 1 request(s)" in stderr
        reader.join(timeout=30)
        assert "[DONE]" not in reader.frames  # cut short, never reported as complete
        assert len(reader.text.split()) < 600
