"""GPT-2's reversible byte ↔ printable-character map used by byte-level BPE vocabularies."""

from __future__ import annotations

__all__ = ["BYTE_TO_CHAR", "CHAR_TO_BYTE", "decode_token_text", "encode_bytes"]


def _byte_to_char() -> list[str]:
    # Printable Latin-1 bytes map to themselves; the rest are shifted to U+0100.. so that every
    # byte has a visible, non-whitespace stand-in (b" " -> "Ġ", b"\n" -> "Ċ").
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = [""] * 256
    shifted = 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + shifted)
            shifted += 1
    return table


BYTE_TO_CHAR: list[str] = _byte_to_char()
CHAR_TO_BYTE: dict[str, int] = {char: byte for byte, char in enumerate(BYTE_TO_CHAR)}
_ENCODE_TABLE = {byte: char for byte, char in enumerate(BYTE_TO_CHAR)}


def encode_bytes(text: str) -> str:
    """UTF-8 bytes of ``text`` spelled in the byte-level alphabet (what vocab entries contain)."""
    return text.encode("utf-8").decode("latin-1").translate(_ENCODE_TABLE)


def decode_token_text(token_text: str) -> bytes:
    """Byte-level vocab entry → the bytes it stands for (unmapped characters pass as UTF-8)."""
    out = bytearray()
    for char in token_text:
        byte = CHAR_TO_BYTE.get(char)
        if byte is None:
            out += char.encode("utf-8")
        else:
            out.append(byte)
    return bytes(out)
