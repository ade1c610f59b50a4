"""Tokenizers built from GGUF metadata (byte-level BPE) and streaming detokenization."""

from __future__ import annotations

from core_engine.tokenizer.bpe import Tokenizer, TokenizerError, TokenType
from core_engine.tokenizer.detokenizer import IncrementalDetokenizer
from core_engine.tokenizer.gguf import tokenizer_from_gguf_metadata
from core_engine.tokenizer.pre_tokenizer import UnsupportedPreTokenizerError

__all__ = [
    "IncrementalDetokenizer",
    "TokenType",
    "Tokenizer",
    "TokenizerError",
    "UnsupportedPreTokenizerError",
    "tokenizer_from_gguf_metadata",
]
