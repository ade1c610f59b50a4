"""``infermux usage``: recorded usage and cost, from the ledger file or from a server.

::

    infermux usage                                 # the ledger of the default config
    infermux usage --config infermux.toml --key team-a --start 2026-11-01
    infermux usage --url http://127.0.0.1:8000 --model smollm2 --json

Without ``--url`` it reads the SQLite ledger directly (``--db``, else the config's
``[cost] ledger_path``, else ``$INFERMUX_LEDGER_PATH``, else ``var/ledger.sqlite3``); a
server does not need to run. With ``--url`` it asks ``GET /v1/usage`` of a running gateway
(the API key comes from ``--api-key`` or ``$INFERMUX_API_KEY``).
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
    source.add_argument("--db", type=Path, default=None, help="the ledger file (SQLite)")
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


def _from_file(args: argparse.Namespace, query: Any) -> Any:
    from gateway.config import ConfigError, load_config
    from gateway.observability_config import CostConfig
    from plugins.builtin.cost import resolve_ledger_path
    from plugins.builtin.cost.ledger import LedgerError, query_usage

    cost = CostConfig()
    if args.config is not None:
        try:
            cost = load_config(args.config).cost
        except ConfigError as exc:
            print(f"infermux usage: config error in {args.config}: {exc}", file=sys.stderr)
            return 2
    path = args.db if args.db is not None else resolve_ledger_path(cost)
    try:
        return query_usage(path, query, currency=cost.currency)
    except LedgerError as exc:
        print(f"infermux usage: {exc}", file=sys.stderr)
        return 1


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
