"""``[cost]``'s config: prices, the usage ledger, budgets (docs/observability.md).

The cost plugin's own structs; :class:`gateway.config.types.InfermuxConfig` holds a
:class:`CostConfig` as its ``cost`` table and cross-checks it against the backends, aliases
and keys.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

__all__ = ["BudgetConfig", "CostConfig", "PriceConfig"]

_NonNegative = Annotated[float, msgspec.Meta(ge=0)]


class PriceConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One ``[[cost.prices]]`` rule. The most specific rule wins: model and backend, then
    backend, then model. Token prices are per million tokens; ``per_hour`` is the price
    of running a backend for an hour, shared among the requests it serves (see
    docs/observability.md for the allocation rule)."""

    #: A model alias of ``[[models]]`` (None: any).
    model: str | None = None
    #: A backend name of ``[[backends]]`` (None: any). Required with ``per_hour``.
    backend: str | None = None
    input_per_mtok: _NonNegative = 0.0
    #: Prompt tokens served from a prefix cache (None: the ``input_per_mtok`` price).
    cached_input_per_mtok: _NonNegative | None = None
    output_per_mtok: _NonNegative = 0.0
    per_hour: _NonNegative | None = None


class BudgetConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One ``[[cost.budgets]]``: once ``limit`` is spent in the period, requests get 429."""

    #: The API key id (``[[auth.keys]] id``) or the tenant this budget is for (exactly one).
    api_key: str | None = None
    tenant: str | None = None
    #: In ``[cost] currency``.
    limit: _NonNegative
    #: "total" (ever), "day" or "month" (UTC calendar periods).
    period: Literal["total", "day", "month"] = "month"


class CostConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[cost]``: prices, the usage ledger and budgets."""

    #: Write one usage record per request that reached a backend.
    enabled: bool = True
    #: SQLite file (WAL mode). None: ``$INFERMUX_LEDGER_PATH``, else ``var/ledger.sqlite3``
    #: (relative paths are relative to the working directory).
    ledger_path: str | None = None
    #: A ``postgresql://`` URL: the ledger on Postgres instead of SQLite, shared by replicas
    #: (docs/scale-out.md). Keep the password out of it: libpq reads ``PGPASSWORD`` (or
    #: ``PGPASSFILE``) from the environment.
    database: str | None = None
    #: "normal": a record survives a crash of the gateway (kill -9, OOM) once its response
    #: completed, and a commit costs tens of microseconds; "full": it also survives a power
    #: cut or a kernel crash, for one fsync per group commit (milliseconds on many disks).
    synchronous: Literal["full", "normal"] = "normal"
    currency: str = "USD"
    prices: list[PriceConfig] = []
    budgets: list[BudgetConfig] = []
