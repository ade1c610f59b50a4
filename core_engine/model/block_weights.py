"""GGUF blocks to the arrays of the int4 and int8 weight formats, without a second rounding.

The int4 format is Q4_1's block split into arrays: ``qweight`` (N, K/2) uint8 (byte j of a
block: weight j in the low nibble, weight j + 16 in the high one), ``scales`` and ``mins``
(N, K/32) fp16, ``W = scales * q + mins``. The int8 format is Q8_0's: ``qweight`` (N, K) int8,
``scales`` (N, K/32) fp16, ``W = scales * q``.

* Q4_1 and Q8_0 blocks are copied as they are;
* Q4_0 (``W = d (q - 8)``) becomes ``mins = -8 d`` (exact in fp16);
* Q4_K super-blocks of 256 carry 8 sub-blocks of 32 with 6-bit scales and minima under fp16
  ``d``/``dmin``: each sub-block becomes one block with ``scales = d * sc`` and
  ``mins = -dmin * m`` rounded to fp16 (2^-11 relative, far below the 4-bit step), its
  codes reordered from Q4_K's 64-weight chunks;
* any other tensor (F32, F16, BF16, Q6_K...) is quantised from its dequantised values with
  ``gguf.quants`` (Q4_1 or Q8_0, llama.cpp's own rounding): lossy, and logged by the caller.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants
from torch import Tensor

__all__ = ["BlockSource", "BlockWeight", "concat_rows", "from_gguf_blocks", "is_exact", "permute_rows", "quantize_dense"]

#: (qweight, scales, mins or None)
BlockWeight = tuple[Tensor, Tensor, Tensor | None]



class BlockSource(Protocol):
    """Where a model's products come from in block form (the GGUF loader implements it)."""

    def block_weight(self, name: str, weight_format: str) -> BlockWeight | None:
        """Product ``name`` (``layers.3.qkv``, ``head``...) in ``weight_format`` ("int4" or
        "int8"), from the file's blocks where they match; None if the source cannot say."""
        ...

    def natural_format(self, name: str) -> str:
        """The block format that holds product ``name``'s file weights best ("int4"/"int8")."""
        ...


_EXACT = {
    "int4": frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K}),
    "int8": frozenset({GGMLQuantizationType.Q8_0}),
}


def is_exact(weight_format: str, qtype: GGMLQuantizationType) -> bool:
    """Whether tensors of ``qtype`` go into ``weight_format`` without a second rounding."""
    return qtype in _EXACT.get(weight_format, ())


def _f16_field(blocks: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, start : start + 2]).view(np.float16)[:, 0]


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return blocks[:, 4:], _f16_field(blocks, 0), _f16_field(blocks, 2)


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16_field(blocks, 0)
    return blocks[:, 2:], d, (d * np.float16(-8.0)).astype(np.float16)


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # super-block: d f16 | dmin f16 | scales u8[12] | qs u8[128]; sub-block 2c takes the low
    # nibbles of qs[32c : 32c + 32], sub-block 2c + 1 the high ones.
    n = blocks.shape[0]
    d = _f16_field(blocks, 0).astype(np.float32)[:, None]
    dmin = _f16_field(blocks, 2).astype(np.float32)[:, None]
    sc, mn = quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))  # (n, 8) each
    qs = blocks[:, 16:].reshape(n, 4, 32)
    codes = np.stack((qs & 0x0F, qs >> 4), axis=2).reshape(n * 8, 32)  # (sub-blocks, 32 in k order)
    packed = (codes[:, :16] | (codes[:, 16:] << 4)).astype(np.uint8)
    scales = (d * sc.astype(np.float32)).astype(np.float16).reshape(-1)
    mins = (-dmin * mn.astype(np.float32)).astype(np.float16).reshape(-1)
    return packed, scales, mins


def _q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    return blocks[:, 2:], _f16_field(blocks, 0), None


_SPLITTERS = {
    GGMLQuantizationType.Q4_1: (20, _q4_1),
    GGMLQuantizationType.Q4_0: (18, _q4_0),
    GGMLQuantizationType.Q4_K: (144, _q4_k),
    GGMLQuantizationType.Q8_0: (34, _q8_0),
}


def from_gguf_blocks(data: np.ndarray, qtype: GGMLQuantizationType, rows: int, cols: int) -> BlockWeight:
    """Raw tensor ``data`` (``rows`` x ``cols`` weights, ``qtype`` blocks) as format arrays."""
    block_bytes, split = _SPLITTERS[qtype]
    raw = np.asarray(data).reshape(-1).view(np.uint8)
    blocks = raw.reshape(-1, block_bytes)
    qs, d, m = split(blocks)
    nb = cols // 32
    int4 = qtype != GGMLQuantizationType.Q8_0
    qweight = torch.from_numpy(np.ascontiguousarray(qs).reshape(rows, cols // 2 if int4 else cols).copy())
    if not int4:
        qweight = qweight.view(torch.int8)
    scales = torch.from_numpy(np.ascontiguousarray(d).reshape(rows, nb).copy())
    mins = None if m is None else torch.from_numpy(np.ascontiguousarray(m).reshape(rows, nb).copy())
    return qweight, scales, mins


def quantize_dense(weight: Tensor, weight_format: str) -> BlockWeight:
    """``weight`` (N, K) quantised to ``weight_format`` ("int4": Q4_1, "int8": Q8_0) by gguf."""
    qtype = GGMLQuantizationType.Q4_1 if weight_format == "int4" else GGMLQuantizationType.Q8_0
    rows, cols = weight.shape
    if cols % 32:
        raise ValueError(f"{weight_format} weights need rows of a multiple of 32 values, got {cols}")
    packed = quants.quantize(weight.detach().float().cpu().numpy(), qtype)
    return from_gguf_blocks(packed, qtype, rows, cols)


def permute_rows(weight: BlockWeight, order: Tensor) -> BlockWeight:
    """The same weight with its rows in ``order`` (blocks run along a row, so rows move whole)."""
    qweight, scales, mins = weight
    return qweight[order].contiguous(), scales[order].contiguous(), None if mins is None else mins[order].contiguous()


def concat_rows(parts: list[BlockWeight], *, groups: int = 1) -> BlockWeight:
    """Row-wise concatenation (fused q|k|v or gate|up) of weights of one format. With
    ``groups`` (a mixture's experts, each part's rows expert-major) it is per group: group
    ``g``'s rows of every part, then group ``g + 1``'s."""

    def cat(tensors: list[Tensor]) -> Tensor:
        return torch.cat([t.reshape(groups, -1, *t.shape[1:]) for t in tensors], dim=1).flatten(0, 1)

    mins = [p[2] for p in parts]
    return (
        cat([p[0] for p in parts]),
        cat([p[1] for p in parts]),
        None if any(m is None for m in mins) else cat(mins),  # type: ignore[arg-type]
    )
