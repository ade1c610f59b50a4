"""One KV block as a file: its name, its header, its validation, and the model fingerprint.

A block file is a 68-byte header, then the payload (the block's raw bytes)::

    magic        8s   b"IMXKVBLK"
    version      u32  FORMAT_VERSION (little-endian, as every field)
    fingerprint  16s  model_fingerprint() of the model (and KV layout) that filled the block
    file id      16s  block_file_id() of the block's chained prefix hash; must equal the name
    length       u64  payload bytes; must equal the block size and the rest of the file
    mac          16s  keyed blake2b of the header fields above, the block hash and the payload

Both the file id (the file's name: ``<file id hex>.kv``) and the MAC are keyed with the
installation's secret (:func:`core_engine.private_files.installation_secret`): without it a
prompt guessed by another user cannot be confirmed from a directory listing (an unkeyed hash
of its tokens would name its file), and a file made elsewhere never passes as a block, even
one under the right name.

:func:`read_block_file` returns a payload only when every field matches what the reader
expects and the MAC agrees: a torn or truncated file, flipped bits, a file from another model,
one renamed or copied in under another block's name, or one written with another secret never
pass as data.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

__all__ = [
    "DIGEST_NBYTES",
    "FORMAT_VERSION",
    "HEADER_NBYTES",
    "block_file_id",
    "encode_header",
    "model_fingerprint",
    "read_block_file",
]

FORMAT_VERSION = 2  # 1: unkeyed names (the block hash) and an unkeyed checksum
DIGEST_NBYTES = 16  # block hashes, fingerprints, file ids and MACs alike
_MAGIC = b"IMXKVBLK"
# magic, version, fingerprint, file id, payload length (what the MAC covers first)
_FIELDS = struct.Struct("<8sI16s16sQ")
_HEADER = struct.Struct(_FIELDS.format + "16s")  # ... then the MAC
HEADER_NBYTES = _HEADER.size

_MiB = 1 << 20
_NUM_SAMPLES = 62
_SAMPLE_NBYTES = 64 << 10


def model_fingerprint(model_path: str | os.PathLike[str], *, extra: str = "") -> bytes:
    """16 bytes that tell one model file (plus ``extra``) from another, cheaply.

    blake2b over the file size, the first and last MiB, 62 evenly spaced 64 KiB samples in
    between (the whole file when it is not larger than that) and ``extra``, in which the
    engine puts whatever else shapes a KV block (KV dtype, block size, layer and head shape,
    its layout version). About 6 MiB are read whatever the file's size, so a multi-GB file
    costs milliseconds. Two files that differ only outside the samples get the same
    fingerprint; another model (another size, header or weights) does not. Raises
    ``OSError`` when the file cannot be read. A Hugging Face checkpoint directory is
    fingerprinted by its ``*.json`` and ``*.safetensors`` files.
    """
    if os.path.isdir(model_path):  # a checkpoint directory: its config and weight files, in order
        from pathlib import Path

        files = sorted(p for p in Path(model_path).iterdir() if p.suffix in (".json", ".safetensors") and p.is_file())
        parts = b"".join(p.name.encode() + model_fingerprint(p) for p in files)
        return hashlib.blake2b(parts + extra.encode(), digest_size=DIGEST_NBYTES, person=b"infermux-kv-fp").digest()
    digest = hashlib.blake2b(digest_size=DIGEST_NBYTES, person=b"infermux-kv-fp")
    with open(model_path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(size.to_bytes(8, "little"))
        if size <= 2 * _MiB + _NUM_SAMPLES * _SAMPLE_NBYTES:
            while chunk := f.read(_MiB):
                digest.update(chunk)
        else:
            digest.update(f.read(_MiB))
            first, last = _MiB, size - _MiB - _SAMPLE_NBYTES  # sample offsets, both included
            for i in range(_NUM_SAMPLES):
                f.seek(first + (last - first) * i // (_NUM_SAMPLES - 1))
                digest.update(f.read(_SAMPLE_NBYTES))
            f.seek(size - _MiB)
            digest.update(f.read(_MiB))
    digest.update(extra.encode())
    return digest.digest()


def block_file_id(secret: bytes, block_hash: bytes) -> bytes:
    """The 16 bytes that name ``block_hash``'s file (``<hex>.kv``): a hash keyed by ``secret``."""
    return hashlib.blake2b(
        block_hash, key=secret, digest_size=DIGEST_NBYTES, person=b"infermux-kv-name"
    ).digest()


def _mac(secret: bytes, fields: bytes, block_hash: bytes, payload: bytes | memoryview) -> bytes:
    mac = hashlib.blake2b(fields, key=secret, digest_size=DIGEST_NBYTES, person=b"infermux-kv-mac")
    mac.update(block_hash)
    mac.update(payload)
    return mac.digest()


def encode_header(secret: bytes, fingerprint: bytes, block_hash: bytes, payload: bytes) -> bytes:
    """The header to write before ``payload`` (MAC'ed here: ``payload`` must be final)."""
    fields = _FIELDS.pack(
        _MAGIC, FORMAT_VERSION, fingerprint, block_file_id(secret, block_hash), len(payload)
    )
    return fields + _mac(secret, fields, block_hash, payload)


def read_block_file(
    path: str, *, secret: bytes, fingerprint: bytes, block_hash: bytes, payload_nbytes: int
) -> tuple[bytes | None, str]:
    """``(payload, "")`` for a valid file, else ``(None, what is wrong)``; never raises.

    The file is opened without following a symbolic link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with open(fd, "rb") as f:
            header = f.read(HEADER_NBYTES)
            if len(header) != HEADER_NBYTES:
                return None, "truncated header"
            magic, version, stored_fingerprint, stored_id, length, mac = _HEADER.unpack(header)
            if magic != _MAGIC or version != FORMAT_VERSION:
                return None, f"not a block file of format version {FORMAT_VERSION}"
            if stored_fingerprint != fingerprint:
                return None, f"written for another model (fingerprint {stored_fingerprint.hex()})"
            if stored_id != block_file_id(secret, block_hash):
                return None, f"holds block file {stored_id.hex()}"
            if length != payload_nbytes:
                return None, f"payload length {length}, expected {payload_nbytes}"
            payload = f.read(length)
            if len(payload) != length:
                return None, "truncated payload"
            if f.read(1):
                return None, "trailing bytes"
    except OSError as exc:  # missing (deleted behind the reader's back), a link, or unreadable
        return None, str(exc)
    expected = _mac(secret, header[: _FIELDS.size], block_hash, payload)
    if not hmac.compare_digest(expected, mac):
        return None, "MAC mismatch (changed, or written with another secret)"
    return payload, ""
