"""``GET /metrics`` as a Prometheus server scrapes it, and the same numbers as OTel metrics."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.base import BackendConfig
from backends.mock import MockBackend
from tests.telemetry.telemetry_util import Telemetry, make_config, mock

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(gateway: str) -> Samples:
    answer = httpx.get(f"{gateway}/metrics")
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def poll(gateway: str, name: str, labels: dict[str, str], *, until: float) -> float:
    """Scrape until the sample has the value ``until`` (a hang guard of 10 s), return it."""
    deadline = time.monotonic() + 10
    while True:
        current = value(scrape(gateway), name, **labels)
        if current == until or time.monotonic() > deadline:
            return current
        time.sleep(0.01)


def chat(gateway: str, text: str, model: str = "echo", **extra: Any) -> httpx.Response:
    return httpx.post(
        f"{gateway}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": text}], **extra},
        timeout=30,
    )


def test_counters_and_histograms_move_as_requests_are_served(
    telemetry: Telemetry, telemetry_gateway: Any
) -> None:
    config = make_config(
        mock("a", token_delay_s=0.002),
        mock("b", fail_before_first_token="upstream_status"),
        models={"echo": ["a"], "broken": ["b"]},
        max_retries=0,
    )
    with telemetry_gateway(config) as gw:
        before = scrape(gw)
        first = chat(gw, "one two three").json()["usage"]
        with httpx.stream(
            "POST",
            f"{gw}/v1/chat/completions",
            json={
                "model": "echo",
                "messages": [{"role": "user", "content": "four five"}],
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ) as answer:
            data = [line[6:] for line in answer.iter_lines() if line.startswith("data: ")]
        second = json.loads(data[-2])["usage"]
        assert chat(gw, "x", model="broken").status_code == 502
        assert chat(gw, "x", model="no-such-model").status_code == 404
        after = scrape(gw)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    ok = {"model": "echo", "backend": "a"}
    assert delta("infermux_requests_total", **ok, status="ok") == 2
    assert (
        delta("infermux_requests_total", model="broken", backend="none", status="upstream_error")
        == 1
    )
    # A client cannot grow the label set: unknown aliases are "unknown".
    assert (
        delta("infermux_requests_total", model="unknown", backend="none", status="model_not_found")
        == 1
    )
    assert delta("infermux_prompt_tokens_total", **ok) == (
        first["prompt_tokens"] + second["prompt_tokens"]
    )
    assert delta("infermux_completion_tokens_total", **ok) == (
        first["completion_tokens"] + second["completion_tokens"]
    )
    assert delta("infermux_time_to_first_token_seconds_count", **ok) == 2
    assert delta("infermux_time_per_output_token_seconds_count", **ok) == 2
    # 3 + 2 tokens: 2 + 1 gaps between output chunks.
    assert delta("infermux_inter_token_latency_seconds_count", **ok) == 3
    assert delta("infermux_request_duration_seconds_count", **ok, status="ok") == 2
    assert delta("infermux_goodput_requests_total", model="echo") == 2  # no SLO configured
    assert value(after, "infermux_requests_running", model="echo") == 0
    assert value(after, "infermux_requests_waiting", model="echo") == 0
    assert value(after, "infermux_requests_waiting", model="broken") == 0


def test_running_and_waiting_requests_are_visible_while_they_last(
    telemetry: Telemetry, telemetry_gateway: Any
) -> None:
    config = make_config(
        mock("slow", token_delay_s=0.05),
        mock("late", first_token_delay_s=30.0),
        models={"echo": ["slow"], "late": ["late"]},
    )
    with telemetry_gateway(config) as gw:
        with httpx.stream(
            "POST",
            f"{gw}/v1/chat/completions",
            json={
                "model": "echo",
                "messages": [{"role": "user", "content": "a b c d e f g h i j k l m n"}],
                "stream": True,
            },
        ) as answer:
            lines = answer.iter_lines()  # kept: a dropped iterator closes the response
            next(lines)  # the stream has started: the choice is running
            during = scrape(gw)
        assert value(during, "infermux_requests_running", model="echo") == 1

        # A raw connection, so that the test decides when the client goes away.
        body = json.dumps({"model": "late", "messages": [{"role": "user", "content": "x"}]})
        port = int(gw.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(
                (
                    "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                    f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
                    f"{body}"
                ).encode()
            )
            waiting = poll(gw, "infermux_requests_waiting", {"model": "late"}, until=1)
        assert waiting == 1
        after_disconnect = poll(gw, "infermux_requests_waiting", {"model": "late"}, until=0)
        assert after_disconnect == 0
        assert poll(gw, "infermux_requests_running", {"model": "echo"}, until=0) == 0


class EngineLikeMock(MockBackend):
    """A mock that also reports engine statistics, as the core engine's ``stats()`` does."""

    def stats(self) -> dict[str, float]:
        return {
            "kv_cache_usage": 0.25,
            "prefix_cache_hit_rate": 0.5,
            "num_running": 3,
            "num_waiting": 1,
        }


