"""TCP KV transport over ZeroMQ: the decode engine listens, prefill engines push to it.

A transfer is one ZeroMQ frame ``[header, transfer id, msgpack metadata, data, scales]`` on a
PUSH socket connected to the decode engine's PULL socket (``kv_transfer.address``). ZeroMQ
delivers a message whole or not at all, so a sender killed mid-transfer leaves nothing behind
on the receiver: the receive waiting for it times out
(:class:`~core_engine.kv_transfer.transport.KVTransferTimeout`). A reader thread takes
messages off the socket as they arrive and keeps each until its receive claims it or
``ttl_s`` passes. The sender queues only to a connected receiver and only a few transfers
deep: a decode engine that is down or not keeping up fails the send within ``timeout_s``
(at most 5 s) instead of piling prompts' KV up in the prefill process.

What a peer can make the decode engine hold is bounded. One frame per transfer lets
``ZMQ_MAXMSGSIZE`` bound a whole transfer: a peer that starts a larger frame is disconnected
as its size arrives, before its bytes are buffered (a message of several frames is not a
transfer and is dropped once received; ZeroMQ has no limit on the number of frames, so a peer
that may connect can still make it buffer an endless multipart message). At most
``max_pending_transfers`` transfers wait to be claimed; one more is dropped as it arrives.

With ``secret_key_file`` the socket pair runs ZeroMQ CURVE: every connection is encrypted and
the decode side admits only the public keys in ``authorized_keys_dir`` (a ZAP handler checks
each handshake), so a peer without a key never gets a message to the reader.
:class:`~core_engine.kv_transfer.transport.KVTransferConfig` refuses a non-loopback address
without keys.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from core_engine.kv_transfer.payload import KVTransferMeta, PrefilledKV
from core_engine.kv_transfer.transport import (
    KVTransferConfig,
    KVTransferError,
    KVTransferTimeout,
    stall_mid_send,
)

__all__ = ["TcpKVReceiver", "TcpKVSender"]

logger = logging.getLogger(__name__)

_POLL_MS = 50
# Queued transfers still sent after close (ms); beyond it they are dropped, as a crash would.
_LINGER_MS = 1000
# Transfers queued in the prefill process at most (each is a prompt's whole KV).
_SEND_QUEUE = 8
_MAX_SEND_WAIT_S = 5.0
# Whole transfers ZeroMQ queues in the decode process ahead of the reader (which drains it).
_RECEIVE_QUEUE = 2
# What CURVE adds to a frame on the wire (the MESSAGE command, nonce and MAC: 33 bytes), which
# ZMQ_MAXMSGSIZE counts.
_CURVE_OVERHEAD = 64
# Refusals are logged at most this often (a peer flooding the port must not flood the log).
_WARN_EVERY_S = 10.0
# Frame header: magic, then the lengths of the transfer id and of the metadata.
_HEADER = struct.Struct("!4sII")
_MAGIC = b"IKV1"


def _key_pair(config: KVTransferConfig) -> tuple[bytes, bytes]:
    """This engine's CURVE (public, secret) keys, from ``secret_key_file``."""
    assert config.secret_key_file is not None
    try:
        public, secret = zmq.auth.load_certificate(config.secret_key_file)
    except (OSError, ValueError) as exc:
        raise KVTransferError(f"kv_transfer.secret_key_file: {exc}") from exc
    if secret is None:
        raise KVTransferError(
            f"kv_transfer.secret_key_file: {config.secret_key_file} holds no secret key (a NAME.key_secret file)"
        )
    return public, secret


