"""Slots: the sequence ids of one llama.cpp context, and which one a new prompt takes.

A context serving ``parallel`` sequences has that many slots, each a llama.cpp ``seq_id`` with
its own KV positions. A slot remembers the tokens whose KV it holds (the last request's
prompt and output), so a new prompt that starts the same way skips that prefix.
:meth:`SlotPool.acquire` gives a new request the free slot with the longest common prefix;
ties go to the least recently used slot, so unused slots are taken before warm ones.

A slot also remembers the ``cache_salt`` of the request that filled it (issue 44): a prompt
shares a prefix only with a slot of its own salt, so one tenant's cached tokens and faster
first token never tell another whether its prompt began the same way. A slot of another
salt counts as sharing nothing; the caller then removes all of its KV (a cold prefill).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["Slot", "SlotPool", "common_prefix_length"]


class Slot:
    """One sequence id of the context and the tokens its KV cache holds, in position order."""

    __slots__ = ("seq_id", "tokens", "salt", "last_used", "is_busy")

    def __init__(self, seq_id: int) -> None:
        self.seq_id = seq_id
        #: Token ``i`` of this list has its KV at position ``i`` of sequence ``seq_id``.
        self.tokens: list[int] = []
        #: The ``cache_salt`` of the request whose KV ``tokens`` describes.
        self.salt: str | None = None
        #: Release order (0: never used), the tie-break of :meth:`SlotPool.acquire`.
        self.last_used = 0
        self.is_busy = False


class SlotPool:
    """The slots of one context; :meth:`acquire` / :meth:`release` hand them out."""

    def __init__(self, num_slots: int) -> None:
        self.slots = [Slot(seq_id) for seq_id in range(num_slots)]
        self._num_releases = 0

    @property
    def num_free(self) -> int:
        return sum(not slot.is_busy for slot in self.slots)

    def acquire(self, prompt: Sequence[int], salt: str | None = None) -> tuple[Slot, int]:
        """The free slot that shares the longest prefix with ``prompt``, and that length.

        Only a slot filled under ``salt`` (None matches only None) can share a prefix; the
        slot taken belongs to ``salt`` from now on. The caller trims the slot's KV past the
        returned length (all of it when that is 0); ``num_free`` must be > 0.
        """
        best: Slot | None = None
        best_key = (-1, 0)
        for slot in self.slots:
            if slot.is_busy:
                continue
            shared = common_prefix_length(slot.tokens, prompt) if slot.salt == salt else 0
            key = (shared, -slot.last_used)
            if key > best_key:
                best, best_key = slot, key
        assert best is not None, "acquire() needs a free slot"
        best.is_busy = True
        best.salt = salt
        return best, best_key[0]

    def release(self, slot: Slot) -> None:
        self._num_releases += 1
        slot.last_used = self._num_releases
        slot.is_busy = False


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    length = min(len(a), len(b))
    if a[:length] == b[:length]:  # the common case of a repeated prompt, compared in C
        return length
    for i in range(length):
        if a[i] != b[i]:
            return i
    return length
