"""SentencePiece vocabularies in GGUF (``tokenizer.ggml.model = "llama"``: Llama 2, Mistral,
Gemma): ids and text equal llama.cpp's on the same file, and a model with one runs.

The vocabulary is trained here by the ``sentencepiece`` library (BPE with byte fallback, two
ChatML markers as user-defined pieces) on the varied corpus, then written into a tiny GGUF as
llama.cpp's converter writes SentencePiece models (pieces, scores, types)."""

from __future__ import annotations

from pathlib import Path

import pytest

from core_engine.gguf_loader import GGUFFile
from core_engine.sampling_params import SamplingParams
from core_engine.tokenizer.spm import SentencePieceTokenizer
from tests.core_engine.engine_util import make_engine, run_all
from tests.core_engine.gguf_factory import TinyLlamaSpec, write_llama_gguf
from tests.core_engine.tokenizer_corpus import CORPUS


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import sentencepiece

    directory = tmp_path_factory.mktemp("spm")
    (directory / "corpus.txt").write_text("\n".join(CORPUS) * 3 + "\n" + (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8"), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(directory / "corpus.txt"), model_prefix=str(directory / "tiny"), vocab_size=600, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        character_coverage=1.0, allow_whitespace_only_pieces=True, user_defined_symbols=["<|im_start|>", "<|im_end|>"],
        minloglevel=2,
    )
    return write_llama_gguf(directory / "tiny-spm.gguf", spec=TinyLlamaSpec(sentencepiece_model=directory / "tiny.model"))


@pytest.fixture(scope="module")
def llama_vocab(spm_gguf: Path):  # type: ignore[no-untyped-def]
    import llama_cpp

    llm = llama_cpp.Llama(str(spm_gguf), vocab_only=True, verbose=False)
    yield llm
    llm.close()


@pytest.mark.parametrize(("add_special", "parse_special"), [(False, False), (True, False), (False, True), (True, True)])
def test_sentencepiece_ids_equal_llamacpp(spm_gguf: Path, llama_vocab, add_special: bool, parse_special: bool) -> None:  # type: ignore[no-untyped-def]
    ours = GGUFFile(spm_gguf).tokenizer()
    assert isinstance(ours, SentencePieceTokenizer)
    for text in CORPUS:
        theirs = llama_vocab.tokenize(text.encode(), add_bos=add_special, special=parse_special)
        assert ours.encode(text, add_special=add_special, parse_special=parse_special) == theirs, text


def test_sentencepiece_text_equals_llamacpp_detokenize(spm_gguf: Path, llama_vocab) -> None:  # type: ignore[no-untyped-def]
    ours = GGUFFile(spm_gguf).tokenizer()
    for text in CORPUS:
        ids = ours.encode(text, add_special=False)
        assert ours.decode(ids) == llama_vocab.detokenize(ids).decode("utf-8", errors="replace"), text
    # <|im_end|> reads as an end of turn: a control token, a stop id, hidden from output.
    im_end = ours.token_to_id("<|im_end|>")
    assert im_end in ours.stop_token_ids and ours.decode([im_end]) == ""
    assert ours.bos_token_id == 1 and ours.encode("hi")[0] == 1


def test_a_model_with_a_sentencepiece_vocabulary_generates(spm_gguf: Path) -> None:
    engine = make_engine(spm_gguf)
    out = run_all(engine, {"p": "The quick brown fox"}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))["p"]
    assert len(out["token_ids"]) == 8 and isinstance(out["text"], str)