class TcpKVSender:
    """The prefill side: one PUSH socket to the decode engine's address."""

    def __init__(self, config: KVTransferConfig) -> None:
        assert config.address is not None  # KVTransferConfig checks it
        self.config = config
        curve = self._curve_keys(config)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, _LINGER_MS)
        self._socket.setsockopt(zmq.IMMEDIATE, 1)
        self._socket.setsockopt(zmq.SNDHWM, _SEND_QUEUE)
        self._socket.setsockopt(zmq.SNDTIMEO, int(1000 * min(config.timeout_s, _MAX_SEND_WAIT_S)))
        if curve is not None:
            self._socket.curve_publickey, self._socket.curve_secretkey, self._socket.curve_serverkey = curve
        self._socket.connect(config.address)
        self._lock = threading.Lock()

    @staticmethod
    def _curve_keys(config: KVTransferConfig) -> tuple[bytes, bytes, bytes] | None:
        if config.secret_key_file is None:
            return None
        if config.server_key_file is None:
            raise KVTransferError(
                "kv_transfer.server_key_file: the prefill side needs the decode engine's public certificate"
            )
        public, secret = _key_pair(config)
        try:
            server, _ = zmq.auth.load_certificate(config.server_key_file)
        except (OSError, ValueError) as exc:
            raise KVTransferError(f"kv_transfer.server_key_file: {exc}") from exc
        return public, secret, server

    def send(self, transfer_id: str, kv: PrefilledKV) -> None:
        frame = self._frame(transfer_id, kv)
        with self._lock:
            try:
                stall = stall_mid_send()
                if stall:  # the test hook: the first half goes, the rest waits
                    half = len(frame) // 2
                    self._socket.send(memoryview(frame)[:half], flags=zmq.SNDMORE, copy=False)
                    time.sleep(stall)
                    self._socket.send(memoryview(frame)[half:], copy=False)
                else:
                    self._socket.send(frame, copy=False)
            except zmq.Again as exc:
                raise KVTransferError(
                    f"KV transfer {transfer_id!r}: the decode engine at {self.config.address} is not taking transfers"
                ) from exc
            except zmq.ZMQError as exc:
                raise KVTransferError(f"KV transfer {transfer_id!r}: {exc}") from exc

    def _frame(self, transfer_id: str, kv: PrefilledKV) -> bytearray:
        """The transfer as one frame (one copy of the blocks: ``ZMQ_MAXMSGSIZE`` bounds a frame)."""
        name = transfer_id.encode()
        meta = msgspec.msgpack.encode(kv.meta)
        parts = [memoryview(name), memoryview(meta), *kv.buffers()]
        size = _HEADER.size + sum(p.nbytes for p in parts)
        if size > self.config.max_message_bytes:
            raise KVTransferError(
                f"KV transfer {transfer_id!r}: {size} bytes, more than kv_transfer.max_message_bytes "
                f"({self.config.max_message_bytes})"
            )
        frame = bytearray(size)
        _HEADER.pack_into(frame, 0, _MAGIC, len(name), len(meta))
        at = _HEADER.size
        for part in parts:
            frame[at : at + part.nbytes] = part
            at += part.nbytes
        return frame

    def close(self) -> None:
        with self._lock:
            self._socket.close()
            self._context.term()


@dataclass(slots=True)
class _Pending:
    """An arrived transfer: its frame, where its metadata lies in it, when it came."""

    frame: zmq.Frame
    meta_start: int
    meta_end: int
    arrived_at: float


