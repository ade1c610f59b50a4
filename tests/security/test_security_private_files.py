"""Files are private and verified: what infermux keeps on disk (the KV disk tier, the usage
ledger and the stored responses, the compiled-kernel cache) lives in ``0700`` folders of this
user, as ``0600`` files; a folder or file that another user controls is refused with the path
named, never used. KV blocks carry a MAC keyed with a per-installation secret and are named by
a keyed hash, so a block planted or changed by someone else is dropped (and counted), never
loaded, and a guessed prompt cannot be confirmed from a listing. A kernel library is loaded
only with the SHA-256 recorded at its build. Shared-memory KV segments of another user are
neither taken nor deleted, and never turn a start-up into a ``PermissionError``.

The tests run as root: "another user" is a file or folder they ``chown`` to uid 65534, and a
child process that drops to uid 65533 plays a user who meets root's (or 65534's) segments.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from backends.errors import InfermuxError
from core_engine.kv_offload import DiskKVStore
from core_engine.kv_offload.block_file import HEADER_NBYTES, encode_header
from core_engine.kv_offload.disk_store import SECRET_NAME
from core_engine.kv_transfer import KVTransferConfig, KVTransferError, KVTransferMeta, PrefilledKV
from core_engine.kv_transfer.shm import ShmKVReceiver, ShmKVSender, segment_name
from gateway.openai.response_store import ResponseStore
from gateway.testing import gateway_config, mock_backend
from plugins.builtin.cost.ledger import Ledger, LedgerError

REPO = Path(__file__).resolve().parents[2]
OTHER_UID = 65534  # "nobody": another user
BLOCK = 4096
FINGERPRINT = hashlib.blake2b(b"model", digest_size=16).digest()


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def bh(i: int) -> bytes:
    """The (made-up) chained hash of block i."""
    return hashlib.blake2b(f"block {i}".encode(), digest_size=16).digest()


def payload(i: int) -> bytes:
    return bytes([i % 256]) * BLOCK


def load(store: DiskKVStore, hashes: list[bytes]) -> dict[bytes, bytes | None]:
    store.request_load(hashes)
    answers: dict[bytes, bytes | None] = {}
    deadline = time.monotonic() + 10
    while len(answers) < len(hashes):
        answers.update(store.poll_loaded())
        assert time.monotonic() < deadline, "loads never answered"
        time.sleep(0.002)
    return answers


@pytest.fixture()
def open_store(tmp_path: Path) -> Iterator[Callable[..., DiskKVStore]]:
    stores: list[DiskKVStore] = []

    def open_(directory: Path | None = None) -> DiskKVStore:
        store = DiskKVStore(
            directory or tmp_path / "kv", capacity_bytes=1 << 20, fingerprint=FINGERPRINT,
            block_nbytes=BLOCK,
        )
        stores.append(store)
        return store

    yield open_
    for store in stores:
        store.close()


# -- the KV disk tier -------------------------------------------------------------------------


def test_kv_blocks_are_0600_files_in_0700_folders_named_by_a_keyed_hash(
    open_store: Callable[..., DiskKVStore], tmp_path: Path
) -> None:
    store = open_store()
    for i in range(3):
        store.put(bh(i), payload(i))
    store.close()
    root = tmp_path / "kv"
    assert mode(root) == mode(store.directory) == 0o700
    assert mode(root / SECRET_NAME) == 0o600 and len((root / SECRET_NAME).read_bytes()) == 32
    files = sorted(store.directory.glob("*.kv"))
    assert len(files) == 3 and all(mode(p) == 0o600 for p in files)
    # The name is not the block's prefix hash (nor anything computable without the secret):
    # a listing cannot confirm a guessed prompt.
    names = {p.name for p in files}
    assert not names & {f"{bh(i).hex()}.kv" for i in range(3)}
    other = open_store(tmp_path / "elsewhere")  # another installation names them otherwise
    assert other.path_of(bh(0)).name not in names

    again = open_store()  # the happy path: a restart restores the blocks
    assert load(again, [bh(i) for i in range(3)]) == {bh(i): payload(i) for i in range(3)}


@pytest.mark.parametrize(
    "make_unsafe",
    [
        pytest.param(lambda d: os.chown(d, OTHER_UID, OTHER_UID), id="owned_by_another_user"),
        pytest.param(lambda d: d.chmod(0o770), id="group_writable"),
        pytest.param(lambda d: d.chmod(0o755), id="world_readable"),
    ],
)
def test_a_kv_folder_others_control_is_refused_by_name(
    make_unsafe: Callable[[Path], None],
    open_store: Callable[..., DiskKVStore],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    make_unsafe(shared)
    store = open_store(shared)
    assert not store.enabled
    reason = store.disabled_reason or ""
    assert f"{shared} " in reason and "refusing" in reason
    assert f"KV disk tier off: {reason}" in caplog.text
    store.put(bh(0), payload(0))
    assert store.flush(timeout=5)
    assert list(shared.iterdir()) == []  # nothing was written into it


def test_a_kv_model_folder_of_another_user_is_refused(
    open_store: Callable[..., DiskKVStore], tmp_path: Path
) -> None:
    first = open_store()
    first.close()
    os.chown(first.directory, OTHER_UID, OTHER_UID)  # planted before our start
    store = open_store()
    assert not store.enabled
    assert f"{first.directory} is owned by uid {OTHER_UID}" in (store.disabled_reason or "")


@pytest.mark.parametrize("plant", ["another_owner", "a_symlink"])
def test_a_secret_file_others_control_is_refused(
    plant: str, open_store: Callable[..., DiskKVStore], tmp_path: Path
) -> None:
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    secret = root / SECRET_NAME
    if plant == "another_owner":
        secret.write_bytes(bytes(32))
        secret.chmod(0o600)
        os.chown(secret, OTHER_UID, OTHER_UID)
    else:
        (tmp_path / "known").write_bytes(bytes(32))
        secret.symlink_to(tmp_path / "known")
    store = open_store()
    assert not store.enabled
    assert str(secret) in (store.disabled_reason or "")


def test_a_block_forged_without_the_secret_is_dropped_and_counted(
    open_store: Callable[..., DiskKVStore], caplog: pytest.LogCaptureFixture
) -> None:
    store = open_store()
    store.put(bh(0), payload(0))
    store.put(bh(1), payload(1))
    store.close()
    # Someone who can write the folder replaces block 0 with their own KV: a well-formed file
    # for the right model and block, MAC'ed with a secret of their own.
    evil = payload(66)
    store.path_of(bh(0)).write_bytes(encode_header(bytes(32), FINGERPRINT, bh(0), evil) + evil)
    # ... and flips a payload byte of block 1, its MAC recomputed the way an unkeyed
    # checksum would be.
    path = store.path_of(bh(1))
    data = bytearray(path.read_bytes())
    data[HEADER_NBYTES] ^= 0xFF
    data[HEADER_NBYTES - 16 : HEADER_NBYTES] = hashlib.blake2b(
        bytes(data[HEADER_NBYTES:]), digest_size=16
    ).digest()
    path.write_bytes(bytes(data))

    caplog.set_level(logging.DEBUG, logger="core_engine.kv_offload.disk_store")
    again = open_store()
    assert load(again, [bh(0), bh(1)]) == {bh(0): None, bh(1): None}  # never loaded
    assert again.stats()["num_invalid"] == 2
    assert "MAC mismatch" in caplog.text
    again.flush()
    assert not again.path_of(bh(0)).exists() and not again.path_of(bh(1)).exists()


def test_a_symlink_or_another_owners_file_is_never_loaded(
    open_store: Callable[..., DiskKVStore], tmp_path: Path
) -> None:
    store = open_store()
    for i in range(2):
        store.put(bh(i), payload(i))
    store.flush()
    # Block 0's file becomes a link to a (valid) copy outside: a load must not follow it.
    outside = tmp_path / "outside.kv"
    shutil.copyfile(store.path_of(bh(0)), outside)
    store.path_of(bh(0)).unlink()
    store.path_of(bh(0)).symlink_to(outside)
    assert load(store, [bh(0)]) == {bh(0): None}
    assert store.stats()["num_invalid"] == 1
    store.close()

    os.chown(store.path_of(bh(1)), OTHER_UID, OTHER_UID)  # a file that is not ours
    again = open_store()
    assert bh(1) not in again and not again.path_of(bh(1)).exists()
    assert again.stats()["num_invalid"] == 1
    assert outside.exists()  # only the link was removed


def test_a_temp_file_planted_as_a_symlink_is_not_written_through(
    open_store: Callable[..., DiskKVStore], tmp_path: Path
) -> None:
    store = open_store()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    Path(f"{store.path_of(bh(0))}.tmp").symlink_to(victim)
    store.put(bh(0), payload(0))
    assert store.flush(timeout=10) and store.enabled
    assert victim.read_bytes() == b"precious"
    assert not store.path_of(bh(0)).is_symlink() and mode(store.path_of(bh(0))) == 0o600
    assert load(store, [bh(0)]) == {bh(0): payload(0)}


# -- the usage ledger and the stored responses ------------------------------------------------


def test_the_ledger_and_stored_responses_are_0600_in_a_0700_folder(
    live_gateway: Any, tmp_path: Path
) -> None:
    data_dir = tmp_path / "var"  # missing: the gateway creates it
    with live_gateway(gateway_config(mock_backend("mock")), data_dir=data_dir) as gw:
        body = {"model": "echo", "input": "my secret plans", "store": True}
        response = httpx.post(f"{gw}/v1/responses", json=body, timeout=30)
        assert response.status_code == 200, response.text
        chat = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(f"{gw}/v1/chat/completions", json=chat, timeout=30).status_code == 200
        usage = httpx.get(f"{gw}/v1/usage", timeout=30).json()
        assert usage["totals"]["requests"] >= 1
        modes = {p.name: mode(p) for p in data_dir.iterdir()}  # -wal, -shm included
    assert mode(data_dir) == 0o700
    assert "ledger.sqlite3" in modes and set(modes.values()) == {0o600}, modes


@pytest.mark.parametrize(
    "make_unsafe",
    [
        pytest.param(lambda d: os.chown(d, OTHER_UID, OTHER_UID), id="owned_by_another_user"),
        pytest.param(lambda d: d.chmod(0o750), id="group_readable"),
    ],
)
def test_a_ledger_folder_others_can_reach_is_refused_by_name(
    make_unsafe: Callable[[Path], None], tmp_path: Path
) -> None:
    folder = tmp_path / "var"
    folder.mkdir(mode=0o700)
    make_unsafe(folder)
    with pytest.raises(LedgerError, match=f"{folder} (is owned by uid {OTHER_UID}|has mode 0750)"):
        Ledger(folder / "ledger.sqlite3")
    store = ResponseStore(folder / "ledger.sqlite3")
    with pytest.raises(InfermuxError, match=f"{folder} .*refusing"):
        store.put("resp_1", None, b"{}", [])
    assert list(folder.iterdir()) == []


def test_a_ledger_file_that_is_a_link_or_another_users_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "var"
    folder.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere.sqlite3"
    elsewhere.write_bytes(b"")
    (folder / "link.sqlite3").symlink_to(elsewhere)
    with pytest.raises(LedgerError, match="symbolic link"):
        Ledger(folder / "link.sqlite3")
    theirs = folder / "theirs.sqlite3"
    theirs.write_bytes(b"")
    os.chown(theirs, OTHER_UID, OTHER_UID)
    with pytest.raises(LedgerError, match=f"owned by uid {OTHER_UID}"):
        Ledger(theirs)
    assert elsewhere.read_bytes() == b""


def test_an_old_ledger_file_of_ours_is_narrowed_to_0600(tmp_path: Path) -> None:
    folder = tmp_path / "var"
    folder.mkdir(mode=0o700)
    ledger_path = folder / "ledger.sqlite3"
    Ledger(ledger_path).close()
    ledger_path.chmod(0o644)  # what an older version left
    Ledger(ledger_path).close()
    assert mode(ledger_path) == 0o600


# -- the compiled-kernel cache ----------------------------------------------------------------

#: A Python extension of a few lines: the cache's checks are the same for any library, and
#: this one compiles in about a second (a real kernel takes ~35 s on 2 cores).
_SMALL_SOURCE = textwrap.dedent(
    """
    #include <Python.h>
    static struct PyModuleDef small = {PyModuleDef_HEAD_INIT, "infermux_cache_probe", nullptr, -1, nullptr};
    PyMODINIT_FUNC PyInit_infermux_cache_probe(void) { return PyModule_Create(&small); }
    """
)

_LOAD_KERNEL = textwrap.dedent(
    """
    import logging, sys
    from pathlib import Path
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    import core_engine.kernels.cpu as kernels
    if len(sys.argv) > 2:  # where "the install" put its libraries (the package's prebuilt/)
        kernels.installed_dir = lambda: Path(sys.argv[2])
    from core_engine.kernels.cpu import KernelBuildError, cached_build
    try:
        cached_build(Path(sys.argv[1]), "infermux_cache_probe", "x86-64")
    except KernelBuildError as exc:
        print("REFUSED", exc)
        sys.exit(3)
    print("LOADED")
    """
)


def load_kernel(
    cache: Path, source: Path, installed: Path | None = None, *, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Load ``source``'s library through the cache in a fresh process (one load per process);
    ``installed``: the folder standing for the package's ``prebuilt/``."""
    env = {**os.environ, "INFERMUX_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", _LOAD_KERNEL, str(source), *([str(installed)] if installed else [])],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=600,
    )


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small source, at one path for the module (its file name is part of the cache key)."""
    source = tmp_path_factory.mktemp("kernel-source") / "infermux_cache_probe.cpp"
    source.write_text(_SMALL_SOURCE)
    return source


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory: pytest.TempPathFactory, probe: Path) -> Path:
    """A kernel cache with the small library built in it (once)."""
    cache = tmp_path_factory.mktemp("kernel-cache") / "cache"
    done = load_kernel(cache, probe)
    assert done.returncode == 0 and "LOADED" in done.stdout, done.stdout + done.stderr
    return cache


@pytest.fixture()
def cache(built_cache: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "cache"
    shutil.copytree(built_cache, copy)  # modes kept
    return copy


def library_of(cache: Path) -> Path:
    (library,) = (cache / "kernels").glob("*.so")
    return library


def test_a_built_kernel_is_0600_with_its_sha256_recorded(cache: Path, probe: Path) -> None:
    library = library_of(cache)
    record = library.with_name(library.name + ".sha256")
    assert mode(cache / "kernels") == 0o700
    assert mode(library) == mode(record) == 0o600
    assert record.read_text().strip() == hashlib.sha256(library.read_bytes()).hexdigest()
    assert load_kernel(cache, probe).stdout.strip() == "LOADED"


def test_a_changed_kernel_is_rebuilt_not_loaded(cache: Path, probe: Path) -> None:
    library = library_of(cache)
    data = bytearray(library.read_bytes())
    data[len(data) // 2] ^= 0xFF
    library.write_bytes(bytes(data))
    done = load_kernel(cache, probe)
    assert done.stdout.strip() == "LOADED", done.stderr
    assert "rebuilding" in done.stderr and "SHA-256" in done.stderr
    rebuilt = library.read_bytes()
    assert rebuilt != bytes(data)
    assert library.with_name(library.name + ".sha256").read_text().strip() == hashlib.sha256(rebuilt).hexdigest()


@pytest.mark.parametrize("plant", ["another_owner", "group_writable", "a_symlink"])
def test_a_kernel_file_others_control_is_refused(plant: str, cache: Path, probe: Path, tmp_path: Path) -> None:
    library = library_of(cache)
    if plant == "another_owner":
        os.chown(library, OTHER_UID, OTHER_UID)
    elif plant == "group_writable":
        library.chmod(0o620)
    else:
        shutil.copyfile(library, tmp_path / "copy.so")
        library.unlink()
        library.symlink_to(tmp_path / "copy.so")
    done = load_kernel(cache, probe)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "REFUSED" in done.stdout and str(library) in done.stdout


@pytest.mark.parametrize("plant", ["another_owner", "group_writable"])
def test_a_kernel_cache_folder_others_control_is_refused(plant: str, cache: Path, probe: Path) -> None:
    folder = cache / "kernels"
    if plant == "another_owner":
        os.chown(folder, OTHER_UID, OTHER_UID)
    else:
        folder.chmod(0o770)
    done = load_kernel(cache, probe)
    assert done.returncode == 3, done.stdout + done.stderr
    assert f"REFUSED the kernel cache cannot be used: {folder} " in done.stdout


def installed_copy(cache: Path, folder: Path) -> Path:
    """What an install leaves in the package's ``prebuilt/``: the library and its record, 0644."""
    folder.mkdir()
    library = library_of(cache)
    for path in (library, library.with_name(library.name + ".sha256")):
        shutil.copyfile(path, folder / path.name)
        (folder / path.name).chmod(0o644)
    return folder / library.name


