"""What ``infermux plan`` knows of a device: the published figures of named machines.

Every figure carries its source (:class:`Figure`): ``"datasheet"`` for the rows below,
``"measured"`` / ``"estimated"`` for what :mod:`core_engine.plan.probe` finds on this machine,
and the system call for available memory. Datasheet figures are dense (NVIDIA's sheets print
tensor-core throughput with 2:4 sparsity and mark it with an asterisk; the dense figure is half
of it); GB, GB/s and TFLOPS are decimal (10^9, 10^12) as the vendors print them.

This module imports nothing heavy: the CLI builds its ``--device`` choices from it.
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["DEVICE_NAMES", "DeviceSpec", "Figure", "named_device", "table_row_for_cuda_name"]

DeviceKind = Literal["cpu", "cuda"]
FigureSource = Literal["datasheet", "measured", "estimated", "system"]

_GB = 1e9
_TERA = 1e12


class Figure(msgspec.Struct, frozen=True, kw_only=True):
    """One number of a device, and where it comes from."""

    value: float
    #: "datasheet" (the table below), "measured" (timed here), "estimated" (derived from a
    #: measurement by a stated rule), "system" (asked of the OS or driver).
    source: FigureSource
    #: How it was obtained: the datasheet line, the measurement, the rule.
    note: str = ""


class DeviceSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The figures the planner's arithmetic needs (bytes, bytes/s, FLOP/s, ops/s)."""

    #: The ``--device`` value ("cpu", "cuda", "h100"...).
    name: str
    description: str
    #: Where the engine runs on it: its CPU ("cpu", also Apple silicon: the engine has no
    #: Metal path) or a CUDA GPU.
    kind: DeviceKind
    #: The engine's compute dtype there ("float32", "bfloat16", "float16").
    compute_dtype: str
    #: The weight formats the planner lists for it (``core_engine.model.formats``).
    weight_formats: tuple[str, ...]
    #: Whether KV can be stored as fp8_e4m3 there (CPU: this torch casts float8; GPU: fp8
    #: hardware, which the Triton decode kernel needs).
    has_fp8_kv: bool
    memory_bytes: Figure
    memory_bandwidth: Figure | None = None
    #: Dense matmul throughput per dtype ("float32", "bfloat16", "float16"), FLOP/s.
    flops: dict[str, Figure] = {}
    #: int8 dot-product throughput, ops/s (GPU: int8 tensor cores; CPU: estimated from fp32).
    int8_ops: Figure | None = None
    #: fp8 tensor-core throughput, FLOP/s; None where the hardware has none.
    fp8_flops: Figure | None = None
    #: Throughput of the engine's own int8/int4 products, ops/s, where measured
    #: (:func:`core_engine.plan.probe.measure_quantized_throughput`); it replaces the int8
    #: estimate for that format's decode.
    kernel_ops: dict[str, Figure] = {}
    #: Bytes/s at which the engine's own int8/int4 kernel reads weights from memory at one
    #: activation row (:func:`core_engine.plan.probe.measure_quantized_stream`); where
    #: measured, it bounds that format's batch-1 decode instead of the read bandwidth.
    kernel_stream: dict[str, Figure] = {}
    #: CPU: whether the int8/int4 kernels multiply prompt chunks with dequantised weight tiles
    #: through the compute dtype's GEMM (``linear.dense_rows_by_dtype``); if not, prefill runs
    #: the int8 dot products at ``kernel_ops``.
    tile_prefill: bool = True
    #: CPU: seconds of the fixed cost of one kernel call from Python
    #: (:func:`core_engine.plan.probe.measure_call_overhead`); a decode step makes
    #: :data:`core_engine.plan.estimate.CALLS_PER_LAYER` per layer, which small models feel.
    call_overhead_s: Figure | None = None
    #: The CPU family the policy's kernels are tuned for (``formats.cpu_family``); None on GPUs.
    cpu_family: str | None = None
    #: bf16 matmuls in hardware (CPU: avx512_bf16/amx_bf16; else torch emulates them).
    has_native_bf16: bool = True
    #: torch intra-op threads the measurements used (CPU).
    num_threads: int | None = None
    #: The datasheet the figures come from (table rows).
    reference: str = ""


_GPU_FORMATS = ("dense", "int8", "int4")
_APPLE_FORMATS = ("dense", "int8", "int4")  # no fbgemm (fp16 format) on arm64


