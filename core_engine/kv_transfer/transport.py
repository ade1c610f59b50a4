"""The transport interface: a sender on the prefill engine's side, a receiver on the decode's.

A transfer is named by a string id that the caller routing the request chooses and gives to
both sides (the ``disaggregated`` backend passes it along with the request): the prefill side
``send``\\ s the prefilled KV under that id, the decode side ``receive``\\ s it by the same id.
Nothing else crosses between the two: a transport owns its framing, its buffers and their
clean-up. A receive either returns the whole transfer or raises; a transfer that was never
received is dropped once ``ttl_s`` has passed (tcp: by the receiver's reader thread; shm: by
the sender at its next send, or when it closes).

::

    KVTransferError            the transfer cannot be completed (sender died, bad payload)
    └── KVTransferTimeout      nothing complete arrived within the timeout

An RDMA transport (NIXL, Mooncake) fits the same two calls: ``send`` registers the tensors
and publishes their descriptor under the id, ``receive`` pulls them into host or device
memory; the blocks' layout is :class:`~core_engine.kv_transfer.payload.KVTransferMeta`'s.
"""

from __future__ import annotations

import os
from typing import Literal, Protocol

import msgspec

from core_engine.kv_transfer.payload import PrefilledKV

__all__ = [
    "KVReceiver",
    "KVSender",
    "KVTransferConfig",
    "KVTransferError",
    "KVTransferTimeout",
]


class KVTransferError(Exception):
    """A KV transfer could not be completed; the request must be prefilled again."""


class KVTransferTimeout(KVTransferError):
    """No complete transfer of that id arrived in time (the sender may have died)."""


class KVTransferConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``kv_transfer`` of a prefill or decode engine (both sides name the same transport)."""

    #: "shm": shared memory segments, both engines on one host; "tcp": ZeroMQ, any hosts.
    transport: Literal["shm", "tcp"] = "shm"
    #: tcp: the decode engine's listening endpoint (``tcp://host:port``); the decode side
    #: binds it, the prefill side connects to it. Unused by shm.
    address: str | None = None
    #: How long a receive waits for its transfer, and how long an unclaimed transfer is kept.
    timeout_s: float = 30.0
    ttl_s: float = 60.0

    def __post_init__(self) -> None:
        if self.transport == "tcp" and not self.address:
            raise ValueError("kv_transfer.address: the tcp transport needs the decode engine's tcp://host:port")
        if self.timeout_s <= 0 or self.ttl_s <= 0:
            raise ValueError("kv_transfer.timeout_s and kv_transfer.ttl_s must be > 0")


#: Test hook (the fault tests' way to a sender killed mid-transfer): the path of a flag file;
#: the send that manages to delete it stalls half-way for this many seconds.
_STALL_ENV = "INFERMUX_TEST_KV_SEND_STALL"
_STALL_S = 60.0


def stall_mid_send() -> float:
    """Seconds this send stalls half-way (0.0 unless the test hook's flag file was taken)."""
    path = os.environ.get(_STALL_ENV)
    if not path:
        return 0.0
    try:
        os.remove(path)
    except OSError:
        return 0.0
    return _STALL_S


class KVSender(Protocol):
    """The prefill side of a transport."""

    def send(self, transfer_id: str, kv: PrefilledKV) -> None:
        """Make ``kv`` available to the receiver under ``transfer_id`` (blocking until it is
        handed to the transport). Raises :class:`KVTransferError`."""
        ...

    def close(self) -> None:
        """Release the transport; transfers not received yet are dropped."""
        ...


class KVReceiver(Protocol):
    """The decode side of a transport."""

    def receive(self, transfer_id: str, timeout: float | None = None) -> PrefilledKV:
        """The whole transfer ``transfer_id`` (waiting up to ``timeout`` seconds, default the
        config's ``timeout_s``); its buffers are released before this returns. Raises
        :class:`KVTransferTimeout` or :class:`KVTransferError`."""
        ...

    def close(self) -> None:
        """Release the transport; transfers not received yet are dropped."""
        ...
