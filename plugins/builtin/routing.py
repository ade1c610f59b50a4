"""The built-in routing strategies, registered through ``infermux_register_routing_strategies``.

A strategy orders the candidate backends of one model alias for one request; the router
tries them in that order (skipping open circuits, retrying only before the first byte).
``factory()`` is called once per model alias, so a strategy's state (a round-robin cursor)
is per alias. A plugin registering the same name replaces a built-in one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from backends.base import GenerationRequest
from plugins.hookspecs import hookimpl

__all__ = [
    "LeastOutstandingStrategy",
    "PriorityStrategy",
    "RoundRobinStrategy",
    "RoutingStrategy",
    "infermux_register_routing_strategies",
]


class RoutingStrategy(Protocol):
    """Orders candidates (in config priority order) for one request; never drops any."""

    def order(
        self, candidates: list[str], request: GenerationRequest, outstanding: Mapping[str, int]
    ) -> list[str]:
        """Candidates in the order to try them. ``outstanding``: open streams per backend."""
        ...


class PriorityStrategy:
    """The config order: the first backend serves, the others are fallbacks."""

    def order(
        self, candidates: list[str], request: GenerationRequest, outstanding: Mapping[str, int]
    ) -> list[str]:
        return list(candidates)


class RoundRobinStrategy:
    """Each request starts one backend further along; the rest follow as fallbacks."""

    def __init__(self) -> None:
        self._next = 0

    def order(
        self, candidates: list[str], request: GenerationRequest, outstanding: Mapping[str, int]
    ) -> list[str]:
        if not candidates:
            return []
        start = self._next % len(candidates)
        self._next = start + 1
        return candidates[start:] + candidates[:start]


class LeastOutstandingStrategy:
    """Fewest open streams first; ties rotate so that an idle pool still spreads the load."""

    def __init__(self) -> None:
        self._rotation = RoundRobinStrategy()

    def order(
        self, candidates: list[str], request: GenerationRequest, outstanding: Mapping[str, int]
    ) -> list[str]:
        rotated = self._rotation.order(candidates, request, outstanding)
        # sorted() is stable: equal counts keep the rotated order.
        return sorted(rotated, key=lambda name: outstanding.get(name, 0))


@hookimpl(trylast=True)
def infermux_register_routing_strategies(
    register: Callable[[str, Callable[[], Any]], None],
) -> None:
    """Register ``priority``, ``round_robin`` and ``least_outstanding``."""
    register("priority", PriorityStrategy)
    register("round_robin", RoundRobinStrategy)
    register("least_outstanding", LeastOutstandingStrategy)
