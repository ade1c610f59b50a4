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

import ipaddress
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
    #: binds it, the prefill side connects to it. Unused by shm. Anything but a loopback
    #: host (127.0.0.0/8, ::1, localhost) needs the CURVE keys below.
    address: str | None = None
    #: How long a receive waits for its transfer, and how long an unclaimed transfer is kept.
    timeout_s: float = 30.0
    ttl_s: float = 60.0
    #: tcp: the largest transfer (its metadata and blocks), in bytes. The prefill side fails
    #: a larger send; the decode side disconnects a peer as soon as a larger message starts
    #: arriving. The default holds SmolLM2-135M's whole 8k context in fp32 (377 MB); a
    #: prompt's KV is ``max_model_len`` x layers x 2 x KV heads x head_dim x element size.
    max_message_bytes: int = 512 * 1024 * 1024
    #: tcp: transfers arrived and not claimed yet that the decode side keeps; one arriving
    #: beyond them is dropped (with ``max_message_bytes``, this bounds what peers can park in
    #: the decode engine's memory for ``ttl_s``).
    max_pending_transfers: int = 32
    #: tcp, ZeroMQ CURVE (encrypted, and only known peers accepted): this engine's key pair,
    #: a certificate with its secret key (``zmq.auth.create_certificates`` writes
    #: ``NAME.key_secret`` and the public half ``NAME.key``).
    secret_key_file: str | None = None
    #: CURVE, prefill side: the decode engine's public certificate (its ``NAME.key``).
    server_key_file: str | None = None
    #: CURVE, decode side: a directory of the public certificates (``*.key``) of the prefill
    #: engines allowed to send; any other peer fails the handshake.
    authorized_keys_dir: str | None = None

    def __post_init__(self) -> None:
        if self.transport == "tcp" and not self.address:
            raise ValueError("kv_transfer.address: the tcp transport needs the decode engine's tcp://host:port")
        if self.timeout_s <= 0 or self.ttl_s <= 0:
            raise ValueError("kv_transfer.timeout_s and kv_transfer.ttl_s must be > 0")
        if self.max_message_bytes < 1:
            raise ValueError(f"kv_transfer.max_message_bytes: must be >= 1, got {self.max_message_bytes}")
        if self.max_pending_transfers < 1:
            raise ValueError(f"kv_transfer.max_pending_transfers: must be >= 1, got {self.max_pending_transfers}")
        peer_keys = self.server_key_file is not None or self.authorized_keys_dir is not None
        if self.transport != "tcp":
            if self.secret_key_file is not None or peer_keys:
                raise ValueError("kv_transfer.secret_key_file: CURVE keys are for the tcp transport")
            return
        assert self.address is not None
        if self.secret_key_file is None:
            if peer_keys:
                raise ValueError(
                    "kv_transfer.secret_key_file: server_key_file / authorized_keys_dir need this engine's own "
                    "CURVE certificate too"
                )
            if not _is_loopback(self.address):
                raise ValueError(
                    f"kv_transfer.secret_key_file: {self.address} is not a loopback address; anyone who reaches "
                    "it would read the prompts and could inject KV blocks, so the tcp transport there needs CURVE "
                    "keys (secret_key_file, with server_key_file on the prefill side and authorized_keys_dir on "
                    "the decode side)"
                )
        elif not peer_keys:
            raise ValueError(
                "kv_transfer.server_key_file: CURVE needs the peer's keys too (server_key_file: the decode "
                "engine's public certificate; authorized_keys_dir: the prefill engines')"
            )


def _is_loopback(address: str) -> bool:
    """Whether a ``tcp://host:port`` endpoint is on loopback (anything unparsed is not)."""
    scheme, _, rest = address.partition("://")
    host = rest.rpartition(":")[0].removeprefix("[").removesuffix("]")
    if scheme != "tcp" or ";" in host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
