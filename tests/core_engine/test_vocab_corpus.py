"""The engine's GGUF tokenizers on real vocabularies: llama.cpp's ``models/ggml-vocab-*.gguf``.

These vocab-only files were written by llama.cpp's converter from the models' own tokenizers;
most come with ``.inp`` / ``.out`` test vectors, which llama.cpp's ``tests/test-tokenizer-0.cpp``
reads: the ``.inp`` cases are separated by ``"\\n__ggml_vocab_test__\\n"``, the ``.out`` has one
line of space-separated ids per case, and they are tokenized with ``add_special = false`` (no
BOS/EOS) and ``parse_special = false``. Each supported file must give exactly those ids, and
decoding ids must give the bytes llama.cpp's pieces give (``llama_token_to_piece``, which is
what llama.cpp streams), checked against llama.cpp itself through the ``llama_cpp`` bindings; so
are encodings with BOS and with special-token parsing, and files without test vectors. A
vocabulary kind the engine does not implement must be refused at load, by name.

The corpus comes from the llama-cpp-python sdist (:mod:`tests.real_artifacts`); nothing of it is
copied here. Each file is read and built once (module cache), a few seconds in all.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from functools import cache, partial
from pathlib import Path
from typing import Any

import pytest

from core_engine.tokenizer import Tokenizer, TokenizerError, TokenType, UnsupportedPreTokenizerError
from core_engine.tokenizer.gguf import read_gguf_metadata, tokenizer_from_gguf_metadata
from tests.real_artifacts import vocab_dir

_SEPARATOR = "\n__ggml_vocab_test__\n"

# The corpus files this llama.cpp ships (a file added upstream fails test_every_file_is_listed
# until it is sorted here), and for the refused ones the kind the error must name.
SUPPORTED = [
    "aquila", "baichuan", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2",
    "gpt-neox", "llama-bpe", "llama-spm", "mpt", "nomic-bert-moe", "phi-3", "qwen2", "qwen35", "refact",
    "starcoder",
]
REFUSED = {"bert-bge": "'bert'"}  # WordPiece (llama.cpp's WPM): not implemented
WITHOUT_VECTORS = {"aquila", "baichuan", "gpt-neox", "nomic-bert-moe"}  # checked against llama.cpp only
WITH_VECTORS = [n for n in SUPPORTED if n not in WITHOUT_VECTORS]

# Cases for files without test vectors, and for the checks against llama.cpp beyond the vectors.
_EXTRA = [
    "Hello world", " Hello world", "Hello  world\n\n\nbye\t\tnow ", "   ", "\n", " \n \n", "",
    "Ünïcödé façade — naïve café", "日本語のテキスト 中文 한국어 ελληνικά العربية", "🎉🦙 emoji 👩‍💻",
    "3333333 1.5e10 0x1F -42", "<s> </s> <unk> <pad> <|endoftext|> <|im_start|>user\nhi<|im_end|>",
    "<start_of_turn>user\nhi<end_of_turn>\n<|begin_of_text|><|eot_id|>", "it's we'll they'RE 'tis",
    "def f(x):\n    return x**2  # comment\n", "fill <mask> in [MASK] here  <|end|>  <|user|> x </s>  y",
]


def _path(name: str) -> Path:
    return vocab_dir() / f"ggml-vocab-{name}.gguf"


@cache
def _metadata(name: str) -> dict[str, Any]:
    return read_gguf_metadata(_path(name))


@cache
def _tokenizer(name: str) -> Tokenizer:
    return tokenizer_from_gguf_metadata(_metadata(name))


def _cases(name: str) -> list[tuple[str, list[int]]]:
    """The ``.inp``/``.out`` pairs, read as test-tokenizer-0.cpp reads them."""
    path = _path(name)
    raw = Path(f"{path}.inp").read_bytes().decode("utf-8")
    texts: list[str] = []
    pos = 0
    while pos < len(raw):
        end = raw.find(_SEPARATOR, pos)
        if end < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:end])
        pos = end + len(_SEPARATOR)
    lines = Path(f"{path}.out").read_bytes().decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # std::getline yields no line after the final newline
    assert len(texts) == len(lines), f"{path}: {len(texts)} inputs, {len(lines)} outputs"
    return [(text, [int(t) for t in line.strip().split(" ") if t]) for text, line in zip(texts, lines, strict=True)]


class _LlamaCpp:
    """llama.cpp's own tokenizer for one vocab file (``llama_cpp`` bindings, vocab only)."""

    def __init__(self, path: Path) -> None:
        import llama_cpp

        self._lib = llama_cpp
        self._llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        self._vocab = self._llm._model.vocab
        self._buffer = ctypes.create_string_buffer(4096)

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return list(self._llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special))

    def piece(self, token_id: int, *, special: bool) -> bytes:
        n = self._lib.llama_token_to_piece(self._vocab, token_id, self._buffer, len(self._buffer), 0, special)
        assert 0 <= n <= len(self._buffer)
        return self._buffer.raw[:n]

    def decode(self, ids: list[int], *, special: bool) -> str:
        return b"".join(self.piece(i, special=special) for i in ids).decode("utf-8", errors="replace")


    def close(self) -> None:
        self._llm.close()


