"""Real servers for the scale-out tests: redis-server, PostgreSQL and ``infermux serve``
processes, each on a free 127.0.0.1 port with a temporary data folder, stopped after use."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for(check: object, process: subprocess.Popen[bytes] | None, what: str) -> None:
    """Poll ``check()`` until true; fail when ``process`` died or after 60 s."""
    deadline = time.monotonic() + 60
    while not check():  # type: ignore[operator]
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start within 60 s")
        time.sleep(0.05)


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class RedisServer:
    """``redis-server`` without persistence on a fixed port: it can be killed and started
    again on the same port (a Redis that came back empty, as after a crash)."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        _wait_for(lambda: _accepts(self.port), self.process, "redis-server")

    def kill(self) -> None:
        """SIGKILL: connections drop, nothing is saved."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def flushall(self) -> None:
        subprocess.run(
            ["redis-cli", "-p", str(self.port), "flushall"], check=True, capture_output=True
        )


def postgres_bin() -> Path | None:
    """The folder of PostgreSQL's server programs (Debian keeps them per version)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


class PostgresServer:
    """A throwaway cluster (``initdb`` + ``pg_ctl``) on 127.0.0.1, trust auth for loopback.

    PostgreSQL refuses to run as root, so as root (CI) the cluster belongs to ``nobody``
    and its programs run through ``runuser``."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin_dir = bin_dir
        self.port = free_port()
        self.datadir = Path(tempfile.mkdtemp(prefix="infermux-pg-"))
        self._as: list[str] = []
        if os.geteuid() == 0:
            user = pwd.getpwnam("nobody")
            os.chown(self.datadir, user.pw_uid, user.pw_gid)
            self._as = ["runuser", "-u", "nobody", "--"]

    @property
    def url(self) -> str:
        return f"postgresql://infermux@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        subprocess.run([*self._as, *args], check=True, capture_output=True, cwd="/")

    def start(self) -> None:
        """Create the cluster (the first time), then start it on ``port``."""
        cluster = self.datadir / "data"
        if not cluster.exists():
            self._run(
                str(self.bin_dir / "initdb"), "-D", str(cluster), "-U", "infermux",
                "--auth=trust", "--no-sync", "-E", "UTF8",
            )  # fmt: skip
        options = (
            f"-c listen_addresses=127.0.0.1 -c port={self.port} "
            f"-c unix_socket_directories={self.datadir} -c fsync=off"
        )
        self._run(
            str(self.bin_dir / "pg_ctl"), "-D", str(cluster), "-o", options,
            "-l", str(self.datadir / "log"), "-w", "start",
        )  # fmt: skip

    def kill(self) -> None:
        """Stop at once (``-m immediate``: connections drop); :meth:`start` brings it back."""
        try:
            self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.datadir / "data"), "-m",
                      "immediate", "-w", "stop")  # fmt: skip
        except subprocess.CalledProcessError:
            pass

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.datadir, ignore_errors=True)


class Gateway:
    """One ``infermux serve`` process (a replica) on a free loopback port."""

    def __init__(self, process: subprocess.Popen[str], base_url: str, log_path: Path) -> None:
        self.process = process
        self.base_url = base_url
        #: Its stdout and stderr (the gateway's log).
        self.log_path = log_path

    def __str__(self) -> str:
        return self.base_url


@contextmanager
def serving(config: Path, env: Mapping[str, str]) -> Iterator[Gateway]:
    """``infermux serve --config config`` with ``env`` added; ready when this yields."""
    port = free_port()
    log = config.with_suffix(f".{port}.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config),
         "--port", str(port)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{base}/ready", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    try:
        try:
            _wait_for(ready, process, f"infermux serve --config {config.name}")  # type: ignore[arg-type]
        except RuntimeError as exc:
            process.kill()
            process.wait()
            raise RuntimeError(f"{exc}: {Path(log.name).read_text()[-3000:]}") from None
        yield Gateway(process, base, Path(log.name))
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()
        log.close()
