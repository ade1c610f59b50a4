"""SentencePiece unigram vocabularies in GGUF (``tokenizer.ggml.model = "t5"``: T5, mT5): ids
and text equal llama.cpp's on the same file.

The vocabulary is trained here by the ``sentencepiece`` library as T5's is (unigram, NFKC
normalisation so the file carries a precompiled charsmap, no byte fallback, pad 0 / eos 1 /
unk 2, no BOS), with two ChatML markers as user-defined pieces and a control piece, then written
into a vocabulary-only ``t5`` GGUF as llama.cpp's converter writes T5 files."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from core_engine.gguf_loader import GGUFFile
from core_engine.tokenizer import TokenizerError, tokenizer_from_gguf_metadata
from core_engine.tokenizer.unigram import UnigramTokenizer
from tests.core_engine.tokenizer_corpus import CORPUS

# Texts the normaliser and the unigram special cases act on, beyond the shared corpus.
UNIGRAM_TEXTS = (
    "ｆｕｌｌ－ｗｉｄｔｈ ＡＢＣ ①② ﬁne ﬂow Ⅻ ㎏ ™",  # NFKC rewrites these
    "＜|im_end|＞ normalises into a marker",
    "<unk> </s> <pad> <extra_id_0> written as text",
    "<extra_id_0>span<extra_id_0>",
    "  x  y  ",
    "a\u00a0\u00a0b\u3000c",
    "\u2581visible\u2581space\u2581",
    "[PAD700] [PAD703] written as text",
)
TEXTS = (*CORPUS, *UNIGRAM_TEXTS)
_VARIANTS = {  # add_space_prefix, remove_extra_whitespaces, number of -1000 "[PAD…]" pieces
    "t5-flags": (True, True, 0),
    "keep-whitespace": (True, False, 0),
    "no-prefix": (False, True, 0),
    "padded": (True, True, 8),
}


@pytest.fixture(scope="module")
def unigram_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import sentencepiece

    directory = tmp_path_factory.mktemp("unigram")
    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    (directory / "corpus.txt").write_text("\n".join(TEXTS) * 3 + "\n" + readme, encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(directory / "corpus.txt"), model_prefix=str(directory / "tiny"), vocab_size=700,
        model_type="unigram", normalization_rule_name="nmt_nfkc", byte_fallback=False,
        character_coverage=0.995, pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
        user_defined_symbols=["<|im_start|>", "<|im_end|>"], control_symbols=["<extra_id_0>"], minloglevel=2,
    )
    return directory / "tiny.model"


def model_pieces(model_file: Path) -> tuple[list[str], list[float], list[int], bytes]:
    """Pieces, scores, GGUF token types (sentencepiece's types are GGUF's) and the normaliser's
    precompiled charsmap of a SentencePiece model."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_file.read_bytes())
    pieces = proto.pieces
    return [p.piece for p in pieces], [p.score for p in pieces], [p.type for p in pieces], proto.normalizer_spec.precompiled_charsmap


def write_unigram_gguf(
    path: Path,
    tokens: list[str],
    scores: list[float],
    token_types: list[int],
    *,
    charsmap: bytes = b"",
    add_space_prefix: bool = True,
    remove_extra_whitespaces: bool = True,
) -> Path:
    """A vocabulary-only ``t5`` GGUF (the hyperparameters llama.cpp reads for T5, no tensors)."""
    writer = gguf.GGUFWriter(str(path), "t5")
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_key_length(4)
    writer.add_value_length(4)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_relative_attn_buckets_count(32)
    writer.add_decoder_start_token_id(0)
    writer.add_tokenizer_model("t5")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(token_types)
    writer.add_add_space_prefix(add_space_prefix)
    writer.add_remove_extra_whitespaces(remove_extra_whitespaces)
    if charsmap:
        writer.add_precompiled_charsmap(charsmap)
    writer.add_pad_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module", params=list(_VARIANTS))
def unigram_gguf(request: pytest.FixtureRequest, unigram_model: Path) -> Path:
    add_space_prefix, remove_extra_whitespaces, num_padding = _VARIANTS[request.param]
    tokens, scores, token_types, charsmap = model_pieces(unigram_model)
    # llama.cpp's converter pads T5 vocabularies to the embedding rows with unused pieces.
    tokens += [f"[PAD{len(tokens) + i}]" for i in range(num_padding)]
    scores += [-1000.0] * num_padding
    token_types += [5] * num_padding
    return write_unigram_gguf(
        unigram_model.parent / f"{request.param}.gguf", tokens, scores, token_types, charsmap=charsmap,
        add_space_prefix=add_space_prefix, remove_extra_whitespaces=remove_extra_whitespaces,
    )