def no_compiler_env(tmp_path: Path) -> dict[str, str]:
    """A PATH with this Python only: no g++, c++ nor CXX, as in the image's runtime stage."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(sys.executable)
    assert shutil.which("g++", path=str(bin_dir)) is None and shutil.which("c++", path=str(bin_dir)) is None
    return {"PATH": str(bin_dir), "CXX": ""}


def test_a_kernel_built_at_install_is_loaded_where_no_compiler_is(built_cache: Path, probe: Path, tmp_path: Path) -> None:
    installed = installed_copy(built_cache, tmp_path / "prebuilt")
    empty_cache = tmp_path / "cache"
    done = load_kernel(empty_cache, probe, installed.parent, env=no_compiler_env(tmp_path))
    assert done.stdout.strip() == "LOADED", done.stdout + done.stderr
    assert not (empty_cache / "kernels").exists()  # nothing compiled, nothing cached
    # Without it, the same runtime says why it cannot serve the kernel, and what to do.
    installed.unlink()
    done = load_kernel(empty_cache, probe, installed.parent, env=no_compiler_env(tmp_path / "again"))
    assert done.returncode == 3, done.stdout + done.stderr
    assert "no C++ compiler found" in done.stdout and "built at install" in done.stdout


@pytest.mark.parametrize("plant", ["changed", "group_writable", "another_owner"])
def test_an_installed_kernel_not_as_its_install_left_it_is_passed_over(
    plant: str, built_cache: Path, probe: Path, tmp_path: Path
) -> None:
    installed = installed_copy(built_cache, tmp_path / "prebuilt")
    if plant == "changed":
        data = bytearray(installed.read_bytes())
        data[len(data) // 2] ^= 0xFF
        installed.write_bytes(bytes(data))
    elif plant == "group_writable":
        installed.chmod(0o664)
    else:
        os.chown(installed, OTHER_UID, OTHER_UID)
    cache = tmp_path / "cache"
    done = load_kernel(cache, probe, installed.parent)
    assert done.stdout.strip() == "LOADED", done.stdout + done.stderr
    assert "not using" in done.stderr and str(installed) in done.stderr
    assert library_of(cache).is_file()  # compiled into the user's cache instead


_USE_OPENBLAS = "from backends.mlx.cpu_blas import use_openblas; print('BLAS', use_openblas())"


def use_openblas_in(cache: Path) -> str:
    """What ``use_openblas`` answers in a fresh process with ``cache`` as the kernel cache."""
    env = {**os.environ, "INFERMUX_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", _USE_OPENBLAS], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().removeprefix("BLAS ")


def test_the_mlx_openblas_forwarder_is_verified_like_a_kernel(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert use_openblas_in(cache) != "None"  # built, recorded, loaded
    (library,) = (cache / "kernels").glob("infermux_mlx_openblas-*.so")
    record = library.with_name(library.name + ".sha256")
    assert mode(library) == mode(record) == 0o600
    library.write_bytes(library.read_bytes() + b"changed")
    assert use_openblas_in(cache) != "None"  # a changed library is rebuilt, not loaded
    assert record.read_text().strip() == hashlib.sha256(library.read_bytes()).hexdigest()
    os.chown(library, OTHER_UID, OTHER_UID)
    assert use_openblas_in(cache) == "None"  # another user's library: refused, reference BLAS


# -- shared-memory KV segments ----------------------------------------------------------------

_DEAD_PID = 2**22 + 12345  # above pid_max on most machines: never alive


def make_kv() -> PrefilledKV:
    data = torch.arange(2 * 2 * 2 * 4 * 2 * 8, dtype=torch.float32).reshape(2, 2, 2, 4, 2, 8)
    meta = KVTransferMeta(
        prompt_token_ids=list(range(7)), first_token_id=7, block_hashes=[bytes(16)],
        num_blocks=2, layout="test", block_shape=(2, 2, 4, 2, 8), dtype=str(data.dtype),
        scale_shape=None, data_nbytes=data.numel() * 4, scales_nbytes=0,
    )
    return PrefilledKV(meta=meta, data=data, scales=None)


@pytest.fixture()
def segments() -> Iterator[list[str]]:
    """Names of segments a test made; unlinked at the end whoever owns them."""
    names: list[str] = []
    yield names
    for name in names:
        try:
            shared_memory._posixshmem.shm_unlink("/" + name)  # type: ignore[attr-defined]
        except FileNotFoundError:
            pass


def plant_segment(name: str, *, uid: int, mode_bits: int, complete: bool = False) -> None:
    """A transfer segment (header of a dead sender) owned by ``uid``."""
    segment = shared_memory.SharedMemory(name=name, create=True, size=64)
    resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    assert segment.buf is not None
    struct.pack_into("<8sB3xIIQd", segment.buf, 0, b"IMXKV001", int(complete), _DEAD_PID, 0, 0, time.time())
    os.fchmod(segment._fd, mode_bits)  # type: ignore[attr-defined]
    os.fchown(segment._fd, uid, uid)  # type: ignore[attr-defined]
    segment.close()


SHM = KVTransferConfig(transport="shm", timeout_s=2)


def test_another_users_dead_segment_is_left_alone_at_start_up(segments: list[str]) -> None:
    name = segment_name(f"theirs-{os.getpid()}")
    segments.append(name)
    plant_segment(name, uid=OTHER_UID, mode_bits=0o600)
    ShmKVSender(SHM).close()  # the start-up sweep of dead senders' segments
    ShmKVReceiver(SHM).close()
    assert os.stat(f"/dev/shm/{name}").st_uid == OTHER_UID  # not ours to delete


def test_a_transfer_name_taken_by_another_user_fails_clearly(segments: list[str]) -> None:
    transfer_id = f"taken-{os.getpid()}"
    name = segment_name(transfer_id)
    segments.append(name)
    plant_segment(name, uid=OTHER_UID, mode_bits=0o600)
    sender = ShmKVSender(SHM)
    with pytest.raises(KVTransferError, match=f"{name} belongs to uid {OTHER_UID}"):
        sender.send(transfer_id, make_kv())
    assert os.stat(f"/dev/shm/{name}").st_uid == OTHER_UID  # neither deleted nor taken over
    sender.close()


def test_a_transfer_segment_of_another_user_is_never_received(segments: list[str]) -> None:
    transfer_id = f"planted-{os.getpid()}"
    name = segment_name(transfer_id)
    segments.append(name)
    sender = ShmKVSender(SHM)
    sender.send(transfer_id, make_kv())  # a complete, well-formed transfer ...
    os.chown(f"/dev/shm/{name}", OTHER_UID, OTHER_UID)  # ... that another user put there
    with pytest.raises(KVTransferError, match=f"belongs to uid {OTHER_UID}"):
        ShmKVReceiver(SHM).receive(transfer_id, timeout=1)
    assert os.path.exists(f"/dev/shm/{name}")


_AS_ANOTHER_USER = textwrap.dedent(
    """
    import os, sys
    from core_engine.kv_transfer import KVTransferConfig, KVTransferError
    from core_engine.kv_transfer.shm import ShmKVReceiver, ShmKVSender
    os.setgid(65533)
    os.setuid(65533)
    config = KVTransferConfig(transport="shm", timeout_s=1)
    ShmKVSender(config)
    receiver = ShmKVReceiver(config)
    print("started")
    try:
        receiver.receive(sys.argv[1], timeout=1)
    except KVTransferError as exc:
        print("refused:", exc)
    """
)


def test_segments_of_other_users_never_crash_a_start_up(segments: list[str]) -> None:
    # A user meets a world-writable dead segment of someone else (which it may open but not
    # unlink: /dev/shm is sticky) and a 0600 one under the name of the transfer it waits for.
    swept = segment_name(f"open-{os.getpid()}")
    transfer_id = f"wanted-{os.getpid()}"
    wanted = segment_name(transfer_id)
    segments.extend([swept, wanted])
    plant_segment(swept, uid=OTHER_UID, mode_bits=0o666)
    plant_segment(wanted, uid=OTHER_UID, mode_bits=0o600, complete=True)
    done = subprocess.run(
        [sys.executable, "-c", _AS_ANOTHER_USER, transfer_id], capture_output=True, text=True,
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "PermissionError" not in done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "started"
    assert lines[1].startswith("refused:") and wanted in lines[1]
    assert os.path.exists(f"/dev/shm/{swept}") and os.path.exists(f"/dev/shm/{wanted}")

