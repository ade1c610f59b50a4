"""Directories and files that only this user may touch: the KV disk tier, the kernel cache, the
usage ledger and stored responses.

On a shared machine another user must not read what these hold (a KV block's layer-0 keys and
values give its prompt back), replace it (a block loaded as a cache hit, a ``.so`` executed) or
redirect a write through a symbolic link. So:

- A directory is created ``0700``. An existing one must be owned by this process's effective
  user and closed to group and other: every access for *confidential* data, write access at
  least for the rest (a kernel cache may stay world-readable). Anything else raises
  :class:`UnsafePathError`, whose message names the path and the fix: the data is never put
  in, or taken from, a directory someone else controls.
- A file is created ``0600`` with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (:func:`create_exclusive`):
  never through a link, never an existing file, whoever planted it.
- :func:`installation_secret` keeps the 32 random bytes that key the KV disk tier's file names
  and MACs; the first process to need it creates it, ``0600``, once.

Checks follow a symbolic link given as the directory itself (a cache moved to another disk is
a normal setup) and judge its target. :class:`UnsafePathError` is a :class:`PermissionError`,
so callers that already turn an ``OSError`` into "cannot use <path>" report it unchanged.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import secrets
import stat
from pathlib import Path

__all__ = [
    "SECRET_NBYTES",
    "UnsafePathError",
    "check_owned_file",
    "create_exclusive",
    "installation_secret",
    "private_dir",
    "private_file",
    "record_sha256",
    "unverified_reason",
    "write_private_file",
]

logger = logging.getLogger(__name__)

SECRET_NBYTES = 32

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class UnsafePathError(PermissionError):
    """A directory or file that others own or may change; the message says which and why."""


def private_dir(path: str | os.PathLike[str], *, confidential: bool = True) -> Path:
    """``path``, created ``0700`` if missing, after checking that only this user controls it.

    ``confidential``: refuse any group/other permission bit (else only write bits). Missing
    parents are created as the umask says (only the last folder holds the data). Raises
    :class:`UnsafePathError`, or ``OSError`` when it cannot be created.
    """
    directory = Path(path)
    if not directory.exists():
        directory.parent.mkdir(parents=True, exist_ok=True)
        try:
            directory.mkdir(mode=0o700)
            os.chmod(directory, 0o700)  # mkdir's mode is filtered by the umask; this is exact
        except FileExistsError:  # another process made it first: checked below like any other
            pass
    st = os.stat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(directory))
    _check_owner(directory, st)
    mode = stat.S_IMODE(st.st_mode)
    if confidential and mode & 0o077:
        raise UnsafePathError(
            f"{directory} has mode {mode:04o}: group or other users may reach what it holds; "
            f"refusing to use it (run `chmod 700 {directory}`)"
        )
    if mode & 0o022:
        raise UnsafePathError(
            f"{directory} has mode {mode:04o}: group or other users may plant files in it; "
            f"refusing to use it (run `chmod go-w {directory}`)"
        )
    return directory


def create_exclusive(path: str | os.PathLike[str]) -> int:
    """A new file ``0600`` opened for writing; ``FileExistsError`` when anything is there
    (a symbolic link included: it is never followed)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)


def check_owned_file(path: str | os.PathLike[str], st: os.stat_result, *, confidential: bool) -> None:
    """Raise :class:`UnsafePathError` unless ``st`` (an ``lstat``/``fstat``) is a regular file of
    this user that group and other cannot write (``confidential``: nor read)."""
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePathError(f"{path} is not a regular file (a link?); refusing to use it")
    _check_owner(path, st)
    if st.st_mode & (0o077 if confidential else 0o022):
        raise UnsafePathError(
            f"{path} has mode {stat.S_IMODE(st.st_mode):04o}, open to group or other users; "
            f"refusing to use it"
        )


