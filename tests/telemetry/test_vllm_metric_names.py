"""``[telemetry.metrics] vllm_names``: ``GET /metrics`` also answers with vLLM's series names,
the numbers of infermux's own series, as a dashboard or an endpoint picker built for vLLM
scrapes them."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from backends.base import BackendConfig
from backends.mock import MockBackend
from gateway.config.types import ConfigError
from gateway.testing import LiveGateway
from tests.telemetry.telemetry_util import make_config, mock

StartGateway = Callable[..., AbstractContextManager[LiveGateway]]
NUM_REQUESTS = 3
METRICS_TOKEN = "scrape-token"


class KvReportingMock(MockBackend):
    """A mock that reports a KV-cache usage, as the core engine's ``stats()`` does."""

    def stats(self) -> dict[str, float]:
        return {"kv_cache_usage": 0.375}


class Scrape:
    """One ``GET /metrics``, parsed by prometheus_client's text parser."""

    def __init__(self, text: str) -> None:
        self.types: dict[str, str] = {}
        self.samples: list[Sample] = []
        for family in text_string_to_metric_families(text):
            self.types[family.name] = family.type
            self.samples.extend(family.samples)

    def value(self, name: str, **labels: str) -> float:
        found = [s.value for s in self.samples if s.name == name and s.labels == labels]
        assert len(found) == 1, (name, labels, found)
        return found[0]

    def buckets(self, name: str, **labels: str) -> dict[str, float]:
        return {
            s.labels["le"]: s.value
            for s in self.samples
            if s.name == f"{name}_bucket"
            and {k: v for k, v in s.labels.items() if k != "le"} == labels
        }


def scrape(gateway: str, token: str | None = None) -> Scrape:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    answer = httpx.get(f"{gateway}/metrics", headers=headers)
    assert answer.status_code == 200
    return Scrape(answer.text)


@pytest.fixture(scope="module")
def served(live_gateway: StartGateway) -> Iterator[tuple[Scrape, list[dict[str, Any]]]]:
    """A gateway with vLLM names on, after NUM_REQUESTS chat completions: (scrape, usages).

    Its /metrics needs a token, and tenant labels are on: neither may change for vLLM's names.
    """
    config = make_config(
        mock("engine"),
        server={"metrics_token_sha256": hashlib.sha256(METRICS_TOKEN.encode()).hexdigest()},
        telemetry={"metrics": {"vllm_names": True, "tenant_labels": True}},
    )
    engine = KvReportingMock(BackendConfig(name="engine", kind="mock"))
    with live_gateway(config, backends={"engine": engine}) as gw:
        client = gw.openai_client()
        usages = []
        for i in range(NUM_REQUESTS):
            answer = client.chat.completions.create(
                model="echo",
                messages=[{"role": "user", "content": "one two three four five"[: 8 + 4 * i]}],
                max_tokens=4,
            )
            assert answer.usage is not None
            usages.append(answer.usage.model_dump())
        refused = httpx.get(f"{gw}/metrics")
        assert refused.status_code == 401 and "vllm:" not in refused.text
        yield scrape(str(gw), METRICS_TOKEN), usages


def test_vllm_series_have_vllm_types_and_the_model_name_label(
    served: tuple[Scrape, list[dict[str, Any]]],
) -> None:
    samples, _ = served
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:gpu_cache_usage_perc": "gauge",
        "vllm:request_success": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:time_per_output_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:request_time_per_output_token_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
    }
    assert {name: samples.types.get(name) for name in expected} == expected
    for sample in samples.samples:
        if sample.name.startswith("vllm:"):
            # vLLM's labels only: no backend/model/status, and nothing naming a client.
            assert set(sample.labels) - {"le"} <= {"model_name", "engine"}, sample
            assert sample.labels.get("model_name") == "echo", sample


def test_vllm_series_equal_infermux_series(
    served: tuple[Scrape, list[dict[str, Any]]],
) -> None:
    samples, usages = served
    mine = {"model": "echo", "backend": "engine"}
    theirs = {"model_name": "echo"}
    assert samples.value("vllm:request_success_total", **theirs) == NUM_REQUESTS
    assert samples.value("infermux_requests_total", **mine, status="ok") == NUM_REQUESTS

    prompt = sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    assert samples.value("vllm:prompt_tokens_total", **theirs) == prompt
    assert samples.value("infermux_prompt_tokens_total", **mine) == prompt
    assert samples.value("vllm:generation_tokens_total", **theirs) == generated
    assert samples.value("infermux_completion_tokens_total", **mine) == generated
    assert samples.value("vllm:prefix_cache_queries_total", **theirs) == prompt

    for vllm_name, own_name in (
        ("vllm:time_to_first_token_seconds", "infermux_time_to_first_token_seconds"),
        ("vllm:inter_token_latency_seconds", "infermux_inter_token_latency_seconds"),
        ("vllm:request_time_per_output_token_seconds", "infermux_time_per_output_token_seconds"),
    ):
        assert samples.buckets(vllm_name, **theirs) == samples.buckets(own_name, **mine)
        assert samples.value(f"{vllm_name}_sum", **theirs) == samples.value(
            f"{own_name}_sum", **mine
        )
    assert samples.value("vllm:time_to_first_token_seconds_count", **theirs) == NUM_REQUESTS
    assert samples.value("vllm:e2e_request_latency_seconds_count", **theirs) == NUM_REQUESTS
    assert samples.buckets("vllm:e2e_request_latency_seconds", **theirs) == samples.buckets(
        "infermux_request_duration_seconds", **mine, status="ok"
    )

    assert samples.value("vllm:num_requests_running", **theirs) == 0
    assert samples.value("vllm:num_requests_waiting", **theirs) == 0
    kv = samples.value("infermux_backend_kv_cache_usage_ratio", backend="engine")
    assert kv == 0.375
    for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
        assert samples.value(name, model_name="echo", engine="engine") == kv


def test_no_vllm_series_unless_configured(live_gateway: StartGateway) -> None:
    engine = KvReportingMock(BackendConfig(name="engine", kind="mock"))
    with live_gateway(make_config(mock("engine")), backends={"engine": engine}) as gw:
        gw.openai_client().chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        samples = scrape(str(gw))
    assert samples.value("infermux_requests_total", model="echo", backend="engine", status="ok")
    assert [name for name in samples.types if name.startswith("vllm:")] == []


def test_the_option_must_be_a_boolean() -> None:
    with pytest.raises(ConfigError, match=r"telemetry\.metrics\.vllm_names: expected `bool`"):
        make_config(mock("a"), telemetry={"metrics": {"vllm_names": "yes"}})
