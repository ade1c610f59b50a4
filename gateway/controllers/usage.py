"""``GET /v1/usage``: recorded usage and cost, filtered, with totals and per-day rows.

Answered by the ``infermux_query_usage`` hook (the built-in cost ledger by default). With
API keys configured, a key reads its own usage only (its id is the filter); in open mode
(loopback only) every record can be read.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from litestar import Controller, Request, get
from litestar.di import NamedDependency
from litestar.params import QueryParameter

from backends.errors import InvalidRequestError, NotFoundError, PermissionDeniedError
from gateway.http.auth import api_key_guard, api_key_of
from gateway.state import GatewayState
from plugins.usage_report import UsageQuery, UsageReport

__all__ = ["UsageController", "parse_time"]

_TIME_HELP = "unix seconds (`1764403200`) or ISO 8601 (`2026-11-29`, `2026-11-29T10:00:00Z`; UTC if no offset)"


def parse_time(text: str | None, param: str) -> float | None:
    """Unix seconds from unix seconds or ISO 8601 text; 400 naming ``param`` otherwise."""
    if text is None or text == "":
        return None
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00") if text.endswith("Z") else text)
    except ValueError:
        raise InvalidRequestError(
            f"{param} must be {_TIME_HELP}; got {text[:64]!r}", param=param
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


class UsageController(Controller):
    """Usage records of the cost ledger."""

    path = "/v1/usage"
    tags = ["usage"]
    guards = [api_key_guard]

    @get(
        "",
        summary="Usage and cost",
        description="Totals and per-day (UTC) sums of the usage records that match the "
        "filters. The time window compares each request's start time: start <= t < end.",
    )
    async def get_usage(
        self,
        request: Request[Any, Any, Any],
        gateway: NamedDependency[GatewayState],
        api_key: Annotated[
            str | None, QueryParameter(name="api_key", description="API key id", max_length=64)
        ] = None,
        tenant: Annotated[str | None, QueryParameter(name="tenant", max_length=64)] = None,
        model: Annotated[str | None, QueryParameter(name="model", max_length=256)] = None,
        start: Annotated[
            str | None, QueryParameter(name="start", description=_TIME_HELP, max_length=64)
        ] = None,
        end: Annotated[
            str | None, QueryParameter(name="end", description=_TIME_HELP, max_length=64)
        ] = None,
    ) -> UsageReport:
        caller = api_key_of(request)
        if caller is not None:
            if api_key is not None and api_key != caller.id:
                raise PermissionDeniedError(
                    "an API key may read its own usage only", param="api_key"
                )
            api_key = caller.id
        query = UsageQuery(
            api_key_id=api_key,
            tenant=tenant,
            model=model,
            start=parse_time(start, "start"),
            end=parse_time(end, "end"),
        )
        if query.start is not None and query.end is not None and query.end < query.start:
            raise InvalidRequestError("end must not be before start", param="end")
        report = await gateway.hooks.query_usage(query=query)
        if report is None:
            raise NotFoundError(
                "usage accounting is disabled ([cost] enabled = false, or the ledger could "
                "not be opened: see the server log)"
            )
        return report
