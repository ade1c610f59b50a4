"""The planner's arithmetic: memory and rooflines of one weight format x KV dtype on a device.

Pure functions of a :class:`~core_engine.model.config.LlamaConfig`, the file's parameter counts
(:class:`WeightInventory`), a :class:`~core_engine.plan.devices.DeviceSpec` and the request
shape; nothing is measured or read here.

* Resident weights: the products (decoder projections and the LM head) in the format, the
  embedding table dense in the compute dtype, the norms and biases in the compute dtype. A
  tied head is the embedding table *and* a product in the format (dense: one tensor).
* KV per token: ``2 x layers x kv_heads x head_dim`` codes, plus for int8/fp8 one float32
  scale per (layer, K/V, block of ``block_size`` tokens, kv head), i.e. ``/block_size`` per
  token. A request holds whole blocks.
* Decode at batch N: the lesser of the bandwidth bound
  ``N x bandwidth / (weight bytes read per step + N x KV bytes per token x context / 2)``
  and the compute bound ``ops/s / (2 x matmul params per token)``. In a mixture of experts a
  token multiplies ``k`` of a layer's ``E`` experts, and a step of N tokens reads the experts
  any of them chose: ``1 - (1 - k/E)^N`` of the experts' bytes, with independent choices.
* Prefill: compute bound, ``ops/s / FLOPs per prompt token`` for a prompt of ``context``
  tokens (projections, causal attention, the head once per prompt).
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec
import torch

from core_engine.kv_quant import kv_quant_spec
from core_engine.model.config import LlamaConfig
from core_engine.model.formats import bytes_per_weight
from core_engine.plan.devices import DeviceSpec, Figure

__all__ = [
    "Bound",
    "PlanRow",
    "WeightInventory",
    "estimate_row",
    "kv_bytes_per_block",
    "kv_bytes_per_token",
    "kv_dtypes",
    "max_concurrency",
    "row_dtype",
    "weight_bytes",
    "weight_bytes_read_per_step",
]

Bound = Literal["memory", "compute"]

#: Scale bytes of the quantized KV dtypes: one float32 per (layer, K/V, block, kv head).
_SCALE_BYTES = 4


class WeightInventory(msgspec.Struct, frozen=True, kw_only=True):
    """Parameter counts of a model file, by how the engine stores them."""

    #: Decoder projections (q, k, v, output, gate, up, down of every layer).
    layer_params: int
    #: The LM head (``output.weight``, or the embedding table when tied).
    head_params: int
    #: The token embedding table (looked up row by row, kept dense).
    embedding_params: int
    #: Norm weights and biases (kept in the compute dtype).
    vector_params: int
    tied_embeddings: bool
    #: Layer products whose file tensors are not 4-bit blocks: ``weight_format = "auto"``
    #: stores them at int8 (the file's own precision) where the rest goes to int4.
    eight_bit_layer_params: int = 0
    #: Whether the head's tensor is not 4-bit blocks (SmolLM2's Q4_1 file keeps a Q8_0 head).
    eight_bit_head: bool = False
    #: Of ``layer_params``, the experts of a mixture (``ffn_*_exps``), and the share of them a
    #: token multiplies (``num_experts_used / num_experts``).
    expert_params: int = 0
    expert_fraction: float = 1.0

    @property
    def matmul_params(self) -> int:
        """Weights each decoded token multiplies: the projections (its experts only) and the head."""
        return round(self.layer_params - self.expert_params * (1.0 - self.expert_fraction)) + self.head_params

    def experts_read(self, num_seqs: int) -> float:
        """Share of the experts' weights a step of ``num_seqs`` tokens reads (1 without experts)."""
        return 1.0 - (1.0 - self.expert_fraction) ** num_seqs


class PlanRow(msgspec.Struct, frozen=True, kw_only=True):
    """Memory and speed of one weight format x KV dtype (bytes, tokens/s)."""

    weight_format: str
    kv_dtype: str
    #: Every resident weight (see the module docstring).
    weight_bytes: int
    #: Bytes of weight one decode step reads: the products and the norms.
    weight_bytes_read_per_step: int
    kv_bytes_per_token: float
    #: Whole blocks for ``context`` tokens.
    kv_bytes_per_request: int
    #: Most requests of ``context`` tokens whose KV fits next to the weights (0: none, or
    #: the weights alone do not fit).
    max_concurrency: int
    #: Whether ``concurrency`` requests fit.
    fits_concurrency: bool
    #: Matmul ops/s decode runs at here, and what that figure is (None: not known).
    decode_ops_per_s: float | None
    decode_ops_source: str | None
    prefill_ops_per_s: float | None
    decode_tok_s_batch1: float | None
    #: Total tokens/s of ``concurrency`` requests decoding together.
    decode_tok_s_concurrency: float | None
    #: Which bound sets each decode figure; None when one of the two is not known.
    bound_batch1: Bound | None
    bound_concurrency: Bound | None
    prefill_tok_s: float | None


