"""Shared-memory KV transport: one POSIX segment per transfer, both engines on one host.

The sender creates the segment ``ikv-<digest of the transfer id>`` (short enough for macOS's
31-character names), writes a header, the msgpack metadata and the blocks, and marks the
header complete last; the receiver polls for the segment, copies it out and unlinks it. A
sender killed mid-write leaves an incomplete segment with its pid in the header: the receiver
waiting for it sees the pid gone, unlinks it and raises :class:`KVTransferError`; segments of
dead senders that nobody waits for are unlinked by the next sender or receiver to start, and
by every receive that times out (:func:`unlink_orphans`). Segments are not left to Python's
resource tracker, which would unlink a segment at the exit of any process that opened it.

Both engines run as one user. A segment is created ``0600``; one of another user is never
read, unlinked nor overwritten: the sweep passes over it, and a transfer whose name it holds
fails with a :class:`KVTransferError` that names it and its owner (another user who planted
a segment under a predictable name could otherwise hand the decode engine its own KV, or
make every start-up fail on a ``PermissionError``).

Header: ``<8s B 3x I I Q d``: magic, state (0 writing, 1 complete), sender pid, metadata
bytes, payload bytes, creation time (``time.time()``).
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import time
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import msgspec

from core_engine.kv_transfer.payload import KVTransferMeta, PrefilledKV
from core_engine.kv_transfer.transport import (
    KVTransferConfig,
    KVTransferError,
    KVTransferTimeout,
    stall_mid_send,
)

__all__ = ["ShmKVReceiver", "ShmKVSender", "segment_name", "unlink_orphans"]

_MAGIC = b"IMXKV001"
_HEADER = struct.Struct("<8sB3xIIQd")
_WRITING, _COMPLETE = 0, 1
_PREFIX = "ikv-"
_POLL_S = 0.002
_SHM_DIR = Path("/dev/shm")  # where Linux keeps POSIX segments (the orphan sweep lists it)


def segment_name(transfer_id: str) -> str:
    return _PREFIX + hashlib.blake2b(transfer_id.encode(), digest_size=10).hexdigest()


def _untrack(segment: shared_memory.SharedMemory) -> None:
    # Python < 3.13 registers every segment a process opens with its resource tracker, which
    # unlinks them when that process exits: the transport owns their life instead.
    try:
        resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:
        pass


def _open(name: str, *, size: int = 0) -> shared_memory.SharedMemory:
    segment = shared_memory.SharedMemory(name=name, create=size > 0, size=size)
    _untrack(segment)
    return segment


def _buf(segment: shared_memory.SharedMemory) -> memoryview:
    buf = segment.buf
    assert buf is not None, "an open segment has its buffer"
    return buf


def _unlink(name: str) -> None:
    # Not SharedMemory.unlink(): it would also unregister the (untracked) name.
    try:
        shared_memory._posixshmem.shm_unlink("/" + name)  # type: ignore[attr-defined]
    except FileNotFoundError:
        pass


def _foreign_owner(name: str) -> int | None:
    """The uid owning segment ``name`` when it is another user's (None: ours, or none)."""
    if not _SHM_DIR.is_dir():  # no file system view of the segments (macOS): opening tells
        return None
    try:
        uid = os.stat(_SHM_DIR / name).st_uid
    except FileNotFoundError:
        return None
    return None if uid == os.geteuid() else uid


