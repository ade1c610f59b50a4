"""Each architecture the core engine runs, against two independent oracles: ``transformers``
(a tiny random-weight model built from a small config) and llama.cpp (the same weights as
GGUF), then served through the gateway.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from backends.base import BackendConfig
from core_engine.attention import ContiguousAttention
from core_engine.gguf_loader import GGUFFile, GGUFLoadError, load_model
from gateway.testing import gateway_config, run_gateway
from tests.core_engine.engine_util import make_engine, run_all
from tests.core_engine.hf_factory import ARCHITECTURES, gguf_architecture, tiny_hf_model, write_gguf

pytestmark = pytest.mark.slow

#: Token ids fed teacher-forced (past the control tokens at 0..2).
IDS = list(range(3, 67))


@pytest.fixture(scope="module", params=ARCHITECTURES)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, object, Path]]:
    arch = request.param
    model = tiny_hf_model(arch)
    yield arch, model, write_gguf(model, tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf")


def _ours(path: Path, ids: list[int]) -> torch.Tensor:
    model, config, _ = load_model(path, dtype=torch.float32, show_progress=False)
    with torch.inference_mode():
        return model(torch.tensor(ids), torch.arange(len(ids)), ContiguousAttention(config.num_layers)).float()


def test_logits_equal_transformers_and_llamacpp(tiny: tuple[str, object, Path]) -> None:
    import llama_cpp

    arch, hf, path = tiny
    assert GGUFFile(path).architecture == gguf_architecture(arch)
    ours = _ours(path, IDS)
    with torch.no_grad():
        theirs = hf(torch.tensor([IDS])).logits[0].float()  # type: ignore[operator]
    assert ours.std() > 1.0  # logits spread over units: the 1e-3 check means something
    assert (ours - theirs).abs().max() <= 1e-3, f"{arch}: vs transformers"
    llm = llama_cpp.Llama(str(path), n_ctx=256, n_threads=1, logits_all=True,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, verbose=False)
    try:
        llm.eval(IDS)
        lcpp = torch.from_numpy(np.array(llm.scores[: len(IDS)]))
    finally:
        llm.close()
    # llama.cpp's CPU GELU looks its values up in an fp16 table: Gemma's logits land ~2-4e-3
    # away from exact fp32 (from transformers' as much as from ours); the others ~1e-5.
    bound = 1e-2 if arch.startswith("gemma") else 1e-3
    assert (ours - lcpp).abs().max() <= bound, f"{arch}: vs llama.cpp"


def test_the_engine_decodes_what_transformers_generates(tiny: tuple[str, object, Path]) -> None:
    # The engine's own path: paged KV cache, the scheduler, the decode kernel (dense fp32).
    arch, hf, path = tiny
    engine = make_engine(path)
    prompt = IDS[:12]
    out = run_all(engine, {"p": prompt}, _greedy(16))["p"]["token_ids"]
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):]  # type: ignore[attr-defined]
    assert out == expected.tolist(), arch


def test_the_default_weight_format_stays_close_to_the_exact_model(tiny: tuple[str, object, Path]) -> None:
    arch, _, path = tiny
    exact = _ours(path, IDS)
    engine = make_engine(path, weight_format="auto", dtype="float32")
    with torch.inference_mode():
        packed = engine.model_runner.model(
            torch.tensor(IDS), torch.arange(len(IDS)), ContiguousAttention(engine.model_runner.model.config.num_layers)
        ).float()
    p = exact.log_softmax(-1)
    kl = float((p.exp() * (p - packed.log_softmax(-1))).sum(-1).mean())
    # A mixture of experts moves more: 8-bit activations upstream can flip a token's router
    # choice between near-tied experts (measured 0.029 on this 4-expert model).
    bound = 0.05 if arch in ("qwen3moe", "mixtral") else 0.01
    assert kl < bound, f"{arch}: KL {kl:.4f} of {engine.model_runner.model.weight_format}"


def test_each_architecture_is_served_through_the_gateway(tiny: tuple[str, object, Path]) -> None:
    arch, _, path = tiny
    config = gateway_config(
        BackendConfig(name=arch, kind="core_engine", options={"model_path": str(path), "num_threads": 1}),
        models={arch: [arch]},
    )
    messages = [{"role": "user", "content": "the quick brown fox " * 8}]
    with run_gateway(config) as gateway:
        client = gateway.openai_client(timeout=120.0)
        # ignore_eos (as vLLM takes it): a random model may pick its end token at once.
        fixed = {"max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
        first = client.chat.completions.create(model=arch, messages=messages, **fixed)
        assert first.choices[0].message.content and first.usage.completion_tokens == 8
        chunks = list(client.chat.completions.create(
            model=arch, messages=messages, stream=True, stream_options={"include_usage": True}, **fixed,
        ))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == first.choices[0].message.content
        usage = next(c.usage for c in chunks if c.usage is not None)
        assert usage.prompt_tokens_details.cached_tokens > 0  # the second request reused the prompt's KV


def test_an_unknown_architecture_lists_the_supported_ones(tmp_path: Path) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFLoadError, match=r"'mamba' is not supported \(supported: gemma2, gemma3, llama, phi3, qwen2, qwen3, qwen3moe\)"):
        GGUFFile(tmp_path / "mamba.gguf").llama_config()


def _greedy(n: int):
    from core_engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("arch", ["qwen3moe", "mixtral"])
@pytest.mark.parametrize("file_type", ["Q8_0", "Q4_0"])
def test_moe_experts_are_stored_from_the_files_blocks(arch: str, file_type: str, tmp_path: Path) -> None:
    # llama.cpp's quantiser writes the stacked expert tensors as file_type; the engine stores
    # each expert's products from those blocks (no second rounding) in the matching block
    # format, and the model stays as close to its exactly dequantised self as a dense one.
    from core_engine.model.linear import BlockQuantLinear
    from tests.core_engine.test_tensor_types import llamacpp_quantize

    path = llamacpp_quantize(write_gguf(tiny_hf_model(arch), tmp_path / "f32.gguf"), tmp_path / "q.gguf", file_type)
    exact = _ours(path, IDS)
    model, config, _ = load_model(path, dtype=torch.float32, show_progress=False)
    gguf_file = GGUFFile(path)
    model.set_weight_format("auto")
    fmt = "int8" if file_type == "Q8_0" else "int4"
    for i, layer in enumerate(model.layers):
        gate, up, down = (
            gguf_file.dequantized(f"blk.{i}.ffn_{n}_exps.weight") for n in ("gate", "up", "down")
        )  # (experts, rows, cols)
        for e in range(config.num_experts):
            gate_up, down_e = layer.experts_gate_up.experts[e], layer.experts_down.experts[e]
            assert isinstance(gate_up, BlockQuantLinear) and gate_up.weight_format == fmt
            assert torch.equal(gate_up.dequantized(), torch.cat((gate[e], up[e])))
            assert torch.equal(down_e.dequantized(), down[e])
    assert not [t for t in model.block_source.requantized if "_exps" in t]
    with torch.inference_mode():
        packed = model(torch.tensor(IDS), torch.arange(len(IDS)), ContiguousAttention(config.num_layers)).float()
    p = exact.log_softmax(-1)
    kl = float((p.exp() * (p - packed.log_softmax(-1))).sum(-1).mean())
    assert kl < 0.05, f"{arch} {file_type}: KL {kl:.4f}"
    engine = make_engine(path, weight_format="auto", dtype="float32")
    assert len(run_all(engine, {"p": IDS[:12]}, _greedy(8))["p"]["token_ids"]) == 8
