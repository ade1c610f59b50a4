"""Admission: per-key rate limits, then the global limit on concurrent generation requests.

Per key (``[[auth.keys]]`` ``rpm`` / ``tpm``) two token buckets refill continuously over a
minute, and ``max_concurrent`` caps the key's requests in flight (a key without one has
``[limits] default_max_concurrent_per_key``, so no key holds every queue place). A request
takes one request token; its tokens (prompt + completion, from the backend's usage) are
charged when it ends, so the token bucket may go below zero and then refuses requests until
it has refilled above zero. Refusals are 429 ``rate_limit_exceeded`` with ``Retry-After``;
every answer of a limited key carries OpenAI's ``x-ratelimit-*`` headers.

Globally, at most ``[limits] max_concurrent_requests`` requests run at once; the next
``max_queued_requests`` wait for up to ``queue_timeout_s``, served fairly between keys
(:class:`ConcurrencyLimiter`). A full queue or a wait that runs out is a 503
``server_is_overloaded`` with ``Retry-After``. Every endpoint that makes a backend compute
is admitted so: generation, embeddings, and the tokenizer's ``/tokenize``, ``/detokenize``
and ``/v1/messages/count_tokens``.

With ``[state] backend = "redis"`` the per-key buckets live in Redis, shared by every
replica (:class:`~gateway.serving.shared_limits.SharedKeyRateLimiter`, the same interface);
the global slots stay per process: they guard this replica's own backends.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from backends.errors import RateLimitError, ServerOverloadedError
from gateway.config.types import ApiKeyConfig, LimitsConfig

__all__ = [
    "Admission",
    "ConcurrencyLimiter",
    "Grant",
    "KeyLimits",
    "KeyRateLimiter",
    "TokenBucket",
    "LOCAL_LEASE",
    "concurrency_refusal",
    "rate_limit_headers",
    "rate_limit_refusal",
]

Clock = Callable[[], float]

#: The lease of a slot counted in this process (shared ones are random ids).
LOCAL_LEASE = "local"

#: Seconds a client refused for a full queue is told to wait.
_OVERLOADED_RETRY_AFTER_S = 1.0


class TokenBucket:
    """``capacity`` tokens per minute, refilled continuously; the level may go negative."""

    def __init__(self, capacity: int, *, clock: Clock = time.monotonic) -> None:
        self.capacity = capacity
        self._rate = capacity / 60.0  # tokens per second
        self._clock = clock
        self._level = float(capacity)
        self._updated = clock()

    def _refill(self) -> float:
        now = self._clock()
        self._level = min(self.capacity, self._level + (now - self._updated) * self._rate)
        self._updated = now
        return self._level

    def level(self) -> float:
        """Tokens available now (negative after charges beyond what was there)."""
        return self._refill()

    def take(self, amount: float = 1.0) -> bool:
        """Take ``amount`` if it is there; False (nothing taken) otherwise."""
        if self._refill() < amount:
            return False
        self._level -= amount
        return True

    def charge(self, amount: float) -> None:
        """Take ``amount`` unconditionally (work already done)."""
        self._refill()
        self._level -= amount


class KeyLimits(Protocol):
    """Per-key ``rpm`` / ``tpm``: in this process (:class:`KeyRateLimiter`) or shared in
    Redis (:class:`~gateway.serving.shared_limits.SharedKeyRateLimiter`)."""

    async def admit(self, key: ApiKeyConfig | None) -> dict[str, str]:
        """Take one request; the ``x-ratelimit-*`` headers, or :class:`RateLimitError`."""
        ...

    async def charge_tokens(self, key: ApiKeyConfig | None, num_tokens: int) -> None:
        """Count the tokens a finished (or failed, or abandoned) request used."""
        ...

    async def enter(self, key: ApiKeyConfig | None) -> str | None:
        """Take one of the key's ``max_concurrent`` slots: a lease to :meth:`leave` with
        (None: the key has no cap), or :class:`RateLimitError`."""
        ...

    async def leave(self, key: ApiKeyConfig, lease: str) -> None:
        """Give back the slot :meth:`enter` leased."""
        ...


#: (kind, capacity per minute, level now): one bucket as the headers and refusals see it.
BucketLevel = tuple[str, int, float]


def rate_limit_headers(buckets: Sequence[BucketLevel]) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*`` headers of ``buckets`` (kind "requests" or "tokens")."""
    headers: dict[str, str] = {}
    for kind, capacity, level in buckets:
        headers[f"x-ratelimit-limit-{kind}"] = str(capacity)
        headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(level)))
        headers[f"x-ratelimit-reset-{kind}"] = _duration(
            max(0.0, (capacity - level) * 60.0 / capacity)
        )
    return headers


