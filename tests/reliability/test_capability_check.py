"""Parameters a backend cannot honour are refused (400 naming them), never silently dropped."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from reliability_util import assert_still_serving, chat_body, envelope
from upstream_server import Behaviour, UpstreamServer

from backends.base import BackendConfig, Capabilities
from backends.mock import MockBackend
from gateway.testing import LiveGateway, gateway_config, mock_backend


class PlainBackend(MockBackend):
    """A backend that honours only the basics (as a small remote server might)."""

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        self.capabilities = Capabilities(
            logprobs=False,
            echo=False,
            top_k=False,
            min_p=False,
            seed=False,
            penalties=False,
            repetition_penalty=False,
            structured_outputs=False,
        )


class FewLogprobsBackend(MockBackend):
    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        self.capabilities = Capabilities(logprobs=True, echo=True, max_top_logprobs=2)


@pytest.fixture(scope="module")
def gw(live_gateway: Any) -> Iterator[LiveGateway]:
    config = gateway_config(
        mock_backend("plain"),
        mock_backend("few"),
        mock_backend("full"),
        models={"echo": ["full"], "plain": ["plain"], "few": ["few"], "mixed": ["plain", "full"]},
    )
    backends = {
        "plain": PlainBackend(config.backends[0]),
        "few": FewLogprobsBackend(config.backends[1]),
    }
    with live_gateway(config, backends=backends) as gateway:
        yield gateway


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/chat/completions", {"logprobs": True}, "logprobs"),
        ("/v1/chat/completions", {"seed": 7}, "seed"),
        ("/v1/chat/completions", {"top_k": 5}, "top_k"),
        ("/v1/chat/completions", {"min_p": 0.1}, "min_p"),
        ("/v1/chat/completions", {"presence_penalty": 0.5}, "presence_penalty"),
        ("/v1/chat/completions", {"frequency_penalty": -0.5}, "frequency_penalty"),
        ("/v1/chat/completions", {"repetition_penalty": 1.2}, "repetition_penalty"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/completions", {"logprobs": 1}, "logprobs"),
        ("/v1/completions", {"echo": True, "max_tokens": 0}, "echo"),
    ],
)
def test_unsupported_parameters_are_400_naming_them(
    gw: LiveGateway, path: str, fields: dict[str, Any], param: str
) -> None:
    backend = gw.backend("plain")
    started = backend.num_started
    body = chat_body(model="plain") if "chat" in path else {"model": "plain", "prompt": "x"}
    error = envelope(httpx.post(f"{gw}{path}", json={**body, **fields}, timeout=30), 400)
    assert (error["code"], error["param"]) == ("unsupported_parameter", param)
    assert "'plain'" in error["message"]
    assert backend.num_started == started  # refused before generate
    assert httpx.get(f"{gw}/ready").json()["circuits"]["plain"] == "closed"
    assert_still_serving(gw, model="plain")


def test_more_top_logprobs_than_the_backend_gives_is_400(gw: LiveGateway) -> None:
    body = chat_body(model="few", logprobs=True, top_logprobs=3)
    error = envelope(httpx.post(f"{gw}/v1/chat/completions", json=body), 400)
    assert (error["code"], error["param"]) == ("unsupported_parameter", "top_logprobs")
    body = {"model": "few", "prompt": "x", "logprobs": 5}
    error = envelope(httpx.post(f"{gw}/v1/completions", json=body), 400)
    assert (error["code"], error["param"]) == ("unsupported_parameter", "logprobs")
    within = chat_body(model="few", logprobs=True, top_logprobs=2)
    ok = httpx.post(f"{gw}/v1/chat/completions", json=within)
    assert ok.status_code == 200


def test_a_capable_backend_of_the_same_model_serves_instead(gw: LiveGateway) -> None:
    plain, full = gw.backend("plain"), gw.backend("full")
    with_logprobs = httpx.post(
        f"{gw}/v1/chat/completions", json=chat_body(model="mixed", logprobs=True, seed=3)
    )
    assert with_logprobs.status_code == 200
    assert with_logprobs.headers["x-infermux-backend"] == "full"
    assert with_logprobs.json()["choices"][0]["logprobs"]["content"]
    plain_started = plain.num_started
    basic = httpx.post(f"{gw}/v1/chat/completions", json=chat_body(model="mixed"))
    assert basic.headers["x-infermux-backend"] == "plain"  # still first for what it can do
    assert plain.num_started == plain_started + 1
    assert full.num_started >= 1


def test_structured_outputs_pass_through_to_an_openai_upstream(live_gateway: Any) -> None:
    schema = {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": {"type": "object", "properties": {}}},
    }
    with UpstreamServer(name="vllm") as upstream:
        remote = BackendConfig(name="vllm", kind="openai", options={"base_url": upstream.base_url})
        with live_gateway(gateway_config(remote)) as gw:
            ok = httpx.post(f"{gw}/v1/chat/completions", json=chat_body(response_format=schema))
            assert ok.status_code == 200
            assert upstream.requests[-1].json["response_format"] == schema
            # The upstream judges the schema; its 400 reaches the client with its param.
            upstream.script(
                Behaviour(
                    mode="status",
                    status=400,
                    error_type="invalid_request_error",
                    error_message="schema too complex to compile",
                    error_param="response_format",
                )
            )
            refused = httpx.post(
                f"{gw}/v1/chat/completions", json=chat_body(response_format=schema)
            )
            error = envelope(refused, 400)
            assert (error["param"], error["message"]) == (
                "response_format",
                "schema too complex to compile",
            )
            assert httpx.get(f"{gw}/ready").json()["circuits"]["vllm"] == "closed"
            assert_still_serving(gw)
