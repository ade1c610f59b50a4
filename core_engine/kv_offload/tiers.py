"""The KV tiers below the engine's pool: host memory, then disk.

Device ("the engine's KV pool", :mod:`core_engine.block_pool`) → host
(:class:`~core_engine.kv_offload.host_pool.HostKVPool`) → disk
(:class:`~core_engine.kv_offload.disk_store.DiskKVStore`). Every block moves with its chained
prefix hash, which names the block and all tokens before it, so a block found in any tier
is valid for any request whose prefix hashes to it.

How blocks move
---------------
* **Down, on eviction.** When the device pool hands out a cached block, it is first copied
  into the host pool (``BlockPool.on_evict``); when the host pool reuses a slot, its block
  goes to disk unless it is there already (``HostKVPool.on_evict``).
* **Down, write-through to disk.** After each step, the blocks that became full and cached
  in it are queued for the disk writer thread (the step never waits on disk). So the disk
  tier holds what was computed even when the process is killed, and a restarted engine
  with the same model file and KV dtype reuses it (the store's fingerprint).
* **Up, on a prefix hit.** When a waiting request is scheduled, its prompt's block hashes
  are looked up on the device, then in host memory, then on disk. Host blocks are copied
  into fresh device blocks at once; disk blocks are read by the store's reader thread
  while the request waits and other requests run; when they are in, the request is
  scheduled with them (a file that fails its checks is recomputed instead).
* **By policy.** Each step :meth:`KVTiers.begin_step` asks the
  :class:`~core_engine.policy.KVOffloadPolicy` which waiting or preempted requests' device
  blocks go down now (``offload``: their cached blocks are copied to the host or disk
  tier and their device blocks become blank) and which requests' lower-tier blocks come up
  before their turn (``prefetch``). A preempted request whose blocks were offloaded is
  restored from the lower tier instead of recomputed. A policy that raises or answers
  something else falls back to :class:`~core_engine.policy.WatermarkOffloadPolicy` for
  that step (logged once).

All movement runs on the engine thread except disk reads and writes. Counters for
``/metrics`` are in :meth:`KVTiers.stats`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from core_engine.block_pool import KVCacheBlock
from core_engine.kv_cache_manager import KVCacheManager
from core_engine.kv_offload.block_copy import BlockCopier
from core_engine.kv_offload.host_pool import HostKVPool
from core_engine.policy import (
    KVOffloadContext,
    KVOffloadDecision,
    KVOffloadPolicy,
    KVResidency,
    WatermarkOffloadPolicy,
)
from core_engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from core_engine.kv_offload.disk_store import DiskKVStore
    from core_engine.paged_attention import KVCache

__all__ = ["TIERS", "KVTiers"]

logger = logging.getLogger(__name__)

TIERS = ("device", "host", "disk")
#: Directions bytes are counted in (``stats()["kv_bytes_moved:<direction>"]``).
DIRECTIONS = ("device_to_host", "host_to_device", "device_to_disk", "host_to_disk", "disk_to_device")
#: Waiting requests the offload policy is shown (the front of the queue).
_POLICY_QUEUE_DEPTH = 32
#: Bytes of blocks read from disk that wait for the request that asked (oldest dropped).
_MAX_STAGED_BYTES = 256 * 2**20
#: A disk read not answered by then is given up (the request recomputes those blocks).
_LOAD_TIMEOUT_S = 30.0



class KVTiers:
    """Host and disk tiers under one engine's :class:`KVCacheManager` and :class:`KVCache`."""

    def __init__(
        self,
        *,
        kv_cache: KVCache,
        kv_manager: KVCacheManager,
        host_blocks: int = 0,
        disk: DiskKVStore | None = None,
        policy: KVOffloadPolicy | None = None,
        tenant_quota_fraction: float | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.kv_manager = kv_manager
        self.pool = kv_manager.block_pool
        self.block_size = kv_manager.block_size
        self.blocks = BlockCopier(kv_cache)
        self.device = self.blocks.device
        self.scale_shape = self.blocks.scale_shape
        #: Bytes of one block in every tier (data + scales).
        self.block_nbytes = self.blocks.block_nbytes
        self._max_staged = max(64, _MAX_STAGED_BYTES // self.block_nbytes)
        self.host: HostKVPool | None = None
        if host_blocks > 0:
            quota = None if tenant_quota_fraction is None else max(1, int(host_blocks * tenant_quota_fraction))
            self.host = HostKVPool(
                host_blocks, block_shape=self.blocks.block_shape, dtype=self.blocks.dtype, scale_shape=self.scale_shape,
                pin_memory=self.device.type == "cuda", tenant_quota=quota,
            )
            self.host.on_evict = self._on_host_evict
        self.disk = disk
        self.pool.on_evict = self._on_device_evict
        kv_manager.track_new_blocks = disk is not None
        self.policy: KVOffloadPolicy = policy or WatermarkOffloadPolicy()
        self._fallback_policy = WatermarkOffloadPolicy()
        self._policy_warned = False
        # Disk blocks in flight (hash -> time requested) and loaded ones without a host tier.
        self._loading: dict[bytes, float] = {}
        self._staged: OrderedDict[bytes, tuple[Tensor, Tensor | None]] = OrderedDict()
        # Device blocks brought up from a lower tier, not yet counted for a request (hash ->
        # tier): what the request's span reports.
        self._brought_up: OrderedDict[bytes, str] = OrderedDict()
        self._step = 0
        self._last_seen: dict[str, int] = {}
        # Counters.
        self.bytes_moved = dict.fromkeys(DIRECTIONS, 0)
        self.hit_tokens = dict.fromkeys(TIERS, 0)
        self.restore_seconds = dict.fromkeys(("host", "disk"), 0.0)
        self.restored_blocks = dict.fromkeys(("host", "disk"), 0)
        self.disk_load_seconds = 0.0
        self.num_policy_offloads = 0
        self.num_policy_prefetches = 0

    @property
    def enabled(self) -> bool:
        return self.host is not None or self._disk_on

    @property
    def _disk_on(self) -> bool:
        return self.disk is not None and self.disk.enabled


    # -- movement down ---------------------------------------------------------------------

    def _on_device_evict(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        if self.host is not None:
            if block_hash in self.host:
                self.host.touch(block_hash)
                return
            data, scales = self.blocks.read([block.block_id])
            self.host.put(block_hash, data[0], None if scales is None else scales[0], tenant=block.tenant)
            self.bytes_moved["device_to_host"] += self.block_nbytes
        elif self._disk_on and self.disk is not None and block_hash not in self.disk:
            data, scales = self.blocks.read([block.block_id])
            self.disk.put(block_hash, self.blocks.to_bytes(data[0], None if scales is None else scales[0]))
            self.bytes_moved["device_to_disk"] += self.block_nbytes

    def _on_host_evict(self, block_hash: bytes, slot: int) -> None:
        if self._disk_on and self.disk is not None and block_hash not in self.disk:
            assert self.host is not None
            scales = None if self.host.scales is None else self.host.scales[slot]
            self.disk.put(block_hash, self.blocks.to_bytes(self.host.data[slot], scales))
            self.bytes_moved["host_to_disk"] += self.block_nbytes

    def after_step(self) -> None:
        """Write the step's newly cached blocks through to disk (queued, not waited for)."""
        pairs = self.kv_manager.take_newly_cached()
        if not pairs or not self._disk_on or self.disk is None:
            return
        fresh = [(b, h) for b, h in pairs if b.block_hash == h and h not in self.disk]
        if not fresh:
            return
        data, scales = self.blocks.read([b.block_id for b, _ in fresh])
        data = data.cpu()
        scales = None if scales is None else scales.cpu()
        for i, (_, block_hash) in enumerate(fresh):
            self.disk.put(block_hash, self.blocks.to_bytes(data[i], None if scales is None else scales[i]))
        self.bytes_moved["device_to_disk"] += len(fresh) * self.block_nbytes

    # -- lookup and movement up --------------------------------------------------------

    def _locate(self, block_hash: bytes) -> str | None:
        if self.pool.get_cached_block(block_hash) is not None:
            return "device"
        if self.host is not None and block_hash in self.host:
            return "host"
        if block_hash in self._staged:
            return "staged"
        if block_hash in self._loading:
            return "loading"
        if self._disk_on and self.disk is not None and block_hash in self.disk:
            return "disk"
        return None

    def _walk(self, request: Request, start: int) -> list[tuple[bytes, str]]:
        """Where the request's prompt blocks ``start..`` are, up to the first miss."""
        max_blocks = (request.num_tokens - 1) // self.block_size
        self.kv_manager.update_block_hashes(request, max_blocks * self.block_size)
        found: list[tuple[bytes, str]] = []
        for block_hash in request.block_hashes[start:max_blocks]:
            where = self._locate(block_hash)
            if where is None:
                break
            found.append((block_hash, where))
        return found

    def extend_hits(
        self, request: Request, device_hits: list[KVCacheBlock]
    ) -> tuple[list[KVCacheBlock], int] | None:
        """The request's computed blocks with lower tiers included, or None while some of
        them are being read from disk (the scheduler tries the request again later).

        Host (and already read disk) blocks are copied into fresh device blocks, left
        cached and unreferenced for ``allocate_slots`` to take.
        """
        if not self.kv_manager.enable_caching or request.wants_prompt_logprobs:
            return device_hits, len(device_hits) * self.block_size
        found = self._walk(request, len(device_hits))
        if not found:
            return device_hits, len(device_hits) * self.block_size
        to_read = [h for h, where in found if where == "disk"]
        if to_read and not request.kv_disk_read:
            self._request_load(to_read)
            request.kv_disk_read = True
            if self.host is not None:  # keep its host part there while the reads run
                for h, where in found:
                    if where == "host":
                        self.host.touch(h)
            return None
        if any(where == "loading" for _, where in found):
            return None
        # Blocks a read could not deliver (invalid files) end the hit run there.
        cut = next((i for i, (_, where) in enumerate(found) if where in ("disk", "loading")), len(found))
        blocks = self._bring_up(found[:cut], device_hits, request.tenant)
        return blocks, len(blocks) * self.block_size

    def note_admitted(self, request: Request, blocks: Sequence[KVCacheBlock]) -> None:
        """A request was admitted with ``blocks`` as its cached prefix (first admission):
        record which tier each block came from (``Request.cached_tokens_by_tier``)."""
        by_tier = dict.fromkeys(TIERS, 0)
        for block in blocks:
            tier = "device" if block.block_hash is None else self._brought_up.pop(block.block_hash, "device")
            by_tier[tier] += self.block_size
        request.cached_tokens_by_tier = {t: n for t, n in by_tier.items() if n}
        for tier, n in by_tier.items():
            self.hit_tokens[tier] += n

    def _bring_up(
        self,
        found: list[tuple[bytes, str]],
        device_hits: list[KVCacheBlock],
        tenant: str | None,
    ) -> list[KVCacheBlock]:
        """Copy host/staged blocks of ``found`` into device blocks; all returned blocks are
        cached and unreferenced (they may be taken by the caller's allocation)."""
        pool = self.pool
        on_device = [pool.get_cached_block(h) for h, where in found if where == "device"]
        protect = [*device_hits, *(b for b in on_device if b is not None)]
        pool.touch(protect)  # the copies below must not evict them
        wanted = [(i, h, where) for i, (h, where) in enumerate(found) if where in ("host", "staged")]
        room = pool.num_free_blocks
        if len(wanted) > room:  # restore a leading run only
            cut = wanted[room][0] if room < len(wanted) else len(found)
            found = found[:cut]
            wanted = wanted[:room]
        new_blocks: dict[int, KVCacheBlock] = {}
        if wanted:
            started = time.perf_counter()
            host_items = [(i, h) for i, h, where in wanted if where == "host"]
            staged_items = [(i, h) for i, h, where in wanted if where == "staged"]
            parts: list[tuple[list[tuple[int, bytes]], Tensor, Tensor | None, str]] = []
            if host_items:
                assert self.host is not None
                data, scales = self.host.gather([h for _, h in host_items])  # copies: safe from evictions
                parts.append((host_items, data, scales, "host"))
            if staged_items:
                loaded = [self._staged.pop(h) for _, h in staged_items]
                data = torch.stack([d for d, _ in loaded])
                scales = None if self.scale_shape is None else torch.stack([s for _, s in loaded])  # type: ignore[misc]
                parts.append((staged_items, data, scales, "disk"))
            for items, data, scales, tier in parts:
                blocks = pool.get_new_blocks(len(items), tenant=tenant)
                self.blocks.write([b.block_id for b in blocks], data, scales)
                for (i, h), block in zip(items, blocks, strict=True):
                    pool.cache_full_block(block, h, tenant=tenant)
                    new_blocks[i] = block
                    self._brought_up[h] = tier
                while len(self._brought_up) > 4 * self.pool.num_blocks:
                    self._brought_up.popitem(last=False)
                direction = "disk_to_device" if tier == "disk" else "host_to_device"
                self.bytes_moved[direction] += len(items) * self.block_nbytes
                self.restored_blocks[tier] += len(items)
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()
                self.restore_seconds[tier] += time.perf_counter() - started
                started = time.perf_counter()
        blocks_out = list(device_hits)
        for i, (h, where) in enumerate(found):
            found_block = new_blocks.get(i) if where != "device" else pool.get_cached_block(h)
            if found_block is None:
                break
            blocks_out.append(found_block)
        pool.free_blocks([*reversed(list(new_blocks.values())), *reversed(protect)])
        return blocks_out

    def _request_load(self, block_hashes: list[bytes]) -> None:
        assert self.disk is not None
        now = time.perf_counter()
        todo = [h for h in block_hashes if h not in self._loading]
        for h in todo:
            self._loading[h] = now
        if todo:
            self.disk.request_load(todo)

    def _poll_disk(self) -> None:
        if self.disk is None or not self._loading:
            return
        now = time.perf_counter()
        stuck = [h for h, t in self._loading.items() if now - t > _LOAD_TIMEOUT_S]
        for block_hash in stuck:  # a read that never came back: recompute rather than wait
            del self._loading[block_hash]
        for block_hash, payload in self.disk.poll_loaded():
            started = self._loading.pop(block_hash, None)
            if started is not None:
                self.disk_load_seconds += now - started
            if payload is None:
                continue  # missing or invalid: recomputed
            try:
                data, scales = self.blocks.from_bytes(payload)
            except (RuntimeError, ValueError):
                logger.warning("KV disk tier: a block of unexpected size was read; it is recomputed")
                continue
            # Held apart for the request that asked (not in the host pool, where its puts could
            # evict that request's own host blocks before it runs).
            self._staged[block_hash] = (data, scales)
            while len(self._staged) > self._max_staged:
                self._staged.popitem(last=False)
        if not self._disk_on:
            self._loading.clear()

    @property
    def is_loading(self) -> bool:
        return bool(self._loading)

    def wait_for_loads(self, timeout: float) -> None:
        """Nothing else to run: give the disk reader a moment instead of spinning."""
        if self._loading:
            time.sleep(timeout)

    # -- the policy ---------------------------------------------------------------------------

    def begin_step(self, running: Sequence[Request], waiting: Sequence[Request]) -> None:
        """Collect finished disk reads, then ask the offload policy and apply its moves."""
        self._step += 1
        self._poll_disk()
        if len(self._last_seen) > 4 * (len(running) + len(waiting)) + 64:
            live = {r.req_id for r in running} | {r.req_id for r in waiting}
            self._last_seen = {k: v for k, v in self._last_seen.items() if k in live}
        for request in running:
            self._last_seen[request.req_id] = self._step
        if not self.enabled:
            return
        context = self._context(running, waiting)
        try:
            decision = self.policy.plan_kv_offload(context)
            if not isinstance(decision, KVOffloadDecision):
                raise TypeError(f"answered {type(decision).__name__}, not a KVOffloadDecision")
        except Exception:
            if not self._policy_warned:
                self._policy_warned = True
                logger.warning(
                    "the KV offload policy failed; WatermarkOffloadPolicy decides instead", exc_info=True
                )
            decision = self._fallback_policy.plan_kv_offload(context)
        if decision.offload or decision.prefetch:
            by_id = {r.req_id: r for r in waiting}
            for req_id in decision.offload:
                if (victim := by_id.get(req_id)) is not None:
                    self._offload(victim, decision.offload_tier)
            for req_id in decision.prefetch:
                if (upcoming := by_id.get(req_id)) is not None:
                    self._prefetch(upcoming)

    def _context(self, running: Sequence[Request], waiting: Sequence[Request]) -> KVOffloadContext:
        residencies = [
            KVResidency(
                req_id=r.req_id, status="running", tier="device",
                num_blocks=len(self.kv_manager.req_to_blocks.get(r.req_id, ())),
            )
            for r in running
        ]
        for position, request in enumerate(itertools.islice(waiting, _POLICY_QUEUE_DEPTH)):
            if not self.kv_manager.enable_caching or request.wants_prompt_logprobs:
                continue
            counts = dict.fromkeys(TIERS, 0)
            for _, where in self._walk(request, 0):
                counts["disk" if where in ("staged", "loading", "disk") else where] += 1
            status = "preempted" if request.status == RequestStatus.PREEMPTED else "waiting"
            idle = self._step - self._last_seen.setdefault(request.req_id, self._step)
            for tier, n in counts.items():
                if n:
                    residencies.append(
                        KVResidency(
                            req_id=request.req_id, status=status, tier=tier,  # type: ignore[arg-type]
                            num_blocks=n, num_idle_steps=max(0, idle), queue_position=position,
                        )
                    )
        disk = self.disk
        disk_free = None
        if disk is not None and disk.enabled:
            stats = disk.stats()
            disk_free = max(0, (stats["capacity_bytes"] - stats["bytes_used"]) // max(1, self.block_nbytes))
        return KVOffloadContext(
            num_device_blocks=self.pool.num_blocks,
            num_free_device_blocks=self.pool.num_blank_blocks,
            num_free_host_blocks=0 if self.host is None else self.host.num_free_slots,
            num_free_disk_blocks=disk_free,
            requests=tuple(residencies),
        )

    def _offload(self, request: Request, tier: str) -> None:
        """Move a non-running request's cached device blocks down a tier now."""
        if request.status == RequestStatus.RUNNING:
            return
        if tier == "host" and self.host is None:
            tier = "disk"
        if tier == "disk" and not self._disk_on:
            return
        blocks = []
        for block_hash, where in self._walk(request, 0):
            if where != "device":
                continue
            block = self.pool.get_cached_block(block_hash)
            if block is not None and block.ref_cnt == 0:
                blocks.append(block)
        if not blocks:
            return
        data, scales = self.blocks.read([b.block_id for b in blocks])
        for i, block in enumerate(blocks):
            assert block.block_hash is not None
            s = None if scales is None else scales[i]
            if tier == "host":
                assert self.host is not None
                self.host.put(block.block_hash, data[i], s, tenant=block.tenant)
                self.bytes_moved["device_to_host"] += self.block_nbytes
            else:
                assert self.disk is not None
                if block.block_hash not in self.disk:
                    self.disk.put(block.block_hash, self.blocks.to_bytes(data[i], s))
                    self.bytes_moved["device_to_disk"] += self.block_nbytes
            self.pool.evict_cached_block(block)
        self.num_policy_offloads += 1

    def _prefetch(self, request: Request) -> None:
        """Bring a waiting request's lower-tier blocks up before its turn."""
        start = 0
        found = self._walk(request, start)
        if not found:
            return
        to_read = [h for h, where in found if where == "disk"]
        if to_read:
            self._request_load(to_read)
            request.kv_disk_read = True
        upper = []
        for h, where in found:
            if where in ("disk", "loading"):
                break
            upper.append((h, where))
        if any(where in ("host", "staged") for _, where in upper):
            self._bring_up(upper, [], request.tenant)
        self.num_policy_prefetches += 1

    # -- lifecycle and figures ---------------------------------------------------------------

    def close(self, timeout: float = 10.0) -> None:
        """Finish queued disk writes (shutdown)."""
        if self.disk is not None:
            self.disk.close(timeout=timeout)

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {
            "kv_tier_blocks:device": float(self.pool.num_blocks - self.pool.num_blank_blocks),
            "kv_tier_blocks:host": float(0 if self.host is None else self.host.num_blocks),
        }
        if self.disk is not None:
            disk = self.disk.stats()
            out["kv_tier_blocks:disk"] = float(disk["num_blocks"])
            out["kv_disk_invalid_blocks"] = float(disk["num_invalid"])
            out["kv_disk_write_errors"] = float(disk["num_write_errors"])
            out["kv_disk_pending_writes"] = float(disk["pending_writes"])
            out["kv_disk_enabled"] = 1.0 if disk["enabled"] else 0.0
        for direction, n in self.bytes_moved.items():
            out[f"kv_bytes_moved:{direction}"] = float(n)
        for tier, n in self.hit_tokens.items():
            out[f"kv_hit_tokens:{tier}"] = float(n)
        for tier in ("host", "disk"):
            out[f"kv_restore_seconds:{tier}"] = self.restore_seconds[tier]
            out[f"kv_restored_blocks:{tier}"] = float(self.restored_blocks[tier])
        out["kv_disk_load_seconds"] = self.disk_load_seconds
        out["kv_offload_policy_moves"] = float(self.num_policy_offloads + self.num_policy_prefetches)
        return out
