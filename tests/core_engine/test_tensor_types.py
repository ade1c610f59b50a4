"""GGUF tensor types beyond the first six: Q5_0, Q5_1 and the K-quants Q2_K ... Q6_K (so the
``Q4_K_M`` and ``Q5_K_M`` files of the model hubs load), each checked against llama.cpp.

The files are made as users get them: llama.cpp's own quantiser (``llama_model_quantize`` of
llama-cpp-python) turns an F32 file into each file type, and turns it back into F32 with its
own dequantisation, the oracle for ours.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from backends.default_model import default_model_path
from core_engine.attention import ContiguousAttention
from core_engine.gguf_loader import GGUFFile, load_model
from tests.artifact_cache import cached_file, file_sha256, versions
from tests.core_engine.engine_util import make_engine
from tests.core_engine.gguf_factory import TinyLlamaSpec, write_llama_gguf

pytestmark = pytest.mark.slow

#: llama.cpp file type -> the tensor types its quantiser writes for a model whose rows are
#: multiples of 256 (K-quant files mix types: Q4_K_M keeps some tensors at Q6_K).
FILE_TYPES = {
    "Q5_0": {"Q5_0"},
    "Q5_1": {"Q5_1"},
    "Q2_K": {"Q2_K", "Q3_K"},
    "Q3_K_M": {"Q3_K", "Q4_K", "Q5_K"},
    "Q4_K_M": {"Q4_K", "Q6_K"},
    "Q5_K_M": {"Q5_K", "Q6_K"},
    "Q6_K": {"Q6_K"},
}

#: Teacher-forced text for the agreement checks (the benchmark's corpus).
TEXT = (
    "The history of mountain huts begins with shepherds who needed shelter in summer pastures. "
    "Later, alpine clubs built stone refuges along the main routes, each with a warden, a stove "
    "and a logbook where climbers wrote the weather, their route and the time they left. "
) * 12


def llamacpp_quantize(source: Path, target: Path, file_type: str) -> Path:
    """``source`` written as ``file_type`` ("Q4_K_M", ..., "ALL_F32") by llama.cpp's quantiser."""
    import llama_cpp

    name = "LLAMA_FTYPE_ALL_F32" if file_type == "ALL_F32" else f"LLAMA_FTYPE_MOSTLY_{file_type}"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, name)
    params.nthread = 1
    params.allow_requantize = True
    assert llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params)) == 0
    return target


def smollm2_as(file_type: str) -> tuple[Path, bool]:
    """The default model requantised to ``file_type`` by llama.cpp's quantiser, from the
    test-artifact cache (``scripts/build_test_artifacts.py`` writes them); whether it was
    built now."""
    source = default_model_path()
    facts = {"source_sha256": file_sha256(source), "file_type": file_type, **versions("llama_cpp_python")}
    return cached_file(f"smollm2-{file_type}", facts, lambda partial: llamacpp_quantize(source, partial, file_type))


#: The file types :func:`test_smollm2_in_each_file_type_predicts_what_llamacpp_predicts` runs.
SMOLLM2_FILE_TYPES = ("Q2_K", "Q4_K_M", "Q5_K_M", "Q5_1")


def _types(path: Path) -> set[str]:
    return {GGMLQuantizationType(t.tensor_type).name for t in GGUFFile(path).tensors}


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor(ids), torch.arange(len(ids)), ContiguousAttention(model.config.num_layers)).float()


def _llamacpp_logits(path: Path, ids: list[int], *, f32_kv: bool = False) -> torch.Tensor:
    import llama_cpp

    kv_type = llama_cpp.GGML_TYPE_F32 if f32_kv else None  # else llama.cpp's default F16 KV
    llm = llama_cpp.Llama(
        str(path), n_ctx=512, n_threads=1, logits_all=True, type_k=kv_type, type_v=kv_type, verbose=False
    )
    try:
        llm.eval(ids)
        return torch.from_numpy(np.array(llm.scores[: len(ids)]))
    finally:
        llm.close()


@pytest.fixture(scope="module")
def tiny_f32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = TinyLlamaSpec(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, context_length=512)
    return write_llama_gguf(tmp_path_factory.mktemp("types") / "f32.gguf", spec=spec)


@pytest.mark.parametrize("file_type", list(FILE_TYPES))
def test_each_tensor_type_dequantizes_as_llamacpp_and_the_model_matches_it(
    file_type: str, tiny_f32: Path, tmp_path: Path
) -> None:
    quantized = llamacpp_quantize(tiny_f32, tmp_path / f"{file_type}.gguf", file_type)
    assert FILE_TYPES[file_type] <= _types(quantized)
    theirs = llamacpp_quantize(quantized, tmp_path / "dequantized.gguf", "ALL_F32")  # llama.cpp's dequantisation
    ours_file, their_file = GGUFFile(quantized), GGUFFile(theirs)
    for tensor in ours_file.tensors:
        assert torch.equal(ours_file.dequantized(tensor.name), their_file.dequantized(tensor.name)), tensor.name
    # The model on those weights computes what llama.cpp computes with them (F32 weights and
    # KV: no rounding of activations on either side).
    model, _, tok = load_model(quantized, dtype=torch.float32, show_progress=False)
    ids = tok.encode(TEXT)[:64]
    diff = (_logits(model, ids) - _llamacpp_logits(theirs, ids, f32_kv=True)).abs().max()
    assert diff <= 1e-3, f"{file_type}: max |logit difference| {diff:.2e}"


@pytest.mark.parametrize("file_type", SMOLLM2_FILE_TYPES)
def test_smollm2_in_each_file_type_predicts_what_llamacpp_predicts(file_type: str) -> None:
    # SmolLM2's 576-wide rows are not multiples of 256: llama.cpp's quantiser keeps K-quants
    # for the 1536-wide down projections and falls back to Q4_0/Q5_0/Q8_0 elsewhere, so these
    # four files also hold Q3_K, Q4_K, Q5_K, Q6_K, Q4_0, Q5_0 and Q8_0 tensors.
    path, _ = smollm2_as(file_type)
    engine = make_engine(path, weight_format="auto", dtype="auto")  # the engine's default path
    ids = engine.tokenizer.encode(TEXT)[:300]
    ours, theirs = _logits(engine.model_runner.model, ids), _llamacpp_logits(path, ids)
    agreement = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
    assert len(ids) >= 256 and agreement >= 0.98, f"{file_type}: top-1 agreement {agreement:.3f} ({_types(path)})"
