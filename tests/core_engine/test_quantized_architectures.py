"""Every architecture in every quantised GGUF type, against llama.cpp on the same file.

A tiny model of each architecture (rows of 256, so that the K-quants apply to its matrices),
trained on a text so that it predicts that text with a real model's margins, is built once
per machine by ``scripts/build_test_artifacts.py`` (``make test`` runs it; the file and its
cache key: ``tests/core_engine/trained_tiny.py``); a missing one fails the test, naming
that command. llama.cpp's quantiser writes it in each file type; the engine's default path
(``weight_format = "auto"``) then predicts llama.cpp's top-1 token at >= 98% of 256
teacher-forced positions of the text.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core_engine.gguf_loader import GGUFFile, load_model
from tests.core_engine.test_tensor_types import (
    TEXT,
    _llamacpp_logits,
    _logits,
    _types,
    llamacpp_quantize,
)
from tests.core_engine.trained_tiny import ARCHITECTURES, trained_gguf

pytestmark = pytest.mark.slow

#: llama.cpp file types, and the tensor types each must bring into these files (Q4_K_M and
#: Q5_K_M keep some tensors at Q6_K; small files take Q8_0 where a type's rows do not fit).
FILE_TYPES = {
    "Q8_0": "Q8_0", "Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q5_0": "Q5_0", "Q5_1": "Q5_1",
    "Q2_K": "Q2_K", "Q3_K_M": "Q3_K", "Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K",
}

POSITIONS = 256


@pytest.fixture(scope="module", params=ARCHITECTURES)
def trained(request: pytest.FixtureRequest) -> tuple[str, Path, list[int]]:
    """The cached trained F32 file of the architecture (read only), and the text's first ids."""
    arch = request.param
    try:
        f32, missing = trained_gguf(arch), None
    except FileNotFoundError as exc:
        missing = str(exc)
    if missing is not None:  # not skipped: the artifact is part of the test set-up
        pytest.fail(missing, pytrace=False)
    # The text in the tiny vocabulary (the tokenizer the GGUF carries).
    ids = GGUFFile(f32).tokenizer().encode(TEXT)
    assert len(ids) > POSITIONS + 128
    return arch, f32, ids[:POSITIONS]


@pytest.mark.parametrize("file_type", list(FILE_TYPES))
def test_each_architecture_in_each_type_predicts_what_llamacpp_predicts(
    trained: tuple[str, Path, list[int]], file_type: str, tmp_path: Path
) -> None:
    arch, f32, ids = trained
    path = llamacpp_quantize(f32, tmp_path / f"{arch}-{file_type}.gguf", file_type)
    assert FILE_TYPES[file_type] in _types(path)
    model, _, _ = load_model(path, dtype=torch.float32, show_progress=False)
    model.set_weight_format("auto")  # the engine's default: the file's blocks as int4/int8
    ours = _logits(model, ids)
    theirs = _llamacpp_logits(path, ids, f32_kv=True)
    agreement = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
    assert agreement >= 0.98, f"{arch} {file_type}: top-1 agreement {agreement:.3f}"
