"""What the endpoints without an API key tell: ``/metrics`` may require a bearer token
(``[server] metrics_token_sha256``) and names no API key or tenant unless ``[telemetry.metrics]
tenant_labels`` says so; ``/ready`` gives states, never exception text or file paths (those go
to the log). All through a live gateway on loopback."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest

from backends.mock import MockBackend
from gateway.config.load import config_from_dict
from gateway.config.types import ApiKeyConfig, AuthConfig, ConfigError, InfermuxConfig, ServerConfig
from gateway.http.auth import generate_key, hash_key
from gateway.testing import LiveGateway, gateway_config, mock_backend

ALICE = "imx-alice-public-endpoints"
KEYS = AuthConfig(keys=[ApiKeyConfig(id="alice", tenant="acme", key_sha256=hash_key(ALICE))])
CHAT = {"model": "echo", "messages": [{"role": "user", "content": "what does it cost"}]}
#: A price, so that every request has a cost (1 per million prompt and output tokens).
COST = {"prices": [{"model": "echo", "input_per_mtok": 1.0, "output_per_mtok": 1.0}]}


def keyed_config(*, tenant_labels: bool = False, metrics_token: str | None = None) -> InfermuxConfig:
    raw = msgspec.to_builtins(gateway_config(mock_backend("mock"), auth=KEYS))
    raw["cost"] = COST
    raw["telemetry"] = {"metrics": {"tenant_labels": tenant_labels}}
    if metrics_token is not None:
        raw["server"] = {"metrics_token_sha256": hash_key(metrics_token)}
    return config_from_dict(raw)


def spend(gw: LiveGateway) -> None:
    answer = httpx.post(
        f"{gw}/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {ALICE}"}
    )
    assert answer.status_code == 200, answer.text


def cost_series(scrape: str) -> list[str]:
    return [line for line in scrape.splitlines() if line.startswith("infermux_cost_total{")]


# -- /metrics: who spends what ----------------------------------------------------------------


def test_metrics_name_no_key_or_tenant_by_default(live_gateway: Any) -> None:
    with live_gateway(keyed_config()) as gw:
        spend(gw)
        scrape = httpx.get(f"{gw}/metrics")
    assert scrape.status_code == 200
    (series,) = cost_series(scrape.text)
    assert series.startswith('infermux_cost_total{model="echo"} ') and float(series.split()[-1]) > 0
    # No series at all (cost, tokens, prefix-cache figures...) is labelled by key or tenant.
    labels = set(re.findall(r'[{,]([a-z_]+)="', scrape.text))
    assert labels and not labels & {"api_key", "tenant"}
    assert "alice" not in scrape.text and "acme" not in scrape.text


def test_tenant_labels_are_there_when_the_config_turns_them_on(live_gateway: Any) -> None:
    with live_gateway(keyed_config(tenant_labels=True)) as gw:
        spend(gw)
        scrape = httpx.get(f"{gw}/metrics").text
    (series,) = cost_series(scrape)
    assert series.startswith('infermux_cost_total{api_key="alice",model="echo",tenant="acme"} ')


# -- /metrics: the token --------------------------------------------------------------------


@pytest.fixture(scope="module")
def token_gw(live_gateway: Any) -> Iterator[tuple[LiveGateway, str]]:
    token = generate_key()
    with live_gateway(keyed_config(metrics_token=token)) as gw:
        yield gw, token


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer wrong"},
        {"authorization": f"Bearer {ALICE}"},  # an API key is not the metrics token
        {"authorization": "Bearer {digest}"},  # nor is the digest in the config
        {"authorization": "Basic {token}"},
    ],
    ids=["none", "wrong", "api-key", "digest", "basic"],
)
def test_metrics_need_the_token_when_one_is_configured(
    token_gw: tuple[LiveGateway, str], headers: dict[str, str]
) -> None:
    gw, token = token_gw
    headers = {k: v.format(token=token, digest=hash_key(token)) for k, v in headers.items()}
    refused = httpx.get(f"{gw}/metrics", headers=headers)
    assert refused.status_code == 401, refused.text
    assert refused.json()["error"]["code"] == "invalid_api_key"
    assert refused.headers["www-authenticate"].startswith("Bearer")
    assert "infermux_" not in refused.text


def test_metrics_answer_the_token(token_gw: tuple[LiveGateway, str]) -> None:
    gw, token = token_gw
    scrape = httpx.get(f"{gw}/metrics", headers={"authorization": f"Bearer {token}"})
    assert scrape.status_code == 200
    assert "# TYPE infermux_requests_total counter" in scrape.text
    # The probes stay public.
    assert httpx.get(f"{gw}/ready").status_code == 200
    assert httpx.get(f"{gw}/health").status_code == 200


def test_the_metrics_token_digest_is_checked_when_the_config_is_read() -> None:
    raw = msgspec.to_builtins(gateway_config(mock_backend("mock")))
    raw["server"] = {"metrics_token_sha256": "my-token"}
    with pytest.raises(ConfigError, match="server.metrics_token_sha256"):
        config_from_dict(raw)
    assert ServerConfig().metrics_token_sha256 is None  # public by default


# -- /ready: states only --------------------------------------------------------------------


SECRET_PATH = "/srv/private-models/acme/weights-v7.gguf"


class Unloadable(MockBackend):
    async def start(self) -> None:
        raise FileNotFoundError(f"model file not found: {SECRET_PATH}")


def test_ready_gives_states_and_the_reasons_go_to_the_log(
    live_gateway: Any, caplog: pytest.LogCaptureFixture
) -> None:
    config = gateway_config(
        mock_backend("broken"),
        mock_backend("fine"),
        models={"needs_broken": ["broken"], "served": ["fine"]},
    )
    with live_gateway(
        config, backends={"broken": Unloadable(config.backends[0])}, allow_failed_backends=True
    ) as gw:
        ready = httpx.get(f"{gw}/ready")
    assert ready.status_code == 503
    assert ready.json() == {
        "status": "unavailable",
        "backends": {"broken": "failed", "fine": "ready"},
        "circuits": {"broken": "closed", "fine": "closed"},
        "models": {"needs_broken": "no started backend"},
    }
    assert SECRET_PATH not in ready.text and "FileNotFoundError" not in ready.text
    assert f"FileNotFoundError: model file not found: {SECRET_PATH}" in caplog.text
