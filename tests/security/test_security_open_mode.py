"""Open mode (no API keys) is loopback in fact: a web page that reaches the gateway through a
browser (DNS rebinding: a foreign ``Host``; a cross-site request: a foreign ``Origin``) is
refused; with keys the key decides. Every JSON POST needs ``Content-Type: application/json``
(a cross-site ``text/plain`` POST needs no preflight), in every mode. All through a live
gateway on loopback, with the official clients where they apply."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from gateway.config.types import ApiKeyConfig, AuthConfig
from gateway.http.auth import hash_key
from gateway.testing import LiveGateway, gateway_config, mock_backend

KEY = "imx-security-open-mode-key"
KEYS = AuthConfig(keys=[ApiKeyConfig(id="ops", tenant="acme", key_sha256=hash_key(KEY))])
CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hello there"}]}
#: Every POST that takes a JSON body, with a body it would accept as JSON.
JSON_POSTS = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"model": "echo", "prompt": "hello"},
    "/v1/embeddings": {"model": "echo", "input": "hello"},
    "/v1/responses": {"model": "echo", "input": "hello"},
    "/v1/messages": {"model": "echo", "max_tokens": 8, "messages": CHAT["messages"]},
    "/v1/messages/count_tokens": {"model": "echo", "messages": CHAT["messages"]},
    "/tokenize": {"model": "echo", "prompt": "hello"},
    "/detokenize": {"model": "echo", "tokens": [1, 2]},
}


@pytest.fixture(scope="module")
def open_gw(live_gateway: Any) -> Iterator[LiveGateway]:
    with live_gateway(gateway_config(mock_backend("mock"))) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def keyed_gw(live_gateway: Any) -> Iterator[LiveGateway]:
    with live_gateway(gateway_config(mock_backend("mock"), auth=KEYS)) as gateway:
        yield gateway


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI envelope's ``error`` of a refusal with ``status``."""
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def port_of(gw: LiveGateway) -> str:
    return gw.rsplit(":", 1)[1]


# -- Host and Origin in open mode -----------------------------------------------------------


@pytest.mark.parametrize(
    "host",
    ["evil.example", "evil.example:{port}", "127.0.0.1.nip.io:{port}", "localhost.evil.example", ""],
)
def test_a_rebinding_request_is_refused_in_open_mode(open_gw: LiveGateway, host: str) -> None:
    # DNS rebinding: the page's own name resolves to 127.0.0.1, so the browser connects
    # here but sends the page's name as Host.
    host = host.format(port=port_of(open_gw))
    backend = open_gw.backend("mock")
    started = backend.num_started
    headers = {"host": host}
    chat = httpx.post(f"{open_gw}/v1/chat/completions", json=CHAT, headers=headers)
    error = error_of(chat, 403)
    assert (error["code"], error["param"]) == ("permission_denied", "Host")
    assert "Host" in error["message"]
    for path in ("/v1/usage", "/v1/models", "/metrics", "/ready"):
        assert error_of(httpx.get(f"{open_gw}{path}", headers=headers), 403)["param"] == "Host"
    assert backend.num_started == started  # nothing reached the backend


@pytest.mark.parametrize(
    "host", ["127.0.0.1:{port}", "localhost:{port}", "LOCALHOST", "127.8.9.10", "[::1]:{port}", "[::1]"]
)
def test_loopback_host_names_are_served_in_open_mode(open_gw: LiveGateway, host: str) -> None:
    headers = {"host": host.format(port=port_of(open_gw))}
    answer = httpx.post(f"{open_gw}/v1/chat/completions", json=CHAT, headers=headers)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    "origin", ["http://evil.example", "https://evil.example:443", "null", "http://127.0.0.1.nip.io"]
)
def test_a_foreign_origin_is_refused_in_open_mode(open_gw: LiveGateway, origin: str) -> None:
    # A cross-site POST from a page: the browser adds its Origin (and sends no preflight for
    # a "simple" request), Host being the gateway's own.
    backend = open_gw.backend("mock")
    started = backend.num_started
    answer = httpx.post(f"{open_gw}/v1/chat/completions", json=CHAT, headers={"origin": origin})
    error = error_of(answer, 403)
    assert (error["code"], error["param"]) == ("permission_denied", "Origin")
    assert backend.num_started == started


@pytest.mark.parametrize("origin", ["http://localhost:3000", "http://127.0.0.1", "https://[::1]:8443"])
def test_a_loopback_origin_is_served_in_open_mode(open_gw: LiveGateway, origin: str) -> None:
    answer = httpx.post(f"{open_gw}/v1/chat/completions", json=CHAT, headers={"origin": origin})
    assert answer.status_code == 200, answer.text


