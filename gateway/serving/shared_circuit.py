"""Circuit breakers shared by the replicas (``[state] backend = "redis"``).

When a backend's circuit opens on one replica (gateway/serving/router.py: consecutive failures),
that replica writes ``circuit:<backend>`` to Redis with the circuit's cool-down as its TTL.
Every replica reads those keys every :data:`POLL_INTERVAL_S` and opens its own closed
circuit of the backend for what is left of the TTL, so the other replicas stop sending
requests to a dead upstream without each paying ``circuit_failure_threshold`` failures
first. When the TTL runs out every replica half-opens and probes on its own, as with local
circuits.

Shared circuits only ever open circuits sooner; Redis being unreachable leaves each replica
with its local circuits (whatever ``on_unavailable`` says, which is about admission).
Reading once per poll instead of once per request keeps Redis off the routing path.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.serving.router import ModelRouter
from plugins.shared_state import RedisState, StateStoreDown

__all__ = ["POLL_INTERVAL_S", "CircuitSync"]

logger = logging.getLogger("gateway.router")

#: How often each replica reads the shared circuits.
POLL_INTERVAL_S = 0.5

#: KEYS: a backend's circuit. ARGV: its cool-down in milliseconds.
_PUBLISH = "redis.call('SET', KEYS[1], '1', 'PX', ARGV[1]) return 1"
#: KEYS: every backend's circuit. Returns each one's remaining milliseconds (<= 0: none).
_READ = """
local left = {}
for i, key in ipairs(KEYS) do left[i] = redis.call('PTTL', key) end
return left
"""


class CircuitSync:
    """Publishes this replica's opened circuits and opens the ones others published."""

    def __init__(self, state: RedisState, router: ModelRouter, backend_names: list[str]) -> None:
        self._state = state
        self._router = router
        self._names = list(backend_names)
        self._keys = [state.key("circuit", name) for name in self._names]
        self._publishing: set[asyncio.Task[None]] = set()
        router.on_circuit_open = self.opened

    def opened(self, name: str, cooldown_s: float) -> None:
        """The router opened ``name``'s circuit here: tell the others (in the background)."""
        if cooldown_s <= 0:
            return
        task = asyncio.get_running_loop().create_task(self._publish(name, cooldown_s))
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    async def _publish(self, name: str, cooldown_s: float) -> None:
        try:
            await self._state.run(
                _PUBLISH, [self._state.key("circuit", name)], [max(1, int(cooldown_s * 1000))]
            )
        except StateStoreDown:
            pass  # the other replicas find out on their own

    async def sync_once(self) -> None:
        """Open every local circuit that another replica opened (one Redis call)."""
        if not self._keys:
            return
        try:
            left = await self._state.run(_READ, self._keys, [])
        except StateStoreDown:
            return
        for name, milliseconds in zip(self._names, left, strict=True):
            if int(milliseconds) > 0 and self._router.open_circuit(name, int(milliseconds) / 1000):
                logger.warning(
                    "backend %r: circuit opened for %.1f s (opened by another replica)",
                    name,
                    int(milliseconds) / 1000,
                )

    async def run(self) -> None:
        """:meth:`sync_once` every :data:`POLL_INTERVAL_S` until cancelled."""
        while True:
            await asyncio.sleep(POLL_INTERVAL_S)
            await self.sync_once()
