"""``POST /v1/embeddings`` with the official ``openai`` client, on the real default model
(SmolLM2-135M) served by llama.cpp and by the core engine (in its engine process), and
passed through a remote ``openai`` backend - with its ledger rows and trace.
"""

from __future__ import annotations

import base64
import math
import sqlite3
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from core_engine.gguf_loader import preferred_dtype
from gateway.testing import LiveGateway
from tests.telemetry.telemetry_util import (
    Telemetry,
    make_config,
    mock,
    remote,
    telemetry_gateway_for,
)

pytestmark = pytest.mark.slow

BACKENDS = ["llamacpp", "core_engine"]

#: Three pairs of related sentences; each pair's sentences are nearer each other than any
#: sentence of another pair (a property of the model's pooled states, measured for both).
TEXTS = [
    "The cat sat on the mat.",
    "A kitten is sitting on a rug.",
    "Quarterly revenue rose by four percent.",
    "The stock market fell sharply today.",
    "I love eating pizza with cheese.",
    "Pasta with tomato sauce is my favourite food.",
]
PAIRS = [(0, 1), (2, 3), (4, 5)]
#: How far from 1 the cosine of one text's vectors from two forwards of other shapes (alone, in
#: a batch) may be. The core engine computes in bf16 where the CPU has it (AMX, AVX512-BF16):
#: there a batch sums in other orders, measured 4.5e-4 on a Sapphire Rapids Xeon (2026-12-04);
#: in float32 and in llama.cpp, under 1e-5.
SAME_TEXT_TOLERANCE = {
    "llamacpp": 1e-4,
    "core_engine": 1e-4 if preferred_dtype("cpu") == torch.float32 else 2e-3,
}


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(
        sum(x * x for x in a) * sum(y * y for y in b)
    )


def embed(client: Any, backend: str, inputs: Any, **kwargs: Any) -> Any:
    return client.embeddings.create(
        model="smollm2", input=inputs, extra_headers={"x-infermux-backend": backend}, **kwargs
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_float_and_base64_answers_carry_the_same_vectors(default_client: Any, backend: str) -> None:
    floats = embed(default_client, backend, TEXTS[:2], encoding_format="float")
    encoded = embed(default_client, backend, TEXTS[:2], encoding_format="base64")
    assert floats.object == "list" and floats.model == "smollm2"
    assert [d.index for d in floats.data] == [0, 1]
    for as_floats, as_base64 in zip(floats.data, encoded.data, strict=True):
        raw = base64.b64decode(as_base64.embedding)
        decoded = list(struct.unpack(f"<{len(raw) // 4}f", raw))
        assert decoded == as_floats.embedding  # the same float32 numbers, bit for bit
        assert len(decoded) == 576  # SmolLM2-135M's hidden size
        assert math.sqrt(sum(v * v for v in decoded)) == pytest.approx(1.0, abs=1e-5)
    assert floats.usage.prompt_tokens > 0
    assert floats.usage.total_tokens == floats.usage.prompt_tokens == encoded.usage.prompt_tokens


@pytest.mark.parametrize("backend", BACKENDS)
def test_related_texts_are_nearer_than_unrelated_ones(default_client: Any, backend: str) -> None:
    vectors = [d.embedding for d in embed(default_client, backend, TEXTS, encoding_format="float").data]
    again = embed(default_client, backend, TEXTS[0], encoding_format="float").data[0].embedding
    assert cosine(vectors[0], again) == pytest.approx(1.0, abs=SAME_TEXT_TOLERANCE[backend])  # a text with itself
    for a, b in PAIRS:
        related = cosine(vectors[a], vectors[b])
        for c in range(len(TEXTS)):
            if c not in (a, b):
                assert related > cosine(vectors[a], vectors[c]), (TEXTS[a], TEXTS[b], TEXTS[c])


def test_a_batch_gives_each_input_the_vector_it_gets_alone(default_client: Any) -> None:
    """The core engine packs a request's inputs into one forward (block-diagonal attention):
    no input may see another's tokens."""
    batch = embed(default_client, "core_engine", TEXTS, encoding_format="float").data
    for i in (0, 3, 5):
        alone = embed(default_client, "core_engine", TEXTS[i], encoding_format="float").data[0]
        assert cosine(batch[i].embedding, alone.embedding) == pytest.approx(1.0, abs=SAME_TEXT_TOLERANCE["core_engine"])


def test_the_core_engine_agrees_with_llama_cpp(default_client: Any) -> None:
    ours = embed(default_client, "core_engine", TEXTS, encoding_format="float").data
    theirs = embed(default_client, "llamacpp", TEXTS, encoding_format="float").data
    for a, b in zip(ours, theirs, strict=True):
        assert cosine(a.embedding, b.embedding) > 0.99


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_ids_embed_as_their_text_does(default_client: Any, backend: str) -> None:
    # The /tokenize ids of the text (with the BOS the text would get: none for SmolLM2).
    tokens = httpx.post(
        f"{default_client.base_url}".removesuffix("/v1/") + "/tokenize",
        json={"model": "smollm2", "prompt": TEXTS[2]},
        headers={"x-infermux-backend": backend},
    ).json()["tokens"]
    by_text = embed(default_client, backend, TEXTS[2], encoding_format="float")
    by_ids = embed(default_client, backend, tokens, encoding_format="float")
    both = embed(default_client, backend, [tokens, tokens[:3]], encoding_format="float")
    assert cosine(by_ids.data[0].embedding, by_text.data[0].embedding) == pytest.approx(1.0, abs=1e-5)
    assert by_ids.usage.prompt_tokens == len(tokens) == by_text.usage.prompt_tokens
    assert both.usage.prompt_tokens == len(tokens) + 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_dimensions_other_than_the_models_are_refused_naming_dimensions(
    default_client: Any, backend: str
) -> None:
    assert len(embed(default_client, backend, "x", dimensions=576, encoding_format="float").data[0].embedding) == 576
    with pytest.raises(openai.BadRequestError) as caught:
        embed(default_client, backend, "x", dimensions=64)
    assert caught.value.body["param"] == "dimensions"  # type: ignore[index]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": [[]]}, "input[0]"),
        ({"input": ["ok", ""]}, "input[1]"),
        ({"input": [1, "two"]}, "input"),
        ({"input": [-1]}, "input"),
        ({"input": [[1, 2], [10**9]]}, "input[1]"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": 5}, "input"),
        ({}, "input"),
        ({"input": "x", "model": "no-such-model"}, "model"),
    ],
)
def test_bad_input_gets_the_openai_envelope_naming_the_field(
    default_gateway: LiveGateway, body: dict[str, Any], param: str
) -> None:
    answer = httpx.post(
        f"{default_gateway}/v1/embeddings",
        json={"model": "smollm2", **body},
        headers={"x-infermux-backend": "core_engine"} if "model" not in body else {},
        timeout=60,
    )
    assert answer.status_code in (400, 404), answer.text
    error = answer.json()["error"]
    assert error["param"] == param, error
    assert error["message"]


