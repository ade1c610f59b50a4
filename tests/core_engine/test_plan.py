"""``infermux plan`` / ``plan_model``: memory and roofline arithmetic on the real default model.

The default model is SmolLM2-135M-Instruct Q4_1: 30 layers, 3 kv heads of 64, tied
embeddings. The arithmetic tests run on device figures built by hand (:data:`HAND_CPU`,
injected in place of the live probe, and the datasheet rows): every expected figure and
every ordering below follows from those numbers, never from a timing taken on a machine
shared with other work. The live probe of this CPU runs once (``live_cpu``), and its one
test checks only that each figure is a finite positive number labelled with its source.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest

from backends.default_model import default_model_path
from core_engine.gguf_loader import GGUFFile
from core_engine.model.formats import bytes_per_weight
from core_engine.plan import DeviceSpec, Figure, Plan, PlanError, plan_model
from core_engine.plan.estimate import CALLS_PER_LAYER, kv_bytes_per_token, step_overhead_s
from gateway.cli import main
from tests.core_engine.gguf_factory import TinyLlamaSpec, write_llama_gguf

MODEL = default_model_path()


def _figure(value: float, source: str = "measured") -> Figure:
    return Figure(value=value, source=source, note="set by the test")  # type: ignore[arg-type]


#: A CPU described by hand, in place of the live probe: 20 GB/s of read bandwidth, a 400
#: GFLOP/s fp32 GEMM, int8/int4 kernels at 300/200 GOP/s that read weights at one row at
#: 16/10 GB/s, 10 us per kernel call, 16 GB available.
HAND_CPU = DeviceSpec(
    name="cpu",
    description="a CPU described by the test",
    kind="cpu",
    compute_dtype="float32",
    weight_formats=("dense", "int8", "int4"),
    has_fp8_kv=True,
    memory_bytes=_figure(16e9, "system"),
    memory_bandwidth=_figure(20e9),
    flops={"float32": _figure(400e9)},
    int8_ops=_figure(1600e9, "estimated"),
    kernel_ops={"int8": _figure(300e9), "int4": _figure(200e9)},
    kernel_stream={"int8": _figure(16e9), "int4": _figure(10e9)},
    call_overhead_s=_figure(10e-6),
    cpu_family="avx512",
    has_native_bf16=False,
    num_threads=2,
)


def _fake_probe(spec: DeviceSpec) -> Callable[..., DeviceSpec]:
    """``probe.cpu_spec`` answering ``spec``, announcing a measurement as the real one does."""

    def cpu_spec(config: object, *, measure: bool = True, progress: Callable[[str], None] | None = None) -> DeviceSpec:
        if measure and progress is not None:
            progress("measuring (figures set by the test)...")
        return spec

    return cpu_spec


@pytest.fixture()
def on_device(monkeypatch: pytest.MonkeyPatch) -> Callable[[DeviceSpec], None]:
    """``on_device(spec)``: ``--device cpu`` plans with ``spec`` instead of measuring."""
    from core_engine.plan import probe

    def inject(spec: DeviceSpec) -> None:
        monkeypatch.setattr(probe, "cpu_spec", _fake_probe(spec))

    return inject


def plan_on(spec: DeviceSpec, **options: object) -> Plan:
    """``plan_model(MODEL, device="cpu", ...)`` with ``spec`` as the probe's answer."""
    from core_engine.plan import probe

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(probe, "cpu_spec", _fake_probe(spec))
        return plan_model(MODEL, device="cpu", **options)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def cpu_plan() -> Plan:
    """The plan on :data:`HAND_CPU`."""
    return plan_on(HAND_CPU)


@pytest.fixture(scope="module")
def local_plan() -> Plan:
    """This machine's CPU without measurements: memory, dtypes, the policy's choice."""
    return plan_model(MODEL, measure=False)


@pytest.fixture(scope="module")
def h100_plan() -> Plan:
    return plan_model(MODEL, device="h100")


