"""Reading the ledger (``GET /v1/usage``, ``infermux usage``) and budgets that refuse with 429."""

from __future__ import annotations

import json
import sqlite3
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.cli import main as infermux
from gateway.http.auth import hash_key
from tests.telemetry.telemetry_util import Telemetry, make_config, mock

KEYS = {"team-a": "sk-team-a-" + "a" * 32, "team-b": "sk-team-b-" + "b" * 32}
AUTH = {
    "keys": [
        {"id": "team-a", "key_sha256": hash_key(KEYS["team-a"]), "tenant": "acme"},
        {"id": "team-b", "key_sha256": hash_key(KEYS["team-b"]), "tenant": "globex"},
    ]
}
PRICES = [{"model": "echo", "input_per_mtok": 1000.0, "output_per_mtok": 2000.0}]


def chat(
    gateway: str, key: str, model: str = "echo", text: str = "one two three"
) -> httpx.Response:
    return httpx.post(
        f"{gateway}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": text}]},
        headers={"authorization": f"Bearer {KEYS[key]}"},
        timeout=30,
    )


def usage(gateway: str, key: str, **params: Any) -> httpx.Response:
    return httpx.get(
        f"{gateway}/v1/usage", params=params, headers={"authorization": f"Bearer {KEYS[key]}"}
    )


def keyed_config(**cost: Any) -> Any:
    return make_config(
        mock("a"),
        mock("b"),
        models={"echo": ["a"], "other": ["b"]},
        auth=AUTH,
        cost={"prices": PRICES, **cost},
    )


def test_usage_is_filtered_by_key_model_and_time_with_totals_and_days(
    telemetry: Telemetry, telemetry_gateway: Any, tmp_path: Path
) -> None:
    with telemetry_gateway(keyed_config()) as gw:
        for key, model in (("team-a", "echo"), ("team-a", "echo"), ("team-a", "other")):
            assert chat(gw, key, model).status_code == 200
        assert chat(gw, "team-b", "echo", text="four five six seven").status_code == 200

        mine = usage(gw, "team-a").json()
        assert mine["object"] == "usage"
        assert mine["query"]["api_key_id"] == "team-a"  # a key reads its own usage only
        totals = mine["totals"]
        assert totals["requests"] == 3 and totals["failed_requests"] == 0
        assert (totals["input_tokens"], totals["output_tokens"]) == (9, 9)
        # Only echo has prices: 2 requests x (3 x 1000 + 3 x 2000) per million tokens.
        assert totals["cost"] == pytest.approx(2 * (3 * 1000 + 3 * 2000) / 1e6)
        today = datetime.now(UTC).strftime("%Y-%m-%d")
        assert mine["per_day"] == [{"date": today, **totals}]

        assert usage(gw, "team-a", model="echo").json()["totals"]["requests"] == 2
        assert usage(gw, "team-a", tenant="acme").json()["totals"]["requests"] == 3
        assert usage(gw, "team-a", tenant="globex").json()["totals"]["requests"] == 0
        assert usage(gw, "team-b").json()["totals"]["input_tokens"] == 4
        now = time.time()
        assert usage(gw, "team-a", start=now + 60).json()["totals"]["requests"] == 0
        assert usage(gw, "team-a", end=now - 3600).json()["totals"]["requests"] == 0
        assert usage(gw, "team-a", start=today).json()["totals"]["requests"] == 3
        assert (
            usage(gw, "team-a", start=f"{today}T00:00:00Z", end=now + 60).json()["totals"][
                "requests"
            ]
            == 3
        )

        other_key = usage(gw, "team-a", api_key="team-b")
        assert other_key.status_code == 403
        assert other_key.json()["error"]["param"] == "api_key"
        bad_time = usage(gw, "team-a", start="yesterday-ish")
        assert bad_time.status_code == 400
        assert bad_time.json()["error"]["param"] == "start"
        assert httpx.get(f"{gw}/v1/usage").status_code == 401


def test_infermux_usage_prints_the_ledger_from_the_file_or_from_a_server(
    telemetry: Telemetry,
    telemetry_gateway: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ledger = tmp_path / "ledger.sqlite3"
    with telemetry_gateway(keyed_config()) as gw:
        assert chat(gw, "team-a").status_code == 200
        assert chat(gw, "team-b", "other").status_code == 200
        capsys.readouterr()

        assert infermux(["usage", "--url", gw, "--api-key", KEYS["team-a"], "--json"]) == 0
        from_server = json.loads(capsys.readouterr().out)
        assert from_server["totals"]["requests"] == 1

    assert infermux(["usage", "--db", str(ledger)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "usage: all records"
    header = lines[2].split()
    assert header[:6] == ["DAY", "REQUESTS", "FAILED", "INPUT", "CACHED", "OUTPUT"]
    total = lines[-1].split()
    assert total[:6] == ["TOTAL", "2", "0", "6", "0", "6"]
    assert float(total[6]) == pytest.approx((3 * 1000 + 3 * 2000) / 1e6)

    assert infermux(["usage", "--db", str(ledger), "--key", "team-b", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["totals"]["requests"] == 1 and report["totals"]["cost"] == 0

    assert infermux(["usage", "--db", str(tmp_path / "missing.sqlite3")]) == 1
    assert "no usage ledger" in capsys.readouterr().err
    assert infermux(["usage", "--db", str(ledger), "--start", "soon"]) == 2


def test_a_spent_budget_refuses_with_429_and_survives_a_restart(
    telemetry: Telemetry, telemetry_gateway: Any, tmp_path: Path
) -> None:
    config = keyed_config(
        budgets=[
            {"api_key": "team-a", "limit": 0.005, "period": "month"},
            {"tenant": "globex", "limit": 0.0, "period": "total"},
        ]
    )
    with telemetry_gateway(config) as gw:
        assert chat(gw, "team-a").status_code == 200  # costs 0.009: the budget is now spent
        refused = chat(gw, "team-a")
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert error["code"] == "budget_exceeded"
        assert "budget of API key 'team-a' is exhausted" in error["message"]
        assert "renews" in error["message"]
        tenant_refused = chat(gw, "team-b")  # a zero budget for its tenant
        assert tenant_refused.status_code == 429
        assert "tenant 'globex'" in tenant_refused.json()["error"]["message"]
        metrics = httpx.get(f"{gw}/metrics").text
        assert 'status="budget_exceeded"' in metrics
    with sqlite3.connect(tmp_path / "ledger.sqlite3") as connection:
        # Refused requests never reached a backend: no records for them.
        assert connection.execute("SELECT COUNT(*) FROM usage_records").fetchone()[0] == 1

    with telemetry_gateway(config) as gw:  # the totals are read back from the ledger
        assert chat(gw, "team-a").status_code == 429
