"""Prefix-cache events: which block hashes entered and left the reusable cache.

The :class:`~core_engine.block_pool.BlockPool` reports each full block registered under its
chained hash (``stored``) and each hash it forgets (``removed``: the block was handed out
again, dropped a tier, or the cache was reset). A consumer outside the engine (the gateway's
``cache_aware`` routing strategy, through the backend) keeps a copy of the set of cached
hashes by applying :meth:`KVEventLog.take`'s batches in order.

The log is bounded: it coalesces per hash (a hash stored then removed before the next
``take`` is one pending change, not two) and holds at most ``max_pending`` hashes. Past that
it drops its changes and the next batch is a ``reset``: the full set of cached hashes (bounded
by the pool's block count), which replaces the consumer's copy. So a consumer that drains
late loses precision for one batch, never memory.

The engine thread writes and the consumer's thread takes, so both go through one lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["KVEventBatch", "KVEventLog"]


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """The changes since the previous batch."""

    #: Hashes now in the reusable cache (with ``reset``: all of them).
    stored: list[bytes]
    #: Hashes no longer in it.
    removed: list[bytes]
    #: True: ``stored`` is the whole set; forget everything known before.
    reset: bool = False

    @property
    def is_empty(self) -> bool:
        return not (self.stored or self.removed or self.reset)


class KVEventLog:
    """Pending stored/removed changes, coalesced per hash; see the module docstring."""

    def __init__(self, max_pending: int = 4096) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.max_pending = max_pending
        self._lock = threading.Lock()
        #: hash -> True (stored) / False (removed); dicts keep insertion order.
        self._pending: dict[bytes, bool] = {}
        self._overflowed = False
        #: Batches that had to be a full reset (metrics, tests).
        self.num_resets = 0

    def record_stored(self, block_hash: bytes) -> None:
        self._record(block_hash, True)

    def record_removed(self, block_hash: bytes) -> None:
        self._record(block_hash, False)

    def _record(self, block_hash: bytes, stored: bool) -> None:
        with self._lock:
            if self._overflowed:
                return  # the next batch is a full snapshot anyway
            self._pending.pop(block_hash, None)
            self._pending[block_hash] = stored
            if len(self._pending) > self.max_pending:
                self._pending.clear()
                self._overflowed = True

    def take(self, snapshot: Callable[[], Iterable[bytes]]) -> KVEventBatch:
        """The pending changes, or (after an overflow) ``snapshot()``, the cached hashes now."""
        with self._lock:
            if self._overflowed:
                self._overflowed = False
                self.num_resets += 1
                return KVEventBatch(stored=list(snapshot()), removed=[], reset=True)
            pending, self._pending = self._pending, {}
        return KVEventBatch(
            stored=[h for h, stored in pending.items() if stored],
            removed=[h for h, stored in pending.items() if not stored],
        )
