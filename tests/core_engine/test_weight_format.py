"""Matmul weight storage: fp16-packed weights give the dense model's answers; the block formats
(int4/int8, the default "auto" on CPU) hold the file's own blocks and stay as close to the exact
model as llama.cpp's own arithmetic.

``EngineConfig.weight_format="fp16"`` stores every projection and the LM head as fp16 for
fbgemm (CPU, fp32 compute). The file's weights are 4-bit blocks with fp16 scales, so the fp16 copy is within 2^-11 of each weight: the logits must stay within a small
fraction of their spread and greedy decoding must not change.

``"int4"``/``"int8"`` keep GGUF Q4_1/Q8_0 blocks (taken from the file without a second
rounding) and multiply activations quantised to int8 per block of 32 in the compiled
``quant_linear`` kernel; ``"auto"`` on a Q4_1 file is int4 with the Q8_0 head at int8. The
loss is the 8-bit activations', held to the yardstick llama.cpp sets on the same file: the
mean KL from the exact model's next-token distribution may not exceed twice llama.cpp's.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from backends.default_model import default_model_path
from core_engine.attention import ContiguousAttention
from core_engine.gguf_loader import load_model
from core_engine.model.linear import (
    DenseLinear,
    Fp16Linear,
    TopKRefinedLinear,
    resolve_weight_format,
)
from core_engine.sampling_params import SamplingParams
from tests.core_engine.engine_util import make_engine, reference_greedy, run_all
from tests.core_engine.gguf_factory import write_llama_gguf

TEXT = (
    "The history of the city begins in the early twelfth century, when a small group of farmers "
    "settled along the river. Over the next two hundred years the settlement grew into a busy "
    "market town, and merchants came from the surrounding villages to sell grain and wool."
)
PROMPTS = ("The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,")


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor(ids), torch.arange(len(ids)), ContiguousAttention(model.config.num_layers))


def test_fp16_linear_matches_dense_product_of_fp16_rounded_weights() -> None:
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 80, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(7, 80, generator=gen)
    packed = Fp16Linear(weight, bias)
    expected = torch.nn.functional.linear(x, weight.half().float(), bias)
    torch.testing.assert_close(packed(x), expected, atol=1e-4, rtol=1e-4)
    residual = torch.randn(7, 96, generator=gen)
    torch.testing.assert_close(Fp16Linear(weight).add_to(residual, x), residual + expected - bias, atol=1e-4, rtol=1e-4)
    assert packed.nbytes == 96 * 80 * 2 + 96 * 4
    assert DenseLinear(weight, bias).nbytes == 96 * 80 * 4 + 96 * 4


def test_weight_format_is_validated() -> None:
    # A 4-bit file on a CPU: int4; anything else unknown: int8; an explicit format as named.
    assert resolve_weight_format("auto", dtype=torch.float32, device="cpu", file_type="Q4_1") == "int4"
    assert resolve_weight_format("auto", dtype=torch.bfloat16, device="cpu", file_type="F16") == "int8"
    assert resolve_weight_format("fp16", dtype=torch.float32, device="cpu") == "fp16"
    assert resolve_weight_format("dense", dtype=torch.bfloat16, device="cpu") == "dense"
    with pytest.raises(ValueError, match="weight_format='fp16' with dtype='bfloat16' on cpu"):
        resolve_weight_format("fp16", dtype=torch.bfloat16, device="cpu")


def test_packing_frees_the_dense_weights_and_keeps_the_outputs(tmp_path) -> None:
    path = write_llama_gguf(tmp_path / "tiny.gguf")
    model, config, tok = load_model(path, dtype=torch.float32, show_progress=False)
    ids = tok.encode(TEXT)
    dense = _logits(model, ids)
    dense_bytes = model.matmul_weight_bytes()
    assert model.set_weight_format("fp16") == "fp16"
    assert model.layers[0].qkv_proj is None and model.layers[0].gate_up_proj is None
    assert model.matmul_weight_bytes() == dense_bytes // 2
    packed = _logits(model, ids)
    # The tiny model's weights are arbitrary fp32 values, each rounded by up to 2^-11 relative.
    assert (packed - dense).abs().max() <= 5e-3 * dense.abs().max()
    assert model.set_weight_format("fp16") == "fp16"  # idempotent
    with pytest.raises(ValueError, match="already packed"):
        model.set_weight_format("dense")


def test_smollm2_fp16_weights_decode_like_dense_fp32() -> None:
    path = default_model_path()
    dense = make_engine(path, weight_format="dense")
    packed = make_engine(path, weight_format="fp16")
    assert dense.model_runner.model.weight_format == "dense"
    assert packed.model_runner.model.weight_format == "fp16"
    tok = dense.tokenizer
    ids = tok.encode(TEXT)
    a, b = _logits(dense.model_runner.model, ids), _logits(packed.model_runner.model, ids)
    assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) >= 0.99
    assert (a - b).abs().max() <= 0.01 * a.abs().max()
    for prompt in PROMPTS:
        prompt_ids = tok.encode(prompt)
        assert reference_greedy(packed, prompt_ids, 24) == reference_greedy(dense, prompt_ids, 24), prompt


# -- block formats ---------------------------------------------------------------------


def _kernel(march: str = "native"):
    from core_engine.kernels.cpu import cpu_extension

    return cpu_extension("quant_linear", march)


def _reference_block_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in torch: x quantised to int8 per block of 32 (scale max/127,
    round half to even), times the dequantised weight, in float64."""
    rows, k = x.shape
    blocks = x.double().view(rows, k // 32, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    codes = torch.where(scale > 0, torch.round(blocks / torch.where(scale > 0, scale, 1)), 0)
    return (codes * scale).view(rows, k) @ weight.double().t()


@pytest.mark.parametrize("weight_format", ["int4", "int8"])
def test_block_kernel_is_the_product_of_the_blocks_with_8_bit_block_activations(weight_format: str) -> None:
    from core_engine.model.block_weights import quantize_dense
    from core_engine.model.linear import BlockQuantLinear

    gen = torch.Generator().manual_seed(3)
    for out, k in ((200, 96), (67, 576), (33, 160)):  # K of 3, 18 and 5 blocks: padded groups
        weight, bias = torch.randn(out, k, generator=gen), torch.randn(out, generator=gen)
        lin = BlockQuantLinear(*quantize_dense(weight, weight_format), bias)
        exact = lin.dequantized()
        # The format is within one 4-bit (8-bit) step of each weight.
        step = (weight.abs().amax(1, keepdim=True) / (7.5 if weight_format == "int4" else 127)).expand_as(weight)
        assert ((exact - weight).abs() <= step + 1e-3).all()
        for rows in (1, 2, 3, 4, 5, 17, 40):
            x = torch.randn(rows, k, generator=gen) * 2
            expected = (_reference_block_product(x, exact) + bias.double()).float()
            lin.dense_rows = 1 << 30
            torch.testing.assert_close(lin(x), expected, atol=2e-4, rtol=1e-4)
            # Prefill-sized inputs: dequantised tiles through the dense GEMM, the same products
            # (so a token's logits do not depend on how many rows its step has).
            lin.dense_rows = 1
            torch.testing.assert_close(lin(x), expected, atol=2e-4, rtol=1e-4)
        lin.dense_rows = 1 << 30
        zeros = torch.zeros(3, k)  # an all-zero block has no scale to take: must not divide by zero
        torch.testing.assert_close(lin(zeros), bias.expand(3, out))


def test_block_kernel_fuses_norm_swiglu_bias_and_residual_and_takes_bf16() -> None:
    from core_engine.model.block_weights import quantize_dense
    from core_engine.model.linear import BlockQuantLinear
    from core_engine.model.rope import apply_rotary

    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(70, 128, generator=gen)
    lin = BlockQuantLinear(*quantize_dense(weight, "int4"), None)
    exact = lin.dequantized()
    x, residual = torch.randn(6, 128, generator=gen), torch.randn(6, 70, generator=gen)
    norm = torch.rand(128, generator=gen) + 0.5
    h = torch.nn.functional.rms_norm(x, (128,), norm, 1e-5)
    torch.testing.assert_close(lin.normed(x, norm, 1e-5), _reference_block_product(h, exact).float(), atol=2e-4, rtol=1e-4)
    gate_up = torch.randn(6, 256, generator=gen)
    act = torch.nn.functional.silu(gate_up[:, :128]) * gate_up[:, 128:]
    torch.testing.assert_close(
        lin.swiglu_add_to(residual, gate_up), residual + _reference_block_product(act, exact).float(), atol=2e-4, rtol=1e-4
    )
    torch.testing.assert_close(lin.add_to(residual, x), residual + _reference_block_product(x, exact).float(), atol=2e-4, rtol=1e-4)
    # RoPE on the first heads of the output (a fused QKV): as the dense model rotates them.
    angles = torch.rand(6, 1, 32, generator=gen) * 6
    lin64 = BlockQuantLinear(*quantize_dense(torch.randn(5 * 64, 128, generator=gen), "int4"), None)
    for rows in (1 << 30, 1):
        lin64.dense_rows = rows
        fused = lin64.normed_rope(x, norm, 1e-5, angles.cos(), angles.sin(), 3, 64)
        plain = lin64.normed(x, norm, 1e-5).view(6, 5, 64)  # the same products, RoPE in torch
        unfused = torch.cat((apply_rotary(plain[:, :3], angles.cos(), angles.sin()), plain[:, 3:]), dim=1)
        assert fused.shape == (6, 5, 64)
        torch.testing.assert_close(fused, unfused, atol=1e-4, rtol=1e-4)
    out = lin(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _reference_block_product(x.bfloat16().float(), exact).float(), atol=0.05, rtol=0.02)


#: Builds of the kernel this CPU can run besides its own: the portable loops (no AVX2), the
#: AVX2 path (maddubs) and, where the CPU has AVX-VNNI and Alder Lake's other extensions, the
#: ymm dpbusd path. (march, isa it takes, CPU flags it needs.)
_OTHER_BUILDS = (
    ("x86-64", "scalar", frozenset()),
    ("haswell", "avx2", frozenset({"avx2", "fma", "f16c", "bmi2", "movbe"})),
    ("alderlake", "avx-vnni", frozenset({"avx2", "avx_vnni", "gfni", "vaes", "vpclmulqdq", "sha_ni", "movdiri", "serialize"})),
)


@pytest.mark.parametrize(("march", "isa", "needs"), _OTHER_BUILDS, ids=[b[0] for b in _OTHER_BUILDS])
def test_every_build_of_the_block_kernel_gives_this_cpus_floats(march: str, isa: str, needs: frozenset[str]) -> None:
    from core_engine.cpu_features import cpu_flags
    from core_engine.model.block_weights import quantize_dense

    if not needs <= cpu_flags():
        pytest.skip(f"this CPU cannot run an -march={march} build (lacks {sorted(needs - cpu_flags())})")
    native, other = _kernel(), _kernel(march)
    assert other.isa() == isa
    gen = torch.Generator().manual_seed(5)
    for weight_format in ("int4", "int8"):
        q, d, m = quantize_dense(torch.randn(45, 160, generator=gen), weight_format)
        packed = native.quant_pack(q, d, m)
        assert torch.equal(other.quant_pack(q, d, m), packed)
        for rows in (1, 3, 9, 20):
            x = torch.randn(rows, 160, generator=gen)
            # Every build sums each output in the same order: the same floats.
            assert torch.equal(other.quant_linear(x, packed, 45), native.quant_linear(x, packed, 45))
        assert torch.equal(other.quant_dequantize(q, d, m), native.quant_dequantize(q, d, m))
        assert torch.equal(other.packed_dequantize(packed, 45), native.quant_dequantize(q, d, m))
        # Prefill-sized inputs: weight tiles dequantised to the input's dtype (bf16 rounded to
        # nearest even in every build) through the same GEMM.
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(40, 160, generator=gen).to(dtype)
            ours = native.quant_linear(x, packed, 45, dense_rows=32)
            theirs = other.quant_linear(x, packed, 45, dense_rows=32)
            assert ours.dtype == dtype
            torch.testing.assert_close(ours.float(), theirs.float(), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("qtype_name", ["Q4_0", "Q4_1", "Q4_K", "Q8_0"])
def test_file_blocks_are_taken_without_a_second_rounding(qtype_name: str) -> None:
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    from core_engine.model.block_weights import from_gguf_blocks
    from core_engine.model.linear import BlockQuantLinear

    qtype = GGMLQuantizationType[qtype_name]
    rows, cols = 24, 512
    rng = np.random.default_rng(6)
    if qtype == GGMLQuantizationType.Q4_K:  # gguf cannot write Q4_K: random super-blocks are valid ones
        raw = rng.integers(0, 256, size=(rows, cols // 256 * 144), dtype=np.uint8)
        halves = raw.reshape(-1, 144)[:, :4].copy().view(np.float16)
        halves[:] = rng.uniform(0.001, 0.01, size=halves.shape).astype(np.float16)
        raw.reshape(-1, 144)[:, :4] = halves.view(np.uint8)
    else:
        raw = quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    expected = torch.from_numpy(quants.dequantize(raw, qtype).reshape(rows, cols).astype(np.float32))
    lin = BlockQuantLinear(*from_gguf_blocks(raw, qtype, rows, cols))
    assert lin.weight_format == ("int8" if qtype == GGMLQuantizationType.Q8_0 else "int4")
    tol = 2e-3 * expected.abs().max() if qtype == GGMLQuantizationType.Q4_K else 0  # fp16 d * sc
    assert (lin.dequantized() - expected).abs().max() <= tol


def test_every_weight_format_and_dtype_runs_on_this_cpu_or_is_refused_at_config_load(tmp_path) -> None:
    from core_engine.config import EngineConfig

    path = write_llama_gguf(tmp_path / "tiny.gguf")
    refused = []
    for weight_format in ("auto", "dense", "fp16", "int8", "int4"):
        for dtype in ("auto", "float32", "bfloat16", "float16"):
            try:
                EngineConfig(model_path=str(path), weight_format=weight_format, dtype=dtype)  # type: ignore[arg-type]
            except ValueError as exc:
                assert f"weight_format={weight_format!r} with EngineConfig.dtype={dtype!r}" in str(exc)
                refused.append((weight_format, dtype))
                continue
            engine = make_engine(path, weight_format=weight_format, dtype=dtype)
            out = run_all(engine, {"a": "hello"}, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
            assert len(out["a"]["token_ids"]) == 3, (weight_format, dtype)
    assert set(refused) == {("fp16", "bfloat16"), ("fp16", "float16"), ("int8", "float16"), ("int4", "float16")}
    for weight_format in ("fp16", "int8"):
        with pytest.raises(ValueError, match=f"weight_format={weight_format!r} .* on 'cuda'"):
            EngineConfig(model_path=str(path), weight_format=weight_format, device="cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="weight_format must be one of auto, dense, fp16, int8, int4; got 'int3'"):
        resolve_weight_format("int3", dtype=torch.float32, device="cpu")


def test_auto_on_a_4_bit_file_is_int4_with_the_8_bit_head_at_int8_from_the_files_blocks() -> None:
    from gguf import GGMLQuantizationType, quants

    from core_engine.model.linear import BlockQuantLinear

    path = default_model_path()
    packed = make_engine(path, weight_format="auto")
    model = packed.model_runner.model
    assert model.weight_format == "int4" and model.layer_formats == {"head": "int8"}
    assert isinstance(model.layers[0].down, BlockQuantLinear) and model.layers[0].down.weight_format == "int4"
    assert model.block_source.requantized == []  # every product from the file's own blocks
    record = model.block_source.gguf_file.tensor("blk.3.ffn_down.weight")
    rows, cols = (int(n) for n in reversed(record.shape.tolist()[:2]))
    file_weights = torch.from_numpy(quants.dequantize(record.data, GGMLQuantizationType.Q4_1).reshape(rows, cols))
    assert torch.equal(model.layers[3].down.dequantized(), file_weights.float())
    # Resident: the blocks (5/8 byte per int4 weight, 34/32 per int8) + the dense embedding table.
    assert model.resident_weight_bytes() < 0.45 * make_engine(path, weight_format="dense").model_runner.model.resident_weight_bytes()
    # Every product came from the file's blocks, so the loader never dequantised them (most of
    # the load's time); such a model can only be packed into block formats.
    assert model.products_unread


def test_a_model_loaded_without_its_dense_products_refuses_a_dense_format() -> None:
    from core_engine.gguf_loader import load_model

    model, _, _ = load_model(default_model_path(), dtype=torch.float32, packs_from_blocks=lambda file_type: file_type == "Q4_1")
    assert model.products_unread
    for weight_format in ("dense", "fp16"):
        with pytest.raises(ValueError, match="dense weights were not loaded"):
            model.set_weight_format(weight_format)
    with pytest.raises(ValueError, match="dense weights were not loaded"):
        model.set_weight_format("int4", layer_formats={"head": "dense"})


def test_smollm2_block_formats_stay_as_close_to_exact_as_llamacpp() -> None:
    import llama_cpp
    import numpy as np

    path = default_model_path()
    dense = make_engine(path, weight_format="dense")
    ids = dense.tokenizer.encode(TEXT * 3)
    exact = _logits(dense.model_runner.model, ids)
    llm = llama_cpp.Llama(str(path), n_ctx=512, n_threads=1, logits_all=True, verbose=False)
    try:
        llm.eval(ids)
        theirs = torch.from_numpy(np.array(llm.scores[: len(ids)]))
    finally:
        llm.close()

    def kl_from_exact(logits: torch.Tensor) -> float:
        p = exact.log_softmax(-1)
        return float((p.exp() * (p - logits.float().log_softmax(-1))).sum(-1).mean())

    llama_kl = kl_from_exact(theirs)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = {f"p{i}": prompt for i, prompt in enumerate(PROMPTS)}
    for weight_format in ("auto", "int8"):
        packed = make_engine(path, weight_format=weight_format)
        ours = _logits(packed.model_runner.model, ids)
        ours_kl = kl_from_exact(ours)
        assert ours_kl <= 2 * llama_kl, f"{weight_format} KL {ours_kl:.5f} vs llama.cpp's {llama_kl:.5f}"
        assert float((ours.argmax(-1) == exact.argmax(-1)).float().mean()) >= 0.9
        # Decode rows are quantised one by one: a request's tokens do not depend on the
        # requests decoded beside it.
        together = run_all(packed, prompts, greedy)
        for key, prompt in prompts.items():
            alone = run_all(packed, {key: prompt}, greedy)[key]
            assert alone["token_ids"] == together[key]["token_ids"], (weight_format, prompt)


def test_topk_refined_head_makes_the_top_logits_exact() -> None:
    from core_engine.model.block_weights import quantize_dense
    from core_engine.model.linear import BlockQuantLinear

    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(500, 64, generator=gen)
    x = torch.randn(6, 64, generator=gen)
    exact = x @ weight.T
    head = TopKRefinedLinear(BlockQuantLinear(*quantize_dense(weight, "int8")), weight, k=8)
    refined = head(x)
    assert head(x[:0]).shape == (0, 500)  # a prefill chunk that samples nothing
    top = exact.topk(8, dim=-1).indices
    torch.testing.assert_close(refined.gather(1, top), exact.gather(1, top), atol=1e-5, rtol=1e-5)
    assert torch.equal(refined.argmax(-1), exact.argmax(-1))
    assert (refined - exact).abs().max() < 0.5  # the rest: 8-bit products


# -- the policy at load -----------------------------------------------------------------


def test_per_layer_formats_and_the_log_say_what_was_chosen_and_why(caplog) -> None:
    from core_engine.model.linear import BlockQuantLinear

    path = default_model_path()
    with caplog.at_level("INFO", logger="core_engine.llm_engine"):
        engine = make_engine(path, weight_format="auto", layer_weight_formats={"layers.0.*": "dense", "layers.*.down": "int8"})
    model = engine.model_runner.model
    assert isinstance(model.layers[0].qkv, DenseLinear) and isinstance(model.layers[0].down, DenseLinear)
    assert model.layers[5].down.weight_format == "int8" and model.layers[5].qkv.weight_format == "int4"
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("matmul weights"))
    assert "int4" in line and "layers.0.*=dense" in line and "Q4_1 file" in line, line
    assert isinstance(model.head.__class__, type) and isinstance(model.layers[5].o, BlockQuantLinear)


def test_a_weight_budget_keeps_the_most_sensitive_layers_dense_and_fits() -> None:
    path = default_model_path()
    fast = make_engine(path, weight_format="auto").model_runner.model.resident_weight_bytes()
    dense = make_engine(path, weight_format="dense").model_runner.model.resident_weight_bytes()
    budget = fast + (dense - fast) // 4
    engine = make_engine(path, weight_format="auto", weight_memory_bytes=budget)
    model = engine.model_runner.model
    dense_layers = {n.rsplit(".", 1)[0] for n, f in model.layer_formats.items() if f == "dense"}
    assert dense_layers, "a budget above the fast format's size keeps some layers dense"
    assert fast < model.resident_weight_bytes() <= budget
    with pytest.raises(ValueError, match="weight_memory_bytes=1000 is below"):
        make_engine(path, weight_format="auto", weight_memory_bytes=1000)
