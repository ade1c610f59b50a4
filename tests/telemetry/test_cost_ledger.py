"""Cost accounting: prices, the per-hour share, and one durable ledger record per request."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.base import Usage
from plugins.builtin.cost.config import PriceConfig
from plugins.builtin.cost.ledger import Ledger, LedgerError, UsageRecord
from plugins.builtin.cost.pricing import PriceBook, ShareMeter
from tests.telemetry.telemetry_util import Telemetry, make_config, mock


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_busy_backend_price_is_split_among_requests_in_flight_and_idle_time_is_free() -> None:
    clock = FakeClock()
    meter = ShareMeter(clock)
    meter.enter("gpu", "a")  # t=0: a alone
    clock.now = 10
    meter.enter("gpu", "b")  # t=10..20: a and b share
    clock.now = 20
    share_a = meter.leave("gpu", "a")
    clock.now = 30
    share_b = meter.leave("gpu", "b")  # t=20..30: b alone
    clock.now = 40  # t=30..40: idle, charged to nobody
    meter.enter("gpu", "c")
    clock.now = 50
    share_c = meter.leave("gpu", "c")
    assert share_a == pytest.approx(10 + 10 / 2)
    assert share_b == pytest.approx(10 / 2 + 10)
    assert share_c == pytest.approx(10)
    # Every busy second is paid exactly once (30 s + 10 s); the idle 10 s by nobody.
    assert share_a + share_b + share_c == pytest.approx(40)
    assert meter.leave("gpu", "never-entered") == 0


def test_the_most_specific_price_applies_and_cached_tokens_have_their_own_price() -> None:
    book = PriceBook(
        [
            PriceConfig(model="gpt", input_per_mtok=1.0, output_per_mtok=2.0),
            PriceConfig(backend="remote", input_per_mtok=10.0, cached_input_per_mtok=5.0),
            PriceConfig(model="gpt", backend="remote", input_per_mtok=100.0),
            PriceConfig(backend="gpu-box", per_hour=7.2),
        ]
    )
    usage = Usage(prompt_tokens=1_000_000, completion_tokens=500_000, cached_tokens=400_000)
    assert book.token_cost("gpt", "remote", usage) == pytest.approx(100.0)  # model + backend
    assert book.token_cost("other", "remote", usage) == pytest.approx(6 + 2)  # backend rule
    assert book.token_cost("gpt", "local", usage) == pytest.approx(1 + 1)  # model rule
    assert book.token_cost("other", "local", usage) == 0  # no rule: free
    assert book.per_second("other", "gpu-box") == pytest.approx(0.002)
    assert book.per_second("gpt", "remote") == 0


def _record(request_id: str, **fields: Any) -> UsageRecord:
    values: dict[str, Any] = {
        "request_id": request_id,
        "created_at": 1_764_400_000.0,
        "finished_at": 1_764_400_001.0,
        "model": "m",
        "kind": "chat",
        "status": "ok",
        **fields,
    }
    return UsageRecord(**values)


def test_the_ledger_group_commits_concurrent_writes_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "ledger.sqlite3"
    ledger = Ledger(path)
    futures = []
    lock = threading.Lock()

    def writer(worker: int) -> None:
        for i in range(50):
            future = ledger.submit(_record(f"w{worker}-{i}", output_tokens=i))
            with lock:
                futures.append(future)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for future in futures:
        future.result(timeout=30)
    # A resolved future means committed: a second connection sees every row now.
    with sqlite3.connect(path) as reader:
        assert reader.execute("SELECT COUNT(*) FROM usage_records").fetchone()[0] == 400
        assert reader.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    ledger.close()
    reopened = Ledger(path)  # reopening keeps the rows and the schema
    report = reopened.query(_query())
    assert report.totals.requests == 400
    assert report.totals.output_tokens == 8 * sum(range(50))
    reopened.close()


def _query() -> Any:
    from plugins.usage_report import UsageQuery

    return UsageQuery()


def test_a_bad_record_fails_alone_and_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    ledger = Ledger(path)
    ledger.submit(_record("same")).result(timeout=10)
    duplicate = ledger.submit(_record("same"))
    fine = ledger.submit(_record("other"))
    with pytest.raises(LedgerError):
        duplicate.result(timeout=10)
    fine.result(timeout=10)
    ledger.close()
    with sqlite3.connect(path) as connection:
        connection.execute("PRAGMA user_version = 99")
    with pytest.raises(LedgerError, match="schema 99"):
        Ledger(path)


@pytest.mark.parametrize("synchronous", ["normal", "full"])
def test_writes_from_the_event_loop_are_committed_when_they_return(
    tmp_path: Path, synchronous: Any
) -> None:
    path = tmp_path / "ledger.sqlite3"
    ledger = Ledger(path, synchronous=synchronous)

    async def main() -> list[Any]:
        # Fifty at once ("full": group-committed by the writer thread); a repeated id fails
        # alone.
        records = [_record(f"r{i}", output_tokens=i) for i in range(50)] + [_record("r7")]
        return await asyncio.gather(
            *(ledger.write(record) for record in records), return_exceptions=True
        )

    outcomes = asyncio.run(main())
    assert outcomes[:50] == [None] * 50
    assert isinstance(outcomes[50], LedgerError) and "r7" in str(outcomes[50])
    with sqlite3.connect(path) as reader:  # before close: committed on return
        assert reader.execute(
            "SELECT COUNT(*), SUM(output_tokens) FROM usage_records"
        ).fetchone() == (
            50,
            sum(range(50)),
        )
    ledger.close()


def test_another_writer_holding_the_ledger_does_not_stall_the_event_loop(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    ledger = Ledger(path)
    # Another process's gateway sharing the file, in the middle of a transaction.
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")

    async def main() -> tuple[int, bool]:
        write = asyncio.create_task(ledger.write(_record("waits")))
        turns = 0
        for _ in range(20):  # 0.2 s in which the loop must keep turning
            await asyncio.sleep(0.01)
            turns += 1
        waiting = not write.done()
        other.execute("COMMIT")
        await asyncio.wait_for(write, timeout=15)
        return turns, waiting

    turns, waiting = asyncio.run(main())
    assert turns == 20
    assert waiting  # it could not commit while the lock was held...
    assert "waits" in ledger_rows(path)  # ...and did once it was released
    other.close()
    ledger.close()


def test_the_wal_starts_over_while_requests_keep_coming(tmp_path: Path) -> None:
    """The loop never checkpoints; the writer thread does, also when writes never pause."""
    path = tmp_path / "ledger.sqlite3"
    ledger = Ledger(path)
    count = 3000

    async def main() -> None:
        for i in range(count):
            await ledger.write(_record(f"r{i}"))
            # The rest of a request: 0.1 ms in which the loop does not yield. A sleep, not a
            # spin: most of a gateway's own work (sockets, C code) lets go of the GIL, and a
            # spin holding it starved the writer thread whenever the other test worker kept
            # both cores busy (the WAL then reached 1.6x count pages in a full run).
            time.sleep(1e-4)

    asyncio.run(main())
    with sqlite3.connect(path) as reader:
        page_size = reader.execute("PRAGMA page_size").fetchone()[0]
        assert reader.execute("SELECT COUNT(*) FROM usage_records").fetchone()[0] == count
    # Each record writes about five pages (the table and four indexes): never starting over,
    # the WAL file would reach ~5 * count of them (it keeps its largest size).
    wal_pages = (path.with_name(path.name + "-wal")).stat().st_size / page_size
    assert wal_pages < 2 * count
    ledger.close()


def test_a_usage_report_in_progress_does_not_hold_up_the_records(tmp_path: Path) -> None:
    """A reader with an open snapshot (a long ``GET /v1/usage``) keeps the WAL from starting
    over; the checkpoint must then give up, not hold the write lock for its 10 s busy wait."""
    path = tmp_path / "ledger.sqlite3"
    ledger = Ledger(path)
    reader = sqlite3.connect(path, isolation_level=None)

    async def main() -> None:
        await ledger.write(_record("before"))
        reader.execute("BEGIN")
        reader.execute("SELECT COUNT(*) FROM usage_records").fetchone()
        for i in range(450):  # two checkpoints' worth, with the snapshot held throughout
            await ledger.write(_record(f"r{i}"))
            await asyncio.sleep(0.001)  # let the writer thread run its checkpoint

    # A guard against the stall (normally ~1 s; one blocked checkpoint alone is 10 s).
    asyncio.run(asyncio.wait_for(main(), timeout=8))
    reader.execute("COMMIT")
    reader.close()
    assert len(ledger_rows(path)) == 451
    ledger.close()


def ledger_rows(path: Path) -> dict[str, dict[str, Any]]:
    with sqlite3.connect(path) as connection:
        connection.row_factory = sqlite3.Row
        return {
            row["request_id"]: dict(row)
            for row in connection.execute("SELECT * FROM usage_records")
        }


def test_a_completed_response_is_already_in_the_ledger(
    telemetry: Telemetry, telemetry_gateway: Any, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger.sqlite3"
    with telemetry_gateway(make_config(mock("a", token_delay_s=0.001))) as gw:
        for stream in (False, True, False, True):
            with httpx.stream(
                "POST",
                f"{gw}/v1/chat/completions",
                json={
                    "model": "echo",
                    "messages": [{"role": "user", "content": "is it recorded yet"}],
                    "stream": stream,
                },
            ) as answer:
                answer.read()  # up to the final bytes ([DONE] / the end of the body)
                request_id = answer.headers["x-request-id"]
            # No waiting: the record was committed before the final bytes were sent.
            row = ledger_rows(ledger)[request_id]
            assert row["status"] == "ok"
            assert row["output_tokens"] == 4


async def _ok(client: httpx.AsyncClient, stream: bool) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": "echo",
        "messages": [{"role": "user", "content": "alpha beta gamma delta epsilon"}],
        "stream": stream,
    }
    if not stream:
        answer = await client.post("/v1/chat/completions", json=payload)
        return {"id": answer.headers["x-request-id"], "usage": answer.json()["usage"]}
    payload["stream_options"] = {"include_usage": True}
    async with client.stream("POST", "/v1/chat/completions", json=payload) as answer:
        data = [line[6:] async for line in answer.aiter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        return {"id": answer.headers["x-request-id"], "usage": json.loads(data[-2])["usage"]}


async def _streamed_tokens(
    client: httpx.AsyncClient, model: str, *, stop_after: int | None
) -> dict[str, Any]:
    payload = {
        "model": model,
        "messages": [{"role": "user", "content": " ".join(f"w{i}" for i in range(40))}],
        "stream": True,
    }
    seen = 0
    async with client.stream("POST", "/v1/chat/completions", json=payload) as answer:
        request_id = answer.headers["x-request-id"]
        async for line in answer.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return {"id": request_id, "seen": seen, "error": event["error"]}
            if event["choices"] and event["choices"][0]["delta"].get("content"):
                seen += 1
            if stop_after is not None and seen >= stop_after:
                break  # the client goes away mid-stream
    return {"id": request_id, "seen": seen}


def test_concurrent_requests_leave_exactly_one_record_each_whatever_their_end(
    telemetry: Telemetry, telemetry_gateway: Any, tmp_path: Path
) -> None:
    config = make_config(
        mock("a", token_delay_s=0.005),
        mock("flaky", fail_after_tokens=2),
        mock("slow", token_delay_s=0.05),
        models={"echo": ["a"], "flaky": ["flaky"], "slow": ["slow"]},
    )
    ledger = tmp_path / "ledger.sqlite3"

    async def load(base_url: str) -> list[Any]:
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            jobs = [_ok(client, stream=i % 2 == 0) for i in range(12)]
            jobs += [_streamed_tokens(client, "flaky", stop_after=None) for _ in range(4)]
            jobs += [_streamed_tokens(client, "slow", stop_after=3) for _ in range(4)]
            results = await asyncio.gather(*jobs)
            refused = await client.post(
                "/v1/chat/completions",
                json={"model": "missing", "messages": [{"role": "user", "content": "x"}]},
            )
            assert refused.status_code == 404  # never reached a backend: no record
            return results

    with telemetry_gateway(config) as gw:
        results = asyncio.run(load(gw))
        # Aborted requests are recorded once their upstream work has stopped.
        ids = {r["id"] for r in results}
        rows: dict[str, dict[str, Any]] = {}
        for _ in range(500):
            rows = ledger_rows(ledger)
            if ids <= set(rows):
                break
            threading.Event().wait(0.02)
    assert len(results) == 20
    assert set(rows) == ids  # exactly one record per request, none for the refused one
    completed, failed, cancelled = results[:12], results[12:16], results[16:]
    for result in completed:
        row = rows[result["id"]]
        assert row["status"] == "ok"
        assert row["input_tokens"] == result["usage"]["prompt_tokens"]
        assert row["output_tokens"] == result["usage"]["completion_tokens"]
        assert row["backend"] == "a" and row["model"] == "echo"
    for result in failed:
        row = rows[result["id"]]
        assert result["error"]["code"] == row["error_code"] == "backend_error"
        assert row["status"] == "error"
        assert row["output_tokens"] == result["seen"] == 2  # what was streamed before it broke
    for result in cancelled:
        row = rows[result["id"]]
        assert row["status"] == "aborted"
        assert row["error_code"] == "request_aborted"
        assert row["output_tokens"] >= result["seen"] == 3


def test_a_per_hour_price_is_shared_by_concurrent_requests(
    telemetry: Telemetry, telemetry_gateway: Any, tmp_path: Path
) -> None:
    config = make_config(
        mock("box", token_delay_s=0.02),
        cost={"prices": [{"backend": "box", "per_hour": 3600.0}]},  # 1 per busy second
    )

    async def load(base_url: str) -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            await asyncio.gather(*(_ok(client, stream=False) for _ in range(3)))

    with telemetry_gateway(config) as gw:
        asyncio.run(load(gw))
    rows = list(ledger_rows(tmp_path / "ledger.sqlite3").values())
    assert len(rows) == 3
    assert all(row["cost"] > 0 for row in rows)
    # Shares add up to the backend's busy time, which fits in the window of the requests:
    # three requests running together pay for the window once, not three times.
    window = max(r["finished_at"] for r in rows) - min(r["created_at"] for r in rows)
    assert sum(row["cost"] for row in rows) <= window * 1.0 + 1e-6
    assert sum(row["cost"] for row in rows) < sum(row["duration_s"] for row in rows)


def test_token_prices_cost_exactly_the_recorded_tokens(
    telemetry: Telemetry, telemetry_gateway: Any, tmp_path: Path
) -> None:
    config = make_config(
        mock("api"),
        cost={
            "prices": [
                {"model": "echo", "input_per_mtok": 2.0, "output_per_mtok": 8.0},
            ]
        },
    )
    with telemetry_gateway(config) as gw:
        answer = httpx.post(
            f"{gw}/v1/chat/completions",
            json={"model": "echo", "messages": [{"role": "user", "content": "a b c d"}], "n": 3},
        )
    usage = answer.json()["usage"]
    (row,) = ledger_rows(tmp_path / "ledger.sqlite3").values()
    assert row["request_id"] == answer.headers["x-request-id"]
    assert row["num_choices"] == 3
    # One record for the HTTP request with the usage the client got (the prompt once) ...
    assert (
        (row["input_tokens"], row["output_tokens"])
        == (4, 12)
        == (
            usage["prompt_tokens"],
            usage["completion_tokens"],
        )
    )
    # ... and the cost of what the backend did: three choices, each with its own prompt.
    assert row["cost"] == pytest.approx((3 * 4 * 2.0 + 12 * 8.0) / 1e6)
