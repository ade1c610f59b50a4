"""Tool calling through the gateway with the official ``openai`` client, on the real default
model served by the core engine, llama.cpp and MLX (each in its worker process).

SmolLM2's template knows no tools, so these requests go through the fallback tool prompt and
the Hermes parser; ``required`` and named ``tool_choice`` are held to a grammar, so every call
is valid JSON that validates against its function's ``parameters``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from backends.base import BackendConfig
from gateway.testing import LiveGateway, gateway_config

pytestmark = pytest.mark.slow

BACKENDS = ("core", "llamacpp", "mlx")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 40}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = [
    "What is the weather in Paris?",
    "Is it raining in Tokyo right now? Use fahrenheit.",
    "What time is it in New York?",
    "Tell me the weather and the time in Berlin.",
]


def _backend(name: str, kind: str, **options: Any) -> BackendConfig:
    # A loaded CPU (a full run, MLX on the CPU) may take longer than the default first-byte
    # timeout (60 s) before the first token of an answer.
    return BackendConfig(name=name, kind=kind, options=options, first_byte_timeout=300.0, idle_timeout=120.0)


@pytest.fixture(scope="module")
def gw(live_gateway: Any) -> Iterator[LiveGateway]:
    config = gateway_config(
        _backend("core", "core_engine", kv_cache_memory_mb=128),
        _backend("llamacpp", "llamacpp", n_ctx=2048, parallel=2),
        _backend("mlx", "mlx", n_ctx=2048),
        models={name: [name] for name in BACKENDS},
    )
    with live_gateway(config) as gateway:
        yield gateway


def _valid_calls(message: Any, *, cut: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """The calls, each validated (``cut``: the last one may be cut by max_tokens)."""
    calls = []
    tool_calls = list(message.tool_calls or ())
    if cut:
        tool_calls = tool_calls[:-1]
    for call in tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


@pytest.mark.parametrize("model", BACKENDS)
def test_required_tool_choice_always_gives_valid_calls(gw: LiveGateway, model: str) -> None:
    client = gw.openai_client(timeout=180)
    prompts = PROMPTS if model != "mlx" else PROMPTS[:2]  # MLX on the CPU is the slow one
    for i, prompt in enumerate(prompts):
        completion = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, max_tokens=80, temperature=0.8, seed=i,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert len(_valid_calls(choice.message)) == 1
        assert choice.message.content is None


# The SSE shape and the SDK's stream helper are the gateway's, the same whatever the backend
# (every backend's deltas are checked by the matrix below).
@pytest.mark.parametrize("model", ["core"])
def test_streamed_tool_call_deltas_reassemble_to_the_non_streamed_call(gw: LiveGateway, model: str) -> None:
    client = gw.openai_client(timeout=180)
    request: dict[str, Any] = {
        "model": model, "messages": [{"role": "user", "content": PROMPTS[0]}], "tools": TOOLS,
        "tool_choice": "required", "max_tokens": 120, "temperature": 0,
        # One call: llama.cpp's greedy output may part between two requests where its reused
        # prompt cache rounds differently, and a second call is where this small model drifts.
        "parallel_tool_calls": False,
    }
    whole = client.chat.completions.create(**request)
    chunks = list(client.chat.completions.create(**request, stream=True))
    # OpenAI's shape: a call's first delta has index, id, type and name, then argument fragments.
    pieces = [tc for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or ())]
    assert pieces[0].id and pieces[0].function.name and pieces[0].type == "function"
    assert len(pieces) > 2  # the arguments came in fragments
    assert all(p.id is None and p.function.name is None for p in pieces[1:] if p.index == pieces[0].index)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The SDK's stream helper rebuilds the same call the non-streamed answer has.
    with client.beta.chat.completions.stream(**request) as stream:
        final = stream.get_final_completion()
    expected = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls or ()]
    assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls or ()] == expected
    streamed_args = "".join(p.function.arguments or "" for p in pieces if p.index == 0)
    assert streamed_args == expected[0][1]


@pytest.mark.parametrize("model", BACKENDS)
def test_a_tool_result_turn_gets_an_answer(gw: LiveGateway, model: str) -> None:
    client = gw.openai_client(timeout=180)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, max_tokens=80, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    call = first.choices[0].message.tool_calls[0]
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21, "sky": "sunny"})})
    second = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=40, temperature=0)
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length")
    assert answer.message.tool_calls is None or _valid_calls(answer.message)
    assert answer.message.content or answer.message.tool_calls
    # tool_choice "none": an answer in words, never a call.
    third = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=30, temperature=0
    )
    assert third.choices[0].message.tool_calls is None and third.choices[0].message.content


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"messages": [{"role": "tool", "content": "21 C"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls"),
    ],
)
def test_bad_tool_fields_are_400s_naming_them(gw: LiveGateway, body: dict[str, Any], param: str) -> None:
    payload = {"model": "core", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | body
    response = httpx.post(f"{gw}/v1/chat/completions", json=payload, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_the_openai_client_raises_bad_request_for_an_unknown_tool(gw: LiveGateway) -> None:
    client = gw.openai_client(timeout=60)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="core", messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "missing"}},
        )


# -- every backend, every tool_choice, streamed or not: each index is one valid call ---------
#
# Whatever the model chose to call, each index of ``delta.tool_calls`` reassembles to exactly
# one call with a known name, arguments that parse and validate against that tool's schema,
# and an id of its own, on the core engine, llama.cpp and MLX alike. How many calls a 135M
# model makes (and with which arguments) is a near-tie it may decide either way, so the count
# is held only where the request forces it: a named or ``required`` choice gives at least one
# call, ``parallel_tool_calls = false`` at most one (``auto`` included: later calls are
# dropped), a named choice only that function.

CHOICES: dict[str, Any] = {
    "named": {"type": "function", "function": {"name": "get_time"}},
    "required": "required",
    "auto": "auto",
}
#: Without ``parallel_tool_calls`` (OpenAI's default: several calls allowed) and with it false.
PARALLEL = {"unset": None, "single": False}

Call = tuple[str, str, str]  # (id, name, arguments)


@pytest.fixture(scope="module")
def answers() -> dict[tuple[str, ...], tuple[list[Call], str | None]]:
    """Non-streamed answers by (model, choice, parallel), asked once per module."""
    return {}


def _request(model: str, choice: str, parallel: str) -> dict[str, Any]:
    request: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "What time is it in Oslo?"}],
        "tools": TOOLS,
        "tool_choice": CHOICES[choice],
        "max_tokens": 60,
        "temperature": 0,
    }
    if PARALLEL[parallel] is not None:
        request["parallel_tool_calls"] = PARALLEL[parallel]
    return request


def _streamed(client: Any, request: dict[str, Any]) -> tuple[list[Call], str | None]:
    """The calls rebuilt from ``delta.tool_calls`` (fragments joined per index), checking
    OpenAI's shape: a call's first delta has its id, type and name, later ones only arguments."""
    calls: dict[int, list[str]] = {}
    finish_reason = None
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            finish_reason = choice.finish_reason or finish_reason
            for piece in choice.delta.tool_calls or ():
                if piece.index not in calls:
                    assert piece.id and piece.type == "function" and piece.function.name, piece
                    calls[piece.index] = [piece.id, piece.function.name, piece.function.arguments or ""]
                else:  # one name per index: a second call never continues under this index
                    assert piece.id is None and not piece.function.name, piece
                    calls[piece.index][2] += piece.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    return [(c[0], c[1], c[2]) for _, c in sorted(calls.items())], finish_reason


def _whole(client: Any, request: dict[str, Any]) -> tuple[list[Call], str | None]:
    choice = client.chat.completions.create(**request).choices[0]
    calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
    if calls:
        assert all(c.type == "function" for c in choice.message.tool_calls)
    return calls, choice.finish_reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("parallel", list(PARALLEL))
@pytest.mark.parametrize("choice", list(CHOICES))
@pytest.mark.parametrize("model", BACKENDS)
def test_each_tool_call_index_reassembles_to_one_valid_call(
    gw: LiveGateway, answers: dict[tuple[str, ...], Any], model: str, choice: str, parallel: str, stream: bool
) -> None:
    client = gw.openai_client(timeout=600)
    request = _request(model, choice, parallel)
    key = (model, choice, parallel)
    if key not in answers:
        answers[key] = _whole(client, request)
    calls, finish_reason = _streamed(client, request) if stream else answers[key]

    # max_tokens may cut the last call; every call before it is whole.
    complete = calls[:-1] if finish_reason == "length" else calls
    for _, name, arguments in complete:
        assert name in SCHEMAS, name
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    assert len({call_id for call_id, _, _ in calls}) == len(calls)  # ids unique
    if finish_reason != "length":
        assert (finish_reason == "tool_calls") == bool(calls), finish_reason
    if PARALLEL[parallel] is False:  # at most one call, whether the grammar forced it or not
        assert len(calls) <= 1
    if choice != "auto":  # the grammar forces a call, and only the offered ones
        assert calls or finish_reason == "length"
    if choice == "named":
        assert {name for _, name, _ in calls} <= {"get_time"}
    if stream and PARALLEL[parallel] is False:
        # Greedy with one call: the stream rebuilds the non-streamed answer (ids aside).
        # With parallel calls allowed a near-tie after the first call may part two runs of
        # llama.cpp, whose reused prompt cache can round differently.
        expected, expected_finish = answers[key]
        assert [c[1:] for c in calls] == [c[1:] for c in expected]
        assert finish_reason == expected_finish
