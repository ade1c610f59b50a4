"""Built-in cost accounting: prices, the SQLite usage ledger, budgets (``builtin.cost``).

Registered per plugin manager through :func:`create_plugin` (it holds per-app state: the
ledger connection, running budget totals). docs/observability.md describes prices, the
per-hour allocation rule and the ledger schema.
"""

from __future__ import annotations

from plugins.builtin.cost.plugin import ENV_LEDGER_PATH, CostPlugin, resolve_ledger_path

__all__ = ["ENV_LEDGER_PATH", "CostPlugin", "create_plugin", "resolve_ledger_path"]


def create_plugin() -> CostPlugin:
    """A fresh, inactive plugin; ``infermux_startup`` opens the ledger."""
    return CostPlugin()
