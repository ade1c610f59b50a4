"""Reusing the KV cache of the previous generation for the next prompt's common prefix.

mlx-lm's KV caches can be trimmed from the end, so one cache is kept with the exact tokens it
holds; the next prompt reuses the longest common prefix (the cache is trimmed to it) and only
the rest is prefilled. A conversation's follow-up turn thus prefills only the new messages.

The cache belongs to the ``cache_salt`` of the request that filled it (issue 44): a prompt of
another salt reuses nothing (it gets a new, empty cache), so no tenant learns from
``cached_tokens`` or its first token's latency how another tenant's prompt began.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

__all__ = ["PromptCache"]


class PromptCache:
    """The last generation's KV cache, the tokens in it position by position, and the salt
    of the request that put them there."""

    def __init__(self, *, enabled: bool) -> None:
        self._enabled = enabled
        self._cache: list[Any] | None = None
        self._tokens: list[int] = []
        self._salt: str | None = None

    def take(self, model: Any, prompt: Sequence[int], salt: str | None) -> tuple[list[Any], int]:
        """A KV cache of ``model`` with the longest reusable prefix of ``prompt``, and its length.

        Only a cache filled under ``salt`` (None matches only None) has a reusable prefix. The
        cache is handed over: until :meth:`keep` gives it back, nothing is reused; it then
        belongs to ``salt``.
        """
        cache, self._cache = self._cache, None
        if salt != self._salt:
            cache = None  # another tenant's KV: none of it is kept
            self._salt = salt
        if cache is None or not self._enabled or not can_trim_prompt_cache(cache):
            self._tokens = []
            return make_prompt_cache(model), 0
        num_common = 0
        for previous, current in zip(self._tokens, prompt, strict=False):
            if previous != current:
                break
            num_common += 1
        # The last prompt token is always fed again: its logits are what is sampled from.
        num_common = min(num_common, len(prompt) - 1)
        trim_prompt_cache(cache, cache[0].offset - num_common)
        self._tokens = self._tokens[:num_common]
        return cache, num_common

    def keep(self, cache: list[Any], fed: Sequence[int]) -> None:
        """Keep ``cache`` for the next prompt; ``fed`` lists the tokens given to the model."""
        if not self._enabled:
            return
        # generate_step feeds each token to the model before handing it out; a token fed but
        # never handed out (cancelled right after prefill) is unknown here: drop it.
        excess = cache[0].offset - len(fed)
        if excess > 0:
            trim_prompt_cache(cache, excess)
        self._cache = cache
        self._tokens = list(fed[: cache[0].offset])

    def clear(self) -> None:
        """Forget the cache (its state is unknown after an error, or the model is closing)."""
        self._cache = None
        self._tokens = []
