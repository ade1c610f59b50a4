"""Disaggregated prefill / decode: a prompt's KV blocks moved from one engine to another.

A *prefill* engine runs a request's prompt, samples its first token and exports the prompt's
KV blocks (:class:`~core_engine.kv_transfer.payload.PrefilledKV`); a transport carries them to
a *decode* engine, which writes them into its own pool (reusing the blocks its prefix cache
already holds) and continues generating. Transports (:mod:`~core_engine.kv_transfer.transport`):
shared memory on one host (:mod:`~core_engine.kv_transfer.shm`), ZeroMQ over TCP between hosts
(:mod:`~core_engine.kv_transfer.tcp`).
"""

from core_engine.kv_transfer.opening import open_receiver, open_sender
from core_engine.kv_transfer.payload import KVTransferMeta, PrefilledKV, kv_layout
from core_engine.kv_transfer.transport import (
    KVReceiver,
    KVSender,
    KVTransferConfig,
    KVTransferError,
    KVTransferTimeout,
)

__all__ = [
    "KVReceiver",
    "KVSender",
    "KVTransferConfig",
    "KVTransferError",
    "KVTransferMeta",
    "KVTransferTimeout",
    "PrefilledKV",
    "kv_layout",
    "open_receiver",
    "open_sender",
]
