"""Matrix-product weights in the form the device multiplies fastest.

The model's projections (fused QKV, output, fused gate/up, down, the LM head) call one of
these instead of ``F.linear`` directly, so the storage format is chosen once, after loading
(:mod:`core_engine.model.formats` lists the formats and what ``"auto"`` picks):

* :class:`DenseLinear` - the torch weight as loaded (fp32 or bf16), ``F.linear``/``addmm``.
* :class:`Fp16Linear` - fbgemm's fp16-weight GEMM (CPU, fp32 compute): half of fp32's bytes,
  exact to 2^-11 per weight for a 4-bit file.
* :class:`BlockQuantLinear` - int4 or int8 weights in blocks of 32 (GGUF's Q4_1 / Q8_0
  layouts, taken from the file's blocks without a second rounding where they match), times
  activations quantised to int8 per block of 32, in the compiled ``quant_linear`` kernel
  (AVX2 maddubs, AVX-512/AVX VNNI dpbusd); prefill-sized inputs multiply dequantised weight
  tiles in the compute dtype instead. The arithmetic is llama.cpp's for these blocks.
* :class:`TopKRefinedLinear` - an approximate LM head whose top logits are recomputed from the
  exact (dense) rows.

Every product offers the calls a decoder layer makes, so formats can fuse them: ``self(x)``,
``add_to(residual, x)``, ``normed(x, norm_weight, eps)`` (RMSNorm of the input first) and
``swiglu_add_to(residual, gate_up)`` (``residual + (silu(gate) * up) @ W.T``). The dense
forms run the same ops one by one.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from core_engine.model.formats import WEIGHT_FORMATS, auto_weight_format
from core_engine.model.norm import rms_norm

__all__ = [
    "WEIGHT_FORMATS",
    "BlockQuantLinear",
    "DenseLinear",
    "ExpertsLinear",
    "Fp16Linear",
    "Linear",
    "TopKRefinedLinear",
    "W4A16Linear",
    "block_linear",
    "dense_rows_by_dtype",
    "make_linear",
    "resolve_weight_format",
]


@functools.cache
def dense_rows_by_dtype() -> dict[torch.dtype, int]:
    """Input rows from which the block formats multiply dequantised weight tiles with the dense
    GEMM instead of the packed int8 dot products (the same products either way up to float
    rounding), per compute dtype; 0: never. Crossovers measured over SmolLM2's product shapes
    at 2 threads on a Xeon (docs/benchmarks.md "Block kernel, packed layout"): with AVX-512
    VNNI the dot products win at every size in fp32 and up to ~128 rows in bf16 with AMX; an
    AVX2 build (maddubs) loses from ~64 rows; the portable loops always lose.
    """
    from core_engine.cpu_features import cpu_flags
    from core_engine.kernels.cpu import cpu_extension

    isa, flags = cpu_extension("quant_linear").isa(), cpu_flags()
    if isa == "scalar":
        return {torch.float32: 1, torch.bfloat16: 1}
    if isa in ("avx2", "avx-vnni"):  # avx-vnni (ymm dpbusd) not measured: taken as AVX2
        return {torch.float32: 64, torch.bfloat16: 64}
    return {torch.float32: 0, torch.bfloat16: 128 if "amx_bf16" in flags else 0}


class _Product:
    """The fused calls of a decoder layer, as separate ops (formats override what they fuse)."""

    __slots__ = ()

    def __call__(self, x: Tensor) -> Tensor:  # pragma: no cover - every product defines it
        raise NotImplementedError

    def add_to(self, residual: Tensor, x: Tensor) -> Tensor:
        """``residual + self(x)``."""
        return torch.add(residual, self(x))

    def normed(self, x: Tensor, norm_weight: Tensor, eps: float) -> Tensor:
        """``self(rms_norm(x) * norm_weight)``."""
        return self(rms_norm(x, norm_weight, eps))

    def swiglu_add_to(self, residual: Tensor, gate_up: Tensor) -> Tensor:
        """``residual + self(silu(gate) * up)`` for ``gate_up = gate | up`` (T, 2 * in)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return self.add_to(residual, F.silu(gate) * up)

    def normed_rope(
        self, x: Tensor, norm_weight: Tensor, eps: float, cos: Tensor, sin: Tensor, rotated_heads: int, head_dim: int
    ) -> Tensor:
        """``self.normed(x, ...)`` as (T, heads, head_dim) with RoPE applied to the first
        ``rotated_heads`` heads (the q and k of a fused QKV); cos/sin: (T, 1, head_dim/2)."""
        from core_engine.model.rope import apply_rotary

        out = self.normed(x, norm_weight, eps)
        out = out.view(out.shape[0], -1, head_dim)
        return torch.cat((apply_rotary(out[:, :rotated_heads], cos, sin), out[:, rotated_heads:]), dim=1)


class DenseLinear(_Product):
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


