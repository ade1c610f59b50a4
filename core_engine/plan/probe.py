"""Measure the device the planner runs on: this CPU (``--device cpu``) or the local GPU.

Each measurement takes a fraction of a second with torch's intra-op threads, and keeps the
best of several runs (the least disturbed by other work on the machine):

* read bandwidth: ``sum()`` over a float32 buffer (256 MiB on CPU, 1 GiB on a GPU);
* matmul FLOP/s: a GEMM shaped like the model's fused gate/up projection
  (``(m, hidden) @ (hidden, 2 x intermediate)``, ``m`` chosen for ~1 GFLOP a call) in fp32,
  and in bf16 where the CPU has it natively (avx512_bf16 / amx_bf16; else torch emulates bf16
  and the engine computes in fp32);
* int8/int4 products: :func:`measure_quantized_throughput` times the engine's own compiled
  kernel at 16 rows (a decode batch); where it cannot be built the planner uses an estimate,
  2x the fp32 FLOP/s on AVX2 / AVX-512 and 4x with VNNI or AMX, labelled so.

A named GPU found in :mod:`core_engine.plan.devices` takes the datasheet's figures and only
its free memory from the driver; another GPU is measured like the CPU (bf16 GEMM).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from core_engine.model.config import LlamaConfig
from core_engine.plan.devices import DeviceSpec, Figure, table_row_for_cuda_name

__all__ = [
    "available_memory",
    "cpu_spec",
    "cuda_spec",
    "gemm_shape",
    "measure_bandwidth",
    "measure_matmul_flops",
    "measure_call_overhead",
    "measure_quantized_throughput",
    "NoCudaError",
]

Progress = Callable[[str], None]

_MIB = 2**20
_CPU_BUFFER_BYTES = 256 * _MIB
_CUDA_BUFFER_BYTES = 1024 * _MIB
#: FLOPs of one timed GEMM call: long enough to time, short enough for a slow CPU.
_GEMM_FLOPS = 1e9


def _quiet(_: str) -> None:
    pass


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn: Callable[[], object], device: torch.device, *, min_runs: int, budget_s: float) -> float:
    """The fastest of at least ``min_runs`` timed calls (more while ``budget_s`` lasts)."""
    fn()  # warm-up: first-touch, kernel selection
    _synchronize(device)
    best = float("inf")
    started = time.perf_counter()
    runs = 0
    while runs < min_runs or time.perf_counter() - started < budget_s:
        t0 = time.perf_counter()
        fn()
        _synchronize(device)
        best = min(best, time.perf_counter() - t0)
        runs += 1
    return best


def measure_bandwidth(device: torch.device | str = "cpu", nbytes: int = _CPU_BUFFER_BYTES) -> float:
    """Read bandwidth, bytes/s: the best ``sum()`` over an ``nbytes`` float32 buffer."""
    device = torch.device(device)
    buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    seconds = _best_seconds(buffer.sum, device, min_runs=5, budget_s=0.5)
    return buffer.numel() * 4 / seconds


def gemm_shape(config: LlamaConfig) -> tuple[int, int, int]:
    """(m, k, n) of the timed GEMM: the gate/up projection for ~1 GFLOP of rows."""
    k = config.hidden_size
    n = min(2 * config.intermediate_size, 8192)
    m = int(min(512, max(32, round(_GEMM_FLOPS / (2 * k * n) / 16) * 16)))
    return m, k, n


def measure_matmul_flops(
    device: torch.device | str, dtype: torch.dtype, shape: tuple[int, int, int], *, budget_s: float = 0.6
) -> float:
    """FLOP/s of ``(m, k) @ (k, n)`` in ``dtype`` (best call)."""
    device = torch.device(device)
    m, k, n = shape
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    w = torch.randn(n, k, generator=gen).to(device=device, dtype=dtype)
    with torch.inference_mode():
        seconds = _best_seconds(lambda: torch.mm(x, w.t()), device, min_runs=3, budget_s=budget_s)
    return 2 * m * k * n / seconds


def measure_quantized_throughput(weight_format: str, *, rows: int, in_features: int, out_features: int) -> float | None:
    """Ops/s (2 per multiply-add) of the engine's own ``weight_format`` ("int8", "int4")
    product (:class:`~core_engine.model.linear.BlockQuantLinear`, the compiled CPU kernel) at
    ``rows`` activation rows on random weights, best of a few calls; None where the kernel
    cannot be built here."""
    if weight_format not in ("int8", "int4"):
        return None
    try:
        from core_engine.model.block_weights import quantize_dense
        from core_engine.model.linear import BlockQuantLinear

        gen = torch.Generator().manual_seed(0)
        lin = BlockQuantLinear(*quantize_dense(torch.randn(out_features, in_features, generator=gen), weight_format))
        lin.dense_rows = 1 << 30  # the int8 dot products, as decode runs them
        x = torch.randn(rows, in_features, generator=gen)
        lin(x)
    except Exception:  # no compiler, an unsupported CPU: the estimate stands
        return None
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        lin(x)
        best = min(best, time.perf_counter() - started)
    return 2.0 * rows * in_features * out_features / best


def measure_call_overhead() -> float | None:
    """Seconds of the fixed cost of one call of the engine's block kernel from Python (the
    binding, the activation quantisation set-up, the output, the threads' fork and join),
    timed on a 1 x 32 @ 32 x 64 product (4 groups of 16 rows, so every thread takes part) whose
    arithmetic is negligible; the best of 200 calls, as the other probes take their best run.
    None where the kernel cannot be built here."""
    try:
        from core_engine.kernels.cpu import cpu_extension

        ext = cpu_extension("quant_linear")
    except Exception:
        return None
    gen = torch.Generator().manual_seed(0)
    packed = ext.quant_pack(*random_block_weight("int4", 64, 32, gen))
    x = torch.randn(1, 32, generator=gen)
    times = []
    for _ in range(200):
        started = time.perf_counter()
        ext.quant_linear(x, packed, 64)
        times.append(time.perf_counter() - started)
    return min(times)


def random_block_weight(
    weight_format: str, out_features: int, in_features: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Random codes, scales (and int4 minima) in the block kernel's layout (``"int8"`` or
    ``"int4"``; see :mod:`core_engine.model.block_weights`), for timing the kernel."""
    blocks = in_features // 32
    if weight_format == "int4":
        codes = torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8, generator=generator)
        mins: torch.Tensor | None = (torch.randn(out_features, blocks, generator=generator) * 0.01).half()
    else:
        codes = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8, generator=generator)
        mins = None
    return codes, (torch.rand(out_features, blocks, generator=generator) * 0.01).half(), mins


