"""SentencePiece unigram vocabularies stored in GGUF (``tokenizer.ggml.model = "t5"``: T5, mT5,
Flan-T5 and others), tokenized as llama.cpp's UGM tokenizer does.

A run of ordinary text goes through three steps, each as llama.cpp does it:

1. the file's ``tokenizer.ggml.precompiled_charsmap`` (the SentencePiece normaliser's rules,
   e.g. NFKC) is applied by ``sentencepiece``'s own normaliser, whitespace flags off;
2. spaces become ``▁``: with ``tokenizer.ggml.remove_extra_whitespaces`` every word gets one
   ``▁`` in front and other spaces go; without it each space is a ``▁`` and
   ``tokenizer.ggml.add_space_prefix`` puts one more before the first word;
3. the best segmentation by the sum of piece scores (Viterbi), a code point no piece covers
   scoring ``min score - 10`` as the unknown token, unknowns in a row fused into one.

Step 3 is the ``tokenizers`` library's ``Unigram`` model, not ``sentencepiece``'s: both search
the same lattice, but ``sentencepiece`` adds scores in float32 and llama.cpp (like
``tokenizers``) in float64, so near-ties such as ``🎉`` + ``🎉🎉`` against ``🎉🎉`` + ``🎉`` went
the other way on the test corpus. Only normal, user-defined (score 0) and unused pieces can be
matched there, as in llama.cpp; the others get a text with an ASCII space, which step 2 never
leaves in the text. Pieces scoring below every normal piece (the converter's -1000 padding and
added tokens) are left out too, so that the unknown score stays llama.cpp's; llama.cpp would
choose one only where every other path scores worse still (not seen in the tests). Special tokens are split out first as for the BPE SentencePiece files
(:class:`~core_engine.tokenizer.spm.SentencePieceTokenizer`), and decoding is the same.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from core_engine.tokenizer.bpe import TokenizerError, TokenType
from core_engine.tokenizer.spm import SentencePieceTokenizer

__all__ = ["UnigramTokenizer"]

_SPACE = "\u2581"  # SentencePiece's visible space
_UNKNOWN_PENALTY = 10.0  # llama.cpp and sentencepiece: unknown score = lowest normal score - 10
_MATCHABLE = (TokenType.NORMAL, TokenType.USER_DEFINED, TokenType.UNUSED)


class UnigramTokenizer(SentencePieceTokenizer):
    """Text <-> ids for a GGUF unigram vocabulary (see the module docstring)."""

    def __init__(
        self,
        tokens: Sequence[str],
        scores: Sequence[float],
        *,
        unknown_token_id: int,
        precompiled_charsmap: bytes = b"",
        remove_extra_whitespaces: bool = False,
        token_types: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> None:
        if not 0 <= unknown_token_id < len(tokens):
            raise TokenizerError(f"unknown_token_id {unknown_token_id} is outside the vocabulary")
        self.unknown_token_id = unknown_token_id
        self.remove_extra_whitespaces = remove_extra_whitespaces
        self._charsmap = precompiled_charsmap
        # llama.cpp builds its matcher before it turns end-of-turn texts into control tokens:
        # a user-defined <|im_end|> stays matchable, and unnormalised, in ordinary text.
        self._file_types = list(token_types) if token_types is not None else [TokenType.NORMAL] * len(tokens)
        super().__init__(tokens, scores, token_types=token_types, unknown_token_id=unknown_token_id, **kwargs)

    @classmethod
    def from_ugm_metadata(cls, metadata: Mapping[str, Any]) -> UnigramTokenizer:
        """Build from GGUF key/values; defaults are llama.cpp's for ``"t5"`` vocabularies."""
        tokens, scores, token_id = cls.scored_vocabulary(metadata)
        add_bos = metadata.get("tokenizer.ggml.add_bos_token")
        add_eos = metadata.get("tokenizer.ggml.add_eos_token")
        unknown = token_id("unknown_token_id", 2)
        assert unknown is not None  # the default is an id
        # A GGUF uint8 or int8 array; the blob is whatever bytes it holds.
        charsmap = bytes(int(b) & 0xFF for b in metadata.get("tokenizer.ggml.precompiled_charsmap") or ())
        tokenizer = cls(
            tokens,
            scores,
            token_types=metadata.get("tokenizer.ggml.token_type"),
            unknown_token_id=unknown,
            precompiled_charsmap=charsmap,
            remove_extra_whitespaces=bool(metadata.get("tokenizer.ggml.remove_extra_whitespaces", False)),
            add_space_prefix=bool(metadata.get("tokenizer.ggml.add_space_prefix", False)),
            # UGM defaults in llama.cpp: no BOS, eos 1, pad 0; EOS added, BOS not.
            bos_token_id=token_id("bos_token_id", None),
            eos_token_id=token_id("eos_token_id", 1),
            eot_token_id=token_id("eot_token_id", None),
            eom_token_id=token_id("eom_token_id", None),
            pad_token_id=token_id("padding_token_id", 0),
            add_bos=bool(add_bos) if add_bos is not None else False,
            add_eos=bool(add_eos) if add_eos is not None else True,
            chat_template=metadata.get("tokenizer.chat_template"),
        )
        tokenizer._set_strip_attributes(metadata)
        return tokenizer

    def _load_segmenter(self, scores: Sequence[float]) -> None:
        import sentencepiece
        from sentencepiece import sentencepiece_model_pb2
        from tokenizers.models import Unigram

        self._normalizer = None
        if self._charsmap:
            spec = sentencepiece_model_pb2.NormalizerSpec(
                name="precompiled", precompiled_charsmap=self._charsmap,
                add_dummy_prefix=False, remove_extra_whitespaces=False, escape_whitespaces=False,
            )
            try:
                self._normalizer = sentencepiece.SentencePieceNormalizer(normalizer_spec=spec)
            except RuntimeError as exc:
                raise TokenizerError(f"tokenizer.ggml.precompiled_charsmap rejected: {exc}") from exc
        file_types = self._file_types
        normal_scores = [float(s) for s, t in zip(scores, file_types, strict=True) if t == TokenType.NORMAL]
        min_score = min(normal_scores, default=0.0)
        # tokenizers' unknown score is its lowest piece score - 10; llama.cpp's is the lowest
        # *normal* score - 10. Unmatchable pieces get a harmless score, and matchable ones
        # scoring below every normal piece (the converter's -1000 "[PAD…]" and added tokens)
        # are made unmatchable too: llama.cpp would pick one only over a path scoring worse.
        filler = max(normal_scores, default=0.0)
        vocab: list[tuple[str, float]] = []
        for i, (text, score) in enumerate(zip(self._id_to_text, scores, strict=True)):
            # llama.cpp: user-defined pieces score 0, above every normal piece's log-probability.
            viterbi_score = 0.0 if self._types[i] == TokenType.USER_DEFINED else float(score)
            if file_types[i] not in _MATCHABLE or viterbi_score < min_score:
                vocab.append((f" {i} {text}", filler))
            else:
                vocab.append((text, viterbi_score))
        user_defined = sorted(
            (self._id_to_text[i] for i, t in enumerate(file_types) if t == TokenType.USER_DEFINED), key=len, reverse=True
        )
        # Longest first, as llama.cpp's prefix match; a capture group keeps them in re.split's output.
        self._unnormalized = re.compile("(" + "|".join(map(re.escape, user_defined)) + ")") if user_defined else None
        self._unigram = Unigram(vocab, self.unknown_token_id, False)

    def _encode_text(self, text: str) -> list[int]:
        if self._normalizer is not None:
            parts = self._unnormalized.split(text) if self._unnormalized is not None else [text]
            # Odd parts are user-defined texts: llama.cpp passes them through unnormalised.
            text = "".join(part if k % 2 else self._normalizer.Normalize(part) for k, part in enumerate(parts))
        if self.remove_extra_whitespaces:
            text = "".join(_SPACE + word for word in text.split(" ") if word)
        elif text.strip(" "):
            text = (_SPACE if self.add_space_prefix else "") + text.replace(" ", _SPACE)
        else:
            text = text.replace(" ", _SPACE)  # spaces only: no prefix (no word to put it on)
        if not text:
            return []
        return [token.id for token in self._unigram.tokenize(text)]
