"""Matrix-product weights in the form the device multiplies fastest.

The model's projections (fused QKV, output, fused gate/up, down, the LM head) call one of
these instead of ``F.linear`` directly, so the storage format is chosen once, after loading:

* :class:`DenseLinear` - the torch weight as loaded (fp32 or bf16), ``F.linear``/``addmm``.
* :class:`Fp16Linear` - fbgemm's fp16-weight GEMM: the weight is stored as fp16 in fbgemm's
  packed layout and widened to fp32 inside the kernel, so activations and accumulation stay
  fp32. On x86 CPUs without native bf16 (the dev machine: AVX512 but no AVX512-BF16) decode is
  bound by the bytes of weight read per step; half the bytes made 1-thread decode ~1.4x faster,
  but at 2 threads only 16-row batches gained (fbgemm's per-call dispatch is ~20 us). Every
  weight of a Q4_0/Q4_1/Q8_0 GGUF is ``d * q (+ m)`` with fp16 ``d``/``m``, so fp16 storage
  rounds each weight by at most 2^-11 relative - far below the file's own 4-bit step.
* :class:`Int8Linear` - int8 weight rows (one fp32 scale each) times 16-bit fixed-point
  activations (two int8 digit planes) in int8 GEMMs: a quarter of fp32's bytes and the CPU's
  VNNI int8 throughput. Lossy: requantising the 4-bit blocks to int8 rows moves the logits
  about as far from the exact model as llama.cpp's own 8-bit activations do (mean KL from the
  exact next-token distribution 0.0032 vs llama.cpp's 0.0028 on SmolLM2). The LM head is
  wrapped in :class:`TopKRefinedLinear` so the logits that decide sampling are exact.

``weight_format`` values (``EngineConfig.weight_format``): ``"auto"`` keeps ``"dense"`` weights
(at 2 threads on the dev CPU fp16 won only at 16 rows and lost at 1 and 512); ``"fp16"`` and
``"int8"`` are opt-in, ``"int8"`` being the fast path (see docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "WEIGHT_FORMATS",
    "DenseLinear",
    "Fp16Linear",
    "Int8Linear",
    "Linear",
    "TopKRefinedLinear",
    "make_linear",
    "resolve_weight_format",
]

WeightFormat = Literal["auto", "dense", "fp16", "int8"]
WEIGHT_FORMATS: tuple[str, ...] = ("auto", "dense", "fp16", "int8")


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
    """fp16 weights packed for fbgemm; fp32 activations, fp32 accumulation (CPU only).

    Through ``quantized::linear_dynamic_fp16``, which splits the product over torch's threads
    (ATen's older ``fbgemm_linear_fp16_weight`` costs less per call, ~3 vs ~20 us, but runs on
    one thread: 2x slower at 2 threads).
    """

    __slots__ = ("_packed", "nbytes")

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        w = weight.detach().float().contiguous()
        b = None if bias is None else bias.detach().float().contiguous()
        self._packed = torch.ops.quantized.linear_prepack_fp16(w, b)
        self.nbytes = w.numel() * 2 + (0 if b is None else b.numel() * 4)

    def __call__(self, x: Tensor) -> Tensor:
        """x: (T, in) fp32 -> (T, out) fp32."""
        return _linear_dynamic_fp16(x, self._packed)

    def add_to(self, residual: Tensor, x: Tensor) -> Tensor:
        """``residual + self(x)``."""
        return torch.add(residual, self(x))


class Int8Linear:
    """int8 weights (one fp32 scale per output row), 16-bit fixed-point activations, int8
    GEMMs on the CPU (the compiled ``int8_linear`` of :mod:`core_engine.kernels.cpu`).

    ``precise=True`` stores a second int8 digit of each weight (W ~= s (W1 + W2 / 254)): one
    more GEMM for a product within ~1e-4 of fp32, used for the LM head, where one-digit
    weights would move the logits of every token.
    """

    __slots__ = ("_bias", "_kernel", "_scale", "_weight", "_weight_lo", "nbytes")

    def __init__(self, weight: Tensor, bias: Tensor | None = None, *, precise: bool = False) -> None:
        from core_engine.kernels.cpu import int8_linear_module

        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)  # (out,)
        digits = w / scale[:, None]  # in [-127, 127]
        high = torch.round(digits)
        self._weight = high.to(torch.int8).contiguous()  # (out, in)
        self._weight_lo = torch.round((digits - high) * 254.0).to(torch.int8).contiguous() if precise else None
        self._scale = scale.contiguous()
        self._bias = None if bias is None else bias.detach().float().contiguous()
        self._kernel = int8_linear_module().int8_linear
        self.nbytes = w.numel() * (2 if precise else 1) + scale.numel() * 4
        self.nbytes += 0 if bias is None else bias.numel() * 4

    def __call__(self, x: Tensor) -> Tensor:
        """x: (T, in) fp32 -> (T, out) fp32."""
        return self._kernel(x, self._weight, self._scale, self._bias, None, self._weight_lo)

    def add_to(self, residual: Tensor, x: Tensor) -> Tensor:
        """``residual + self(x)``, the add fused into the kernel's output pass."""
        return self._kernel(x, self._weight, self._scale, self._bias, residual, self._weight_lo)


