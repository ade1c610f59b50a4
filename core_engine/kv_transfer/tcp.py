"""TCP KV transport over ZeroMQ: the decode engine listens, prefill engines push to it.

A transfer is one multipart message ``[transfer id, msgpack metadata, data, scales]`` on a
PUSH socket connected to the decode engine's PULL socket (``kv_transfer.address``). ZeroMQ
delivers a multipart message whole or not at all, so a sender killed mid-transfer leaves
nothing behind on the receiver: the receive waiting for it times out
(:class:`~core_engine.kv_transfer.transport.KVTransferTimeout`). A reader thread takes
messages off the socket as they arrive and keeps each until its receive claims it or
``ttl_s`` passes. The sender queues only to a connected receiver and only a few transfers
deep: a decode engine that is down or not keeping up fails the send within ``timeout_s``
(at most 5 s) instead of piling prompts' KV up in the prefill process.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import msgspec
import zmq

from core_engine.kv_transfer.payload import KVTransferMeta, PrefilledKV
from core_engine.kv_transfer.transport import (
    KVTransferConfig,
    KVTransferError,
    KVTransferTimeout,
    stall_mid_send,
)

__all__ = ["TcpKVReceiver", "TcpKVSender"]

_POLL_MS = 50
# Queued transfers still sent after close (ms); beyond it they are dropped, as a crash would.
_LINGER_MS = 1000
# Transfers queued in the prefill process at most (each is a prompt's whole KV).
_SEND_QUEUE = 8
_MAX_SEND_WAIT_S = 5.0


class TcpKVSender:
    """The prefill side: one PUSH socket to the decode engine's address."""

    def __init__(self, config: KVTransferConfig) -> None:
        assert config.address is not None  # KVTransferConfig checks it
        self.config = config
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, _LINGER_MS)
        self._socket.setsockopt(zmq.IMMEDIATE, 1)
        self._socket.setsockopt(zmq.SNDHWM, _SEND_QUEUE)
        self._socket.setsockopt(zmq.SNDTIMEO, int(1000 * min(config.timeout_s, _MAX_SEND_WAIT_S)))
        self._socket.connect(config.address)
        self._lock = threading.Lock()

    def send(self, transfer_id: str, kv: PrefilledKV) -> None:
        frames: list[Any] = [transfer_id.encode(), msgspec.msgpack.encode(kv.meta), *kv.buffers()]
        with self._lock:
            try:
                stall = stall_mid_send()
                if stall:  # the test hook: the first frames go, the blocks wait
                    self._socket.send_multipart(frames[:2], flags=zmq.SNDMORE, copy=False)
                    time.sleep(stall)
                    self._socket.send_multipart(frames[2:], copy=False)
                else:
                    self._socket.send_multipart(frames, copy=False)
            except zmq.Again as exc:
                raise KVTransferError(
                    f"KV transfer {transfer_id!r}: the decode engine at {self.config.address} is not taking transfers"
                ) from exc
            except zmq.ZMQError as exc:
                raise KVTransferError(f"KV transfer {transfer_id!r}: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            self._socket.close()
            self._context.term()


class TcpKVReceiver:
    """The decode side: binds ``kv_transfer.address``; a thread collects arriving transfers."""

    def __init__(self, config: KVTransferConfig) -> None:
        assert config.address is not None
        self.config = config
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(config.address)
        except zmq.ZMQError as exc:
            self._socket.close()
            self._context.term()
            raise KVTransferError(f"kv_transfer.address: cannot listen on {config.address}: {exc}") from exc
        self._arrived: dict[str, tuple[float, list[zmq.Frame]]] = {}
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._read, name="infermux-kv-receiver", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        try:
            while not self._closing:
                if not poller.poll(_POLL_MS):
                    self._expire()
                    continue
                frames = self._socket.recv_multipart(copy=False)
                if len(frames) < 3:
                    continue  # not a transfer
                transfer_id = bytes(frames[0].buffer).decode(errors="replace")
                with self._cond:
                    self._arrived[transfer_id] = (time.monotonic(), frames[1:])
                    self._cond.notify_all()
                self._expire()
        finally:
            self._socket.close()

    def _expire(self) -> None:
        now = time.monotonic()
        with self._cond:
            for transfer_id in [t for t, (at, _) in self._arrived.items() if now - at > self.config.ttl_s]:
                del self._arrived[transfer_id]

    def receive(self, transfer_id: str, timeout: float | None = None) -> PrefilledKV:
        deadline = time.monotonic() + (self.config.timeout_s if timeout is None else timeout)
        with self._cond:
            while transfer_id not in self._arrived:
                left = deadline - time.monotonic()
                if left <= 0 or self._closing:
                    raise KVTransferTimeout(f"KV transfer {transfer_id!r}: nothing arrived in time")
                self._cond.wait(left)
            _, frames = self._arrived.pop(transfer_id)
        try:
            meta = msgspec.msgpack.decode(frames[0].buffer, type=KVTransferMeta)
            payload = bytearray().join(f.buffer for f in frames[1:])
            return PrefilledKV.from_buffer(meta, payload)
        except (msgspec.DecodeError, ValueError) as exc:
            raise KVTransferError(f"KV transfer {transfer_id!r}: {exc}") from exc

    @property
    def num_waiting(self) -> int:
        """Transfers arrived and not claimed yet."""
        with self._cond:
            return len(self._arrived)

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._arrived.clear()
            self._cond.notify_all()
        self._thread.join(timeout=2.0)
        self._context.term()
