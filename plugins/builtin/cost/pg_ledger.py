"""The usage ledger on PostgreSQL (``[cost] database = "postgresql://..."``), for replicas.

Several gateways write one table, so ``/v1/usage`` and ``infermux usage`` see every
replica's requests and budgets are seeded from all of them. The schema is SQLite's
(ledger.py), column for column. Exactly once: each record is one
``INSERT ... ON CONFLICT (request_id) DO NOTHING`` in autocommit, so a write that is retried
after a dropped connection (the commit may or may not have happened) never makes a second
row, and two replicas can never both own one request id.

Connections come from a ``psycopg_pool.AsyncConnectionPool`` that opens in the background:
a gateway starts while Postgres is down, and the schema is made by the first call that
reaches it.

Postgres unreachable: no record is lost and no request waits for it. The write that found
it down (it waited at most ``_CONNECT_TIMEOUT_S`` for a connection), and every write after
it, commits its record to the spool instead, a SQLite ledger on the local disk (the
``[cost] ledger_path`` file); the outage is logged once. A background task tries Postgres
every ``retry_interval_s``; once it answers, the task moves the spooled records over (the
idempotent insert, then a delete from the spool) and writes go to Postgres again. Spooled
records left by a stopped gateway are moved when it starts next. Reports (``/v1/usage``)
read Postgres only: records still in the spool appear there once moved.

``migrate_sqlite`` copies a SQLite ledger into Postgres (``infermux usage migrate``);
running it twice copies nothing twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import msgspec

from plugins.builtin.cost.ledger import (
    RECORD_COLUMNS,
    SCHEMA_VERSION,
    Ledger,
    LedgerError,
    UsageRecord,
    usage_totals,
    where_clause,
)
from plugins.usage_report import UsageDay, UsageQuery, UsageReport

__all__ = ["PostgresLedger", "migrate_sqlite", "redacted_url"]

logger = logging.getLogger("plugins.cost")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS infermux_ledger_meta (
    name  TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS usage_records (
    id                  BIGSERIAL PRIMARY KEY,
    request_id          TEXT    NOT NULL UNIQUE,
    created_at          DOUBLE PRECISION NOT NULL,
    finished_at         DOUBLE PRECISION NOT NULL,
    api_key_id          TEXT,
    tenant              TEXT,
    model               TEXT    NOT NULL,
    backend             TEXT,
    kind                TEXT    NOT NULL,
    status              TEXT    NOT NULL,
    error_code          TEXT,
    num_choices         INTEGER NOT NULL,
    input_tokens        BIGINT  NOT NULL,
    cached_input_tokens BIGINT  NOT NULL,
    output_tokens       BIGINT  NOT NULL,
    cost                DOUBLE PRECISION NOT NULL,
    ttft_s              DOUBLE PRECISION,
    tpot_s              DOUBLE PRECISION,
    duration_s          DOUBLE PRECISION NOT NULL
);
CREATE INDEX IF NOT EXISTS usage_records_created_at ON usage_records (created_at);
CREATE INDEX IF NOT EXISTS usage_records_key ON usage_records (api_key_id, created_at);
CREATE INDEX IF NOT EXISTS usage_records_tenant ON usage_records (tenant, created_at);
"""
#: Serialises schema creation across replicas starting at once (CREATE ... IF NOT EXISTS
#: races in Postgres); any constant the deployment does not use for its own locks.
_SCHEMA_LOCK = 0x696E666D  # "infm"
_INSERT = (
    f"INSERT INTO usage_records ({', '.join(RECORD_COLUMNS)}) "
    f"VALUES ({', '.join('%s' for _ in RECORD_COLUMNS)}) ON CONFLICT (request_id) DO NOTHING"
)
_SUMS = (
    "COUNT(*), COUNT(*) FILTER (WHERE status <> 'ok'), COALESCE(SUM(input_tokens), 0), "
    "COALESCE(SUM(cached_input_tokens), 0), COALESCE(SUM(output_tokens), 0), "
    "COALESCE(SUM(cost), 0.0)"
)
_DAY = "to_char(to_timestamp(created_at) AT TIME ZONE 'UTC', 'YYYY-MM-DD')"
_CONNECT_TIMEOUT_S = 2.0
#: How long start-up waits for the schema before going on without it.
_OPEN_WAIT_S = 2.0
_MIGRATE_BATCH = 1000


