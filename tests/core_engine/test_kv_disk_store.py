"""The disk tier of the KV cache (core_engine.kv_offload.disk_store) on real files.

Failures of the file system are real too: a read-only bind mount and a small tmpfs when the
tests run as root (else a chmod'ed folder, or a skip for the disk-full case).
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from core_engine.kv_offload import DiskKVStore, model_fingerprint
from core_engine.kv_offload.block_file import HEADER_NBYTES

BLOCK = 4096
FILE = HEADER_NBYTES + BLOCK
MODEL_A = hashlib.blake2b(b"model a", digest_size=16).digest()
MODEL_B = hashlib.blake2b(b"model b", digest_size=16).digest()
LOGGER = "core_engine.kv_offload.disk_store"
REPO = Path(__file__).resolve().parents[2]

OpenStore = Callable[..., DiskKVStore]


def bh(i: int) -> bytes:
    """The (made-up) chained hash of block i."""
    return hashlib.blake2b(f"block {i}".encode(), digest_size=16).digest()


def payload(i: int, nbytes: int = BLOCK) -> bytes:
    return random.Random(i).randbytes(nbytes)


def block_file(store: DiskKVStore, block_hash: bytes) -> Path:
    return store.path_of(block_hash)


def load(
    store: DiskKVStore, hashes: Sequence[bytes], timeout: float = 10.0
) -> dict[bytes, bytes | None]:
    """Request the loads and poll until every hash is answered."""
    store.request_load(hashes)
    answers: dict[bytes, bytes | None] = {}
    deadline = time.monotonic() + timeout
    while True:
        for block_hash, data in store.poll_loaded():
            assert block_hash not in answers, "a load was answered twice"
            answers[block_hash] = data
        if len(answers) == len(hashes):
            return answers
        assert time.monotonic() < deadline, f"{len(hashes) - len(answers)} loads never answered"
        time.sleep(0.002)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    records = caplog.records
    return [r.getMessage() for r in records if r.name == LOGGER and r.levelno >= logging.WARNING]


@pytest.fixture()
def open_store(tmp_path: Path) -> Iterator[OpenStore]:
    stores: list[DiskKVStore] = []

    def open_(directory: Path | None = None, **kwargs: Any) -> DiskKVStore:
        kwargs.setdefault("capacity_bytes", 1 << 20)
        kwargs.setdefault("fingerprint", MODEL_A)
        kwargs.setdefault("block_nbytes", BLOCK)
        store = DiskKVStore(directory or tmp_path / "kv", **kwargs)
        stores.append(store)
        return store

    yield open_
    for store in stores:
        store.close()


@pytest.fixture()
def mount() -> Iterator[Callable[..., None]]:
    """``mount(*args, target)`` runs ``mount``; skips when it cannot. Unmounted at teardown
    (request this fixture before ``open_store`` so that stores are closed first)."""
    mounted: list[str] = []

    def mount_(*args: str, target: Path, unmount: bool = True) -> None:
        if os.geteuid() != 0:
            pytest.skip("mounting a file system needs root")
        try:
            done = subprocess.run(["mount", *args, str(target)], capture_output=True, text=True)
        except FileNotFoundError:
            pytest.skip("no mount command")
        if done.returncode != 0:
            pytest.skip(f"mount {' '.join(args)} refused: {done.stderr.strip()}")
        if unmount:
            mounted.append(str(target))

    yield mount_
    for target in reversed(mounted):
        if subprocess.run(["umount", target], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", target], capture_output=True)


# -- what a store keeps -------------------------------------------------------------------------


def test_round_trip(open_store: OpenStore) -> None:
    store = open_store()
    for i in range(3):
        store.put(bh(i), payload(i))
    store.put(bh(3), memoryview(bytearray(payload(3))))
    reused = bytearray(payload(4))
    store.put(bh(4), reused)
    reused[:] = bytes(BLOCK)  # the caller's buffer is reused at once: the store kept a copy
    assert store.flush(timeout=10)

    assert all(bh(i) in store for i in range(5))
    assert bh(99) not in store
    answers = load(store, [bh(i) for i in range(5)] + [bh(99)])
    assert answers == {**{bh(i): payload(i) for i in range(5)}, bh(99): None}
    stats = store.stats()
    assert (stats["num_blocks"], stats["num_writes"], stats["num_reads"]) == (5, 5, 5)
    assert stats["bytes_used"] == stats["bytes_written"] == stats["bytes_read"] == 5 * FILE
    assert stats["num_invalid"] == stats["pending_writes"] == stats["num_dropped_puts"] == 0
    assert sorted(p.name for p in store.directory.glob("*.kv")) == sorted(
        store.path_of(bh(i)).name for i in range(5)
    )


def test_a_block_still_queued_loads_from_memory(open_store: OpenStore) -> None:
    store = open_store()
    store.put(bh(0), payload(0))
    assert bh(0) in store  # queued counts as held: the engine may plan on it now
    assert load(store, [bh(0)]) == {bh(0): payload(0)}


def test_put_rejects_a_payload_of_the_wrong_size_or_a_bad_hash(open_store: OpenStore) -> None:
    store = open_store()
    with pytest.raises(ValueError, match="block_nbytes"):
        store.put(bh(0), b"short")
    with pytest.raises(ValueError, match="block_hash"):
        store.put(b"not 16 bytes", payload(0))


def test_a_restarted_store_finds_and_reads_the_blocks(open_store: OpenStore) -> None:
    first = open_store()
    for i in range(3):
        first.put(bh(i), payload(i))
    first.close()

    again = open_store()
    assert again.enabled and again.stats()["num_blocks"] == 3
    assert all(bh(i) in again for i in range(3))
    assert load(again, [bh(i) for i in range(3)]) == {bh(i): payload(i) for i in range(3)}


def test_a_second_store_on_the_same_folder_stays_off(
    open_store: OpenStore, caplog: pytest.LogCaptureFixture
) -> None:
    first = open_store()
    first.put(bh(0), payload(0))
    second = open_store()
    assert not second.enabled
    assert second.disabled_reason is not None and "in use" in second.disabled_reason
    assert warnings_of(caplog) == [f"KV disk tier off: {second.disabled_reason}"]
    assert load(first, [bh(0)]) == {bh(0): payload(0)}  # the first one is unaffected


def test_discard_deletes_the_file(open_store: OpenStore) -> None:
    store = open_store()
    store.put(bh(0), payload(0))
    store.flush()
    store.discard(bh(0))
    assert bh(0) not in store
    store.flush()
    assert not block_file(store, bh(0)).exists()
    assert load(store, [bh(0)]) == {bh(0): None}
    assert store.stats()["num_invalid"] == 0


def test_close_writes_what_was_queued_and_is_idempotent(open_store: OpenStore) -> None:
    store = open_store()
    for i in range(20):
        store.put(bh(i), payload(i))
    store.close()
    store.close()
    assert not store.enabled and bh(0) not in store
    store.put(bh(50), payload(50))  # a no-op, not an error
    assert load(store, [bh(0)]) == {bh(0): None}
    assert len(list(store.directory.glob("*.kv"))) == 20


# -- capacity and LRU -----------------------------------------------------------------------------


def test_capacity_deletes_the_least_recently_used_file(open_store: OpenStore) -> None:
    store = open_store(capacity_bytes=3 * FILE + FILE // 2)
    for i in range(4):
        store.put(bh(i), payload(i))
        store.flush()
    assert bh(0) not in store and not block_file(store, bh(0)).exists()
    assert all(bh(i) in store for i in (1, 2, 3))
    stats = store.stats()
    assert stats["num_blocks"] == 3 and stats["bytes_used"] <= stats["capacity_bytes"]
    assert len(list(store.directory.glob("*.kv"))) == 3


def test_touch_and_loads_keep_a_block_alive(open_store: OpenStore) -> None:
    store = open_store(capacity_bytes=3 * FILE)
    for i in range(3):
        store.put(bh(i), payload(i))
    store.flush()
    store.touch(bh(0))  # LRU order now 1, 2, 0
    store.put(bh(3), payload(3))
    store.flush()
    assert bh(1) not in store and bh(0) in store
    load(store, [bh(2)])  # a load is a hit too: order 0, 3, 2
    store.put(bh(4), payload(4))
    store.flush()
    assert bh(0) not in store and bh(2) in store


def test_lru_order_survives_a_restart(open_store: OpenStore) -> None:
    first = open_store(capacity_bytes=4 * FILE)
    for i in range(4):
        first.put(bh(i), payload(i))
    first.close()
    past = time.time_ns() - 100 * 10**9
    for i in range(4):  # block 0 oldest
        os.utime(block_file(first, bh(i)), ns=(past + i * 10**9, past + i * 10**9))

    second = open_store(capacity_bytes=4 * FILE)
    second.touch(bh(0))  # a hit: its file's mtime is refreshed
    second.close()

    third = open_store(capacity_bytes=2 * FILE)  # trimmed at start, oldest first
    assert [i for i in range(4) if bh(i) in third] == [0, 3]
    assert not block_file(third, bh(1)).exists() and not block_file(third, bh(2)).exists()


def test_a_writer_behind_drops_puts_instead_of_blocking(open_store: OpenStore) -> None:
    nbytes = 256 << 10
    store = open_store(capacity_bytes=64 << 20, block_nbytes=nbytes, max_pending_writes=2)
    data = payload(0, nbytes)
    for i in range(200):
        store.put(bh(i), data)
        assert store.stats()["pending_writes"] <= 2
    assert store.flush(timeout=10)
    stats = store.stats()
    assert stats["num_dropped_puts"] > 0
    assert stats["num_writes"] + stats["num_dropped_puts"] == 200


# -- invalid files --------------------------------------------------------------------------------


def _flip(offset: int) -> Callable[[DiskKVStore, Path], None]:
    def tamper(store: DiskKVStore, root: Path) -> None:
        path = block_file(store, bh(0))
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x01
        path.write_bytes(data)

    return tamper


def _truncate(nbytes: int) -> Callable[[DiskKVStore, Path], None]:
    def tamper(store: DiskKVStore, root: Path) -> None:
        os.truncate(block_file(store, bh(0)), nbytes)

    return tamper


def _append(store: DiskKVStore, root: Path) -> None:
    with open(block_file(store, bh(0)), "ab") as f:
        f.write(b"\0")


def _other_model_under_the_same_name(store: DiskKVStore, root: Path) -> None:
    other = DiskKVStore(root, capacity_bytes=1 << 20, fingerprint=MODEL_B, block_nbytes=BLOCK)
    other.put(bh(0), payload(7))
    other.close()
    shutil.copyfile(block_file(other, bh(0)), block_file(store, bh(0)))


def _swap_names(store: DiskKVStore, root: Path) -> None:
    a, b = block_file(store, bh(0)), block_file(store, bh(1))
    a.rename(a.with_suffix(".swap"))
    b.rename(a)
    a.with_suffix(".swap").rename(b)


TAMPERS = {
    "flipped_payload_byte": (_flip(HEADER_NBYTES + BLOCK // 2), 1),
    "flipped_magic_byte": (_flip(0), 1),
    "flipped_length_byte": (_flip(HEADER_NBYTES - 17), 1),
    "truncated_payload": (_truncate(FILE - 1), 1),
    "truncated_header": (_truncate(HEADER_NBYTES // 2), 1),
    "trailing_byte": (_append, 1),
    "other_model_under_the_same_name": (_other_model_under_the_same_name, 1),
    "names_swapped": (_swap_names, 2),
}


@pytest.mark.parametrize("tamper", TAMPERS.values(), ids=TAMPERS.keys())
def test_an_invalid_file_is_never_returned(
    tamper: tuple[Callable[[DiskKVStore, Path], None], int],
    open_store: OpenStore,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    tamper_with, num_invalid = tamper
    store = open_store()
    for i in range(3):
        store.put(bh(i), payload(i))
    store.flush()
    tamper_with(store, tmp_path / "kv")

    answers = load(store, [bh(0), bh(1), bh(2)])
    assert answers[bh(0)] is None
    assert answers[bh(1)] == (None if num_invalid == 2 else payload(1))
    assert answers[bh(2)] == payload(2)
    assert store.stats()["num_invalid"] == num_invalid
    assert bh(0) not in store
    store.flush()  # deletions happen on the writer thread
    assert not block_file(store, bh(0)).exists()
    assert load(store, [bh(0)]) == {bh(0): None}
    invalid = [w for w in warnings_of(caplog) if "invalid block file" in w]
    assert len(invalid) == 1  # once, however many


def test_a_file_copied_in_from_another_model_is_invalid(
    open_store: OpenStore, tmp_path: Path
) -> None:
    store = open_store()
    store.put(bh(0), payload(0))
    store.close()
    other = open_store(fingerprint=MODEL_B)
    other.put(bh(1), payload(1))
    other.close()
    shutil.copyfile(block_file(other, bh(1)), block_file(store, bh(1)))

    again = open_store()
    assert bh(1) in again  # start-up only stats files
    assert load(again, [bh(0), bh(1)]) == {bh(0): payload(0), bh(1): None}
    assert again.stats()["num_invalid"] == 1
    again.flush()
    assert not block_file(again, bh(1)).exists()


def test_a_torn_write_is_cleaned_at_start(open_store: OpenStore) -> None:
    first = open_store()
    first.put(bh(0), payload(0))
    first.close()
    # What a SIGKILL mid-write leaves: the temp file (documented layout) and no block file.
    torn = first.directory / f"{bh(1).hex()}.kv.tmp"
    torn.write_bytes(block_file(first, bh(0)).read_bytes()[: FILE // 2])
    # A half block under its final name (another tool, an old version) is caught by its size.
    block_file(first, bh(2)).write_bytes(block_file(first, bh(0)).read_bytes()[:-10])

    again = open_store()
    assert not torn.exists() and not block_file(again, bh(2)).exists()
    assert bh(0) in again and bh(1) not in again and bh(2) not in again
    assert again.stats()["num_blocks"] == 1
    assert load(again, [bh(0)]) == {bh(0): payload(0)}


_WRITER = textwrap.dedent(
    """
    import hashlib, sys
    from core_engine.kv_offload import DiskKVStore

    nbytes = int(sys.argv[2])
    store = DiskKVStore(sys.argv[1], capacity_bytes=32 * nbytes, fingerprint=bytes(16),
                        block_nbytes=nbytes, max_pending_writes=4)
    i = 0
    while True:
        block_hash = hashlib.blake2b(f"block {i}".encode(), digest_size=16).digest()
        store.put(block_hash, i.to_bytes(8, "little") * (nbytes // 8))
        if i == 100:
            print("writing", flush=True)
        i += 1
    """
)


def test_a_process_killed_while_writing_leaves_only_whole_blocks(
    open_store: OpenStore, tmp_path: Path
) -> None:
    nbytes = 1 << 20
    directory = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for _ in range(5):  # until a kill lands mid-write (leaves a temp file): ~40% per try
        proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(directory), str(nbytes)],
            stdout=subprocess.PIPE, env=env, cwd=REPO,
        )
        assert proc.stdout is not None and proc.stdout.readline() == b"writing\n"
        time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if list(directory.rglob("*.tmp")):
            break

    store = open_store(
        directory, capacity_bytes=32 * nbytes, fingerprint=bytes(16), block_nbytes=nbytes
    )
    assert not list(store.directory.glob("*.tmp"))
    by_name = {store.path_of(bh(i)).name: bh(i) for i in range(100_000)}  # names are keyed
    hashes = [by_name[p.name] for p in store.directory.glob("*.kv")]
    assert hashes and len(hashes) == store.stats()["num_blocks"]
    for block_hash, data in load(store, hashes).items():
        assert data is not None
        i = int.from_bytes(data[:8], "little")
        assert block_hash == bh(i) and data == i.to_bytes(8, "little") * (nbytes // 8)
    assert store.stats()["num_invalid"] == 0


# -- a store that cannot work turns itself off ----------------------------------------------------


def test_a_capacity_below_one_block_turns_the_store_off(
    open_store: OpenStore, caplog: pytest.LogCaptureFixture
) -> None:
    store = open_store(capacity_bytes=FILE - 1)
    assert not store.enabled
    assert "smaller than one block file" in (store.disabled_reason or "")
    assert warnings_of(caplog) == [f"KV disk tier off: {store.disabled_reason}"]
    store.put(bh(0), payload(0))
    assert bh(0) not in store and store.stats()["pending_writes"] == 0
    store.request_load([bh(0)])
    assert store.poll_loaded() == [(bh(0), None)]  # answered, so that no caller waits for it
    assert store.flush(timeout=1)
    assert not store.directory.exists()


def test_a_folder_that_cannot_be_created_turns_the_store_off(
    open_store: OpenStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "a_file").write_bytes(b"")
    store = open_store(tmp_path / "a_file")
    assert not store.enabled
    assert store.disabled_reason is not None and "cannot use" in store.disabled_reason
    assert len(warnings_of(caplog)) == 1


@pytest.fixture()
def make_read_only(mount: Callable[..., None]) -> Iterator[Callable[[Path], None]]:
    """Root ignores permissions, so as root: a read-only bind mount of the folder on itself."""
    chmodded: list[Path] = []

    def make(path: Path) -> None:
        if os.geteuid() == 0:
            mount("--bind", str(path), target=path)
            mount("-o", "remount,ro,bind", str(path), target=path, unmount=False)
        else:
            path.chmod(0o555)
            chmodded.append(path)

    yield make
    for path in chmodded:
        path.chmod(0o755)


def test_a_folder_turned_read_only_turns_the_store_off(
    make_read_only: Callable[[Path], None],
    open_store: OpenStore,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = open_store()
    store.put(bh(0), payload(0))
    store.flush()
    make_read_only(store.directory)

    store.put(bh(1), payload(1))  # the writer fails on this one
    assert store.flush(timeout=10)
    assert not store.enabled
    reason = store.disabled_reason or ""
    assert "Read-only file system" in reason or "Permission denied" in reason
    assert warnings_of(caplog) == [f"KV disk tier off: {store.disabled_reason}"]
    assert store.stats()["num_write_errors"] == 1
    store.put(bh(2), payload(2))
    assert bh(0) not in store and bh(2) not in store
    assert load(store, [bh(0)]) == {bh(0): None}
    assert len(warnings_of(caplog)) == 1


def test_a_full_disk_turns_the_store_off(
    mount: Callable[..., None],
    open_store: OpenStore,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    small = tmp_path / "small"
    small.mkdir()
    mount("-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", target=small)  # private
    nbytes = 16 << 10
    store = open_store(small, capacity_bytes=64 << 20, block_nbytes=nbytes)
    assert store.enabled
    for i in range(100):
        store.put(bh(i), payload(i, nbytes))
        store.flush(timeout=10)
        if not store.enabled:
            break
    assert not store.enabled
    assert store.disabled_reason is not None and "No space left on device" in store.disabled_reason
    assert warnings_of(caplog) == [f"KV disk tier off: {store.disabled_reason}"]
    stats = store.stats()
    assert stats["num_write_errors"] == 1 and stats["num_writes"] >= 1
    assert not list(store.directory.glob("*.tmp"))  # the failed write cleaned up after itself
    store.put(bh(500), payload(500, nbytes))
    assert bh(500) not in store


# -- model fingerprint ----------------------------------------------------------------------------


def test_model_fingerprint_tells_files_one_byte_apart(tmp_path: Path) -> None:
    data = bytearray(random.Random(0).randbytes(3 << 20))  # small enough to be hashed whole
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(data)
    data[len(data) // 2] ^= 0x01
    b.write_bytes(data)
    fingerprint = model_fingerprint(a)
    assert len(fingerprint) == 16
    assert model_fingerprint(a) == fingerprint
    assert model_fingerprint(b) != fingerprint
    assert model_fingerprint(a, extra="kv=int8") != fingerprint


def test_model_fingerprint_of_a_large_file_reads_samples(tmp_path: Path) -> None:
    size = 1 << 30  # sparse: costs no disk

    def model(name: str, size: int, edits: dict[int, bytes]) -> Path:
        path = tmp_path / name
        with open(path, "wb") as f:
            f.truncate(size)
            f.write(b"GGUF header")
            for offset, data in edits.items():
                f.seek(offset)
                f.write(data)
        return path

    base = model_fingerprint(model("base", size, {}))
    assert model_fingerprint(tmp_path / "base") == base
    assert model_fingerprint(model("header", size, {100: b"x"})) != base
    assert model_fingerprint(model("tail", size, {size - 1: b"x"})) != base
    # The first of the evenly spaced samples starts right after the first MiB.
    assert model_fingerprint(model("sample", size, {(1 << 20) + 10: b"x"})) != base
    assert model_fingerprint(model("longer", size + 1, {})) != base
