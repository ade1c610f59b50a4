"""Traces as an operator sees them in a trace viewer: the span tree and its attributes.

A live gateway on loopback; its tracing plugin exports to an in-memory exporter (the same
plugin that exports OTLP in production, given another provider).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode
from upstream_server import Behaviour, closed_port_url

from backends.base import BackendConfig
from plugins.builtin.otel_env import tracing_wanted
from tests.telemetry.telemetry_util import Telemetry, make_config, mock, remote

CLIENT_TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
CLIENT_SPAN_ID = 0x00F067AA0BA902B7
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE_ID:032x}-{CLIENT_SPAN_ID:016x}-01"


def by_name(spans: list[ReadableSpan]) -> dict[str, ReadableSpan]:
    return {span.name: span for span in spans}


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.span_id


def test_a_chat_request_is_one_trace_under_the_client_span(
    telemetry: Telemetry, telemetry_gateway: Any
) -> None:
    config = make_config(mock("local"))
    with telemetry_gateway(config) as gw:
        answer = httpx.post(
            f"{gw}/v1/chat/completions",
            json={
                "model": "echo",
                "messages": [{"role": "user", "content": "the secret plan is simple"}],
                "max_tokens": 3,
                "temperature": 0.5,
                "top_p": 0.9,
                "seed": 7,
            },
            headers={"traceparent": CLIENT_TRACEPARENT},
        )
    assert answer.status_code == 200
    body = answer.json()
    spans = by_name(telemetry.trace_of(answer.headers["x-request-id"]))
    assert set(spans) == {"chat echo", "route echo", "attempt local"}

    root = spans["chat echo"]
    assert root.kind == SpanKind.SERVER
    assert root.context is not None and root.context.trace_id == CLIENT_TRACE_ID
    assert parent_of(root) == CLIENT_SPAN_ID
    assert root.status.status_code != StatusCode.ERROR
    root_attrs = attrs(root)
    assert root_attrs["gen_ai.operation.name"] == "chat"
    assert root_attrs["gen_ai.request.model"] == "echo"
    assert root_attrs["gen_ai.request.max_tokens"] == 3
    assert root_attrs["gen_ai.request.temperature"] == 0.5
    assert root_attrs["gen_ai.request.top_p"] == 0.9
    assert root_attrs["gen_ai.request.seed"] == 7
    assert root_attrs["gen_ai.request.stream"] is False
    assert root_attrs["gen_ai.response.id"] == body["id"]
    assert root_attrs["gen_ai.response.model"] == body["model"]
    assert list(root_attrs["gen_ai.response.finish_reasons"]) == ["length"]
    assert root_attrs["gen_ai.usage.input_tokens"] == body["usage"]["prompt_tokens"]
    assert root_attrs["gen_ai.usage.output_tokens"] == body["usage"]["completion_tokens"] == 3
    assert root_attrs["gen_ai.usage.cache_read.input_tokens"] == 0
    assert root_attrs["gen_ai.provider.name"] == "mock"
    assert root_attrs["server.address"] == "127.0.0.1"
    assert root_attrs["infermux.backend.name"] == "local"
    assert root_attrs["infermux.retries"] == 0
    assert root_attrs["infermux.ttft_s"] >= 0
    assert root_attrs["infermux.tpot_s"] >= 0
    assert "infermux.cost" in root_attrs  # set by the cost plugin (0: no prices configured)
    # Message content is never recorded unless the operator opts in.
    assert not any("messages" in key for key in root_attrs)
    assert all("secret" not in str(value) for s in spans.values() for value in attrs(s).values())

    route, attempt = spans["route echo"], spans["attempt local"]
    assert parent_of(route) == span_id(root)
    assert parent_of(attempt) == span_id(route)
    assert attempt.kind == SpanKind.INTERNAL  # an in-process backend
    assert attrs(attempt)["infermux.backend.name"] == "local"
    assert attrs(attempt)["infermux.attempt"] == 0
    assert attrs(route)["infermux.backend.name"] == "local"


def test_a_streamed_completion_has_the_same_tree_and_the_streamed_usage(
    telemetry: Telemetry, telemetry_gateway: Any
) -> None:
    config = make_config(mock("local", token_delay_s=0.01))
    with telemetry_gateway(config) as gw:
        with httpx.stream(
            "POST",
            f"{gw}/v1/completions",
            json={
                "model": "echo",
                "prompt": "one two three four",
                "max_tokens": 10,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ) as answer:
            events = [line[6:] for line in answer.iter_lines() if line.startswith("data: ")]
            request_id = answer.headers["x-request-id"]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    spans = by_name(telemetry.trace_of(request_id))
    assert set(spans) == {"text_completion echo", "route echo", "attempt local"}
    root = attrs(spans["text_completion echo"])
    assert root["gen_ai.operation.name"] == "text_completion"
    assert root["gen_ai.request.stream"] is True
    assert root["gen_ai.usage.input_tokens"] == usage["prompt_tokens"] == 4
    assert root["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 4
    assert list(root["gen_ai.response.finish_reasons"]) == ["stop"]
    # Four tokens 10 ms apart: a time per output token was measured.
    assert root["infermux.tpot_s"] > 0


def test_a_retried_request_shows_both_attempts_and_propagates_the_attempt_context(
    telemetry: Telemetry, telemetry_gateway: Any, upstream_servers: Any
) -> None:
    upstream = upstream_servers(Behaviour(reply="from the second upstream"), name="up")
    config = make_config(
        remote("down", closed_port_url()),  # connection refused: retryable
        remote("up", upstream.base_url),
    )
    with telemetry_gateway(config) as gw:
        answer = httpx.post(
            f"{gw}/v1/chat/completions",
            json={"model": "echo", "messages": [{"role": "user", "content": "hi"}]},
            headers={"traceparent": CLIENT_TRACEPARENT},
        )
    assert answer.status_code == 200
    assert answer.headers["x-infermux-backend"] == "up"
    spans = by_name(telemetry.trace_of(answer.headers["x-request-id"]))
    assert set(spans) == {"chat echo", "route echo", "attempt down", "attempt up"}
    root, route = spans["chat echo"], spans["route echo"]
    failed, served = spans["attempt down"], spans["attempt up"]
    assert attrs(root)["infermux.retries"] == 1
    assert attrs(root)["gen_ai.provider.name"] == "openai"
    assert attrs(route)["infermux.retries"] == 1
    assert attrs(route)["infermux.backend.name"] == "up"
    for attempt in (failed, served):
        assert parent_of(attempt) == span_id(route)
        assert attempt.kind == SpanKind.CLIENT
        assert attrs(attempt)["server.address"] == "127.0.0.1"
    assert attrs(failed)["infermux.attempt"] == 0
    assert attrs(failed)["error.type"] == "backend_unavailable"
    assert failed.status.status_code == StatusCode.ERROR
    assert attrs(served)["infermux.attempt"] == 1
    assert "error.type" not in attrs(served)
    assert attrs(served)["server.port"] == upstream.port
    # The upstream continues the client's trace under the attempt that reached it.
    sent = upstream.requests[-1].headers["traceparent"]
    _, trace_id, parent_id, _ = sent.split("-")
    assert int(trace_id, 16) == CLIENT_TRACE_ID
    assert int(parent_id, 16) == span_id(served)


def test_a_request_no_backend_could_serve_is_an_error_trace(
    telemetry: Telemetry, telemetry_gateway: Any
) -> None:
    config = make_config(mock("broken", fail_before_first_token="upstream_status"), max_retries=0)
    with telemetry_gateway(config) as gw:
        answer = httpx.post(
            f"{gw}/v1/chat/completions",
            json={"model": "echo", "messages": [{"role": "user", "content": "hi"}]},
        )
    assert answer.status_code == 502
    spans = by_name(telemetry.trace_of(answer.headers["x-request-id"]))
    assert set(spans) == {"chat echo", "route echo", "attempt broken"}
    for name in spans:
        assert spans[name].status.status_code == StatusCode.ERROR, name
        assert attrs(spans[name])["error.type"] == "upstream_error", name
    assert "infermux.backend.name" not in attrs(spans["chat echo"])


def test_a_stream_that_breaks_midway_is_an_error_trace_with_partial_usage(
    telemetry: Telemetry, telemetry_gateway: Any
) -> None:
    config = make_config(mock("flaky", fail_after_tokens=2))
    with telemetry_gateway(config) as gw:
        with httpx.stream(
            "POST",
            f"{gw}/v1/chat/completions",
            json={
                "model": "echo",
                "messages": [{"role": "user", "content": "a b c d e"}],
                "stream": True,
            },
        ) as answer:
            lines = [line for line in answer.iter_lines() if line.startswith("data: ")]
            request_id = answer.headers["x-request-id"]
    assert "error" in json.loads(lines[-1][6:])  # an error frame, no [DONE]
    spans = by_name(telemetry.trace_of(request_id))
    root = spans["chat echo"]
    assert root.status.status_code == StatusCode.ERROR
    assert attrs(root)["error.type"] == "backend_error"
    assert attrs(root)["gen_ai.usage.output_tokens"] == 2
    # The attempt itself succeeded (it produced the first chunk): the stream broke later.
    assert spans["attempt flaky"].status.status_code != StatusCode.ERROR


def test_a_stream_resumed_on_another_backend_shows_both_attempts(
    telemetry: Telemetry, telemetry_gateway: Any, upstream_servers: Any
) -> None:
    # resume_on_failure: the first backend breaks after two tokens, the remote continues the
    # same answer (continue_final_message); the trace shows both tries, each under its own
    # routing span, and what the second one was given.
    upstream = upstream_servers(Behaviour(reply="and the rest"), name="up")
    config = make_config(
        mock("flaky", fail_after_tokens=2, fail_after_error="upstream_status"),  # a 5xx mid-stream
        BackendConfig(
            name="up",
            kind="openai",
            options={"base_url": upstream.base_url, "continue_final_message": True},
        ),
        resume_on_failure=True,
    )
    with telemetry_gateway(config) as gw:
        with httpx.stream(
            "POST",
            f"{gw}/v1/chat/completions",
            json={
                "model": "echo",
                "messages": [{"role": "user", "content": "a b c d e"}],
                "stream": True,
            },
        ) as answer:
            events = [line[6:] for line in answer.iter_lines() if line.startswith("data: ")]
            request_id = answer.headers["x-request-id"]
    assert events[-1] == "[DONE]"
    text = "".join(
        choice["delta"].get("content") or ""
        for event in events[:-1]
        for choice in json.loads(event)["choices"]
    )
    assert text.endswith("and the rest")
    given = text[: -len("and the rest")]
    assert given == "a b"  # the flaky backend echoed two words before it broke
    trace = telemetry.trace_of(request_id)
    assert sorted(span.name for span in trace) == [
        "attempt flaky",
        "attempt up",
        "chat echo",
        "route echo",
        "route echo",
    ]
    spans = by_name(trace)
    root, first, resumed = spans["chat echo"], spans["attempt flaky"], spans["attempt up"]
    # One routing decision per try, both under the request's span.
    routes = {
        attrs(span)["infermux.backend.name"]: span for span in trace if span.name == "route echo"
    }
    assert set(routes) == {"flaky", "up"}
    assert parent_of(routes["flaky"]) == parent_of(routes["up"]) == span_id(root)
    assert parent_of(first) == span_id(routes["flaky"])
    assert parent_of(resumed) == span_id(routes["up"])
    assert attrs(first)["infermux.attempt"] == 0
    assert "infermux.resume.num_output_chars" not in attrs(first)
    assert attrs(resumed)["infermux.attempt"] == 1
    assert attrs(resumed)["infermux.resume.num_output_chars"] == len(given)
    assert root.status.status_code != StatusCode.ERROR
    assert attrs(root)["infermux.backend.name"] == "flaky,up"
    assert attrs(root)["gen_ai.usage.output_tokens"] == 5  # two words, then three
    # What the remote was asked: the partial answer as an open assistant message.
    sent = upstream.requests[-1].json
    assert sent["continue_final_message"] is True
    assert sent["messages"][-1] == {"role": "assistant", "content": given}


def test_message_content_is_recorded_only_when_the_operator_opts_in(
    telemetry: Telemetry, telemetry_gateway: Any
) -> None:
    config = make_config(mock("local"), telemetry={"tracing": {"record_content": True}})
    with telemetry_gateway(config) as gw:
        answer = httpx.post(
            f"{gw}/v1/chat/completions",
            json={
                "model": "echo",
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "echo these words"},
                ],
                "n": 2,
            },
        )
    assert answer.status_code == 200
    spans = telemetry.trace_of(answer.headers["x-request-id"])
    root = by_name(spans)["chat echo"]
    inputs = json.loads(attrs(root)["gen_ai.input.messages"])
    assert [m["role"] for m in inputs] == ["system", "user"]
    assert inputs[1]["parts"][0]["content"] == "echo these words"
    outputs = json.loads(attrs(root)["gen_ai.output.messages"])
    assert [o["parts"][0]["content"] for o in outputs] == ["echo these words"] * 2
    assert attrs(root)["gen_ai.request.choice.count"] == 2
    # n = 2: one route and one attempt per choice.
    routes = [s for s in spans if s.name == "route echo"]
    assert sorted(attrs(r)["infermux.choice_index"] for r in routes) == [0, 1]


def test_tracing_is_off_unless_the_environment_or_the_config_asks() -> None:
    assert not tracing_wanted(None, {})
    assert tracing_wanted(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert tracing_wanted(None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c/v1/traces"})
    assert tracing_wanted(None, {"OTEL_TRACES_EXPORTER": "otlp"})
    assert not tracing_wanted(
        None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"}
    )
    assert not tracing_wanted(
        None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}
    )
    assert tracing_wanted(True, {})
    assert not tracing_wanted(False, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})


def test_the_core_engine_phases_become_spans_after_its_attempt_began(
    telemetry: Telemetry, telemetry_gateway: Any, tmp_path: Any
) -> None:
    from backends.base import BackendConfig
    from tests.core_engine.gguf_factory import write_llama_gguf

    model_path = tmp_path / "tiny.gguf"
    write_llama_gguf(model_path)
    engine = BackendConfig(
        name="core",
        kind="core_engine",
        options={
            "model_path": str(model_path),
            "dtype": "float32",
            "num_threads": 1,
            "kv_cache_memory_mb": 16,
        },
    )
    with telemetry_gateway(make_config(engine)) as gw:
        answer = httpx.post(
            f"{gw}/v1/chat/completions",
            json={
                "model": "echo",
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 4,
                "temperature": 0,
            },
        )
    assert answer.status_code == 200
    spans = by_name(telemetry.trace_of(answer.headers["x-request-id"]))
    assert {"queued", "prefill", "decode"} <= set(spans)
    root, attempt = spans["chat echo"], spans["attempt core"]
    queued, prefill, decode = spans["queued"], spans["prefill"], spans["decode"]
    for phase in (queued, prefill, decode):
        assert parent_of(phase) == span_id(root)
        assert attrs(phase)["infermux.backend.name"] == "core"
    # One after the other, starting when the answering attempt began.
    assert queued.start_time == attempt.start_time
    assert queued.end_time == prefill.start_time
    assert prefill.end_time == decode.start_time
    assert attrs(root)["gen_ai.provider.name"] == "infermux"
