"""Server-sent events as OpenAI streams them: ``data: {json}\\n\\n`` ... ``data: [DONE]\\n\\n``."""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["DONE_FRAME", "SSE_HEADERS", "data_frame"]

DONE_FRAME = b"data: [DONE]\n\n"

#: Proxies must not buffer or transform an event stream.
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}

_encoder = msgspec.json.Encoder()


def data_frame(payload: Any) -> bytes:
    """One ``data:`` event holding ``payload`` encoded as JSON."""
    return b"data: " + _encoder.encode(payload) + b"\n\n"
