"""A GGUF file's key/values and tensor records, read in one pass over its header.

``gguf.GGUFReader`` (gguf-py, llama.cpp's own Python package) builds a numpy view for every
part of every field: on a vocabulary of 49k tokens that is ~500k small memmap slices, 2.06 s
for SmolLM2-135M (30 s for Gemma 4's 262k-token vocabulary), and the engine opened each file
twice. :func:`read_gguf` reads the same header with ``struct`` and one bulk ``np.frombuffer``
per numeric array, 0.04 s for the metadata of the same file (docs/benchmarks.md, "Model
load"), and gives each tensor the record ``GGUFReader`` would (same name, type, shape in GGUF
order, element and byte counts, and a read-only memmap view of its data in the same dtype and
shape). gguf-py stays the library for everything else: its type table, block sizes and byte
shapes, dequantization, and writing files.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

__all__ = ["GGUFIndex", "TensorRecord", "read_gguf", "read_gguf_metadata"]

# GGUF value types: numpy dtype (little-endian) of the scalar ones; 8 = string, 9 = array.
_DTYPES = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8",
}
_STRING, _ARRAY, _BOOL = 8, 9, 7
_DEFAULT_ALIGNMENT = 32

#: Tensor types stored as plain numbers: their data view has this dtype and the tensor's shape.
_PLAIN: dict[GGMLQuantizationType, type[np.generic]] = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """One tensor, as ``gguf.ReaderTensor`` describes it."""

    name: str
    tensor_type: GGMLQuantizationType
    #: Dimensions in GGUF order (``ne0`` first: a weight of torch shape (out, in) is [in, out]).
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    #: Byte offset of the data in the file.
    data_offset: int
    #: The raw data, memory-mapped read-only: numbers for plain types (torch order), else
    #: bytes shaped (rows..., bytes per row) as ``quant_shape_to_byte_shape`` gives.
    data: np.ndarray


@dataclass(frozen=True, slots=True)
class GGUFIndex:
    """Everything in a GGUF file's header."""

    version: int
    metadata: dict[str, Any]
    tensors: list[TensorRecord]
    alignment: int
    #: Where the tensor data section starts.
    data_offset: int


class _Header:
    """A cursor over the header bytes; ``ValueError`` (with the byte offset) on bad input."""

    def __init__(self, buf: Any) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (size,) = self.unpack("<Q")
        if self.pos + size > len(self.buf):
            raise ValueError(f"a string of {size} bytes runs past the end of the file")
        self.pos += size
        return bytes(self.buf[self.pos - size : self.pos]).decode("utf-8")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.unpack("<IQ")
            if item_kind in _DTYPES:
                dtype = np.dtype(_DTYPES[item_kind])
                items = np.frombuffer(self.buf, dtype, count, self.pos)
                self.pos += dtype.itemsize * count
                return [bool(x) for x in items] if item_kind == _BOOL else items.tolist()
            return [self.value(item_kind) for _ in range(count)]
        dtype = np.dtype(_DTYPES[kind])  # KeyError for an unknown type
        scalar = np.frombuffer(self.buf, dtype, 1, self.pos)[0].item()
        self.pos += dtype.itemsize
        return bool(scalar) if kind == _BOOL else scalar

    def metadata(self, count: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for _ in range(count):
            key = self.string()
            (kind,) = self.unpack("<I")
            out[key] = self.value(kind)
        return out


def _open_header(buf: Any, path: str | Path) -> tuple[_Header, int, int, int]:
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (no GGUF magic)")
    header = _Header(buf)
    header.pos = 4
    version, n_tensors, n_kv = header.unpack("<IQQ")
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported")
    return header, version, n_tensors, n_kv


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All key/values of a GGUF file (version 2 or 3) as Python values: strings, numbers,
    bools and lists, as ``gguf.GGUFReader``'s ``field.contents()`` gives them."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        header, _, _, n_kv = _open_header(buf, path)
        try:
            return header.metadata(n_kv)
        except (KeyError, struct.error, ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: malformed GGUF metadata at byte {header.pos}: {exc}") from exc


def read_gguf(path: str | Path) -> GGUFIndex:
    """The key/values and tensor records of the GGUF file at ``path`` (``ValueError`` naming
    the byte offset for a file that is not GGUF or is cut short)."""
    # The header through mmap (slicing bytes is cheap; slicing a np.memmap builds a memmap
    # object per string), the tensor data as np.memmap views.
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        header, version, n_tensors, n_kv = _open_header(buf, path)
        try:
            metadata = header.metadata(n_kv)
            infos = []
            for _ in range(n_tensors):
                name = header.string()
                (n_dims,) = header.unpack("<I")
                dims = np.array(struct.unpack_from(f"<{n_dims}Q", buf, header.pos), dtype=np.uint64)
                header.pos += 8 * n_dims
                raw_type, offset = header.unpack("<IQ")
                infos.append((name, dims, GGMLQuantizationType(raw_type), offset))
        except (KeyError, struct.error, ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: malformed GGUF header at byte {header.pos}: {exc}") from exc
        header_end = header.pos
    data = np.memmap(path, dtype=np.uint8, mode="r")
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{path}: general.alignment = {alignment} is not a power of two")
    start = -(-header_end // alignment) * alignment
    tensors: list[TensorRecord] = []
    seen: set[str] = set()
    for name, dims, ggml_type, offset in infos:
        if name in seen:
            raise ValueError(f"{path}: tensor {name} appears twice")
        seen.add(name)
        n_elements = int(np.prod(dims))
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        n_bytes = n_elements * type_size // block_size
        begin = start + int(offset)
        if begin + n_bytes > len(data):
            raise ValueError(f"{path}: tensor {name} runs past the end of the file")
        torch_order = tuple(reversed(dims.tolist()))
        plain = _PLAIN.get(ggml_type)
        if plain is not None:
            view = data[begin : begin + n_bytes].view(plain).reshape(torch_order)
        else:
            view = data[begin : begin + n_bytes].reshape(quant_shape_to_byte_shape(torch_order, ggml_type))
        tensors.append(TensorRecord(name, ggml_type, dims, n_elements, n_bytes, begin, view))
    return GGUFIndex(version, metadata, tensors, alignment, start)
