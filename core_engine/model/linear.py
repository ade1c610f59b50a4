"""Matrix-product weights in the form the device multiplies fastest.

The model's projections (fused QKV, output, fused gate/up, down, the LM head) call one of
these instead of ``F.linear`` directly, so the storage format is chosen once, after loading:

* :class:`DenseLinear` - the torch weight as loaded (fp32 or bf16), ``F.linear``/``addmm``.
* :class:`Fp16Linear` - fbgemm's fp16-weight GEMM (``quantized::linear_dynamic_fp16``): the
  weight is stored as fp16 in fbgemm's packed layout and widened to fp32 inside the kernel, so
  activations and accumulation stay fp32. On x86 CPUs without native bf16 (the dev machine:
  AVX512 but no AVX512-BF16) decode is bound by the bytes of weight read per step: half the
  bytes made single-stream decode and 16-way batched decode ~1.7x faster than fp32, and the
  packed layout is no slower than fp32 at 64 rows. Every weight of a Q4_0/Q4_1/Q8_0 GGUF is
  ``d * q (+ m)`` with fp16 ``d``/``m``, so fp16 storage rounds each weight by at most 2^-11
  relative - far below the file's own 4-bit quantisation step.

``weight_format`` values (``EngineConfig.weight_format``): ``"auto"`` picks ``"fp16"`` on a CPU
with fbgemm when the compute dtype is fp32, else ``"dense"``.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["WEIGHT_FORMATS", "DenseLinear", "Fp16Linear", "Linear", "make_linear", "resolve_weight_format"]

WeightFormat = Literal["auto", "dense", "fp16"]
WEIGHT_FORMATS: tuple[str, ...] = ("auto", "dense", "fp16")


class DenseLinear:
    """``y = x @ weight.T (+ bias)`` with the weight as torch holds it: (out, in)."""

    __slots__ = ("bias", "weight")

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias

    def __call__(self, x: Tensor) -> Tensor:
        """x: (T, in) -> (T, out)."""
        return F.linear(x, self.weight, self.bias)

    def add_to(self, residual: Tensor, x: Tensor) -> Tensor:
        """``residual + x @ weight.T`` in one ``addmm`` (no bias: used for o/down projections)."""
        return torch.addmm(residual, x, self.weight.t())

    @property
    def nbytes(self) -> int:
        """Bytes of weight (and bias) read per product."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.bias) if t is not None)


class Fp16Linear:
    """fp16 weights packed for fbgemm; fp32 activations, fp32 accumulation (CPU only)."""

    __slots__ = ("_bias", "_packed", "nbytes")

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        w = weight.detach().float().contiguous()
        self._bias = torch.zeros(w.shape[0]) if bias is None else bias.detach().float().contiguous()
        self._packed = _pack_fp16(w)
        self.nbytes = w.numel() * 2 + (0 if bias is None else self._bias.numel() * 4)

    def __call__(self, x: Tensor) -> Tensor:
        """x: (T, in) fp32 -> (T, out) fp32."""
        return _fp16_linear(x, self._packed, self._bias)

    def add_to(self, residual: Tensor, x: Tensor) -> Tensor:
        """``residual + self(x)``."""
        return torch.add(residual, self(x))


# ATen's own fbgemm fp16 functions cost ~3 us per call; the ``quantized::linear_dynamic_fp16``
# custom-class op does the same product but pays ~20 us of boxed dispatch per call, ~2.5 ms per
# decode step of a 30-layer model. torch marks the ATen pair deprecated (a warning per process)
# but 2.13 has them; the custom op is the fallback where they are gone.
if hasattr(torch, "fbgemm_linear_fp16_weight_fp32_activation"):

    def _pack_fp16(weight: Tensor) -> object:
        with warnings.catch_warnings():
            # torch warns once per process: spend that warning here, on a throwaway product.
            warnings.filterwarnings("ignore", message=r"fbgemm_\w+ is deprecated", category=UserWarning)
            packed = torch.fbgemm_pack_gemm_matrix_fp16(weight)
            torch.fbgemm_linear_fp16_weight_fp32_activation(
                torch.zeros(1, weight.shape[1]), packed, torch.zeros(weight.shape[0])
            )
        return packed

    def _fp16_linear(x: Tensor, packed: object, bias: Tensor) -> Tensor:
        return torch.fbgemm_linear_fp16_weight_fp32_activation(x, packed, bias)

else:  # pragma: no cover - newer torch without the ATen functions

    def _pack_fp16(weight: Tensor) -> object:
        return torch.ops.quantized.linear_prepack_fp16(weight, None)

    def _fp16_linear(x: Tensor, packed: object, bias: Tensor) -> Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, packed) + bias


Linear = DenseLinear | Fp16Linear


def fbgemm_available() -> bool:
    """Whether this torch build has fbgemm's fp16-weight kernels (x86 CPU builds do)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def resolve_weight_format(name: str, *, dtype: torch.dtype, device: torch.device | str) -> str:
    """``"auto"`` -> ``"fp16"`` for fp32 compute on a CPU with fbgemm, else ``"dense"``.

    Raises ValueError for an unknown name or ``"fp16"`` where it cannot run.
    """
    if name not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {', '.join(WEIGHT_FORMATS)}; got {name!r}")
    usable = torch.device(device).type == "cpu" and dtype == torch.float32 and fbgemm_available()
    if name == "auto":
        return "fp16" if usable else "dense"
    if name == "fp16" and not usable:
        raise ValueError(
            "weight_format='fp16' needs fp32 compute on a CPU whose torch has fbgemm "
            f"(got dtype {dtype} on {device})"
        )
    return name


def make_linear(weight_format: str, weight: Tensor, bias: Tensor | None = None) -> Linear:
    """A product over ``weight`` in ``weight_format`` ("dense" or "fp16"; resolve "auto" first)."""
    if weight_format == "fp16":
        return Fp16Linear(weight, bias)
    if weight_format == "dense":
        return DenseLinear(weight, bias)
    raise ValueError(f"make_linear: unresolved weight_format {weight_format!r}")
