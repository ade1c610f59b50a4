"""The disk tier of the KV cache: one file per block, named by a keyed hash of its prefix hash.

A block hash (16 bytes, :func:`core_engine.kv_cache_manager.hash_block_tokens`) names a block
*and* every token before it; a file's name is that hash keyed with the installation's secret
(:func:`~core_engine.kv_offload.block_file.block_file_id`), so that the name still says
everything about the content to this store and nothing to anyone without the secret. The
payload is the block's raw bytes as the engine lays them out. Files outlive the process: a new
:class:`DiskKVStore` on the same directory finds the blocks of the previous one.

Layout::

    <directory>/                            0700, this user's (else the store stays off)
        secret                              32 random bytes, 0600: keys names and MACs
        <fingerprint hex>/                  0700, one folder per model (see model_fingerprint)
            .lock                           flock'ed by the one store using the folder
            <file id hex>.kv                a block file, 0600 (format: block_file)
            <file id hex>.kv.tmp            a write in progress; removed at start

The secret belongs to ``<directory>`` (created by the first store to use it, never replaced):
every model's folder under it shares it, and a directory copied elsewhere with its secret
keeps its blocks. Deleting the secret drops every block under it (they become unreadable
orphans that the LRU deletes).

Privacy: the blocks hold the prompts (layer-0 keys and values invert to tokens), so
``<directory>`` and the model folder must be owned by this user with no group/other
permission; a missing one is created ``0700``; any other state turns the store off with a
reason naming the path (:func:`core_engine.private_files.private_dir`). Files are created
``0600`` with ``O_EXCL | O_NOFOLLOW``.

A block file is a fixed header (magic, format version, model fingerprint, file id, payload
length, MAC), then the payload: :mod:`core_engine.kv_offload.block_file`. A load is valid only
when every header field matches and the MAC (keyed with the secret, over the header, the
block hash and the payload) agrees. Anything else (a torn or truncated file, flipped bits, a
file from another model, a file renamed or copied in under another block's name, a file
written with another secret, a link) is *invalid*: it is never returned as data; its file is
deleted, it leaves the index and counts in ``num_invalid``. Files of the wrong size, links and
files of another owner are dropped the same way at start-up, from a ``stat`` alone.

Contract:

- Every call is non-blocking and never raises for disk trouble. ``put`` copies the payload
  (the caller may reuse its buffer once ``put`` returns) and queues it for the writer thread;
  ``request_load`` queues reads for the reader thread (reads never wait behind writes);
  ``poll_loaded`` hands back finished loads. Each hash passed to ``request_load`` is answered
  exactly once by some later ``poll_loaded``: with its payload, or ``None`` when the block is
  missing or invalid, or when the store is (or becomes) disabled.
- ``block_hash in store`` means the block is on disk or queued for writing; a load of a block
  still queued is answered from memory.
- Capacity: block files never exceed ``capacity_bytes`` (``num_blocks * (HEADER_NBYTES +
  block_nbytes)``); the writer deletes the least recently used file (written, loaded or
  touched longest ago) before writing a new one. The order survives a restart through the
  files' mtimes, which the writer refreshes on every hit.
- At most ``max_pending_writes`` puts wait for the writer; a put beyond that is dropped and
  counted (``num_dropped_puts``): the engine's step must not wait for the disk, and a dropped
  block is only a future cache miss. Queued payloads cost up to ``max_pending_writes *
  block_nbytes`` bytes of memory.
- Disabled store: a capacity below one block file, a folder that cannot be created or written,
  or a folder another store holds: the store starts disabled. Any ``OSError`` of a write at
  run time (EACCES, EROFS, ENOSPC, ...) disables it. Either way it logs *one* warning, ``KV
  disk tier off: <reason>``, drops its queued work, and every call becomes a cheap no-op
  (``in`` is False, loads answer ``None``); files already on disk stay for the next start.
- Crash safety: a block is written to ``.kv.tmp`` and ``os.replace``\\ d onto its name, so a
  killed process never leaves a partial file under a block's name. There is no ``fsync``: a
  process kill is covered, a power loss is not (a file can then hold garbage, which the
  checksum catches). ``flush`` waits for queued writes (the SIGTERM path); ``close`` flushes,
  stops the threads and releases the folder.

Both threads are daemons; the index is guarded by one lock, never held across I/O.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypedDict

from core_engine.kv_offload.block_file import (
    DIGEST_NBYTES,
    HEADER_NBYTES,
    block_file_id,
    encode_header,
    read_block_file,
)
from core_engine.private_files import create_exclusive, installation_secret, private_dir

__all__ = ["SECRET_NAME", "DiskKVStore", "DiskKVStoreStats", "disk_tier_secret"]

_logger = logging.getLogger(__name__)

_BLOCK_NAME = re.compile(r"[0-9a-f]{32}\.kv")
_TMP_SUFFIX = ".tmp"
_LOCK_NAME = ".lock"
#: The installation secret's file in the store's directory (see the module docstring).
SECRET_NAME = "secret"


def disk_tier_secret(directory: str | os.PathLike[str]) -> bytes:
    """The secret that keys the names and MACs of the block files under ``directory`` (a
    disk tier's ``kv_disk_dir``), created on first use; the directory is checked (and
    created) private first. Raises ``OSError`` (``UnsafePathError`` for a directory or
    secret file others control)."""
    return installation_secret(private_dir(directory) / SECRET_NAME)


class DiskKVStoreStats(TypedDict):
    """A snapshot from :meth:`DiskKVStore.stats`; byte counts are whole files (header included)."""

    enabled: bool
    num_blocks: int  # block files on disk that the store knows
    bytes_used: int  # their size: num_blocks * file size
    capacity_bytes: int
    pending_writes: int  # accepted puts not yet on disk
    num_writes: int
    bytes_written: int
    num_reads: int  # valid loads from disk (loads answered from the write queue not included)
    bytes_read: int
    num_invalid: int  # block files found invalid (wrong MAC, size, owner...) and deleted
    num_write_errors: int  # 0 or 1: the first one disables the store
    num_dropped_puts: int  # puts dropped because max_pending_writes were already queued


class DiskKVStore:
    """KV blocks on disk, at most ``capacity_bytes``, LRU, shared across restarts (see module)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        capacity_bytes: int,
        fingerprint: bytes,
        block_nbytes: int,
        max_pending_writes: int = 64,
        logger: logging.Logger | None = None,
    ) -> None:
        if not isinstance(fingerprint, bytes) or len(fingerprint) != DIGEST_NBYTES:
            raise ValueError(f"fingerprint must be {DIGEST_NBYTES} bytes (model_fingerprint)")
        if block_nbytes < 1:
            raise ValueError(f"block_nbytes must be >= 1, got {block_nbytes}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if max_pending_writes < 1:
            raise ValueError(f"max_pending_writes must be >= 1, got {max_pending_writes}")
        self.root = Path(directory)
        #: The model's own folder: ``<directory>/<fingerprint hex>``.
        self.directory = self.root / fingerprint.hex()
        self.fingerprint = fingerprint
        self.block_nbytes = block_nbytes
        self.file_nbytes = HEADER_NBYTES + block_nbytes
        self.capacity_bytes = capacity_bytes
        self.max_blocks = capacity_bytes // self.file_nbytes
        self.max_pending_writes = max_pending_writes
        self.enabled = True
        self.disabled_reason: str | None = None
        self._logger = logger or _logger
        self._dir = str(self.directory)
        self._secret = b""  # read from the directory at start-up

        self._lock = threading.Lock()
        self._write_cv = threading.Condition(self._lock)  # writer work, and flush() waiters
        self._read_cv = threading.Condition(self._lock)
        # The files, by file id (block_file_id: all a file's name tells) -> generation (a new
        # number per file written or found), least recently used first.
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._generations = itertools.count()
        # The write queue, oldest first: block hash -> payload.
        self._pending: OrderedDict[bytes, bytes] = OrderedDict()
        self._unlinks: deque[bytes] = deque()  # file ids that left the index, for the writer
        self._touched: set[bytes] = set()  # file ids of hits whose mtime the writer refreshes
        self._loads: deque[bytes] = deque()  # block hashes
        self._loaded: list[tuple[bytes, bytes | None]] = []
        self._writer_busy = False
        self._stopping = False
        self._closed = False
        self._disabling = False
        self._warned_invalid = False
        self._lock_fd: int | None = None
        self._threads: list[threading.Thread] = []
        self._num_writes = self._num_reads = self._num_invalid = 0
        self._num_write_errors = self._num_dropped_puts = 0
        self._bytes_written = self._bytes_read = 0

        if self.max_blocks == 0:
            self._disable(
                f"capacity_bytes={capacity_bytes} is smaller than one block file "
                f"({self.file_nbytes} bytes)"
            )
            return
        try:
            reason = self._open_directory()
        except OSError as exc:
            reason = f"cannot use {self._dir}: {exc}"
        if reason is not None:
            self._release_directory()
            self._disable(reason)
            return
        for name, loop in (("kv-disk-write", self._write_loop), ("kv-disk-read", self._read_loop)):
            thread = threading.Thread(target=self._guarded, args=(loop,), name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    # -- the caller's side: in-memory bookkeeping only ---------------------------------------

    def __contains__(self, block_hash: object) -> bool:
        if not isinstance(block_hash, bytes):
            return False
        file_id = self._file_id(block_hash)
        with self._lock:
            return self.enabled and (file_id in self._index or block_hash in self._pending)

    def put(self, block_hash: bytes, payload: bytes | bytearray | memoryview) -> None:
        """Queue one block for writing; ignored when held, queued, the queue is full or disabled.

        ``payload`` is any buffer of exactly ``block_nbytes`` bytes (else ``ValueError``)."""
        _check_hash(block_hash)
        nbytes = memoryview(payload).nbytes
        if nbytes != self.block_nbytes:
            raise ValueError(
                f"payload must be block_nbytes={self.block_nbytes} bytes, got {nbytes}"
            )
        file_id = self._file_id(block_hash)
        with self._lock:
            if not self._accepts(block_hash, file_id):
                return
        data = bytes(payload)  # no copy for bytes; a copy of a buffer the caller will reuse
        with self._lock:
            if self._accepts(block_hash, file_id):
                self._pending[block_hash] = data
                self._write_cv.notify_all()

    def request_load(self, block_hashes: Iterable[bytes]) -> None:
        """Queue reads; each hash is answered once by a later :meth:`poll_loaded`."""
        requested = [(block_hash, self._file_id(block_hash)) for block_hash in block_hashes]
        with self._lock:
            for block_hash, file_id in requested:
                if self.enabled and file_id in self._index:
                    self._loads.append(block_hash)
                else:  # still queued for writing, or unknown
                    pending = self._pending.get(block_hash) if self.enabled else None
                    self._loaded.append((block_hash, pending))
            self._read_cv.notify()

    def poll_loaded(self) -> list[tuple[bytes, bytes | None]]:
        """Loads finished since the last call: ``(hash, payload)``, ``payload`` None if lost."""
        with self._lock:
            loaded, self._loaded = self._loaded, []
        return loaded

    def touch(self, block_hash: bytes) -> None:
        """Mark a block recently used (a hit elsewhere), so that it is evicted later."""
        file_id = self._file_id(block_hash)
        with self._lock:
            if self.enabled and file_id in self._index:
                self._index.move_to_end(file_id)
                self._touched.add(file_id)
                self._write_cv.notify_all()

    def discard(self, block_hash: bytes) -> None:
        """Forget a block: drop its queued write, delete its file."""
        file_id = self._file_id(block_hash)
        with self._lock:
            if not self.enabled:
                return
            self._pending.pop(block_hash, None)
            if self._index.pop(file_id, None) is not None:
                self._unlinks.append(file_id)
                self._write_cv.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every accepted put is on disk (or dropped by a disable); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self.enabled and (
                self._pending or self._unlinks or self._touched or self._writer_busy
            ):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._write_cv.wait(remaining)
            return True

    def close(self, timeout: float | None = 10.0) -> None:
        """Flush (up to ``timeout``), stop the threads and release the folder; idempotent.

        Writes still queued after ``timeout`` are dropped."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        deadline = None if timeout is None else time.monotonic() + timeout
        self.flush(timeout)
        with self._lock:
            self._stopping = True
            if self.enabled:
                self._drop_work_locked()
                self.disabled_reason = "closed"
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._release_directory()

    def stats(self) -> DiskKVStoreStats:
        """Counters and sizes now (for metrics and the offload policy's free-block count)."""
        with self._lock:
            return DiskKVStoreStats(
                enabled=self.enabled,
                num_blocks=len(self._index),
                bytes_used=len(self._index) * self.file_nbytes,
                capacity_bytes=self.capacity_bytes,
                pending_writes=len(self._pending),
                num_writes=self._num_writes,
                bytes_written=self._bytes_written,
                num_reads=self._num_reads,
                bytes_read=self._bytes_read,
                num_invalid=self._num_invalid,
                num_write_errors=self._num_write_errors,
                num_dropped_puts=self._num_dropped_puts,
            )

    # -- state changes (call with the lock held) ---------------------------------------------

    def _accepts(self, block_hash: bytes, file_id: bytes) -> bool:
        if not self.enabled or file_id in self._index or block_hash in self._pending:
            return False
        if len(self._pending) >= self.max_pending_writes:
            self._num_dropped_puts += 1
            return False
        return True

    def _drop_work_locked(self) -> None:
        self.enabled = False
        self._pending.clear()
        self._unlinks.clear()
        self._touched.clear()
        self._index.clear()
        self._loaded.extend((block_hash, None) for block_hash in self._loads)
        self._loads.clear()
        self._write_cv.notify_all()
        self._read_cv.notify_all()

    def _disable(self, reason: str) -> None:
        with self._lock:
            if self._disabling or not self.enabled:
                return
            self._disabling = True
        # Logged before the state flips, so that whoever sees the store off finds the reason
        # in the log; not under the lock, which callers' cheap calls need.
        self._logger.warning("KV disk tier off: %s", reason)
        with self._lock:
            if self.enabled:  # (unless close() came first)
                self._drop_work_locked()
                self.disabled_reason = reason

    # -- start-up ----------------------------------------------------------------------------

    def _open_directory(self) -> str | None:
        """Create (private), lock and probe the folder, index its block files; a reason to
        stay off. Raises ``OSError`` (``UnsafePathError`` naming a folder others control)."""
        self._secret = disk_tier_secret(self.root)
        private_dir(self.directory)
        lock_path = os.path.join(self._dir, _LOCK_NAME)
        self._lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return f"{self._dir} is in use by another DiskKVStore (its {_LOCK_NAME} is locked)"
        except OSError as exc:  # no flock on this file system (some NFS): go on unguarded
            self._logger.debug("KV disk tier: no lock on %s: %s", self._dir, exc)
        probe = os.path.join(self._dir, "probe" + _TMP_SUFFIX)
        _remove(probe)
        with os.fdopen(create_exclusive(probe), "wb") as f:
            f.write(b"\0")
        os.unlink(probe)

        found: list[tuple[int, str]] = []
        num_tmp = num_invalid = 0
        uid = os.geteuid()
        with os.scandir(self._dir) as entries:
            for entry in entries:
                if entry.name.endswith(_TMP_SUFFIX):  # a write cut short by a kill
                    _remove(entry.path)
                    num_tmp += 1
                elif _BLOCK_NAME.fullmatch(entry.name):
                    st = entry.stat(follow_symlinks=False)
                    if (
                        entry.is_file(follow_symlinks=False)
                        and st.st_size == self.file_nbytes
                        and st.st_uid == uid
                    ):
                        found.append((st.st_mtime_ns, entry.name))
                    else:
                        _remove(entry.path)
                        num_invalid += 1
        found.sort()
        excess = max(0, len(found) - self.max_blocks)
        for _, name in found[:excess]:
            _remove(os.path.join(self._dir, name))
        for _, name in found[excess:]:
            self._index[bytes.fromhex(name[:-3])] = next(self._generations)
        self._num_invalid = num_invalid
        if num_tmp or num_invalid or excess:
            self._logger.info(
                "KV disk tier %s: removed %d unfinished writes, %d files of the wrong size, "
                "type or owner, %d blocks over capacity",
                self._dir, num_tmp, num_invalid, excess,
            )
        return None

    def _release_directory(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    # -- the threads -------------------------------------------------------------------------

    def _guarded(self, loop: Callable[[], None]) -> None:
        try:
            loop()
        except Exception as exc:  # a bug: keep the promise that calls never hang or raise
            self._logger.exception("KV disk tier: %s failed", threading.current_thread().name)
            self._disable(f"{threading.current_thread().name} failed: {exc!r}")

    def _file_id(self, block_hash: bytes) -> bytes:
        return block_file_id(self._secret, block_hash)

    def _path(self, file_id: bytes) -> str:
        return os.path.join(self._dir, file_id.hex() + ".kv")

    def path_of(self, block_hash: bytes) -> Path:
        """Where ``block_hash``'s file is (or would be)."""
        return Path(self._path(self._file_id(block_hash)))

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                self._writer_busy = False
                self._write_cv.notify_all()
                while self.enabled and not self._stopping and not (
                    self._pending or self._unlinks or self._touched
                ):
                    self._write_cv.wait()
                if not self.enabled or self._stopping:
                    return
                self._writer_busy = True
                # Deletions before the write, so that a block deleted and put again ends up
                # on disk; all of them at once, so that a stream of hits cannot starve writes.
                unlinks = list(self._unlinks)
                self._unlinks.clear()
                touched, self._touched = self._touched, set()
                write = next(iter(self._pending.items()), None)
                if write is not None:
                    while len(self._index) >= self.max_blocks:
                        unlinks.append(self._index.popitem(last=False)[0])
            try:
                for file_id in unlinks:
                    _remove(self._path(file_id))
                for file_id in touched:
                    with contextlib.suppress(OSError):  # best effort: only orders a restart's LRU
                        os.utime(self._path(file_id), follow_symlinks=False)
                if write is not None:
                    self._write_block(*write)
            except OSError as exc:
                with self._lock:
                    self._num_write_errors += 1
                self._disable(f"writing to {self._dir} failed: {exc}")
                return

    def _write_block(self, block_hash: bytes, data: bytes) -> None:
        file_id = self._file_id(block_hash)
        path = self._path(file_id)
        tmp = path + _TMP_SUFFIX
        header = encode_header(self._secret, self.fingerprint, block_hash, data)
        _remove(tmp)  # the folder is this user's alone: only a leftover of ours can be there
        try:
            with os.fdopen(create_exclusive(tmp), "wb") as f:
                f.write(header)
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        with self._lock:
            still_wanted = self._pending.get(block_hash) is data
            if still_wanted:
                del self._pending[block_hash]
                self._index[file_id] = next(self._generations)
            self._num_writes += 1
            self._bytes_written += self.file_nbytes
        if not still_wanted:  # discarded while being written
            _remove(path)

    def _read_loop(self) -> None:
        while True:
            with self._lock:
                while self.enabled and not self._stopping and not self._loads:
                    self._read_cv.wait()
                if not self.enabled or self._stopping:
                    return
                block_hash = self._loads.popleft()
                file_id = self._file_id(block_hash)
                generation = self._index.get(file_id)
                if generation is None:  # discarded or evicted since it was requested
                    self._loaded.append((block_hash, self._pending.get(block_hash)))
                    continue
            data, problem = read_block_file(
                self._path(file_id),
                secret=self._secret,
                fingerprint=self.fingerprint,
                block_hash=block_hash,
                payload_nbytes=self.block_nbytes,
            )
            first_invalid = None
            with self._lock:
                if not self.enabled:
                    data = None
                elif data is not None:
                    self._num_reads += 1
                    self._bytes_read += self.file_nbytes
                    if file_id in self._index:
                        self._index.move_to_end(file_id)
                        self._touched.add(file_id)
                        self._write_cv.notify_all()
                elif self._index.get(file_id) == generation:  # not a file evicted meanwhile
                    del self._index[file_id]
                    self._unlinks.append(file_id)
                    self._write_cv.notify_all()
                    self._num_invalid += 1
                    first_invalid = not self._warned_invalid
                    self._warned_invalid = True
                if first_invalid is None:
                    self._loaded.append((block_hash, data))
                    continue
            # Logged before the answer, so that a caller that saw the miss finds its reason.
            self._logger.log(
                logging.WARNING if first_invalid else logging.DEBUG,
                "KV disk tier: dropped invalid block file %s (%s)%s",
                self._path(file_id), problem,
                "; further ones are logged at debug level" if first_invalid else "",
            )
            with self._lock:
                self._loaded.append((block_hash, None))


def _check_hash(block_hash: bytes) -> None:
    if not isinstance(block_hash, bytes) or len(block_hash) != DIGEST_NBYTES:
        raise ValueError(f"block_hash must be {DIGEST_NBYTES} bytes, got {block_hash!r:.40}")


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
