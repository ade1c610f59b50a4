"""The tokenizer of a GGUF file, by its ``tokenizer.ggml.model``: byte-level BPE (``gpt2``),
SentencePiece-style BPE (``gemma4``), SentencePiece (``llama``: Llama 2, Mistral, Gemma) or
SentencePiece unigram (``t5``); others (``bert`` WordPiece, ``rwkv``, ``plamo2``...) are refused
by name.

:func:`read_gguf_metadata` reads only a file's key/values (core_engine/gguf_reader.py), many
times faster than ``gguf.GGUFReader`` on vocabularies of 100k+ tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from core_engine import gguf_reader
from core_engine.tokenizer.bpe import Tokenizer, TokenizerError
from core_engine.tokenizer.spm import SentencePieceTokenizer
from core_engine.tokenizer.unigram import UnigramTokenizer

__all__ = ["SUPPORTED_TOKENIZER_MODELS", "read_gguf_metadata", "tokenizer_from_gguf_metadata"]

#: ``tokenizer.ggml.model`` values this engine tokenizes (others are refused by name).
SUPPORTED_TOKENIZER_MODELS: dict[str, str] = {
    "gpt2": "byte-level BPE",
    "gemma4": "SentencePiece-style BPE",
    "llama": "SentencePiece",
    "t5": "SentencePiece unigram",
}


def tokenizer_from_gguf_metadata(metadata: Mapping[str, Any]) -> Tokenizer:
    """Build from GGUF key/values; ``TokenizerError`` naming the kind for a vocabulary kind
    (``tokenizer.ggml.model``) or pre-tokenizer (``tokenizer.ggml.pre``) not supported."""
    model = metadata.get("tokenizer.ggml.model")
    if model == "llama":
        return SentencePieceTokenizer.from_spm_metadata(metadata)
    if model == "t5":
        return UnigramTokenizer.from_ugm_metadata(metadata)
    if model not in ("gpt2", "gemma4"):
        supported = ", ".join(f"{name!r} {kind}" for name, kind in SUPPORTED_TOKENIZER_MODELS.items())
        raise TokenizerError(f"tokenizer.ggml.model = {model!r} is not supported (supported: {supported})")
    return Tokenizer.from_bpe_metadata(metadata)


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All key/values of a GGUF file (core_engine/gguf_reader.py); ``TokenizerError`` for a
    file that is not GGUF or whose header is malformed."""
    try:
        return gguf_reader.read_gguf_metadata(path)
    except ValueError as exc:
        raise TokenizerError(str(exc)) from exc