@pytest.fixture(scope="module")
def live_cpu() -> Iterator[tuple[Plan, list[str]]]:
    """The one live probe of this CPU, and the progress lines it printed."""
    lines: list[str] = []
    yield plan_model(MODEL, progress=lines.append), lines


def _run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(["plan", *argv])
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_kv_bytes_per_token_of_smollm2(cpu_plan: Plan, h100_plan: Plan) -> None:
    config = cpu_plan.config
    assert kv_bytes_per_token(config, "float32", 16) == 2 * 30 * 3 * 64 * 4 == 46080
    assert kv_bytes_per_token(config, "bfloat16", 16) == 2 * 30 * 3 * 64 * 2
    # int8/fp8 codes: one byte each, plus a float32 scale per (layer, K/V, kv head) per block of 16.
    quantized = 2 * 30 * 3 * 64 * 1 + 2 * 30 * 3 * 4 / 16
    for kv in ("int8", "fp8_e4m3"):
        assert cpu_plan.row("int4", kv).kv_bytes_per_token == quantized
        assert cpu_plan.row("int4", kv).kv_bytes_per_request == quantized * 8192
    compute = cpu_plan.device.compute_dtype
    assert cpu_plan.row("dense", compute).kv_bytes_per_token == kv_bytes_per_token(config, compute, 16)
    assert h100_plan.row("int4", "bfloat16").kv_bytes_per_token == 23040


def test_weight_bytes_follow_the_files_tensor_shapes(local_plan: Plan, h100_plan: Plan) -> None:
    gguf_file = GGUFFile(MODEL)
    counts = {t.name: int(t.n_elements) for t in gguf_file.tensors}
    embedding = counts.pop("token_embd.weight")
    assert "output.weight" not in counts  # tied: the head multiplies the embedding table
    products = sum(n for name, n in counts.items() if len(gguf_file.tensor(name).shape) == 2)
    vectors = sum(counts.values()) - products
    assert (products, embedding, vectors) == (30 * 3_538_944, 49152 * 576, 61 * 576)

    plan = local_plan  # this CPU's formats (fp16 where fbgemm is built) and compute dtype
    dense = plan.device.compute_dtype
    size = {"float32": 4, "bfloat16": 2}[dense]
    # dense: the head is the embedding table itself, held once.
    assert plan.row("dense", dense).weight_bytes == (products + embedding + vectors) * size
    for fmt, dtype_size in (("fp16", 4), ("int8", size), ("int4", size)):
        if fmt not in plan.device.weight_formats:
            continue
        expected = round((products + embedding) * bytes_per_weight(fmt)) + (embedding + vectors) * dtype_size
        assert plan.row(fmt, dense).weight_bytes == expected, fmt
    assert h100_plan.row("int4", "int8").weight_bytes == round((products + embedding) * 20 / 32) + (embedding + vectors) * 2
    assert h100_plan.row("dense", "int8").weight_bytes == (products + embedding + vectors) * 2


def test_untied_head_is_one_product_next_to_the_embedding_table(tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "tiny.gguf", spec=TinyLlamaSpec(tie_embeddings=False))
    plan = plan_model(path, device="h100")
    counts = {t.name: int(t.n_elements) for t in GGUFFile(path).tensors}
    total = sum(counts.values())
    assert plan.row("dense", "bfloat16").weight_bytes == total * 2
    head, embedding = counts["output.weight"], counts["token_embd.weight"]
    int8 = plan.row("int8", "bfloat16").weight_bytes
    assert int8 == round((plan.weights.layer_params + head) * 34 / 32) + (embedding + plan.weights.vector_params) * 2


