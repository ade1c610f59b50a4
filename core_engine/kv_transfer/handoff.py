"""Moving a prefilled prompt's KV blocks out of one engine's pool and into another's.

Export (prefill engine): the prompt's blocks are read while the request still holds them,
just before its blocks are freed (``Scheduler.finish_listeners``). Import (decode engine): the
prompt's leading blocks that the decode engine's prefix cache already holds (same chained
hashes) are referenced, not written; fresh blocks take the rest, are written from the
transfer and registered in the prefix cache, the way the KV tiers bring blocks up
(:mod:`core_engine.kv_offload.tiers`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from core_engine.kv_offload.block_copy import BlockCopier
from core_engine.kv_transfer.payload import KVTransferMeta, PrefilledKV, kv_layout

if TYPE_CHECKING:
    from core_engine.kv_cache_manager import KVCacheManager
    from core_engine.paged_attention import KVCache
    from core_engine.request import Request

__all__ = ["KVHandoff"]


class KVHandoff:
    """Export and import of prefilled prompts for one engine's pool."""

    def __init__(self, kv_cache: KVCache, kv_manager: KVCacheManager) -> None:
        self.kv_manager = kv_manager
        self.blocks = BlockCopier(kv_cache)
        self.layout = kv_layout(kv_cache)
        #: Counters (tests, benchmark, metrics): blocks exported; blocks imported by writing
        #: them, and blocks an import found in the prefix cache already.
        self.num_exported_blocks = 0
        self.num_written_blocks = 0
        self.num_reused_blocks = 0
        #: Imports the pool or the batch could not take at once (the request waited).
        self.num_deferred = 0

    def export(self, request: Request) -> PrefilledKV:
        """The prompt's blocks and first token of ``request`` (which still holds its blocks)."""
        kv = self.kv_manager
        num_prompt = request.num_prompt_tokens
        block_ids = kv.get_block_ids(request.req_id)[: kv.num_blocks_for(num_prompt)]
        assert len(block_ids) == kv.num_blocks_for(num_prompt), "a prefilled request holds its prompt's blocks"
        kv.update_block_hashes(request, num_prompt)
        data, scales = self.blocks.read(block_ids)
        data = data.cpu()
        scales = None if scales is None else scales.cpu()
        meta = KVTransferMeta(
            prompt_token_ids=list(request.prompt_token_ids),
            first_token_id=request.output_token_ids[0],
            block_hashes=list(request.block_hashes[: num_prompt // kv.block_size]),
            num_blocks=len(block_ids),
            layout=self.layout,
            block_shape=self.blocks.block_shape,
            dtype=str(self.blocks.dtype),
            scale_shape=self.blocks.scale_shape,
            data_nbytes=data.numel() * data.element_size(),
            scales_nbytes=0 if scales is None else scales.numel() * 4,
        )
        self.num_exported_blocks += len(block_ids)
        return PrefilledKV(meta=meta, data=data, scales=scales)

    def check(self, request: Request, kv: PrefilledKV) -> None:
        """``ValueError`` when ``kv`` cannot be ``request``'s prompt in this pool."""
        meta = kv.meta
        if meta.layout != self.layout:
            raise ValueError(f"the prefill engine's KV layout ({meta.layout}) is not this engine's ({self.layout})")
        if meta.prompt_token_ids != request.prompt_token_ids:
            raise ValueError("the transferred KV belongs to another prompt")
        if meta.num_blocks != self.kv_manager.num_blocks_for(request.num_prompt_tokens):
            raise ValueError(f"the transfer has {meta.num_blocks} blocks for a {request.num_prompt_tokens}-token prompt")

    def import_blocks(self, request: Request, kv: PrefilledKV) -> bool:
        """Give ``request`` (prompt plus its first token, holding no blocks) the prompt's
        blocks: prefix-cache hits referenced, the rest written from ``kv``. False (nothing
        changed) when the pool is short."""
        manager = self.kv_manager
        num_prompt = request.num_prompt_tokens
        # With the first token appended, every full prompt block may hit.
        hits, num_hit_tokens = manager.get_computed_blocks(request)
        if manager.allocate_slots(request, num_prompt - num_hit_tokens, hits) is None:
            return False
        block_ids = manager.get_block_ids(request.req_id)
        start = len(hits)
        if start < kv.meta.num_blocks:
            scales = None if kv.scales is None else kv.scales[start:]
            self.blocks.write(block_ids[start : kv.meta.num_blocks], kv.data[start:], scales)
        request.num_computed_tokens = num_prompt
        request.num_cached_tokens = num_hit_tokens
        self.num_reused_blocks += start
        self.num_written_blocks += kv.meta.num_blocks - start
        return True
