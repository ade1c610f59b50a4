"""The usage ledger: one SQLite row per request that reached a backend, durable on return.

Writes go through one writer thread with a queue: each :meth:`Ledger.write` enqueues a
record and awaits a future; the thread takes everything queued (a *group commit*: one
transaction and one fsync for all of them), commits, then resolves the futures (those of
one event loop with one call into it per commit: thread hand-offs, not SQLite, are most
of a write's CPU). So the event loop never blocks on the disk, concurrent requests share
fsyncs, and a caller that awaited :meth:`Ledger.write` knows its record is committed
(WAL mode: with
``synchronous=NORMAL``, the default, it survives a killed process; with ``FULL`` also a
power cut, for one fsync per group commit). A crashed process leaves a WAL file that SQLite
replays on the next open.

Schema (``PRAGMA user_version = 1``), documented in docs/observability.md::

    usage_records(id, request_id UNIQUE, created_at, finished_at, api_key_id, tenant, model,
                  backend, kind, status, error_code, num_choices, input_tokens,
                  cached_input_tokens, output_tokens, cost, ttft_s, tpot_s, duration_s)
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sqlite3
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal

import msgspec

from plugins.usage_report import UsageDay, UsageQuery, UsageReport, UsageTotals

__all__ = ["SCHEMA_VERSION", "Ledger", "LedgerError", "UsageRecord", "query_usage", "spent"]

logger = logging.getLogger("plugins.cost")

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage_records (
    id                  INTEGER PRIMARY KEY,
    request_id          TEXT    NOT NULL UNIQUE,
    created_at          REAL    NOT NULL,
    finished_at         REAL    NOT NULL,
    api_key_id          TEXT,
    tenant              TEXT,
    model               TEXT    NOT NULL,
    backend             TEXT,
    kind                TEXT    NOT NULL,
    status              TEXT    NOT NULL,
    error_code          TEXT,
    num_choices         INTEGER NOT NULL,
    input_tokens        INTEGER NOT NULL,
    cached_input_tokens INTEGER NOT NULL,
    output_tokens       INTEGER NOT NULL,
    cost                REAL    NOT NULL,
    ttft_s              REAL,
    tpot_s              REAL,
    duration_s          REAL    NOT NULL
);
CREATE INDEX IF NOT EXISTS usage_records_created_at ON usage_records (created_at);
CREATE INDEX IF NOT EXISTS usage_records_key ON usage_records (api_key_id, created_at);
CREATE INDEX IF NOT EXISTS usage_records_tenant ON usage_records (tenant, created_at);
"""

# Records committed per transaction at most (a burst larger than this takes several).
_MAX_BATCH = 512


class LedgerError(Exception):
    """The ledger file cannot be opened or has a schema this version does not know."""


class UsageRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One row of ``usage_records``: one HTTP request that reached a backend."""

    request_id: str
    #: Unix seconds: when the request started and when it ended.
    created_at: float
    finished_at: float
    api_key_id: str | None = None
    tenant: str | None = None
    model: str
    #: The backend(s) that served the choices (comma-separated), else the last one tried.
    backend: str | None = None
    kind: str
    #: "ok" | "error" | "aborted".
    status: str
    #: The error's code (``upstream_error``, ``request_aborted``...) unless "ok".
    error_code: str | None = None
    num_choices: int = 1
    #: The usage the client got (each prompt counted once, outputs summed).
    input_tokens: int = 0
    cached_input_tokens: int = 0
    output_tokens: int = 0
    cost: float = 0.0
    ttft_s: float | None = None
    tpot_s: float | None = None
    duration_s: float = 0.0

    def row(self) -> tuple[object, ...]:
        """The values of the record's columns (its fields, in order)."""
        return msgspec.structs.astuple(self)


#: A queued record and who waits for it: a thread's future (:meth:`Ledger.submit`) or an
#: event loop's (:meth:`Ledger.write`).
#: The columns a record fills: its fields, in order.
_COLUMNS = UsageRecord.__struct_fields__
_INSERT = (
    f"INSERT INTO usage_records ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' for _ in _COLUMNS)})"
)

