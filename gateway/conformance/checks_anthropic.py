"""Anthropic Messages: the body, stop reasons, the exact streamed event order, count_tokens
and the error envelope.

Written from https://docs.anthropic.com/en/api/messages (the message object),
/en/docs/build-with-claude/streaming (the event flow), /en/api/messages-count-tokens and
/en/api/errors.
"""

from __future__ import annotations

from typing import Any

from gateway.conformance.expect import expect, expect_type, ok_object, stop_string_of
from gateway.conformance.runner import Exchange, Probe, check

REF = "https://docs.anthropic.com/en"
MESSAGES = "/v1/messages"
STORY = [{"role": "user", "content": "Write a long story, with many chapters and characters, about a dragon who learns to fly over the wide and stormy sea."}]
STOP_REASONS = ("end_turn", "max_tokens", "stop_sequence", "tool_use", "pause_turn", "refusal")


def message(probe: Probe, **fields: Any) -> tuple[Exchange, dict[str, Any]]:
    body = {"model": probe.model, "max_tokens": 16, "messages": STORY, "temperature": 0, **fields}
    return ok_object(probe, MESSAGES, body)


def _text(data: dict[str, Any]) -> str:
    return "".join(block.get("text", "") for block in data.get("content", []) if block.get("type") == "text")


@check("anthropic.body", "anthropic", f"{REF}/api/messages (id, type \"message\", role, content[], model, stop_reason, stop_sequence, usage)")
def anthropic_body(probe: Probe) -> None:
    exchange, data = message(probe)
    expect(data.get("type") == "message", "type must be \"message\"", exchange)
    expect(data.get("role") == "assistant", "role must be \"assistant\"", exchange)
    expect_type(data.get("id"), str, "id", exchange)
    expect_type(data.get("model"), str, "model", exchange)
    content: Any = data.get("content")
    expect(isinstance(content, list) and len(content) >= 1, "content must hold the answer's blocks", exchange)
    for i, block in enumerate(content):
        expect(block.get("type") == "text" and isinstance(block.get("text"), str), f"content[{i}] must be a text block", exchange, offending=block)
    expect(data.get("stop_reason") in STOP_REASONS, "stop_reason", exchange, offending=data.get("stop_reason"))
    expect("stop_sequence" in data and data["stop_sequence"] is None, "stop_sequence must be null unless one matched", exchange)
    usage = data.get("usage") or {}
    expect_type(usage.get("input_tokens"), int, "usage.input_tokens", exchange)
    expect_type(usage.get("output_tokens"), int, "usage.output_tokens", exchange)
    expect(usage["output_tokens"] <= 16, "usage.output_tokens exceeds max_tokens", exchange)


@check("anthropic.max_tokens", "anthropic", f"{REF}/api/messages#response-stop-reason (\"max_tokens\" at the limit)")
def anthropic_max_tokens(probe: Probe) -> None:
    exchange, data = message(probe, max_tokens=3)
    expect(data.get("stop_reason") == "max_tokens", "stop_reason must be \"max_tokens\"", exchange)
    expect((data.get("usage") or {}).get("output_tokens") == 3, "usage.output_tokens must be 3", exchange)


@check("anthropic.stop_sequences", "anthropic", f"{REF}/api/messages#body-stop-sequences (stop_reason \"stop_sequence\", stop_sequence the match)")
def anthropic_stop_sequences(probe: Probe) -> None:
    _, first = message(probe, max_tokens=24)
    text = _text(first)
    stop = stop_string_of(text)
    exchange, data = message(probe, max_tokens=24, stop_sequences=[stop])
    expected = text[: text.index(stop)]
    expect(_text(data) == expected, f"the text must stop before the stop sequence ({expected!r})", exchange, offending=_text(data))
    expect(data.get("stop_reason") == "stop_sequence", "stop_reason must be \"stop_sequence\"", exchange)
    expect(data.get("stop_sequence") == stop, "stop_sequence must be the matched sequence", exchange)


