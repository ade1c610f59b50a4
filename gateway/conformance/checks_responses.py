"""The Responses API: the response object, the streamed events, ``previous_response_id`` and
``incomplete`` on ``max_output_tokens``.

Written from https://platform.openai.com/docs/api-reference/responses (create, the response
object, retrieve) and /responses-streaming (the event types and ``sequence_number``).
"""

from __future__ import annotations

from typing import Any

from gateway.conformance.expect import (
    data_events,
    expect,
    expect_error_envelope,
    expect_type,
    ok_object,
)
from gateway.conformance.runner import Exchange, Probe, check

REF = "https://platform.openai.com/docs/api-reference"
RESPONSES = "/v1/responses"
STORY = "Write a long story, with many chapters and characters, about a dragon who learns to fly over the wide and stormy sea."


def respond(probe: Probe, **fields: Any) -> tuple[Exchange, dict[str, Any]]:
    body = {"model": probe.model, "input": STORY, "max_output_tokens": 16, "temperature": 0, **fields}
    return ok_object(probe, RESPONSES, body)


def output_text(data: dict[str, Any]) -> str:
    return "".join(
        part.get("text", "")
        for item in data.get("output", [])
        if item.get("type") == "message"
        for part in item.get("content", [])
        if part.get("type") == "output_text"
    )


def expect_response(data: dict[str, Any], exchange: Exchange) -> None:
    expect(data.get("object") == "response", "object must be \"response\"", exchange)
    expect_type(data.get("id"), str, "id", exchange)
    expect_type(data.get("created_at"), (int, float), "created_at", exchange)
    expect(data.get("status") in ("completed", "incomplete"), "status", exchange, offending=data.get("status"))
    output: Any = data.get("output")
    expect(isinstance(output, list) and len(output) >= 1, "output must hold the message item", exchange)
    for i, item in enumerate(output):
        if item.get("type") != "message":
            continue
        expect(item.get("role") == "assistant", f"output[{i}].role must be \"assistant\"", exchange)
        expect_type(item.get("id"), str, f"output[{i}].id", exchange)
        for j, part in enumerate(item.get("content") or []):
            expect(part.get("type") == "output_text" and isinstance(part.get("text"), str), f"output[{i}].content[{j}] must be output_text", exchange, offending=part)
            expect(isinstance(part.get("annotations"), list), f"output[{i}].content[{j}].annotations must be a list", exchange, offending=part)
    usage = data.get("usage") or {}
    for name in ("input_tokens", "output_tokens", "total_tokens"):
        expect_type(usage.get(name), int, f"usage.{name}", exchange)
    expect(usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"], "usage.total_tokens must be input + output", exchange, offending=usage)


@check("responses.body", "responses", f"{REF}/responses/object (object \"response\", status, output[] message with output_text, usage)")
def responses_body(probe: Probe) -> None:
    exchange, data = respond(probe, input="Say hello.", max_output_tokens=64)
    expect_response(data, exchange)


@check("responses.incomplete", "responses", f"{REF}/responses/object#responses/object-incomplete_details (status \"incomplete\", reason \"max_output_tokens\")")
def responses_incomplete(probe: Probe) -> None:
    exchange, data = respond(probe)
    expect_response(data, exchange)
    expect(data.get("status") == "incomplete", "a story cut at max_output_tokens=16 must be status \"incomplete\"", exchange)
    expect((data.get("incomplete_details") or {}).get("reason") == "max_output_tokens", "incomplete_details.reason must be \"max_output_tokens\"", exchange, offending=data.get("incomplete_details"))


@check("responses.stream", "responses", f"{REF}/responses-streaming (typed events, sequence_number from 0, created first, completed/incomplete last)")
def responses_stream(probe: Probe) -> None:
    body = {"model": probe.model, "input": STORY, "max_output_tokens": 16, "temperature": 0, "stream": True}
    exchange = probe.require_ok(probe.stream(RESPONSES, body))
    events = data_events(exchange, done=False)
    for i, (raw, event) in enumerate(zip(exchange.events or [], events, strict=True)):
        expect(event.get("sequence_number") == i, f"event {i}: sequence_number must count from 0", exchange, offending=event)
        if raw.event is not None:
            expect(raw.event == event.get("type"), f"event {i}: the `event:` name must equal data.type", exchange, offending=[raw.event, event.get("type")])
    types = [e.get("type") for e in events]
    expect(types[:2] == ["response.created", "response.in_progress"], "the stream opens with response.created, response.in_progress", exchange, offending=types[:3])
    expect(types[-1] in ("response.completed", "response.incomplete"), "the stream ends with response.completed or response.incomplete", exchange, offending=types[-3:])
    for name in ("response.output_item.added", "response.content_part.added", "response.output_text.done", "response.content_part.done", "response.output_item.done"):
        expect(types.count(name) == 1, f"one {name} for the one message", exchange, offending=types)
    order = [types.index(n) for n in ("response.output_item.added", "response.content_part.added", "response.output_text.done", "response.content_part.done", "response.output_item.done")]
    expect(order == sorted(order), "item added, part added, deltas, text done, part done, item done: in that order", exchange, offending=types)
    deltas = "".join(e["delta"] for e in events if e.get("type") == "response.output_text.delta")
    done = next(e for e in events if e.get("type") == "response.output_text.done")
    expect(deltas == done.get("text"), "the output_text deltas must join to output_text.done's text", exchange, offending=[deltas, done.get("text")])
    final = events[-1].get("response") or {}
    expect(output_text(final) == deltas, "the final response's output_text must be the streamed text", exchange)


@check("responses.previous_response_id", "responses", f"{REF}/responses/create#responses-create-previous_response_id (the stored conversation continues)")
def responses_previous(probe: Probe) -> None:
    first_exchange, first = respond(probe, input="My name is Ada.", max_output_tokens=16)
    exchange = probe.get(f"{RESPONSES}/{first['id']}")
    probe.require_ok(exchange)
    expect(exchange.json().get("id") == first["id"], "GET /v1/responses/{id} returns that response", exchange)
    _, alone = respond(probe, input="What is my name?", max_output_tokens=8)
    exchange, follow = respond(probe, input="What is my name?", max_output_tokens=8, previous_response_id=first["id"])
    expect(follow.get("previous_response_id") == first["id"], "previous_response_id is echoed", exchange)
    expect(follow["usage"]["input_tokens"] > alone["usage"]["input_tokens"], "the follow-up's input must include the stored conversation (more input_tokens than the same input alone)", exchange, offending=[follow["usage"], alone["usage"]])
    missing = probe.post(RESPONSES, {"model": probe.model, "input": "Hi", "max_output_tokens": 16, "previous_response_id": "resp_no_such_conformance"})
    expect_error_envelope(missing, (400, 404))