_Item = tuple[UsageRecord, "Future[None] | asyncio.Future[None]"]
#: An event loop's future and the error of its record (None: committed).
_Outcome = tuple["asyncio.Future[None]", BaseException | None]


class Ledger:
    """The ledger at ``path`` (created with its folder if missing); see the module docstring."""

    def __init__(
        self, path: str | Path, *, synchronous: Literal["full", "normal"] = "normal"
    ) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            connection = _connect(self.path, create=True)
            connection.execute(f"PRAGMA synchronous = {synchronous.upper()}")
            _ensure_schema(connection, self.path)
        except sqlite3.Error as exc:
            raise LedgerError(f"cannot open the usage ledger {str(self.path)!r}: {exc}") from exc
        except OSError as exc:
            raise LedgerError(
                f"cannot create the folder of the usage ledger {str(self.path)!r}: {exc}"
            ) from exc
        self._connection = connection
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="infermux-ledger", daemon=True)
        self._thread.start()

    def submit(self, record: UsageRecord) -> Future[None]:
        """Queue ``record``; the future resolves once its transaction committed."""
        future: Future[None] = Future()
        self._put((record, future))
        return future

    async def write(self, record: UsageRecord) -> None:
        """Queue ``record`` and wait until it is committed (the event loop keeps running)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._put((record, future))
        await future

    def _put(self, item: _Item) -> None:
        with self._lock:
            if self._closed:
                raise LedgerError("the usage ledger is closed")
            self._queue.put(item)

    def close(self, timeout_s: float = 10.0) -> None:
        """Commit what is queued, stop the writer thread, close the file. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("the usage ledger writer did not stop within %.0f s", timeout_s)

    def query(self, query: UsageQuery, *, currency: str = "USD") -> UsageReport:
        """Totals and per-day rows (runs on the calling thread: use ``asyncio.to_thread``)."""
        return query_usage(self.path, query, currency=currency)

    # -- the writer thread ----------------------------------------------------------------

    def _run(self) -> None:
        stop = False
        while not stop:
            item = self._queue.get()
            if item is None:
                break
            batch = [item]
            # Only this thread takes from the queue: not empty means get_nowait succeeds.
            while len(batch) < _MAX_BATCH and not self._queue.empty():
                more = self._queue.get_nowait()
                if more is None:
                    stop = True
                    break
                batch.append(more)
            self._commit(batch)
        self._connection.close()

    def _commit(self, batch: list[_Item]) -> None:
        errors: dict[int, BaseException] = {}
        try:
            with self._connection:
                self._connection.executemany(_INSERT, [record.row() for record, _ in batch])
        except sqlite3.IntegrityError:
            # One bad record (a repeated request id) must not lose the others: row by row.
            for index, (record, _) in enumerate(batch):
                try:
                    with self._connection:
                        self._connection.execute(_INSERT, record.row())
                except sqlite3.Error as exc:
                    logger.error("usage ledger: record %s not written: %s", record.request_id, exc)
                    errors[index] = LedgerError(f"{record.request_id}: {exc}")
        except sqlite3.Error as exc:
            logger.error("usage ledger: writing %d records failed: %s", len(batch), exc)
            errors = {
                index: LedgerError(f"{record.request_id}: {exc}")
                for index, (record, _) in enumerate(batch)
            }
        outcomes: dict[asyncio.AbstractEventLoop, list[_Outcome]] = {}
        for index, (_, future) in enumerate(batch):
            error = errors.get(index)
            if isinstance(future, asyncio.Future):
                outcomes.setdefault(future.get_loop(), []).append((future, error))
            elif future.set_running_or_notify_cancel():  # else cancelled by its waiter
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(error)
        for loop, settled in outcomes.items():
            try:
                loop.call_soon_threadsafe(_settle, settled)
            except RuntimeError:  # that loop is closed: nobody waits any more
                pass


