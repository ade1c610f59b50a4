"""The GGUF tokenizer produces llama.cpp's ids and streams text without breaking characters."""

from __future__ import annotations

from pathlib import Path

import llama_cpp
import pytest

from backends.default_model import default_model_path
from core_engine.gguf_loader import GGUFFile
from core_engine.tokenizer import (
    IncrementalDetokenizer,
    Tokenizer,
    TokenizerError,
    UnsupportedPreTokenizerError,
    tokenizer_from_gguf_metadata,
)
from tests.core_engine.gguf_factory import TinyLlamaSpec, write_llama_gguf
from tests.core_engine.tokenizer_corpus import CORPUS


@pytest.fixture(scope="module")
def smollm_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def tokenizer(smollm_path: Path) -> Tokenizer:
    return GGUFFile(smollm_path).tokenizer()


@pytest.fixture(scope="module")
def llama_vocab(smollm_path: Path) -> llama_cpp.Llama:
    return llama_cpp.Llama(str(smollm_path), vocab_only=True, verbose=False)


def _mismatches(tok: Tokenizer, llm: llama_cpp.Llama, *, add_special: bool, parse_special: bool) -> list:
    bad = []
    for text in CORPUS:
        ours = tok.encode(text, add_special=add_special, parse_special=parse_special)
        ref = llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special)
        if ours != ref:
            bad.append((text, ours, ref))
    return bad


@pytest.mark.parametrize("parse_special", [True, False])
@pytest.mark.parametrize("add_special", [True, False])
def test_smollm2_ids_equal_llamacpp(
    tokenizer: Tokenizer, llama_vocab: llama_cpp.Llama, add_special: bool, parse_special: bool
) -> None:
    assert _mismatches(tokenizer, llama_vocab, add_special=add_special, parse_special=parse_special) == []


def test_special_tokens_are_single_ids_only_when_parsed(tokenizer: Tokenizer) -> None:
    text = "<|im_start|>user\nhi<|im_end|>"
    parsed = tokenizer.encode(text, parse_special=True)
    assert parsed[0] == tokenizer.token_to_id("<|im_start|>")
    assert parsed[-1] == tokenizer.token_to_id("<|im_end|>")
    plain = tokenizer.encode(text, parse_special=False)
    assert tokenizer.token_to_id("<|im_start|>") not in plain
    assert tokenizer.decode(plain) == text  # the markup survives as ordinary text


def test_smollm2_metadata_rules(tokenizer: Tokenizer) -> None:
    # SmolLM2 says add_bos_token = false: no BOS even when special tokens are added.
    assert tokenizer.encode("Hi", add_special=True) == tokenizer.encode("Hi", add_special=False)
    assert tokenizer.eos_token_id == tokenizer.token_to_id("<|im_end|>")
    assert {tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")} <= tokenizer.stop_token_ids
    assert tokenizer.vocab_size == 49152
    assert tokenizer.chat_template is not None and "<|im_start|>" in tokenizer.chat_template


def test_chat_template_from_metadata_renders_to_parsable_ids(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.make_chat_template().render(
        [{"role": "user", "content": "Hi!"}], add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tokenizer.encode(prompt, parse_special=True)
    assert ids.count(tokenizer.token_to_id("<|im_start|>")) == 3  # system, user, assistant


def test_decode_equals_llamacpp_detokenize(tokenizer: Tokenizer, llama_vocab: llama_cpp.Llama) -> None:
    for text in CORPUS:
        ids = tokenizer.encode(text, add_special=False)
        assert tokenizer.decode(ids) == text
        assert tokenizer.decode(ids).encode() == llama_vocab.detokenize(ids)


def test_control_tokens_hidden_unless_asked(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>assistant\nHi!<|im_end|>", parse_special=True)
    assert tokenizer.decode(ids) == "assistant\nHi!"
    assert tokenizer.decode(ids, skip_special=False) == "<|im_start|>assistant\nHi!<|im_end|>"


def test_incremental_detokenizer_never_splits_a_character(tokenizer: Tokenizer) -> None:
    text = "Emoji 🤖🎉 family 👩‍👩‍👧 and 日本語テキスト, done."
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(i) for i in ids]
    assert "" in deltas  # some tokens end mid-character and are held back...
    assert all("\ufffd" not in d for d in deltas)  # ...never emitted as replacement chars
    assert "".join(deltas) + detok.flush() == text


def test_incremental_detokenizer_flushes_an_incomplete_tail(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("🤖")
    assert len(ids) > 1  # the emoji is several byte tokens
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add_many(ids[:-1]) == ""
    assert detok.flush() == "\ufffd"  # a cut-off character at the end of a stream


# Pre-tokenizer types other than SmolLM2's, checked on a tiny byte-level vocabulary.
@pytest.mark.parametrize(
    "pre",
    ["gpt-2", "llama-bpe", "qwen2", "starcoder", "default", "tekken", "deepseek-coder", "chatglm-bpe",
     "gpt-4o", "falcon", "poro-chat", "dbrx"],
)
def test_pre_tokenizer_types_equal_llamacpp(tmp_path: Path, pre: str) -> None:
    path = write_llama_gguf(tmp_path / f"{pre}.gguf", spec=TinyLlamaSpec(pre=pre, add_bos=None))
    tok = GGUFFile(path).tokenizer()
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    assert _mismatches(tok, llm, add_special=True, parse_special=True) == []


def test_unknown_pre_tokenizer_is_refused_by_name(tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "x.gguf", spec=TinyLlamaSpec(pre="kimi-k2"))
    with pytest.raises(UnsupportedPreTokenizerError, match="kimi-k2"):
        GGUFFile(path).tokenizer()


def test_an_unsupported_tokenizer_model_is_refused_with_the_supported_ones() -> None:
    with pytest.raises(
        TokenizerError, match=r"'bert' is not supported \(supported: 'gpt2' .*'llama' SentencePiece, 't5' SentencePiece unigram"
    ):
        tokenizer_from_gguf_metadata({"tokenizer.ggml.model": "bert"})


def test_every_backend_that_reads_a_vocabulary_stops_on_the_same_end_of_turn_texts() -> None:
    from backends.mlx import tokenizer as mlx_tokenizer
    from core_engine.tokenizer import bpe, hf
    from core_engine.tokenizer.end_of_generation import END_OF_GENERATION_TEXTS

    assert mlx_tokenizer._END_OF_TURN_TEXTS is END_OF_GENERATION_TEXTS
    assert bpe._EOG_TEXTS is END_OF_GENERATION_TEXTS and hf.END_OF_GENERATION_TEXTS is END_OF_GENERATION_TEXTS
    assert {"<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>"} <= END_OF_GENERATION_TEXTS
