"""Two ``infermux serve`` replicas sharing one real redis-server: rate limits and budgets
count once across both, and a Redis killed under load gives the configured behaviour."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from servers import Gateway, RedisServer, serving

from gateway.http.auth import hash_key

TEN_WORDS = " ".join(f"w{i}" for i in range(10))
# (id, limits): one key per test, so tests sharing the replicas do not share a bucket.
KEYS = {
    "alice": "rpm = 6",
    "bob": "tpm = 20",
    "carol": "",  # a budget
    "dave": "rpm = 100000",  # limited (so admission asks Redis), never reached
    "erin": "rpm = 3",
    "fay": "max_concurrent = 2",
}


def config_text(*, on_unavailable: str, ledger_extra: str = "") -> str:
    keys = "".join(
        f'[[auth.keys]]\nid = "{key}"\nkey_sha256 = "{hash_key("k-" + key)}"\n{limits}\n'
        for key, limits in KEYS.items()
    )
    return (
        '[state]\nbackend = "redis"\nurl_env = "TEST_REDIS_URL"\n'
        f'on_unavailable = "{on_unavailable}"\nretry_interval_s = 0.2\n'
        '[[backends]]\nname = "mock"\nkind = "mock"\n'
        '[[backends]]\nname = "slow"\nkind = "mock"\n[backends.options]\ntoken_delay_s = 0.05\n'
        '[[models]]\nalias = "echo"\nbackends = ["mock"]\n'
        '[[models]]\nalias = "slow"\nbackends = ["slow"]\n'
        f"{keys}"
        f"[cost]\n{ledger_extra}"
        # One dollar a token: one ten-word request (20 tokens) spends carol's budget.
        '[[cost.prices]]\nmodel = "echo"\ninput_per_mtok = 1000000.0\n'
        "output_per_mtok = 1000000.0\n"
        '[[cost.budgets]]\napi_key = "carol"\nlimit = 5.0\nperiod = "total"\n'
    )


@contextmanager
def replicas(tmp_path: Path, redis: RedisServer, *, on_unavailable: str) -> Iterator[list[Gateway]]:
    config = tmp_path / f"{on_unavailable}.toml"
    config.write_text(config_text(on_unavailable=on_unavailable))
    with ExitStack() as stack:
        gateways = [
            stack.enter_context(
                serving(
                    config,
                    {
                        "TEST_REDIS_URL": redis.url,
                        "INFERMUX_LEDGER_PATH": str(tmp_path / f"ledger-{index}.sqlite3"),
                    },
                )
            )
            for index in range(2)
        ]
        yield gateways


@pytest.fixture(scope="module")
def closed_pair(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Gateway]]:
    with replicas(tmp_path_factory.mktemp("closed"), redis_server, on_unavailable="closed") as gws:
        yield gws


def chat(gw: Gateway, key: str, content: str = "hi") -> httpx.Response:
    return httpx.post(
        f"{gw}/v1/chat/completions",
        json={"model": "echo", "messages": [{"role": "user", "content": content}]},
        headers={"authorization": f"Bearer k-{key}"},
        timeout=30,
    )


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_two_replicas_grant_a_key_its_requests_per_minute_once(
    redis: RedisServer, closed_pair: list[Gateway]
) -> None:
    started = time.monotonic()
    answers = [chat(closed_pair[i % 2], "alice") for i in range(16)]
    elapsed = time.monotonic() - started
    codes = [a.status_code for a in answers]
    assert set(codes) == {200, 429}, codes
    assert codes[:2] == [200, 200]  # both replicas served the key
    # 6 per minute across both; the bucket refills 0.1 requests a second meanwhile.
    assert 6 <= codes.count(200) <= 6 + math.ceil(elapsed * 6 / 60), codes
    refused = next(a for a in answers if a.status_code == 429)
    assert error_of(refused)["code"] == "rate_limit_exceeded"
    assert "alice" in error_of(refused)["message"]
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-ratelimit-limit-requests"] == "6"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"


def test_tokens_used_on_one_replica_count_on_the_other(
    redis: RedisServer, closed_pair: list[Gateway]
) -> None:
    a, b = closed_pair
    first = chat(a, "bob", TEN_WORDS)
    assert first.status_code == 200
    assert first.json()["usage"]["total_tokens"] == 20
    # The 20 tokens were charged in Redis before the response ended: the other replica
    # refuses the key's next request, through the official client too.
    with pytest.raises(openai.RateLimitError) as caught:
        openai.OpenAI(base_url=f"{b}/v1", api_key="k-bob", max_retries=0).chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.response.headers["x-ratelimit-remaining-tokens"] == "0"
    assert "tokens per minute" in str(caught.value)


def test_a_budget_is_spent_once_across_replicas(
    redis: RedisServer, closed_pair: list[Gateway]
) -> None:
    a, b = closed_pair
    assert chat(a, "carol", TEN_WORDS).status_code == 200  # $20 of a $5 total budget
    for gw in (b, a):
        refused = chat(gw, "carol")
        assert refused.status_code == 429
        error = error_of(refused)
        assert error["code"] == "budget_exceeded"
        assert "20.0000 USD spent of 5.0000 USD" in error["message"]


def _load(gateways: list[Gateway], key: str, num_requests: int, kill_after: int,
          redis: RedisServer) -> list[tuple[int, str | None]]:  # fmt: skip
    """``num_requests`` from 4 threads over both replicas; Redis is killed once
    ``kill_after`` of them were answered. (status, error code) of each, in answer order."""
    answered: list[tuple[int, str | None]] = []
    lock = threading.Lock()

    def one(index: int) -> None:
        response = chat(gateways[index % 2], key)
        code = None if response.status_code == 200 else error_of(response)["code"]
        with lock:
            answered.append((response.status_code, code))
            if len(answered) == kill_after:
                redis.kill()

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(num_requests)))
    return answered


def test_redis_killed_under_load_fails_closed_then_limits_return(
    redis: RedisServer, closed_pair: list[Gateway]
) -> None:
    answered = _load(closed_pair, "dave", 60, kill_after=10, redis=redis)
    # Only answers a client can act on: served, or 503 naming the shared state store.
    assert set(answered) <= {(200, None), (503, "state_store_unavailable")}, answered
    assert answered[:10] == [(200, None)] * 10
    assert answered[-10:] == [(503, "state_store_unavailable")] * 10
    down = chat(closed_pair[1], "dave")
    assert down.status_code == 503 and int(down.headers["retry-after"]) >= 1
    assert "on_unavailable" in error_of(down)["message"]

    redis.start()  # back, empty: the next request past retry_interval_s reaches it
    time.sleep(0.3)  # retry_interval_s = 0.2: not a timing assertion, a wait for it
    codes = [chat(closed_pair[i % 2], "erin").status_code for i in range(6)]
    assert codes == [200, 200, 200, 429, 429, 429]  # erin's 3 per minute, shared again
    for gw in closed_pair:
        log = gw.log_path.read_text()
        assert log.count("shared state store (Redis) unreachable") == 1, log
        assert log.count("reachable again") == 1, log


def test_redis_killed_fails_open_on_each_replicas_own_limits(
    redis: RedisServer, tmp_path: Path
) -> None:
    with replicas(tmp_path, redis, on_unavailable="open") as pair:
        assert chat(pair[0], "erin").status_code == 200
        redis.kill()
        codes = [chat(pair[i % 2], "erin").status_code for i in range(10)]
        # No 5xx: each replica admits erin's 3 per minute on its own, then refuses.
        assert codes.count(200) == 6 and codes.count(429) == 4, codes
        redis.start()
        time.sleep(0.3)
        # Redis came back empty: one shared bucket of 3 again.
        back = [chat(pair[i % 2], "erin").status_code for i in range(6)]
        assert back == [200, 200, 200, 429, 429, 429], back


def test_a_keys_concurrency_cap_holds_across_replicas(
    redis: RedisServer, closed_pair: list[Gateway]
) -> None:
    a, b = closed_pair
    body = {
        "model": "slow",
        "stream": True,
        "messages": [{"role": "user", "content": TEN_WORDS}],
    }
    headers = {"authorization": "Bearer k-fay"}
    with httpx.Client(timeout=30) as client, ExitStack() as streams:
        opened = []
        for gw in (a, b):  # one stream in flight on each replica
            response = streams.enter_context(
                client.stream("POST", f"{gw}/v1/chat/completions", json=body, headers=headers)
            )
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            opened.append(lines)
        refused = chat(a, "fay")
        assert refused.status_code == 429
        assert "at most 2 at once" in error_of(refused)["message"]
        for lines in opened:  # to the end: the leases are given back before [DONE]
            assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"
    assert chat(b, "fay").status_code == 200
