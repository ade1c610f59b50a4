"""Mid-stream failover that resumes (``resume_on_failure``), live, with the real model.

The default model (SmolLM2-135M) behind two core-engine backends, llama.cpp and MLX, greedy, on
a real gateway on loopback, asked through the official ``openai`` client. The first backend
of an alias fails on cue: a plugin around its real stream (``infermux_wrap_generate``)
raises the retryable error a dead worker raises once that backend has sent N chunks, and
closes the stream (the engine request is aborted). The client's answer must be the one an
unbroken stream gives. The core engines run float32 dense weights: the continuation's
prefill then computes the logits a token-by-token decode computes, so greedy choices do
not flip on rounding.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest

from backends.base import BackendConfig, GenerationChunk, GenerationRequest
from backends.errors import BackendUnavailableError
from gateway.config.load import config_from_dict
from gateway.config.types import ConfigError
from gateway.testing import LiveGateway, gateway_config
from plugins.builtin.cost.config import CostConfig, PriceConfig
from plugins.hookspecs import hookimpl
from plugins.manager import create_plugin_manager

pytestmark = pytest.mark.slow

CORE = {"num_threads": 1, "kv_cache_memory_mb": 64, "dtype": "float32", "weight_format": "dense"}
LLAMA = {"n_ctx": 512, "n_threads": 1}
CHAT = [{"role": "user", "content": "Say hello in French, with accents."}]
#: Its greedy answer is made of byte tokens: characters cut between tokens.
JAPANESE = "日本の首都は"
MAX_TOKENS = 20


class Breaker:
    """Fails the streams of one backend after ``after`` chunks (None: never); records the
    chunks every backend sent."""

    def __init__(self) -> None:
        self.backend: str | None = None
        self.after: int | None = None
        self.chunks: dict[str, list[GenerationChunk]] = {}
        #: (backend, attempt number, resumed?) of every try (the tracing plugin's spans).
        self.attempts: list[tuple[str, int, bool]] = []
        #: For each resumed try: whether it continued from the earlier backend's token ids.
        self.from_ids: list[bool] = []

    def arm(self, backend: str | None, after: int | None) -> None:
        self.backend, self.after, self.chunks, self.attempts, self.from_ids = backend, after, {}, [], []

    @hookimpl
    def infermux_on_attempt_start(self, request: GenerationRequest, backend_name: str, attempt: int) -> None:
        self.attempts.append((backend_name, attempt, request.resume is not None))
        if request.resume is not None:
            self.from_ids.append(bool(request.resume.token_ids))

    @hookimpl
    async def infermux_wrap_generate(
        self,
        request: GenerationRequest,
        backend_name: str,
        call_next: Callable[[GenerationRequest], AsyncIterator[GenerationChunk]],
    ) -> AsyncIterator[GenerationChunk]:
        seen = self.chunks.setdefault(backend_name, [])
        stream = call_next(request)
        try:
            async for chunk in stream:
                seen.append(chunk)
                yield chunk
                if (
                    backend_name == self.backend
                    and self.after is not None
                    and len(seen) >= self.after
                    and chunk.finish_reason is None
                ):
                    raise BackendUnavailableError(f"backend {backend_name!r}: its worker died (injected)")
        finally:
            await stream.aclose()  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def setup(live_gateway: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveGateway, Breaker, Path]]:
    breaker = Breaker()
    pm = create_plugin_manager(load_entry_points=False)
    pm.register(breaker, name="breaker")
    ledger = tmp_path_factory.mktemp("ledger") / "ledger.sqlite3"
    config = gateway_config(
        BackendConfig(name="core1", kind="core_engine", options=CORE, worker_process=False),
        BackendConfig(name="core2", kind="core_engine", options=CORE, worker_process=False),
        BackendConfig(name="llama", kind="llamacpp", options=LLAMA, worker_process=False),
        BackendConfig(name="mlx", kind="mlx", options={"n_ctx": 512}, worker_process=False),
        # The same weights under another model id: resumed as another model (from the text).
        BackendConfig(
            name="other", kind="core_engine", options={**CORE, "model_id": "smollm2-other"}, worker_process=False
        ),
        models={
            "cc": ["core1", "core2"],
            "cl": ["core1", "llama"],
            "lc": ["llama", "core2"],
            "cm": ["core1", "mlx"],
            "mc": ["mlx", "core2"],
            "cx": ["core1", "other"],
            "off": ["core1", "core2"],
            "solo_llama": ["llama"],
            "solo_core2": ["core2"],
            "solo_mlx": ["mlx"],
        },
        resume_on_failure=("cc", "cl", "lc", "cm", "mc", "cx"),
    )
    config = msgspec.structs.replace(
        config,
        cost=CostConfig(
            ledger_path=str(ledger),
            prices=[
                PriceConfig(backend="core1", input_per_mtok=1.0, output_per_mtok=10.0),
                PriceConfig(backend="core2", input_per_mtok=2.0, output_per_mtok=20.0),
            ],
        ),
    )
    with live_gateway(config, plugin_manager=pm) as gateway:
        yield gateway, breaker, ledger


class Answer(msgspec.Struct):
    text: str
    finish_reason: str | None
    usage: Any
    request_id: str | None


def chat(gw: LiveGateway, model: str, **fields: Any) -> Answer:
    client = gw.openai_client(timeout=300.0)
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=CHAT, temperature=0, max_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True}, **fields,
    )
    text, finish, usage = "", None, None
    for event in raw.parse():
        if event.choices:
            text += event.choices[0].delta.content or ""
            finish = event.choices[0].finish_reason or finish
        if event.usage is not None:
            usage = event.usage
    return Answer(text, finish, usage, raw.headers.get("x-request-id"))


def complete(gw: LiveGateway, model: str, prompt: str, **fields: Any) -> Answer:
    client = gw.openai_client(timeout=300.0)
    stream = client.completions.create(
        model=model, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True}, **fields,
    )
    text, finish, usage = "", None, None
    for event in stream:
        if event.choices:
            text += event.choices[0].text
            finish = event.choices[0].finish_reason or finish
        if event.usage is not None:
            usage = event.usage
    return Answer(text, finish, usage, None)


def continuation(gw: LiveGateway, alias: str, output_ids: list[int]) -> str:
    """The chat's answer on ``alias``'s one backend as it goes on after ``output_ids``:
    their text, then a completion of the rendered chat followed by them (no resuming)."""
    with httpx.Client(base_url=str(gw), timeout=300.0) as http:
        prompt = http.post(
            "/tokenize", json={"model": alias, "messages": CHAT, "add_generation_prompt": True}
        ).json()["tokens"]
        head = http.post("/detokenize", json={"model": alias, "tokens": output_ids}).json()["prompt"]
    rest = gw.openai_client(timeout=300.0).completions.create(
        model=alias, prompt=prompt + output_ids, temperature=0, max_tokens=MAX_TOKENS - len(output_ids)
    )
    return str(head) + rest.choices[0].text


def num_sent_tokens(chunks: list[GenerationChunk]) -> int:
    return sum(len(c.token_ids) for c in chunks)


def held_chunk(chunks: list[GenerationChunk]) -> int:
    """The number of chunks up to the first that carried token ids but no text (its text is
    held: part of a UTF-8 character, or a possible stop string's start)."""
    for i, chunk in enumerate(chunks[:-1]):
        if chunk.token_ids and not chunk.text:
            return i + 1
    raise AssertionError("no chunk held its text back")


def held_run_end(chunks: list[GenerationChunk]) -> int:
    """The number of chunks up to the end of the first run of two or more chunks whose text
    is held back (the core engine sends their token ids at once: "'", "aven" of "l'aven")."""
    run = 0
    for i, chunk in enumerate(chunks[:-1]):
        run = run + 1 if chunk.token_ids and not chunk.text else 0
        following = chunks[i + 1]
        if run >= 2 and (following.finish_reason is not None or following.text):
            return i + 1
    raise AssertionError("no run of held chunks")


@pytest.mark.parametrize("alias", ["cc", "cl", "lc", "cm", "mc"])
@pytest.mark.parametrize("point", ["first_token", "mid_answer", "last_token"])
def test_a_backend_failing_mid_stream_is_continued_to_the_unbroken_answer(
    setup: tuple[LiveGateway, Breaker, Path], alias: str, point: str
) -> None:
    gw, breaker, _ = setup
    first, second = gw.state.config.models[[m.alias for m in gw.state.config.models].index(alias)].backends
    breaker.arm(None, None)
    unbroken = chat(gw, alias)
    num_chunks = len(breaker.chunks[first])
    assert num_chunks > 4 and unbroken.finish_reason == "length"
    after = {"first_token": 1, "mid_answer": num_chunks // 2, "last_token": num_chunks - 2}[point]
    breaker.arm(first, after)
    resumed = chat(gw, alias)
    assert len(breaker.chunks) == 2  # the second backend took over
    sent = breaker.chunks[first]
    if alias == "cc":
        assert resumed.text == unbroken.text
    else:
        # llama.cpp's and MLX's arithmetic is not the core engine's: a greedy near-tie may go
        # the other way. The answer is then what the next backend says after those tokens.
        assert resumed.text == continuation(gw, f"solo_{second}", [t for c in sent for t in c.token_ids])
    assert resumed.finish_reason == unbroken.finish_reason
    assert resumed.usage.completion_tokens == unbroken.usage.completion_tokens == MAX_TOKENS
    # Each backend's work: the failed one's prompt, then the prompt and the output so far.
    num_sent = num_sent_tokens(sent)
    assert resumed.usage.prompt_tokens == 2 * unbroken.usage.prompt_tokens + num_sent


def test_another_model_continues_from_the_text_received(setup: tuple[LiveGateway, Breaker, Path]) -> None:
    """Across model ids the next backend gets the tokens of the text the client has (its own
    tokenizer's), not the failed backend's ids. Same weights here: the answer goes on as the
    unbroken one does."""
    gw, breaker, _ = setup
    breaker.arm(None, None)
    unbroken = chat(gw, "cx")
    num_chunks = len(breaker.chunks["core1"])
    breaker.arm("core1", num_chunks // 2)
    resumed = chat(gw, "cx")
    assert set(breaker.chunks) == {"core1", "other"}
    assert breaker.attempts == [("core1", 0, False), ("other", 1, True)]
    assert breaker.from_ids == [False]  # the text's tokens, not core1's ids
    before = "".join(c.text for c in breaker.chunks["core1"])
    assert resumed.text.startswith(before) and len(resumed.text) > len(before)
    assert resumed.text == unbroken.text
    assert resumed.finish_reason == unbroken.finish_reason
    assert resumed.usage.completion_tokens == MAX_TOKENS


def test_two_core_engines_resume_inside_a_multi_byte_character(setup: tuple[LiveGateway, Breaker, Path]) -> None:
    gw, breaker, _ = setup
    breaker.arm(None, None)
    unbroken = complete(gw, "cc", JAPANESE)
    after = held_chunk(breaker.chunks["core1"])
    breaker.arm("core1", after)
    resumed = complete(gw, "cc", JAPANESE)
    assert set(breaker.chunks) == {"core1", "core2"}
    assert resumed.text == unbroken.text
    assert "\ufffd" not in resumed.text[:-1]  # only a character cut by max_tokens at the very end
    assert resumed.usage.completion_tokens == unbroken.usage.completion_tokens


def test_core_engine_to_llamacpp_resumes_inside_a_multi_byte_character(
    setup: tuple[LiveGateway, Breaker, Path],
) -> None:
    gw, breaker, _ = setup
    breaker.arm(None, None)
    unbroken = complete(gw, "cl", JAPANESE)
    breaker.arm("core1", held_chunk(breaker.chunks["core1"]))
    resumed = complete(gw, "cl", JAPANESE)
    assert set(breaker.chunks) == {"core1", "llama"}
    before = "".join(c.text for c in breaker.chunks["core1"])
    assert resumed.text.startswith(before) and len(resumed.text) > len(before)
    # The character cut at the break is completed by llama.cpp's next byte tokens.
    assert resumed.text[len(before)] != "\ufffd"
    assert resumed.usage.completion_tokens == unbroken.usage.completion_tokens


@pytest.mark.parametrize(("alias", "stop"), [("cc", "l'avenir"), ("cc", "l'avenue"), ("cl", "l'avenir")])
def test_a_stop_string_candidate_held_at_the_break_is_neither_lost_nor_duplicated(
    setup: tuple[LiveGateway, Breaker, Path], alias: str, stop: str
) -> None:
    """The answer has "c'est l'avenir": the failure comes while "l'aven" is held back; the
    stop matches across the break ("l'avenir") or the held text is released after it."""
    gw, breaker, _ = setup
    breaker.arm(None, None)
    unbroken = chat(gw, alias, stop=[stop])
    after = held_run_end(breaker.chunks["core1"])
    breaker.arm("core1", after)
    resumed = chat(gw, alias, stop=[stop])
    assert len(breaker.chunks) == 2
    assert resumed.text == unbroken.text
    assert resumed.finish_reason == unbroken.finish_reason
    if stop == "l'avenir":
        assert unbroken.finish_reason == "stop" and unbroken.text.endswith("c'est ")


def test_n_choices_with_logprobs_each_resume(setup: tuple[LiveGateway, Breaker, Path]) -> None:
    gw, breaker, _ = setup
    client = gw.openai_client(timeout=300.0)

    def ask() -> Any:
        return client.chat.completions.create(
            model="cc", messages=CHAT, temperature=0, max_tokens=12, n=2, logprobs=True, top_logprobs=2,
        )

    breaker.arm(None, None)
    unbroken = ask()
    breaker.arm("core1", 4)
    resumed = ask()
    assert len(breaker.chunks["core2"]) > 0
    for before, after in zip(unbroken.choices, resumed.choices, strict=True):
        assert after.message.content == before.message.content
        tokens = [entry.token for entry in after.logprobs.content]
        assert "".join(tokens) == after.message.content
        assert [e.token for e in before.logprobs.content] == tokens
    assert resumed.usage.completion_tokens == unbroken.usage.completion_tokens == 24


def test_the_ledger_has_one_row_priced_at_both_backends(setup: tuple[LiveGateway, Breaker, Path]) -> None:
    gw, breaker, ledger = setup
    breaker.arm("core1", 5)
    resumed = chat(gw, "cc")
    assert resumed.request_id is not None
    assert breaker.attempts == [("core1", 0, False), ("core2", 1, True)]
    assert breaker.from_ids == [True]  # the same model: from core1's exact token ids
    connection = sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)
    connection.row_factory = sqlite3.Row
    try:
        rows = [
            dict(r)
            for r in connection.execute("SELECT * FROM usage_records WHERE request_id = ?", (resumed.request_id,))
        ]
    finally:
        connection.close()
    assert len(rows) == 1
    row = rows[0]
    assert row["backend"] == "core1,core2"
    assert row["input_tokens"] == resumed.usage.prompt_tokens
    assert row["output_tokens"] == resumed.usage.completion_tokens == MAX_TOKENS
    num_first = num_sent_tokens(breaker.chunks["core1"])
    prompt = (resumed.usage.prompt_tokens - num_first) // 2
    cached = resumed.usage.prompt_tokens_details.cached_tokens or 0
    expected = (
        prompt * 1.0 + num_first * 10.0  # core1: its prompt, its output
        + (prompt + num_first - cached) * 2.0 + cached * 2.0 + (MAX_TOKENS - num_first) * 20.0
    ) / 1e6
    assert row["cost"] == pytest.approx(expected)


def test_without_resume_on_failure_the_stream_ends_with_an_error(setup: tuple[LiveGateway, Breaker, Path]) -> None:
    gw, breaker, _ = setup
    breaker.arm("core1", 3)
    client = gw.openai_client(timeout=300.0)
    stream = client.chat.completions.create(
        model="off", messages=CHAT, temperature=0, max_tokens=MAX_TOKENS, stream=True
    )
    text = ""
    with pytest.raises(openai.APIError, match="worker died"):
        for event in stream:
            if event.choices:
                text += event.choices[0].delta.content or ""
    assert set(breaker.chunks) == {"core1"}  # nobody continued
    assert 0 < len(text) < 40


def test_resume_on_failure_needs_a_backend_to_resume_on() -> None:
    raw = {
        "backends": [{"name": "a", "kind": "mock"}],
        "models": [{"alias": "m", "backends": ["a"], "resume_on_failure": True}],
    }
    with pytest.raises(ConfigError, match=r"models\[0\]\.resume_on_failure"):
        config_from_dict(raw)
    raw["models"][0]["resume_on_failure"] = "yes"  # type: ignore[index]
    with pytest.raises(ConfigError, match="resume_on_failure"):
        config_from_dict(raw)
