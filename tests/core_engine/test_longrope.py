"""Phi-3's LongRoPE (Phi-3-mini-128k, Phi-3.5-mini) against ``transformers`` and llama.cpp, in
short mode (the engine's context window within the original context) and long mode (past it).

The engine chooses the factor set once, by its context window (llama.cpp's rule on ``n_ctx``);
``transformers`` chooses per forward by the sequence's length. They agree when the sequence
and the window lie on the same side of the original context, which is how each case is set up.
llama.cpp pads ``n_ctx`` to 256, so its model's original context is 256.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from core_engine.attention import ContiguousAttention
from core_engine.gguf_loader import GGUFFile, load_model
from core_engine.model.rope import longrope_attention_factor
from tests.core_engine.engine_util import make_engine, run_all
from tests.core_engine.hf_factory import save_checkpoint, tiny_hf_model, write_gguf

pytestmark = pytest.mark.slow


def _longrope_phi3(original: int, trained: int, *, seed: int) -> object:
    """A tiny Phi-3 with LongRoPE: random short and long divisors in [1, 4) per pair."""
    gen = torch.Generator().manual_seed(seed)
    half = 64 // 4 // 2  # head_dim / 2
    short, long = (1.0 + 3.0 * torch.rand(half, generator=gen)).tolist(), (1.0 + 3.0 * torch.rand(half, generator=gen)).tolist()
    return tiny_hf_model(
        "phi3", seed=seed, max_position_embeddings=trained, original_max_position_embeddings=original,
        rope_scaling={"rope_type": "longrope", "short_factor": short, "long_factor": long},
    )


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[object, Path, Path]]:
    """Original context 32, trained 128: transformers' long mode is reached by 48 tokens."""
    model = _longrope_phi3(32, 128, seed=0)
    directory = tmp_path_factory.mktemp("longrope")
    yield model, save_checkpoint(model, directory / "checkpoint"), write_gguf(model, directory / "tiny-longrope.gguf")


def _ours(path: Path, ids: list[int], max_model_len: int | None) -> torch.Tensor:
    model, config, _ = load_model(path, dtype=torch.float32, show_progress=False, max_model_len=max_model_len)
    with torch.inference_mode():
        return model(torch.tensor(ids), torch.arange(len(ids)), ContiguousAttention(config.num_layers)).float()


@pytest.mark.parametrize(("num_tokens", "max_model_len"), [(24, 32), (48, None)], ids=["short", "long"])
@pytest.mark.parametrize("fmt", ["checkpoint", "gguf"])
def test_logits_equal_transformers(small: tuple[object, Path, Path], fmt: str, num_tokens: int, max_model_len: int | None) -> None:
    # short: window 32 = original, 24 tokens; long: window 128 (the trained length), 48 tokens.
    hf, checkpoint, gguf_path = small
    ids = list(range(3, 3 + num_tokens))
    ours = _ours(checkpoint if fmt == "checkpoint" else gguf_path, ids, max_model_len)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].float()  # type: ignore[operator]
    assert ours.std() > 1.0
    assert (ours - theirs).abs().max() <= 1e-3


@pytest.mark.parametrize("n_ctx", [256, 512], ids=["short", "long"])
def test_logits_equal_llamacpp(tmp_path: Path, n_ctx: int) -> None:
    import llama_cpp

    path = write_gguf(_longrope_phi3(256, 1024, seed=1), tmp_path / "tiny-longrope-256.gguf")
    scaling = GGUFFile(path).llama_config().rope_scaling
    assert scaling is not None and (scaling.kind, scaling.original_context, scaling.factor) == ("longrope", 256, 4.0)
    assert scaling.attention_factor == pytest.approx(longrope_attention_factor(4.0, 256))
    ids = list(range(3, 51))
    llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=1, logits_all=True,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, verbose=False)
    try:
        assert llm.n_ctx() == n_ctx
        llm.eval(ids)
        lcpp = torch.from_numpy(np.array(llm.scores[: len(ids)]))
    finally:
        llm.close()
    ours = _ours(path, ids, n_ctx)
    assert ours.std() > 1.0
    assert (ours - lcpp).abs().max() <= 1e-3
    other = _ours(path, ids, 768 if n_ctx == 256 else 256)  # the other factor set is far off
    assert (other - lcpp).abs().max() > 0.1


@pytest.mark.parametrize("fmt", ["checkpoint", "gguf"])
def test_the_engine_decodes_what_transformers_generates_in_long_mode(small: tuple[object, Path, Path], fmt: str) -> None:
    # A 40-token prompt is past the original 32 from transformers' first forward on, and the
    # engine's window (the trained 128) is past it too: long factors on both sides throughout.
    hf, checkpoint, gguf_path = small
    engine = make_engine(checkpoint if fmt == "checkpoint" else gguf_path)
    assert engine.max_model_len == 128
    prompt = list(range(3, 43))
    out = run_all(engine, {"p": prompt}, _greedy(16))["p"]["token_ids"]
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):]  # type: ignore[attr-defined]
    assert out == expected.tolist()


def test_the_engine_decodes_what_transformers_generates_in_short_mode(small: tuple[object, Path, Path]) -> None:
    # Window 32: prompt and output (12 + 16 tokens) stay within it, as transformers' short set.
    hf, _, gguf_path = small
    engine = make_engine(gguf_path, max_model_len=32)
    prompt = list(range(3, 15))
    out = run_all(engine, {"p": prompt}, _greedy(16))["p"]["token_ids"]
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):]  # type: ignore[attr-defined]
    assert out == expected.tolist()


def _greedy(n: int):
    from core_engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_kv_blocks_on_disk_are_not_shared_between_short_and_long_factors(
    small: tuple[object, Path, Path], tmp_path: Path
) -> None:
    # max_model_len picks LongRoPE's short or long factors: other K for the same tokens, so
    # the disk tier's key holds the RoPE tables in use.
    _, _, gguf_path = small
    prompt = list(range(3, 3 + 16)) + [1]  # one block of 16 tokens
    params = _greedy(1)

    def cached(max_model_len: int | None) -> dict[str, int]:
        engine = make_engine(gguf_path, max_model_len=max_model_len, kv_disk_dir=str(tmp_path))
        try:
            out = run_all(engine, {"r": prompt}, params)["r"]["outputs"][-1]  # type: ignore[index]
            return dict(out.cached_tokens_by_tier or {})  # type: ignore[attr-defined]
        finally:
            engine.close()

    assert cached(32) == {}
    assert cached(None) == {}  # long factors: the short ones' blocks are not theirs
    assert cached(32) == {"disk": 16} and cached(None) == {"disk": 16}
