"""The built-in routing strategies, registered through ``infermux_register_routing_strategies``
(:mod:`plugins.builtin.strategies` says what a strategy is; ``slo_cost`` and ``cache_aware``
have their own modules). A plugin registering the same name replaces a built-in one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from plugins.builtin.cache_aware import CacheAwareStrategy
from plugins.builtin.slo_cost import SloCostStrategy
from plugins.builtin.strategies import (
    LeastOutstandingStrategy,
    PriorityStrategy,
    RoundRobinStrategy,
)
from plugins.hookspecs import hookimpl

__all__ = ["infermux_register_routing_strategies"]


@hookimpl(trylast=True)
def infermux_register_routing_strategies(
    register: Callable[[str, Callable[[], Any]], None],
) -> None:
    """Register ``priority``, ``round_robin``, ``least_outstanding``, ``slo_cost`` and
    ``cache_aware``."""
    register("priority", PriorityStrategy)
    register("slo_cost", SloCostStrategy)
    register("round_robin", RoundRobinStrategy)
    register("least_outstanding", LeastOutstandingStrategy)
    register("cache_aware", CacheAwareStrategy)