class ExpertsLinear:
    """The same product of every expert of a mixture (``experts[e]``: expert ``e``'s, any
    format), multiplied one expert at a time by the MoE dispatch
    (:func:`core_engine.model.moe.moe_feed_forward`)."""

    __slots__ = ("experts",)

    def __init__(self, experts: list[_Product]) -> None:
        self.experts = experts

    @property
    def nbytes(self) -> int:
        """Bytes of every expert's weights."""
        return sum(e.nbytes for e in self.experts)  # type: ignore[attr-defined]


class Fp16Linear(_Product):
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


class BlockQuantLinear(_Product):
    """int4 or int8 weights in blocks of 32 (see :mod:`core_engine.model.block_weights` for
    the arrays), multiplied by the compiled ``quant_linear`` CPU kernel, which also fuses the
    input's RMSNorm or SwiGLU, the bias and the residual add.

    The arrays are regrouped once, here, into the kernel's packed layout (groups of 16 weight
    rows, one record per block; ``quant_linear.cpp``) and only that is kept.
    ``weight_format``: ``"int4"`` (``mins`` given) or ``"int8"``. Inputs of ``dense_rows``
    rows or more (large prefill chunks) multiply dequantised weight tiles in the input's dtype;
    ``None`` (the default) takes :func:`dense_rows_by_dtype`'s crossover for the input's dtype.
    """

    __slots__ = ("_bias", "_by_dtype", "_kernel", "_out", "_packed", "dense_rows", "nbytes", "weight_format")

    def __init__(
        self, qweight: Tensor, scales: Tensor, mins: Tensor | None, bias: Tensor | None = None,
        *, dense_rows: int | None = None,
    ) -> None:
        from core_engine.kernels.cpu import cpu_extension

        ext = cpu_extension("quant_linear")
        self.weight_format = "int4" if mins is not None else "int8"
        self._out = qweight.shape[0]
        self._packed = ext.quant_pack(
            qweight.contiguous(), scales.to(torch.float16).contiguous(),
            None if mins is None else mins.to(torch.float16).contiguous(),
        )
        self._bias = None if bias is None else bias.detach().float().contiguous()
        self._kernel = ext.quant_linear
        self._by_dtype = dense_rows_by_dtype()
        self.dense_rows = dense_rows
        self.nbytes = sum(t.numel() * t.element_size() for t in (self._packed, self._bias) if t is not None)

    @property
    def out_features(self) -> int:
        return self._out

    def _rows(self, x: Tensor) -> int:
        return self.dense_rows if self.dense_rows is not None else self._by_dtype.get(x.dtype, 0)

    def __call__(self, x: Tensor) -> Tensor:
        """x: (T, in) fp32/bf16 -> (T, out) in x's dtype."""
        return self._kernel(x, self._packed, self._out, self._bias, None, None, 1e-6, False, self._rows(x))

    def add_to(self, residual: Tensor, x: Tensor) -> Tensor:
        return self._kernel(x, self._packed, self._out, self._bias, residual, None, 1e-6, False, self._rows(x))

    def normed(self, x: Tensor, norm_weight: Tensor, eps: float) -> Tensor:
        return self._kernel(x, self._packed, self._out, self._bias, None, norm_weight, eps, False, self._rows(x))

    def swiglu_add_to(self, residual: Tensor, gate_up: Tensor) -> Tensor:
        return self._kernel(gate_up, self._packed, self._out, self._bias, residual, None, 1e-6, True, self._rows(gate_up))

    def normed_rope(
        self, x: Tensor, norm_weight: Tensor, eps: float, cos: Tensor, sin: Tensor, rotated_heads: int, head_dim: int
    ) -> Tensor:
        out = self._kernel(
            x, self._packed, self._out, self._bias, None, norm_weight, eps, False, self._rows(x),
            cos, sin, rotated_heads * head_dim,
        )
        return out.view(out.shape[0], -1, head_dim)

    def dequantized(self) -> Tensor:
        """The weight as fp32 (out, in): what the kernel multiplies (tests, sensitivity)."""
        from core_engine.kernels.cpu import cpu_extension

        return cpu_extension("quant_linear").packed_dequantize(self._packed, self._out)


class W4A16Linear(_Product):
    """int4 weights (the same arrays as :class:`BlockQuantLinear`) on a GPU: the Triton W4A16
    kernel of :mod:`core_engine.kernels.w4a16` (activations stay 16-bit)."""

    __slots__ = ("_bias", "_mins", "_qweight", "_scales", "nbytes", "weight_format")

    def __init__(self, qweight: Tensor, scales: Tensor, mins: Tensor, bias: Tensor | None = None) -> None:
        self.weight_format = "int4"
        self._qweight, self._scales, self._mins = qweight.contiguous(), scales.half().contiguous(), mins.half().contiguous()
        self._bias = bias
        self.nbytes = sum(t.numel() * t.element_size() for t in (self._qweight, self._scales, self._mins, bias) if t is not None)

    def __call__(self, x: Tensor) -> Tensor:
        from core_engine.kernels.w4a16 import w4a16_matmul

        return w4a16_matmul(x, self._qweight, self._scales, self._mins, self._bias)

    def dequantized(self) -> Tensor:
        from core_engine.kernels.w4a16 import unpack_int4

        return unpack_int4(self._qweight, self._scales, self._mins)


