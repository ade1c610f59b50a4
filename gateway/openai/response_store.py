"""Stored responses of the Responses API: ``store`` + ``previous_response_id``, ``GET`` and
``DELETE /v1/responses/{id}``.

One table, ``responses``, where the usage ledger is: on Postgres with ``[cost] database``
(:class:`PostgresResponseStore`), so that every replica behind a load balancer reads,
continues and deletes what another stored; else in the ledger's SQLite file (``[cost]
ledger_path`` / ``$INFERMUX_LEDGER_PATH``, else ``var/ledger.sqlite3``;
:class:`ResponseStore`), one file to back up, for one gateway. Both are a
:class:`ResponseStorage`: short blocking calls, which the gateway makes through
:class:`StoredResponses` on worker threads of its own, never on the event loop (a locked
SQLite file or a slow Postgres holds that request only).

Each row is the response body as answered, the conversation it ends (the chat messages a
follow-up continues from, without ``instructions``, which OpenAI does not carry over), its
size, and the API key id that created it: every read and delete is keyed by (id, key), so a
key never sees, continues or deletes another key's response (it gets the same 404 as for an
id that never existed). In open mode (no keys) the key is NULL.

Retention (``[responses]``) is bounded per key and per tenant, applied in the transaction
that stores a response: rows older than ``max_age_s`` go; then the key's oldest go until it
has at most ``max_per_key`` rows and ``max_bytes_per_key`` bytes (body plus conversation),
the new one included; then its tenant's oldest (of any of the tenant's keys) until the tenant
holds at most ``max_bytes_per_tenant`` bytes. Eviction, not refusal, so a long-lived client keeps working like a ring buffer of
its recent responses; only one response larger than the whole byte quota is refused
(:class:`StoredResponseTooLargeError`, 400 naming ``store``), since storing it would leave
the key over its quota with nothing else to evict.
"""

from __future__ import annotations

import asyncio
import functools
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import msgspec

from backends.errors import InfermuxError, InvalidRequestError, StateStoreUnavailableError
from core_engine.private_files import private_dir, private_file

if TYPE_CHECKING:
    from psycopg_pool import ConnectionPool

    from gateway.config.types import InfermuxConfig, ResponsesConfig

__all__ = [
    "PostgresResponseStore",
    "ResponseStorage",
    "ResponseStore",
    "StoredResponse",
    "StoredResponseTooLargeError",
    "StoredResponses",
    "open_response_store",
]

_BUSY_TIMEOUT_S = 2.0
#: OpenAI keeps stored responses for 30 days.
DEFAULT_MAX_AGE_S = 30 * 24 * 3600.0
DEFAULT_MAX_PER_KEY = 10_000
DEFAULT_MAX_BYTES_PER_KEY = 256 * 1024 * 1024
DEFAULT_MAX_BYTES_PER_TENANT = 1024 * 1024 * 1024
#: Worker threads of :class:`StoredResponses`: store calls in flight at once per gateway.
_THREADS = 4

_SQLITE_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id           TEXT PRIMARY KEY,
    api_key_id   TEXT,
    created_at   REAL NOT NULL,
    body         BLOB NOT NULL,
    conversation BLOB NOT NULL,
    size         INTEGER NOT NULL DEFAULT 0,
    tenant       TEXT
);
CREATE INDEX IF NOT EXISTS responses_key ON responses (api_key_id, created_at);
"""
_PG_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id           TEXT PRIMARY KEY,
    api_key_id   TEXT,
    created_at   DOUBLE PRECISION NOT NULL,
    body         BYTEA NOT NULL,
    conversation BYTEA NOT NULL,
    size         BIGINT NOT NULL
);
ALTER TABLE responses ADD COLUMN IF NOT EXISTS tenant TEXT;
CREATE INDEX IF NOT EXISTS responses_key ON responses (api_key_id, created_at);
CREATE INDEX IF NOT EXISTS responses_tenant ON responses (tenant, created_at);
CREATE INDEX IF NOT EXISTS responses_created_at ON responses (created_at);
"""
#: Advisory lock keys (any constants the deployment does not use for its own locks): schema
#: creation by replicas starting at once, and one tenant's (or, without a tenant, one key's)
#: store-then-evict transactions, so two replicas storing for it cannot both see it under
#: its quota.
_PG_SCHEMA_LOCK = 0x696E6672  # "infr"
_PG_KEY_LOCK = 0x696E666B  # "infk"
_PG_CONNECT_TIMEOUT_S = 2.0
#: The row bound of a tenant's eviction (tenants are bounded in bytes; rows per key).
_NO_ROW_LIMIT = 2**62
#: Expired rows one store deletes at most (the next store deletes more).
_PG_EXPIRE_BATCH = 100


