"""Mixture-of-experts feed-forward (Qwen3-MoE, Mixtral): a router picks ``num_experts_used`` of
``num_experts`` SwiGLU experts per token and their outputs are summed with the router's
weights (softmax over all experts, the top ones kept and renormalised).

Dispatch is batched per expert, not per token: the step's (token, expert) pairs are sorted by
expert, and each expert that has tokens multiplies all of them in one GEMM; a loop over the
experts remains (up to 128 per layer in the models of the field). Each layer's experts are two
products, ``experts_gate_up`` and ``experts_down`` (an :class:`ExpertsLinear` of one product
per expert), stored in the weight format like the others: int4/int8 from the file's blocks
(``ffn_{gate,up,down}_exps``) where they match, quantised from the values otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from core_engine.model.config import LlamaConfig
from core_engine.model.linear import DenseLinear, ExpertsLinear
from core_engine.model.llama import LlamaDecoderLayer, layer_weight
from core_engine.model.norm import rms_norm
from core_engine.model.qwen3 import QKNormDecoderLayer

__all__ = ["MoEDecoderLayer", "QKNormMoEDecoderLayer", "moe_feed_forward"]


def moe_feed_forward(
    h: Tensor, router: Tensor, gate_up: ExpertsLinear, down: ExpertsLinear, *, top_k: int, normalize: bool = True
) -> Tensor:
    """The experts' weighted sum for the normed input ``h`` (T, hidden).

    router (E, hidden); ``gate_up.experts[e]``: (hidden -> 2 inter), gate rows first;
    ``down.experts[e]``: (inter -> hidden).
    """
    num_experts = router.shape[0]
    probs = F.softmax(F.linear(h, router).float(), dim=-1)  # (T, E)
    weights, experts = probs.topk(top_k, dim=-1)  # (T, k) each
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)  # pairs grouped by expert
    tokens = order // top_k
    pair_weights = weights.reshape(-1)[order].to(h.dtype)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    out = torch.zeros_like(h)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = tokens[start : start + n]
        gate, up = gate_up.experts[e](h[rows]).chunk(2, dim=-1)
        y = down.experts[e](F.silu(gate) * up)  # (n, hidden)
        out.index_add_(0, rows, y * pair_weights[start : start + n, None])
        start += n
    return out


class MoEDecoderLayer(LlamaDecoderLayer):
    """A layer whose FFN is a mixture of experts (Mixtral: Llama's attention)."""

    PRODUCTS = ("qkv", "o", "experts_gate_up", "experts_down")

    def __init__(self, config: LlamaConfig, *, dtype: torch.dtype, device: torch.device | str, qkv_bias: bool) -> None:
        super().__init__(config, dtype=dtype, device=device, qkv_bias=qkv_bias)
        del self.gate_up_proj, self.down_proj  # no dense FFN
        self.gate_up_proj = self.down_proj = None  # type: ignore[assignment]
        self.gate_up = self.down = None  # type: ignore[assignment]
        hidden, inter, experts = config.hidden_size, config.expert_intermediate_size, config.num_experts
        self.top_k = config.num_experts_used
        self.router = layer_weight(experts, hidden, dtype=dtype, device=device)
        self.experts_gate_up_proj = layer_weight(experts, 2 * inter, hidden, dtype=dtype, device=device)
        self.experts_down_proj = layer_weight(experts, hidden, inter, dtype=dtype, device=device)
        self.experts_gate_up = ExpertsLinear([DenseLinear(w) for w in self.experts_gate_up_proj])
        self.experts_down = ExpertsLinear([DenseLinear(w) for w in self.experts_down_proj])

    def dense_weights(self) -> dict[str, tuple[Tensor, Tensor | None]]:
        return {"qkv": (self.qkv_proj, self.qkv_bias), "o": (self.o_proj, None),
                "experts_gate_up": (self.experts_gate_up_proj, None), "experts_down": (self.experts_down_proj, None)}

    def feed_forward(self, x: Tensor) -> Tensor:
        h = rms_norm(x, self.ffn_norm, self.rms_eps)
        return x + moe_feed_forward(h, self.router, self.experts_gate_up, self.experts_down, top_k=self.top_k)

    def other_weight_bytes(self) -> int:
        """The router's bytes (the experts are products)."""
        return self.router.numel() * self.router.element_size()


class QKNormMoEDecoderLayer(MoEDecoderLayer, QKNormDecoderLayer):
    """A Qwen3-MoE layer: Qwen3's attention (q/k norms), a mixture of experts for the FFN."""
