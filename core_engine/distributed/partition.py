"""How a model's weights are split over the ranks of a tensor-parallel engine.

Megatron's split for a Llama block, decided once from the model's shapes:

* attention: each rank owns whole KV heads and the query heads that read them (GQA groups
  stay on one rank). With ``world <= num_kv_heads`` the KV heads are dealt out in contiguous
  runs (3 KV heads over 2 ranks: 2 and 1); with more ranks than KV heads each KV head is
  replicated on the ranks that share its group, and the group's query heads are dealt out
  among them. Either way a rank's query heads are one contiguous run, so the fused QKV rows
  and the output projection's columns of a rank are runs too;
* feed-forward: the intermediate dimension in runs of 32 (the block formats' block), so
  gate/up rows and down columns of a rank keep whole blocks;
* vocabulary: contiguous runs of embedding / LM-head rows.

Splits may be uneven (SmolLM2's 9 query heads over 2 ranks: 6 and 3); rank 0 always holds
the most KV heads, so its KV block is the largest and its block count fits every rank.
"""

from __future__ import annotations

import msgspec

from core_engine.model.config import LlamaConfig

__all__ = ["RankShard", "partition"]

#: The feed-forward split's unit: one block of the int4/int8 formats.
FFN_UNIT = 32


class RankShard(msgspec.Struct, frozen=True, kw_only=True):
    """The half-open index ranges one rank owns."""

    rank: int
    world_size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    ffn: tuple[int, int]
    vocab: tuple[int, int]
    #: The widest vocabulary run of any rank (the LM head's gather pads to it).
    max_vocab: int

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    def local_config(self, config: LlamaConfig) -> LlamaConfig:
        """``config`` as this rank's layers see it: its heads and intermediate width (the
        vocabulary stays whole: the logits are gathered)."""
        return msgspec.structs.replace(
            config, num_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads,
            intermediate_size=self.ffn[1] - self.ffn[0],
        )


def _runs(total: int, parts: int) -> list[tuple[int, int]]:
    """``total`` items in ``parts`` contiguous runs, the first ones one longer."""
    base, extra = divmod(total, parts)
    runs, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        runs.append((start, end))
        start = end
    return runs


def partition(config: LlamaConfig, world_size: int) -> list[RankShard]:
    """Every rank's shard of ``config``'s model over ``world_size`` ranks; ``ValueError``
    naming ``tensor_parallel_size`` when the model cannot be split that many ways."""
    name = "tensor_parallel_size"
    heads, kv_heads = config.num_heads, config.num_kv_heads
    if world_size < 1:
        raise ValueError(f"{name} must be >= 1, got {world_size}")
    if world_size > heads:
        raise ValueError(f"{name}={world_size}: the model has only {heads} attention heads")
    if config.intermediate_size % FFN_UNIT or config.intermediate_size // FFN_UNIT < world_size:
        raise ValueError(
            f"{name}={world_size}: the feed-forward width {config.intermediate_size} does not split into "
            f"{world_size} runs of multiples of {FFN_UNIT}"
        )
    group = heads // kv_heads  # query heads per KV head
    if world_size <= kv_heads:
        kv_runs = _runs(kv_heads, world_size)
        q_runs = [(a * group, b * group) for a, b in kv_runs]
    else:
        owner = [r * kv_heads // world_size for r in range(world_size)]  # each rank's KV head
        kv_runs, q_runs = [], []
        for r, h in enumerate(owner):
            sharers = [s for s in range(world_size) if owner[s] == h]
            if len(sharers) > group:
                raise ValueError(
                    f"{name}={world_size}: {len(sharers)} ranks would share KV head {h}, which only "
                    f"{group} query heads read"
                )
            a, b = _runs(group, len(sharers))[sharers.index(r)]
            kv_runs.append((h, h + 1))
            q_runs.append((h * group + a, h * group + b))
    ffn_runs = [(a * FFN_UNIT, b * FFN_UNIT) for a, b in _runs(config.intermediate_size // FFN_UNIT, world_size)]
    vocab_runs = _runs(config.vocab_size, world_size)
    max_vocab = max(b - a for a, b in vocab_runs)
    return [
        RankShard(rank=r, world_size=world_size, q_heads=q_runs[r], kv_heads=kv_runs[r], ffn=ffn_runs[r],
                  vocab=vocab_runs[r], max_vocab=max_vocab)
        for r in range(world_size)
    ]