class TopKRefinedLinear(_Product):
    """An approximate product whose ``k`` largest outputs per row are recomputed exactly.

    For a quantised LM head: 8-bit activations move every logit a little, enough to swap
    near-tied top tokens, but only the top of the distribution decides greedy, top-k/top-p
    sampling and the reported logprobs. Recomputing the top ``k`` logits from the exact
    weight rows (a gather and a (T, k, hidden) product; the rows are the embedding table a
    tied model keeps anyway) costs ~1/1000 of the head.
    """

    __slots__ = ("_approx", "_exact", "_k", "nbytes")

    def __init__(self, approx: Linear, exact_weight: Tensor, k: int = 32) -> None:
        self._approx = approx
        self._exact = exact_weight  # (out, in), rows gathered per call
        self._k = min(k, exact_weight.shape[0])
        self.nbytes: int = approx.nbytes

    def __call__(self, x: Tensor) -> Tensor:
        """x: (T, in) -> (T, out), the top ``k`` of each row exact."""
        y = self._approx(x)  # (T, out)
        top = y.topk(self._k, dim=-1, sorted=False).indices  # (T, k)
        rows = self._exact.index_select(0, top.view(-1)).view(*top.shape, x.shape[1])  # (T, k, in)
        y.scatter_(1, top, torch.bmm(rows, x.unsqueeze(-1).to(rows.dtype)).squeeze(-1).to(y.dtype))
        return y


Linear = DenseLinear | Fp16Linear | BlockQuantLinear | W4A16Linear | TopKRefinedLinear

#: The overload itself: skips the packet's per-call overload resolution.
_linear_dynamic_fp16 = torch.ops.quantized.linear_dynamic_fp16.default


def fbgemm_available() -> bool:
    """Whether this torch build has fbgemm's fp16-weight kernels (x86 CPU builds do)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def check_weight_format(name: str, *, dtype: torch.dtype, device: torch.device | str) -> None:
    """Raise ValueError naming the combination when ``name`` cannot run with ``dtype`` on
    ``device`` (the engine calls this at config load, before any weight is read)."""
    if name not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {', '.join(WEIGHT_FORMATS)}; got {name!r}")
    device_type = torch.device(device).type
    if device_type == "cpu":
        if name == "fp16" and (dtype != torch.float32 or not fbgemm_available()):
            raise ValueError(
                f"weight_format='fp16' with dtype={str(dtype).removeprefix('torch.')!r} on cpu: fbgemm's fp16 "
                "kernel computes in float32 (use dtype 'float32' or 'auto', or weight_format 'int8'/'int4')"
                + ("" if fbgemm_available() else "; this torch has no fbgemm")
            )
        if dtype == torch.float16 and name not in ("auto", "dense"):
            raise ValueError(
                f"weight_format={name!r} with dtype='float16' on cpu: the CPU kernels take float32 or bfloat16 "
                "activations (use dtype 'auto')"
            )
    elif name in ("fp16", "int8"):
        raise ValueError(
            f"weight_format={name!r} on {device_type}: only 'auto', 'dense' and 'int4' (Triton W4A16) run there"
        )


def resolve_weight_format(
    name: str, *, dtype: torch.dtype, device: torch.device | str, file_type: str | None = None
) -> str:
    """The concrete format for ``name`` (``"auto"``: see :func:`core_engine.model.formats.auto_weight_format`).

    Raises ValueError for an unknown name or a combination that cannot run.
    """
    check_weight_format(name, dtype=dtype, device=device)
    if name == "auto":
        return auto_weight_format(device, dtype, file_type).weight_format
    return name


def block_linear(blocks: tuple[Tensor, Tensor, Tensor | None], bias: Tensor | None, *, device: torch.device) -> Linear:
    """The product over block-format arrays on ``device``: the CPU kernel, or Triton W4A16
    for int4 on a GPU."""
    qweight, scales, mins = blocks
    if device.type == "cpu":
        return BlockQuantLinear(qweight, scales, mins, bias)
    if mins is None:
        raise ValueError(f"weight_format='int8' does not run on {device.type} (only 'auto', 'dense', 'int4')")
    return W4A16Linear(qweight.to(device), scales.to(device), mins.to(device), bias)


def make_linear(weight_format: str, weight: Tensor, bias: Tensor | None = None) -> Linear:
    """A product over the dense ``weight`` in ``weight_format`` (resolve "auto" first); the
    block formats quantise it (use :class:`BlockQuantLinear` with the file's blocks to avoid
    a second rounding)."""
    if weight_format == "fp16":
        return Fp16Linear(weight, bias)
    if weight_format in ("int8", "int4"):
        from core_engine.model.block_weights import quantize_dense

        return block_linear(quantize_dense(weight, weight_format), bias, device=weight.device)
    if weight_format == "dense":
        return DenseLinear(weight, bias)
    raise ValueError(f"make_linear: unresolved weight_format {weight_format!r}")
