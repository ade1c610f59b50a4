"""Weight formats: what each one stores, and which one ``"auto"`` picks on this hardware.

One table for the engine (:mod:`core_engine.model.linear` builds the products), the
quantization policy and ``infermux plan`` (which prints the memory and rooflines of each).

=========  ==================================================================  ============
format     storage per weight                                                  bytes/weight
=========  ==================================================================  ============
dense      the compute dtype as loaded (fp32 or bf16; fp16 on GPUs)            4 / 2
fp16       fp16, fbgemm's packed layout, widened to fp32 in the kernel (CPU)   2
int8       int8 codes in blocks of 32 with an fp16 scale (Q8_0's layout)       34 / 32
int4       4-bit codes in blocks of 32 with an fp16 scale and minimum (Q4_1)   20 / 32
=========  ==================================================================  ============

The embedding table is looked up row by row and stays dense in the compute dtype; the LM head
(tied or not) is a product like the others.
"""

from __future__ import annotations

from typing import Literal

import torch

from core_engine.cpu_features import cpu_flags

__all__ = [
    "BLOCK",
    "CPU_FAMILIES",
    "WEIGHT_FORMATS",
    "AutoChoice",
    "auto_weight_format",
    "bytes_per_weight",
    "cpu_family",
]

WeightFormat = Literal["auto", "dense", "fp16", "int8", "int4"]
WEIGHT_FORMATS: tuple[str, ...] = ("auto", "dense", "fp16", "int8", "int4")
#: Weights per quantisation block of the int8 and int4 formats.
BLOCK = 32

CpuFamily = Literal["amx", "avx512", "avx2", "other"]
CPU_FAMILIES: tuple[str, ...] = ("amx", "avx512", "avx2", "other")


def cpu_family(flags: frozenset[str] | None = None) -> CpuFamily:
    """The CPU family the kernels are tuned for: AMX (Sapphire Rapids and later), AVX-512
    (with or without VNNI), AVX2-only, or anything else (scalar kernels)."""
    flags = cpu_flags() if flags is None else flags
    if "amx_bf16" in flags or "amx_int8" in flags:
        return "amx"
    if "avx512f" in flags and "avx512bw" in flags:
        return "avx512"
    if "avx2" in flags and "fma" in flags:
        return "avx2"
    return "other"


def bytes_per_weight(weight_format: str, dtype: torch.dtype = torch.float32) -> float:
    """Bytes one matmul weight takes in ``weight_format`` (``dense``: in ``dtype``)."""
    if weight_format == "dense":
        return float(torch.empty((), dtype=dtype).element_size())
    if weight_format == "fp16":
        return 2.0
    if weight_format == "int8":
        return (BLOCK + 2) / BLOCK
    if weight_format == "int4":
        return (BLOCK // 2 + 4) / BLOCK
    raise ValueError(f"weight_format must be one of {', '.join(WEIGHT_FORMATS[1:])}; got {weight_format!r}")


class AutoChoice:
    """What ``weight_format = "auto"`` became, and why (logged at load, printed by the planner)."""

    __slots__ = ("reason", "weight_format")

    def __init__(self, weight_format: str, reason: str) -> None:
        self.weight_format = weight_format
        self.reason = reason

    def __repr__(self) -> str:
        return f"AutoChoice({self.weight_format!r}, {self.reason!r})"


#: GGUF file types whose matmul weights are 4-bit blocks the int4 format holds without a
#: second rounding; 8-bit ones go to int8 the same way.
_FOUR_BIT_FILES = frozenset({"Q4_0", "Q4_1", "Q4_K_S", "Q4_K_M"})
_EIGHT_BIT_FILES = frozenset({"Q8_0"})


def auto_weight_format(
    device: str | torch.device, dtype: torch.dtype, file_type: str | None, *, family: CpuFamily | None = None
) -> AutoChoice:
    """The fastest format within the accuracy bound for a model file on this hardware.

    The bound is the file's own precision: a 4-bit file runs int4 (its blocks as they are),
    an 8-bit file int8; a 16/32-bit file runs int8 (blocks of 32 with their own scale: mean
    KL from the exact model ~1e-4, where 4-bit requantisation moves it 10-100x more). On
    CUDA the 4-bit file runs the Triton W4A16 kernel, anything else dense.
    """
    device = torch.device(device)
    if device.type == "cuda":
        if file_type in _FOUR_BIT_FILES:
            return AutoChoice("int4", f"{file_type} file on CUDA: its 4-bit blocks, Triton W4A16 kernel")
        return AutoChoice("dense", f"{file_type or 'unknown'} file on CUDA: dense {dtype} weights")
    family = family or cpu_family()
    if dtype == torch.float16:
        return AutoChoice("dense", "float16 compute on a CPU: the int8/int4 kernels take float32 or bfloat16 activations")
    kernel = {
        "amx": "AVX-512 VNNI int8 dot products for small batches, AMX bf16 GEMMs on dequantised tiles for large ones",
        "avx512": "AVX-512 VNNI int8 dot products",
        "avx2": "AVX2 int8 dot products (maddubs)",
        "other": "portable C++ loops",
    }[family]
    if file_type in _FOUR_BIT_FILES:
        return AutoChoice("int4", f"{file_type} file on a {family} CPU: its 4-bit blocks as stored; {kernel}")
    if file_type in _EIGHT_BIT_FILES:
        return AutoChoice("int8", f"{file_type} file on a {family} CPU: its 8-bit blocks as stored; {kernel}")
    return AutoChoice(
        "int8", f"{file_type or 'unknown'} file on a {family} CPU: 8-bit blocks of 32 stay within the accuracy bound; {kernel}"
    )
