"""The KV tiers below the engine's device pool: host memory, then disk.

:mod:`~core_engine.kv_offload.disk_store` keeps blocks on disk across restarts, one file per
block in the format of :mod:`~core_engine.kv_offload.block_file`; it imports no torch.
"""

from core_engine.kv_offload.block_file import model_fingerprint
from core_engine.kv_offload.disk_store import DiskKVStore, DiskKVStoreStats

__all__ = ["DiskKVStore", "DiskKVStoreStats", "model_fingerprint"]
