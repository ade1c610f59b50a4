"""Small assertions that turn a broken contract into :class:`CheckFailed` with evidence.

Each takes the exchange the value came from, so the evidence is always the request and the
answer, with the offending field or chunk named first.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.conformance.runner import CheckFailed, Exchange, NotApplicable, Probe, SseEvent

__all__ = [
    "data_events",
    "expect",
    "expect_error_envelope",
    "expect_type",
    "expect_usage",
    "greedy",
    "ok_object",
    "stop_string_of",
]

_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", list: "an array",
               dict: "an object", bool: "a boolean", type(None): "null"}


def expect(condition: bool, what: str, exchange: Exchange | None = None, *, offending: Any = None) -> None:
    """Fail with ``what`` (and the offending value, then the exchange) unless ``condition``."""
    if condition:
        return
    lines = [what]
    if offending is not None:
        lines.append(f"offending: {json.dumps(offending)[:800]}")
    if exchange is not None:
        lines.append(str(exchange))
    raise CheckFailed("\n".join(lines))


def expect_type(value: Any, types: type | tuple[type, ...], field: str, exchange: Exchange) -> None:
    """``value`` (the field ``field``) is of ``types`` (bool is never an int)."""
    allowed = types if isinstance(types, tuple) else (types,)
    ok = isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed)
    names = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in allowed)
    expect(ok, f"{field} must be {names}, got {json.dumps(value)[:200]}", exchange)


def ok_object(probe: Probe, path: str, body: dict[str, Any]) -> tuple[Exchange, dict[str, Any]]:
    """POST ``body`` to ``path``: the exchange and its JSON object (n/a on a missing route,
    a failure when the status is not 200 or the body not an object)."""
    exchange = probe.require_ok(probe.post(path, body))
    data = exchange.json()
    expect_type(data, dict, "the body", exchange)
    return exchange, data


def expect_usage(usage: Any, exchange: Exchange, *, field: str = "usage") -> None:
    """OpenAI's ``usage``: integer counts with ``total_tokens`` their sum."""
    expect_type(usage, dict, field, exchange)
    for name in ("prompt_tokens", "completion_tokens", "total_tokens"):
        expect_type(usage.get(name), int, f"{field}.{name}", exchange)
        expect(usage[name] >= 0, f"{field}.{name} is negative", exchange)
    expect(
        usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"],
        f"{field}.total_tokens is not prompt_tokens + completion_tokens",
        exchange,
        offending=usage,
    )
    expect(usage["prompt_tokens"] > 0, f"{field}.prompt_tokens is 0 for a non-empty prompt", exchange)


def expect_error_envelope(exchange: Exchange, status: int | tuple[int, ...]) -> dict[str, Any]:
    """OpenAI's error body ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""
    statuses = status if isinstance(status, tuple) else (status,)
    expect(exchange.status in statuses, f"expected status {' or '.join(map(str, statuses))}", exchange)
    body = exchange.error_body()
    error = body.get("error")
    expect(isinstance(error, dict), "the body has no `error` object", exchange)
    assert isinstance(error, dict)
    expect_type(error.get("message"), str, "error.message", exchange)
    expect(bool(error["message"]), "error.message is empty", exchange)
    expect_type(error.get("type"), str, "error.type", exchange)
    for key in ("param", "code"):
        expect(key in error, f"error.{key} is missing (it is null when it does not apply)", exchange)
        expect_type(error[key], (str, type(None)), f"error.{key}", exchange)
    return error


def data_events(exchange: Exchange, *, done: bool = True) -> list[Any]:
    """The JSON of each ``data:`` event; with ``done``, the stream must end with ``[DONE]``
    (and only there)."""
    events: list[SseEvent] = exchange.events or []
    expect(bool(events), "the stream carried no events", exchange)
    payloads = []
    for i, event in enumerate(events):
        if event.data == "[DONE]":
            expect(done, "a `data: [DONE]` in a stream that does not end with one", exchange)
            expect(i == len(events) - 1, "events after `data: [DONE]`", exchange)
            continue
        try:
            payloads.append(json.loads(event.data))
        except ValueError:
            raise CheckFailed(f"event {i} is not JSON: {event.data[:300]}\n{exchange}") from None
    if done:
        expect(events[-1].data == "[DONE]", "the stream does not end with `data: [DONE]`", exchange)
    return payloads


def stop_string_of(text: str) -> str:
    """A stop string that occurs in ``text`` after its first character (for stop checks)."""
    stripped = text.rstrip()
    if len(stripped) < 6:
        raise NotApplicable(f"the greedy answer is too short to take a stop string from: {text!r}")
    middle = len(stripped) // 2
    candidate = stripped[middle : middle + 3]
    if not candidate.strip():
        candidate = stripped[middle - 2 : middle + 1]
    return candidate


def greedy(probe: Probe, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with deterministic sampling: temperature 0 and a fixed seed."""
    return {"model": probe.model, "temperature": 0, "seed": 7, **body}
