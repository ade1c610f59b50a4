"""``[cache]``: how the prefix caches are partitioned between tenants (issue 44).

Every cache that can speed up or report a hit (the engine's KV tiers, llama.cpp's slots, MLX's
prompt cache, the ``cache_aware`` router's prefix maps) hits only within one partition: an
``usage.prompt_tokens_details.cached_tokens`` above 0, or a shorter time to the first token,
would otherwise tell one API key how another key's prompt began. By default each tenant
(``[[auth.keys]] tenant``) is its own partition; ``[[cache.sharing_groups]]`` puts tenants
that trust each other (one company's apps on one long system prompt) in one, so they warm the
prefix once. docs/kv-cache.md "Tenants" explains it for operators.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

__all__ = ["CacheConfig", "SharingGroupConfig"]


class SharingGroupConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One ``[[cache.sharing_groups]]`` table: tenants that share cached prompt prefixes."""

    #: Names the group's partition (logs and docs only; never sent to a client).
    name: str
    #: ``[[auth.keys]] tenant`` names; a tenant belongs to one group at most.
    tenants: Annotated[list[str], msgspec.Meta(min_length=1)]


class CacheConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[cache]``: the partitions of the prefix caches (see the module docstring)."""

    sharing_groups: list[SharingGroupConfig] = []

    def partition_of(self, tenant: str) -> str:
        """The partition of ``tenant``'s requests: its sharing group's, else its own.

        The two kinds are told apart by their prefix, so a group never shares with a tenant
        that happens to bear the group's name.
        """
        for group in self.sharing_groups:
            if tenant in group.tenants:
                return f"group:{group.name}"
        return f"tenant:{tenant}"