_REFERENCES: dict[str, _LlamaCpp] = {}


def _llama_cpp(name: str) -> _LlamaCpp:
    if name not in _REFERENCES:
        _REFERENCES[name] = _LlamaCpp(_path(name))
    return _REFERENCES[name]


@pytest.fixture(autouse=True, scope="module")
def _close_references() -> Iterator[None]:
    """Free llama.cpp's vocabularies before interpreter exit (its finalizer fails at exit)."""
    yield
    while _REFERENCES:
        _REFERENCES.popitem()[1].close()


def _mismatches(pairs: list[tuple[str, list[int]]], encode: Callable[[str], list[int]]) -> list[str]:
    return [f"{text!r}: expected {want}, got {got}" for text, want in pairs if (got := encode(text)) != want]


def test_every_file_is_listed() -> None:
    found = sorted(p.name.removeprefix("ggml-vocab-").removesuffix(".gguf") for p in vocab_dir().glob("ggml-vocab-*.gguf"))
    assert found == sorted([*SUPPORTED, *REFUSED])
    vectors = {n for n in found if Path(f"{_path(n)}.inp").is_file() and Path(f"{_path(n)}.out").is_file()}
    assert vectors == set(found) - WITHOUT_VECTORS


@pytest.mark.parametrize("name", WITH_VECTORS)
def test_test_vectors_encode_exactly(name: str) -> None:
    """llama.cpp's test-tokenizer-0 on the file: every ``.inp`` case gives the ``.out`` ids."""
    tokenizer = _tokenizer(name)
    cases = _cases(name)
    assert len(cases) >= 40
    bad = _mismatches(cases, lambda text: tokenizer.encode(text, add_special=False, parse_special=False))
    assert not bad, f"ggml-vocab-{name}.gguf: {len(bad)} of {len(cases)} cases differ:\n" + "\n".join(bad[:5])


def _texts(name: str) -> list[str]:
    # Another file's vectors where it has none: the same English, code, Unicode, whitespace cases.
    vectors = _cases(name if name in WITH_VECTORS else "llama-bpe")
    return [text for text, _ in vectors] + _EXTRA


@pytest.mark.parametrize("name", SUPPORTED)
def test_encoding_matches_llama_cpp(name: str) -> None:
    """Beyond the vectors: BOS added or not, special-token texts parsed or not, as llama.cpp."""
    tokenizer, reference = _tokenizer(name), _llama_cpp(name)
    texts = _texts(name)
    for add_special, parse_special in ((False, False), (True, False), (True, True)):
        pairs = [(t, reference.tokenize(t, add_special=add_special, parse_special=parse_special)) for t in texts]
        bad = _mismatches(pairs, partial(tokenizer.encode, add_special=add_special, parse_special=parse_special))
        assert not bad, f"ggml-vocab-{name}.gguf, add_special={add_special} parse_special={parse_special}:\n" + "\n".join(bad[:5])