@check("anthropic.stream.order", "anthropic", f"{REF}/docs/build-with-claude/streaming#event-types (message_start, blocks start/delta/stop, message_delta, message_stop)")
def anthropic_stream_order(probe: Probe) -> None:
    body = {"model": probe.model, "max_tokens": 8, "messages": STORY, "temperature": 0, "stream": True}
    exchange = probe.require_ok(probe.stream(MESSAGES, body))
    events = exchange.events or []
    payloads = []
    for i, event in enumerate(events):
        data = event.json()
        expect(event.event == data.get("type"), f"event {i}: the `event:` name must equal data.type", exchange, offending=[event.event, data.get("type")])
        payloads.append(data)
    types = [p["type"] for p in payloads if p["type"] != "ping"]
    expect(bool(types) and types[0] == "message_start", "the first event must be message_start", exchange, offending=types)
    expect(types[-2:] == ["message_delta", "message_stop"], "the stream must end with message_delta then message_stop", exchange, offending=types)
    start = payloads[0]["message"]
    expect(start.get("type") == "message" and start.get("content") == [], "message_start.message: an empty message", exchange, offending=start)
    open_index: int | None = None
    next_index = 0
    for data in payloads:
        kind, index = data["type"], data.get("index")
        if kind == "content_block_start":
            expect(open_index is None and index == next_index, "content_block_start opens the next index after the previous block stopped", exchange, offending=data)
            open_index = index
        elif kind == "content_block_delta":
            expect(index == open_index, "content_block_delta belongs to the open block", exchange, offending=data)
        elif kind == "content_block_stop":
            expect(index == open_index, "content_block_stop closes the open block", exchange, offending=data)
            open_index, next_index = None, next_index + 1
        elif kind in ("message_delta", "message_stop"):
            expect(open_index is None, f"{kind} while a block is open", exchange, offending=data)
    expect(next_index >= 1, "the answer must have at least one content block", exchange, offending=types)
    delta = next(p for p in payloads if p["type"] == "message_delta")
    expect(delta.get("delta", {}).get("stop_reason") in STOP_REASONS, "message_delta.delta.stop_reason", exchange, offending=delta)
    expect_type((delta.get("usage") or {}).get("output_tokens"), int, "message_delta.usage.output_tokens", exchange)


@check("anthropic.count_tokens", "anthropic", f"{REF}/api/messages-count-tokens (input_tokens: what the message would use)")
def anthropic_count_tokens(probe: Probe) -> None:
    request = probe.post(f"{MESSAGES}/count_tokens", {"model": probe.model, "messages": STORY})
    exchange = probe.require_ok(request, lacking=("tokenizer",))
    counted = exchange.json().get("input_tokens")
    expect_type(counted, int, "input_tokens", exchange)
    _, data = message(probe, max_tokens=2)
    usage = data.get("usage") or {}
    used = usage.get("input_tokens", 0) + (usage.get("cache_read_input_tokens") or 0) + (usage.get("cache_creation_input_tokens") or 0)
    expect(counted == used, f"input_tokens must equal the message's input usage ({used})", exchange, offending=counted)


def _anthropic_error(probe: Probe, body: Any, status: int, error_type: str, raw: str | None = None) -> None:
    exchange = probe.post(MESSAGES, body, raw=raw)
    expect(exchange.status == status, f"expected status {status}", exchange)
    data = exchange.error_body()
    expect(data.get("type") == "error", "the body's type must be \"error\"", exchange)
    error = data.get("error") or {}
    expect(error.get("type") == error_type, f"error.type must be \"{error_type}\"", exchange)
    expect_type(error.get("message"), str, "error.message", exchange)


@check("anthropic.errors", "anthropic", f"{REF}/api/errors ({{\"type\": \"error\", \"error\": {{type, message}}}}: 400 invalid_request_error, 404 not_found_error)")
def anthropic_errors(probe: Probe) -> None:
    message(probe, max_tokens=1)  # n/a where the route is not served at all
    _anthropic_error(probe, {"model": probe.model, "messages": STORY}, 400, "invalid_request_error")
    _anthropic_error(probe, {"model": probe.model, "max_tokens": 8, "messages": "Hi"}, 400, "invalid_request_error")
    _anthropic_error(probe, None, 400, "invalid_request_error", raw='{"model": ')
    _anthropic_error(probe, {"model": "no-such-model-conformance", "max_tokens": 8, "messages": STORY}, 404, "not_found_error")