def test_largest_concurrency_fits_and_one_more_does_not(cpu_plan: Plan, h100_plan: Plan) -> None:
    for plan in (cpu_plan, h100_plan):
        assert plan.usable_memory_bytes == int(plan.device.memory_bytes.value * 0.9)
        for row in plan.rows:
            assert row.max_concurrency > 0
            assert row.weight_bytes + row.max_concurrency * row.kv_bytes_per_request <= plan.usable_memory_bytes
            assert row.weight_bytes + (row.max_concurrency + 1) * row.kv_bytes_per_request > plan.usable_memory_bytes
            assert row.fits_concurrency == (row.max_concurrency >= 32)
    # A quarter of the bytes per token: four times the requests, give or take the weights.
    assert h100_plan.row("int4", "int8").max_concurrency >= 1.9 * h100_plan.row("int4", "bfloat16").max_concurrency


#: :data:`HAND_CPU` with kernels and a GEMM too slow for the bandwidth: compute binds.
SLOW_CPU = msgspec.structs.replace(
    HAND_CPU, flops={"float32": _figure(4e9)}, kernel_ops={"int8": _figure(2e9), "int4": _figure(1e9)}
)


def test_decode_is_the_lesser_bound_plus_the_call_overhead_and_says_which(cpu_plan: Plan, h100_plan: Plan) -> None:
    slow_plan = plan_on(SLOW_CPU)
    for plan in (cpu_plan, slow_plan, h100_plan):
        bandwidth = plan.device.memory_bandwidth
        assert bandwidth is not None
        # The fixed cost of the step's kernel calls: 5 per layer and the head's, 10 us each
        # on the hand-built CPUs; the datasheet GPU has none.
        overhead = 0.0 if plan is h100_plan else (CALLS_PER_LAYER * 30 + 1) * 10e-6
        assert step_overhead_s(plan.device, plan.config) == pytest.approx(overhead)
        for row in plan.rows:
            assert row.decode_ops_per_s is not None
            compute = row.decode_ops_per_s / (2 * plan.weights.matmul_params)
            for n, tok_s, bound in ((1, row.decode_tok_s_batch1, row.bound_batch1),
                                    (32, row.decode_tok_s_concurrency, row.bound_concurrency)):
                kv_read = n * row.kv_bytes_per_token * 8192 / 2
                memory = n * bandwidth.value / (row.weight_bytes_read_per_step + kv_read)
                # "auto": the file's own precisions, timed with the int4 kernel's figures
                stream = plan.device.kernel_stream.get("int4" if row.weight_format == "auto" else row.weight_format)
                if n == 1 and stream is not None:  # batch 1 on a CPU: the kernel's own read rate
                    memory = 1 / (row.weight_bytes_read_per_step / min(bandwidth.value, stream.value)
                                  + kv_read / bandwidth.value)
                assert tok_s == pytest.approx(n / (n / min(memory, compute) + overhead))
                assert bound == ("memory" if memory <= compute else "compute")
            assert row.decode_tok_s_batch1 is not None and row.decode_tok_s_concurrency is not None
            assert row.decode_tok_s_batch1 <= bandwidth.value / row.weight_bytes_read_per_step
            assert row.decode_tok_s_concurrency >= row.decode_tok_s_batch1
            assert row.prefill_tok_s is not None and row.prefill_tok_s > 0
    # What the injected figures decide: 20 GB/s against >= 200 GOP/s binds on memory at
    # batch 1; 1-4 GOP/s binds on compute.
    assert {row.bound_batch1 for row in cpu_plan.rows} == {"memory"}
    assert {row.bound_batch1 for row in slow_plan.rows} == {"compute"}
    # ... and with memory binding, fewer weight bytes (int4 0.625 B, int8 1.0625 B, dense 4 B
    # a weight) at a kernel read rate no lower than a third of the bandwidth decode faster.
    rates = [cpu_plan.row(fmt, "float32").decode_tok_s_batch1 or 0.0 for fmt in ("int4", "int8", "dense")]
    assert rates == sorted(rates, reverse=True) and rates[-1] > 0
    # One figure written out: int4 products and head 134,479,872 x 0.625 B plus 35,136 norm
    # weights x 4 B read at 10 GB/s, 46,080 B x 4096 tokens of float32 KV at 20 GB/s, 151 calls.
    int4 = cpu_plan.row("int4", "float32")
    assert int4.weight_bytes_read_per_step == 134_479_872 * 20 // 32 + 35_136 * 4
    assert int4.decode_tok_s_batch1 == pytest.approx(1 / (84_190_464 / 10e9 + 188_743_680 / 20e9 + 151 * 10e-6), rel=1e-12)


