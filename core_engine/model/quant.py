"""Dequantisation of GGUF tensor data to torch fp32.

F32, F16, BF16, Q8_0, Q4_0 and Q4_1 are vectorised here in torch: each of those block types
packs 32 weights of one row, a float16 scale ``d`` (and for Q4_1 a float16 minimum ``m``)
followed by the quants, and the formulas match ggml's reference ``dequantize_row_*`` exactly,
so a dequantised fp32 matrix is bit-identical to what ggml computes per block.

Q5_0, Q5_1 and the K-quants (Q2_K ... Q6_K, super-blocks of 256 weights) go through
``gguf.quants.dequantize`` (the ``gguf`` package's numpy port of ggml's reference
dequantisers), once at load: what runs per step is the engine's weight format.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import Tensor

__all__ = ["SUPPORTED_TYPES", "UnsupportedTensorTypeError", "dequantize"]

QK = 32  # weights per block for all the block types below


class UnsupportedTensorTypeError(ValueError):
    """A tensor uses a GGML type this engine cannot dequantise (message names it)."""


def _f16(blocks: Tensor, start: int) -> Tensor:
    """Read a float16 field at byte ``start`` of each block row → (n_blocks, 1) fp32."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: Tensor) -> Tensor:
    """16 packed bytes per block → 32 quants: low nibbles are weights 0..15, high 16..31."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1)  # (n_blocks, 32) uint8


def _q8_0(blocks: Tensor) -> Tensor:
    # block: d f16 | qs int8[32]
    d = _f16(blocks, 0)
    qs = blocks[:, 2:].contiguous().view(torch.int8)
    return qs.float() * d


def _q4_0(blocks: Tensor) -> Tensor:
    # block: d f16 | qs u8[16]; w = (q - 8) * d
    d = _f16(blocks, 0)
    return (_nibbles(blocks[:, 2:]).float() - 8.0) * d


def _q4_1(blocks: Tensor) -> Tensor:
    # block: d f16 | m f16 | qs u8[16]; w = q * d + m, rounded once (as ggml's fused
    # multiply-add does): in float64 the product and the sum are exact.
    d = _f16(blocks, 0).double()
    m = _f16(blocks, 2).double()
    return (_nibbles(blocks[:, 4:]).double() * d + m).float()


_BLOCK_DEQUANTIZERS = {
    GGMLQuantizationType.Q8_0: (34, _q8_0),
    GGMLQuantizationType.Q4_0: (18, _q4_0),
    GGMLQuantizationType.Q4_1: (20, _q4_1),
}

#: Dequantised by ``gguf.quants`` (numpy), in chunks of whole blocks.
_GGUF_DEQUANTIZED = frozenset({
    GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q2_K, GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
})

SUPPORTED_TYPES = frozenset(
    {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
    | set(_BLOCK_DEQUANTIZERS)
    | _GGUF_DEQUANTIZED
)

# Rows per chunk when dequantising block types: bounds the fp32 temporaries to ~64 MiB.
_CHUNK_ELEMENTS = 16 * 1024 * 1024


#: Blocks per row handed to ``gguf.quants``, which works on groups of 16 rows at a time: one
#: block per row made ~55,000 numpy calls per 16M weights of Q5_0 (SmolLM2's embedding in a
#: Q4_K_M file took 3 s); 16 blocks a row is 7x faster, and the values are the same.
_BLOCKS_PER_ROW = 16


def _block_rows(blocks: np.ndarray) -> np.ndarray:
    """``(n_blocks, block_bytes)`` as rows of ``_BLOCKS_PER_ROW`` blocks (one row if it does not divide)."""
    n_blocks, block_bytes = blocks.shape
    per_row = _BLOCKS_PER_ROW if n_blocks % _BLOCKS_PER_ROW == 0 else n_blocks
    return blocks.reshape(n_blocks // per_row, per_row * block_bytes)


def dequantize(
    data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...], *, name: str = "tensor"
) -> Tensor:
    """Dequantise raw GGUF tensor ``data`` to an fp32 tensor of ``shape`` (torch order, rows first).

    ``data`` is what :class:`gguf.GGUFReader` exposes (a possibly read-only memmap view);
    ``shape`` is the logical shape with the innermost (contiguous) dimension last.
    """
    numel = int(np.prod(shape))
    if qtype == GGMLQuantizationType.F32:
        flat = torch.from_numpy(np.array(data, dtype=np.float32, copy=True).reshape(-1))
    elif qtype == GGMLQuantizationType.F16:
        flat = torch.from_numpy(np.array(data, dtype=np.float16, copy=True).reshape(-1)).float()
    elif qtype == GGMLQuantizationType.BF16:
        raw = np.asarray(data).reshape(-1).view(np.uint16).astype(np.uint32)
        # bf16 is the high half of an fp32: shift the 16 bits into place.
        flat = torch.from_numpy((raw << 16).view(np.float32))
    elif qtype in _BLOCK_DEQUANTIZERS:
        block_bytes, fn = _BLOCK_DEQUANTIZERS[qtype]
        raw = np.array(data, copy=True).reshape(-1).view(np.uint8)
        blocks = torch.from_numpy(raw).view(-1, block_bytes)  # (n_blocks, block_bytes)
        if blocks.shape[0] * QK != numel:
            raise UnsupportedTensorTypeError(
                f"{name}: {blocks.shape[0]} {qtype.name} blocks do not hold {numel} weights"
            )
        step = max(1, _CHUNK_ELEMENTS // QK)
        flat = torch.cat([fn(blocks[i : i + step]) for i in range(0, blocks.shape[0], step)]).view(-1)
    elif qtype in _GGUF_DEQUANTIZED:
        from gguf import GGML_QUANT_SIZES, quants

        block_weights, block_bytes = GGML_QUANT_SIZES[qtype]
        raw = np.asarray(data).reshape(-1).view(np.uint8)
        if raw.size % block_bytes or raw.size // block_bytes * block_weights != numel:
            raise UnsupportedTensorTypeError(f"{name}: {raw.size} bytes of {qtype.name} blocks do not hold {numel} weights")
        packed = raw.reshape(-1, block_bytes)
        step = max(1, _CHUNK_ELEMENTS // block_weights)
        flat = torch.cat([
            torch.from_numpy(quants.dequantize(_block_rows(packed[i : i + step]), qtype).astype(np.float32).reshape(-1))
            for i in range(0, packed.shape[0], step)
        ])
    else:
        raise UnsupportedTensorTypeError(
            f"{name}: tensor type {qtype.name} is not supported "
            f"(supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))})"
        )
    if flat.numel() != numel:
        raise UnsupportedTensorTypeError(f"{name}: {flat.numel()} values for shape {shape}")
    return flat.view(shape)
