"""Session fixtures: one real redis-server and one real PostgreSQL for the scale-out tests.

``make test`` installs both (scripts/install_test_services.sh); without them these tests
are skipped with the reason."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import PostgresServer, RedisServer, postgres_bin


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (scripts/install_test_services.sh)")
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture()
def redis(redis_server: RedisServer) -> RedisServer:
    """The session's Redis, running and empty (a test may have killed it)."""
    if redis_server.process is None or redis_server.process.poll() is not None:
        redis_server.start()
    redis_server.flushall()
    return redis_server


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    bin_dir = postgres_bin()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed (scripts/install_test_services.sh)")
    server = PostgresServer(Path(bin_dir))
    try:
        server.start()
        yield server
    finally:
        server.stop()
