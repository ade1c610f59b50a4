"""The default model served through MLX behind a live gateway, called with the ``openai`` client.

The gateway serves ``smollm2`` from llama.cpp first and MLX second (the shape of the default
config when MLX is installed); every request here pins MLX with ``x-infermux-backend: mlx``,
and the response header proves it served. MLX's Linux CPU build is slow: outputs stay short.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import openai
import pytest

from backends.base import BackendConfig
from backends.default_model import default_model_path
from backends.mlx import default_backend_config
from gateway.testing import LiveGateway, gateway_config

pytestmark = pytest.mark.slow

MODEL = "smollm2"
PIN = {"x-infermux-backend": "mlx"}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gateway(
    live_gateway: Callable[..., AbstractContextManager[LiveGateway]],
) -> Iterator[LiveGateway]:
    llamacpp = BackendConfig(name="llamacpp", kind="llamacpp", options={"n_threads": 1})
    mlx = default_backend_config(default_model_path())
    config = gateway_config(llamacpp, mlx, models={MODEL: ["llamacpp", "mlx"]})
    with live_gateway(config) as running:
        yield running


@pytest.fixture(scope="module")
def client(gateway: LiveGateway) -> openai.OpenAI:
    return gateway.openai_client(timeout=300.0)


def test_chat_completion_is_served_by_mlx(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=QUESTION, max_tokens=10, temperature=0, extra_headers=PIN
    )
    response = raw.parse()
    assert raw.headers["x-infermux-backend"] == "mlx"
    choice = response.choices[0]
    assert "Paris" in (choice.message.content or "")
    assert choice.finish_reason in ("stop", "length")
    assert response.usage is not None
    assert 0 < response.usage.completion_tokens <= 10
    assert response.usage.prompt_tokens > 20


def test_streaming_matches_the_non_streamed_answer(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=8, temperature=0, extra_headers=PIN
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers=PIN,
    )
    chunks = list(stream)
    deltas = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert len(deltas) > 1  # token by token
    assert "".join(deltas) == whole.choices[0].message.content
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]
    # The same conversation again: its prompt came from MLX's prompt cache.
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def test_stop_string_is_cut_and_not_returned(client: openai.OpenAI) -> None:
    full = client.completions.create(
        model=MODEL,
        prompt="Monday, Tuesday, Wednesday,",
        max_tokens=8,
        temperature=0,
        extra_headers=PIN,
    )
    text = full.choices[0].text
    assert "day" in text
    stopped = client.completions.create(
        model=MODEL,
        prompt="Monday, Tuesday, Wednesday,",
        max_tokens=8,
        temperature=0,
        stop=["day"],
        extra_headers=PIN,
    )
    assert stopped.choices[0].text == text[: text.index("day")]
    assert stopped.choices[0].finish_reason == "stop"


def test_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        response = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Write a poem about the sea."}],
            max_tokens=10,
            temperature=1.0,
            seed=seed,
            extra_headers=PIN,
        )
        return response.choices[0].message.content or ""

    first = sample(1234)
    assert sample(1234) == first
    assert sample(99) != first


def test_unsupported_parameter_is_a_400_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=2, echo=True, extra_headers=PIN
        )
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == "echo"
    assert error["code"] == "unsupported_parameter"


def test_tokenize_and_detokenize_are_served_by_mlx_like_llamacpp(gateway: LiveGateway, client: openai.OpenAI) -> None:
    import httpx

    def post(path: str, body: dict[str, object], backend: str) -> dict[str, object]:
        answer = httpx.post(
            f"{gateway}{path}", json={"model": MODEL, **body}, headers={"x-infermux-backend": backend}, timeout=60
        )
        assert answer.status_code == 200, answer.text
        return dict(answer.json())

    text = "Tokenizers split words: internationalisation, naïve café."
    tokens = post("/tokenize", {"prompt": text}, "mlx")["tokens"]
    assert tokens == post("/tokenize", {"prompt": text}, "llamacpp")["tokens"]
    assert post("/detokenize", {"tokens": tokens}, "mlx") == {"prompt": text}
    # A chat's tokens, template rendered: what the chat request is billed for.
    chat_tokens = post("/tokenize", {"messages": QUESTION}, "mlx")["tokens"]
    billed = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1, extra_headers=PIN).usage
    assert billed is not None and len(chat_tokens) == billed.prompt_tokens  # type: ignore[arg-type]