def rate_limit_refusal(
    key: ApiKeyConfig, refused: BucketLevel, buckets: Sequence[BucketLevel]
) -> RateLimitError:
    """The 429 of ``key`` whose ``refused`` bucket holds less than one unit."""
    kind, capacity, level = refused
    wait = max(0.0, (1.0 - level) * 60.0 / capacity)
    unit = "tokens" if kind == "tokens" else "requests"
    return RateLimitError(
        f"rate limit reached for key {key.id!r}: {capacity} {unit} per minute; "
        f"retry in {wait:.1f} s",
        retry_after=max(1.0, wait),
        headers=rate_limit_headers(buckets),
    )


def concurrency_refusal(key: ApiKeyConfig, max_concurrent: int) -> RateLimitError:
    """The 429 of ``key`` with ``max_concurrent`` requests already in flight."""
    return RateLimitError(
        f"too many concurrent requests for key {key.id!r}: at most {max_concurrent} at once; "
        "retry when one has finished",
        retry_after=1.0,
    )


class KeyRateLimiter:
    """The ``rpm`` / ``tpm`` buckets and ``max_concurrent`` counts of every key that has
    them, in this process."""

    def __init__(self, keys: Sequence[ApiKeyConfig], *, clock: Clock = time.monotonic) -> None:
        self._requests = {k.id: TokenBucket(k.rpm, clock=clock) for k in keys if k.rpm}
        self._tokens = {k.id: TokenBucket(k.tpm, clock=clock) for k in keys if k.tpm}
        self._max_concurrent = {k.id: k.max_concurrent for k in keys if k.max_concurrent}
        self._num_active: dict[str, int] = {}

    async def admit(self, key: ApiKeyConfig | None) -> dict[str, str]:
        """Take one request; the ``x-ratelimit-*`` headers, or :class:`RateLimitError`."""
        if key is None:
            return {}
        requests = self._requests.get(key.id)
        tokens = self._tokens.get(key.id)
        levels = {
            kind: (kind, bucket.capacity, bucket.level())
            for kind, bucket in (("requests", requests), ("tokens", tokens))
            if bucket is not None
        }
        # Tokens first: a request refused for tokens must not also spend a request.
        if "tokens" in levels and levels["tokens"][2] < 1.0:
            raise rate_limit_refusal(key, levels["tokens"], list(levels.values()))
        if requests is not None:
            if not requests.take():
                raise rate_limit_refusal(key, levels["requests"], list(levels.values()))
            levels["requests"] = ("requests", requests.capacity, requests.level())
        return rate_limit_headers(list(levels.values()))

    async def charge_tokens(self, key: ApiKeyConfig | None, num_tokens: int) -> None:
        """Count the tokens a finished (or failed, or abandoned) request used."""
        if key is None or num_tokens <= 0:
            return
        bucket = self._tokens.get(key.id)
        if bucket is not None:
            bucket.charge(num_tokens)

    async def enter(self, key: ApiKeyConfig | None) -> str | None:
        """Count one more request of the key in flight, or :class:`RateLimitError`."""
        if key is None or key.id not in self._max_concurrent:
            return None
        cap = self._max_concurrent[key.id]
        num_active = self._num_active.get(key.id, 0)
        if num_active >= cap:
            raise concurrency_refusal(key, cap)
        self._num_active[key.id] = num_active + 1
        return LOCAL_LEASE

    async def leave(self, key: ApiKeyConfig, lease: str) -> None:
        """One request of the key fewer in flight."""
        self._num_active[key.id] -= 1


