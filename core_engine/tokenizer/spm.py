"""SentencePiece vocabularies stored in GGUF (``tokenizer.ggml.model = "llama"``: Llama 2,
Mistral, Gemma and their fine-tunes), tokenized as llama.cpp does.

The pieces, scores and types of the file become a SentencePiece ``ModelProto`` (BPE, byte
fallback where the vocabulary has byte pieces, no normalisation) and the ``sentencepiece``
library segments each run of ordinary text. Around it, what llama.cpp adds: special-token
texts are split out first (user-defined ones always, control ones only with
``parse_special``; :class:`~core_engine.tokenizer.bpe.Tokenizer`'s rules), and a run of text
that starts the input or follows a special token gets a leading space
(``tokenizer.ggml.add_space_prefix``, default on) before spaces become ``▁``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from core_engine.tokenizer.bpe import (
    Tokenizer,
    TokenizerError,
    TokenType,
    byte_fallback_piece,
    metadata_token_id,
)

__all__ = ["SentencePieceTokenizer"]

_SPACE = "\u2581"  # SentencePiece's visible space


class SentencePieceTokenizer(Tokenizer):
    """Text <-> ids for a GGUF SentencePiece vocabulary (see the module docstring)."""

    def __init__(
        self,
        tokens: Sequence[str],
        scores: Sequence[float],
        *,
        token_types: Sequence[int] | None = None,
        add_space_prefix: bool = True,
        unknown_token_id: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(tokens, [], token_types=token_types, **kwargs)
        if len(scores) != len(tokens):
            raise TokenizerError(f"{len(scores)} token scores for {len(tokens)} tokens")
        if unknown_token_id is not None and not 0 <= unknown_token_id < len(tokens):
            raise TokenizerError(f"unknown_token_id {unknown_token_id} is outside the vocabulary")
        self.add_space_prefix = add_space_prefix
        if unknown_token_id is None:  # the first piece typed unknown, if any
            unknown_token_id = next((i for i, t in enumerate(self._types) if t == TokenType.UNKNOWN), None)
        self.unknown_token_id = unknown_token_id
        self._load_segmenter(scores)

    def _load_segmenter(self, scores: Sequence[float]) -> None:
        """Build what :meth:`_encode_text` segments with (here a ``sentencepiece`` BPE model)."""
        import sentencepiece
        from sentencepiece import sentencepiece_model_pb2

        proto = sentencepiece_model_pb2.ModelProto()
        proto.trainer_spec.model_type = sentencepiece_model_pb2.TrainerSpec.BPE
        proto.trainer_spec.byte_fallback = any(t == TokenType.BYTE for t in self._types)
        proto.normalizer_spec.name = "identity"
        proto.normalizer_spec.add_dummy_prefix = False  # the prefix is added here, per fragment
        proto.normalizer_spec.remove_extra_whitespaces = False
        proto.normalizer_spec.escape_whitespaces = True
        kinds = sentencepiece_model_pb2.ModelProto.SentencePiece
        if self.unknown_token_id is None:
            raise TokenizerError("SentencePiece vocabulary has no unknown token")
        for i, (text, score) in enumerate(zip(self._id_to_text, scores, strict=True)):
            piece = proto.pieces.add()
            piece.piece = text
            piece.score = float(score)
            token_type = self._types[i]
            # The unknown piece is the one tokenizer.ggml.unknown_token_id names, whatever its
            # type (converters write Phi-3's <unk> as a control token and its [PAD…] pieces as
            # unknown ones): sentencepiece wants exactly one. Special texts never reach the
            # segmenter (split out before): keep them out of it.
            piece.type = kinds.UNKNOWN if i == self.unknown_token_id else {
                TokenType.UNKNOWN: kinds.CONTROL, TokenType.CONTROL: kinds.CONTROL, TokenType.BYTE: kinds.BYTE,
                TokenType.USER_DEFINED: kinds.CONTROL, TokenType.UNUSED: kinds.UNUSED,
            }.get(TokenType(token_type), kinds.NORMAL)
        self._processor = sentencepiece.SentencePieceProcessor()
        try:
            self._processor.LoadFromSerializedProto(proto.SerializeToString())
        except RuntimeError as exc:
            raise TokenizerError(f"SentencePiece vocabulary rejected: {exc}") from exc

    @staticmethod
    def scored_vocabulary(
        metadata: Mapping[str, Any],
    ) -> tuple[list[str], list[float], Callable[[str, int | None], int | None]]:
        """The GGUF's pieces and scores, and a reader of its ``tokenizer.ggml.*_token_id`` keys
        (``token_id(key, default)``, llama.cpp's default for a missing or out-of-range id)."""
        tokens = metadata.get("tokenizer.ggml.tokens")
        scores = metadata.get("tokenizer.ggml.scores")
        if not tokens or scores is None:
            raise TokenizerError("GGUF lacks tokenizer.ggml.tokens or tokenizer.ggml.scores")

        def token_id(key: str, default: int | None) -> int | None:
            return metadata_token_id(metadata, key, len(tokens), default)

        return tokens, scores, token_id

    @classmethod
    def from_spm_metadata(cls, metadata: Mapping[str, Any]) -> SentencePieceTokenizer:
        tokens, scores, token_id = cls.scored_vocabulary(metadata)
        add_bos = metadata.get("tokenizer.ggml.add_bos_token")
        tokenizer = cls(
            tokens,
            scores,
            token_types=metadata.get("tokenizer.ggml.token_type"),
            # SPM defaults in llama.cpp: unk 0, bos 1, eos 2, BOS added.
            unknown_token_id=token_id("unknown_token_id", 0),
            bos_token_id=token_id("bos_token_id", 1),
            eos_token_id=token_id("eos_token_id", 2),
            eot_token_id=token_id("eot_token_id", None),
            eom_token_id=token_id("eom_token_id", None),
            pad_token_id=token_id("padding_token_id", None),
            add_bos=True if add_bos is None else bool(add_bos),
            add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
            add_space_prefix=bool(metadata.get("tokenizer.ggml.add_space_prefix", True)),
            chat_template=metadata.get("tokenizer.chat_template"),
        )
        tokenizer._set_strip_attributes(metadata)
        return tokenizer

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text``; equal to llama.cpp's ``llama_tokenize(text, add_special,
        parse_special)`` on the same file."""
        ids: list[int] = []
        if add_special and self.add_bos and self.bos_token_id is not None:
            ids.append(self.bos_token_id)
        # Fragments alternate: every run of text starts the input or follows a special token.
        for fragment in self._split_special(text, parse_special):
            if isinstance(fragment, int):
                ids.append(fragment)
            else:
                ids.extend(self._encode_text(fragment))
        if add_special and self.add_eos and self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        return ids

    def _encode_text(self, text: str) -> list[int]:
        """Ids of one run of ordinary text (no special-token texts in it)."""
        return self._processor.EncodeAsIds((" " if self.add_space_prefix else "") + text)

    def _piece(self, token_id: int) -> bytes:
        token_type = self._types[token_id]
        text = self._id_to_text[token_id]
        if token_type == TokenType.NORMAL:
            return text.replace(_SPACE, " ").encode("utf-8")
        if token_type == TokenType.BYTE:
            return byte_fallback_piece(text)
        if token_type in (TokenType.USER_DEFINED, TokenType.CONTROL, TokenType.UNKNOWN):
            return text.encode("utf-8")
        return b""
