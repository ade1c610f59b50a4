"""Turning msgspec validation messages into a key path and a readable reason.

msgspec reports ``Expected `int`, got `str` - at `$.server.port``` or
``Object missing required field `kind` - at `$.backends[0]```. Config errors and request
errors both name the offending key, so the parsing lives in one place.
"""

from __future__ import annotations

import re

__all__ = ["split_validation_message"]

_LOCATION = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>[^`]+)`$")


def split_validation_message(message: str) -> tuple[str | None, str]:
    """Return ``(path, reason)``: ``("server.port", "expected `int`, got `str`")``.

    ``path`` is ``None`` when msgspec points at the document root and no field is named.
    Missing and unknown fields are folded into the path (``backends[0].kind``).
    """
    path = ""
    located = _LOCATION.search(message)
    if located is not None:
        path = located.group("path").lstrip(".")
        message = message[: located.start()]
    reason = message
    for pattern, what in ((_MISSING, "missing required key"), (_UNKNOWN, "unknown key")):
        matched = pattern.match(message)
        if matched is not None:
            field = matched.group("field")
            path = f"{path}.{field}" if path else field
            reason = what
            break
    else:
        reason = message[:1].lower() + message[1:]
    return (path or None), reason
