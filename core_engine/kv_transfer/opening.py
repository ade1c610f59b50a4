"""Opening a transport's two ends from its config (the transports import their protocol from
:mod:`~core_engine.kv_transfer.transport`; this module picks one, so that nothing imports back)."""

from __future__ import annotations

from core_engine.kv_transfer.transport import KVReceiver, KVSender, KVTransferConfig

__all__ = ["open_receiver", "open_sender"]


def open_sender(config: KVTransferConfig) -> KVSender:
    """The prefill side of ``config``'s transport."""
    if config.transport == "shm":
        from core_engine.kv_transfer.shm import ShmKVSender

        return ShmKVSender(config)
    from core_engine.kv_transfer.tcp import TcpKVSender

    return TcpKVSender(config)


def open_receiver(config: KVTransferConfig) -> KVReceiver:
    """The decode side of ``config``'s transport."""
    if config.transport == "shm":
        from core_engine.kv_transfer.shm import ShmKVReceiver

        return ShmKVReceiver(config)
    from core_engine.kv_transfer.tcp import TcpKVReceiver

    return TcpKVReceiver(config)
