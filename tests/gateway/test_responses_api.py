"""The Responses API with the official ``openai`` client: ``responses.create``,
``responses.stream``, ``previous_response_id`` chains, retrieve and delete, per-key
isolation of stored responses, errors naming the field, and the ledger row of each
response - on a live gateway with the mock backend (the real model: tests/e2e)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest

from gateway.config.types import ApiKeyConfig, AuthConfig
from gateway.http.auth import hash_key
from gateway.openai.response_store import ResponseStore
from gateway.testing import LiveGateway, gateway_config, mock_backend

ALICE = "sk-alice-responses-0123456789"
BOB = "sk-bob-responses-9876543210"
KEYS = AuthConfig(
    keys=[
        ApiKeyConfig(id="alice", key_sha256=hash_key(ALICE)),
        ApiKeyConfig(id="bob", key_sha256=hash_key(BOB)),
    ]
)


@pytest.fixture(scope="module")
def gw(live_gateway: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveGateway, Path]]:
    ledger = tmp_path_factory.mktemp("responses") / "ledger.sqlite3"
    config = gateway_config(mock_backend("mock"), auth=KEYS)
    config = msgspec.structs.replace(config, cost=msgspec.structs.replace(config.cost, ledger_path=str(ledger)))
    with live_gateway(config) as gateway:
        yield gateway, ledger


def client(gateway: LiveGateway, key: str = ALICE) -> Any:
    return gateway.openai_client(api_key=key)


def test_create_answers_a_response_object_with_usage(gw: tuple[LiveGateway, Path]) -> None:
    gateway, _ = gw
    response = client(gateway).responses.create(model="echo", input="alpha beta gamma", instructions="Be brief.")
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed"
    assert response.output_text == "alpha beta gamma"  # the mock echoes the last user turn
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    assert response.usage is not None and response.usage.output_tokens == 3
    assert response.usage.total_tokens == response.usage.input_tokens + 3
    seen = gateway.backend("mock").received[-1].messages
    assert [(m.role, m.content) for m in seen] == [("system", "Be brief."), ("user", "alpha beta gamma")]


def test_the_stream_is_the_typed_event_sequence_and_ends_as_stored(gw: tuple[LiveGateway, Path]) -> None:
    gateway, _ = gw
    alice = client(gateway)
    with alice.responses.stream(model="echo", input="one two three") as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 3 and "".join(deltas) == final.output_text == "one two three"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert alice.responses.retrieve(final.id).output_text == final.output_text
    # No "data: [DONE]" after response.completed (the Responses API has none).
    with httpx.stream(
        "POST",
        f"{gateway}/v1/responses",
        json={"model": "echo", "input": "x", "stream": True},
        headers={"authorization": f"Bearer {ALICE}"},
    ) as raw:
        lines = [line for line in raw.iter_lines() if line]
    assert lines[-2] == "event: response.completed" and "[DONE]" not in lines[-1]


def test_previous_response_id_chains_the_conversation_without_old_instructions(
    gw: tuple[LiveGateway, Path],
) -> None:
    gateway, _ = gw
    alice = client(gateway)
    first = alice.responses.create(model="echo", input="red", instructions="Only colours.")
    second = alice.responses.create(model="echo", input="green", previous_response_id=first.id)
    third = alice.responses.create(
        model="echo",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "blue"}]}],
        previous_response_id=second.id,
        instructions="New rules.",
    )
    assert third.previous_response_id == second.id
    seen = gateway.backend("mock").received[-1].messages
    assert [(m.role, m.content) for m in seen] == [
        ("system", "New rules."),
        ("user", "red"),
        ("assistant", "red"),
        ("user", "green"),
        ("assistant", "green"),
        ("user", "blue"),
    ]


def test_function_call_items_reach_the_backend_as_chat_tool_turns(gw: tuple[LiveGateway, Path]) -> None:
    gateway, _ = gw
    client(gateway).responses.create(
        model="echo",
        input=[
            {"role": "user", "content": "weather in Paris and Rome?"},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"city": "Rome"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2", "output": "rain"},
        ],
    )
    seen = gateway.backend("mock").received[-1].messages
    assert [m.role for m in seen] == ["user", "assistant", "tool", "tool"]
    assert [(c.id, c.name, c.arguments) for c in seen[1].tool_calls] == [
        ("c1", "weather", '{"city": "Paris"}'),
        ("c2", "weather", '{"city": "Rome"}'),
    ]
    assert [(m.tool_call_id, m.content) for m in seen[2:]] == [("c1", "sunny"), ("c2", "rain")]


def test_retrieve_and_delete_and_store_false(gw: tuple[LiveGateway, Path]) -> None:
    gateway, _ = gw
    alice = client(gateway)
    kept = alice.responses.create(model="echo", input="keep me", metadata={"k": "v"})
    got = alice.responses.retrieve(kept.id)
    assert got.output_text == "keep me" and got.metadata == {"k": "v"}
    alice.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.delete(kept.id)
    unstored = alice.responses.create(model="echo", input="forget me", store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(unstored.id)


def test_a_key_never_reads_continues_or_deletes_another_keys_response(
    gw: tuple[LiveGateway, Path],
) -> None:
    gateway, _ = gw
    alice, bob = client(gateway, ALICE), client(gateway, BOB)
    secret = alice.responses.create(model="echo", input="alice secret")
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(secret.id)
    with pytest.raises(openai.NotFoundError) as caught:
        bob.responses.create(model="echo", input="tell me", previous_response_id=secret.id)
    assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(secret.id)
    assert alice.responses.retrieve(secret.id).output_text == "alice secret"  # still there


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": []}, 400, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, 400, "input[0].role"),
        ({"input": [{"type": "reasoning", "role": "user", "content": "x"}]}, 400, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400, "input[0].content[0]"),
        ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"input": "x", "temperature": 5}, 400, "temperature"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, 400, "text.format.type"),
        ({"input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
        # The mock backend has no tool calling: the router's capability check names tools.
        ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, 400, "tools"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
        ({"input": "x", "tools": [{"type": "function", "name": "bad name!"}]}, 400, "tools[0].name"),
        ({"input": "x", "tool_choice": "required"}, 400, "tool_choice"),
        ({"input": [{"type": "function_call", "name": "f"}]}, 400, "input[0]"),
        ({"input": [{"type": "function_call_output", "call_id": "c1"}]}, 400, "input[0]"),
        ({"input": "x", "model": "nope"}, 404, "model"),
        ({}, 400, "input"),
    ],
)
def test_bad_input_gets_the_openai_envelope_naming_the_field(
    gw: tuple[LiveGateway, Path], body: dict[str, Any], status: int, param: str
) -> None:
    gateway, _ = gw
    answer = httpx.post(
        f"{gateway}/v1/responses",
        json={"model": "echo", **body},
        headers={"authorization": f"Bearer {ALICE}"},
    )
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["param"] == param


def test_each_response_leaves_a_ledger_row_under_its_key(gw: tuple[LiveGateway, Path]) -> None:
    gateway, ledger = gw
    with httpx.Client(headers={"authorization": f"Bearer {BOB}"}) as http:
        for stream in (False, True):
            answer = http.post(f"{gateway}/v1/responses", json={"model": "echo", "input": "a b", "stream": stream})
            assert answer.status_code == 200
            request_id = answer.headers["x-request-id"]
            with sqlite3.connect(ledger) as connection:
                row = connection.execute(
                    "SELECT api_key_id, kind, status, output_tokens FROM usage_records WHERE request_id = ?",
                    (request_id,),
                ).fetchone()
            assert row == ("bob", "chat", "ok", 2)


def test_retention_keeps_the_newest_per_key_and_drops_expired_ones(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "store.sqlite3", max_per_key=2)
    for i in range(3):
        store.put(f"r{i}", "k", b"{}", [])
    store.put("other", "j", b"{}", [])
    assert store.get("r0", "k") is None  # the oldest of k's three went
    assert store.get("r1", "k") is not None and store.get("r2", "k") is not None
    assert store.get("other", "j") is not None  # another key's rows are not k's budget
    assert store.get("r2", "j") is None and store.get("r2", None) is None  # keyed reads
    store.max_age_s = 0.0  # everything stored so far is now too old
    assert store.get("r2", "k") is None
    store.close()
