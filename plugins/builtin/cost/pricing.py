"""Prices: per-token rules, and the per-hour price of a self-hosted backend shared fairly.

Token prices (remote APIs) are per million tokens: uncached prompt tokens at
``input_per_mtok``, prompt tokens served from a prefix cache at ``cached_input_per_mtok``
(default: the input price), output tokens at ``output_per_mtok``.

A per-hour price (a self-hosted backend: a GPU box, a rented instance) is shared among the
requests the backend serves by this rule: at every moment the backend has requests in
flight, its price per second is split equally among them; idle time is charged to nobody.
So a request's share is ``per_hour / 3600 * ∫ dt / active(t)`` over the time it was in
flight on the backend (from the router's call to ``generate`` until its stream ended or the
try failed), where ``active(t)`` counts this gateway's requests in flight on that backend.
:class:`ShareMeter` computes the integral exactly, in O(1) per event, with a per-backend
"virtual clock" that advances by ``dt / active`` (as in fair queueing).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence

from backends.base import Usage
from plugins.builtin.cost.config import PriceConfig

__all__ = ["PriceBook", "ShareMeter"]

_PER_MTOK = 1_000_000


class PriceBook:
    """The ``[[cost.prices]]`` rules; the most specific one for (model, backend) applies."""

    def __init__(self, rules: Sequence[PriceConfig]) -> None:
        self._rules = {(rule.model, rule.backend): rule for rule in rules}

    def rule_for(self, model: str | None, backend: str | None) -> PriceConfig | None:
        """Model and backend, else backend alone, else model alone, else None (free)."""
        if not self._rules:
            return None
        for key in ((model, backend), (None, backend), (model, None)):
            if key == (None, None):  # no rule names neither (config validation)
                continue
            rule = self._rules.get(key)
            if rule is not None:
                return rule
        return None

    def token_cost(self, model: str | None, backend: str | None, usage: Usage | None) -> float:
        """What ``usage`` costs at the per-token prices (0 without a rule or usage)."""
        rule = self.rule_for(model, backend)
        if rule is None or usage is None:
            return 0.0
        cached = min(usage.cached_tokens or 0, usage.prompt_tokens)
        cached_price = (
            rule.cached_input_per_mtok
            if rule.cached_input_per_mtok is not None
            else rule.input_per_mtok
        )
        return (
            (usage.prompt_tokens - cached) * rule.input_per_mtok
            + cached * cached_price
            + usage.completion_tokens * rule.output_per_mtok
        ) / _PER_MTOK

    def per_second(self, model: str | None, backend: str) -> float:
        """The backend's per-hour price in seconds (0 when it has none)."""
        rule = self.rule_for(model, backend)
        if rule is None or rule.per_hour is None:
            return 0.0
        return rule.per_hour / 3600.0


class _BackendClock:
    """The virtual clock of one backend: ∫ dt / active(t) since the meter started."""

    __slots__ = ("virtual", "updated_at", "entered")

    def __init__(self, now: float) -> None:
        self.virtual = 0.0
        self.updated_at = now
        #: In-flight key -> the virtual time when it entered.
        self.entered: dict[Hashable, float] = {}

    def advance(self, now: float) -> None:
        if self.entered:
            self.virtual += (now - self.updated_at) / len(self.entered)
        self.updated_at = now


class ShareMeter:
    """Each in-flight unit's share of its backend's busy time (see the module docstring).

    ``enter(backend, key)`` when work starts on a backend, ``leave(backend, key)`` when it
    ends; ``leave`` returns the key's share in seconds. Not thread-safe: the gateway calls
    it from its event loop only.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._backends: dict[str, _BackendClock] = {}

    def enter(self, backend: str, key: Hashable) -> None:
        now = self._clock()
        meter = self._backends.get(backend)
        if meter is None:
            meter = self._backends[backend] = _BackendClock(now)
        meter.advance(now)
        meter.entered[key] = meter.virtual

    def leave(self, backend: str, key: Hashable) -> float:
        """The key's share of the backend's busy seconds; 0 for a key that never entered."""
        meter = self._backends.get(backend)
        if meter is None or key not in meter.entered:
            return 0.0
        meter.advance(self._clock())
        return meter.virtual - meter.entered.pop(key)

    def num_active(self, backend: str) -> int:
        meter = self._backends.get(backend)
        return len(meter.entered) if meter is not None else 0