def redacted_url(url: str) -> str:
    """``url`` without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{netloc}"))


class PostgresLedger:
    """:class:`~plugins.builtin.cost.ledger.UsageLedger` on Postgres; see the module docstring."""

    def __init__(
        self,
        url: str,
        *,
        spool: Path | None = None,
        max_connections: int = 4,
        retry_interval_s: float = 2.0,
    ) -> None:
        from psycopg_pool import AsyncConnectionPool

        self.location = redacted_url(url)
        #: The SQLite file records go to while Postgres is down (None: they fail).
        self.spool_path = spool
        self._spool: Ledger | None = None
        self._retry_interval_s = retry_interval_s
        #: Postgres failed and the spool is taking the records.
        self.is_down = False
        self._mover: asyncio.Task[None] | None = None
        self._pool = AsyncConnectionPool(
            url,
            min_size=1,
            max_size=max_connections,
            open=False,
            timeout=_CONNECT_TIMEOUT_S,
            kwargs={"autocommit": True, "connect_timeout": int(_CONNECT_TIMEOUT_S)},
        )
        self._has_schema = False
        self._schema_lock = asyncio.Lock()

    async def open(self) -> None:
        """Start the pool (connections open in the background) and try the schema once."""
        await self._pool.open(wait=False)
        try:
            # Bounded well inside the start-up hook's timeout (5 s by default).
            await asyncio.wait_for(self._ensure_schema(), _OPEN_WAIT_S)
        except TimeoutError:
            logger.error(
                "usage ledger %s: not reachable at start-up; retried on the next write",
                self.location,
            )
        except LedgerError as exc:
            logger.error("usage ledger %s: %s; retried on the next write", self.location, exc)
        if self.spool_path is not None and self.spool_path.exists():
            self._start_mover()  # records a previous run could not move

    async def _ensure_schema(self) -> None:
        if self._has_schema:
            return
        import psycopg
        from psycopg_pool import PoolTimeout

        async with self._schema_lock:
            if self._has_schema:
                return
            try:
                async with self._pool.connection() as connection, connection.transaction():
                    await connection.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
                    await connection.execute(_SCHEMA)
                    row = await (
                        await connection.execute(
                            "SELECT value FROM infermux_ledger_meta WHERE name = 'schema_version'"
                        )
                    ).fetchone()
                    if row is None:
                        await connection.execute(
                            "INSERT INTO infermux_ledger_meta VALUES ('schema_version', %s)",
                            (SCHEMA_VERSION,),
                        )
                    elif row[0] > SCHEMA_VERSION:
                        raise LedgerError(
                            f"{self.location} has ledger schema {row[0]}; this infermux "
                            f"knows {SCHEMA_VERSION}"
                        )
            except (psycopg.Error, PoolTimeout, OSError) as exc:
                raise LedgerError(f"cannot reach the usage ledger {self.location}: {exc}") from exc
            self._has_schema = True

    async def write(self, record: UsageRecord) -> None:
        """Insert ``record`` once; into the spool while Postgres is down (module docstring)."""
        import psycopg
        from psycopg_pool import PoolTimeout

        if not self.is_down:
            try:
                await self._ensure_schema()
                async with self._pool.connection() as connection:
                    await connection.execute(_INSERT, record.row())
                return
            except (psycopg.OperationalError, PoolTimeout, LedgerError) as exc:
                if self.spool_path is None:
                    logger.error("usage ledger: record %s not written: %s", record.request_id, exc)
                    raise LedgerError(f"{record.request_id}: {exc}") from exc
                self.is_down = True
                logger.error(
                    "usage ledger %s unreachable: %s; records go to %s until it is back",
                    self.location,
                    exc,
                    self.spool_path,
                )
            except psycopg.Error as exc:
                logger.error("usage ledger: record %s not written: %s", record.request_id, exc)
                raise LedgerError(f"{record.request_id}: {exc}") from exc
        assert self.spool_path is not None
        if self._spool is None:
            self._spool = Ledger(self.spool_path)
        await self._spool.write(record)
        self._start_mover()

    def _start_mover(self) -> None:
        if self._mover is None or self._mover.done():
            self._mover = asyncio.get_running_loop().create_task(self._move_spooled())

    async def _move_spooled(self) -> None:
        """Until the spool is empty: try Postgres every ``retry_interval_s``, move records."""
        import psycopg
        from psycopg_pool import PoolTimeout

        assert self.spool_path is not None
        while True:
            try:
                moved = await self._move_batch(self.spool_path)
            except (psycopg.Error, PoolTimeout, LedgerError, sqlite3.Error) as exc:
                logger.debug("usage ledger: spooled records not moved yet: %s", exc)
                await asyncio.sleep(self._retry_interval_s)
                continue
            if self.is_down:
                # Postgres answers: writes go there again. Records spooled before this
                # point are moved by the passes that follow.
                self.is_down = False
                logger.warning("usage ledger %s reachable again", self.location)
            if moved:
                logger.info("usage ledger: %d spooled records moved to %s", moved, self.location)
                continue
            return

    async def _move_batch(self, path: Path) -> int:
        """Copy up to ``_MIGRATE_BATCH`` spooled records into Postgres, then delete them
        from the spool; how many moved (0: the spool is empty)."""
        await self._ensure_schema()
        rows = await asyncio.to_thread(_spooled_rows, path)
        if not rows:
            return 0
        async with self._pool.connection() as connection, connection.cursor() as cursor:
            await cursor.executemany(_INSERT, rows)
        await asyncio.to_thread(_unspool, path, [row[0] for row in rows])
        return len(rows)

    async def _fetch(self, sql: str, params: list[object]) -> list[tuple[Any, ...]]:
        import psycopg
        from psycopg_pool import PoolTimeout

        try:
            await self._ensure_schema()
            async with self._pool.connection() as connection:
                return await (await connection.execute(sql, params)).fetchall()
        except (psycopg.Error, PoolTimeout) as exc:
            raise LedgerError(f"cannot read the usage ledger {self.location}: {exc}") from exc

    async def report(self, query: UsageQuery, *, currency: str = "USD") -> UsageReport:
        """Totals and per-day rows (UTC days) matching ``query``."""
        where, params = where_clause(query, "%s")
        totals = await self._fetch(f"SELECT {_SUMS} FROM usage_records{where}", params)
        days = await self._fetch(
            f"SELECT {_DAY} AS day, {_SUMS} FROM usage_records{where} GROUP BY day ORDER BY day",
            params,
        )
        return UsageReport(
            query=query,
            totals=usage_totals(totals[0]),
            per_day=[
                UsageDay(date=row[0], **msgspec.structs.asdict(usage_totals(row[1:])))
                for row in days
            ],
            currency=currency,
        )

    async def spent(
        self, *, api_key_id: str | None, tenant: str | None, since: float | None
    ) -> float:
        """The cost recorded for a key or a tenant since ``since`` (None: ever)."""
        query = UsageQuery(api_key_id=api_key_id, tenant=tenant, start=since)
        where, params = where_clause(query, "%s")
        rows = await self._fetch(
            f"SELECT COALESCE(SUM(cost), 0.0) FROM usage_records{where}", params
        )
        return float(rows[0][0])

    async def num_records(self) -> int:
        """Rows in the table (for the migration's summary and tests)."""
        rows = await self._fetch("SELECT COUNT(*) FROM usage_records", [])
        return int(rows[0][0])

    async def aclose(self) -> None:
        """Stop moving spooled records (they stay in the spool for the next start), close."""
        if self._mover is not None:
            self._mover.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._mover
        if self._spool is not None:
            await self._spool.aclose()
        await self._pool.close()


def _spooled_rows(path: Path) -> list[tuple[Any, ...]]:
    """The oldest spooled records, as rows (request id first)."""
    connection = sqlite3.connect(path, timeout=10.0)
    try:
        return connection.execute(
            f"SELECT {', '.join(RECORD_COLUMNS)} FROM usage_records ORDER BY id LIMIT ?",
            (_MIGRATE_BATCH,),
        ).fetchall()
    finally:
        connection.close()


def _unspool(path: Path, request_ids: list[str]) -> None:
    """Delete moved records from the spool."""
    connection = sqlite3.connect(path, timeout=10.0)
    try:
        with connection:
            connection.executemany(
                "DELETE FROM usage_records WHERE request_id = ?", [(rid,) for rid in request_ids]
            )
    finally:
        connection.close()


async def migrate_sqlite(path: str | Path, target: PostgresLedger) -> tuple[int, int]:
    """Copy every record of the SQLite ledger at ``path`` into ``target``.

    Returns (records read, records added); a record already there (by request id) is left
    as it is, so an interrupted migration is finished by running it again."""
    import psycopg

    path = Path(path)
    if not path.exists():
        raise LedgerError(f"no usage ledger at {str(path)!r}")
    source = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    await target._ensure_schema()
    before = await target.num_records()
    num_read = 0
    try:
        cursor = source.execute(
            f"SELECT {', '.join(RECORD_COLUMNS)} FROM usage_records ORDER BY id"
        )
        while rows := cursor.fetchmany(_MIGRATE_BATCH):
            num_read += len(rows)
            async with target._pool.connection() as connection, connection.cursor() as pg:
                await pg.executemany(_INSERT, rows)
    except sqlite3.Error as exc:
        raise LedgerError(f"cannot read the usage ledger {str(path)!r}: {exc}") from exc
    except psycopg.Error as exc:
        raise LedgerError(f"cannot write the usage ledger {target.location}: {exc}") from exc
    finally:
        source.close()
    return num_read, await target.num_records() - before
