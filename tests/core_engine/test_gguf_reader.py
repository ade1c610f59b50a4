"""core_engine/gguf_reader.py gives what gguf-py's GGUFReader gives, on real files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from backends.default_model import default_model_path
from core_engine.gguf_reader import read_gguf, read_gguf_metadata
from tests.core_engine.gguf_factory import write_llama_gguf
from tests.real_artifacts import vocab_dir


def _files(tmp_path: Path) -> list[Path]:
    tiny = write_llama_gguf(tmp_path / "tiny.gguf")  # F32 and F16 tensors, the factory's metadata
    return [default_model_path(), tiny, vocab_dir() / "ggml-vocab-phi-3.gguf"]


def test_records_and_metadata_equal_gguf_pys(tmp_path: Path) -> None:
    for path in _files(tmp_path):
        theirs = GGUFReader(str(path))
        ours = read_gguf(path)
        expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
        assert ours.metadata == expected == read_gguf_metadata(path), path.name
        assert ours.alignment == theirs.alignment and ours.data_offset == theirs.data_offset
        assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
        for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
            assert (mine.tensor_type, mine.n_elements, mine.n_bytes, mine.data_offset) == (
                ref.tensor_type, ref.n_elements, ref.n_bytes, ref.data_offset
            )
            assert mine.shape.tolist() == ref.shape.tolist()
            assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape
            assert np.array_equal(mine.data, ref.data)
            assert not mine.data.flags.writeable


@pytest.mark.parametrize("cut", [3, 30, 200])
def test_a_file_cut_short_or_not_gguf_is_a_value_error_naming_it(tmp_path: Path, cut: int) -> None:
    whole = default_model_path().read_bytes()
    broken = tmp_path / "cut.gguf"
    broken.write_bytes(whole[:cut] if cut > 3 else b"GGML" + whole[4:64])
    with pytest.raises(ValueError, match="cut.gguf"):
        read_gguf(broken)