def _evict_sql(column: str, same: str, mark: str) -> str:
    """Delete the rows of one ``column`` value (a key, a tenant) beyond its newest N rows or
    B bytes: params (value, N, B)."""
    return (
        "DELETE FROM responses WHERE id IN (SELECT id FROM (SELECT id, "
        "ROW_NUMBER() OVER newest AS n, SUM(size) OVER newest AS total "
        f"FROM responses WHERE {column} {same} {mark} "
        "WINDOW newest AS (ORDER BY created_at DESC, id DESC ROWS UNBOUNDED PRECEDING)) "
        f"AS ranked WHERE n > {mark} OR total > {mark})"
    )


class StoredResponse(msgspec.Struct, frozen=True, kw_only=True):
    #: The response body as JSON bytes.
    body: bytes
    #: ``[{"role", "content"}, ...]``: the conversation up to and including this output.
    conversation: list[dict[str, Any]]


class StoredResponseTooLargeError(InvalidRequestError):
    """One response bigger than its key's whole ``max_bytes_per_key`` (or its tenant's
    ``max_bytes_per_tenant``)."""

    code = "stored_response_too_large"


class ResponseStorage(Protocol):
    """Where stored responses live; blocking calls (the gateway makes them on worker
    threads, through :class:`StoredResponses`)."""

    def put(
        self, response_id: str, api_key_id: str | None, body: bytes, conversation: list[dict[str, Any]],
        tenant: str | None = None,
    ) -> None:
        """Store a response, then apply the retention bounds (the key's, and its tenant's)."""
        ...

    def get(self, response_id: str, api_key_id: str | None) -> StoredResponse | None:
        """The response ``response_id`` created by ``api_key_id``, or None."""
        ...

    def delete(self, response_id: str, api_key_id: str | None) -> bool:
        """Delete it; False when this key has no such response."""
        ...

    def close(self) -> None: ...


class _Limits:
    """The retention bounds both stores apply, and the one-response size check."""

    def __init__(self, max_age_s: float, max_per_key: int, max_bytes_per_key: int, max_bytes_per_tenant: int) -> None:
        self.max_age_s = max_age_s
        self.max_per_key = max_per_key
        self.max_bytes_per_key = max_bytes_per_key
        self.max_bytes_per_tenant = max_bytes_per_tenant

    def _row(self, body: bytes, conversation: list[dict[str, Any]], tenant: str | None) -> tuple[bytes, int]:
        """The encoded conversation and the row's size; refuses one over a whole quota."""
        encoded = msgspec.json.encode(conversation)
        size = len(body) + len(encoded)
        for limit, who, key in (
            (self.max_bytes_per_key, "a key", "max_bytes_per_key"),
            (self.max_bytes_per_tenant if tenant is not None else None, "a tenant", "max_bytes_per_tenant"),
        ):
            if limit is not None and size > limit:
                raise StoredResponseTooLargeError(
                    f"this response and its conversation are {size} bytes, more than the "
                    f"{limit} bytes {who} may store ([responses] {key}); send store=false, "
                    "or continue with a shorter conversation",
                    param="store",
                )
        return encoded, size

    def _expired(self, created_at: float) -> bool:
        return created_at < time.time() - self.max_age_s


