"""Streaming detokenization that never splits a multi-byte UTF-8 character."""

from __future__ import annotations

import codecs
from collections.abc import Iterable

from core_engine.tokenizer.bpe import Tokenizer

__all__ = ["IncrementalDetokenizer"]


class IncrementalDetokenizer:
    """Turns generated ids into text deltas, holding back bytes of an unfinished character.

    Byte-level tokens can end in the middle of a character (an emoji is often 2-4 tokens).
    :meth:`add` returns only complete text; :meth:`flush` returns whatever is held back at the
    end of the stream (an incomplete tail becomes U+FFFD). Joining every :meth:`add` result and
    the :meth:`flush` result equals ``tokenizer.decode(all_ids)``.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """Text completed by ``token_id`` ("" while a character is still incomplete)."""
        data = self._tokenizer.token_to_bytes(token_id, skip_special=self._skip_special)
        return self._decoder.decode(data) if data else ""

    def add_many(self, token_ids: Iterable[int]) -> str:
        """Text completed by several ids at once."""
        return "".join(self.add(i) for i in token_ids)

    def flush(self) -> str:
        """Text still held back (the end of the stream); resets the detokenizer."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text
