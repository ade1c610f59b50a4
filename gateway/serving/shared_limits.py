"""Per-key rate limits shared by every replica: the token buckets of admission.py in Redis.

The same buckets as :class:`~gateway.serving.admission.KeyRateLimiter` (``rpm`` / ``tpm`` per
minute, refilled continuously, the token level may go below zero), but each bucket is one
Redis hash ``{level, at}`` and each admission or charge is one Lua script: refill from the
time elapsed, test, take, write back, all inside Redis, so two replicas admitting one key at
the same instant are serialised by Redis and together take at most the key's limit. The
clock is Redis's own (``TIME``), so the replicas' clocks need not agree. A bucket expires
once it would be full again: an idle key costs no memory.

A key's ``max_concurrent`` is a sorted set of leases, one per request in flight, scored by
when the lease expires (:data:`LEASE_TTL_S` after it was taken): taking one drops the
expired, counts, and adds, in one script. A replica that dies holding leases frees them
when they expire; a request running longer than the TTL stops counting against the cap.

Redis unreachable: ``on_unavailable = "closed"`` refuses (503 ``state_store_unavailable``);
"open" admits on a :class:`~gateway.serving.admission.KeyRateLimiter` of this replica (each replica
then grants the key its full limit: N replicas, N times the limit, until Redis is back).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence

from gateway.config.types import ApiKeyConfig
from gateway.serving.admission import (
    LOCAL_LEASE,
    BucketLevel,
    KeyRateLimiter,
    concurrency_refusal,
    rate_limit_headers,
    rate_limit_refusal,
)
from plugins.shared_state import RedisState, StateStoreDown

__all__ = ["LEASE_TTL_S", "SharedKeyRateLimiter"]

#: How long a concurrency lease lasts at most (longer than any request should run).
LEASE_TTL_S = 600.0

# The level of a bucket now (refilled from its stored level), and how to store it back.
_BUCKET = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local function level(key, capacity)
  local stored = redis.call('HMGET', key, 'level', 'at')
  if not stored[1] then return capacity end
  local refilled = tonumber(stored[1]) + (now - tonumber(stored[2])) * capacity / 60
  if refilled > capacity then return capacity end
  return refilled
end
local function store(key, capacity, value)
  redis.call('HSET', key, 'level', tostring(value), 'at', tostring(now))
  -- Full again after this long: from then on an absent key means the same.
  redis.call('PEXPIRE', key, math.ceil((capacity - value) * 60000 / capacity) + 1000)
end
"""

#: KEYS: the key's request bucket, its token bucket. ARGV: rpm, tpm (0: no such limit).
#: Returns {verdict ("ok" | "requests" | "tokens"), request level, token level}: a request
#: refused for tokens takes no request, as in admission.py.
_ADMIT = (
    _BUCKET
    + """
local rpm = tonumber(ARGV[1])
local tpm = tonumber(ARGV[2])
local requests = 0
local tokens = 0
if tpm > 0 then tokens = level(KEYS[2], tpm) end
if rpm > 0 then requests = level(KEYS[1], rpm) end
if tpm > 0 and tokens < 1 then return {'tokens', tostring(requests), tostring(tokens)} end
if rpm > 0 then
  if requests < 1 then return {'requests', tostring(requests), tostring(tokens)} end
  requests = requests - 1
  store(KEYS[1], rpm, requests)
end
return {'ok', tostring(requests), tostring(tokens)}
"""
)

#: KEYS: the key's token bucket. ARGV: tpm, tokens used.
_CHARGE = (
    _BUCKET
    + """
local tpm = tonumber(ARGV[1])
store(KEYS[1], tpm, level(KEYS[1], tpm) - tonumber(ARGV[2]))
return 1
"""
)


#: KEYS: the key's leases. ARGV: max_concurrent, a new lease id, its TTL in ms. 1: taken.
_ENTER = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
return 1
"""
#: KEYS: the key's leases. ARGV: the lease to give back.
_LEAVE = "return redis.call('ZREM', KEYS[1], ARGV[1])"


class SharedKeyRateLimiter:
    """:class:`~gateway.serving.admission.KeyLimits` in Redis; see the module docstring."""

    def __init__(
        self,
        keys: Sequence[ApiKeyConfig],
        state: RedisState,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._state = state
        self._limits = {k.id: (k.rpm or 0, k.tpm or 0) for k in keys if k.rpm or k.tpm}
        self._max_concurrent = {k.id: k.max_concurrent for k in keys if k.max_concurrent}
        #: The limits of this replica alone, used while Redis is down and failing open.
        self._local = KeyRateLimiter(keys, clock=clock)

    def _keys(self, key: ApiKeyConfig) -> list[str]:
        return [self._state.key("rpm", key.id), self._state.key("tpm", key.id)]

    async def admit(self, key: ApiKeyConfig | None) -> dict[str, str]:
        """Take one request from the shared bucket; headers, or :class:`RateLimitError`."""
        if key is None or key.id not in self._limits:
            return {}
        rpm, tpm = self._limits[key.id]
        try:
            verdict, requests, tokens = await self._state.run(_ADMIT, self._keys(key), [rpm, tpm])
        except StateStoreDown:
            if self._state.fail_open:
                return await self._local.admit(key)
            raise self._state.unavailable("the per-key rate limits") from None
        buckets: list[BucketLevel] = []
        if rpm:
            buckets.append(("requests", rpm, float(requests)))
        if tpm:
            buckets.append(("tokens", tpm, float(tokens)))
        if verdict != "ok":
            refused = next(bucket for bucket in buckets if bucket[0] == verdict)
            raise rate_limit_refusal(key, refused, buckets)
        return rate_limit_headers(buckets)

    async def charge_tokens(self, key: ApiKeyConfig | None, num_tokens: int) -> None:
        """Take the tokens a request used from the shared bucket (locally while down)."""
        if key is None or num_tokens <= 0:
            return
        _, tpm = self._limits.get(key.id, (0, 0))
        if not tpm:
            return
        try:
            await self._state.run(_CHARGE, self._keys(key)[1:], [tpm, num_tokens])
        except StateStoreDown:
            # Failing closed nothing is admitted meanwhile; failing open the local bucket
            # is the one admitting, so it is the one to charge.
            await self._local.charge_tokens(key, num_tokens)

    async def enter(self, key: ApiKeyConfig | None) -> str | None:
        """Lease one of the key's ``max_concurrent`` slots in Redis, or 429."""
        if key is None or key.id not in self._max_concurrent:
            return None
        cap = self._max_concurrent[key.id]
        lease = uuid.uuid4().hex
        try:
            taken = await self._state.run(
                _ENTER, [self._state.key("conc", key.id)], [cap, lease, int(LEASE_TTL_S * 1000)]
            )
        except StateStoreDown:
            if self._state.fail_open:
                return await self._local.enter(key)
            raise self._state.unavailable("the per-key concurrency caps") from None
        if not int(taken):
            raise concurrency_refusal(key, cap)
        return lease

    async def leave(self, key: ApiKeyConfig, lease: str) -> None:
        """Give the lease back (a local one to the local count)."""
        if lease == LOCAL_LEASE:
            await self._local.leave(key, lease)
            return
        try:
            await self._state.run(_LEAVE, [self._state.key("conc", key.id)], [lease])
        except StateStoreDown:
            pass  # the lease expires by itself (LEASE_TTL_S)
