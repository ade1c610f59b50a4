"""What an engine's prefix cache holds, as seen from the gateway.

An engine that reports its cache (the core engine: :mod:`core_engine.kv_events`) hands out
:class:`CacheEvents` batches — block hashes stored in / removed from its reusable cache. The
backend (in-process, or the supervisor of its worker process, which receives the batches over
the worker channel) applies them in order to one :class:`PrefixCacheIndex`, which a router
asks how many leading blocks of a prompt that engine holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

__all__ = ["CacheEvents", "PrefixCacheIndex"]


class CacheEvents(msgspec.Struct, frozen=True, kw_only=True):
    """One batch of prefix-cache changes of one engine."""

    #: Tokens per block: the unit the hashes are computed over.
    block_size: int
    #: Hashes that entered the cache (with ``reset``: every cached hash).
    stored: list[bytes] = []
    #: Hashes that left it.
    removed: list[bytes] = []
    #: ``stored`` replaces everything known before (the engine's log overflowed).
    reset: bool = False


class PrefixCacheIndex:
    """The set of block hashes one engine reported cached (bounded by its block count:
    every hash it forgets is reported removed, or the next batch is a full reset)."""

    def __init__(self) -> None:
        #: None until the engine's first batch.
        self.block_size: int | None = None
        self._hashes: set[bytes] = set()
        #: Batches applied (tests wait for the one that follows a request).
        self.num_batches = 0

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._hashes

    def apply(self, events: CacheEvents) -> None:
        if events.reset or events.block_size != self.block_size:
            self._hashes.clear()
        self.block_size = events.block_size
        self._hashes.difference_update(events.removed)
        self._hashes.update(events.stored)
        self.num_batches += 1

    def clear(self) -> None:
        """The engine restarted with an empty cache."""
        self._hashes.clear()

    def num_leading_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """How many of the leading ``block_hashes`` (a prompt's chained hashes) are cached."""
        n = 0
        for block_hash in block_hashes:
            if block_hash not in self._hashes:
                break
            n += 1
        return n