def test_int8_and_int4_decode_take_the_kernels_figure_else_the_estimate(cpu_plan: Plan) -> None:
    ops = {row.weight_format: (row.decode_ops_per_s, row.decode_ops_source) for row in cpu_plan.rows}
    assert ops == {"dense": (400e9, "measured"), "int8": (300e9, "measured"), "int4": (200e9, "measured"),
                   "auto": (200e9, "measured")}  # "auto": the int4 kernel's figures
    unmeasured = plan_on(msgspec.structs.replace(HAND_CPU, kernel_ops={}))
    for fmt in ("int8", "int4"):
        assert unmeasured.row(fmt, "float32").decode_ops_per_s == 1600e9
        assert unmeasured.row(fmt, "float32").decode_ops_source == "estimated"
    # Prefill multiplies dequantised tiles through the fp32 GEMM (tile_prefill), or without
    # it runs the kernel's dot products.
    assert cpu_plan.row("int4", "float32").prefill_ops_per_s == 400e9
    no_tiles = plan_on(msgspec.structs.replace(HAND_CPU, tile_prefill=False))
    assert no_tiles.row("int4", "float32").prefill_ops_per_s == 200e9


def _finite_positive(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value > 0


def test_the_live_cpu_probe_gives_finite_positive_figures_with_their_sources(
    live_cpu: tuple[Plan, list[str]],
) -> None:
    # Only the figures' presence and labels: their sizes depend on what else the machine runs.
    plan, progress = live_cpu
    spec = plan.device
    assert spec.memory_bytes.source == "system" and "MemAvailable" in spec.memory_bytes.note
    measured = {"bandwidth": spec.memory_bandwidth, "call overhead": spec.call_overhead_s,
                **{f"{dtype} GEMM": figure for dtype, figure in spec.flops.items()},
                **{f"{fmt} kernel": figure for fmt, figure in spec.kernel_ops.items()},
                **{f"{fmt} kernel stream": figure for fmt, figure in spec.kernel_stream.items()}}
    assert {"float32 GEMM", "int8 kernel", "int4 kernel", "int8 kernel stream", "int4 kernel stream"} <= set(measured)
    for name, figure in measured.items():
        assert figure is not None and figure.source == "measured", name
        assert _finite_positive(figure.value), (name, figure)
    assert _finite_positive(spec.memory_bytes.value)
    # The int8 estimate is a stated multiple of the fp32 GEMM, not a timing of its own.
    assert spec.int8_ops is not None and spec.int8_ops.source == "estimated"
    assert spec.int8_ops.value in (spec.flops["float32"].value * f for f in (1, 2, 4))
    for row in plan.rows:
        for value in (row.decode_tok_s_batch1, row.decode_tok_s_concurrency, row.prefill_tok_s):
            assert _finite_positive(value), row
    assert plan.row("int4", spec.compute_dtype).decode_ops_source == "measured"
    assert sum(line.startswith("measuring") for line in progress) >= len(measured)


def test_named_gpu_rows_use_the_datasheet_table(h100_plan: Plan) -> None:
    spec = h100_plan.device
    assert spec.memory_bytes.value == 80e9 and spec.memory_bytes.source == "datasheet"
    assert spec.memory_bandwidth is not None and spec.memory_bandwidth.value == 3.35e12
    assert {(r.weight_format, r.kv_dtype) for r in h100_plan.rows} == {
        (f, kv) for f in ("dense", "int8", "int4") for kv in ("bfloat16", "int8", "fp8_e4m3")
    }
    a100 = plan_model(MODEL, device="a100-80g")
    assert {r.kv_dtype for r in a100.rows} == {"bfloat16", "int8"}  # no fp8 hardware
    assert h100_plan.choice.weight_format == "int4"  # a Q4_1 file on CUDA: W4A16
    assert h100_plan.row("auto", "auto") is h100_plan.row("int4", "bfloat16")


def test_policy_choice_is_the_auto_weight_format(local_plan: Plan) -> None:
    from core_engine.model.formats import auto_weight_format

    auto = auto_weight_format("cpu", getattr(__import__("torch"), local_plan.device.compute_dtype), "Q4_1")
    assert local_plan.file_type == "Q4_1"
    assert local_plan.choice.weight_format == auto.weight_format
    assert auto.reason in local_plan.choice.weight_reason
    assert local_plan.choice.kv_dtype == local_plan.device.compute_dtype


def test_row_names_the_argument_it_does_not_know(h100_plan: Plan) -> None:
    with pytest.raises(PlanError) as info:
        h100_plan.row("fp16", "bfloat16")  # CPU only
    assert info.value.param == "weight_format"
    with pytest.raises(PlanError) as info:
        h100_plan.row("int4", "float32")
    assert info.value.param == "kv_dtype"


def test_cli_text_names_every_format_and_the_choice(
    cpu_plan: Plan, on_device: Callable[[DeviceSpec], None], capsys: pytest.CaptureFixture[str]
) -> None:
    on_device(HAND_CPU)
    code, out, err = _run_cli(["--model", str(MODEL)], capsys)
    assert code == 0
    assert "measuring" in err and "measuring" not in out  # progress goes to stderr
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["FORMAT", "KV"]) + 1
    table = [line.split() for line in lines[start : lines.index("", start)]]
    assert len(table) == len(cpu_plan.rows)
    formats = {cells[1] if cells[0] == "*" else cells[0] for cells in table}
    # ... and "auto": SmolLM2's Q4_1 file with its Q8_0 head, as the engine's default holds it.
    assert formats == {*cpu_plan.device.weight_formats, "auto"}
    assert sum(cells[0] == "*" for cells in table) == 1
    assert next(cells for cells in table if cells[0] == "*")[1] == "auto"
    choice = next(line for line in out.splitlines() if line.startswith("choice"))
    assert f"{cpu_plan.choice.weight_format} weights" in choice
    assert cpu_plan.choice.weight_reason in out
    assert "estimated" in out and "10%" in out