class TopKRefinedLinear:
    """An approximate product whose ``k`` largest outputs per row are recomputed exactly.

    For the LM head of an int8 model: one-digit int8 weights move every logit by up to ~0.05,
    enough to swap near-tied top tokens, but only the top of the distribution decides greedy,
    top-k/top-p sampling and the reported logprobs. Recomputing the top ``k`` logits from the
    exact weight rows (a gather and a (T, k, hidden) product) costs ~1/1000 of the head, where
    fp16 or two-digit int8 weights would cost 1.5-2x the one-digit product.
    """

    __slots__ = ("_approx", "_exact", "_k", "nbytes")

    def __init__(self, approx: Linear, exact_weight: Tensor, k: int = 32) -> None:
        self._approx = approx
        self._exact = exact_weight  # (out, in), rows gathered per call
        self._k = min(k, exact_weight.shape[0])
        self.nbytes = approx.nbytes

    def __call__(self, x: Tensor) -> Tensor:
        """x: (T, in) -> (T, out), the top ``k`` of each row exact."""
        y = self._approx(x)  # (T, out)
        top = y.topk(self._k, dim=-1, sorted=False).indices  # (T, k)
        rows = self._exact.index_select(0, top.view(-1)).view(*top.shape, x.shape[1])  # (T, k, in)
        y.scatter_(1, top, torch.bmm(rows, x.unsqueeze(-1).to(rows.dtype)).squeeze(-1).to(y.dtype))
        return y


Linear = DenseLinear | Fp16Linear | Int8Linear | TopKRefinedLinear

#: The overload itself: skips the packet's per-call overload resolution.
_linear_dynamic_fp16 = torch.ops.quantized.linear_dynamic_fp16.default


def fbgemm_available() -> bool:
    """Whether this torch build has fbgemm's fp16-weight kernels (x86 CPU builds do)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def resolve_weight_format(name: str, *, dtype: torch.dtype, device: torch.device | str) -> str:
    """``"auto"`` -> ``"dense"`` (measured best default on the dev CPU; see docs/benchmarks.md).

    Raises ValueError for an unknown name, or ``"fp16"``/``"int8"`` where they cannot run.
    """
    if name not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {', '.join(WEIGHT_FORMATS)}; got {name!r}")
    # fp16 runs fbgemm's kernels; int8 its own (compiled when first used).
    on_cpu_fp32 = torch.device(device).type == "cpu" and dtype == torch.float32
    usable = on_cpu_fp32 and (name != "fp16" or fbgemm_available())
    if name == "auto":
        return "dense"
    if name in ("fp16", "int8") and not usable:
        raise ValueError(
            f"weight_format={name!r} needs fp32 compute on a CPU"
            + (" whose torch has fbgemm" if name == "fp16" else "")
            + f" (got dtype {dtype} on {device})"
        )
    return name


def make_linear(
    weight_format: str, weight: Tensor, bias: Tensor | None = None, *, precise: bool = False
) -> Linear:
    """A product over ``weight`` in ``weight_format`` (resolve "auto" first); ``precise``
    asks int8 for two-digit weights (the LM head)."""
    if weight_format == "fp16":
        return Fp16Linear(weight, bias)
    if weight_format == "int8":
        return Int8Linear(weight, bias, precise=precise)
    if weight_format == "dense":
        return DenseLinear(weight, bias)
    raise ValueError(f"make_linear: unresolved weight_format {weight_format!r}")