@pytest.mark.parametrize("name", SUPPORTED)
def test_decoding_matches_llama_cpp(name: str) -> None:
    """Decoding gives llama.cpp's pieces: special tokens hidden (``skip_special``) or shown."""
    tokenizer, reference = _tokenizer(name), _llama_cpp(name)
    sequences = [reference.tokenize(t, add_special=True, parse_special=True) for t in _texts(name)]
    for skip_special in (True, False):
        bad = [
            f"{ids}: expected {want!r}, got {got!r}"
            for ids in sequences
            if (got := tokenizer.decode(ids, skip_special=skip_special)) != (want := reference.decode(ids, special=not skip_special))
        ]
        assert not bad, f"ggml-vocab-{name}.gguf, skip_special={skip_special}:\n" + "\n".join(bad[:5])
    # Every single token too (what streaming emits), special ones shown.
    # One deliberate difference: a byte-level vocabulary's entry with characters outside GPT-2's
    # byte alphabet (Command-R's "‼", unreachable by encoding) is its UTF-8 text here, where
    # llama.cpp writes "[UNK_BYTE_0x…]" around it.
    reference_pieces = [reference.piece(i, special=True) for i in range(tokenizer.vocab_size)]
    for i, piece in enumerate(reference_pieces):
        if b"[UNK_BYTE_0x" in piece:
            reference_pieces[i] = tokenizer.id_to_token(i).encode("utf-8")
    bad_ids = [i for i in range(tokenizer.vocab_size) if tokenizer.token_to_bytes(i, skip_special=False) != reference_pieces[i]]
    assert not bad_ids, f"ggml-vocab-{name}.gguf: pieces of {len(bad_ids)} tokens differ, e.g. " + ", ".join(
        f"{i} {tokenizer.id_to_token(i)!r}: {reference_pieces[i]!r} vs {tokenizer.token_to_bytes(i, skip_special=False)!r}"
        for i in bad_ids[:5]
    )


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_kinds_are_refused_by_name(name: str) -> None:
    with pytest.raises((TokenizerError, UnsupportedPreTokenizerError), match=REFUSED[name]):
        tokenizer_from_gguf_metadata(_metadata(name))


def test_an_unknown_token_typed_control_loads() -> None:
    """Phi-3's converter types ``<unk>`` CONTROL (and 53 ``[PAD…]`` pieces UNKNOWN) while
    ``tokenizer.ggml.unknown_token_id`` names ``<unk>``: the key decides, as in llama.cpp."""
    metadata = _metadata("phi-3")
    unknown = metadata["tokenizer.ggml.unknown_token_id"]
    assert metadata["tokenizer.ggml.tokens"][unknown] == "<unk>"
    assert metadata["tokenizer.ggml.token_type"][unknown] == TokenType.CONTROL
    tokenizer = _tokenizer("phi-3")
    assert getattr(tokenizer, "unknown_token_id", None) == unknown
    assert tokenizer.encode("Hello world", add_special=True) == [1, 15043, 3186]
    # The same on Llama 2's vocabulary with <unk> retyped CONTROL: loads, encodes the same.
    llama = dict(_metadata("llama-spm"))
    types = list(llama["tokenizer.ggml.token_type"])
    types[llama["tokenizer.ggml.unknown_token_id"]] = TokenType.CONTROL
    retyped = tokenizer_from_gguf_metadata({**llama, "tokenizer.ggml.token_type": types})
    texts = [text for text, _ in _cases("llama-spm")]
    assert [retyped.encode(t) for t in texts] == [_tokenizer("llama-spm").encode(t) for t in texts]


def test_missing_optional_keys_take_llama_cpp_defaults() -> None:
    """Without the special-id keys a SentencePiece vocabulary gets llama.cpp's defaults
    (unk 0, bos 1, eos 2) and still loads."""
    metadata = {k: v for k, v in _metadata("llama-spm").items() if not k.endswith("_token_id") and "add_" not in k}
    tokenizer = tokenizer_from_gguf_metadata(metadata)
    assert (getattr(tokenizer, "unknown_token_id", None), tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.encode("Hello world") == _tokenizer("llama-spm").encode("Hello world")
