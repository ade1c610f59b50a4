"""The approximate prefix map of the ``cache_aware`` strategy, for backends that do not
report their cache (llama.cpp, remote servers): which prompt prefixes the gateway itself
routed to each replica lately.

A prompt is cut into fixed-size byte blocks of its rendering (chat messages as their JSON,
one after the other; a completion's text or token ids) and each block is named by a chained
hash, so one hash names the whole prefix up to it. The chain starts from the request's
``cache_salt``, so two tenants' prompts never share a hash (the engines partition alike). Each replica keeps the hashes of the
prompts routed to it, with an expiry (``ttl_s``: an engine's LRU forgets too) and at most
``max_entries`` of them (the least recently routed go first). It is a guess at what the
engine holds, no more: the engine may have evicted a prefix sooner.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import msgspec

from backends.base import GenerationRequest

__all__ = ["APPROX_BLOCK_BYTES", "PrefixMap", "prompt_text_hashes"]

#: Bytes per approximate block (about 16 tokens of English text).
APPROX_BLOCK_BYTES = 64
_ROOT = b"infermux-approx-root"


def prompt_text_hashes(request: GenerationRequest, block_bytes: int = APPROX_BLOCK_BYTES) -> list[bytes]:
    """Chained hashes of the full ``block_bytes`` blocks of the request's prompt rendering,
    from a root that is the request's ``cache_salt``."""
    if request.messages is not None:
        data = b"".join(msgspec.json.encode(m) for m in request.messages)
    elif isinstance(request.prompt, tuple):
        data = msgspec.json.encode(request.prompt)
    else:
        data = (request.prompt or "").encode()
    hashes: list[bytes] = []
    parent = _ROOT if request.cache_salt is None else _ROOT + b"\0" + request.cache_salt.encode()
    for start in range(0, len(data) - block_bytes + 1, block_bytes):
        parent = hashlib.blake2b(parent + data[start : start + block_bytes], digest_size=16).digest()
        hashes.append(parent)
    return hashes


class PrefixMap:
    """Per-replica prefix hashes with a TTL and a size cap; see the module docstring."""

    def __init__(
        self, *, ttl_s: float = 300.0, max_entries: int = 100_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        #: replica -> hash -> expiry (monotonic), least recently routed first.
        self._entries: dict[str, OrderedDict[bytes, float]] = {}

    def num_entries(self, replica: str) -> int:
        return len(self._entries.get(replica, ()))

    def record(self, replica: str, block_hashes: Sequence[bytes]) -> None:
        """``replica`` was sent a prompt with these prefix hashes."""
        entries = self._entries.setdefault(replica, OrderedDict())
        expiry = self._clock() + self.ttl_s
        for block_hash in block_hashes:
            entries[block_hash] = expiry
            entries.move_to_end(block_hash)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)

    def num_leading_blocks(self, replica: str, block_hashes: Sequence[bytes]) -> int:
        """How many leading ``block_hashes`` were routed to ``replica`` and have not expired."""
        entries = self._entries.get(replica)
        if not entries:
            return 0
        now = self._clock()
        self._expire(entries, now)
        n = 0
        for block_hash in block_hashes:
            expiry = entries.get(block_hash)
            if expiry is None or expiry <= now:
                break
            n += 1
        return n

    @staticmethod
    def _expire(entries: OrderedDict[bytes, float], now: float) -> None:
        # Least recently routed first, and every record() gives the same TTL: expired
        # entries are at the front.
        while entries:
            block_hash, expiry = next(iter(entries.items()))
            if expiry > now:
                return
            del entries[block_hash]
