"""``infermux usage``: recorded usage and cost, from the ledger file or from a server.

::

    infermux usage                                 # the ledger of the default config
    infermux usage --config infermux.toml --key team-a --start 2026-11-01
    infermux usage --url http://127.0.0.1:8000 --model smollm2 --json

Without ``--url`` it reads the ledger directly: ``--db`` (a SQLite file or a
``postgresql://`` URL), else the config's ``[cost] database`` (Postgres), else its
``[cost] ledger_path``, else ``$INFERMUX_LEDGER_PATH``, else ``var/ledger.sqlite3``; a
server does not need to run. With ``--url`` it asks ``GET /v1/usage`` of a running gateway
(the API key comes from ``--api-key`` or ``$INFERMUX_API_KEY``).

``infermux usage migrate --to postgresql://... [--db FILE | --config FILE]`` copies a SQLite
ledger into Postgres (records already there, by request id, are skipped: run it again after
an interruption).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "format_report", "run"]

ENV_API_KEY = "INFERMUX_API_KEY"


def add_parser(subparsers: Any) -> None:
    """Register ``usage``."""
    parser = subparsers.add_parser(
        "usage",
        help="show recorded usage and cost (totals and per day)",
        description="Usage and cost from the usage ledger: totals and one row per UTC day. "
        "Times are unix seconds or ISO 8601 (UTC unless an offset is given); the window "
        "is start <= request start < end.",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--db", default=None, help="the ledger: a SQLite file or a postgresql:// URL"
    )
    source.add_argument("--url", default=None, help="ask a running gateway instead")
    parser.add_argument(
        "--config", type=Path, default=None, help="take the ledger path and currency from here"
    )
    parser.add_argument("--api-key", default=None, help=f"for --url (default: ${ENV_API_KEY})")
    parser.add_argument("--key", default=None, help="only this API key id")
    parser.add_argument("--tenant", default=None, help="only this tenant")
    parser.add_argument("--model", default=None, help="only this model alias")
    parser.add_argument("--start", default=None, help="from this time (inclusive)")
    parser.add_argument("--end", default=None, help="until this time (exclusive)")
    parser.add_argument("--json", action="store_true", help="print the /v1/usage JSON body")
    parser.set_defaults(func=run)
    actions = parser.add_subparsers(dest="action", metavar="{migrate}")
    migrate = actions.add_parser(
        "migrate",
        help="copy a SQLite ledger into Postgres",
        description="Copy every record of a SQLite ledger into a Postgres ledger; records "
        "already there (by request id) are skipped, so running it twice copies nothing twice.",
    )
    migrate.add_argument("--db", type=Path, default=None, help="the SQLite ledger file")
    migrate.add_argument(
        "--config", type=Path, default=None, help="take the SQLite path (and --to) from here"
    )
    migrate.add_argument(
        "--to", default=None, help="postgresql:// URL (default: the config's [cost] database)"
    )
    migrate.set_defaults(func=run_migrate)


def run(args: argparse.Namespace) -> int:
    """Print the report; 2 on bad arguments or config, 1 when the ledger cannot be read."""
    import msgspec

    from backends.errors import InvalidRequestError
    from gateway.controllers.usage import parse_time
    from plugins.usage_report import UsageQuery, UsageReport

    try:
        start = parse_time(args.start, "--start")
        end = parse_time(args.end, "--end")
    except InvalidRequestError as exc:
        print(f"infermux usage: {exc.message}", file=sys.stderr)
        return 2
    query = UsageQuery(
        api_key_id=args.key, tenant=args.tenant, model=args.model, start=start, end=end
    )
    if args.url is not None:
        report = _from_server(args, query)
    else:
        report = _from_file(args, query)
    if not isinstance(report, UsageReport):
        return report
    if args.json:
        print(json.dumps(msgspec.to_builtins(report), indent=2))
    else:
        print(format_report(report))
    return 0


def _cost_config(args: argparse.Namespace) -> Any:
    """The config's ``[cost]`` (defaults without ``--config``), or 2 on a config error."""
    from gateway.config.load import load_config
    from gateway.config.types import ConfigError
    from plugins.builtin.cost.config import CostConfig

    if args.config is None:
        return CostConfig()
    try:
        return load_config(args.config).cost
    except ConfigError as exc:
        print(f"infermux usage: config error in {args.config}: {exc}", file=sys.stderr)
        return 2