def test_the_official_clients_are_served_in_open_mode(open_gw: LiveGateway) -> None:
    completion = open_gw.openai_client().chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "hello there"}]
    )
    assert completion.choices[0].message.content
    assert open_gw.openai_client().completions.create(model="echo", prompt="hello").choices
    client = anthropic.Anthropic(base_url=str(open_gw), api_key="unused", max_retries=0)
    message = client.messages.create(
        model="echo", max_tokens=8, messages=[{"role": "user", "content": "hello there"}]
    )
    assert message.content


# -- with keys, the key decides -------------------------------------------------------------


def test_with_keys_a_foreign_host_or_origin_is_served_with_a_valid_key(keyed_gw: LiveGateway) -> None:
    backend = keyed_gw.backend("mock")
    foreign = {"host": "evil.example", "origin": "http://evil.example"}
    answer = httpx.post(
        f"{keyed_gw}/v1/chat/completions",
        json=CHAT,
        headers={**foreign, "authorization": f"Bearer {KEY}"},
    )
    assert answer.status_code == 200, answer.text
    assert backend.received[-1].api_key_id == "ops"
    usage = httpx.get(f"{keyed_gw}/v1/usage", headers={**foreign, "authorization": f"Bearer {KEY}"})
    assert usage.status_code == 200, usage.text
    # ... and without the key, the key check refuses it as any other request.
    started = backend.num_started
    refused = httpx.post(f"{keyed_gw}/v1/chat/completions", json=CHAT, headers=foreign)
    assert error_of(refused, 401)["code"] == "invalid_api_key"
    assert backend.num_started == started


# -- Content-Type, in every mode ------------------------------------------------------------


@pytest.mark.parametrize("mode", ["open", "keyed"])
@pytest.mark.parametrize("path", list(JSON_POSTS))
def test_a_text_plain_post_is_415_and_never_reaches_the_backend(
    open_gw: LiveGateway, keyed_gw: LiveGateway, mode: str, path: str
) -> None:
    gw, headers = (open_gw, {}) if mode == "open" else (keyed_gw, {"authorization": f"Bearer {KEY}"})
    backend = gw.backend("mock")
    started = backend.num_started
    # What a page's cross-site form or fetch() sends without a CORS preflight.
    body = httpx.Request("POST", "http://x", json=JSON_POSTS[path]).read()
    answer = httpx.post(
        f"{gw}{path}", content=body, headers={**headers, "content-type": "text/plain;charset=UTF-8"}
    )
    assert answer.status_code == 415, answer.text
    if path.startswith("/v1/messages"):  # Anthropic's API answers in Anthropic's envelope
        error = answer.json()["error"]
        assert "Content-Type" in error["message"]
    else:
        error = error_of(answer, 415)
        assert (error["code"], error["param"]) == ("unsupported_media_type", "Content-Type")
        assert "Content-Type" in error["message"]
    assert backend.num_started == started  # nothing reached the backend


@pytest.mark.parametrize(
    "content_type",
    [None, "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/jsonx", "text/json"],
)
def test_only_application_json_is_a_json_body(open_gw: LiveGateway, content_type: str | None) -> None:
    body = httpx.Request("POST", "http://x", json=CHAT).read()
    headers = {} if content_type is None else {"content-type": content_type}
    answer = httpx.post(f"{open_gw}/v1/chat/completions", content=body, headers=headers)
    assert ("content-type" in answer.request.headers) is (content_type is not None)
    assert error_of(answer, 415)["param"] == "Content-Type"


@pytest.mark.parametrize(
    "content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON;charset=UTF-8"]
)
def test_application_json_with_parameters_is_accepted(open_gw: LiveGateway, content_type: str) -> None:
    body = httpx.Request("POST", "http://x", json=CHAT).read()
    answer = httpx.post(
        f"{open_gw}/v1/chat/completions", content=body, headers={"content-type": content_type}
    )
    assert answer.status_code == 200, answer.text


def test_the_key_is_checked_before_the_content_type(keyed_gw: LiveGateway) -> None:
    # An unauthenticated client learns nothing about what the gateway would accept.
    for path in ("/v1/chat/completions", "/tokenize"):
        answer = httpx.post(f"{keyed_gw}{path}", content=b"x", headers={"content-type": "text/plain"})
        assert error_of(answer, 401)["code"] == "invalid_api_key"
