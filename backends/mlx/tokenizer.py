"""The MLX backend's tokenizers, built from GGUF metadata or a model directory.

For a GGUF file with a byte-level BPE vocabulary (``tokenizer.ggml.model == "gpt2"``, as
SmolLM2, Llama 3 and Qwen use) the core engine's llama.cpp-compatible tokenizer is built from
the metadata in a fraction of a second. Other GGUF vocabularies (SentencePiece) go through
``transformers``, which converts the file's vocabulary into a fast tokenizer offline. For an
MLX/Hugging Face directory, mlx-lm's loader provides the Hugging Face tokenizer.

The backend needs only what :class:`MLXTokenizer` offers: encoding with special-token texts
recognised (as llama.cpp does with ``special=True``) or read as text (a chat's content,
:mod:`core_engine.chat.content_text`), the texts that differ between the two, streaming
decoding that never splits a UTF-8 character, each token's bytes for logprobs, and the
end-of-generation ids.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from core_engine.chat.formats import SPECIAL_MARKERS
from core_engine.tokenizer.byte_level import CHAR_TO_BYTE
from core_engine.tokenizer.end_of_generation import END_OF_GENERATION_TEXTS

__all__ = [
    "GGUFBPETokenizer",
    "HFTokenizer",
    "IncrementalDecoder",
    "MLXTokenizer",
    "TextStream",
    "load_gguf_tokenizer",
]

logger = logging.getLogger(__name__)

#: Texts of control tokens that end a turn (the list the core engine's tokenizers use too).
_END_OF_TURN_TEXTS = END_OF_GENERATION_TEXTS


class TextStream(Protocol):
    """Text deltas of a growing output (see :meth:`MLXTokenizer.text_stream`)."""

    def add(self, token_id: int) -> str:
        """Append one token; return the text that is now complete (possibly empty)."""
        ...

    def flush(self) -> str:
        """End of output: whatever is held (an unfinished character becomes U+FFFD)."""
        ...


class MLXTokenizer:
    """Encoding, decoding and special tokens of one model (the interface the runner uses)."""

    #: Ids that end the output unless the request sets ``ignore_eos``.
    eos_token_ids: frozenset[int]
    #: Whether prompts start with BOS (unless the chat template writes it).
    add_bos: bool
    bos_token_id: int | None
    bos_text: str
    eos_text: str
    #: The model's Jinja chat template, or None.
    chat_template: str | None

    def encode(self, text: str, *, add_bos: bool, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``; special-token texts in it become their ids unless
        ``parse_special`` is off."""
        raise NotImplementedError

    def control_texts(self) -> list[str]:
        """The texts :meth:`encode` makes into tokens only with ``parse_special``."""
        raise NotImplementedError

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` without special tokens."""
        raise NotImplementedError

    def text_stream(self, prompt_ids: Sequence[int]) -> TextStream:
        """A streaming decoder for output that follows ``prompt_ids``."""
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a special token: its text)."""
        raise NotImplementedError


class HFTokenizer(MLXTokenizer):
    """A Hugging Face fast tokenizer."""

    def __init__(
        self,
        hf_tokenizer: Any,
        *,
        eos_token_ids: Iterable[int],
        add_bos: bool,
        chat_template: str | None,
    ) -> None:
        self.hf = hf_tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.add_bos = add_bos
        self.chat_template = chat_template if isinstance(chat_template, str) else None
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.bos_text: str = hf_tokenizer.bos_token or ""
        self.eos_text: str = hf_tokenizer.eos_token or ""
        self._special_ids = frozenset(hf_tokenizer.all_special_ids) | frozenset(
            hf_tokenizer.added_tokens_decoder
        )
        self._byte_level = _is_byte_level(hf_tokenizer)
        self._pieces: dict[int, bytes] = {}
        # Special tokens that are tool-call / reasoning markers stay in the text (the output
        # parsers read them), unless they end generation.
        self._markers: dict[int, str] = {}
        for token_id in self._special_ids - self.eos_token_ids:
            text = hf_tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(text, str) and text in SPECIAL_MARKERS:
                self._markers[token_id] = text

    @classmethod
    def from_mlx_lm(cls, wrapper: Any) -> HFTokenizer:
        """Wrap the ``TokenizerWrapper`` that ``mlx_lm.load`` returns for a directory."""
        hf = wrapper._tokenizer
        probe = hf.encode("a", add_special_tokens=True)
        add_bos = hf.bos_token_id is not None and probe[:1] == [hf.bos_token_id]
        eos = set(wrapper.eos_token_ids or ())
        if hf.eos_token_id is not None:
            eos.add(hf.eos_token_id)
        return cls(hf, eos_token_ids=eos, add_bos=add_bos, chat_template=hf.chat_template)

    def encode(self, text: str, *, add_bos: bool, parse_special: bool = True) -> list[int]:
        ids: list[int] = self.hf.encode(text, add_special_tokens=False, split_special_tokens=not parse_special)
        if add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def control_texts(self) -> list[str]:
        # ``split_special_tokens`` reads the added tokens marked special as text, not the others.
        return [t.content for t in self.hf.added_tokens_decoder.values() if t.special]

    def decode(self, token_ids: Sequence[int]) -> str:
        ids = list(token_ids)
        if not self._markers or not any(i in self._markers for i in ids):
            return self._decode(ids)
        parts: list[str] = []
        run: list[int] = []
        for token_id in ids:
            marker = self._markers.get(token_id)
            if marker is None:
                run.append(token_id)
                continue
            parts += [self._decode(run), marker]
            run = []
        parts.append(self._decode(run))
        return "".join(parts)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        text: str = self.hf.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return text

    def text_stream(self, prompt_ids: Sequence[int]) -> TextStream:
        return IncrementalDecoder(self, prompt_ids)

    def token_bytes(self, token_id: int) -> bytes:
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._piece(token_id)
            self._pieces[token_id] = piece
        return piece

    def _piece(self, token_id: int) -> bytes:
        if token_id in self._special_ids:
            return str(self.hf.convert_ids_to_tokens(token_id) or "").encode("utf-8")
        if self._byte_level:
            text = self.hf.convert_ids_to_tokens(token_id)
            if text is None:
                return b""
            if all(ch in CHAR_TO_BYTE for ch in text):
                return bytes(CHAR_TO_BYTE[ch] for ch in text)
        # Other vocabularies: the token's own decoded text (a lone partial byte shows as U+FFFD).
        return self.decode([token_id]).encode("utf-8")


class GGUFBPETokenizer(MLXTokenizer):
    """The core engine's byte-level BPE tokenizer (llama.cpp's tokenization) from GGUF metadata."""

    def __init__(self, core: Any, *, eos_token_ids: Iterable[int]) -> None:
        self.core = core
        self.eos_token_ids = frozenset(eos_token_ids) | core.stop_token_ids
        self.add_bos = bool(core.add_bos)
        self.chat_template = core.chat_template if isinstance(core.chat_template, str) else None
        self.bos_token_id = core.bos_token_id
        self.bos_text = self._special_text(core.bos_token_id)
        self.eos_text = self._special_text(core.eos_token_id)

    def _special_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self.core.token_to_bytes(token_id, skip_special=False).decode("utf-8", "replace")

    def encode(self, text: str, *, add_bos: bool, parse_special: bool = True) -> list[int]:
        ids: list[int] = self.core.encode(text, add_special=False, parse_special=parse_special)
        if add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def control_texts(self) -> list[str]:
        core = self.core
        return [core.id_to_token(i) for i in range(core.vocab_size) if core.is_special(i)]

    def decode(self, token_ids: Sequence[int]) -> str:
        text: str = self.core.decode(token_ids, skip_special=True)
        return text

    def text_stream(self, prompt_ids: Sequence[int]) -> TextStream:
        from core_engine.tokenizer import IncrementalDetokenizer

        stream: TextStream = IncrementalDetokenizer(self.core, skip_special=True)
        return stream

    def token_bytes(self, token_id: int) -> bytes:
        piece: bytes = self.core.token_to_bytes(token_id, skip_special=False)
        return piece


def load_gguf_tokenizer(path: Path, metadata: Mapping[str, Any]) -> MLXTokenizer:
    """The tokenizer stored in a GGUF file's metadata (``tokenizer.ggml.*``)."""
    eos = _gguf_end_of_generation_ids(metadata)
    if metadata.get("tokenizer.ggml.model") == "gpt2":
        from core_engine.tokenizer import (
            TokenizerError,
            UnsupportedPreTokenizerError,
            tokenizer_from_gguf_metadata,
        )

        try:
            return GGUFBPETokenizer(tokenizer_from_gguf_metadata(metadata), eos_token_ids=eos)
        except (TokenizerError, UnsupportedPreTokenizerError) as exc:
            logger.info("%s: the core tokenizer cannot build this vocabulary (%s)", path.name, exc)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    add_bos = metadata.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:  # llama.cpp's default: SentencePiece vocabularies add BOS
        add_bos = metadata.get("tokenizer.ggml.model") == "llama"
    return HFTokenizer(
        hf,
        eos_token_ids=eos,
        add_bos=bool(add_bos),
        chat_template=metadata.get("tokenizer.chat_template"),
    )


def _gguf_end_of_generation_ids(metadata: Mapping[str, Any]) -> set[int]:
    tokens: Sequence[str] = metadata.get("tokenizer.ggml.tokens") or []
    types: Sequence[int] = metadata.get("tokenizer.ggml.token_type") or []
    eos = {
        int(metadata[key])
        for key in (
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        )
        if metadata.get(key) is not None
    }
    control = 3  # GGUF token type CONTROL
    eos |= {
        i
        for i, text in enumerate(tokens)
        if text in _END_OF_TURN_TEXTS and i < len(types) and types[i] == control
    }
    return eos


class IncrementalDecoder:
    """Text deltas of a growing token sequence that never end inside a UTF-8 character.

    Decodes a short window of recent tokens and emits what it adds to the text of the window
    without the newest tokens (how vLLM and TGI detokenize), so tokenizers whose decoding
    depends on neighbours (SentencePiece spaces, byte fallback) come out right.
    """

    def __init__(self, tokenizer: HFTokenizer, prompt_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        # A few prompt tokens give the first output token its left context (leading spaces).
        self._ids: list[int] = list(prompt_ids[-4:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, token_id: int) -> str:
        """Append one token; return the text that is now complete (possibly empty)."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """End of output: whatever is held (an unfinished character becomes U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) and not final:
            return ""
        if new_text.endswith("\ufffd") and not final:
            return ""  # the last token ends inside a character: wait for its other bytes
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta


def _is_byte_level(hf_tokenizer: Any) -> bool:
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except (ValueError, AttributeError):
        return False
    return decoder.get("type") == "ByteLevel"
