"""Structured outputs on the llama.cpp backend (the default gateway): the llguidance masks
written into llama.cpp's logits rows before its sampler chain. Every output of the shared
JSON-schema suite that ends by itself validates; regex and choice always match."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from tests.core_engine.structured_schemas import SCHEMAS

pytestmark = pytest.mark.slow


def test_every_schema_output_validates_on_llamacpp(default_client: Any) -> None:
    def one(entry: tuple[str, str, dict[str, Any]]) -> tuple[str, Any, dict[str, Any]]:
        name, what, schema = entry
        reply = default_client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": f"Reply with {what} as JSON."}],
            max_tokens=160, temperature=0.7, seed=len(name),
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
        )
        return name, reply.choices[0], schema

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, SCHEMAS))
    finished = 0
    for _name, choice, schema in results:
        if choice.finish_reason == "length":
            continue
        finished += 1
        jsonschema.validate(json.loads(choice.message.content), schema)
    assert finished >= len(SCHEMAS) - 3, f"only {finished} of {len(SCHEMAS)} finished"


def test_regex_choice_and_parse_on_llamacpp(default_client: Any) -> None:
    code = default_client.completions.create(
        model="smollm2", prompt="Code:", max_tokens=16, temperature=1.0, seed=2,
        extra_body={"guided_regex": "[A-Z]{2}[0-9]{3}"},
    )
    assert re.fullmatch("[A-Z]{2}[0-9]{3}", code.choices[0].text)
    pick = default_client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Pick a fruit."}], max_tokens=8,
        extra_body={"guided_choice": ["apple", "pear"]},
    )
    assert pick.choices[0].message.content in ("apple", "pear")
    with pytest.raises(openai.BadRequestError) as info:
        default_client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "x"}], max_tokens=4,
            extra_body={"guided_regex": "(unclosed"},
        )
    assert info.value.body["param"] == "guided_regex"
