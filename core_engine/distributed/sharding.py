"""A loaded Llama model cut down to one rank's shard, with the collectives of Megatron's
tensor parallelism in its forward pass.

:func:`shard_model` slices the dense parameters in place (before the weights are packed, so
every format packs only its rank's rows) and wraps the file's block source so the int4/int8
formats take the same rows and columns from the file's own blocks (no second rounding). The
model and its layers then become the tensor-parallel classes below, which differ from
:class:`~core_engine.model.llama.LlamaModel` in four places:

* fused QKV and gate/up are column-parallel: each rank computes its heads' and its
  intermediate run's outputs, no communication;
* the output and down projections are row-parallel: each rank's partial product, one
  all-reduce (fp32 on CPU), then the residual add;
* the embedding is vocab-parallel: a rank looks up the ids in its run, zeros elsewhere, and
  the rows are all-reduced;
* the LM head is vocab-parallel: each rank's logits columns are all-gathered (a quantised
  head's exactly recomputed top ``k`` is chosen over the whole vocabulary, as on one rank).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from core_engine.distributed.group import TensorParallelGroup
from core_engine.distributed.partition import RankShard
from core_engine.model.block_weights import BlockWeight
from core_engine.model.linear import TopKRefinedLinear
from core_engine.model.llama import LlamaDecoderLayer, LlamaModel

__all__ = ["ShardedBlockSource", "TensorParallelDecoderLayer", "TensorParallelLlamaModel", "shard_model"]


class TensorParallelDecoderLayer(LlamaDecoderLayer):
    """A Llama block over one rank's heads and intermediate run (see the module docstring)."""

    tp: TensorParallelGroup

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: Any, layer_idx: int) -> Tensor:
        heads_qk = self.num_heads + self.num_kv_heads
        qkv = self.qkv_heads(x, cos, sin)
        out = attn.forward(
            layer_idx, qkv[:, : self.num_heads], qkv[:, self.num_heads : heads_qk], qkv[:, heads_qk:],
            self.attention_spec,
        )
        # This rank's heads' share of o(attn), in fp32 (see _row_parallel_add).
        partial = self.o(self.tp.accumulate(out.reshape(x.shape[0], self.q_size)))
        return self.feed_forward(self._row_parallel_add(x, partial))

    def feed_forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up.normed(x, self.ffn_norm, self.rms_eps)  # (T, 2 * local inter)
        gate_up = self.tp.accumulate(gate_up)
        partial = self.down.swiglu_add_to(torch.zeros(x.shape, dtype=gate_up.dtype, device=x.device), gate_up)
        return self._row_parallel_add(x, partial)

    def _row_parallel_add(self, x: Tensor, partial: Tensor) -> Tensor:
        """``x + sum over ranks of partial``, rounded once to x's dtype as the unsplit
        product's fused residual add rounds (partials rounded to bf16 each would move the
        sum by ~2^-9 of every partial: enough to flip a greedy near-tie)."""
        return torch.add(x.to(partial.dtype), self.tp.all_reduce(partial)).to(x.dtype)


class TensorParallelLlamaModel(LlamaModel):
    """:class:`LlamaModel` whose embedding and LM head hold one vocabulary run."""

    tp: TensorParallelGroup
    shard: RankShard
    #: Every rank's vocabulary run width (the gather's order).
    vocab_widths: list[int]

    def embed(self, input_ids: Tensor) -> Tensor:
        start, end = self.shard.vocab
        mine = (input_ids >= start) & (input_ids < end)
        local = torch.where(mine, input_ids - start, torch.zeros_like(input_ids))
        x = F.embedding(local, self.embed_tokens) * mine.unsqueeze(-1).to(self.embed_tokens.dtype)
        x = self.tp.all_reduce(x)
        scale = self.config.embedding_scale
        return x if scale is None else x * scale

    def compute_logits(self, x: Tensor) -> Tensor:
        cfg = self.config
        x = F.rms_norm(x, (x.shape[-1],), self.norm, cfg.rms_eps)
        head = self.head
        if isinstance(head, TopKRefinedLinear):
            logits = self._refined_logits(head, x)
        else:
            logits = self.tp.all_gather_columns(head(x).float(), self.vocab_widths)  # (N, vocab)
        if cfg.final_logit_softcap is not None:
            logits = cfg.final_logit_softcap * torch.tanh(logits / cfg.final_logit_softcap)
        return logits


    def _refined_logits(self, head: TopKRefinedLinear, x: Tensor) -> Tensor:
        """A quantised head's logits with the *global* top ``k`` recomputed exactly, as one
        rank's :class:`TopKRefinedLinear` does (each shard refining its own top ``k`` would
        make more logits exact than one rank does, and move the distribution): the
        approximate logits are gathered, every rank takes the same top ``k``, computes the
        exact values of those in its run, and one all-reduce of (N, k) completes them."""
        logits = self.tp.all_gather_columns(head._approx(x).float(), self.vocab_widths)  # (N, vocab)
        top = logits.topk(head._k, dim=-1, sorted=False).indices  # (N, k), the same on every rank
        start, end = self.shard.vocab
        mine = (top >= start) & (top < end)
        local = torch.where(mine, top - start, torch.zeros_like(top))
        rows = head._exact.index_select(0, local.view(-1)).view(*top.shape, x.shape[1])  # (N, k, hidden)
        exact = torch.bmm(rows, x.unsqueeze(-1).to(rows.dtype)).squeeze(-1).float() * mine
        logits.scatter_(1, top, self.tp.all_reduce(exact))
        return logits