def _from_file(args: argparse.Namespace, query: Any) -> Any:
    import asyncio

    from plugins.builtin.cost import resolve_ledger_path
    from plugins.builtin.cost.ledger import LedgerError, query_usage

    cost = _cost_config(args)
    if isinstance(cost, int):
        return cost
    database = args.db if args.db is not None and _is_postgres(args.db) else None
    if database is None and args.db is None:
        database = cost.database
    try:
        if database is not None:
            return asyncio.run(_postgres_report(database, query, cost.currency))
        path = Path(args.db) if args.db is not None else resolve_ledger_path(cost)
        return query_usage(path, query, currency=cost.currency)
    except LedgerError as exc:
        print(f"infermux usage: {exc}", file=sys.stderr)
        return 1


def _is_postgres(target: str) -> bool:
    return target.startswith(("postgresql://", "postgres://"))


async def _postgres_report(url: str, query: Any, currency: str) -> Any:
    from plugins.builtin.cost.pg_ledger import PostgresLedger

    ledger = PostgresLedger(url, max_connections=1)
    await ledger.open()
    try:
        return await ledger.report(query, currency=currency)
    finally:
        await ledger.aclose()


def run_migrate(args: argparse.Namespace) -> int:
    """``infermux usage migrate``: 0 when copied, 2 on bad arguments, 1 on a ledger error."""
    import asyncio

    from plugins.builtin.cost import resolve_ledger_path
    from plugins.builtin.cost.ledger import LedgerError

    cost = _cost_config(args)
    if isinstance(cost, int):
        return cost
    target = args.to or cost.database
    if target is None or not _is_postgres(target):
        print(
            "infermux usage migrate: --to must be a postgresql:// URL (or set [cost] database "
            "in --config)",
            file=sys.stderr,
        )
        return 2
    source = args.db if args.db is not None else resolve_ledger_path(cost)
    try:
        num_read, num_added = asyncio.run(_migrate(source, target))
    except LedgerError as exc:
        print(f"infermux usage migrate: {exc}", file=sys.stderr)
        return 1
    print(f"{num_read} records read from {source}, {num_added} added (the rest were there)")
    return 0


async def _migrate(source: Path, url: str) -> tuple[int, int]:
    from plugins.builtin.cost.pg_ledger import PostgresLedger, migrate_sqlite

    ledger = PostgresLedger(url, max_connections=1)
    await ledger.open()
    try:
        return await migrate_sqlite(source, ledger)
    finally:
        await ledger.aclose()


def _from_server(args: argparse.Namespace, query: Any) -> Any:
    import httpx
    import msgspec

    from plugins.usage_report import UsageReport

    params = {
        name: value
        for name, value in (
            ("api_key", query.api_key_id),
            ("tenant", query.tenant),
            ("model", query.model),
            ("start", query.start),
            ("end", query.end),
        )
        if value is not None
    }
    headers = {}
    api_key = args.api_key or os.environ.get(ENV_API_KEY)
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    url = args.url.rstrip("/") + "/v1/usage"
    try:
        answer = httpx.get(url, params=params, headers=headers, timeout=30.0)
    except httpx.HTTPError as exc:
        print(f"infermux usage: cannot reach {url}: {exc}", file=sys.stderr)
        return 1
    if answer.status_code != 200:
        try:
            message = answer.json()["error"]["message"]
        except Exception:
            message = answer.text[:200]
        print(f"infermux usage: {url} answered {answer.status_code}: {message}", file=sys.stderr)
        return 1
    return msgspec.json.decode(answer.content, type=UsageReport)


def format_report(report: Any) -> str:
    """The terminal table: one row per day, then the totals."""
    from datetime import UTC, datetime

    query = report.query
    filters = [
        f"{name}={value}"
        for name, value in (
            ("key", query.api_key_id),
            ("tenant", query.tenant),
            ("model", query.model),
        )
        if value is not None
    ]
    for name, value in (("from", query.start), ("until", query.end)):
        if value is not None:
            moment = datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%d %H:%M:%SZ")
            filters.append(f"{name} {moment}")
    header = ("DAY", "REQUESTS", "FAILED", "INPUT", "CACHED", "OUTPUT", f"COST ({report.currency})")
    rows: list[tuple[str, ...]] = [header]
    for day in report.per_day:
        rows.append(_row(day.date, day))
    rows.append(_row("TOTAL", report.totals))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [f"usage: {', '.join(filters) if filters else 'all records'}", ""]
    for index, row in enumerate(rows):
        if index == len(rows) - 1:
            lines.append("  ".join("-" * w for w in widths))
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells))
    return "\n".join(lines)


def _row(label: str, sums: Any) -> tuple[str, ...]:
    return (
        label,
        str(sums.requests),
        str(sums.failed_requests),
        str(sums.input_tokens),
        str(sums.cached_input_tokens),
        str(sums.output_tokens),
        f"{sums.cost:.6f}",
    )
