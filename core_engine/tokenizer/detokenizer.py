"""Streaming detokenization that never splits a multi-byte UTF-8 character."""

from __future__ import annotations

import codecs
from collections.abc import Iterable

from core_engine.chat.formats import SPECIAL_MARKERS
from core_engine.tokenizer.bpe import Tokenizer

__all__ = ["IncrementalDetokenizer", "marker_piece"]


def marker_piece(tokenizer: Tokenizer, token_id: int) -> bytes:
    """The text of special token ``token_id`` when it is a parser marker that does not end
    generation, else nothing."""
    stop: frozenset[int] = getattr(tokenizer, "stop_token_ids", frozenset())
    if token_id in stop or token_id == getattr(tokenizer, "eos_token_id", None):
        return b""
    data = tokenizer.token_to_bytes(token_id, skip_special=False)
    return data if data.decode("utf-8", errors="replace") in SPECIAL_MARKERS else b""


class IncrementalDetokenizer:
    """Turns generated ids into text deltas, holding back bytes of an unfinished character.

    Byte-level tokens can end in the middle of a character (an emoji is often 2-4 tokens).
    :meth:`add` returns only complete text; :meth:`flush` returns whatever is held back at the
    end of the stream (an incomplete tail becomes U+FFFD). Joining every :meth:`add` result and
    the :meth:`flush` result equals ``tokenizer.decode(all_ids)``, except that a special token
    whose text is a tool-call or reasoning marker (:data:`~core_engine.chat.formats.
    SPECIAL_MARKERS`: ``[TOOL_CALLS]``, harmony's ``<|channel|>``...) is kept even when special
    tokens are skipped - the output parsers need it - unless it ends generation.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """Text completed by ``token_id`` ("" while a character is still incomplete)."""
        data = self._tokenizer.token_to_bytes(token_id, skip_special=self._skip_special)
        if not data and self._skip_special and self._tokenizer.is_special(token_id):
            data = marker_piece(self._tokenizer, token_id)
        return self._decoder.decode(data) if data else ""

    def add_many(self, token_ids: Iterable[int]) -> str:
        """Text completed by several ids at once."""
        return "".join(self.add(i) for i in token_ids)

    def flush(self) -> str:
        """Text still held back (the end of the stream); resets the detokenizer."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text
