"""Structured outputs through the gateway with the official ``openai`` client: the SDK's
``parse()`` and ``stream()`` helpers with a Pydantic model, vLLM's ``guided_*`` fields, and
the errors a bad constraint gets - against the real core engine in its engine process.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from backends.base import BackendConfig
from gateway.testing import LiveGateway, gateway_config

pytestmark = pytest.mark.slow


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=100)
    kind: Literal["capital", "city", "town"]


@pytest.fixture(scope="module")
def gw(live_gateway: Any) -> Iterator[LiveGateway]:
    config = gateway_config(
        BackendConfig(name="core", kind="core_engine", options={"kv_cache_memory_mb": 128}),
        models={"core": ["core"]},
    )
    with live_gateway(config) as gateway:
        yield gateway


MESSAGES = [{"role": "user", "content": "Describe Paris as JSON."}]


def test_the_sdk_parse_helper_gets_a_validated_pydantic_object(gw: LiveGateway) -> None:
    client = gw.openai_client(timeout=120)
    completion = client.beta.chat.completions.parse(
        model="core", messages=MESSAGES, response_format=City, max_tokens=120, temperature=0,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, City)
    assert City.model_validate_json(message.content or "") == message.parsed


def test_the_sdk_stream_helper_assembles_the_same_object(gw: LiveGateway) -> None:
    client = gw.openai_client(timeout=120)
    with client.beta.chat.completions.stream(
        model="core", messages=MESSAGES, response_format=City, max_tokens=120, temperature=0,
    ) as stream:
        deltas = [e for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert len(deltas) > 3  # it did stream
    message = final.choices[0].message
    assert isinstance(message.parsed, City)
    assert "".join(e.delta for e in deltas) == message.content  # the deltas are the whole text


def test_vllm_guided_fields_constrain_chat_and_completions(gw: LiveGateway) -> None:
    client = gw.openai_client(timeout=120)
    choice = client.chat.completions.create(
        model="core", messages=[{"role": "user", "content": "Capital of Italy?"}], max_tokens=8,
        extra_body={"guided_choice": ["Rome", "Milan", "Naples"]},
    )
    assert choice.choices[0].message.content in ("Rome", "Milan", "Naples")
    code = client.completions.create(
        model="core", prompt="Product code:", max_tokens=16, temperature=0.9, seed=4,
        extra_body={"guided_regex": "[A-Z]{3}-[0-9]{4}"},
    )
    assert re.fullmatch("[A-Z]{3}-[0-9]{4}", code.choices[0].text)
    # Seeded: unseeded, one run in a whole suite sampled whitespace between the items until
    # max_tokens cut the array ("length": the one case where the output may not parse).
    listed = client.chat.completions.create(
        model="core", messages=[{"role": "user", "content": "Two colours."}], max_tokens=40, seed=5,
        extra_body={"structured_outputs": {"json": {"type": "array", "items": {"enum": ["red", "blue"]},
                                                     "minItems": 2, "maxItems": 2}}},
    )
    if listed.choices[0].finish_reason != "length":
        assert set(__import__("json").loads(listed.choices[0].message.content or "[]")) <= {"red", "blue"}
    # vLLM's disable_any_whitespace: compact JSON, through the HTTP API.
    compact = client.chat.completions.create(
        model="core", messages=[{"role": "user", "content": "Two colours."}], max_tokens=40, seed=5,
        extra_body={"structured_outputs": {"json": {"type": "array", "items": {"enum": ["red", "blue"]},
                                                     "minItems": 2, "maxItems": 2}, "disable_any_whitespace": True}},
    ).choices[0]
    text = compact.message.content or ""
    assert compact.finish_reason == "stop" and text in ('["red","blue"]', '["blue","red"]', '["red","red"]', '["blue","blue"]')


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
        ({"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}},
         "structured_outputs.disable_any_whitespace"),
        ({"structured_outputs": {"json": {}, "disable_any_whitespace": "yes"}},
         "structured_outputs.disable_any_whitespace"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}},
         "response_format"),
    ],
)
def test_a_constraint_the_engine_rejects_is_a_400_naming_the_field_and_the_server_stays_up(
    gw: LiveGateway, fields: dict[str, Any], param: str
) -> None:
    body = {"model": "core", "messages": MESSAGES, "max_tokens": 4, **fields}
    response = httpx.post(f"{gw}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    client = gw.openai_client(timeout=60)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="core", messages=MESSAGES, max_tokens=4, extra_body=fields)
    ok = client.chat.completions.create(model="core", messages=MESSAGES, max_tokens=4)
    assert ok.choices[0].message.content is not None
