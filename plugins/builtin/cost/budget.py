"""Budgets per API key or tenant: running totals of recorded cost, checked at admission.

A budget covers one period ("total", or the UTC calendar "day" / "month"). Its running
total starts from the ledger when the gateway starts and grows with every record this
process commits; a request is refused (429 ``budget_exceeded``) once the total reached
the limit. Requests already in flight are not stopped, so a budget can be overshot by
what they cost: the check is at admission, the charge at the end.

:class:`BudgetBook` keeps the totals in this process; with ``[state] backend = "redis"``
:class:`~plugins.builtin.cost.shared_budget.SharedBudgetBook` keeps them in Redis for every
replica, behind the same methods.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime

from backends.errors import BudgetExceededError
from plugins.builtin.cost.config import BudgetConfig

__all__ = ["BudgetBook", "SpentSince", "budget_subject", "exhausted_message", "period_bounds"]

#: ``spent_since(budget, start)``: the recorded cost of the budget's key or tenant since
#: ``start`` (unix seconds; None: ever), read from the ledger.
SpentSince = Callable[[BudgetConfig, "float | None"], Awaitable[float]]


def period_bounds(period: str, now: float) -> tuple[float | None, float | None]:
    """``(start, end)`` in unix seconds of the period containing ``now`` (None: unbounded)."""
    if period == "total":
        return None, None
    moment = datetime.fromtimestamp(now, UTC)
    if period == "day":
        start = moment.replace(hour=0, minute=0, second=0, microsecond=0)
        end = datetime.fromtimestamp(start.timestamp() + 86400, UTC)
    elif period == "month":
        start = moment.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        end = start.replace(year=start.year + (start.month == 12), month=start.month % 12 + 1)
    else:  # pragma: no cover - the config decoder allows only the three
        raise ValueError(f"unknown budget period {period!r}")
    return start.timestamp(), end.timestamp()


class _Budget:
    __slots__ = ("config", "spent", "period_start")

    def __init__(self, config: BudgetConfig) -> None:
        self.config = config
        self.spent = 0.0
        self.period_start: float | None = None

    def applies_to(self, api_key_id: str | None, tenant: str | None) -> bool:
        if self.config.api_key is not None:
            return self.config.api_key == api_key_id
        return self.config.tenant == tenant


class BudgetBook:
    """The ``[[cost.budgets]]`` and what was spent against each in its current period."""

    def __init__(
        self,
        budgets: Sequence[BudgetConfig],
        *,
        currency: str = "USD",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._budgets = [_Budget(config) for config in budgets]
        self.currency = currency
        self._clock = clock

    def __bool__(self) -> bool:
        return bool(self._budgets)

    async def load(self, spent_since: SpentSince) -> None:
        """Start every total from the ledger's records of its current period."""
        now = self._clock()
        for budget in self._budgets:
            start, _ = period_bounds(budget.config.period, now)
            budget.period_start = start
            budget.spent = await spent_since(budget.config, start)

    async def check(self, *, api_key_id: str | None, tenant: str | None) -> None:
        """Raise :class:`BudgetExceededError` when a budget of this key or tenant is spent."""
        now = self._clock()
        for budget in self._budgets:
            if not budget.applies_to(api_key_id, tenant):
                continue
            self._roll(budget, now)
            if budget.spent >= budget.config.limit:
                raise BudgetExceededError(self._message(budget, now))

    async def charge(
        self, *, api_key_id: str | None, tenant: str | None, cost: float, at: float
    ) -> None:
        """Add a recorded cost (of a request that started at ``at``) to its budgets."""
        if cost <= 0:
            return
        now = self._clock()
        for budget in self._budgets:
            if not budget.applies_to(api_key_id, tenant):
                continue
            self._roll(budget, now)
            if budget.period_start is None or at >= budget.period_start:
                budget.spent += cost

    def spent(self) -> list[tuple[BudgetConfig, float]]:
        """Each budget with its current total (for tests and diagnostics)."""
        return [(budget.config, budget.spent) for budget in self._budgets]

    def _roll(self, budget: _Budget, now: float) -> None:
        start, _ = period_bounds(budget.config.period, now)
        if start != budget.period_start:  # a new day / month: nothing spent in it yet
            budget.period_start = start
            budget.spent = 0.0

    def _message(self, budget: _Budget, now: float) -> str:
        return exhausted_message(budget.config, budget.spent, self.currency, now)


def budget_subject(config: BudgetConfig) -> str:
    """Whose budget it is, for messages."""
    if config.api_key is not None:
        return f"API key {config.api_key!r}"
    return f"tenant {config.tenant!r}"


def exhausted_message(config: BudgetConfig, spent_total: float, currency: str, now: float) -> str:
    """The message of a 429 ``budget_exceeded``: what was spent, and when it renews."""
    spent = (
        f"the budget of {budget_subject(config)} is exhausted: {spent_total:.4f} "
        f"{currency} spent of {config.limit:.4f} {currency}"
    )
    if config.period == "total":
        return f"{spent} (a total budget: raise its limit in [[cost.budgets]])"
    _, end = period_bounds(config.period, now)
    assert end is not None
    renews = datetime.fromtimestamp(end, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f"{spent} this {config.period}; it renews at {renews}"
