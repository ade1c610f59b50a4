"""The usage ledger: one SQLite row per request that reached a backend, durable on return.

A caller that awaited :meth:`Ledger.write` knows its record is committed (WAL mode). How it
gets there depends on ``synchronous``:

* ``normal`` (the default; a commit survives a killed process, not a power cut): a commit
  writes WAL frames to the page cache and never waits for the disk, so :meth:`write`
  commits on the event loop itself, at once (no group commit: a commit is 30–60 µs, and
  waiting a loop turn to gather others cost a sequential request more than it saved).
  Handing each record to a thread and back cost more than the commit (two thread
  wake-ups, about 0.1 ms of latency, on every request). The fsyncs of a WAL *checkpoint*
  are the disk waits of this mode: the loop's connection never checkpoints
  (``wal_autocheckpoint = 0``); a writer thread does, on its own connection, every
  :data:`_CHECKPOINT_EVERY` records. When another process holds the write lock (a
  ledger file shared by several gateways, or the thread's own checkpoint) the loop does
  not wait: the record goes to the writer thread, which waits for the lock.
* ``full`` (also survives a power cut): every commit fsyncs, so every record goes through
  the writer thread's queue; it commits everything queued in one transaction and one fsync,
  then resolves the futures (those of one event loop with one call into it).

:meth:`Ledger.submit`, for callers on other threads, always uses the writer thread. A
crashed process leaves a WAL file that SQLite replays on the next open.

Schema (``PRAGMA user_version = 1``), documented in docs/observability.md::

    usage_records(id, request_id UNIQUE, created_at, finished_at, api_key_id, tenant, model,
                  backend, kind, status, error_code, num_choices, input_tokens,
                  cached_input_tokens, output_tokens, cost, ttft_s, tpot_s, duration_s)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sqlite3
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal, Protocol

import msgspec

from core_engine.private_files import private_dir, private_file
from plugins.usage_report import UsageDay, UsageQuery, UsageReport, UsageTotals

__all__ = [
    "SCHEMA_VERSION",
    "Ledger",
    "LedgerError",
    "UsageLedger",
    "UsageRecord",
    "query_usage",
    "spent",
]

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
#: ``synchronous = normal``: the writer thread checkpoints the WAL after this many records
#: committed on the event loop (about five pages each: SQLite's own default is 1,000 pages).
_CHECKPOINT_EVERY = 200
#: Put on the writer thread's queue: checkpoint the WAL.
_CHECKPOINT = "checkpoint"
#: How long the writer thread waits for a lock (another process writing) before a commit fails.
_BUSY_TIMEOUT_MS = 10_000
#: How long the second pass of a checkpoint waits for readers (see ``Ledger._checkpoint``).
_RESTART_WAIT_MS = 20


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
RECORD_COLUMNS = UsageRecord.__struct_fields__
_INSERT = f"INSERT INTO usage_records ({', '.join(RECORD_COLUMNS)}) VALUES ({', '.join('?' for _ in RECORD_COLUMNS)})"

_Item = tuple[UsageRecord, "Future[None] | asyncio.Future[None] | None"]
#: An event loop's future and the error of its record (None: committed).
_Outcome = tuple["asyncio.Future[None]", BaseException | None]


class UsageLedger(Protocol):
    """What the cost plugin needs of a ledger: SQLite (:class:`Ledger`, the default) or
    Postgres (:class:`~plugins.builtin.cost.pg_ledger.PostgresLedger`, shared by replicas)."""

    #: Where the records go, for logs (a path, or a URL without its password).
    location: str

    async def write(self, record: UsageRecord) -> None:
        """Commit ``record``; return once it is committed."""
        ...

    async def report(self, query: UsageQuery, *, currency: str = "USD") -> UsageReport:
        """Totals and per-day rows matching ``query``."""
        ...

    async def spent(
        self, *, api_key_id: str | None, tenant: str | None, since: float | None
    ) -> float:
        """The cost recorded for a key or a tenant since ``since`` (None: ever)."""
        ...

    async def aclose(self) -> None:
        """Commit what is pending and close."""
        ...


class Ledger:
    """The ledger at ``path`` (created ``0600``, its folder ``0700``, if missing; a folder of
    another user or open to group/other, or a file that is a link or another user's, is
    refused: :mod:`core_engine.private_files`); see the module docstring."""

    def __init__(
        self, path: str | Path, *, synchronous: Literal["full", "normal"] = "normal"
    ) -> None:
        self.path = Path(path)
        self.location = str(self.path)
        try:
            # Usage per key and tenant, and the stored responses beside it: this user's alone.
            private_dir(self.path.parent)
            private_file(self.path)
            connection = _connect(self.path, create=True)
            connection.execute(f"PRAGMA synchronous = {synchronous.upper()}")
            _ensure_schema(connection, self.path)
            loop_connection = None
            if synchronous == "normal":
                loop_connection = _connect(self.path, create=False)
                loop_connection.execute("PRAGMA synchronous = NORMAL")
                # Never wait for another process's write lock, never checkpoint (fsyncs).
                loop_connection.execute("PRAGMA busy_timeout = 0")
                loop_connection.execute("PRAGMA wal_autocheckpoint = 0")
        except sqlite3.Error as exc:
            raise LedgerError(f"cannot open the usage ledger {str(self.path)!r}: {exc}") from exc
        except OSError as exc:  # UnsafePathError included: it names the path and the fix
            raise LedgerError(f"cannot use the usage ledger {str(self.path)!r}: {exc}") from exc
        self._connection = connection
        #: ``normal``: the connection the event loop commits on (None: everything is queued).
        self._loop_connection = loop_connection
        self._since_checkpoint = 0
        self._queue: queue.SimpleQueue[_Item | str | None] = queue.SimpleQueue()
        self._closed = False
        #: Guards ``_closed`` and the use of the loop connection.
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="infermux-ledger", daemon=True)
        self._thread.start()

    def submit(self, record: UsageRecord) -> Future[None]:
        """Queue ``record``; the future resolves once its transaction committed."""
        future: Future[None] = Future()
        self._put((record, future))
        return future

    async def write(self, record: UsageRecord) -> None:
        """Commit ``record``; return once it is committed (the event loop keeps running)."""
        if self._loop_connection is not None:
            with self._lock:
                if self._closed:
                    raise LedgerError("the usage ledger is closed")
                errors, done = _commit_rows(self._loop_connection, [(record, None)], busy=True)
            if done:
                self._since_checkpoint += 1
                if self._since_checkpoint >= _CHECKPOINT_EVERY:
                    self._since_checkpoint = 0
                    with contextlib.suppress(LedgerError):
                        self._put(_CHECKPOINT)
                if errors:
                    raise errors[0]
                return
            # Another process holds the write lock: the writer thread waits for it.
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._put((record, future))
        await future

    def _put(self, item: _Item | str) -> None:
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

    async def report(self, query: UsageQuery, *, currency: str = "USD") -> UsageReport:
        """:meth:`query` on a thread."""
        return await asyncio.to_thread(self.query, query, currency=currency)

    async def spent(
        self, *, api_key_id: str | None, tenant: str | None, since: float | None
    ) -> float:
        """The cost recorded for a key or a tenant since ``since``, read on a thread."""
        return await asyncio.to_thread(
            spent, self.path, api_key_id=api_key_id, tenant=tenant, since=since
        )

    async def aclose(self) -> None:
        """:meth:`close` on a thread."""
        await asyncio.to_thread(self.close)

    # -- the writer thread ----------------------------------------------------------------

    def _run(self) -> None:
        stop = False
        while not stop:
            item = self._queue.get()
            if item is None:
                break
            if item == _CHECKPOINT:
                self._checkpoint()
                continue
            batch = [item]
            # Only this thread takes from the queue: not empty means get_nowait succeeds.
            while len(batch) < _MAX_BATCH and not self._queue.empty():
                more = self._queue.get_nowait()
                if more is None:
                    stop = True
                    break
                if more != _CHECKPOINT:
                    batch.append(more)
            self._commit(batch)  # type: ignore[arg-type]
        with self._lock:
            if self._loop_connection is not None:
                self._loop_connection.close()
            self._connection.close()

    def _checkpoint(self) -> None:
        """Copy the WAL into the database file, then start the WAL over.

        The first pass lets the loop go on committing. The second (the frames added
        meanwhile) holds the write lock, so the loop's commits come to this thread until it
        is done; without it a WAL written to without pause would never start over, and
        grow. It also waits for readers still on the WAL (a usage report in progress): at
        most :data:`_RESTART_WAIT_MS`, then it gives up until the next checkpoint, so a
        long report never holds up the requests' records.
        """
        connection = self._connection
        try:
            _, frames, copied = connection.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            if copied < frames:
                return  # a reader still needs the WAL: starting over would wait for it
            connection.execute(f"PRAGMA busy_timeout = {_RESTART_WAIT_MS}")
            try:
                connection.execute("PRAGMA wal_checkpoint(RESTART)").fetchone()
            finally:
                connection.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
        except sqlite3.Error as exc:  # SQLite checkpoints again later; nothing is lost
            logger.warning("usage ledger: checkpoint failed: %s", exc)

    def _commit(self, batch: list[_Item]) -> None:
        errors, _ = _commit_rows(self._connection, batch, busy=False)
        outcomes: dict[asyncio.AbstractEventLoop, list[_Outcome]] = {}
        for index, (_, future) in enumerate(batch):
            error = errors.get(index)
            if isinstance(future, asyncio.Future):
                outcomes.setdefault(future.get_loop(), []).append((future, error))
            elif future is not None and future.set_running_or_notify_cancel():  # else cancelled by its waiter
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(error)
        for loop, settled in outcomes.items():
            try:
                loop.call_soon_threadsafe(_settle, settled)
            except RuntimeError:  # that loop is closed: nobody waits any more
                pass


def _commit_rows(
    connection: sqlite3.Connection, batch: list[_Item], *, busy: bool
) -> tuple[dict[int, BaseException], int]:
    """Insert ``batch`` in one transaction: the errors of the records not written (by
    index), and how many records were dealt with. That is all of them, except with ``busy``
    when another connection holds the write lock: the records from there on are left."""
    errors: dict[int, BaseException] = {}
    try:
        with connection:
            connection.executemany(_INSERT, [record.row() for record, _ in batch])
    except sqlite3.IntegrityError:
        # One bad record (a repeated request id) must not lose the others: row by row.
        for index, (record, _) in enumerate(batch):
            try:
                with connection:
                    connection.execute(_INSERT, record.row())
            except sqlite3.Error as exc:
                if busy and _is_busy(exc):
                    return errors, index
                logger.error("usage ledger: record %s not written: %s", record.request_id, exc)
                errors[index] = LedgerError(f"{record.request_id}: {exc}")
    except sqlite3.Error as exc:
        if busy and _is_busy(exc):
            return errors, 0
        logger.error("usage ledger: writing %d records failed: %s", len(batch), exc)
        errors = {
            index: LedgerError(f"{record.request_id}: {exc}")
            for index, (record, _) in enumerate(batch)
        }
    return errors, len(batch)


def _is_busy(exc: sqlite3.Error) -> bool:
    """Another connection holds a lock (primary result code, whatever the extended one)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