def _settle(outcomes: list[_Outcome]) -> None:
    # In the waiters' event loop. A future cancelled by its waiter (hook timeout) is left
    # alone; its record was written all the same.
    for future, error in outcomes:
        if future.done():
            continue
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


def _connect(path: Path, *, create: bool) -> sqlite3.Connection:
    if not create and not path.exists():
        raise LedgerError(f"no usage ledger at {str(path)!r}")
    # DEFERRED: an INSERT opens a transaction implicitly; "with connection" commits it.
    connection = sqlite3.connect(
        path, timeout=10.0, isolation_level="DEFERRED", check_same_thread=False
    )
    connection.execute("PRAGMA busy_timeout = 10000")
    if create:
        mode = connection.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise LedgerError(f"{str(path)!r}: SQLite refused WAL mode (got {mode!r})")
    return connection


def _ensure_schema(connection: sqlite3.Connection, path: Path) -> None:
    version = connection.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise LedgerError(
            f"{str(path)!r} has ledger schema {version}; this infermux knows {SCHEMA_VERSION}"
        )
    with connection:
        connection.executescript(_SCHEMA)
        connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


def _where(query: UsageQuery) -> tuple[str, list[object]]:
    clauses: list[str] = []
    params: list[object] = []
    for column, value in (
        ("api_key_id", query.api_key_id),
        ("tenant", query.tenant),
        ("model", query.model),
    ):
        if value is not None:
            clauses.append(f"{column} = ?")
            params.append(value)
    if query.start is not None:
        clauses.append("created_at >= ?")
        params.append(query.start)
    if query.end is not None:
        clauses.append("created_at < ?")
        params.append(query.end)
    return (" WHERE " + " AND ".join(clauses)) if clauses else "", params


_SUMS = (
    "COUNT(*), COALESCE(SUM(status != 'ok'), 0), COALESCE(SUM(input_tokens), 0), "
    "COALESCE(SUM(cached_input_tokens), 0), COALESCE(SUM(output_tokens), 0), "
    "COALESCE(SUM(cost), 0.0)"
)


def query_usage(path: str | Path, query: UsageQuery, *, currency: str = "USD") -> UsageReport:
    """Totals and per-day rows of the ledger at ``path`` matching ``query``."""
    path = Path(path)
    try:
        connection = _connect(path, create=False)
    except sqlite3.Error as exc:
        raise LedgerError(f"cannot open the usage ledger {str(path)!r}: {exc}") from exc
    try:
        where, params = _where(query)
        totals = connection.execute(f"SELECT {_SUMS} FROM usage_records{where}", params).fetchone()
        days = connection.execute(
            f"SELECT strftime('%Y-%m-%d', created_at, 'unixepoch') AS day, {_SUMS} "
            f"FROM usage_records{where} GROUP BY day ORDER BY day",
            params,
        ).fetchall()
    except sqlite3.Error as exc:
        raise LedgerError(f"cannot read the usage ledger {str(path)!r}: {exc}") from exc
    finally:
        connection.close()
    return UsageReport(
        query=query,
        totals=_sums(totals),
        per_day=[UsageDay(date=row[0], **msgspec.structs.asdict(_sums(row[1:]))) for row in days],
        currency=currency,
    )


def spent(
    path: str | Path,
    *,
    api_key_id: str | None = None,
    tenant: str | None = None,
    since: float | None = None,
) -> float:
    """The cost recorded for a key or a tenant since ``since`` (unix seconds; None: ever)."""
    report = query_usage(path, UsageQuery(api_key_id=api_key_id, tenant=tenant, start=since))
    return report.totals.cost


def _sums(row: tuple[Any, ...]) -> UsageTotals:
    requests, failed, input_tokens, cached, output_tokens, cost = row
    return UsageTotals(
        requests=int(requests),
        failed_requests=int(failed),
        input_tokens=int(input_tokens),
        cached_input_tokens=int(cached),
        output_tokens=int(output_tokens),
        cost=float(cost),
    )
