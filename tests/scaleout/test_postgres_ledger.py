"""The usage ledger on a real PostgreSQL: two replicas write one table, exactly one row per
request; ``/v1/usage`` and ``infermux usage`` read it; ``infermux usage migrate`` copies a
SQLite ledger into it once."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import psycopg
import pytest
from servers import REPO, PostgresServer, serving

from plugins.builtin.cost.ledger import Ledger, UsageRecord


@pytest.fixture()
def postgres_url(postgres_server: PostgresServer) -> str:
    """A new, empty database of the session's cluster."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_server.url, autocommit=True) as connection:
        connection.execute(f"CREATE DATABASE {name}")
    return postgres_server.url.rsplit("/", 1)[0] + "/" + name


def rows(url: str) -> list[tuple[str, int]]:
    with psycopg.connect(url) as connection:
        return connection.execute(
            "SELECT request_id, COUNT(*) FROM usage_records GROUP BY request_id"
        ).fetchall()


def served_id(gw: object, content: str = "hi") -> str:
    """The ``x-request-id`` of a chat completion that ``gw`` answered 200."""
    response = httpx.post(
        f"{gw}/v1/chat/completions",
        json={"model": "echo", "messages": [{"role": "user", "content": content}]},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    return response.headers["x-request-id"]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )


def test_two_replicas_write_one_row_per_request(postgres_url: str, tmp_path: Path) -> None:
    config = tmp_path / "pg.toml"
    config.write_text(
        '[[backends]]\nname = "mock"\nkind = "mock"\n'
        '[[models]]\nalias = "echo"\nbackends = ["mock"]\n'
        f'[cost]\ndatabase = "{postgres_url}"\n'
        '[[cost.prices]]\nmodel = "echo"\noutput_per_mtok = 1000000.0\n'
    )
    with ExitStack() as stack:
        pair = [stack.enter_context(serving(config, {})) for _ in range(2)]

        with ThreadPoolExecutor(8) as pool:
            request_ids = list(pool.map(lambda i: served_id(pair[i % 2], "one two"), range(40)))

        # Each record was committed before its response ended.
        counted = rows(postgres_url)
        assert sorted(request_id for request_id, _ in counted) == sorted(request_ids)
        assert {count for _, count in counted} == {1}
        # Either replica reports what both recorded.
        report = httpx.get(f"{pair[1]}/v1/usage", timeout=30).json()
        assert report["totals"]["requests"] == 40
        assert report["totals"]["output_tokens"] == 80
        assert report["totals"]["cost"] == pytest.approx(80.0)

    shown = cli("usage", "--config", str(config), "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["totals"]["requests"] == 40


def _records(num: int) -> list[UsageRecord]:
    now = time.time()
    return [
        UsageRecord(
            request_id=f"req-{i}",
            created_at=now - 86400 * (i % 2),
            finished_at=now,
            api_key_id="team-a" if i % 2 else "team-b",
            model="echo",
            kind="chat",
            status="ok" if i else "error",
            input_tokens=3,
            output_tokens=5,
            cost=0.5,
            duration_s=0.1,
        )
        for i in range(num)
    ]


def test_migrate_copies_a_sqlite_ledger_once(postgres_url: str, tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    ledger = Ledger(path)

    async def write() -> None:
        for record in _records(5):
            await ledger.write(record)

    asyncio.run(write())
    ledger.close()

    first = cli("usage", "migrate", "--db", str(path), "--to", postgres_url)
    assert first.returncode == 0, first.stderr
    assert "5 records read" in first.stdout and "5 added" in first.stdout
    again = cli("usage", "migrate", "--db", str(path), "--to", postgres_url)
    assert again.returncode == 0, again.stderr
    assert "0 added" in again.stdout
    assert len(rows(postgres_url)) == 5

    # The same report from either ledger.
    from_sqlite = json.loads(cli("usage", "--db", str(path), "--json").stdout)
    from_postgres = json.loads(cli("usage", "--db", postgres_url, "--json").stdout)
    assert from_postgres == from_sqlite
    assert from_postgres["totals"]["failed_requests"] == 1
    assert len(from_postgres["per_day"]) == 2
    key_only = json.loads(cli("usage", "--db", postgres_url, "--key", "team-a", "--json").stdout)
    assert key_only["totals"]["requests"] == 2


def test_migrate_names_a_bad_target(tmp_path: Path) -> None:
    refused = cli("usage", "migrate", "--db", str(tmp_path / "x.sqlite3"), "--to", "mysql://x")
    assert refused.returncode == 2
    assert "--to must be a postgresql:// URL" in refused.stderr


def test_postgres_down_spools_records_and_moves_them_once_it_is_back(tmp_path: Path) -> None:
    """Its own cluster (this test stops it): no request fails, no record is lost."""
    from servers import postgres_bin

    bin_dir = postgres_bin()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed (scripts/install_test_services.sh)")
    server = PostgresServer(bin_dir)
    server.start()
    try:
        config = tmp_path / "pg.toml"
        config.write_text(
            '[[backends]]\nname = "mock"\nkind = "mock"\n'
            '[[models]]\nalias = "echo"\nbackends = ["mock"]\n'
            f'[cost]\ndatabase = "{server.url}"\nledger_path = "{tmp_path / "ledger.sqlite3"}"\n'
        )
        spool = tmp_path / "ledger.pg-spool.sqlite3"

        with serving(config, {}) as gw:
            request_ids = [served_id(gw) for _ in range(3)]
            assert len(rows(server.url)) == 3
            server.kill()
            request_ids += [served_id(gw) for _ in range(5)]  # every one answered 200
            assert spool.exists()
            server.start()
            deadline = time.monotonic() + 60
            while len(rows(server.url)) < 8:  # the mover tries every 2 s
                assert time.monotonic() < deadline, "spooled records were not moved"
                time.sleep(0.2)
            request_ids.append(served_id(gw))  # straight to Postgres again
            log = gw.log_path.read_text()
        counted = dict(rows(server.url))
        assert sorted(counted) == sorted(request_ids)
        assert set(counted.values()) == {1}
        assert log.count("unreachable") == 1 and log.count("reachable again") == 1, log
        import sqlite3

        with sqlite3.connect(spool) as connection:
            assert connection.execute("SELECT COUNT(*) FROM usage_records").fetchone() == (0,)
    finally:
        server.stop()
