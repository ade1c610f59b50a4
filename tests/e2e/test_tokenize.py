"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes) on the real default model,
served by llama.cpp and by the core engine in its engine process."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gateway.testing import LiveGateway

pytestmark = pytest.mark.slow

BACKENDS = ["llamacpp", "core_engine"]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime number."},
]


def post(gateway: LiveGateway, path: str, body: dict[str, Any], backend: str | None = None) -> httpx.Response:
    headers = {"x-infermux-backend": backend} if backend else {}
    return httpx.post(f"{gateway}{path}", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prompt_tokenizes_and_detokenizes_back(default_gateway: LiveGateway, backend: str) -> None:
    text = "Tokenizers split words: internationalisation, naïve café."
    answer = post(default_gateway, "/tokenize", {"model": "smollm2", "prompt": text}, backend)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["count"] == len(body["tokens"]) > 5
    # The backend's own context length: llama.cpp's n_ctx, the core engine's model window.
    assert body["max_model_len"] == {"llamacpp": 2048, "core_engine": 8192}[backend]
    back = post(default_gateway, "/detokenize", {"model": "smollm2", "tokens": body["tokens"]}, backend)
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": text}


def test_both_engines_tokenize_text_and_messages_alike(default_gateway: LiveGateway) -> None:
    for body in ({"prompt": "Hello there, world!"}, {"messages": MESSAGES}):
        answers = [
            post(default_gateway, "/tokenize", {"model": "smollm2", **body}, b).json()["tokens"]
            for b in BACKENDS
        ]
        assert answers[0] == answers[1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_messages_count_the_prompt_tokens_a_chat_request_is_billed(
    default_gateway: LiveGateway, default_client: Any, backend: str
) -> None:
    with_prefix = post(default_gateway, "/tokenize", {"model": "smollm2", "messages": MESSAGES}, backend).json()
    bare = post(
        default_gateway,
        "/tokenize",
        {"model": "smollm2", "messages": MESSAGES, "add_generation_prompt": False},
        backend,
    ).json()
    assert with_prefix["tokens"][: bare["count"]] == bare["tokens"]
    assert with_prefix["count"] > bare["count"]  # the assistant prefix
    chat = default_client.chat.completions.create(
        model="smollm2", messages=MESSAGES, max_tokens=1, extra_headers={"x-infermux-backend": backend}
    )
    assert chat.usage.prompt_tokens == with_prefix["count"]
    text = post(default_gateway, "/detokenize", {"model": "smollm2", "tokens": with_prefix["tokens"]}, backend)
    assert "Name a prime number." in text.json()["prompt"]
    assert "<|im_start|>" in text.json()["prompt"]  # special tokens are written out


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"model": "smollm2"}, 400, "prompt"),
        ("/tokenize", {"model": "smollm2", "prompt": "a", "messages": MESSAGES}, 400, "prompt"),
        ("/tokenize", {"model": "smollm2", "messages": []}, 400, "messages"),
        ("/tokenize", {"model": "smollm2", "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
        ("/tokenize", {"model": "nope", "prompt": "a"}, 404, "model"),
        ("/tokenize", {"prompt": "a"}, 400, "model"),
        ("/detokenize", {"model": "smollm2", "tokens": [-1]}, 400, "tokens[0]"),
        ("/detokenize", {"model": "smollm2", "tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"model": "smollm2", "tokens": "12"}, 400, "tokens"),
    ],
)
def test_bad_input_gets_the_openai_envelope_naming_the_field(
    default_gateway: LiveGateway, path: str, body: dict[str, Any], status: int, param: str
) -> None:
    for backend in BACKENDS:
        answer = post(default_gateway, path, body, backend if body.get("model") == "smollm2" else None)
        assert answer.status_code == status, answer.text
        error = answer.json()["error"]
        assert error["param"] == param, error


def test_a_backend_without_a_tokenizer_is_refused_naming_model(echo_gateway: LiveGateway) -> None:
    answer = post(echo_gateway, "/tokenize", {"model": "echo", "prompt": "hi"})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "model"