def test_engine_statistics_and_goodput_against_the_configured_slos(
    telemetry: Telemetry, telemetry_gateway: Any
) -> None:
    config = make_config(
        mock("engine", token_delay_s=0.03),
        telemetry={"slo": {"ttft_ms": 60_000, "tpot_ms": 1}},
    )
    engine = EngineLikeMock(
        BackendConfig(name="engine", kind="mock", options={"token_delay_s": 0.03})
    )
    with telemetry_gateway(config, backends={"engine": engine}) as gw:
        assert chat(gw, "one", max_tokens=1).status_code == 200  # one token: no TPOT to miss
        assert chat(gw, "one two three four").status_code == 200  # ~30 ms per token > 1 ms
        samples = scrape(gw)
    assert value(samples, "infermux_backend_kv_cache_usage_ratio", backend="engine") == 0.25
    assert value(samples, "infermux_backend_prefix_cache_hit_rate", backend="engine") == 0.5
    assert value(samples, "infermux_backend_requests_running", backend="engine") == 3
    assert value(samples, "infermux_backend_requests_waiting", backend="engine") == 1
    assert (
        value(samples, "infermux_requests_total", model="echo", backend="engine", status="ok") == 2
    )
    assert value(samples, "infermux_goodput_requests_total", model="echo") == 1


def test_two_apps_in_one_process_count_separately(
    telemetry: Telemetry, telemetry_gateway: Any
) -> None:
    config = make_config(mock("a"))
    with telemetry_gateway(config) as one, telemetry_gateway(config) as two:
        for _ in range(3):
            assert chat(one, "hi").status_code == 200
        assert chat(two, "hi").status_code == 200
        ok = {"model": "echo", "backend": "a", "status": "ok"}
        assert value(scrape(one), "infermux_requests_total", **ok) == 3
        assert value(scrape(two), "infermux_requests_total", **ok) == 1


def test_the_same_measurements_are_otel_metrics_with_genai_names(
    telemetry: Telemetry, telemetry_gateway: Any
) -> None:
    with telemetry_gateway(make_config(mock("a", token_delay_s=0.002))) as gw:
        usage = chat(gw, "alpha beta gamma delta").json()["usage"]
    ttft = telemetry.metric_points("gen_ai.server.time_to_first_token")
    assert len(ttft) == 1 and ttft[0].count == 1
    assert ttft[0].attributes["gen_ai.request.model"] == "echo"
    assert ttft[0].attributes["gen_ai.operation.name"] == "chat"
    assert ttft[0].attributes["gen_ai.provider.name"] == "mock"
    assert telemetry.metric_points("gen_ai.server.time_per_output_token")[0].count == 1
    assert telemetry.metric_points("gen_ai.server.request.duration")[0].count == 1
    tokens = {
        p.attributes["gen_ai.token.type"]: p.sum
        for p in telemetry.metric_points("gen_ai.client.token.usage")
    }
    assert tokens == {"input": usage["prompt_tokens"], "output": usage["completion_tokens"]}


def test_the_series_scrape_as_prometheus_client_instruments_would() -> None:
    """The plugin's plain-number series render the text prometheus_client's own counter,
    gauge and histogram give for the same updates (bucket edges included)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from plugins.builtin.metric_series import (
        CounterSeries,
        GaugeSeries,
        HistogramSeries,
        SeriesCollector,
    )

    bounds = (0.01, 0.1, 1.0)
    theirs = CollectorRegistry()
    counter = Counter("x_requests", "Requests", ["model"], registry=theirs)
    gauge = Gauge("x_running", "Running", ["model"], registry=theirs)
    histogram = Histogram("x_seconds", "Seconds", ["model"], buckets=bounds, registry=theirs)
    ours = CollectorRegistry()
    counter_series = CounterSeries("x_requests", "Requests", ["model"])
    gauge_series = GaugeSeries("x_running", "Running", ["model"])
    histogram_series = HistogramSeries("x_seconds", "Seconds", ["model"], bounds)
    ours.register(SeriesCollector([counter_series, gauge_series, histogram_series]))

    # On a bound, between bounds, above the last, zero; for two label values.
    amounts = [0.01, 0.05, 0.1, 0.5, 1.0, 7.0, 0.0]
    for model in ("a", "b"):
        counter.labels(model).inc(3)
        counter_series.inc((model,), 3)
        gauge.labels(model).inc(2)
        gauge.labels(model).dec()
        gauge_series.add((model,), 2)
        gauge_series.add((model,), -1)
    for amount in amounts:
        histogram.labels("a").observe(amount)
        histogram_series.observe(("a",), amount)
    for amount in amounts[:3]:
        histogram.labels("b").observe(amount)
    histogram_series.observe_many(("b",), amounts[:3])

    def text(registry: CollectorRegistry) -> list[str]:
        lines = generate_latest(registry).decode().splitlines()
        return sorted(line for line in lines if "_created" not in line)

    assert text(ours) == text(theirs)
    with pytest.raises(ValueError):
        counter_series.inc(("a",), -1)
    with pytest.raises(ValueError):  # the name is taken in that registry
        Counter("x_requests", "again", registry=ours)
