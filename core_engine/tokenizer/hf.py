"""The tokenizer of a Hugging Face checkpoint directory, through the ``tokenizers`` library.

``tokenizer.json`` holds the model (BPE, unigram...), its pre-tokenizer, normalizer and the
post-processor that adds BOS/EOS; ``tokenizer_config.json`` the chat template and the special
tokens' texts; ``generation_config.json`` the end-of-generation ids. :class:`HFTokenizer`
offers what the engine asks of :class:`~core_engine.tokenizer.bpe.Tokenizer` (encode, bytes of
a token for streaming, stop ids, the chat template).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from core_engine.chat.template import FALLBACK_CHATML_TEMPLATE, ChatTemplate
from core_engine.tokenizer.bpe import TokenizerError, TokenType
from core_engine.tokenizer.byte_level import decode_token_text
from core_engine.tokenizer.end_of_generation import END_OF_GENERATION_TEXTS

__all__ = ["HFTokenizer"]


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{path}: not readable JSON ({exc})") from exc


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """Text <-> ids for a checkpoint directory's ``tokenizer.json``."""

    def __init__(self, directory: str | Path) -> None:
        from tokenizers import Tokenizer as _Tokenizers

        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{directory}: no tokenizer.json (the engine reads Hugging Face tokenizers from it)")
        try:
            self._tok = _Tokenizers.from_file(str(path))
        except Exception as exc:  # the library's own errors name the problem
            raise TokenizerError(f"{path}: {exc}") from exc
        settings = _json(directory / "tokenizer_config.json")
        generation = _json(directory / "generation_config.json")
        model = json.loads(self._tok.to_str()).get("decoder") or {}
        self._byte_level = model.get("type") == "ByteLevel" or any(
            d.get("type") == "ByteLevel" for d in model.get("decoders", []) if isinstance(d, dict)
        )
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        added = self._tok.get_added_tokens_decoder()
        self._special = {i for i, t in added.items() if t.special}
        self._user_defined = {i for i, t in added.items() if not t.special}

        def token_id(text: str | None) -> int | None:
            return None if text is None else self._tok.token_to_id(text)

        self.bos_token_id = token_id(_token_text(settings.get("bos_token")))
        self.eos_token_id = token_id(_token_text(settings.get("eos_token")))
        self.pad_token_id = token_id(_token_text(settings.get("pad_token")))
        eos = generation.get("eos_token_id", self.eos_token_id)
        stop = set(eos if isinstance(eos, list) else [eos]) - {None}
        if self.eos_token_id is None and stop:
            self.eos_token_id = min(stop)
        for text in END_OF_GENERATION_TEXTS:  # end-of-turn markers stop generation, as for GGUF vocabularies
            token_id_ = self._tok.token_to_id(text)
            if token_id_ is not None and token_id_ in self._special:
                stop.add(token_id_)
        self.stop_token_ids: frozenset[int] = frozenset(int(i) for i in stop)
        self.chat_template: str | None = settings.get("chat_template")
        self._pieces: dict[int, bytes] = {}

    # --- vocabulary ---------------------------------------------------------------------------

    def id_to_token(self, token_id: int) -> str:
        text = self._tok.id_to_token(token_id)
        if text is None:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary")
        return text

    def token_to_id(self, text: str) -> int | None:
        return self._tok.token_to_id(text)

    def token_type(self, token_id: int) -> TokenType:
        if token_id in self._special:
            return TokenType.CONTROL
        if token_id in self._user_defined:
            return TokenType.USER_DEFINED
        return TokenType.NORMAL

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special

    def make_chat_template(self) -> ChatTemplate:
        def text(token_id: int | None) -> str:
            return "" if token_id is None else self.id_to_token(token_id)

        return ChatTemplate(
            self.chat_template or FALLBACK_CHATML_TEMPLATE, bos_token=text(self.bos_token_id), eos_token=text(self.eos_token_id)
        )

    # --- encoding -----------------------------------------------------------------------------

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text``: equal to ``tokenizers``' ``encode(text, add_special_tokens=
        add_special)``; special-token texts become their ids only with ``parse_special``
        (chat-templated prompts), else they are tokenized as text (untrusted user input)."""
        self._tok.encode_special_tokens = not parse_special
        return self._tok.encode(text, add_special_tokens=add_special).ids

    # --- decoding -----------------------------------------------------------------------------

    def _piece(self, token_id: int) -> bytes:
        text = self.id_to_token(token_id)
        if token_id in self._special or token_id in self._user_defined:
            return text.encode("utf-8")
        if self._byte_level:
            return decode_token_text(text)
        if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):  # SentencePiece byte fallback
            try:
                return bytes([int(text[3:5], 16)])
            except ValueError:
                pass
        return text.replace("\u2581", " ").encode("utf-8")  # SentencePiece's word boundary

    def token_to_bytes(self, token_id: int, *, skip_special: bool = True) -> bytes:
        """Bytes ``token_id`` stands for (may be part of a UTF-8 character)."""
        if skip_special and self.is_special(token_id):
            return b""
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self._piece(token_id)
        return piece

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        data = b"".join(self.token_to_bytes(i, skip_special=skip_special) for i in ids)
        return data.decode("utf-8", errors="replace")