def _gpu(
    name: str,
    description: str,
    *,
    memory_gb: float,
    bandwidth_gbs: float,
    bf16_tflops: float,
    fp16_tflops: float,
    int8_tops: float,
    fp8_tflops: float | None,
    reference: str,
) -> DeviceSpec:
    def sheet(value: float) -> Figure:
        return Figure(value=value, source="datasheet", note=reference)

    return DeviceSpec(
        name=name,
        description=description,
        kind="cuda",
        compute_dtype="bfloat16",
        weight_formats=_GPU_FORMATS,
        has_fp8_kv=fp8_tflops is not None,
        memory_bytes=sheet(memory_gb * _GB),
        memory_bandwidth=sheet(bandwidth_gbs * _GB),
        flops={"bfloat16": sheet(bf16_tflops * _TERA), "float16": sheet(fp16_tflops * _TERA)},
        int8_ops=sheet(int8_tops * _TERA),
        fp8_flops=None if fp8_tflops is None else sheet(fp8_tflops * _TERA),
        reference=reference,
    )


def _apple(name: str, description: str, *, memory_gb: float, bandwidth_gbs: float, reference: str) -> DeviceSpec:
    # The engine runs on the CPU cores there (fp32: preferred_dtype finds no x86 bf16 flags;
    # "other": portable kernels). Apple publishes no CPU FLOP/s, so no compute bound.
    return DeviceSpec(
        name=name,
        description=description,
        kind="cpu",
        compute_dtype="float32",
        weight_formats=_APPLE_FORMATS,
        has_fp8_kv=True,
        memory_bytes=Figure(value=memory_gb * _GB, source="datasheet", note=reference),
        memory_bandwidth=Figure(value=bandwidth_gbs * _GB, source="datasheet", note=reference),
        cpu_family="other",
        has_native_bf16=False,
        reference=reference,
    )


#: Named devices. Memory is the board's (or the chip's largest configuration), bandwidth its
#: peak; TFLOPS/TOPS are dense tensor-core figures.
_TABLE: tuple[DeviceSpec, ...] = (
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: 80 GB, 3.35 TB/s; BF16 and FP16
    # 1,979 TFLOPS*, FP8 3,958 TFLOPS*, INT8 3,958 TOPS* (* with sparsity; dense is half).
    _gpu("h100", "NVIDIA H100 SXM5 80GB", memory_gb=80, bandwidth_gbs=3350, bf16_tflops=989.5,
         fp16_tflops=989.5, int8_tops=1979, fp8_tflops=1979,
         reference="NVIDIA H100 datasheet (SXM): 80 GB, 3.35 TB/s, BF16 1,979* TFLOPS, FP8 3,958*, INT8 3,958* TOPS; *sparse, halved"),
    # Same datasheet, H100 PCIe column: 80 GB, 2 TB/s; BF16 1,513 TFLOPS*, FP8 3,026*, INT8 3,026 TOPS*.
    _gpu("h100-pcie", "NVIDIA H100 PCIe 80GB", memory_gb=80, bandwidth_gbs=2000, bf16_tflops=756.5,
         fp16_tflops=756.5, int8_tops=1513, fp8_tflops=1513,
         reference="NVIDIA H100 datasheet (PCIe): 80 GB, 2 TB/s, BF16 1,513* TFLOPS, FP8 3,026*, INT8 3,026* TOPS; *sparse, halved"),
    # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: 141 GB, 4.8 TB/s; BF16 and FP16
    # 1,979 TFLOPS*, FP8 3,958 TFLOPS*, INT8 3,958 TOPS*.
    _gpu("h200", "NVIDIA H200 SXM 141GB", memory_gb=141, bandwidth_gbs=4800, bf16_tflops=989.5,
         fp16_tflops=989.5, int8_tops=1979, fp8_tflops=1979,
         reference="NVIDIA H200 datasheet (SXM): 141 GB, 4.8 TB/s, BF16 1,979* TFLOPS, FP8 3,958*, INT8 3,958* TOPS; *sparse, halved"),
    # NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column: 2,039 GB/s; BF16 and FP16
    # 312 TFLOPS (624*), INT8 624 TOPS (1,248*); no FP8.
    _gpu("a100-80g", "NVIDIA A100 SXM4 80GB", memory_gb=80, bandwidth_gbs=2039, bf16_tflops=312,
         fp16_tflops=312, int8_tops=624, fp8_tflops=None,
         reference="NVIDIA A100 datasheet (80GB SXM): 2,039 GB/s, BF16 312 TFLOPS, INT8 624 TOPS"),
    # Same datasheet, A100 40GB column: 1,555 GB/s; same tensor-core figures.
    _gpu("a100-40g", "NVIDIA A100 40GB", memory_gb=40, bandwidth_gbs=1555, bf16_tflops=312,
         fp16_tflops=312, int8_tops=624, fp8_tflops=None,
         reference="NVIDIA A100 datasheet (40GB): 1,555 GB/s, BF16 312 TFLOPS, INT8 624 TOPS"),
    # NVIDIA L4 datasheet: 24 GB, 300 GB/s; BF16 and FP16 242 TFLOPS*, FP8 485 TFLOPS*, INT8 485 TOPS*.
    _gpu("l4", "NVIDIA L4 24GB", memory_gb=24, bandwidth_gbs=300, bf16_tflops=121, fp16_tflops=121,
         int8_tops=242.5, fp8_tflops=242.5,
         reference="NVIDIA L4 datasheet: 24 GB, 300 GB/s, BF16 242* TFLOPS, FP8 485*, INT8 485* TOPS; *sparse, halved"),
    # NVIDIA L40S datasheet: 48 GB, 864 GB/s; BF16 and FP16 362.05 TFLOPS (733*), FP8 733 TFLOPS
    # (1,466*), INT8 733 TOPS (1,466*).
    _gpu("l40s", "NVIDIA L40S 48GB", memory_gb=48, bandwidth_gbs=864, bf16_tflops=362.05,
         fp16_tflops=362.05, int8_tops=733, fp8_tflops=733,
         reference="NVIDIA L40S datasheet: 48 GB, 864 GB/s, BF16 362.05 TFLOPS, FP8 733, INT8 733 TOPS (dense)"),
    # NVIDIA Ada GPU architecture whitepaper, appendix A (GeForce RTX 4090): 24 GB, 1,008 GB/s;
    # FP16 and BF16 tensor TFLOPS with FP32 accumulate 165.2 (330.4*), FP8 with FP32
    # accumulate 330.3 (660.6*), INT8 660.6 TOPS (1,321.2*).
    _gpu("rtx4090", "NVIDIA GeForce RTX 4090 24GB", memory_gb=24, bandwidth_gbs=1008, bf16_tflops=165.2,
         fp16_tflops=165.2, int8_tops=660.6, fp8_tflops=330.3,
         reference="NVIDIA Ada whitepaper (RTX 4090): 24 GB, 1,008 GB/s, BF16/FP16 165.2 TFLOPS (FP32 accumulate), FP8 330.3, INT8 660.6 TOPS (dense)"),
    # NVIDIA Ampere GA102 GPU architecture whitepaper (GeForce RTX 3090): 24 GB, 936 GB/s; FP16
    # and BF16 tensor TFLOPS with FP32 accumulate 71 (142*), INT8 284 TOPS (568*); no FP8.
    _gpu("rtx3090", "NVIDIA GeForce RTX 3090 24GB", memory_gb=24, bandwidth_gbs=936, bf16_tflops=71,
         fp16_tflops=71, int8_tops=284, fp8_tflops=None,
         reference="NVIDIA GA102 whitepaper (RTX 3090): 24 GB, 936 GB/s, BF16/FP16 71 TFLOPS (FP32 accumulate), INT8 284 TOPS (dense)"),
    # Apple newsroom, M2 Pro and M2 Max (January 2023): 400 GB/s unified memory bandwidth, up
    # to 96 GB unified memory.
    _apple("m2-max", "Apple M2 Max (96 GB configuration), engine on the CPU cores", memory_gb=96,
           bandwidth_gbs=400, reference="Apple newsroom, M2 Max: up to 96 GB unified memory, 400 GB/s"),
    # Apple newsroom, M3 family (October 2023): M3 Max up to 128 GB unified memory, 400 GB/s
    # (the 16-core CPU / 40-core GPU part; the 14-core part has 300 GB/s).
    _apple("m3-max", "Apple M3 Max (16-core CPU, 128 GB configuration), engine on the CPU cores",
           memory_gb=128, bandwidth_gbs=400,
           reference="Apple newsroom, M3 Max: up to 128 GB unified memory, 400 GB/s"),
)

