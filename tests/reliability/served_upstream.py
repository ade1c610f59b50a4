"""Upstream servers in processes of their own, to be killed for real (SIGKILL): another
``infermux serve`` and llama.cpp's ``llama-server``, each on a loopback port that it keeps
when started again, so a front gateway configured once reaches every incarnation.

    upstream = infermux_upstream(tmp_path / "up", CORE_OPTIONS)   # started, ready
    upstream.openai_base_url                                      # http://127.0.0.1:PORT/v1
    upstream.kill()                                               # SIGKILL, reaped
    upstream.start()                                              # again, same port
    upstream.stop()                                               # SIGTERM (SIGKILL after 30 s)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

__all__ = [
    "REPO",
    "ServedUpstream",
    "free_port",
    "infermux_upstream",
    "llama_server_binary",
    "llama_server",
]

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServedUpstream:
    """One server process: ``argv`` with ``{port}`` filled in, ready when ``GET
    {base_url}{ready_path}`` answers 200. Its output goes to ``log``."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        cwd: Path,
        log: Path,
        ready_path: str,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._argv = [arg.format(port=self.port) for arg in argv]
        self._cwd = cwd
        self._log = log
        self._ready_path = ready_path
        self._env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def openai_base_url(self) -> str:
        return f"{self.base_url}/v1"

    @property
    def pid(self) -> int:
        assert self.process is not None, "not started"
        return self.process.pid

    def start(self, timeout_s: float = 180.0) -> ServedUpstream:
        """Start it and wait until it is ready (an error with its log if it exits or is not
        ready within ``timeout_s``)."""
        assert self.process is None or self.process.poll() is not None, "already running"
        with self._log.open("ab") as log:
            self.process = subprocess.Popen(
                self._argv, cwd=self._cwd, env=self._env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self._argv[0]} exited during start-up:\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + self._ready_path, timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(
                    f"{self._argv[0]} not ready in {timeout_s} s:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs, the kernel closes its sockets."""
        os.kill(self.pid, signal.SIGKILL)
        assert self.process is not None
        self.process.wait(30)

    def stop(self) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)

    def log_tail(self, num_chars: int = 4000) -> str:
        return self._log.read_text(errors="replace")[-num_chars:] if self._log.exists() else ""


def infermux_upstream(
    folder: Path, backend_options: Mapping[str, Any], *, alias: str = "smollm2"
) -> ServedUpstream:
    """``infermux serve`` of the default model on the core engine (in the server's own
    process: one process to kill) as ``alias``; everything it writes stays in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    options = "\n".join(f"{key} = {_toml(value)}" for key, value in backend_options.items())
    config = folder / "upstream.toml"
    config.write_text(
        '[[backends]]\nname = "core"\nkind = "core_engine"\nworker_process = false\n'
        f"[backends.options]\n{options}\n\n"
        f'[[models]]\nalias = "{alias}"\nbackends = ["core"]\n'
    )
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config),
            "--port", "{port}", "--no-access-log"]  # fmt: skip
    env = {
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
        ),
        "INFERMUX_LEDGER_PATH": str(folder / "ledger.sqlite3"),
    }
    return ServedUpstream(
        argv, cwd=folder, log=folder / "upstream.log", ready_path="/ready", env=env
    ).start()


def llama_server_binary() -> Path:
    """``$INFERMUX_LLAMA_SERVER``, else what scripts/build_llama_server.sh built (it prints the
    cached binary at once; on a machine without one it builds it: about 10 minutes on 2 cores)."""
    given = os.environ.get("INFERMUX_LLAMA_SERVER")
    if given:
        return Path(given)
    script = REPO / "scripts" / "build_llama_server.sh"
    output = subprocess.run(
        [str(script)], check=True, stdout=subprocess.PIPE, text=True, timeout=3600, cwd=REPO
    ).stdout
    return Path(output.strip().splitlines()[-1])


def llama_server(binary: Path, model: Path, folder: Path) -> ServedUpstream:
    """llama.cpp's ``llama-server`` serving ``model`` (one slot, one thread, the GGUF's chat
    template); ready when ``/health`` says the model is loaded."""
    folder.mkdir(parents=True, exist_ok=True)
    argv = [str(binary), "--model", str(model), "--host", "127.0.0.1", "--port", "{port}",
            "--ctx-size", "512", "--threads", "1", "--parallel", "1", "--jinja"]  # fmt: skip
    return ServedUpstream(
        argv, cwd=folder, log=folder / "llama-server.log", ready_path="/health"
    ).start()


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)
