"""Budget totals shared by every replica, in Redis (``[state] backend = "redis"``).

Each budget's spend in its current period is one Redis string (a float), keyed by the
budget's subject and the period's start, so a new day or month starts a new key and the
old one expires. A replica's charge is ``INCRBYFLOAT`` on it: every replica sees what every
other spent at its next check. A key that is missing (first use, expired, or a Redis that
restarted empty) is seeded from the ledger with ``SET NX``, so the first replica to look
writes the total and the others read it; the ledger is the truth, Redis the running total.
A charge to a missing key is dropped: its record is already in the ledger, which the next
check reads when it seeds. A charge that could not reach Redis marks its totals stale: the
replica deletes them once Redis answers again, so they are seeded anew from the ledger,
which holds the record.

Redis unreachable: "closed" refuses (503 ``state_store_unavailable``); "open" checks this
replica's own :class:`~plugins.builtin.cost.budget.BudgetBook`, which is charged all along.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from backends.errors import BudgetExceededError
from plugins.builtin.cost.budget import BudgetBook, SpentSince, exhausted_message, period_bounds
from plugins.builtin.cost.config import BudgetConfig
from plugins.shared_state import RedisState, StateStoreDown

__all__ = ["SharedBudgetBook"]

#: KEYS: the budgets' totals. Returns each value, or false where the key is missing.
_READ = "return redis.call('MGET', unpack(KEYS))"
#: KEYS: one total. ARGV: the ledger's total, seconds to keep it (0: for ever). The value
#: that holds after: ours, or the one another replica seeded first.
_SEED = """
if tonumber(ARGV[2]) > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2])
else
  redis.call('SET', KEYS[1], ARGV[1], 'NX')
end
return redis.call('GET', KEYS[1])
"""
#: KEYS: the totals to charge. ARGV: the cost. Missing keys are left to be seeded.
_CHARGE = """
for _, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then redis.call('INCRBYFLOAT', key, ARGV[1]) end
end
return 1
"""
_DELETE = "return redis.call('DEL', unpack(KEYS))"
#: A period's total is kept this long after the period ended (late charges, diagnostics).
_KEEP_AFTER_S = 86400


class SharedBudgetBook:
    """The ``[[cost.budgets]]`` with their totals in Redis; see the module docstring."""

    def __init__(
        self,
        budgets: Sequence[BudgetConfig],
        state: RedisState,
        *,
        currency: str = "USD",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._budgets = list(budgets)
        self._state = state
        self.currency = currency
        self._clock = clock
        self._local = BudgetBook(budgets, currency=currency, clock=clock)
        self._spent_since: SpentSince | None = None
        #: Totals a charge could not reach (Redis down): re-seeded from the ledger.
        self._stale: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self._budgets)

    async def load(self, spent_since: SpentSince) -> None:
        """Keep ``spent_since`` for seeding; start the local fallback from the ledger."""
        self._spent_since = spent_since
        await self._local.load(spent_since)

    def _key(self, budget: BudgetConfig, start: float | None) -> str:
        subject = (
            f"key:{budget.api_key}" if budget.api_key is not None else f"tenant:{budget.tenant}"
        )
        period = "total" if start is None else f"{budget.period}:{int(start)}"
        return self._state.key("budget", subject, period)

    def _applicable(
        self, api_key_id: str | None, tenant: str | None, now: float
    ) -> list[tuple[BudgetConfig, float | None, float | None]]:
        found = []
        for budget in self._budgets:
            if budget.api_key is not None:
                if budget.api_key != api_key_id:
                    continue
            elif budget.tenant != tenant:
                continue
            start, end = period_bounds(budget.period, now)
            found.append((budget, start, end))
        return found

    async def check(self, *, api_key_id: str | None, tenant: str | None) -> None:
        """Raise :class:`BudgetExceededError` when a shared total reached its limit."""
        now = self._clock()
        budgets = self._applicable(api_key_id, tenant, now)
        if not budgets:
            return
        try:
            if self._stale:
                stale = sorted(self._stale)
                await self._state.run(_DELETE, stale, [])
                self._stale.difference_update(stale)
            keys = [self._key(budget, start) for budget, start, _ in budgets]
            values = await self._state.run(_READ, keys, [])
            for (budget, start, end), key, value in zip(budgets, keys, values, strict=True):
                if value is None or value is False:
                    value = await self._seed(budget, start, end, key, now)
                if float(value) >= budget.limit:
                    raise BudgetExceededError(
                        exhausted_message(budget, float(value), self.currency, now)
                    )
        except StateStoreDown:
            if self._state.fail_open:
                await self._local.check(api_key_id=api_key_id, tenant=tenant)
                return
            raise self._state.unavailable("the budget totals") from None

    async def _seed(
        self, budget: BudgetConfig, start: float | None, end: float | None, key: str, now: float
    ) -> str:
        total = await self._spent_since(budget, start) if self._spent_since is not None else 0.0
        keep_s = 0 if end is None else max(1, int(end - now) + _KEEP_AFTER_S)
        return await self._state.run(_SEED, [key], [repr(total), keep_s])

    async def charge(
        self, *, api_key_id: str | None, tenant: str | None, cost: float, at: float
    ) -> None:
        """Add a recorded cost to the shared totals of its period (and to the local ones)."""
        if cost <= 0:
            return
        await self._local.charge(api_key_id=api_key_id, tenant=tenant, cost=cost, at=at)
        now = self._clock()
        keys = [
            self._key(budget, start)
            for budget, start, _ in self._applicable(api_key_id, tenant, now)
            if start is None or at >= start
        ]
        if not keys:
            return
        try:
            await self._state.run(_CHARGE, keys, [repr(cost)])
        except StateStoreDown:
            self._stale.update(keys)  # the record is in the ledger: seeded anew from it

    def spent(self) -> list[tuple[BudgetConfig, float]]:
        """This replica's own totals (the local fallback's), for diagnostics."""
        return self._local.spent()
