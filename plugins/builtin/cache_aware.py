"""The ``cache_aware`` routing strategy: the replica most likely to hold the prompt's prefix,
bounded by load.

For an alias served by several replicas of one model. Per request:

1. **Load bound.** A replica is eligible when, counting this request, its open streams stay
   within ``cache_load_factor`` (alias option, default 1.5) times the least-loaded
   replica's, also counting one: ``outstanding + 1 <= load_factor * (least + 1)``. So
   affinity never piles requests on one replica while others idle beyond that factor.
2. **Affinity.** Among the eligible, the one with the longest cached prefix of the prompt:

   - *precise*, for backends that report their cache (``prefix_cache()``: the core engine,
     in-process or in its worker process, whose engine sends block-hash stored/removed
     events): the prompt's token ids (one ``tokenize`` call to a replica, rendered as a
     generation would render them) hashed with :func:`core_engine.kv_cache_manager.
     prompt_block_hashes`, matched against each replica's reported hashes;
   - *approximate*, for the others: the :class:`~plugins.builtin.prefix_map.PrefixMap` of
     prompts this strategy routed to each replica (TTL, size cap), counted in ~4-byte tokens.

   Both are keyed by the request's ``cache_salt`` (its tenant's partition, issue 44), as
   the engines key their caches: a prefix one tenant warmed on a replica neither draws
   another tenant's request there nor counts as its hit.

3. Ties (no replica holds any of it: a new prefix) go to the fewest open streams, rotating.
   The other candidates follow, fewest open streams first, as fallbacks.

The decision (chosen, matched tokens per replica, the bound) goes on the routing span.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import msgspec

from backends.base import GenerationRequest
from backends.errors import InfermuxError
from core_engine.kv_cache_manager import prompt_block_hashes
from plugins.builtin.prefix_map import APPROX_BLOCK_BYTES, PrefixMap, prompt_text_hashes
from plugins.builtin.strategies import RoundRobinStrategy, RoutingContext

__all__ = ["CacheAwareStrategy"]

logger = logging.getLogger("plugins.cache_aware")

#: Bytes per token, to weigh approximate matches (bytes) against precise ones (tokens).
_BYTES_PER_TOKEN = 4


class CacheAwareStrategy:
    """See the module docstring. One instance per alias."""

    def __init__(self, prefix_map: PrefixMap | None = None) -> None:
        self._context = RoutingContext(alias="", backends=())
        self._prefix_map = prefix_map if prefix_map is not None else PrefixMap()
        self._rotation = RoundRobinStrategy()

    def configure(self, context: RoutingContext) -> None:
        self._context = context

    def order(
        self, candidates: list[str], request: GenerationRequest, outstanding: Mapping[str, int]
    ) -> list[str]:
        """Without the replicas' caches (no await possible here): approximate affinity only."""
        return self._decide(candidates, request, outstanding, token_ids=None)[0]

    async def adecide(
        self, candidates: list[str], request: GenerationRequest, outstanding: Mapping[str, int]
    ) -> tuple[list[str], dict[str, object]]:
        """The order and the decision (for the routing span); the router awaits this."""
        token_ids = None
        if request.kind in ("chat", "completion") and any(self._index(n) is not None for n in candidates):
            token_ids = await self._prompt_token_ids(candidates, request)
        return self._decide(candidates, request, outstanding, token_ids=token_ids)

    def _index(self, name: str) -> Any:
        backend = self._context.replicas.get(name)
        prefix_cache = getattr(backend, "prefix_cache", None)
        return prefix_cache() if callable(prefix_cache) else None

    async def _prompt_token_ids(self, candidates: list[str], request: GenerationRequest) -> tuple[int, ...] | None:
        """The prompt's token ids from the first reporting replica that tokenizes, or None."""
        ask = msgspec.structs.replace(request, kind="tokenize")
        for name in candidates:
            backend = self._context.replicas.get(name)
            if backend is None or self._index(name) is None:
                continue
            if not getattr(backend.capabilities, "tokenize", False):
                continue
            try:
                async for chunk in backend.generate(ask):
                    return chunk.token_ids
            except InfermuxError as exc:  # a replica down: affinity is a hint, not a need
                logger.debug("tokenize on %s for routing failed: %s", name, exc)
        return None

    def _decide(
        self,
        candidates: list[str],
        request: GenerationRequest,
        outstanding: Mapping[str, int],
        *,
        token_ids: tuple[int, ...] | None,
    ) -> tuple[list[str], dict[str, object]]:
        if not candidates:
            return [], {"strategy": "cache_aware", "chosen": None}
        factor = self._context.load_factor
        rotated = self._rotation.order(candidates, request, outstanding)
        least = min(outstanding.get(n, 0) for n in rotated)
        text_hashes: list[bytes] | None = None
        hashes_by_size: dict[int, list[bytes]] = {}
        matched: dict[str, int] = {}
        precise: dict[str, bool] = {}
        for name in rotated:
            index = self._index(name)
            if index is not None:
                precise[name] = True
                size = index.block_size
                if token_ids is None or size is None:
                    matched[name] = 0
                    continue
                if size not in hashes_by_size:
                    hashes_by_size[size] = prompt_block_hashes(token_ids, size, request.cache_salt)
                matched[name] = index.num_leading_blocks(hashes_by_size[size]) * size
            else:
                precise[name] = False
                if text_hashes is None:
                    text_hashes = prompt_text_hashes(request)
                blocks = self._prefix_map.num_leading_blocks(name, text_hashes)
                matched[name] = blocks * APPROX_BLOCK_BYTES // _BYTES_PER_TOKEN
        eligible = [n for n in rotated if outstanding.get(n, 0) + 1 <= factor * (least + 1)]
        # max() keeps the first of equals: the rotation among the least loaded.
        by_load = sorted(rotated, key=lambda n: outstanding.get(n, 0))
        best = max(sorted(eligible, key=lambda n: outstanding.get(n, 0)), key=lambda n: matched[n])
        if matched[best] == 0:
            best = by_load[0]
        order = [best] + [n for n in by_load if n != best]
        if not precise[best]:
            if text_hashes is None:
                text_hashes = prompt_text_hashes(request)
            self._prefix_map.record(best, text_hashes)
        decision: dict[str, object] = {
            "strategy": "cache_aware",
            "chosen": best,
            "reason": "longest cached prefix within the load bound" if matched[best] else "no cached prefix: least loaded",
            "load_factor": factor,
            "backends": [
                {
                    "backend": n, "queue": outstanding.get(n, 0), "cached_tokens": matched[n],
                    "precise": precise[n], "eligible": n in eligible,
                }
                for n in rotated
            ],
        }
        return order, decision