class ConcurrencyLimiter:
    """At most ``max_active`` holders; ``max_queued`` more wait up to ``timeout_s``.

    The queue is fair between owners (API keys; ``None``: open mode's one user): a freed
    slot goes to the queued owner with the fewest slots held, ties to the one served least
    recently, and within an owner to its oldest waiter. So a key that floods the queue waits
    behind its own requests only: another key's request gets the next free slot whenever it
    holds fewer slots than the flooder (FIFO let 1,024 queued requests of one key go first)."""

    def __init__(self, *, max_active: int, max_queued: int, timeout_s: float) -> None:
        self.max_active = max_active
        self.max_queued = max_queued
        self.timeout_s = timeout_s
        self.num_active = 0
        #: Owner -> its waiters, oldest first (an owner is here while it has any).
        self._waiters: dict[str | None, collections.deque[asyncio.Future[None]]] = {}
        #: Owner -> slots it holds now.
        self._num_held: collections.Counter[str | None] = collections.Counter()
        #: Owner -> the number of the grant it last got (the tie-break: longest ago first).
        self._last_grant: dict[str | None, int] = {}
        self._num_grants = 0

    @property
    def num_queued(self) -> int:
        return sum(len(waiters) for waiters in self._waiters.values())

    async def acquire(self, owner: str | None = None) -> None:
        """Hold a slot for ``owner`` (call :meth:`release` with it once), or
        :class:`ServerOverloadedError`."""
        if self.num_active < self.max_active and not self._waiters:
            self.num_active += 1
            self._granted(owner)
            return
        num_queued = self.num_queued
        if num_queued >= self.max_queued:
            raise ServerOverloadedError(
                f"infermux is at capacity ({self.max_active} requests running, "
                f"{num_queued} waiting); retry shortly",
                retry_after=_OVERLOADED_RETRY_AFTER_S,
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(owner, collections.deque()).append(waiter)
        try:
            async with asyncio.timeout(self.timeout_s):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self.release(owner)  # the slot was handed over as we left: pass it on
            else:
                waiter.cancel()
                self._forget(owner, waiter)
            if isinstance(exc, TimeoutError):
                raise ServerOverloadedError(
                    f"infermux is at capacity: no request slot freed up within "
                    f"{self.timeout_s:g} s; retry shortly",
                    retry_after=_OVERLOADED_RETRY_AFTER_S,
                ) from None
            raise

    def release(self, owner: str | None = None) -> None:
        """Free ``owner``'s slot: hand it to the next waiter (see the class), if any."""
        self._num_held[owner] -= 1
        if self._num_held[owner] <= 0:
            del self._num_held[owner]
        while self._waiters:
            chosen = min(
                self._waiters, key=lambda o: (self._num_held[o], self._last_grant.get(o, -1))
            )
            waiter = self._waiters[chosen].popleft()
            if not self._waiters[chosen]:
                del self._waiters[chosen]
            if not waiter.done():
                waiter.set_result(None)  # the slot moves on; num_active is unchanged
                self._granted(chosen)
                return
        self.num_active -= 1
        assert self.num_active >= 0, "ConcurrencyLimiter released more often than acquired"

    def _granted(self, owner: str | None) -> None:
        self._num_held[owner] += 1
        self._num_grants += 1
        self._last_grant[owner] = self._num_grants

    def _forget(self, owner: str | None, waiter: asyncio.Future[None]) -> None:
        waiters = self._waiters.get(owner)
        if waiters is None:
            return
        try:
            waiters.remove(waiter)
        except ValueError:
            pass
        if not waiters:
            del self._waiters[owner]


class Grant:
    """An admitted request: its rate-limit headers, its slot and its key's concurrency
    lease, released once."""

    def __init__(
        self,
        admission: Admission,
        key: ApiKeyConfig | None,
        headers: dict[str, str],
        lease: str | None = None,
        *,
        default_capped: bool = False,
    ) -> None:
        self._admission = admission
        self._key = key
        self.headers = headers
        self._lease = lease
        self._default_capped = default_capped

    async def release(self, num_tokens: int = 0) -> None:
        """Free the slot and the lease, then charge ``num_tokens`` to the key. Called once, by
        the request's owner (:class:`~gateway.serving.request_life.RequestLife`; before the
        choices opened, by the code that admitted it).

        Awaited, so that with shared limits the charge is in Redis before the response's
        last bytes leave and the client's next request, on any replica, sees it."""
        key = self._key
        self._admission.concurrency.release(key.id if key is not None else None)
        if self._default_capped and key is not None:
            self._admission.leave_default_cap(key)
        limiter = self._admission.rate_limiter
        if self._lease is not None and key is not None:
            await limiter.leave(key, self._lease)
        await limiter.charge_tokens(key, num_tokens)


class Admission:
    """Per-key limits, then a global slot: :meth:`admit` returns a :class:`Grant`.

    A key without its own ``max_concurrent`` has ``[limits] default_max_concurrent_per_key``
    (None: ``max_concurrent_requests``), counted in this replica as the global slots are."""

    def __init__(self, limits: LimitsConfig, rate_limiter: KeyLimits) -> None:
        """``rate_limiter``: this replica's :class:`KeyRateLimiter`, or the one every replica
        shares in Redis (:class:`~gateway.serving.shared_limits.SharedKeyRateLimiter`)."""
        self.rate_limiter = rate_limiter
        self.concurrency = ConcurrencyLimiter(
            max_active=limits.max_concurrent_requests,
            max_queued=limits.max_queued_requests,
            timeout_s=limits.queue_timeout_s,
        )
        self.default_max_concurrent_per_key = (
            limits.default_max_concurrent_per_key or limits.max_concurrent_requests
        )
        #: Key id -> requests in flight, for the keys under the default cap.
        self._num_in_flight_by_key: collections.Counter[str] = collections.Counter()

    @property
    def num_in_flight(self) -> int:
        """Generation requests running or waiting for a slot."""
        return self.concurrency.num_active + self.concurrency.num_queued

    async def admit(self, key: ApiKeyConfig | None) -> Grant:
        # The key's concurrency first: a request refused for it spends no request token.
        default_capped = key is not None and key.max_concurrent is None
        if default_capped:
            assert key is not None
            self._enter_default_cap(key)
        lease = None
        try:
            lease = await self.rate_limiter.enter(key)
            headers = await self.rate_limiter.admit(key)
            await self.concurrency.acquire(key.id if key is not None else None)
        except BaseException:
            if lease is not None and key is not None:
                await self.rate_limiter.leave(key, lease)
            if default_capped and key is not None:
                self.leave_default_cap(key)
            raise
        return Grant(self, key, headers, lease, default_capped=default_capped)

    def _enter_default_cap(self, key: ApiKeyConfig) -> None:
        cap = self.default_max_concurrent_per_key
        if self._num_in_flight_by_key[key.id] >= cap:
            raise concurrency_refusal(key, cap)
        self._num_in_flight_by_key[key.id] += 1

    def leave_default_cap(self, key: ApiKeyConfig) -> None:
        """One request fewer of ``key`` (a key under the default cap) in flight."""
        self._num_in_flight_by_key[key.id] -= 1
        if self._num_in_flight_by_key[key.id] <= 0:
            del self._num_in_flight_by_key[key.id]


def _duration(seconds: float) -> str:
    """OpenAI's reset format: ``"1s"``, ``"6m0s"``, ``"250ms"``."""
    if seconds < 1.0:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    minutes, rest = divmod(whole, 60)
    return f"{minutes}m{rest}s" if minutes else f"{rest}s"
