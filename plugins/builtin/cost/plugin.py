"""The built-in cost plugin: prices each request, records it in the ledger, enforces budgets.

Hooks, in the order a request meets them:

- ``infermux_transform_request`` (trylast, after any plugin that sets the tenant): refuse
  with 429 ``budget_exceeded`` when a budget of the request's API key or tenant is spent;
- ``infermux_on_attempt_start`` / ``infermux_on_attempt_end``: the request is in flight on
  a backend, for the per-hour share (:class:`~plugins.builtin.cost.pricing.ShareMeter`);
- ``infermux_on_request_end`` (tryfirst): price the request, commit its record and await
  the commit (the gateway sends the final bytes afterwards), charge the budgets, and put
  ``infermux.cost`` into ``summary.attributes`` for the tracing plugin;
- ``infermux_query_usage`` (trylast): answer ``GET /v1/usage`` from the ledger.

One record per HTTP request (not per choice): its tokens are the usage the client got; its
cost is what the backends were paid, each choice's own tokens at its backend's prices plus
the per-hour shares of every try.

``infermux_cost_total`` on ``GET /metrics`` is labelled by model; by API key id and tenant as
well only with ``[telemetry.metrics] tenant_labels = true`` (the scrape endpoint may be public:
who spends what is not its business unless the operator says so).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plugins.builtin.cost.budget import BudgetBook
from plugins.builtin.cost.config import BudgetConfig, CostConfig
from plugins.builtin.cost.ledger import Ledger, LedgerError, UsageLedger, UsageRecord
from plugins.builtin.cost.pricing import PriceBook, ShareMeter
from plugins.builtin.metric_series import CounterSeries, SeriesCollector
from plugins.hookspecs import hookimpl
from plugins.request_summary import http_request_id

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from backends.base import GenerationRequest
    from backends.errors import InfermuxError
    from gateway.config.types import InfermuxConfig
    from plugins.builtin.cost.shared_budget import SharedBudgetBook
    from plugins.request_summary import RequestSummary
    from plugins.shared_state import RedisState
    from plugins.usage_report import UsageQuery, UsageReport

__all__ = ["ENV_LEDGER_PATH", "CostPlugin", "resolve_ledger_path", "spool_path"]

logger = logging.getLogger("plugins.cost")

#: Overrides ``[cost] ledger_path``.
ENV_LEDGER_PATH = "INFERMUX_LEDGER_PATH"
DEFAULT_LEDGER_PATH = Path("var") / "ledger.sqlite3"
_COST_METRIC = "infermux_cost"
_COST_HELP = "Cost of the requests that reached a backend ([cost] currency)"


def resolve_ledger_path(cost: CostConfig, env: Mapping[str, str] = os.environ) -> Path:
    """``$INFERMUX_LEDGER_PATH``, else ``[cost] ledger_path``, else ``var/ledger.sqlite3``."""
    return Path(env.get(ENV_LEDGER_PATH) or cost.ledger_path or DEFAULT_LEDGER_PATH)


def spool_path(ledger_path: Path) -> Path:
    """Where records wait while the Postgres ledger is down: beside the SQLite ledger's
    path, never that file itself (its records are moved only by ``infermux usage migrate``)."""
    return ledger_path.with_name(f"{ledger_path.stem}.pg-spool{ledger_path.suffix}")


class _Pending:
    """What the plugin knows about one request until it ends."""

    __slots__ = ("attempted", "hour_cost", "in_flight", "last_backend")

    def __init__(self) -> None:
        self.attempted = False
        self.hour_cost = 0.0
        #: (choice's request id, attempt) -> backend, while in flight.
        self.in_flight: dict[Hashable, str] = {}
        self.last_backend: str | None = None


class CostPlugin:
    """See the module docstring. Inactive until ``infermux_startup`` (and with
    ``[cost] enabled = false``)."""

    def __init__(self, *, env: Mapping[str, str] | None = None) -> None:
        self._env = env if env is not None else os.environ
        self.ledger: UsageLedger | None = None
        self.prices = PriceBook(())
        self.budgets: BudgetBook | SharedBudgetBook = BudgetBook(())
        #: ``[state] backend = "redis"``: where the budget totals are shared.
        self._state: RedisState | None = None
        self.currency = "USD"
        self._meter = ShareMeter()
        self._pending: dict[str, _Pending] = {}
        #: ``infermux_cost_total``: by model, or by model, API key id and tenant.
        self._cost_total = CounterSeries(_COST_METRIC, _COST_HELP, ["model"])
        self._tenant_labels = False

    # -- lifecycle ------------------------------------------------------------------------

    @hookimpl
    def infermux_register_metrics(self, registry: CollectorRegistry) -> None:
        self._cost_total.values.clear()
        registry.register(SeriesCollector([self._cost_total]))

    @hookimpl
    async def infermux_startup(self, config: InfermuxConfig) -> None:
        self._tenant_labels = config.telemetry.metrics.tenant_labels
        if self._tenant_labels:  # before any request: the series holds no values yet
            self._cost_total.labelnames = ["model", "api_key", "tenant"]
        cost = config.cost
        if not cost.enabled:
            return
        self.currency = cost.currency
        self.prices = PriceBook(cost.prices)
        if cost.database is not None:
            from plugins.builtin.cost.pg_ledger import PostgresLedger

            postgres = PostgresLedger(
                cost.database, spool=spool_path(resolve_ledger_path(cost, self._env))
            )
            await postgres.open()
            ledger: UsageLedger = postgres
        else:
            try:
                ledger = Ledger(resolve_ledger_path(cost, self._env), synchronous=cost.synchronous)
            except LedgerError as exc:
                logger.error("usage accounting is OFF: %s", exc)
                return
        self.ledger = ledger
        if cost.budgets and config.state.backend == "redis":
            from plugins.builtin.cost.shared_budget import SharedBudgetBook
            from plugins.shared_state import open_state

            self._state = open_state(config.state, self._env)
            assert self._state is not None
            self.budgets = SharedBudgetBook(cost.budgets, self._state, currency=cost.currency)
        else:
            self.budgets = BudgetBook(cost.budgets, currency=cost.currency)
        try:
            await self.budgets.load(self._spent_since)
        except LedgerError as exc:  # Postgres down at start: totals start at 0 here
            logger.error("budgets: the ledger could not be read: %s", exc)
        logger.info("usage ledger: %s", ledger.location)

    @hookimpl
    async def infermux_shutdown(self) -> None:
        ledger, self.ledger = self.ledger, None
        if ledger is not None:
            await ledger.aclose()
        state, self._state = self._state, None
        if state is not None:
            await state.aclose()

    async def _spent_since(self, budget: BudgetConfig, start: float | None) -> float:
        assert self.ledger is not None
        return await self.ledger.spent(api_key_id=budget.api_key, tenant=budget.tenant, since=start)

    # -- the request path -----------------------------------------------------------------

    @hookimpl(trylast=True)
    async def infermux_transform_request(self, request: GenerationRequest) -> None:
        if self.budgets:
            await self.budgets.check(api_key_id=request.api_key_id, tenant=request.tenant)

    @hookimpl
    def infermux_on_request_start(self, requests: Sequence[GenerationRequest]) -> None:
        if self.ledger is not None and requests:
            self._pending[http_request_id(requests[0])] = _Pending()

    @hookimpl
    def infermux_on_attempt_start(
        self, request: GenerationRequest, backend_name: str, attempt: int
    ) -> None:
        pending = self._pending.get(http_request_id(request))
        if pending is None:
            return
        key = (request.request_id, attempt)
        self._meter.enter(backend_name, key)
        pending.in_flight[key] = backend_name
        pending.attempted = True
        pending.last_backend = backend_name

    @hookimpl
    def infermux_on_attempt_end(
        self,
        request: GenerationRequest,
        backend_name: str,
        attempt: int,
        error: InfermuxError | None,
    ) -> None:
        if error is None:
            return  # the choice streams from this backend until the request ends
        pending = self._pending.get(http_request_id(request))
        if pending is not None:
            self._leave(pending, request.model, (request.request_id, attempt))

    @hookimpl(tryfirst=True)
    async def infermux_on_request_end(self, summary: RequestSummary) -> None:
        request = summary.request
        pending = self._pending.pop(summary.request_id, None)
        if pending is None:
            return
        for key in list(pending.in_flight):
            self._leave(pending, request.model, key)
        if not pending.attempted or self.ledger is None:
            return  # never reached a backend (refused, or every circuit open): no record
        # A choice resumed on another backend (resume_on_failure): each backend's tokens
        # at its own prices.
        cost = pending.hour_cost + sum(
            self.prices.token_cost(request.model, name, usage)
            for choice in summary.choices
            for name, usage in (choice.backend_usages or ((choice.backend_name, choice.usage),))
        )
        summary.attributes["infermux.cost"] = cost
        record = _record(summary, cost, pending.last_backend)
        await self.ledger.write(record)
        await self.budgets.charge(
            api_key_id=record.api_key_id, tenant=record.tenant, cost=cost, at=record.created_at
        )
        if self._tenant_labels:
            self._cost_total.inc((record.model, record.api_key_id or "none", record.tenant or "none"), cost)
        else:
            self._cost_total.inc((record.model,), cost)

    def _leave(self, pending: _Pending, model: str, key: Hashable) -> None:
        backend = pending.in_flight.pop(key)
        share_s = self._meter.leave(backend, key)
        pending.hour_cost += share_s * self.prices.per_second(model, backend)

    # -- GET /v1/usage --------------------------------------------------------------------

    @hookimpl(trylast=True)
    async def infermux_query_usage(self, query: UsageQuery) -> UsageReport | None:
        ledger = self.ledger
        if ledger is None:
            return None
        return await ledger.report(query, currency=self.currency)


def _record(summary: RequestSummary, cost: float, last_backend: str | None) -> UsageRecord:
    request = summary.request
    error: Any = summary.error
    served = summary.backend_names
    return UsageRecord(
        request_id=summary.request_id,
        created_at=summary.started_at,
        finished_at=time.time(),
        api_key_id=request.api_key_id,
        tenant=request.tenant,
        model=request.model,
        backend=",".join(served) if served else last_backend,
        kind=request.kind,
        status=summary.status,
        error_code=getattr(error, "code", None) if error is not None else None,
        num_choices=summary.num_choices,
        input_tokens=summary.usage.prompt_tokens,
        cached_input_tokens=summary.usage.cached_tokens or 0,
        output_tokens=summary.usage.completion_tokens,
        cost=cost,
        ttft_s=summary.ttft_s,
        tpot_s=summary.tpot_s,
        duration_s=summary.duration_s,
    )
