"""Stored Responses (``store``, ``previous_response_id``, ``GET``/``DELETE
/v1/responses/{id}``) on a real PostgreSQL shared by two ``infermux serve`` replicas, each
with its own ledger folder as on two machines: what one replica stored, the other continues,
reads and deletes. The per-key and per-tenant byte quotas (``[responses] max_bytes_per_key``,
``max_bytes_per_tenant``) evict the oldest across replicas. And a store call never runs on the event loop: a locked SQLite
store holds its own request only, while ``/health`` answers."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import msgspec
import psycopg
import pytest
from servers import Gateway, serving
from test_postgres_ledger import postgres_url  # noqa: F401 - the fixture: a fresh database

from gateway.http.auth import hash_key
from gateway.openai.response_store import (
    PostgresResponseStore,
    ResponseStore,
    StoredResponseTooLargeError,
)
from gateway.testing import gateway_config

ALICE = "sk-alice-shared-responses-0123456789"
BOB = "sk-bob-shared-responses-9876543210"
#: One stored response of ``WORDS`` (its body and conversation) is about 2 KB on the mock
#: backend, so 5000 bytes hold two of them, not three; ``LONG`` alone is over 5000.
WORDS = " ".join(f"w{i}" for i in range(100))
LONG = " ".join(f"w{i}" for i in range(400))
QUOTA = 5000


@contextmanager
def replicas(url: str, tmp_path: Path, extra: str = "") -> Iterator[list[Gateway]]:
    """Two replicas on ``url``, each with its own ledger folder (its own SQLite file)."""
    keys = "".join(
        f'[[auth.keys]]\nid = "{name}"\nkey_sha256 = "{hash_key(key)}"\n'
        for name, key in (("alice", ALICE), ("bob", BOB))
    )
    with ExitStack() as stack:
        pair = []
        for name in ("a", "b"):
            config = tmp_path / f"{name}.toml"
            config.write_text(
                '[[backends]]\nname = "mock"\nkind = "mock"\n'
                '[[models]]\nalias = "echo"\nbackends = ["mock"]\n'
                f'[cost]\ndatabase = "{url}"\nledger_path = "{tmp_path / name / "ledger.sqlite3"}"\n'
                f"{extra}{keys}"
            )
            pair.append(stack.enter_context(serving(config, {})))
        yield pair


def call(method: str, gw: Gateway, path: str, key: str = ALICE, **body: Any) -> httpx.Response:
    return httpx.request(
        method,
        f"{gw}{path}",
        json={"model": "echo", **body} if body else None,
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    )


def create(gw: Gateway, key: str = ALICE, **body: Any) -> dict[str, Any]:
    answer = call("POST", gw, "/v1/responses", key, store=True, **body)
    assert answer.status_code == 200, answer.text
    created: dict[str, Any] = answer.json()
    return created


def test_a_response_stored_on_one_replica_is_continued_read_and_deleted_on_the_other(
    postgres_url: str,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    with replicas(postgres_url, tmp_path) as (one, two):
        first = create(one, input="alpha beta gamma")
        assert first["usage"]["input_tokens"] == 3 and first["usage"]["output_tokens"] == 3

        # Continued on the other replica: the backend got the first turn (3 words in, 3
        # out) before the new input (1 word).
        second = create(two, input="delta", previous_response_id=first["id"])
        assert second["previous_response_id"] == first["id"]
        assert second["usage"]["input_tokens"] == 3 + 3 + 1

        # Either replica reads what the other stored, as it was answered.
        assert call("GET", two, f"/v1/responses/{first['id']}").json() == first
        assert call("GET", one, f"/v1/responses/{second['id']}").json() == second
        # Keyed on the API key on every replica.
        assert call("GET", two, f"/v1/responses/{first['id']}", BOB).status_code == 404

        deleted = call("DELETE", two, f"/v1/responses/{first['id']}")
        assert deleted.status_code == 200, deleted.text
        assert deleted.json()["id"] == first["id"] and deleted.json()["deleted"] is True
        gone = call("GET", one, f"/v1/responses/{first['id']}")
        assert gone.status_code == 404 and gone.json()["error"]["param"] == "response_id"
        refused = call("POST", one, "/v1/responses", input="again", previous_response_id=first["id"])
        assert refused.status_code == 404
        assert refused.json()["error"]["param"] == "previous_response_id"
        assert call("GET", two, f"/v1/responses/{second['id']}").status_code == 200

    # Nothing went to the replicas' own SQLite files.
    for name in ("a", "b"):
        ledger = tmp_path / name / "ledger.sqlite3"
        assert not ledger.exists() or "responses" not in _sqlite_tables(ledger)


def _sqlite_tables(path: Path) -> set[str]:
    with sqlite3.connect(path) as connection:
        return {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def test_the_byte_quota_evicts_a_keys_oldest_responses_on_every_replica(
    postgres_url: str,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    with replicas(postgres_url, tmp_path, f"[responses]\nmax_bytes_per_key = {QUOTA}\n") as (one, two):
        oldest = create(one, input=WORDS)
        bobs = create(two, BOB, input=WORDS)
        middle = create(two, input=WORDS)
        newest = create(one, input=WORDS)  # alice's third: over 5000 bytes with the oldest

        for gw in (one, two):
            assert call("GET", gw, f"/v1/responses/{oldest['id']}").status_code == 404
            for kept in (middle, newest):
                assert call("GET", gw, f"/v1/responses/{kept['id']}").status_code == 200
            # Another key's responses are not alice's quota.
            assert call("GET", gw, f"/v1/responses/{bobs['id']}", BOB).status_code == 200
        with psycopg.connect(postgres_url) as connection:
            stored = connection.execute(
                "SELECT COUNT(*), SUM(size) FROM responses WHERE api_key_id = 'alice'"
            ).fetchone()
        assert stored is not None and stored[0] == 2 and stored[1] <= QUOTA

        # One response bigger than the whole quota: refused, naming `store`; nothing evicted.
        refused = call("POST", two, "/v1/responses", input=LONG, store=True)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "store"
        assert error["code"] == "stored_response_too_large" and "max_bytes_per_key" in error["message"]
        assert call("GET", one, f"/v1/responses/{middle['id']}").status_code == 200
        # Not stored, it is answered.
        assert call("POST", two, "/v1/responses", input=LONG, store=False).status_code == 200


def test_the_sqlite_store_applies_the_same_byte_quota(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "ledger.sqlite3", max_bytes_per_key=250)
    conversation = [{"role": "user", "content": "x" * 40}]  # 50 bytes as JSON, plus the body
    for i in range(3):
        store.put(f"r{i}", "k", b"b" * 50, conversation)  # 100 bytes each
    store.put("other", "j", b"b" * 50, conversation)
    assert store.get("r0", "k") is None  # three were 300 bytes: the oldest went
    assert store.get("r1", "k") is not None and store.get("r2", "k") is not None
    assert store.get("other", "j") is not None
    with pytest.raises(StoredResponseTooLargeError, match="max_bytes_per_key"):
        store.put("huge", "k", b"b" * 300, [])
    assert store.get("r1", "k") is not None  # nothing evicted for a refused one
    store.close()


def test_the_tenant_byte_quota_spans_its_keys_on_every_replica(
    postgres_url: str,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    """alice and bob are keys of one tenant (the default one): together they may store
    ``QUOTA`` bytes, so bob's response evicts alice's oldest."""
    limits = f"[responses]\nmax_bytes_per_tenant = {QUOTA}\n"
    with replicas(postgres_url, tmp_path, limits) as (one, two):
        oldest = create(one, input=WORDS)
        bobs = create(two, BOB, input=WORDS)
        newest = create(two, input=WORDS)  # the tenant's third: over 5000 bytes with the oldest
        for gw in (one, two):
            assert call("GET", gw, f"/v1/responses/{oldest['id']}").status_code == 404
            assert call("GET", gw, f"/v1/responses/{bobs['id']}", BOB).status_code == 200
            assert call("GET", gw, f"/v1/responses/{newest['id']}").status_code == 200
        with psycopg.connect(postgres_url) as connection:
            stored = connection.execute("SELECT COUNT(*), SUM(size) FROM responses WHERE tenant = 'default'").fetchone()
        assert stored is not None and stored[0] == 2 and stored[1] <= QUOTA


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_both_stores_bound_a_tenant_across_its_keys(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    store: Any
    if kind == "sqlite":
        store = ResponseStore(tmp_path / "ledger.sqlite3", max_bytes_per_tenant=250)
    else:
        store = PostgresResponseStore(request.getfixturevalue("postgres_url"), max_bytes_per_tenant=250)
    conversation = [{"role": "user", "content": "x" * 40}]  # 50 bytes as JSON, plus the body
    store.put("t1", "k1", b"b" * 50, conversation, "acme")  # 100 bytes each
    store.put("t2", "k2", b"b" * 50, conversation, "acme")
    store.put("u1", "j", b"b" * 50, conversation, "globex")
    store.put("open", None, b"b" * 50, conversation)  # no tenant (open mode): its key's quota only
    store.put("t3", "k1", b"b" * 50, conversation, "acme")  # acme's third: 300 bytes
    assert store.get("t1", "k1") is None  # acme's oldest went, though k1 itself holds 200 bytes
    assert store.get("t2", "k2") is not None and store.get("t3", "k1") is not None
    assert store.get("u1", "j") is not None and store.get("open", None) is not None
    with pytest.raises(StoredResponseTooLargeError, match="max_bytes_per_tenant"):
        store.put("huge", "k2", b"b" * 300, [], "acme")
    store.close()


def test_a_locked_store_holds_its_own_request_not_the_event_loop(
    live_gateway: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SQLite store's file is write-locked by another connection while a response is
    being stored: ``/health`` answers meanwhile, and the response is stored once the lock
    goes. On the event loop the store call would block every request until SQLite's busy
    timeout, then fail."""
    ledger = tmp_path / "ledger.sqlite3"
    config = gateway_config()
    # No usage ledger in the same file: only the response store meets the lock.
    config = msgspec.structs.replace(
        config,
        cost=msgspec.structs.replace(config.cost, ledger_path=str(ledger), enabled=False),
    )
    with live_gateway(config) as gw:
        assert httpx.post(f"{gw}/v1/responses", json={"model": "echo", "input": "warm"}, timeout=30).status_code == 200
        storage = gw.state.response_store.storage
        waiting = threading.Event()
        put = storage.put

        def observed_put(*args: Any) -> None:
            waiting.set()  # the store call started; the lock below holds it
            put(*args)

        monkeypatch.setattr(storage, "put", observed_put)
        locker = sqlite3.connect(ledger, isolation_level=None)
        locker.execute("BEGIN IMMEDIATE")  # the write lock, as another writer holds it
        try:
            with ThreadPoolExecutor(1) as pool:
                stored = pool.submit(
                    httpx.post, f"{gw}/v1/responses", json={"model": "echo", "input": "held"}, timeout=30
                )
                assert waiting.wait(30), "the response was never stored"
                health = httpx.get(f"{gw}/health", timeout=30)
                assert health.status_code == 200
                assert not stored.done()  # /health answered while the store call waited
                locker.execute("COMMIT")
                answer = stored.result()
        finally:
            if locker.in_transaction:
                locker.execute("ROLLBACK")
            locker.close()
        assert answer.status_code == 200, answer.text
        response_id = answer.json()["id"]
        assert httpx.get(f"{gw}/v1/responses/{response_id}", timeout=30).status_code == 200