def test_cli_json_has_the_rows(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / MODEL.name).symlink_to(MODEL)  # a directory holding one .gguf
    code, out, _ = _run_cli(["--model", str(tmp_path), "--device", "h100", "--json", "--concurrency", "4"], capsys)
    assert code == 0
    plan = json.loads(out)
    assert plan["inputs"]["concurrency"] == 4 and plan["inputs"]["device"] == "h100"
    assert plan["device"]["memory_bytes"] == {"value": 80e9, "source": "datasheet", "note": plan["device"]["reference"]}
    assert len(plan["rows"]) == 9
    row = next(r for r in plan["rows"] if (r["weight_format"], r["kv_dtype"]) == ("int4", "fp8_e4m3"))
    assert row["kv_bytes_per_token"] == 2 * 30 * 3 * 64 + 2 * 30 * 3 * 4 / 16
    assert plan["choice"]["weight_format"] == "int4"


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--model", "/nonexistent/model.gguf"], "--model"),
        (["--model", "pyproject.toml"], "--model"),
        (["--model", str(MODEL), "--device", "tpu9"], "--device"),
        (["--model", str(MODEL), "--context", "0"], "--context"),
        (["--model", str(MODEL), "--context", "many"], "--context"),
        (["--model", str(MODEL), "--concurrency", "-3"], "--concurrency"),
    ],
)
def test_cli_bad_arguments_exit_2_naming_the_option(
    argv: list[str], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run_cli(argv, capsys)
    assert code == 2
    assert f"argument {option}" in err and out == ""


def test_cli_refuses_a_directory_without_one_gguf_and_other_architectures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run_cli(["--model", str(tmp_path)], capsys)
    assert code == 2 and "argument --model" in err and "exactly one .gguf" in err
    path = write_llama_gguf(tmp_path / "falcon.gguf", spec=TinyLlamaSpec(architecture="falcon"))
    code, _, err = _run_cli(["--model", str(path), "--device", "l4"], capsys)
    assert code == 2 and "argument --model" in err and "architecture 'falcon' is not supported" in err


def test_cli_cuda_without_a_gpu_names_device(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    code, _, err = _run_cli(["--model", str(MODEL), "--device", "cuda"], capsys)
    assert code == 2 and "argument --device" in err and "no CUDA GPU" in err


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_a_loaded_engines_weight_and_kv_memory_are_within_10_percent_of_the_plan(local_plan: Plan, kv_dtype: str) -> None:
    from core_engine.config import EngineConfig
    from core_engine.llm_engine import LLMEngine

    engine = LLMEngine.from_config(
        EngineConfig(model_path=str(MODEL), num_threads=1, kv_cache_memory_bytes=32 * 2**20, kv_cache_dtype=kv_dtype)  # type: ignore[arg-type]
    )
    model, cache = engine.model_runner.model, engine.model_runner.kv_cache
    kv_name = str(cache.dtype).removeprefix("torch.") if kv_dtype == "auto" else kv_dtype
    # The engine's default ("auto"): the file's 4-bit blocks at int4, its Q8_0 head at int8.
    assert model.weight_format == "int4" and model.layer_formats == {"head": "int8"}
    row = local_plan.row("auto", kv_name)
    assert row.weight_format == "auto" and row.weight_bytes > local_plan.row("int4", kv_name).weight_bytes
    assert row.weight_bytes == pytest.approx(model.resident_weight_bytes(), rel=0.10)
    assert row.weight_bytes_read_per_step == pytest.approx(model.matmul_weight_bytes(), rel=0.10)
    per_token = cache.nbytes / (cache.num_blocks * cache.block_size)
    assert row.kv_bytes_per_token == pytest.approx(per_token, rel=0.10)


def test_a_mixture_of_experts_reads_only_the_experts_its_tokens_choose(tmp_path: Path) -> None:
    # A tiny Qwen3-MoE (4 experts, 2 per token) as llama.cpp's quantiser writes it at Q8_0.
    import torch

    from core_engine.gguf_loader import load_model
    from tests.core_engine.hf_factory import tiny_hf_model, write_gguf
    from tests.core_engine.test_tensor_types import llamacpp_quantize

    path = llamacpp_quantize(write_gguf(tiny_hf_model("qwen3moe"), tmp_path / "f32.gguf"), tmp_path / "moe.gguf", "Q8_0")
    plan = plan_model(path, device="h100", context=64, concurrency=8)
    weights = plan.weights
    assert weights.expert_params > weights.layer_params / 2 and weights.expert_fraction == 0.5
    assert weights.matmul_params == weights.layer_params - weights.expert_params // 2 + weights.head_params
    row = plan.row("int8", "bfloat16")
    # One token reads half of the experts; eight tokens nearly all (1 - 0.5^8).
    from core_engine.plan.estimate import weight_bytes_read_per_step

    one, eight = (weight_bytes_read_per_step(weights, "int8", "bfloat16", n) for n in (1, 8))
    assert row.weight_bytes_read_per_step == one < eight < row.weight_bytes
    model, _, _ = load_model(path, dtype=torch.bfloat16, show_progress=False)
    model.set_weight_format("int8")
    assert row.weight_bytes == pytest.approx(model.resident_weight_bytes(), rel=0.10)
    assert row.weight_bytes_read_per_step == pytest.approx(model.matmul_weight_bytes(), rel=0.10)
