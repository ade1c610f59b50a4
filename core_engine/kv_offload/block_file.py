"""One KV block as a file: its header, its validation, and the model fingerprint it carries.

A block file is a 68-byte header, then the payload (the block's raw bytes)::

    magic        8s   b"IMXKVBLK"
    version      u32  FORMAT_VERSION (little-endian, as every field)
    fingerprint  16s  model_fingerprint() of the model (and KV layout) that filled the block
    block hash   16s  the block's chained prefix hash; must equal the file's name
    length       u64  payload bytes; must equal the block size and the rest of the file
    checksum     16s  blake2b (digest_size=16) of the payload

:func:`read_block_file` returns a payload only when every field matches what the reader
expects and the checksum agrees: a torn or truncated file, flipped bits, a file from another
model or one renamed or copied in under another block's name never pass as data.
"""

from __future__ import annotations

import hashlib
import os
import struct

__all__ = [
    "DIGEST_NBYTES",
    "FORMAT_VERSION",
    "HEADER_NBYTES",
    "encode_header",
    "model_fingerprint",
    "read_block_file",
]

FORMAT_VERSION = 1
DIGEST_NBYTES = 16  # block hashes, fingerprints and checksums alike
_MAGIC = b"IMXKVBLK"
# magic, version, fingerprint, block hash, payload length, payload checksum
_HEADER = struct.Struct("<8sI16s16sQ16s")
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


def encode_header(fingerprint: bytes, block_hash: bytes, payload: bytes) -> bytes:
    """The header to write before ``payload`` (checksummed here: ``payload`` must be final)."""
    checksum = hashlib.blake2b(payload, digest_size=DIGEST_NBYTES).digest()
    return _HEADER.pack(_MAGIC, FORMAT_VERSION, fingerprint, block_hash, len(payload), checksum)


def read_block_file(
    path: str, *, fingerprint: bytes, block_hash: bytes, payload_nbytes: int
) -> tuple[bytes | None, str]:
    """``(payload, "")`` for a valid file, else ``(None, what is wrong)``; never raises."""
    try:
        with open(path, "rb") as f:
            header = f.read(HEADER_NBYTES)
            if len(header) != HEADER_NBYTES:
                return None, "truncated header"
            magic, version, stored_fingerprint, stored_hash, length, checksum = _HEADER.unpack(
                header
            )
            if magic != _MAGIC or version != FORMAT_VERSION:
                return None, f"not a block file of format version {FORMAT_VERSION}"
            if stored_fingerprint != fingerprint:
                return None, f"written for another model (fingerprint {stored_fingerprint.hex()})"
            if stored_hash != block_hash:
                return None, f"holds block {stored_hash.hex()}"
            if length != payload_nbytes:
                return None, f"payload length {length}, expected {payload_nbytes}"
            payload = f.read(length)
            if len(payload) != length:
                return None, "truncated payload"
            if f.read(1):
                return None, "trailing bytes"
    except OSError as exc:  # missing (deleted behind the reader's back) or unreadable
        return None, str(exc)
    if hashlib.blake2b(payload, digest_size=DIGEST_NBYTES).digest() != checksum:
        return None, "checksum mismatch"
    return payload, ""