def private_file(path: str | os.PathLike[str]) -> Path:
    """``path``, created empty ``0600`` if missing; an existing one must be a regular file of
    this user (a link or another owner raises :class:`UnsafePathError`) and is narrowed to
    ``0600`` if it was wider (a file of an older version).

    For files another library then opens by name (SQLite): its journal files take this file's
    mode, and its folder should come from :func:`private_dir`.
    """
    file = Path(path)
    try:
        os.close(create_exclusive(file))
        return file
    except FileExistsError:
        pass
    fd = _open_nofollow(file, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{file} is not a regular file; refusing to use it")
        _check_owner(file, st)
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o600)
            logger.info("%s was mode %04o: narrowed to 0600", file, stat.S_IMODE(st.st_mode))
    finally:
        os.close(fd)
    return file


def write_private_file(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically: a new ``0600`` temporary file beside it
    (``O_EXCL | O_NOFOLLOW``), then ``os.replace``."""
    file = Path(path)
    tmp = file.with_name(f"{file.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = create_exclusive(tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, file)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _sha256_record(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def record_sha256(path: str | os.PathLike[str]) -> None:
    """Write ``<path>.sha256`` (``0600``): the SHA-256 of the library just built at ``path``,
    which :func:`unverified_reason` checks before each load."""
    file = Path(path)
    write_private_file(_sha256_record(file), hashlib.sha256(file.read_bytes()).hexdigest().encode() + b"\n")


def _read_owned(path: Path) -> bytes:
    with open(_open_nofollow(path, os.O_RDONLY), "rb") as f:
        check_owned_file(path, os.fstat(f.fileno()), confidential=False)
        return f.read()


def unverified_reason(path: str | os.PathLike[str]) -> str | None:
    """Why the library at ``path`` must not be loaded as it is: missing, no record, or a
    SHA-256 other than the one :func:`record_sha256` wrote (rebuild it); None when it is the
    library this user built, unchanged. Raises :class:`UnsafePathError` (or ``OSError``
    ``ELOOP`` for a link) when it or its record is someone else's: never load nor replace it."""
    file = Path(path)
    try:
        library = _read_owned(file)
        recorded = _read_owned(_sha256_record(file)).decode(errors="replace").strip()
    except FileNotFoundError as exc:
        return f"{exc.filename} is missing"
    digest = hashlib.sha256(library).hexdigest()
    if digest != recorded:
        return f"its SHA-256 {digest} is not the one recorded at its build ({recorded[:64]})"
    return None


def installation_secret(path: str | os.PathLike[str]) -> bytes:
    """The :data:`SECRET_NBYTES` random bytes kept at ``path``, created ``0600`` on first use.

    Two processes starting together agree on one secret (the file appears whole, by
    ``os.link``, and never replaces another). A file that is a link, of another owner, open
    to group/other or not exactly :data:`SECRET_NBYTES` long raises :class:`UnsafePathError`.
    """
    file = Path(path)
    try:
        fd = _open_nofollow(file, os.O_RDONLY)
    except FileNotFoundError:
        tmp = file.with_name(f"{file.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        with os.fdopen(create_exclusive(tmp), "wb") as f:
            f.write(secrets.token_bytes(SECRET_NBYTES))
        try:
            os.link(tmp, file)
        except FileExistsError:  # another process won: use its secret
            pass
        finally:
            tmp.unlink(missing_ok=True)
        fd = _open_nofollow(file, os.O_RDONLY)
    try:
        check_owned_file(file, os.fstat(fd), confidential=True)
        data = os.read(fd, SECRET_NBYTES + 1)
    finally:
        os.close(fd)
    if len(data) != SECRET_NBYTES:
        raise UnsafePathError(
            f"{file} holds {len(data)} bytes, not a {SECRET_NBYTES}-byte secret; refusing it "
            f"(delete it to make a new one: what it authenticated is then dropped)"
        )
    return data


def _open_nofollow(path: Path, flags: int) -> int:
    try:
        return os.open(path, flags | _NOFOLLOW | _CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(f"{path} is a symbolic link; refusing to follow it") from exc
        raise


def _check_owner(path: str | os.PathLike[str], st: os.stat_result) -> None:
    if st.st_uid != os.geteuid():
        raise UnsafePathError(
            f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}); "
            f"refusing to use it"
        )