def _not_ours(name: str, transfer_id: str, uid: int | None) -> KVTransferError:
    owner = "another user" if uid is None else f"uid {uid}"
    return KVTransferError(
        f"KV transfer {transfer_id!r}: the shared-memory segment {name} belongs to {owner}, "
        f"not to this user (uid {os.geteuid()}); refusing to use it (its owner or root can "
        f"remove /dev/shm/{name})"
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def unlink_orphans() -> list[str]:
    """Unlink the transfer segments whose sender process is gone; returns their names."""
    if not _SHM_DIR.is_dir():
        return []
    removed = []
    for path in _SHM_DIR.glob(_PREFIX + "*"):
        try:
            if path.stat().st_uid != os.geteuid():  # another user's: not ours to judge
                continue
            segment = _open(path.name)
        except (ValueError, OSError):
            continue
        try:
            if segment.size < _HEADER.size:
                continue
            magic, _, pid, *_ = _HEADER.unpack_from(_buf(segment), 0)
        finally:
            segment.close()
        if magic == _MAGIC and not _pid_alive(pid):
            try:
                _unlink(path.name)
            except OSError:  # replaced by another user's meanwhile
                continue
            removed.append(path.name)
    return removed


class ShmKVSender:
    """The prefill side: one segment per :meth:`send`, unlinked by the receiver."""

    def __init__(self, config: KVTransferConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        # Segments sent and perhaps never received: name -> time sent (dropped after ttl_s).
        self._sent: dict[str, float] = {}
        unlink_orphans()  # a previous incarnation killed mid-send

    def send(self, transfer_id: str, kv: PrefilledKV) -> None:
        meta = msgspec.msgpack.encode(kv.meta)
        buffers = kv.buffers()
        payload_len = sum(b.nbytes for b in buffers)
        name = segment_name(transfer_id)
        self._expire()
        uid = _foreign_owner(name)
        if uid is not None:
            raise _not_ours(name, transfer_id, uid)
        try:
            _unlink(name)  # a stale segment of the same id (a retried transfer)
        except PermissionError as exc:  # another user's, where there is no /dev/shm to ask
            raise _not_ours(name, transfer_id, None) from exc
        try:  # O_EXCL: a segment planted since is never written into
            segment = _open(name, size=_HEADER.size + len(meta) + max(1, payload_len))
        except OSError as exc:
            raise KVTransferError(f"cannot create shared memory for the KV transfer: {exc}") from exc
        try:
            buf = _buf(segment)
            _HEADER.pack_into(buf, 0, _MAGIC, _WRITING, os.getpid(), len(meta), payload_len, time.time())
            offset = _HEADER.size
            buf[offset : offset + len(meta)] = meta
            offset += len(meta)
            stall = stall_mid_send()
            for i, part in enumerate(buffers):
                n = part.nbytes
                view = part.cast("B")
                if stall and i == 0:  # the test hook: half of the blocks written, then a stall
                    buf[offset : offset + n // 2] = view[: n // 2]
                    time.sleep(stall)
                buf[offset : offset + n] = view
                offset += n
            buf[8] = _COMPLETE  # the header's state byte, written last
        except BaseException:
            segment.close()
            _unlink(name)
            raise
        segment.close()
        with self._lock:
            self._sent[name] = time.monotonic()

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            stale = [n for n, t in self._sent.items() if now - t > self.config.ttl_s]
            for name in stale:
                del self._sent[name]
        for name in stale:
            _unlink(name)

    def close(self) -> None:
        with self._lock:
            names, self._sent = list(self._sent), {}
        for name in names:
            _unlink(name)


class ShmKVReceiver:
    """The decode side: waits for a transfer's segment, copies it out, unlinks it."""

    def __init__(self, config: KVTransferConfig) -> None:
        self.config = config
        unlink_orphans()

    def receive(self, transfer_id: str, timeout: float | None = None) -> PrefilledKV:
        name = segment_name(transfer_id)
        deadline = time.monotonic() + (self.config.timeout_s if timeout is None else timeout)
        while True:
            got = self._try_take(name, transfer_id)
            if got is not None:
                return got
            if time.monotonic() >= deadline:
                unlink_orphans()
                raise KVTransferTimeout(f"KV transfer {transfer_id!r}: nothing complete arrived in time")
            time.sleep(_POLL_S)

    def _try_take(self, name: str, transfer_id: str) -> PrefilledKV | None:
        try:
            segment = _open(name)
        except FileNotFoundError:
            return None
        except PermissionError as exc:  # another user's segment (0600)
            raise _not_ours(name, transfer_id, _foreign_owner(name)) from exc
        uid = os.fstat(segment._fd).st_uid  # type: ignore[attr-defined]
        if uid != os.geteuid():  # readable (we are root, or its owner opened it up): not ours
            segment.close()
            raise _not_ours(name, transfer_id, uid)
        try:
            if segment.size < _HEADER.size:
                return None  # created, header not written yet
            buf = _buf(segment)
            magic, state, pid, meta_len, payload_len, _ = _HEADER.unpack_from(buf, 0)
            if magic != _MAGIC:
                raise KVTransferError(f"KV transfer {transfer_id!r}: not a transfer segment")
            if state != _COMPLETE:
                if _pid_alive(pid):
                    return None
                raise KVTransferError(f"KV transfer {transfer_id!r}: the sender (pid {pid}) died mid-transfer")
            start = _HEADER.size
            meta_bytes = bytes(buf[start : start + meta_len])
            payload = bytearray(buf[start + meta_len : start + meta_len + payload_len])
        except KVTransferError:
            segment.close()
            _unlink(name)
            raise
        except BaseException:
            segment.close()
            raise
        segment.close()
        _unlink(name)
        try:
            meta = msgspec.msgpack.decode(meta_bytes, type=KVTransferMeta)
            return PrefilledKV.from_buffer(meta, payload)
        except (msgspec.DecodeError, ValueError) as exc:
            raise KVTransferError(f"KV transfer {transfer_id!r}: {exc}") from exc

    def close(self) -> None:
        pass
