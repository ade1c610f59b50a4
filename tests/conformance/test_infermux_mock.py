"""``infermux conformance`` against infermux on the mock backend: every applicable check
passes but the known gaps, and each n/a is a capability the mock declares it lacks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.cli import main
from gateway.conformance import CheckResult, Target, run_checks
from gateway.testing import LiveGateway, gateway_config, mock_backend
from tests.conformance.expected import KNOWN_GAPS, NOT_APPLICABLE


@pytest.fixture(scope="module")
def gateway(live_gateway: Any) -> Iterator[LiveGateway]:
    # tokenize: the mock counts words as tokens, so count_tokens is served.
    with live_gateway(gateway_config(mock_backend("mock", tokenize=True), models={"mock": ["mock"]})) as gw:
        yield gw


@pytest.fixture(scope="module")
def results(gateway: LiveGateway) -> list[CheckResult]:
    return run_checks(Target(gateway, "mock"))


def test_every_applicable_check_passes_but_the_known_gaps(results: list[CheckResult]) -> None:
    failed = {r.name: r.evidence for r in results if r.verdict == "fail"}
    assert set(failed) == set(KNOWN_GAPS), failed


def test_not_applicable_only_where_the_mock_declares_the_lack(results: list[CheckResult]) -> None:
    skipped = {r.name: r.evidence for r in results if r.verdict == "n/a"}
    assert set(skipped) == NOT_APPLICABLE["mock"], skipped
    assert "does not compute embeddings" in skipped["embeddings.float"]
    assert "tool calling is not supported" in skipped["tools.required"]


def test_the_battery_covers_every_api(results: list[CheckResult]) -> None:
    apis = {r.api for r in results}
    assert apis == {"openai", "anthropic", "responses"}
    assert len([r for r in results if r.name.startswith("errors.")]) >= 12
    assert all(r.reference.startswith("https://") for r in results)


def test_cli_exit_status_and_reports(gateway: LiveGateway, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    json_path, html_path = tmp_path / "openai.json", tmp_path / "openai.html"
    status = main([
        # The API root (what an OpenAI client's base_url holds) works as well as the server root.
        "conformance", "--url", gateway.openai_base_url, "--model", "mock", "--api", "openai",
        "--json", str(json_path), "--html", str(html_path),
    ])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "chat.stream.shape" in out and "applicable checks pass" in out
    document = json.loads(json_path.read_text())
    assert document["summary"]["fail"] == 0
    assert {c["api"] for c in document["checks"]} == {"openai"}
    assert "<table>" in html_path.read_text()
