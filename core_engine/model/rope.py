"""Rotary position embedding (rotate-half layout) with the scalings the loader understands:
linear, Llama 3.1's per-pair factors, and Phi-3's LongRoPE (its set chosen by the engine's
context window, see :func:`longrope_freq_factors`)."""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from core_engine.kernels.dispatch import use_triton
from core_engine.model.config import LlamaConfig

__all__ = ["RotaryEmbedding", "apply_rotary", "llama3_freq_factors", "longrope_attention_factor", "longrope_freq_factors"]

logger = logging.getLogger(__name__)


def llama3_freq_factors(
    rope_dim: int, theta: float, *, factor: float, low_freq_factor: float, high_freq_factor: float, original_context: int
) -> Tensor:
    """Llama 3.1's per-pair RoPE frequency divisors (``rope_type = "llama3"`` in a Hugging Face
    config; what llama.cpp's converter writes as ``rope_freqs.weight``): pairs whose wavelength
    is short against the original context keep their frequency, long ones are divided by
    ``factor``, and the band between is interpolated."""
    import math

    inv_freq = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = original_context / low_freq_factor, original_context / high_freq_factor
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    between = 1.0 / ((1.0 - smooth) / factor + smooth)
    out = torch.where(wavelen < high_wavelen, torch.ones_like(wavelen), torch.where(wavelen > low_wavelen, factor, between))
    return out.float()


def longrope_freq_factors(short: Tensor, long: Tensor, *, context_window: int, original_context: int) -> Tensor:
    """The LongRoPE frequency divisors an engine with ``context_window`` positions uses: ``long``
    when the window is longer than the pretraining context ``original_context``, else ``short``.

    One set for every position, chosen once by the configured context (llama.cpp's rule on its
    ``n_ctx``): a sequence's cached keys never change rotation as it grows.
    ``transformers`` instead chooses per forward by the sequence's length, so it agrees with this
    whenever the sequence and the window fall on the same side of ``original_context``.
    """
    is_long = context_window > original_context
    logger.info("LongRoPE: context window %d %s original context %d: the %s factors", context_window,
                ">" if is_long else "<=", original_context, "long" if is_long else "short")
    return long if is_long else short


def longrope_attention_factor(factor: float, original_context: int) -> float:
    """LongRoPE's cos/sin multiplier where the config gives none: ``sqrt(1 + ln(factor) /
    ln(original_context))`` for ``factor`` (trained over original context) above 1, else 1
    (what ``transformers`` computes and llama.cpp's converter writes as ``rope.scaling.attn_factor``)."""
    import math

    return math.sqrt(1.0 + math.log(factor) / math.log(original_context)) if factor > 1.0 else 1.0


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs ``(i, i + D/2)`` of ``x`` (T, n, D) by the angles whose cos/sin are (T, 1, D/2).

    Where the kernel dispatcher picks Triton (CUDA), the rotary kernel does it in one launch,
    in fp32 rounded once; elsewhere the torch formula below, in x's dtype, as before."""
    if x.shape[1] >= 2 and use_triton(x.device):
        return _apply_rotary_triton(x, cos, sin)
    x1, x2 = x.chunk(2, dim=-1)  # (T, n, D/2) each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # (T, n, D)


def _apply_rotary_triton(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # The kernel rotates a q and a k by positions into full tables; here the tables are the
    # rows already looked up (T, D/2), token t reads row t, and x's heads split into q and k.
    from core_engine.kernels.rotary import apply_rotary_embedding

    out = x.contiguous().clone()  # (T, n, D)
    split = (out.shape[1] + 1) // 2
    rows = torch.arange(out.shape[0], device=out.device)  # (T,)
    cos_rows, sin_rows = cos.reshape(out.shape[0], -1), sin.reshape(out.shape[0], -1)  # (T, D/2)
    apply_rotary_embedding(
        out[:, :split], out[:, split:], rows, cos_rows.contiguous(), sin_rows.contiguous(), inplace=True
    )
    return out


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to the context length, looked up per step.

    The angle of pair ``i`` at position ``p`` is ``p * scale / freq_factor[i] * theta^(-2i/D)``
    (llama.cpp's ``rope_ext`` without YaRN): ``scale`` is ``1/factor`` for linear scaling and
    ``freq_factors`` come from a ``rope_freqs.weight`` tensor (Llama 3.x long-context models) or
    are LongRoPE's short or long set (:func:`longrope_freq_factors`), whose
    ``attention_factor`` then multiplies cos and sin. Tables are computed in float64 and stored
    in ``dtype``.
    """

    cos: Tensor
    sin: Tensor

    def __init__(
        self,
        config: LlamaConfig,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        freq_factors: Tensor | None = None,
    ) -> None:
        super().__init__()
        half = config.rope_dim // 2
        exponent = torch.arange(half, dtype=torch.float64) * 2.0 / config.rope_dim
        inv_freq = config.rope_theta ** (-exponent)  # (D/2,)
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.to(torch.float64)
        positions = torch.arange(config.context_length, dtype=torch.float64)
        if config.rope_scaling is not None and config.rope_scaling.kind == "linear":
            positions = positions / config.rope_scaling.factor
        angles = torch.outer(positions, inv_freq)  # (max_positions, D/2)
        mscale = config.rope_scaling.attention_factor if config.rope_scaling is not None else 1.0
        self.register_buffer("cos", (angles.cos() * mscale).to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("sin", (angles.sin() * mscale).to(device=device, dtype=dtype), persistent=False)

    @property
    def max_positions(self) -> int:
        """Positions covered by the tables (the model's context length)."""
        return self.cos.shape[0]

    def lookup(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin for ``positions`` (T,), each shaped (T, 1, D/2) to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
