"""What a routing strategy is (:class:`RoutingContext`, :class:`RoutingStrategy`) and the plain
built-in ones: ``priority``, ``round_robin``, ``least_outstanding`` (registered by
:mod:`plugins.builtin.routing`, with ``slo_cost`` and ``cache_aware``).

A strategy orders the candidate backends of one model alias for one request; the router
tries them in that order (skipping open circuits, retrying only before the first byte).
``factory()`` is called once per model alias, so a strategy's state (a round-robin cursor)
is per alias. A plugin registering the same name replaces a built-in one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from backends.base import GenerationRequest

__all__ = [
    "RoutingContext",
    "LeastOutstandingStrategy",
    "PriorityStrategy",
    "RoundRobinStrategy",
    "RoutingStrategy",
]


@dataclass(frozen=True, slots=True)
class RoutingContext:
    """What the router tells a strategy about its alias, once, if the strategy has
    ``configure(context)``. A strategy may also have ``observe(backend, *, ttft_s, tpot_s)``
    (called when a stream it routed ended well) and ``decide(candidates, request,
    outstanding) -> (order, decision)`` (used instead of ``order``; the decision, a JSON-able
    dict, goes on the request's routing span), or ``async adecide(...)`` with the same
    answer, awaited (preferred over ``decide``: it may ask the backends first)."""

    alias: str
    backends: tuple[str, ...]
    #: backend -> (input, output) price per million tokens (``[[cost.prices]]``); absent: free.
    prices: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    #: The alias's SLO (``[[models]] ttft_slo_ms`` / ``tpot_slo_ms``), None: none.
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    #: ``[[models]] cache_load_factor`` (``cache_aware``): how far above the least-loaded
    #: replica a replica may be loaded and still win on its cached prefix.
    load_factor: float = 1.5
    #: backend name -> the backend object (``cache_aware`` asks it for its prefix cache and
    #: the prompt's token ids).
    replicas: Mapping[str, Any] = field(default_factory=dict)


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
