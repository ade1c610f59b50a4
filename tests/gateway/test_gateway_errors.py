"""Every 4xx/5xx leaves as ``{"error": {"message", "type", "param", "code"}}`` (raw httpx)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.config.types import ServerConfig
from gateway.testing import LiveGateway, gateway_config, mock_backend

MESSAGES = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def gw(live_gateway: Any) -> Iterator[LiveGateway]:
    config = gateway_config(mock_backend("mock"), server=ServerConfig(max_body_bytes=20_000))
    with live_gateway(config) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def http(gw: LiveGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gw, timeout=30.0) as client:
        yield client


def envelope(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert response.headers["x-request-id"]
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def chat(http: httpx.Client, **fields: Any) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": "echo", "messages": MESSAGES, **fields})


def test_framework_404_and_405(http: httpx.Client) -> None:
    error = envelope(http.get("/v2/nothing"), 404)
    assert (error["type"], error["code"]) == ("invalid_request_error", "not_found")
    error = envelope(http.get("/v1/chat/completions"), 405)
    assert error["code"] == "method_not_allowed"
    envelope(http.delete("/v1/models"), 405)


def test_body_over_the_limit_is_413(http: httpx.Client) -> None:
    big = "word " * 10_000
    error = envelope(chat(http, messages=[{"role": "user", "content": big}]), 413)
    assert error["code"] == "request_too_large"


@pytest.mark.parametrize(
    ("content", "content_type"),
    [
        (b'{"model": "echo", "messages": [', "application/json"),
        (b"", "application/json"),
        (b"[1, 2]", "application/json"),
        (b'{"model": NaN, "messages": []}', "application/json"),
    ],
)
def test_unparsable_bodies_are_400(http: httpx.Client, content: bytes, content_type: str) -> None:
    response = http.post(
        "/v1/chat/completions", content=content, headers={"content-type": content_type}
    )
    error = envelope(response, 400)
    assert error["type"] == "invalid_request_error"


def test_a_form_body_is_415_naming_content_type(http: httpx.Client) -> None:
    response = http.post(
        "/v1/chat/completions",
        content=b"model=echo",
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    error = envelope(response, 415)
    assert (error["code"], error["param"]) == ("unsupported_media_type", "Content-Type")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"model": None}, "model"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": 7, "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"temperature": 7}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2**63}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"n": 1_000_000}, "n"),
        ({"top_logprobs": 5}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 1_000_000}, "top_logprobs"),
        ({"stop": ["x"] * 100}, "stop"),
        ({"stop": "x" * 5000}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ],
)
def test_invalid_parameters_are_400_naming_the_param(
    http: httpx.Client, fields: dict[str, Any], param: str
) -> None:
    error = envelope(chat(http, **fields), 400)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


def test_missing_model_names_it(http: httpx.Client) -> None:
    error = envelope(http.post("/v1/chat/completions", json={"messages": MESSAGES}), 400)
    assert error["param"] == "model"


@pytest.mark.parametrize("field", ["api_base", "base_url", "api_key", "chat_template"])
def test_smuggling_fields_are_refused(http: httpx.Client, field: str) -> None:
    error = envelope(chat(http, **{field: "http://169.254.169.254/"}), 400)
    assert error["param"] == field
    assert field in error["message"]


def test_image_content_parts_are_refused_naming_the_message(http: httpx.Client) -> None:
    parts = [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/x.png"}},
    ]
    error = envelope(
        chat(
            http, messages=[{"role": "system", "content": "hi"}, {"role": "user", "content": parts}]
        ),
        400,
    )
    assert error["param"] == "messages[1].content"
    assert "image_url" in error["message"]


def test_unknown_fields_are_ignored_like_openai(http: httpx.Client) -> None:
    response = chat(http, some_future_option={"a": 1}, metadata={"k": "v"})
    assert response.status_code == 200


@pytest.mark.parametrize("model", ["nope", "../../etc/passwd", "/etc/passwd"])
def test_unknown_model_is_404_model_not_found(http: httpx.Client, model: str) -> None:
    error = envelope(chat(http, model=model), 404)
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    completion = http.post("/v1/completions", json={"model": model, "prompt": "x"})
    assert envelope(completion, 404)["code"] == "model_not_found"


def test_get_unknown_model_is_404(http: httpx.Client) -> None:
    error = envelope(http.get("/v1/models/org/unknown-model"), 404)
    assert error["code"] == "model_not_found"


def test_unknown_pinned_backend_is_400(http: httpx.Client) -> None:
    response = http.post(
        "/v1/chat/completions",
        json={"model": "echo", "messages": MESSAGES},
        headers={"x-infermux-backend": "elsewhere"},
    )
    error = envelope(response, 400)
    assert error["code"] == "unknown_backend"
    assert "elsewhere" in error["message"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [[1], []]}, "prompt[1]"),
        ({"prompt": [-5]}, "prompt"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "logprobs": 50}, "logprobs"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": ["x"] * 40, "n": 2}, "prompt"),
        ({"prompt": "x", "base_url": "http://x"}, "base_url"),
    ],
)
def test_completion_parameters_are_checked(
    http: httpx.Client, fields: dict[str, Any], param: str
) -> None:
    error = envelope(http.post("/v1/completions", json={"model": "echo", **fields}), 400)
    assert error["param"] == param


def test_openai_client_surfaces_the_envelope(gw: LiveGateway) -> None:
    client = gw.openai_client()
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="missing", messages=MESSAGES)  # type: ignore[arg-type]
    assert caught.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="echo", messages=MESSAGES, temperature=9)  # type: ignore[arg-type]
    assert bad.value.param == "temperature"


def test_health_and_ready(http: httpx.Client) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    ready = http.get("/ready")
    assert ready.status_code == 200
    assert ready.json()["status"] == "ready"
    assert ready.json()["backends"] == {"mock": "ready"}
    assert ready.json()["circuits"] == {"mock": "closed"}


def test_backend_errors_carry_status_and_retry_after(live_gateway: Any) -> None:
    config = gateway_config(
        mock_backend("limited", fail_before_first_token="rate_limit", retry_after_s=7),
        max_retries=0,
    )
    with live_gateway(config) as gateway, httpx.Client(base_url=gateway) as http:
        error_response = chat(http)
        error = envelope(error_response, 429)
        assert error["code"] == "rate_limit_exceeded"
        assert error_response.headers["retry-after"] == "7"


def test_request_ids_are_fresh_and_ordered_by_time(http: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """32 hex digits, a new one per request whatever the client sends, later ones sorting
    after earlier ones (the usage ledger's index on them then grows at one end)."""
    import re
    import types

    from gateway.http import request_id

    # The ids' clock, a millisecond further at each read: ordered by time without sleeping.
    ticks = iter(range(1_700_000_000_000, 1_700_000_001_000))
    fake_time = types.SimpleNamespace(time_ns=lambda: next(ticks) * 1_000_000)
    monkeypatch.setattr(request_id, "time", fake_time)
    ids = []
    for _ in range(3):
        answer = http.post(
            "/v1/chat/completions",
            json={"model": "echo", "messages": MESSAGES},
            headers={"x-request-id": "client-chosen"},
        )
        assert answer.status_code == 200, answer.text
        ids.append(answer.headers["x-request-id"])
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    assert len(set(ids)) == 3
    assert ids == sorted(ids)