def kv_dtypes(spec: DeviceSpec) -> tuple[str, ...]:
    """The KV dtypes the planner lists for ``spec``: the compute dtype, int8, fp8_e4m3."""
    return (spec.compute_dtype, "int8", *(("fp8_e4m3",) if spec.has_fp8_kv else ()))


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def kv_bytes_per_block(config: LlamaConfig, kv_dtype: str, block_size: int) -> int:
    """Bytes of one KV block (all layers, K and V) in ``kv_dtype``, scales included."""
    spec = kv_quant_spec(kv_dtype, torch.float32)
    codes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * spec.storage_dtype.itemsize
    scales = 2 * config.num_layers * config.num_kv_heads * _SCALE_BYTES if spec.is_quantized else 0
    return block_size * codes + scales


def kv_bytes_per_token(config: LlamaConfig, kv_dtype: str, block_size: int) -> float:
    """KV bytes one token adds (its codes plus ``1/block_size`` of its block's scales)."""
    return kv_bytes_per_block(config, kv_dtype, block_size) / block_size


#: ``weight_format`` of the planned rows that store each product in its file's precision:
#: what ``"auto"`` resolves to per product on a CPU (int4 for 4-bit blocks, int8 otherwise).
NATURAL = "auto"


def _product_bytes(weights: WeightInventory, weight_format: str, dtype: str) -> tuple[int, int]:
    """Bytes of the layer products and of the head in ``weight_format`` (or :data:`NATURAL`)."""
    if weight_format == NATURAL:
        four, eight = bytes_per_weight("int4"), bytes_per_weight("int8")
        layers = round((weights.layer_params - weights.eight_bit_layer_params) * four
                       + weights.eight_bit_layer_params * eight)
        return layers, round(weights.head_params * (eight if weights.eight_bit_head else four))
    per_weight = bytes_per_weight(weight_format, _dtype(dtype))
    return round(weights.layer_params * per_weight), round(weights.head_params * per_weight)


def weight_bytes(weights: WeightInventory, weight_format: str, dtype: str) -> int:
    """Bytes of every resident weight with the products in ``weight_format``."""
    dense = _dtype(dtype).itemsize
    products, head = _product_bytes(weights, weight_format, dtype)
    if weights.tied_embeddings and weight_format == "dense":
        head = 0  # the head multiplies the embedding table itself
    return products + head + weights.embedding_params * dense + weights.vector_params * dense


def weight_bytes_read_per_step(weights: WeightInventory, weight_format: str, dtype: str, num_seqs: int = 1) -> int:
    """Bytes of weight a decode step of ``num_seqs`` tokens reads: every product once (of a
    mixture's experts, those the tokens chose), and the norms."""
    layers, head = _product_bytes(weights, weight_format, dtype)
    if weights.expert_params:  # the experts' bytes taken as their share of the layer params
        experts = layers * weights.expert_params / weights.layer_params
        layers = round(layers - experts * (1.0 - weights.experts_read(num_seqs)))
    return layers + head + weights.vector_params * _dtype(dtype).itemsize