@pytest.fixture(scope="module")
def ours(unigram_gguf: Path) -> UnigramTokenizer:
    # Read once per file: gguf-py takes seconds over the ~240k-byte charsmap array.
    tokenizer = GGUFFile(unigram_gguf).tokenizer()
    assert isinstance(tokenizer, UnigramTokenizer)
    return tokenizer


@pytest.fixture(scope="module")
def llama_vocab(unigram_gguf: Path):  # type: ignore[no-untyped-def]
    import llama_cpp

    llm = llama_cpp.Llama(str(unigram_gguf), vocab_only=True, verbose=False)
    yield llm
    llm.close()


@pytest.mark.parametrize(("add_special", "parse_special"), [(False, False), (True, False), (False, True), (True, True)])
def test_unigram_ids_equal_llamacpp(ours: UnigramTokenizer, llama_vocab, add_special: bool, parse_special: bool) -> None:  # type: ignore[no-untyped-def]
    mismatches = [
        text for text in TEXTS
        if ours.encode(text, add_special=add_special, parse_special=parse_special)
        != llama_vocab.tokenize(text.encode(), add_bos=add_special, special=parse_special)
    ]
    assert mismatches == []


def test_unigram_text_equals_llamacpp_detokenize(ours: UnigramTokenizer, llama_vocab) -> None:  # type: ignore[no-untyped-def]
    for text in TEXTS:
        ids = ours.encode(text, add_special=True, parse_special=True)
        for special in (False, True):
            theirs = llama_vocab.detokenize(ids, special=special).decode("utf-8", errors="replace")
            assert ours.decode(ids, skip_special=not special) == theirs, text


def test_a_t5_vocabulary_appends_eos_and_no_bos(ours: UnigramTokenizer) -> None:
    ids = ours.encode("Hello world")
    assert ours.bos_token_id is None and ids[-1] == ours.eos_token_id == 1 and 1 not in ids[:-1]
    assert ours.encode("Hello world", add_special=False) == ids[:-1]
    assert ours.encode("", add_special=True) == [1]
    # <|im_end|> reads as an end of turn: a stop id, hidden from output.
    im_end = ours.token_to_id("<|im_end|>")
    assert im_end in ours.stop_token_ids and ours.decode([im_end]) == ""


def test_unigram_ids_equal_sentencepiece_but_for_float32_ties(unigram_model: Path) -> None:
    """A second oracle: ``sentencepiece`` on the trained model itself, for text without special
    texts. It sums scores in float32 and llama.cpp in float64, so where two segmentations tie
    in float32 the two may pick differently; everywhere else the ids are the same."""
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor(model_file=str(unigram_model))
    tokens, scores, token_types, charsmap = model_pieces(unigram_model)
    path = write_unigram_gguf(unigram_model.parent / "oracle.gguf", tokens, scores, token_types, charsmap=charsmap)
    ours = GGUFFile(path).tokenizer()
    plain = [t for t in TEXTS if "<" not in t and "＜" not in t]
    num_ties = 0
    for text in plain:
        ids, theirs = ours.encode(text, add_special=False), processor.EncodeAsIds(text)
        if ids != theirs:
            num_ties += 1
            assert sum(processor.GetScore(i) for i in ids) == pytest.approx(
                sum(processor.GetScore(i) for i in theirs), abs=1e-4
            ), text
    assert num_ties < len(plain) // 10


def test_a_unigram_vocabulary_needs_an_unknown_token() -> None:
    with pytest.raises(TokenizerError, match="unknown"):
        tokenizer_from_gguf_metadata(
            {"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.scores": [0.0]}
        )


def test_the_unknown_score_is_the_lowest_normal_score_minus_ten(tmp_path: Path) -> None:
    """A hand-made vocabulary where the unknown score decides: "▁w" + <unk> (-1 - 110) beats
    "▁" + "wz" (-95 - 90) only if a -1000 padding piece does not lower the unknown score."""
    import llama_cpp

    tokens = ["<pad>", "</s>", "<unk>", "\u2581", "\u2581w", "wz", "b", "[PAD7]", "<extra_id_0>"]
    scores = [0.0, 0.0, 0.0, -95.0, -1.0, -90.0, -100.0, -1000.0, -1000.0]
    token_types = [3, 3, 2, 1, 1, 1, 1, 5, 4]
    path = write_unigram_gguf(tmp_path / "handmade.gguf", tokens, scores, token_types)
    ours = GGUFFile(path).tokenizer()
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    texts = ["wz", "wz b wz", "[PAD7]", "b[PAD7]b", "<extra_id_0>wz", "zz w"]
    for text in texts:
        assert ours.encode(text, add_special=False) == llm.tokenize(text.encode(), add_bos=False), text
    assert ours.encode("wz", add_special=False) == [4, 2]
    llm.close()
