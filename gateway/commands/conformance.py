"""``infermux conformance``: run the contract checks against any endpoint.

::

    infermux conformance --url http://127.0.0.1:8000 --model smollm2
    infermux conformance --url http://127.0.0.1:8080 --model m --api anthropic --json out.json --html out.html

Prints one row per check (pass / fail / n/a) and the evidence of each failure; exits 1 when
a check fails, so CI can gate on it. The API key comes from ``--api-key`` or
``$OPENAI_API_KEY`` and is sent as ``Authorization: Bearer``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> None:
    """Register ``conformance``."""
    parser = subparsers.add_parser(
        "conformance",
        help="check an endpoint against the OpenAI / Anthropic / Responses contracts",
        description="Run a battery of contract checks (written from the published API "
        "references) against an endpoint and print check, verdict and the evidence of each "
        "failure. Exit status 1 when any check fails.",
    )
    parser.add_argument(
        "--url", required=True,
        help="the server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is dropped)",
    )
    parser.add_argument("--model", required=True, help="the model name to send")
    parser.add_argument(
        "--api", choices=("openai", "anthropic", "responses", "all"), default="all",
        help="which API's checks to run (default: all)",
    )
    parser.add_argument("--api-key", default=None, help="sent as a bearer token (default: $OPENAI_API_KEY)")
    parser.add_argument("--check", action="append", default=None, metavar="PREFIX",
                        help="only the checks whose name starts with PREFIX (repeatable)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request (default 120)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--html", type=Path, default=None, metavar="FILE", help="also write a self-contained HTML report")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the table; 1 when a check failed, else 0."""
    from gateway.conformance import (
        API_NAMES,
        Target,
        as_html,
        as_json,
        as_table,
        run_checks,
        summary,
    )

    target = Target(
        url=args.url, model=args.model, api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
        timeout_s=args.timeout,
    )
    apis = API_NAMES if args.api == "all" else (args.api,)
    prefixes = tuple(args.check or ())
    results = run_checks(
        target, apis, only=(lambda c: c.name.startswith(prefixes)) if prefixes else None,
        on_result=lambda r: print(f"  {r.verdict:<4} {r.name}", file=sys.stderr, flush=True),
    )
    print(as_table(results))
    if args.json is not None:
        args.json.write_text(json.dumps(as_json(target, results), indent=2) + "\n")
    if args.html is not None:
        args.html.write_text(as_html(target, results))
    return 1 if summary(results)["fail"] else 0