def block_weight_bytes(weight: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]) -> int:
    """Bytes the kernel reads for one :func:`random_block_weight`."""
    return sum(t.numel() * t.element_size() for t in weight if t is not None)


def measure_quantized_stream(weight_format: str, *, in_features: int, out_features: int, nbytes: int) -> float | None:
    """Bytes/s of weights the engine's ``weight_format`` ("int8", "int4") kernel reads at one
    activation row (a batch-1 decode), over ``nbytes`` of distinct random weights, so that
    they come from memory rather than cache; best pass of a few. None where the kernel cannot
    be built here."""
    if weight_format not in ("int8", "int4"):
        return None
    try:
        from core_engine.kernels.cpu import cpu_extension

        ext = cpu_extension("quant_linear")
    except Exception:  # no compiler, an unsupported CPU: the bandwidth bound stands
        return None
    gen = torch.Generator().manual_seed(0)
    first = random_block_weight(weight_format, out_features, in_features, gen)
    copies = max(1, nbytes // block_weight_bytes(first))
    weights = [first, *(random_block_weight(weight_format, out_features, in_features, gen) for _ in range(copies - 1))]
    packed = [ext.quant_pack(*weight) for weight in weights]
    del weights
    x = torch.randn(1, in_features, generator=gen)
    best = float("inf")
    for _ in range(4):
        started = time.perf_counter()
        for weight in packed:
            ext.quant_linear(x, weight, out_features)
        best = min(best, time.perf_counter() - started)
    return copies * block_weight_bytes(first) / best


def available_memory() -> Figure:
    """This machine's available RAM (``MemAvailable`` of /proc/meminfo)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                kib = int(line.split()[1])
                return Figure(value=kib * 1024, source="system", note="/proc/meminfo MemAvailable")
    except (OSError, ValueError, IndexError):
        pass
    import os

    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return Figure(value=free, source="system", note="free pages (no /proc/meminfo MemAvailable)")


def _int8_estimate(fp32: Figure, family: str, flags: frozenset[str]) -> Figure:
    if family == "amx" or "avx512_vnni" in flags:
        factor, why = 4, "AVX-512 VNNI / AMX"
    elif family in ("avx2", "avx512"):
        factor, why = 2, "AVX2 maddubs" if family == "avx2" else "AVX-512 without VNNI"
    else:
        factor, why = 1, "no SIMD int8 dot products"
    return Figure(value=factor * fp32.value, source="estimated", note=f"{factor}x the fp32 FLOP/s ({why})")


def cpu_spec(config: LlamaConfig, *, measure: bool = True, progress: Progress | None = None) -> DeviceSpec:
    """This machine's CPU: memory from the OS; bandwidth and FLOP/s measured (``measure``)."""
    from core_engine.cpu_features import cpu_flags, cpu_model
    from core_engine.gguf_loader import preferred_dtype
    from core_engine.kv_quant import resolve_kv_cache_dtype
    from core_engine.model.formats import cpu_family
    from core_engine.model.linear import fbgemm_available

    say = progress or _quiet
    flags = cpu_flags()
    family = cpu_family(flags)
    compute = preferred_dtype("cpu")
    native_bf16 = compute == torch.bfloat16
    threads = torch.get_num_threads()
    try:
        resolve_kv_cache_dtype("fp8_e4m3", torch.float32, "cpu")
        has_fp8 = True
    except ValueError:
        has_fp8 = False
    memory = available_memory()
    bandwidth: Figure | None = None
    flops: dict[str, Figure] = {}
    int8_ops: Figure | None = None
    kernel_ops: dict[str, Figure] = {}
    kernel_stream: dict[str, Figure] = {}
    call_overhead: Figure | None = None
    if measure:
        nbytes = int(min(_CPU_BUFFER_BYTES, memory.value / 8)) // _MIB * _MIB
        say(f"measuring read bandwidth (sum over {nbytes // _MIB} MiB, {threads} threads)...")
        bandwidth = Figure(value=measure_bandwidth("cpu", nbytes), source="measured",
                           note=f"sum() over {nbytes // _MIB} MiB float32, best run, {threads} threads")
        say(f"  {bandwidth.value / 1e9:.1f} GB/s")
        shape = gemm_shape(config)
        gemm = f"({shape[0]}x{shape[1]}) @ ({shape[1]}x{shape[2]}) GEMM, best call, {threads} threads"
        dtypes = (torch.float32, torch.bfloat16) if native_bf16 else (torch.float32,)
        for dtype in dtypes:
            name = str(dtype).removeprefix("torch.")
            say(f"measuring {name} matmul ({gemm})...")
            flops[name] = Figure(value=measure_matmul_flops("cpu", dtype, shape), source="measured", note=gemm)
            say(f"  {flops[name].value / 1e9:.1f} GFLOP/s")
        int8_ops = _int8_estimate(flops["float32"], family, flags)
        for fmt in ("int8", "int4"):
            say(f"measuring the engine's {fmt} kernel (16 x {shape[1]} @ {shape[1]} x {shape[2]})...")
            ops = measure_quantized_throughput(fmt, rows=16, in_features=shape[1], out_features=shape[2])
            if ops is not None:
                kernel_ops[fmt] = Figure(value=ops, source="measured",
                                         note=f"the engine's {fmt} kernel, 16 rows (decode batches), best call")
                say(f"  {ops / 1e9:.1f} GOP/s")
            say(f"measuring the engine's {fmt} kernel at one row over {nbytes // _MIB} MiB of weights...")
            rate = measure_quantized_stream(fmt, in_features=shape[1], out_features=shape[2], nbytes=nbytes)
            if rate is not None:
                kernel_stream[fmt] = Figure(value=rate, source="measured",
                                            note=f"the engine's {fmt} kernel, 1 row, {nbytes // _MIB} MiB of weights, best pass")
                say(f"  {rate / 1e9:.1f} GB/s")
    if measure:
        say("measuring the fixed cost of one kernel call...")
        seconds = measure_call_overhead()
        if seconds is not None:
            call_overhead = Figure(value=seconds, source="measured",
                                   note="one block-kernel call on a 1 x 32 @ 32 x 64 product, best of 200")
            say(f"  {seconds * 1e6:.1f} us")
    try:
        from core_engine.model.linear import dense_rows_by_dtype

        tile_prefill = dense_rows_by_dtype().get(compute, 0) > 0
    except Exception:  # no compiler: the kernel cannot run here, the table default stands
        tile_prefill = True
    simd = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8") if f in flags]
    return DeviceSpec(
        name="cpu",
        description=f"{cpu_model() or 'unknown CPU'} ({', '.join(simd) or 'no AVX2'}; {threads} threads)",
        kind="cpu",
        compute_dtype=str(compute).removeprefix("torch."),
        weight_formats=("dense", *(("fp16",) if fbgemm_available() else ()), "int8", "int4"),
        has_fp8_kv=has_fp8,
        memory_bytes=memory,
        memory_bandwidth=bandwidth,
        flops=flops,
        int8_ops=int8_ops,
        kernel_ops=kernel_ops,
        kernel_stream=kernel_stream,
        tile_prefill=tile_prefill,
        call_overhead_s=call_overhead,
        cpu_family=family,
        has_native_bf16=native_bf16,
        num_threads=threads,
    )


class NoCudaError(RuntimeError):
    """``--device cuda`` on a machine where torch sees no CUDA GPU."""


def cuda_spec(*, measure: bool = True, progress: Progress | None = None) -> DeviceSpec:
    """The local GPU (device 0): the table's figures for a known board, else measured; its
    free memory from the driver either way. :class:`NoCudaError` without a GPU."""
    import msgspec

    from core_engine.gguf_loader import preferred_dtype

    if not torch.cuda.is_available():
        raise NoCudaError(f"torch sees no CUDA GPU (torch {torch.__version__}, torch.cuda.is_available() is False)")
    say = progress or _quiet
    device = torch.device("cuda", 0)
    board = torch.cuda.get_device_name(device)
    free, _total = torch.cuda.mem_get_info(device)
    memory = Figure(value=free, source="system", note="torch.cuda.mem_get_info (free)")
    row = table_row_for_cuda_name(board)
    if row is not None:
        return msgspec.structs.replace(
            row, name="cuda", description=f"{board} (figures of the '{row.name}' row)", memory_bytes=memory
        )
    compute = preferred_dtype(device)
    name = str(compute).removeprefix("torch.")
    bandwidth: Figure | None = None
    flops: dict[str, Figure] = {}
    if measure:
        say(f"measuring {board} read bandwidth (sum over {_CUDA_BUFFER_BYTES // _MIB} MiB)...")
        bandwidth = Figure(value=measure_bandwidth(device, _CUDA_BUFFER_BYTES), source="measured",
                           note=f"sum() over {_CUDA_BUFFER_BYTES // _MIB} MiB float32, best run")
        shape = (8192, 8192, 8192)
        say(f"measuring {board} {name} matmul (8192^3 GEMM)...")
        flops[name] = Figure(value=measure_matmul_flops(device, compute, shape), source="measured",
                             note="(8192x8192) @ (8192x8192) GEMM, best call")
    return DeviceSpec(
        name="cuda",
        description=f"{board} (not in the table: measured)",
        kind="cuda",
        compute_dtype=name,
        weight_formats=("dense", "int8", "int4"),
        has_fp8_kv=torch.cuda.get_device_capability(device) >= (8, 9),
        memory_bytes=memory,
        memory_bandwidth=bandwidth,
        flops=flops,
    )
