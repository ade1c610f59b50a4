"""Every architecture in every quantised GGUF type, against llama.cpp on the same file.

A tiny model of each architecture (rows of 256, so that the K-quants apply to its matrices)
is trained for a few seconds on a text, so that it predicts that text with a real model's
margins; llama.cpp's quantiser writes it in each file type; the engine's default path
(``weight_format = "auto"``) then predicts llama.cpp's top-1 token at >= 98% of 256
teacher-forced positions of the text.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from core_engine.gguf_loader import GGUFFile, load_model
from tests.core_engine.hf_factory import ARCHITECTURES, tiny_hf_model, train_tiny, write_gguf
from tests.core_engine.test_tensor_types import (
    TEXT,
    _llamacpp_logits,
    _logits,
    _types,
    llamacpp_quantize,
)

pytestmark = pytest.mark.slow

#: llama.cpp file types, and the tensor types each must bring into these files (Q4_K_M and
#: Q5_K_M keep some tensors at Q6_K; small files take Q8_0 where a type's rows do not fit).
FILE_TYPES = {
    "Q8_0": "Q8_0", "Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q5_0": "Q5_0", "Q5_1": "Q5_1",
    "Q2_K": "Q2_K", "Q3_K_M": "Q3_K", "Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K",
}

#: Rows of 256 in every matrix (hidden 256, 4 heads of 64, FFN and experts of 256).
_SIZES = {"hidden_size": 256, "intermediate_size": 256}
_OWN_SIZES = {
    "qwen3": {"head_dim": 64}, "qwen3moe": {"head_dim": 64, "moe_intermediate_size": 256},
    "mixtral": {"intermediate_size": 256}, "gemma2": {"head_dim": 64, "query_pre_attn_scalar": 64},
    "gemma3": {"head_dim": 64, "query_pre_attn_scalar": 64},
}
POSITIONS = 256


@pytest.fixture(scope="module", params=ARCHITECTURES)
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, list[int]]]:
    arch = request.param
    directory = tmp_path_factory.mktemp(f"trained-{arch}")
    model = tiny_hf_model(arch, **(_SIZES | _OWN_SIZES.get(arch, {})))
    # The text in the tiny vocabulary (the same tokenizer the GGUF will carry).
    ids = GGUFFile(write_gguf(model, directory / "vocab.gguf")).tokenizer().encode(TEXT)
    assert len(ids) > POSITIONS + 128
    train_tiny(model, ids, steps=300, seq_len=128)
    yield arch, write_gguf(model, directory / "f32.gguf"), ids[:POSITIONS]


@pytest.mark.parametrize("file_type", list(FILE_TYPES))
def test_each_architecture_in_each_type_predicts_what_llamacpp_predicts(
    trained: tuple[str, Path, list[int]], file_type: str
) -> None:
    arch, f32, ids = trained
    path = llamacpp_quantize(f32, f32.with_name(f"{file_type}.gguf"), file_type)
    assert FILE_TYPES[file_type] in _types(path)
    model, _, _ = load_model(path, dtype=torch.float32, show_progress=False)
    model.set_weight_format("auto")  # the engine's default: the file's blocks as int4/int8
    ours = _logits(model, ids)
    theirs = _llamacpp_logits(path, ids, f32_kv=True)
    agreement = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
    assert agreement >= 0.98, f"{arch} {file_type}: top-1 agreement {agreement:.3f}"