_BY_NAME = {spec.name: spec for spec in _TABLE}

#: ``torch.cuda.get_device_name()`` of the boards the table describes.
_CUDA_NAMES: dict[str, str] = {
    "NVIDIA H100 80GB HBM3": "h100",
    "NVIDIA H100 PCIe": "h100-pcie",
    "NVIDIA H200": "h200",
    "NVIDIA A100-SXM4-80GB": "a100-80g",
    "NVIDIA A100-SXM4-40GB": "a100-40g",
    "NVIDIA A100-PCIE-40GB": "a100-40g",
    "NVIDIA L4": "l4",
    "NVIDIA L40S": "l40s",
    "NVIDIA GeForce RTX 4090": "rtx4090",
    "NVIDIA GeForce RTX 3090": "rtx3090",
}

#: Every ``--device`` value: this machine's CPU, the local CUDA GPU, the table's rows.
DEVICE_NAMES: tuple[str, ...] = ("cpu", "cuda", *(spec.name for spec in _TABLE))


def named_device(name: str) -> DeviceSpec | None:
    """The table row called ``name``; None for "cpu", "cuda" and unknown names."""
    return _BY_NAME.get(name)


def table_row_for_cuda_name(device_name: str) -> DeviceSpec | None:
    """The table row of a GPU as torch names it; None when the table has no such board."""
    key = _CUDA_NAMES.get(device_name.strip())
    return None if key is None else _BY_NAME[key]
