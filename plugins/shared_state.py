"""The shared state store: one Redis that every gateway replica reaches, and its outages.

``[state] backend = "redis"`` puts per-key rate limits (gateway/serving/admission.py) and budget
totals (plugins/builtin/cost/budget.py) here, so that replicas behind a load balancer count
against one total. Every read-modify-write is one Lua script run by Redis itself: two
replicas admitting the same key at the same instant cannot both take the last request.

Redis unreachable (refused, timed out, loading): :meth:`RedisState.run` raises
:class:`StateStoreDown`, and the caller applies ``[state] on_unavailable`` — "closed"
refuses with :class:`~backends.errors.StateStoreUnavailableError` (503), "open" falls back
to the replica's own in-process limits. The outage is logged once when it starts and once
when it ends; for ``retry_interval_s`` after a failure no call is made at all (so an outage
costs no connect timeout per request), then the next request tries again: recovery needs no
restart.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from backends.errors import StateStoreUnavailableError

if TYPE_CHECKING:
    from gateway.config.types import StateConfig

__all__ = ["RedisState", "StateConfigError", "StateStoreDown", "open_state"]

logger = logging.getLogger("infermux.state")


class StateStoreDown(Exception):
    """Redis could not be reached for this call (or was given up on a moment ago)."""


class RedisState:
    """A Redis client with outage bookkeeping; see the module docstring."""

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "infermux:",
        fail_open: bool = False,
        timeout_s: float = 0.5,
        retry_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        import redis.asyncio
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        # No client-side retries: a failed call is an outage at once, and the configured
        # behaviour answers the request instead of it waiting through back-offs.
        self._client = redis.asyncio.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            decode_responses=True,
        )
        self.key_prefix = key_prefix
        self.fail_open = fail_open
        self._retry_interval_s = retry_interval_s
        self._clock = clock
        #: Monotonic time before which no call is tried (None: Redis is up).
        self._down_until: float | None = None
        self._scripts: dict[str, Any] = {}

    @property
    def is_down(self) -> bool:
        """Whether the last call failed (and no later one succeeded)."""
        return self._down_until is not None

    def key(self, *parts: str) -> str:
        """The Redis key of ``parts`` under this deployment's prefix."""
        return self.key_prefix + ":".join(parts)

    async def run(
        self, script: str, keys: Sequence[str], args: Sequence[str | int | float]
    ) -> Any:
        """Run the Lua ``script`` atomically; :class:`StateStoreDown` when Redis is away.

        Scripts are sent once and then called by their SHA (redis-py sends the source
        again when a restarted Redis no longer knows it)."""
        from redis.exceptions import ConnectionError, TimeoutError

        if self._down_until is not None and self._clock() < self._down_until:
            raise StateStoreDown("the shared state store is unreachable")
        registered = self._scripts.get(script)
        if registered is None:
            registered = self._scripts[script] = self._client.register_script(script)
        try:
            result = await registered(keys=list(keys), args=list(args))
        except (ConnectionError, TimeoutError, OSError) as exc:
            if self._down_until is None:
                logger.error(
                    "shared state store (Redis) unreachable: %s; failing %s until it is back",
                    exc or type(exc).__name__,
                    "open on this replica's own limits" if self.fail_open else "closed (503)",
                )
            self._down_until = self._clock() + self._retry_interval_s
            raise StateStoreDown(str(exc)) from exc
        if self._down_until is not None:
            logger.warning("shared state store (Redis) reachable again: shared limits apply")
            self._down_until = None
        return result

    def unavailable(self, what: str) -> StateStoreUnavailableError:
        """The client's error when failing closed; ``what`` names the state that was needed."""
        return StateStoreUnavailableError(
            f"the shared state store (Redis) holding {what} is unreachable, and "
            '[state] on_unavailable = "closed" refuses requests it cannot count; retry shortly',
            retry_after=max(1.0, self._retry_interval_s),
        )

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()


class StateConfigError(ValueError):
    """``[state]`` names an environment variable that is unset or not a Redis URL; ``key``
    is the config key (the gateway reports it as a config error)."""

    def __init__(self, message: str, *, key: str) -> None:
        super().__init__(message)
        self.key = key


def open_state(config: StateConfig, env: Mapping[str, str] = os.environ) -> RedisState | None:
    """The Redis store of ``[state]``, or None for ``backend = "memory"``.

    Nothing connects yet (the first request does), so a gateway starts while Redis is down
    and applies ``on_unavailable`` until it is up. A missing variable is a
    :class:`StateConfigError`."""
    if config.backend != "redis":
        return None
    assert config.url_env is not None  # checked when the config was loaded
    url = env.get(config.url_env)
    if not url:
        raise StateConfigError(
            f"state.url_env: the environment variable {config.url_env!r} (the redis:// URL "
            "of the shared state store) is not set",
            key="state.url_env",
        )
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise StateConfigError(
            f"state.url_env: ${config.url_env} must be a redis://, rediss:// or unix:// URL",
            key="state.url_env",
        )
    return RedisState(
        url,
        key_prefix=config.key_prefix,
        fail_open=config.on_unavailable == "open",
        timeout_s=config.timeout_s,
        retry_interval_s=config.retry_interval_s,
    )
