"""Decoding a backend's ``options`` table into its own Struct, naming bad keys."""

from __future__ import annotations

import re
from typing import TypeVar

import msgspec

from backends.base import BackendConfig

__all__ = ["BackendOptionError", "decode_options"]

T = TypeVar("T")

_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `(?P<field>[^`]+)`")
_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")


class BackendOptionError(ValueError):
    """A backend's ``options`` table is invalid; the message names ``backends.<name>.options.<key>``."""


def decode_options(config: BackendConfig, options_type: type[T]) -> T:
    """Convert ``config.options`` into ``options_type`` (a Struct that forbids unknown fields)."""
    try:
        return msgspec.convert(config.options, options_type, strict=False)
    except msgspec.ValidationError as exc:
        raise BackendOptionError(_describe(config, str(exc))) from exc


def _describe(config: BackendConfig, message: str) -> str:
    prefix = f"backends.{config.name}.options"
    unknown = _UNKNOWN_FIELD.search(message)
    located = _PATH.search(message)
    if unknown is not None:
        # A nested table's unknown key comes with its path: ``... - at `$.speculation```.
        parent = located.group("path").lstrip(".") + "." if located is not None and located.group("path") else ""
        return f"{prefix}.{parent}{unknown.group('field')}: unknown option for kind {config.kind!r}"
    if located is not None:
        key = located.group("path").lstrip(".")
        reason = message[: located.start()]
        return f"{prefix}.{key}: {reason}" if key else f"{prefix}: {reason}"
    return f"{prefix}: {message}"