@pytest.fixture(scope="module")
def through_remote(
    default_gateway: LiveGateway, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LiveGateway, Telemetry, Path]]:
    """A second gateway whose ``openai`` backend is the default gateway (no model loads),
    with a mock backend beside it, recording spans and its ledger."""
    folder = tmp_path_factory.mktemp("embeddings-remote")
    telemetry = Telemetry()
    config = make_config(
        remote("up", f"{default_gateway}/v1"),
        mock("plain"),
        models={"smollm2": ["up"], "echo": ["plain"]},
    )
    with telemetry_gateway_for(telemetry, folder, config) as gateway:
        yield gateway, telemetry, folder / "ledger.sqlite3"
    telemetry.tracer_provider.shutdown()
    telemetry.meter_provider.shutdown()


def test_a_remote_backend_passes_embeddings_through(
    through_remote: tuple[LiveGateway, Telemetry, Path], default_client: Any
) -> None:
    gateway, _, _ = through_remote
    client = gateway.openai_client(timeout=120)
    ours = client.embeddings.create(model="smollm2", input=TEXTS[:3], encoding_format="float")
    direct = default_client.embeddings.create(model="smollm2", input=TEXTS[:3], encoding_format="float")
    assert [d.embedding for d in ours.data] == [d.embedding for d in direct.data]
    assert ours.usage.prompt_tokens == direct.usage.prompt_tokens
    # The upstream's refusal comes back with its param.
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="smollm2", input="x", dimensions=64)
    assert caught.value.body["param"] == "dimensions"  # type: ignore[index]


def test_a_backend_without_embeddings_is_refused_naming_model(
    through_remote: tuple[LiveGateway, Telemetry, Path],
) -> None:
    gateway, _, _ = through_remote
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.openai_client().embeddings.create(model="echo", input="hello")
    assert caught.value.body["param"] == "model"  # type: ignore[index]
    assert "embeddings" in caught.value.body["message"]  # type: ignore[index]


def test_embeddings_leave_a_ledger_row_and_an_embeddings_span(
    through_remote: tuple[LiveGateway, Telemetry, Path],
) -> None:
    gateway, telemetry, ledger = through_remote
    answer = httpx.post(
        f"{gateway}/v1/embeddings", json={"model": "smollm2", "input": ["one", "two three"]}, timeout=120
    )
    assert answer.status_code == 200, answer.text
    request_id = answer.headers["x-request-id"]
    with sqlite3.connect(ledger) as connection:
        connection.row_factory = sqlite3.Row
        row = dict(connection.execute("SELECT * FROM usage_records WHERE request_id = ?", (request_id,)).fetchone())
    assert row["kind"] == "embedding" and row["status"] == "ok" and row["backend"] == "up"
    assert row["input_tokens"] == answer.json()["usage"]["prompt_tokens"] > 0
    assert row["output_tokens"] == 0
    spans = telemetry.trace_of(request_id)
    root = next(s for s in spans if (s.attributes or {}).get("infermux.request_id") == request_id)
    assert root.name == "embeddings smollm2"
    assert (root.attributes or {})["gen_ai.operation.name"] == "embeddings"
    assert (root.attributes or {})["gen_ai.usage.input_tokens"] == row["input_tokens"]
