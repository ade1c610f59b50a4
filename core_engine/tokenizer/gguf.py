"""The tokenizer of a GGUF file, by its ``tokenizer.ggml.model``: byte-level BPE (``gpt2``),
SentencePiece (``llama``: Llama 2, Mistral, Gemma) or SentencePiece unigram (``t5``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core_engine.tokenizer.bpe import Tokenizer, TokenizerError
from core_engine.tokenizer.spm import SentencePieceTokenizer
from core_engine.tokenizer.unigram import UnigramTokenizer

__all__ = ["tokenizer_from_gguf_metadata"]


def tokenizer_from_gguf_metadata(metadata: Mapping[str, Any]) -> Tokenizer:
    """Build from GGUF key/values; ``TokenizerError`` for a vocabulary kind not supported."""
    model = metadata.get("tokenizer.ggml.model")
    if model == "llama":
        return SentencePieceTokenizer.from_spm_metadata(metadata)
    if model == "t5":
        return UnigramTokenizer.from_ugm_metadata(metadata)
    if model != "gpt2":
        raise TokenizerError(
            f"tokenizer.ggml.model = {model!r} is not supported "
            "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece, 't5' SentencePiece unigram)"
        )
    return Tokenizer.from_bpe_metadata(metadata)