def _ranges(*runs: tuple[int, int]) -> Tensor:
    return torch.cat([torch.arange(a, b) for a, b in runs])


class ShardedBlockSource:
    """A model's :class:`~core_engine.model.block_weights.BlockSource` cut to one rank's
    rows (QKV, gate/up, head) and columns (o, down: whole blocks of 32)."""

    def __init__(self, inner: Any, config: Any, shard: RankShard) -> None:
        self._inner = inner
        hd = config.head_dim
        q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
        (q0, q1), (k0, k1), (f0, f1) = shard.q_heads, shard.kv_heads, shard.ffn
        self._rows = {
            "qkv": _ranges((q0 * hd, q1 * hd), (q + k0 * hd, q + k1 * hd), (q + kv + k0 * hd, q + kv + k1 * hd)),
            "gate_up": _ranges((f0, f1), (inter + f0, inter + f1)),
            "head": _ranges(shard.vocab),
        }
        self._cols = {"o": (q0 * hd, q1 * hd), "down": (f0, f1)}

    def __getattr__(self, name: str) -> Any:  # gguf_file, requantized, ...
        return getattr(self._inner, name)

    def natural_format(self, name: str) -> str:
        return self._inner.natural_format(name)

    def block_weight(self, name: str, weight_format: str) -> BlockWeight | None:
        full = self._inner.block_weight(name, weight_format)
        if full is None:
            return None
        product = name.rsplit(".", 1)[-1]
        qweight, scales, mins = full
        if product in self._rows:
            rows = self._rows[product]
            return qweight[rows].contiguous(), scales[rows].contiguous(), None if mins is None else mins[rows].contiguous()
        start, end = self._cols[product]
        if start % 32 or end % 32:
            return None  # not whole blocks: the packer quantises the dense slice instead
        per_byte = 2 if mins is not None else 1  # int4: two codes a byte
        b0, b1 = start // 32, end // 32
        return (
            qweight[:, start // per_byte : end // per_byte].contiguous(), scales[:, b0:b1].contiguous(),
            None if mins is None else mins[:, b0:b1].contiguous(),
        )


def _take(param: Tensor | None, index: Tensor, dim: int) -> torch.nn.Parameter | None:
    if param is None:
        return None
    return torch.nn.Parameter(param.detach().index_select(dim, index).contiguous(), requires_grad=False)


def shard_model(model: LlamaModel, shard: RankShard, group: TensorParallelGroup, widths: list[int]) -> None:
    """Cut ``model`` (dense, as loaded) to ``shard`` in place and make it tensor-parallel
    over ``group``; ``widths``: every rank's vocabulary run. ``ValueError`` for an
    architecture whose layers have no tensor-parallel form yet."""
    if type(model) is not LlamaModel or any(type(layer) is not LlamaDecoderLayer for layer in model.layers):
        kinds = sorted({type(layer).__name__ for layer in model.layers})
        raise ValueError(
            f"tensor_parallel_size > 1: {model.config.architecture!r} models ({', '.join(kinds)}) are not sharded "
            "yet; Llama-architecture layers (Llama, SmolLM2, Mistral, Qwen2) are"
        )
    if model.weight_format != "dense":
        raise ValueError("shard_model: shard the dense weights, before packing them")
    config = model.config
    hd = config.head_dim
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    (q0, q1), (k0, k1), (f0, f1) = shard.q_heads, shard.kv_heads, shard.ffn
    qkv_rows = _ranges((q0 * hd, q1 * hd), (q + k0 * hd, q + k1 * hd), (q + kv + k0 * hd, q + kv + k1 * hd))
    o_cols = _ranges((q0 * hd, q1 * hd))
    ffn_rows = _ranges((f0, f1), (inter + f0, inter + f1))
    ffn_cols = _ranges((f0, f1))
    local = shard.local_config(config)
    # Class surgery: the layers and the model become their tensor-parallel classes in place,
    # so their attributes are set through untyped views.
    layers: list[Any] = list(model.layers)
    for layer in layers:
        layer.qkv_proj = _take(layer.qkv_proj, qkv_rows, 0)
        layer.qkv_bias = _take(layer.qkv_bias, qkv_rows, 0)
        layer.o_proj = _take(layer.o_proj, o_cols, 1)
        layer.gate_up_proj = _take(layer.gate_up_proj, ffn_rows, 0)
        layer.down_proj = _take(layer.down_proj, ffn_cols, 1)
        layer.num_heads, layer.num_kv_heads, layer.q_size = local.num_heads, local.num_kv_heads, local.q_size
        for product, (weight, bias) in layer.dense_weights().items():
            setattr(layer, product, type(getattr(layer, product))(weight, bias))
        layer.__class__ = TensorParallelDecoderLayer
        layer.tp = group
    vocab_rows = _ranges(shard.vocab)
    model_view: Any = model
    tied = model.lm_head is model.embed_tokens
    model_view.embed_tokens = _take(model.embed_tokens, vocab_rows, 0)
    model_view.lm_head = model.embed_tokens if tied else _take(model.lm_head, vocab_rows, 0)
    model_view.head = type(model_view.head)(model.lm_head)
    if model.block_source is not None:
        model_view.block_source = ShardedBlockSource(model.block_source, config, shard)
    model.config = local
    model_view.__class__ = TensorParallelLlamaModel
    model_view.tp, model_view.shard, model_view.vocab_widths = group, shard, list(widths)
