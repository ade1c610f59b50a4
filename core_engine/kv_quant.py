"""KV-cache quantization: int8 and fp8 codes with one float32 scale per block and kv head.

``kv_cache_dtype`` (:class:`~core_engine.config.EngineConfig`) names how K/V are stored:

* ``"auto"`` (the compute dtype), ``"bfloat16"``, ``"float16"``, ``"float32"``: plain values;
* ``"int8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``: codes ``c`` with ``value ≈ c * scale``, where
  ``scale`` is shared by the ``block_size`` tokens of one block, per layer, per K/V and per kv
  head (a ``(num_layers, 2, num_blocks, n_kv_heads)`` float32 tensor next to the pool). A
  block's scale is ``amax / qmax`` over the values written to it so far; ``qmax`` is the
  largest code (127, 448, 57344), so each block uses the full code range.

fp8 codes are kept as their raw bytes (``uint8`` storage) and viewed as
``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` to encode and decode: CPU torch has no
``index_copy_`` for the float8 dtypes, and bytes move, gather and scatter on every device.

Blocks fill incrementally (a prefill chunk writes many slots of a block, a decode one), so
:func:`write_quantized` may have to raise a block's scale after values were stored under the
old one: it re-encodes the block's existing codes to the new scale (``c * old / new``, one more
rounding, which only happens while the block's running maximum grows), then stores the new
tokens. A step that writes offset 0 of a block starts it afresh (a reused block's old scale
and codes are void). All of it is vectorised over the step's touched blocks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import get_args

import torch
from torch import Tensor

from core_engine.policy import KVCacheDType

__all__ = [
    "KVQuantSpec",
    "KVWritePlan",
    "dequantize",
    "kv_quant_spec",
    "plan_kv_write",
    "resolve_kv_cache_dtype",
    "write_quantized",
]

# name -> (torch attribute of the code dtype, qmax); the storage of fp8 codes is uint8.
_QUANTIZED: dict[str, tuple[str, float]] = {
    "int8": ("int8", 127.0),
    "fp8_e4m3": ("float8_e4m3fn", 448.0),
    "fp8_e5m2": ("float8_e5m2", 57344.0),
}


@dataclass(frozen=True, slots=True)
class KVQuantSpec:
    """How a :class:`~core_engine.paged_attention.KVCache` stores its values."""

    #: The resolved ``kv_cache_dtype``: "float32", "bfloat16", ..., "int8", "fp8_e4m3"...
    name: str
    #: dtype of ``KVCache.storage``: the plain dtype, int8, or uint8 (the bytes of fp8 codes).
    storage_dtype: torch.dtype
    #: What the stored elements mean: ``storage_dtype``, except float8_* for the fp8 bytes.
    code_dtype: torch.dtype
    #: Largest code magnitude; None when values are stored as they are (no scales).
    qmax: float | None

    @property
    def is_quantized(self) -> bool:
        return self.qmax is not None

    @property
    def label(self) -> str:
        """For logs: ``torch.bfloat16`` or ``int8 (fp32 scale per block and kv head)``."""
        if not self.is_quantized:
            return str(self.storage_dtype)
        return f"{self.name} (fp32 scale per block and kv head)"


def kv_quant_spec(name: str, compute_dtype: torch.dtype) -> KVQuantSpec:
    """The storage for ``kv_cache_dtype=name`` (no device check: sizes only, see
    :func:`resolve_kv_cache_dtype`). ``ValueError`` naming ``kv_cache_dtype`` if unknown."""
    if name not in get_args(KVCacheDType):
        raise ValueError(f"kv_cache_dtype must be one of {list(get_args(KVCacheDType))}, got {name!r}")
    if name == "auto":
        return KVQuantSpec(str(compute_dtype).removeprefix("torch."), compute_dtype, compute_dtype, None)
    if name not in _QUANTIZED:
        dtype = getattr(torch, name)
        return KVQuantSpec(name, dtype, dtype, None)
    attr, qmax = _QUANTIZED[name]
    code_dtype = getattr(torch, attr, None)
    if code_dtype is None:
        raise ValueError(
            f"kv_cache_dtype={name!r} needs torch.{attr}, which this torch ({torch.__version__}) "
            "does not have: use 'int8' or 'auto'"
        )
    storage = torch.int8 if name == "int8" else torch.uint8
    return KVQuantSpec(name, storage, code_dtype, qmax)


def resolve_kv_cache_dtype(
    name: str, compute_dtype: torch.dtype, device: torch.device | str
) -> KVQuantSpec:
    """:func:`kv_quant_spec`, checked on ``device``: fp8 is accepted only where this torch
    casts to and from the float8 dtype there (``ValueError`` naming ``kv_cache_dtype``)."""
    spec = kv_quant_spec(name, compute_dtype)
    device = torch.device(device)
    if spec.code_dtype.is_floating_point and spec.is_quantized and not _fp8_round_trips(spec.code_dtype, device):
        raise ValueError(
            f"kv_cache_dtype={name!r}: this torch ({torch.__version__}) cannot store "
            f"{spec.code_dtype} on {device}; use 'int8' (or 'auto') there"
        )
    return spec


@functools.cache
def _fp8_round_trips(code_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether values exact in ``code_dtype`` survive a cast there and back (via the bytes)."""
    x = torch.tensor([0.0, 1.0, -2.0, 0.5, 3.5, -0.75], device=device)
    try:
        y = x.to(code_dtype).view(torch.uint8).view(code_dtype).to(torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool(torch.equal(x, y))


@dataclass(slots=True)
class KVWritePlan:
    """Where one step's new tokens land, by block: built once per step, used by every layer."""

    #: (T,) int64 slot of each new token (``block_id * block_size + offset``).
    slots: Tensor
    #: (U,) int64 the distinct blocks the step writes, ascending.
    blocks: Tensor
    #: (T,) int64 index into ``blocks`` of each token's block.
    block_index: Tensor
    #: (U,) bool: the step writes offset 0 of the block, so it starts afresh.
    fresh: Tensor


def plan_kv_write(slot_mapping: Tensor, block_size: int) -> KVWritePlan:
    """The :class:`KVWritePlan` of ``slot_mapping`` (T,). Syncs once on CUDA (``unique``)."""
    slots = slot_mapping.long()
    blocks, block_index = torch.unique(slots // block_size, return_inverse=True)
    starts = (slots % block_size == 0).to(torch.int32)
    fresh = torch.zeros(blocks.shape[0], dtype=torch.int32, device=slots.device).index_add_(0, block_index, starts) > 0
    return KVWritePlan(slots=slots, blocks=blocks, block_index=block_index, fresh=fresh)


def write_quantized(
    cache: Tensor, scales: Tensor, key: Tensor, value: Tensor, plan: KVWritePlan, spec: KVQuantSpec
) -> None:
    """Store this step's ``key``/``value`` (T, n_kv, hd) into one layer's quantized pool.

    ``cache``: (2, num_blocks, block_size, n_kv, hd) in ``spec.storage_dtype`` (K then V);
    ``scales``: (2, num_blocks, n_kv) float32. Both are updated in place (module docstring).
    """
    assert spec.qmax is not None, "write_quantized needs a quantized spec"
    num_tokens = plan.slots.shape[0]
    if num_tokens == 0:
        return
    _, num_blocks, block_size, n_kv, head_dim = cache.shape
    x = torch.stack((key, value)).float()  # (2, T, n_kv, hd)
    token_amax = x.abs().amax(-1)  # (2, T, n_kv)
    index = plan.block_index.view(1, -1, 1).expand_as(token_amax)
    num_touched = plan.blocks.shape[0]
    block_amax = token_amax.new_zeros((2, num_touched, n_kv)).scatter_reduce_(1, index, token_amax, "amax")
    old_scale = scales.index_select(1, plan.blocks).masked_fill_(plan.fresh.view(1, -1, 1), 0.0)  # (2, U, n_kv)
    new_scale = torch.maximum(old_scale, block_amax / spec.qmax)
    # A zero scale means every value seen is zero: divide by 1 there, the codes stay 0.
    divisor = torch.where(new_scale > 0, new_scale, 1.0)
    ratio = old_scale / divisor  # (2, U, n_kv): 1 where the scale stands, 0 for fresh blocks

    # Re-encode the existing codes of blocks whose scale grew (fresh blocks: cleared). Where
    # the ratio is 1 this is a no-op, so on CPU only the grown blocks are touched (a host-side
    # selection, free there); on CUDA all touched blocks are, to keep the step free of syncs.
    blocks, block_ratio = plan.blocks, ratio
    if cache.device.type == "cpu":
        grown = (ratio < 1).any(2).any(0).nonzero().squeeze(1)
        blocks, block_ratio = plan.blocks.index_select(0, grown), ratio.index_select(1, grown)
    if blocks.shape[0]:
        codes = _decode(cache.index_select(1, blocks), spec)  # (2, G, block_size, n_kv, hd)
        codes.mul_(block_ratio[:, :, None, :, None])
        cache.index_copy_(1, blocks, _encode(codes, spec))

    token_divisor = divisor.index_select(1, plan.block_index)  # (2, T, n_kv)
    new_codes = _encode(x / token_divisor.unsqueeze(-1), spec)
    cache.view(2, num_blocks * block_size, n_kv, head_dim).index_copy_(1, plan.slots, new_codes)
    scales.index_copy_(1, plan.blocks, new_scale)


def dequantize(codes: Tensor, scales: Tensor, spec: KVQuantSpec, dtype: torch.dtype) -> Tensor:
    """Values of ``codes`` (N, n_kv, hd), as stored, under ``scales`` (N, n_kv), in ``dtype``."""
    # In place on the converted copy: a second full-size temporary costs ~3x on CPU.
    return codes.view(spec.code_dtype).to(dtype, copy=True).mul_(scales.to(dtype).unsqueeze(-1))


def _decode(codes: Tensor, spec: KVQuantSpec) -> Tensor:
    return codes.view(spec.code_dtype).float()


def _encode(codes: Tensor, spec: KVQuantSpec) -> Tensor:
    """Float codes (already divided by their scale) -> storage dtype, rounded and clamped."""
    assert spec.qmax is not None
    if spec.storage_dtype == torch.int8:
        return codes.round().clamp_(-spec.qmax, spec.qmax).to(torch.int8)
    return codes.clamp(-spec.qmax, spec.qmax).to(spec.code_dtype).view(torch.uint8)
