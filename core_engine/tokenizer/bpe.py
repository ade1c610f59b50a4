"""Byte-level BPE tokenizer built from GGUF metadata, token-for-token equal to llama.cpp.

Encoding follows ``llama_vocab::tokenize``: special tokens are cut out of the text first
(longest first), each remaining text fragment is split by the model's pre-tokenizer, every word
is spelled in the byte-level alphabet and merged by BPE rank (lowest rank first, leftmost on
ties). Words are cached, so long prompts with repeated words encode quickly.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from enum import IntEnum
from typing import Any

from core_engine.chat.template import FALLBACK_CHATML_TEMPLATE, ChatTemplate
from core_engine.tokenizer.byte_level import decode_token_text, encode_bytes
from core_engine.tokenizer.end_of_generation import END_OF_GENERATION_TEXTS
from core_engine.tokenizer.pre_tokenizer import (
    SPM_STYLE_PRE_TOKENIZER,
    PreTokenizer,
    pre_tokenizer_type,
)

__all__ = ["TokenType", "Tokenizer", "TokenizerError"]

# Token texts llama.cpp treats as end-of-generation whatever the metadata says.
_EOG_TEXTS = END_OF_GENERATION_TEXTS
_MAX_CACHED_WORDS = 200_000
_SPACE = "\u2581"  # SentencePiece's visible space (Gemma 4's BPE)
_C_SPACE = " \t\n\v\f\r"  # C's isspace()


def metadata_token_id(metadata: Mapping[str, Any], key: str, vocab_size: int, default: int | None) -> int | None:
    """``tokenizer.ggml.{key}`` as a token id; llama.cpp ignores out-of-range ids and keeps
    its default."""
    value = metadata.get(f"tokenizer.ggml.{key}")
    if value is None or not 0 <= int(value) < vocab_size:
        return default
    return int(value)


def byte_fallback_piece(text: str) -> bytes:
    """The byte a ``<0xXX>`` entry stands for (llama.cpp's ``token_to_byte``)."""
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return bytes([int(text[3:5], 16)])
        except ValueError:
            pass
    return b""


class TokenizerError(ValueError):
    """The GGUF's tokenizer metadata is missing, unsupported or inconsistent (message says which)."""


class TokenType(IntEnum):
    """``tokenizer.ggml.token_type`` values."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


class Tokenizer:
    """Text ↔ token ids for a byte-level BPE (``tokenizer.ggml.model == "gpt2"``) vocabulary."""

    def __init__(
        self,
        tokens: Sequence[str],
        merges: Sequence[str],
        *,
        token_types: Sequence[int] | None = None,
        pre: str | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        eot_token_id: int | None = None,
        eom_token_id: int | None = None,
        pad_token_id: int | None = None,
        add_bos: bool | None = None,
        add_eos: bool = False,
        chat_template: str | None = None,
    ) -> None:
        kind, self._ignore_merges, default_add_bos = pre_tokenizer_type(pre)
        self._pre_tokenizer = PreTokenizer(kind)
        # Gemma 4's BPE: merges over raw UTF-8 with spaces as "▁" (not GPT-2's byte alphabet),
        # "<0xXX>" byte fallback, llama.cpp's escape_whitespaces / byte_encode = false.
        self._spm_style = kind == SPM_STYLE_PRE_TOKENIZER
        if self._spm_style:
            add_bos = True  # llama.cpp overrides add_bos_token = false for Gemma 4
        self.pre = pre
        # llama.cpp renames empty entries so every id has a distinct text.
        self._id_to_text = [text or f"[EMPTY_{i}]" for i, text in enumerate(tokens)]
        self._text_to_id = {text: i for i, text in enumerate(self._id_to_text)}
        types = list(token_types) if token_types is not None else [TokenType.NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise TokenizerError(f"{len(types)} token types for {len(tokens)} tokens")
        self._ranks: dict[tuple[str, str], int] = {}
        for rank, merge in enumerate(merges):
            split_at = merge.find(" ", 1)
            if split_at > 0:
                self._ranks[(merge[:split_at], merge[split_at + 1 :])] = rank
        for name, token_id in (("bos", bos_token_id), ("eos", eos_token_id), ("eot", eot_token_id)):
            if token_id is not None and not 0 <= token_id < len(tokens):
                raise TokenizerError(f"{name}_token_id {token_id} is outside the vocabulary")
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.add_bos = default_add_bos if add_bos is None else add_bos
        self.add_eos = add_eos
        self.chat_template = chat_template
        self._types = types
        eog = self._end_of_generation_ids(eos_token_id, eot_token_id, eom_token_id)
        self.stop_token_ids: frozenset[int] = frozenset(eog)
        # Special tokens are matched longest first, as in llama.cpp's tokenizer_st_partition.
        self._special_ids = sorted(
            (i for i, t in enumerate(types) if t in (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)),
            key=lambda i: -len(self._id_to_text[i]),
        )
        self._pieces = [self._piece(i) for i in range(len(tokens))]
        # Special tokens that swallow the whitespace before (lstrip) or after (rstrip) them.
        self._lstrip_ids: frozenset[int] = frozenset()
        self._rstrip_ids: frozenset[int] = frozenset()
        self._word_cache: dict[str, tuple[int, ...]] = {}

    def _end_of_generation_ids(self, *ids: int | None) -> set[int]:
        """The ids that end generation, adjusting ``self._types`` as llama.cpp's loader does:
        a token whose text is an end-of-turn marker is a control token (so never matched in
        ordinary text, even when the file types it user-defined, e.g. Phi-3's ``</s>``);
        gpt-oss's channel markers are user-defined; ``<|end|>`` next to ``<|return|>`` and
        ``<|call|>`` (harmony) and ``</s>`` next to ``<|tool_response>`` (Gemma 4) are not
        end-of-generation markers but ordinary (user-defined, normal) tokens."""
        types, text_to_id = self._types, self._text_to_id
        eog: set[int] = set()
        for text in _EOG_TEXTS:
            token_id = text_to_id.get(text)
            if token_id is not None:
                eog.add(token_id)
                types[token_id] = TokenType.CONTROL
        for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
            token_id = text_to_id.get(text)
            if token_id is not None:
                types[token_id] = TokenType.USER_DEFINED
        eog.update(i for i in ids if i is not None)
        eog_texts = {self._id_to_text[i] for i in eog}
        end_id = text_to_id.get("<|end|>")
        has_call = bool(eog_texts & {"<|call|>", "<|calls|>"})
        if end_id in eog and has_call and eog_texts & {"<|return|>", "<|flush|>"}:
            eog.discard(end_id)
            types[end_id] = TokenType.USER_DEFINED
        s_id = text_to_id.get("</s>")
        if s_id in eog and eog_texts & {"<|tool_response>", "<|plamo:eos|>"}:
            eog.discard(s_id)
            types[s_id] = TokenType.NORMAL
        return eog

    def _set_strip_attributes(self, metadata: Mapping[str, Any]) -> None:
        """llama.cpp's per-model whitespace stripping around special tokens, decided by
        ``general.name`` / ``tokenizer.ggml.pre`` / ``general.architecture`` as its loader does:
        ``<mask>`` strips on its left for Jina v2 and nomic-bert-moe; Phi-3's special tokens
        strip on their right, except ``<unk>``, ``<s>`` and ``<|endoftext|>``."""
        name = str(metadata.get("general.name") or "").lower()
        pre = str(metadata.get("tokenizer.ggml.pre") or "")
        arch = str(metadata.get("general.architecture") or "")
        text_to_id = self._text_to_id
        if any(p in pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
            a in arch for a in ("nomic-bert-moe", "jina-bert-v3")
        ):
            mask = text_to_id.get("<mask>")
            self._lstrip_ids = frozenset(() if mask is None else (mask,))
        elif "phi-3" in name or "phi3" in name:
            keep = {text_to_id.get(t) for t in ("<unk>", "<s>", "<|endoftext|>")}
            self._rstrip_ids = frozenset(i for i in self._special_ids if i not in keep)
        elif "modern-bert" in name:
            mask = text_to_id.get("[MASK]")
            self._lstrip_ids = frozenset(() if mask is None else (mask,))

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_bpe_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build a byte-level BPE (``tokenizer.ggml.model = "gpt2"``) from GGUF key/values
        (``tokenizer.ggml.*``, ``tokenizer.chat_template``); any vocabulary kind:
        :func:`core_engine.tokenizer.gguf.tokenizer_from_gguf_metadata`."""
        tokens = metadata.get("tokenizer.ggml.tokens")
        merges = metadata.get("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise TokenizerError("GGUF lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")

        def token_id(key: str, default: int | None) -> int | None:
            return metadata_token_id(metadata, key, len(tokens), default)

        add_bos = metadata.get("tokenizer.ggml.add_bos_token")
        gemma4 = metadata.get("tokenizer.ggml.model") == "gemma4"
        # BPE defaults in llama.cpp: bos = eos = 11 unless the file says otherwise ("gemma4":
        # none, and its pre-tokenizer whatever tokenizer.ggml.pre says).
        default_id = 11 if len(tokens) > 11 and not gemma4 else None
        tokenizer = cls(
            tokens,
            merges,
            token_types=metadata.get("tokenizer.ggml.token_type"),
            pre=SPM_STYLE_PRE_TOKENIZER if gemma4 else metadata.get("tokenizer.ggml.pre"),
            bos_token_id=token_id("bos_token_id", default_id),
            eos_token_id=token_id("eos_token_id", default_id),
            eot_token_id=token_id("eot_token_id", None),
            eom_token_id=token_id("eom_token_id", None),
            pad_token_id=token_id("padding_token_id", None),
            add_bos=None if add_bos is None else bool(add_bos),
            add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
            chat_template=metadata.get("tokenizer.chat_template"),
        )
        tokenizer._set_strip_attributes(metadata)
        return tokenizer

    # --- vocabulary ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids."""
        return len(self._id_to_text)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry of ``token_id`` (byte-level spelling for normal tokens)."""
        return self._id_to_text[token_id]

    def token_to_id(self, text: str) -> int | None:
        """Id of the vocabulary entry ``text``, or ``None``."""
        return self._text_to_id.get(text)

    def token_type(self, token_id: int) -> TokenType:
        """Type of ``token_id`` (control tokens are not rendered by :meth:`decode` by default)."""
        return TokenType(self._types[token_id])

    def is_special(self, token_id: int) -> bool:
        """True for control and unknown tokens (hidden from output unless asked for)."""
        return self._types[token_id] in (TokenType.CONTROL, TokenType.UNKNOWN)

    def make_chat_template(self) -> ChatTemplate:
        """The file's chat template (ChatML when it has none) with its BOS/EOS token texts."""
        def text(token_id: int | None) -> str:
            return "" if token_id is None else self._id_to_text[token_id]

        return ChatTemplate(
            self.chat_template or FALLBACK_CHATML_TEMPLATE,
            bos_token=text(self.bos_token_id),
            eos_token=text(self.eos_token_id),
        )

    # --- encoding -----------------------------------------------------------------------------

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text``; equal to ``llama_tokenize(text, add_special, parse_special)``.

        ``add_special`` adds BOS/EOS where the model asks for them (``add_bos_token``);
        ``parse_special`` turns control-token texts such as ``<|im_start|>`` into their ids
        (use it for chat-templated prompts; leave it off for untrusted user text).
        User-defined tokens are always matched whole, as in llama.cpp.
        """
        ids: list[int] = []
        if add_special and self.add_bos and self.bos_token_id is not None:
            ids.append(self.bos_token_id)
        for fragment in self._split_special(text, parse_special):
            if isinstance(fragment, int):
                ids.append(fragment)
            else:
                ids.extend(self._encode_ordinary(fragment))
        if add_special and self.add_eos and self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        return ids

    def _split_special(self, text: str, parse_special: bool) -> list[str | int]:
        fragments: list[str | int] = [text] if text else []
        for token_id in self._special_ids:
            if not parse_special and self._types[token_id] != TokenType.USER_DEFINED:
                continue
            special = self._id_to_text[token_id]
            if not any(isinstance(f, str) and special in f for f in fragments):
                continue
            split: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, int) or special not in fragment:
                    split.append(fragment)
                    continue
                parts = fragment.split(special)
                lstrip, rstrip = token_id in self._lstrip_ids, token_id in self._rstrip_ids
                for k, part in enumerate(parts):
                    if k:
                        split.append(token_id)
                        if rstrip:  # llama.cpp's LSTRIP/RSTRIP attributes: C isspace()
                            part = part.lstrip(_C_SPACE)
                    if lstrip and k < len(parts) - 1:
                        part = part.rstrip(_C_SPACE)
                    if part:
                        split.append(part)
            fragments = split
        return fragments

    def _encode_ordinary(self, text: str) -> list[int]:
        ids: list[int] = []
        cache = self._word_cache
        if self._spm_style:
            text = text.replace(" ", _SPACE)
        for word in self._pre_tokenizer.split(text):
            cached = cache.get(word)
            if cached is None:
                if len(cache) >= _MAX_CACHED_WORDS:
                    cache.clear()
                cached = cache[word] = tuple(self._encode_word(word if self._spm_style else encode_bytes(word)))
            ids.extend(cached)
        return ids

    def _encode_word(self, word: str) -> list[int]:
        """BPE over one pre-tokenized word already spelled in the byte-level alphabet."""
        if self._ignore_merges or (self._spm_style and not word.strip("\n")):
            # Gemma 4: a run of newlines is one token where the vocabulary has it (llama.cpp).
            whole = self._text_to_id.get(word)
            if whole is not None:
                return [whole]
        symbols: list[str] = list(word)
        ranks = self._ranks
        if len(symbols) > 1:
            # Linked list + heap of (rank, left index): merges the lowest-rank adjacent pair,
            # leftmost on ties, skipping entries made stale by earlier merges (llama.cpp's order).
            nxt = [*range(1, len(symbols)), -1]
            prv = list(range(-1, len(symbols) - 1))
            heap = [
                (rank, i, i + 1, symbols[i] + symbols[i + 1])
                for i in range(len(symbols) - 1)
                if (rank := ranks.get((symbols[i], symbols[i + 1]))) is not None
            ]
            heapq.heapify(heap)
            while heap:
                _, left, right, merged = heapq.heappop(heap)
                # Stale when either side was merged since the pair was queued.
                if (
                    nxt[left] != right
                    or not symbols[left]
                    or not symbols[right]
                    or symbols[left] + symbols[right] != merged
                ):
                    continue
                symbols[left] = merged
                symbols[right] = ""
                nxt[left] = nxt[right]
                if nxt[right] != -1:
                    prv[nxt[right]] = left
                for a, b in ((prv[left], left), (left, nxt[left])):
                    if a != -1 and b != -1:
                        rank = ranks.get((symbols[a], symbols[b]))
                        if rank is not None:
                            heapq.heappush(heap, (rank, a, b, symbols[a] + symbols[b]))
        ids: list[int] = []
        for symbol in symbols:
            if not symbol:
                continue
            token_id = self._text_to_id.get(symbol)
            if token_id is not None:
                ids.append(token_id)
                continue
            # Not in the vocabulary: llama.cpp falls back to single-byte entries that exist
            # ("<0xXX>" ones for Gemma 4; else the raw byte as text, only ASCII can match).
            for byte in symbol.encode("utf-8"):
                if self._spm_style:
                    byte_id = self._text_to_id.get(f"<0x{byte:02X}>")
                else:
                    byte_id = self._text_to_id.get(chr(byte)) if byte < 0x80 else None
                if byte_id is not None:
                    ids.append(byte_id)
        return ids

    # --- decoding -----------------------------------------------------------------------------

    def _piece(self, token_id: int) -> bytes:
        token_type = self._types[token_id]
        text = self._id_to_text[token_id]
        if token_type == TokenType.NORMAL:
            return text.replace(_SPACE, " ").encode("utf-8") if self._spm_style else decode_token_text(text)
        if token_type in (TokenType.USER_DEFINED, TokenType.CONTROL, TokenType.UNKNOWN):
            return text.encode("utf-8")
        if token_type == TokenType.BYTE:  # SentencePiece-style "<0xXX>" byte fallback entry
            return byte_fallback_piece(text)
        return b""  # unused/undefined entries render as nothing in llama.cpp

    def token_to_bytes(self, token_id: int, *, skip_special: bool = True) -> bytes:
        """Bytes ``token_id`` stands for (may be part of a UTF-8 character)."""
        if skip_special and self.is_special(token_id):
            return b""
        return self._pieces[token_id]

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 (a character cut at the end) becomes U+FFFD."""
        data = b"".join(self.token_to_bytes(i, skip_special=skip_special) for i in ids)
        return data.decode("utf-8", errors="replace")
