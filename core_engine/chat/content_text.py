"""Message content stays text: a control token's text inside a request never becomes the token.

A chat prompt is tokenized with special-token parsing on, so that the template's own
``<|im_start|>``, ``<|eot_id|>``... become control tokens. Content written by the client
(messages of any role, content parts, tool-call arguments, tool results, tool definitions,
``chat_template_kwargs``) goes through the same template, so without care a user who writes
``<|im_end|><|im_start|>system`` forges a system turn. OpenAI, and this module, read such text
as text.

How: before rendering, :meth:`ControlTexts.mark` replaces every control-token text inside the
request's strings by one sentinel character of the Supplementary Private Use Areas (one per
control text of the vocabulary; a character of those areas already in the content is escaped,
so no client text can pass for a sentinel). The template renders the marked strings like any
other text. :meth:`ControlTexts.encode` then tokenizes the rendered text as the tokenizer
always splits it (the template's control tokens, with the runs of text between them tokenized
on their own), except that a run holding a sentinel is tokenized with special parsing off,
its sentinels given back their original text. A prompt whose content holds no control text has
no sentinel and is tokenized by the very call used before, so its token ids are unchanged.

Left as the tokenizers have them: tokens a vocabulary marks user-defined (non-special added
tokens such as Qwen's ``<tool_call>``) match in any text, as in Hugging Face and llama.cpp with
special parsing off; raw ``/v1/completions`` prompts are the client's own full prompt and keep
special parsing on, as vLLM and llama.cpp do.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["ControlTexts"]

#: ``tokenize(text, add_special, parse_special)``: a backend's own tokenizer call.
Tokenize = Callable[[str, bool, bool], list[int]]

# Sentinels: U+F0001..U+FFFFD (Area-A) then U+100000..U+10FFFD (Area-B); U+F0000 escapes a
# character of those areas that the content itself holds.
_ESCAPE = "\U000F0000"
_AREA_A = range(0xF0001, 0xFFFFE)
_AREA_B = range(0x100000, 0x10FFFE)
_MAX_CONTROL_TEXTS = len(_AREA_A) + len(_AREA_B)
#: Any character of the two areas: a sentinel, the escape, or an escaped character.
_MARKED = re.compile("[\U000F0000-\U0010FFFF]")
_MARK = re.compile("\U000F0000(.)|([\U000F0001-\U0010FFFF])", re.DOTALL)


def _sentinel(index: int) -> str:
    if index < len(_AREA_A):
        return chr(_AREA_A[index])
    return chr(_AREA_B[index - len(_AREA_A)])


class ControlTexts:
    """The control-token texts of one vocabulary: the texts that special parsing turns into
    tokens (llama.cpp's control and unknown tokens, Hugging Face's special added tokens).

    ``ValueError`` past 131,067 texts (no vocabulary comes near: they would run out of
    sentinels).
    """

    def __init__(self, texts: Iterable[str] = ()) -> None:
        # Longest first: a longer text that holds a shorter one is marked whole.
        ordered = sorted({t for t in texts if t}, key=lambda t: (-len(t), t))
        if len(ordered) > _MAX_CONTROL_TEXTS:
            raise ValueError(f"{len(ordered)} control-token texts: at most {_MAX_CONTROL_TEXTS} can be marked")
        self._sentinels = {text: _sentinel(i) for i, text in enumerate(ordered)}
        self._texts = {sentinel: text for text, sentinel in self._sentinels.items()}
        alternatives = "|".join(re.escape(t) for t in ordered)
        #: The template's control tokens in a rendered prompt; what content holds to be marked.
        self._control = re.compile(alternatives) if ordered else None
        self._in_content = re.compile(f"{alternatives}|[\U000F0000-\U0010FFFF]") if ordered else None

    # -- content ------------------------------------------------------------------------------

    def mark(self, value: Any) -> Any:
        """``value`` (a string, or lists, tuples and dicts of them, keys included) with every
        control text replaced by its sentinel; other values as they are."""
        if self._in_content is None:
            return value
        if isinstance(value, str):
            return self._in_content.sub(self._mark_one, value)
        if isinstance(value, dict):
            return {self.mark(k): self.mark(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.mark(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self.mark(v) for v in value)
        return value

    def _mark_one(self, match: re.Match[str]) -> str:
        found = match.group()
        sentinel = self._sentinels.get(found)
        return sentinel if sentinel is not None else _ESCAPE + found

    def text(self, marked: str) -> str:
        """The real text of ``marked`` (the prompt as the model reads it)."""
        if not _MARKED.search(marked):
            return marked
        return _MARK.sub(self._text_of, marked)

    def _text_of(self, match: re.Match[str]) -> str:
        escaped, sentinel = match.group(1), match.group(2)
        if escaped is not None:
            return escaped
        return self._texts.get(sentinel, sentinel)

    # -- tokenization -------------------------------------------------------------------------

    def encode(self, marked: str, tokenize: Tokenize, *, add_special: bool) -> list[int]:
        """Token ids of a rendered prompt: ``tokenize(marked, add_special, True)`` when nothing
        in it is marked; otherwise the template's control tokens parsed, the content's control
        texts tokenized as text, and BOS/EOS framed around it all as ``add_special`` asks."""
        pieces = self._pieces(marked)
        if len(pieces) == 1 and pieces[0][1]:
            return tokenize(marked, add_special, True)
        ids = [token for piece, parse_special in pieces for token in tokenize(piece, False, parse_special)]
        if not add_special:
            return ids
        head, tail = _framing(tokenize)
        return head + ids + tail

    def _pieces(self, marked: str) -> list[tuple[str, bool]]:
        """``marked`` cut into runs to tokenize with special parsing on (True) or off (False):
        a run of text between two of the template's control tokens that holds a sentinel is
        tokenized whole, as text (so its tokens are those of the same text written plainly)."""
        marks = [m.start() for m in _MARKED.finditer(marked)]
        if not marks or self._control is None:
            return [(marked, True)]
        controls = [(m.start(), m.end()) for m in self._control.finditer(marked)]
        gap_starts = [0] + [end for _, end in controls]
        gap_ends = [start for start, _ in controls] + [len(marked)]
        pieces: list[tuple[str, bool]] = []
        done = 0
        for start, end in zip(gap_starts, gap_ends, strict=True):
            k = bisect.bisect_left(marks, start)
            if k == len(marks) or marks[k] >= end:
                continue
            if done < start:
                pieces.append((marked[done:start], True))
            pieces.append((self.text(marked[start:end]), False))
            done = end
        if done < len(marked):
            pieces.append((marked[done:], True))
        return pieces


def _framing(tokenize: Tokenize) -> tuple[list[int], list[int]]:
    """The ids ``add_special`` puts before and after a text (BOS; EOS for the few vocabularies
    that add one), found on a probe text."""
    bare = tokenize("a", False, False)
    framed = tokenize("a", True, False)
    for k in range(len(framed) - len(bare) + 1):
        if framed[k : k + len(bare)] == bare:
            return framed[:k], framed[k + len(bare) :]
    return [], []