class TcpKVReceiver:
    """The decode side: binds ``kv_transfer.address``; a thread collects arriving transfers."""

    def __init__(self, config: KVTransferConfig) -> None:
        assert config.address is not None
        self.config = config
        self._context = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVHWM, _RECEIVE_QUEUE)
        try:
            self._socket.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes + _CURVE_OVERHEAD)
            if config.secret_key_file is not None:
                self._listen_with_curve(config)
            self._socket.bind(config.address)
        except (KVTransferError, zmq.ZMQError) as exc:
            self._shut()
            if isinstance(exc, KVTransferError):
                raise
            raise KVTransferError(f"kv_transfer.address: cannot listen on {config.address}: {exc}") from exc
        self._arrived: dict[str, _Pending] = {}
        self._cond = threading.Condition()
        self._closing = False
        self._num_refused = 0
        self._warned_at = -_WARN_EVERY_S
        self._thread = threading.Thread(target=self._read, name="infermux-kv-receiver", daemon=True)
        self._thread.start()

    def _listen_with_curve(self, config: KVTransferConfig) -> None:
        """CURVE server keys, and a ZAP handler admitting ``authorized_keys_dir``'s keys only."""
        keys_dir = config.authorized_keys_dir
        if keys_dir is None:
            raise KVTransferError(
                "kv_transfer.authorized_keys_dir: the decode side needs the public certificates of the prefill "
                "engines allowed to send"
            )
        public, secret = _key_pair(config)
        try:
            allowed = zmq.auth.load_certificates(keys_dir)
        except (OSError, ValueError) as exc:
            raise KVTransferError(f"kv_transfer.authorized_keys_dir: {exc}") from exc
        if not allowed:
            raise KVTransferError(f"kv_transfer.authorized_keys_dir: no public certificate (*.key) in {keys_dir}")
        self._auth = ThreadAuthenticator(self._context, log=logger.getChild("zap"))
        self._auth.start()
        self._auth.configure_curve(domain="*", location=keys_dir)
        self._socket.curve_publickey, self._socket.curve_secretkey = public, secret
        self._socket.curve_server = True

    def _read(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        try:
            while not self._closing:
                if not poller.poll(_POLL_MS):
                    self._expire()
                    continue
                refused = self._file(self._socket.recv_multipart(copy=False))
                if refused:
                    self._refuse(refused)
                self._expire()
        finally:
            self._socket.close()

    def _file(self, frames: list[zmq.Frame]) -> str | None:
        """Keep an arrived message as a pending transfer; why not, when it is refused."""
        if len(frames) != 1:
            return f"a message of {len(frames)} frames is not a transfer"
        frame = frames[0]
        size = len(frame.buffer)
        if size > self.config.max_message_bytes:
            return f"{size} bytes, more than kv_transfer.max_message_bytes ({self.config.max_message_bytes})"
        if size < _HEADER.size:
            return "not a transfer (too short)"
        magic, name_len, meta_len = _HEADER.unpack_from(frame.buffer)
        meta_start = _HEADER.size + name_len
        if magic != _MAGIC or meta_start + meta_len > size:
            return "not a transfer (bad header)"
        transfer_id = bytes(frame.buffer[_HEADER.size : meta_start]).decode(errors="replace")
        with self._cond:
            if transfer_id in self._arrived:
                return f"transfer {transfer_id!r} is already pending"
            if len(self._arrived) >= self.config.max_pending_transfers:
                return (
                    f"transfer {transfer_id!r}: {len(self._arrived)} transfers are pending "
                    "(kv_transfer.max_pending_transfers)"
                )
            self._arrived[transfer_id] = _Pending(frame, meta_start, meta_start + meta_len, time.monotonic())
            self._cond.notify_all()
        return None

    def _refuse(self, why: str) -> None:
        self._num_refused += 1
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY_S:
            self._warned_at = now
            logger.warning("KV transfer dropped on %s: %s (%d dropped so far)", self.config.address, why, self._num_refused)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._cond:
            for transfer_id in [t for t, p in self._arrived.items() if now - p.arrived_at > self.config.ttl_s]:
                del self._arrived[transfer_id]

    def receive(self, transfer_id: str, timeout: float | None = None) -> PrefilledKV:
        deadline = time.monotonic() + (self.config.timeout_s if timeout is None else timeout)
        with self._cond:
            while transfer_id not in self._arrived:
                left = deadline - time.monotonic()
                if left <= 0 or self._closing:
                    raise KVTransferTimeout(f"KV transfer {transfer_id!r}: nothing arrived in time")
                self._cond.wait(left)
            pending = self._arrived.pop(transfer_id)
        buffer: Any = pending.frame.buffer
        try:
            meta = msgspec.msgpack.decode(buffer[pending.meta_start : pending.meta_end], type=KVTransferMeta)
            return PrefilledKV.from_buffer(meta, buffer[pending.meta_end :])
        except (msgspec.DecodeError, ValueError) as exc:
            raise KVTransferError(f"KV transfer {transfer_id!r}: {exc}") from exc

    @property
    def num_waiting(self) -> int:
        """Transfers arrived and not claimed yet."""
        with self._cond:
            return len(self._arrived)

    @property
    def num_refused(self) -> int:
        """Messages that reached the reader and were dropped: not a transfer, a duplicate id,
        or past ``max_pending_transfers``. (Peers refused by ZeroMQ itself, on a failed CURVE
        handshake or a frame past ``max_message_bytes``, never reach the reader.)"""
        return self._num_refused

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._arrived.clear()
            self._cond.notify_all()
        self._thread.join(timeout=2.0)
        self._shut()

    def _shut(self) -> None:
        if self._auth is not None:
            self._auth.stop()
        self._socket.close()
        self._context.term()
