"""The tokenizer of a GGUF file, by its ``tokenizer.ggml.model``: byte-level BPE (``gpt2``),
SentencePiece-style BPE (``gemma4``), SentencePiece (``llama``: Llama 2, Mistral, Gemma) or
SentencePiece unigram (``t5``); others (``bert`` WordPiece, ``rwkv``, ``plamo2``...) are refused
by name.

:func:`read_gguf_metadata` reads only a file's key/values (no tensor records), a few times
faster than ``gguf.GGUFReader`` on vocabularies of 100k+ tokens.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

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


# GGUF value types: numpy dtype (little-endian) of the scalar ones; 8 = string, 9 = array.
_DTYPES = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8",
}
_STRING, _ARRAY, _BOOL = 8, 9, 7


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All key/values of a GGUF file (version 2 or 3) as Python values: strings, numbers,
    bools and lists, as ``gguf.GGUFReader``'s ``field.contents()`` gives them."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise TokenizerError(f"{path}: not a GGUF file")
        version, _n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise TokenizerError(f"{path}: GGUF version {version} is not supported")
        pos = 24

        def string() -> str:
            nonlocal pos
            (size,) = struct.unpack_from("<Q", buf, pos)
            pos += 8 + size
            return buf[pos - size : pos].decode("utf-8")

        def value(kind: int) -> Any:
            nonlocal pos
            if kind == _STRING:
                return string()
            if kind == _ARRAY:
                item_kind, count = struct.unpack_from("<IQ", buf, pos)
                pos += 12
                if item_kind in _DTYPES:
                    dtype = np.dtype(_DTYPES[item_kind])
                    items = np.frombuffer(buf, dtype, count, pos)
                    pos += dtype.itemsize * count
                    return [bool(x) for x in items] if item_kind == _BOOL else items.tolist()
                return [value(item_kind) for _ in range(count)]
            dtype = np.dtype(_DTYPES[kind])
            scalar = np.frombuffer(buf, dtype, 1, pos)[0].item()
            pos += dtype.itemsize
            return bool(scalar) if kind == _BOOL else scalar

        metadata: dict[str, Any] = {}
        try:
            for _ in range(n_kv):
                key = string()
                (kind,) = struct.unpack_from("<I", buf, pos)
                pos += 4
                metadata[key] = value(kind)
        except (KeyError, struct.error, ValueError) as exc:
            raise TokenizerError(f"{path}: malformed GGUF metadata at byte {pos}: {exc}") from exc
        return metadata