class ResponseStore(_Limits):
    """The ``responses`` table of one SQLite file; thread-safe.

    The file is opened on first use, so a gateway that never stores a response creates
    nothing; it is created ``0600`` in a ``0700`` folder, and a folder or file that another
    user controls is refused (:mod:`core_engine.private_files`). A busy database waits at
    most ``_BUSY_TIMEOUT_S``.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        max_per_key: int = DEFAULT_MAX_PER_KEY,
        max_bytes_per_key: int = DEFAULT_MAX_BYTES_PER_KEY,
        max_bytes_per_tenant: int = DEFAULT_MAX_BYTES_PER_TENANT,
    ) -> None:
        super().__init__(max_age_s, max_per_key, max_bytes_per_key, max_bytes_per_tenant)
        self.path = Path(path)
        self._lock = threading.Lock()
        self._connection: sqlite3.Connection | None = None

    def _connect(self) -> sqlite3.Connection:
        if self._connection is None:
            try:
                # The responses people were given: this user's alone (core_engine.private_files).
                private_dir(self.path.parent)
                private_file(self.path)
                connection = sqlite3.connect(
                    self.path, timeout=_BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
                )
                connection.execute("PRAGMA journal_mode=WAL")
                connection.executescript(_SQLITE_SCHEMA)
                _add_columns(connection)
            except (sqlite3.Error, OSError) as exc:
                raise InfermuxError(f"the response store {str(self.path)!r} cannot be opened: {exc}") from exc
            self._connection = connection
        return self._connection

    def put(
        self,
        response_id: str,
        api_key_id: str | None,
        body: bytes,
        conversation: list[dict[str, Any]],
        tenant: str | None = None,
    ) -> None:
        """Store a response, then apply the retention bounds (module docstring)."""
        encoded, size = self._row(body, conversation, tenant)
        now = time.time()
        with self._lock:
            connection = self._connect()
            try:
                connection.execute("BEGIN IMMEDIATE")
                connection.execute(
                    "INSERT INTO responses (id, api_key_id, created_at, body, conversation, size, tenant) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (response_id, api_key_id, now, body, encoded, size, tenant),
                )
                connection.execute("DELETE FROM responses WHERE created_at < ?", (now - self.max_age_s,))
                connection.execute(
                    _evict_sql("api_key_id", "IS", "?"), (api_key_id, self.max_per_key, self.max_bytes_per_key)
                )
                if tenant is not None:
                    connection.execute(
                        _evict_sql("tenant", "IS", "?"), (tenant, _NO_ROW_LIMIT, self.max_bytes_per_tenant)
                    )
                connection.execute("COMMIT")
            except sqlite3.Error as exc:
                if connection.in_transaction:
                    connection.execute("ROLLBACK")
                raise InfermuxError(f"the response could not be stored: {exc}") from exc

    def get(self, response_id: str, api_key_id: str | None) -> StoredResponse | None:
        """The response ``response_id`` created by ``api_key_id``, or None."""
        with self._lock:
            row = (
                self._connect()
                .execute(
                    "SELECT body, conversation, created_at FROM responses WHERE id = ? AND api_key_id IS ?",
                    (response_id, api_key_id),
                )
                .fetchone()
            )
        if row is None or self._expired(row[2]):
            return None
        return StoredResponse(body=bytes(row[0]), conversation=msgspec.json.decode(row[1]))

    def delete(self, response_id: str, api_key_id: str | None) -> bool:
        """Delete it; False when this key has no such response."""
        with self._lock:
            cursor = self._connect().execute(
                "DELETE FROM responses WHERE id = ? AND api_key_id IS ?", (response_id, api_key_id)
            )
        return cursor.rowcount > 0

    def close(self) -> None:
        with self._lock:
            if self._connection is not None:
                self._connection.close()
                self._connection = None


def _add_columns(connection: sqlite3.Connection) -> None:
    """A file stored by an older infermux has no ``size`` (added, filled in) or ``tenant``
    (added, empty: its rows count for their keys only)."""
    columns = {row[1] for row in connection.execute("PRAGMA table_info(responses)")}
    with connection:
        if "size" not in columns:
            connection.execute("ALTER TABLE responses ADD COLUMN size INTEGER NOT NULL DEFAULT 0")
            connection.execute("UPDATE responses SET size = length(body) + length(conversation)")
        if "tenant" not in columns:
            connection.execute("ALTER TABLE responses ADD COLUMN tenant TEXT")
        connection.execute("CREATE INDEX IF NOT EXISTS responses_tenant ON responses (tenant, created_at)")


class PostgresResponseStore(_Limits):
    """The ``responses`` table on Postgres (the ledger's ``[cost] database``), shared by
    every replica; thread-safe.

    Connections come from a ``psycopg_pool.ConnectionPool`` opened on first use, so a
    gateway that never stores a response never connects, and one starts while Postgres is
    down. A call that cannot get a connection within ``_PG_CONNECT_TIMEOUT_S`` is a 503
    ``state_store_unavailable``; the next call tries again. Unlike usage records nothing is
    spooled: a response stored on one replica's disk would be invisible to the others.
    """

    def __init__(
        self,
        url: str,
        *,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        max_per_key: int = DEFAULT_MAX_PER_KEY,
        max_bytes_per_key: int = DEFAULT_MAX_BYTES_PER_KEY,
        max_bytes_per_tenant: int = DEFAULT_MAX_BYTES_PER_TENANT,
        max_connections: int = _THREADS,
    ) -> None:
        from psycopg_pool import ConnectionPool

        from plugins.builtin.cost.pg_ledger import redacted_url

        super().__init__(max_age_s, max_per_key, max_bytes_per_key, max_bytes_per_tenant)
        self.location = redacted_url(url)
        self._pool: ConnectionPool = ConnectionPool(
            url,
            min_size=1,
            max_size=max_connections,
            open=False,
            timeout=_PG_CONNECT_TIMEOUT_S,
            kwargs={"autocommit": True, "connect_timeout": int(_PG_CONNECT_TIMEOUT_S)},
        )
        self._lock = threading.Lock()
        self._opened = False
        self._has_schema = False

    def _run(self, work: Any) -> Any:
        """``work(connection)`` on a pooled connection, the schema made first; errors as
        InfermuxErrors (unreachable: 503)."""
        import psycopg
        from psycopg_pool import PoolTimeout

        try:
            with self._lock:
                if not self._opened:
                    self._pool.open(wait=False)
                    self._opened = True
            with self._pool.connection() as connection:
                if not self._has_schema:
                    with connection.transaction():
                        connection.execute("SELECT pg_advisory_xact_lock(%s)", (_PG_SCHEMA_LOCK,))
                        connection.execute(_PG_SCHEMA)
                    self._has_schema = True
                return work(connection)
        except (psycopg.OperationalError, PoolTimeout) as exc:
            raise StateStoreUnavailableError(
                f"the response store {self.location} cannot be reached: {exc}", retry_after=2.0
            ) from exc
        except psycopg.Error as exc:
            raise InfermuxError(f"the response store {self.location} failed: {exc}") from exc

    def put(
        self,
        response_id: str,
        api_key_id: str | None,
        body: bytes,
        conversation: list[dict[str, Any]],
        tenant: str | None = None,
    ) -> None:
        """Store a response, then apply the retention bounds (module docstring), in one
        transaction under the advisory lock of its tenant (a key belongs to one tenant), or of
        its key where there is no tenant."""
        encoded, size = self._row(body, conversation, tenant)
        now = time.time()
        owner = f"tenant:{tenant}" if tenant is not None else f"key:{api_key_id or ''}"

        def work(connection: Any) -> None:
            with connection.transaction():
                connection.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (_PG_KEY_LOCK, owner))
                connection.execute(
                    "INSERT INTO responses (id, api_key_id, created_at, body, conversation, size, tenant) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s)",
                    (response_id, api_key_id, now, body, encoded, size, tenant),
                )
                # Rows another replica is deleting are skipped, not waited for.
                connection.execute(
                    "DELETE FROM responses WHERE id IN (SELECT id FROM responses WHERE created_at < %s "
                    "ORDER BY created_at LIMIT %s FOR UPDATE SKIP LOCKED)",
                    (now - self.max_age_s, _PG_EXPIRE_BATCH),
                )
                connection.execute(
                    _evict_sql("api_key_id", "IS NOT DISTINCT FROM", "%s"),
                    (api_key_id, self.max_per_key, self.max_bytes_per_key),
                )
                if tenant is not None:
                    connection.execute(
                        _evict_sql("tenant", "=", "%s"), (tenant, _NO_ROW_LIMIT, self.max_bytes_per_tenant)
                    )

        self._run(work)

    def get(self, response_id: str, api_key_id: str | None) -> StoredResponse | None:
        """The response ``response_id`` created by ``api_key_id``, or None."""
        row = self._run(
            lambda connection: connection.execute(
                "SELECT body, conversation, created_at FROM responses "
                "WHERE id = %s AND api_key_id IS NOT DISTINCT FROM %s",
                (response_id, api_key_id),
            ).fetchone()
        )
        if row is None or self._expired(row[2]):
            return None
        return StoredResponse(body=bytes(row[0]), conversation=msgspec.json.decode(row[1]))

    def delete(self, response_id: str, api_key_id: str | None) -> bool:
        """Delete it; False when this key has no such response."""
        rowcount: int = self._run(
            lambda connection: connection.execute(
                "DELETE FROM responses WHERE id = %s AND api_key_id IS NOT DISTINCT FROM %s",
                (response_id, api_key_id),
            ).rowcount
        )
        return rowcount > 0

    def close(self) -> None:
        with self._lock:
            if self._opened:
                self._pool.close()
                self._opened = False


T = TypeVar("T")


class StoredResponses:
    """A :class:`ResponseStorage` for the async handlers: each call runs on one of this
    gateway's own ``_THREADS`` worker threads, so the event loop never waits on SQLite or
    Postgres, and a store that is slow (a locked file, a far database) holds these threads,
    not the loop's default executor that other work shares."""

    def __init__(self, storage: ResponseStorage) -> None:
        self.storage = storage
        self._executor = ThreadPoolExecutor(_THREADS, thread_name_prefix="response-store")

    async def _call(self, method: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(method, *args))

    async def put(
        self, response_id: str, api_key_id: str | None, body: bytes, conversation: list[dict[str, Any]],
        tenant: str | None = None,
    ) -> None:
        await self._call(self.storage.put, response_id, api_key_id, body, conversation, tenant)

    async def get(self, response_id: str, api_key_id: str | None) -> StoredResponse | None:
        stored: StoredResponse | None = await self._call(self.storage.get, response_id, api_key_id)
        return stored

    async def delete(self, response_id: str, api_key_id: str | None) -> bool:
        deleted: bool = await self._call(self.storage.delete, response_id, api_key_id)
        return deleted

    async def aclose(self) -> None:
        """Wait for the calls in flight (on a thread: they may be waiting on a lock), close."""
        await asyncio.to_thread(self._executor.shutdown)
        self.storage.close()


def open_response_store(config: InfermuxConfig, ledger_path: Path) -> StoredResponses:
    """Postgres when the ledger is there (``[cost] database``), else the SQLite file at
    ``ledger_path`` (the ledger's); neither is touched before the first call."""
    limits: ResponsesConfig = config.responses
    storage: ResponseStorage
    if config.cost.database is not None:
        storage = PostgresResponseStore(
            config.cost.database,
            max_age_s=limits.max_age_s,
            max_per_key=limits.max_per_key,
            max_bytes_per_key=limits.max_bytes_per_key,
            max_bytes_per_tenant=limits.max_bytes_per_tenant,
        )
    else:
        storage = ResponseStore(
            ledger_path,
            max_age_s=limits.max_age_s,
            max_per_key=limits.max_per_key,
            max_bytes_per_key=limits.max_bytes_per_key,
            max_bytes_per_tenant=limits.max_bytes_per_tenant,
        )
    return StoredResponses(storage)