def max_concurrency(usable_bytes: int, weight_bytes: int, kv_bytes_per_request: int) -> int:
    """Most requests whose KV fits in ``usable_bytes`` after the weights."""
    return max(0, (usable_bytes - weight_bytes) // kv_bytes_per_request)


def row_dtype(spec: DeviceSpec, weight_format: str) -> str:
    """The model's dtype with ``weight_format``: fp16 weights need fp32 compute (fbgemm)."""
    return "float32" if weight_format == "fp16" else spec.compute_dtype


def _decode_rate(spec: DeviceSpec, weight_format: str) -> Figure | None:
    """Matmul ops/s of a decode step. CPU: int8/int4 products are int8 dot products; GPU:
    weight-only formats, dequantised to the compute dtype in the kernel."""
    weight_format = "int4" if weight_format == NATURAL else weight_format  # its kernel's figures
    if spec.kind == "cpu" and weight_format in ("int8", "int4"):
        return spec.kernel_ops.get(weight_format, spec.int8_ops)
    return spec.flops.get(row_dtype(spec, weight_format))


#: Kernel calls a decode step makes per decoder layer (the fused qkv + RoPE, attention, o +
#: residual, gate_up, SwiGLU + down + residual); plus one for the head.
CALLS_PER_LAYER = 5


def step_overhead_s(spec: DeviceSpec, config: LlamaConfig) -> float:
    """Seconds a decode step spends in the fixed cost of its kernel calls (0 where unmeasured)."""
    if spec.call_overhead_s is None:
        return 0.0
    return (CALLS_PER_LAYER * config.num_layers + 1) * spec.call_overhead_s.value


def _prefill_rate(spec: DeviceSpec, weight_format: str) -> Figure | None:
    """Matmul FLOP/s of prefill: the compute dtype's, where the CPU int8/int4 kernels multiply
    prompt chunks with dequantised weight tiles through ``at::mm``; else (``tile_prefill``
    false) the int8 dot products' rate."""
    weight_format = "int4" if weight_format == NATURAL else weight_format
    if spec.kind == "cpu" and weight_format in ("int8", "int4") and not spec.tile_prefill:
        return spec.kernel_ops.get(weight_format, spec.int8_ops)
    return spec.flops.get(row_dtype(spec, weight_format))


def _prefill_flops_per_token(config: LlamaConfig, weights: WeightInventory, context: int) -> float:
    """FLOPs per token of a ``context``-token prompt: the projections, causal attention (QK^T
    and PV over (context + 1) / 2 positions on average), and the head once per prompt."""
    attention = 4 * config.num_layers * config.num_heads * config.head_dim * (context + 1) / 2
    return 2 * (weights.matmul_params - weights.head_params) + attention + 2 * weights.head_params / context


def _lesser(memory_bound: float | None, compute_bound: float | None) -> tuple[float | None, Bound | None]:
    """The binding bound; with one of them unknown, the other (and no label)."""
    if memory_bound is None or compute_bound is None:
        return memory_bound if compute_bound is None else compute_bound, None
    if memory_bound <= compute_bound:
        return memory_bound, "memory"
    return compute_bound, "compute"


def estimate_row(
    *,
    config: LlamaConfig,
    weights: WeightInventory,
    spec: DeviceSpec,
    weight_format: str,
    kv_dtype: str,
    context: int,
    concurrency: int,
    usable_memory_bytes: int,
    block_size: int,
) -> PlanRow:
    """The :class:`PlanRow` of ``weight_format`` x ``kv_dtype`` on ``spec``."""
    dtype = row_dtype(spec, weight_format)
    resident = weight_bytes(weights, weight_format, dtype)
    read_bytes = weight_bytes_read_per_step(weights, weight_format, dtype)
    per_token = kv_bytes_per_token(config, kv_dtype, block_size)
    per_request = math.ceil(context / block_size) * kv_bytes_per_block(config, kv_dtype, block_size)
    most = max_concurrency(usable_memory_bytes, resident, per_request)
    bandwidth = None if spec.memory_bandwidth is None else spec.memory_bandwidth.value
    decode_rate, prefill_rate = _decode_rate(spec, weight_format), _prefill_rate(spec, weight_format)
    kv_read_per_seq = per_token * context / 2  # each sequence half way through its context

    # Batch 1 on a CPU: the engine's kernel reading the weights, where measured (it reaches
    # ~0.8 of the read bandwidth), else the bandwidth itself.
    stream = spec.kernel_stream.get("int4" if weight_format == NATURAL else weight_format) if spec.kind == "cpu" else None

    def memory_bound(num_seqs: int) -> float | None:
        if bandwidth is None:
            return None
        if num_seqs == 1 and stream is not None:
            return 1.0 / (read_bytes / min(bandwidth, stream.value) + kv_read_per_seq / bandwidth)
        read = weight_bytes_read_per_step(weights, weight_format, dtype, num_seqs)
        return num_seqs * bandwidth / (read + num_seqs * kv_read_per_seq)

    compute_bound = None if decode_rate is None else decode_rate.value / (2 * weights.matmul_params)
    batch1, bound1 = _lesser(memory_bound(1), compute_bound)
    batched, bound_n = _lesser(memory_bound(concurrency), compute_bound)
    # Plus the fixed cost of the step's kernel calls, where measured (CPU).
    overhead = step_overhead_s(spec, config)
    if overhead and batch1:
        batch1 = 1.0 / (1.0 / batch1 + overhead)
    if overhead and batched:
        batched = concurrency / (concurrency / batched + overhead)
    prefill = None
    if prefill_rate is not None:
        prefill = prefill_rate.value / _prefill_flops_per_token(config, weights, context)
    return PlanRow(
        weight_format=weight_format,
        kv_dtype=kv_dtype,
        weight_bytes=resident,
        weight_bytes_read_per_step=read_bytes,
        kv_bytes_per_token=per_token,
        kv_bytes_per_request=per_request,
        max_concurrency=most,
        fits_concurrency=most >= concurrency,
        decode_ops_per_s=None if decode_rate is None else decode_rate.value,
        decode_ops_source=None if decode_rate is None else decode_rate.source,
        prefill_ops_per_s=None if prefill_rate is None else prefill_rate.value,
        decode_tok_s_batch1=batch1,
        decode_tok_s_concurrency=batched,
        bound_batch1=bound1,
        bound_concurrency=bound_n,
        prefill_tok_s=prefill,
    )