def _resolve(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():  # cancelled by its waiter (hook timeout): the record is written all the same
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _settle(outcomes: list[_Outcome]) -> None:
    # In the waiters' event loop.
    for future, error in outcomes:
        _resolve(future, error)


def _connect(path: Path, *, create: bool) -> sqlite3.Connection:
    if not create and not path.exists():
        raise LedgerError(f"no usage ledger at {str(path)!r}")
    # DEFERRED: an INSERT opens a transaction implicitly; "with connection" commits it.
    connection = sqlite3.connect(
        path, timeout=10.0, isolation_level="DEFERRED", check_same_thread=False
    )
    connection.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
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


def where_clause(query: UsageQuery, placeholder: str = "?") -> tuple[str, list[object]]:
    clauses: list[str] = []
    params: list[object] = []
    for column, value in (
        ("api_key_id", query.api_key_id),
        ("tenant", query.tenant),
        ("model", query.model),
    ):
        if value is not None:
            clauses.append(f"{column} = {placeholder}")
            params.append(value)
    if query.start is not None:
        clauses.append(f"created_at >= {placeholder}")
        params.append(query.start)
    if query.end is not None:
        clauses.append(f"created_at < {placeholder}")
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
        where, params = where_clause(query)
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
        totals=usage_totals(totals),
        per_day=[
            UsageDay(date=row[0], **msgspec.structs.asdict(usage_totals(row[1:]))) for row in days
        ],
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


def usage_totals(row: tuple[Any, ...]) -> UsageTotals:
    requests, failed, input_tokens, cached, output_tokens, cost = row
    return UsageTotals(
        requests=int(requests),
        failed_requests=int(failed),
        input_tokens=int(input_tokens),
        cached_input_tokens=int(cached),
        output_tokens=int(output_tokens),
        cost=float(cost),
    )
