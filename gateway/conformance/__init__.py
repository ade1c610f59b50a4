"""``infermux conformance``: contract checks of an OpenAI / Anthropic / Responses endpoint.

Each check (``checks_*.py``) is written from the published API reference it cites, talks
raw JSON and raw SSE through :class:`~gateway.conformance.runner.Probe` (a checker must see
the wire, not what a client library repaired), and ends pass, fail (with the request and the
offending field or chunk as evidence) or n/a (the endpoint says it lacks the capability).
"""

from __future__ import annotations

# Importing each checks module registers its checks (``runner.check``).
from gateway.conformance import (  # noqa: F401
    checks_anthropic,
    checks_chat,
    checks_completions,
    checks_embeddings,
    checks_errors,
    checks_responses,
    checks_structured,
    checks_tools,
)
from gateway.conformance.report import as_html, as_json, as_table, summary
from gateway.conformance.runner import API_NAMES, CheckResult, Target, registered_checks, run_checks

__all__ = [
    "API_NAMES",
    "CheckResult",
    "Target",
    "as_html",
    "as_json",
    "as_table",
    "registered_checks",
    "run_checks",
    "summary",
]
