"""The llama.cpp backend with the real default model (SmolLM2-135M-Instruct, loaded once)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from backends.base import (
    BackendConfig,
    ChatMessage,
    GenerationChunk,
    GenerationRequest,
    SamplingParams,
)
from backends.errors import ContextLengthExceededError, GenerationAbortedError
from backends.llamacpp import LlamaCppBackend, create_backend
from tests.backends.llamacpp_util import _chat, _collect, _completion

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backend() -> AsyncIterator[LlamaCppBackend]:
    llama = create_backend(
        BackendConfig(name="llamacpp", kind="llamacpp", options={"n_threads": 1})
    )
    await llama.start()
    yield llama
    await llama.aclose()


def _text(chunks: list[GenerationChunk]) -> str:
    return "".join(c.text for c in chunks)


async def test_streams_text_token_by_token_with_usage(backend: LlamaCppBackend) -> None:
    chunks = await _collect(backend, _chat("Name three colours.", max_tokens=12, temperature=0))
    assert len([c for c in chunks if c.text]) > 3  # streamed, not one blob
    assert _text(chunks).strip()
    last = chunks[-1]
    assert last.finish_reason in ("stop", "length")
    assert last.usage is not None
    assert last.usage.prompt_tokens > 5
    assert 0 < last.usage.completion_tokens <= 12
    assert backend.model_info().chat_template is not None
    assert "<|im_start|>" in backend.model_info().chat_template  # the GGUF's own template


async def test_same_seed_same_output(backend: LlamaCppBackend) -> None:
    request = _chat("Write a short poem about the sea.", max_tokens=20, temperature=1.0, seed=1234)
    first = _text(await _collect(backend, request))
    await _collect(backend, _chat("Something else entirely", max_tokens=3))  # disturb the cache
    second = _text(await _collect(backend, request))
    other = _text(
        await _collect(backend, _chat("Write a short poem about the sea.", max_tokens=20, seed=99))
    )
    assert first == second
    assert first != other


async def test_stop_string_across_tokens_is_cut_and_not_leaked(backend: LlamaCppBackend) -> None:
    request = _completion("The days of the week are Monday, Tuesday,", max_tokens=16, temperature=0)
    chunks = [c for c in await _collect(backend, request) if c.text]
    full = _text(chunks)
    # A stop string made of the end of one token and the start of the next.
    boundary = next(i for i in range(2, len(chunks)) if len(chunks[i].text) >= 2)
    stop = chunks[boundary - 1].text[-1:] + chunks[boundary].text[:2]
    stopped = await _collect(
        backend, _completion(request.prompt, max_tokens=16, temperature=0, stop=(stop,))
    )  # type: ignore[arg-type]
    assert _text(stopped) == full[: full.index(stop)]
    assert stop not in _text(stopped)
    assert stopped[-1].finish_reason == "stop"


async def test_closing_the_stream_stops_generation(backend: LlamaCppBackend) -> None:
    before = backend.num_generated_tokens
    stream = backend.generate(
        _chat("Count from one to a thousand.", max_tokens=400, ignore_eos=True)
    )
    for _ in range(3):
        await anext(stream)
    await stream.aclose()  # type: ignore[attr-defined]
    await backend.wait_idle()
    generated = backend.num_generated_tokens - before
    assert generated < 40, f"{generated} tokens generated for a stream closed after 3"


async def test_cancelled_consumer_stops_generation(backend: LlamaCppBackend) -> None:
    before = backend.num_generated_tokens

    async def consume() -> None:
        async for _ in backend.generate(
            _chat("Tell a long story.", max_tokens=400, ignore_eos=True)
        ):
            pass

    task = asyncio.create_task(consume())
    while backend.num_generated_tokens - before < 3:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await backend.wait_idle()
    assert backend.num_generated_tokens - before < 40


async def test_context_length_errors_name_the_parameter(backend: LlamaCppBackend) -> None:
    with pytest.raises(ContextLengthExceededError) as too_many:
        await _collect(backend, _chat("Hi", max_tokens=2040))
    assert too_many.value.param == "max_tokens"
    with pytest.raises(ContextLengthExceededError) as too_long:
        await _collect(backend, _chat("word " * 2500, max_tokens=1))
    assert too_long.value.param == "messages"


async def test_multibyte_characters_are_never_split(backend: LlamaCppBackend) -> None:
    request = _completion(
        "日本の首都は東京です。大阪は", max_tokens=24, temperature=0, logprobs=True
    )
    chunks = await _collect(backend, request)
    entries = [e for c in chunks if c.logprobs for e in c.logprobs]
    raw = b"".join(bytes(e.bytes or []) for e in entries)
    assert any(not _is_utf8(bytes(e.bytes or [])) for e in entries), "no split character produced"
    for chunk in chunks:
        assert "\ufffd" not in chunk.text
    assert _text(chunks) == raw.decode("utf-8")


async def test_greedy_logprobs_are_the_top_choice(backend: LlamaCppBackend) -> None:
    chunks = await _collect(
        backend, _chat("Say hello.", max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    )
    entries = [e for c in chunks if c.logprobs for e in c.logprobs]
    assert len(entries) == chunks[-1].usage.completion_tokens  # type: ignore[union-attr]
    for entry in entries:
        assert entry.logprob is not None and entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token_id == entry.token_id
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)


async def test_echo_returns_prompt_logprobs(backend: LlamaCppBackend) -> None:
    request = _completion(
        "The cat sat on the", max_tokens=2, temperature=0, echo=True, logprobs=True, top_logprobs=1
    )
    chunks = await _collect(backend, request)
    assert chunks[0].prompt_text == "The cat sat on the"
    prompt_logprobs = chunks[0].prompt_logprobs
    assert prompt_logprobs is not None
    assert len(prompt_logprobs) == chunks[-1].usage.prompt_tokens  # type: ignore[union-attr]
    assert prompt_logprobs[0].logprob is None
    assert all(e.logprob is not None and e.logprob <= 0 for e in prompt_logprobs[1:])
    assert "".join(e.token for e in prompt_logprobs) == "The cat sat on the"


async def test_shared_prefix_is_reported_as_cached(backend: LlamaCppBackend) -> None:
    system = ChatMessage(role="system", content="You are a terse assistant. " * 5)
    first = GenerationRequest(
        request_id="a",
        model="smollm2",
        kind="chat",
        messages=(system, ChatMessage(role="user", content="Hi")),
        params=SamplingParams(max_tokens=2),
    )
    await _collect(backend, first)
    second = GenerationRequest(
        request_id="b",
        model="smollm2",
        kind="chat",
        messages=(system, ChatMessage(role="user", content="Hello there")),
        params=SamplingParams(max_tokens=2),
    )
    usage = (await _collect(backend, second))[-1].usage
    assert usage is not None and usage.cached_tokens is not None
    assert usage.cached_tokens > 20  # the system prompt was not evaluated again


async def test_ignore_eos_runs_to_max_tokens(backend: LlamaCppBackend) -> None:
    chunks = await _collect(backend, _chat("Hi", max_tokens=40, temperature=0, ignore_eos=True))
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 40


async def test_concurrent_requests_each_get_their_own_output(backend: LlamaCppBackend) -> None:
    requests = [_chat(f"Say the number {i}.", max_tokens=6, temperature=0) for i in range(3)]
    results = await asyncio.gather(*(_collect(backend, r) for r in requests))
    alone = await _collect(backend, requests[1])
    assert all(r[-1].finish_reason in ("stop", "length") for r in results)
    assert _text(results[1]) == _text(alone)


async def test_closing_the_backend_aborts_open_streams() -> None:
    # One slot: the second request really waits in the queue behind the first.
    llama = create_backend(
        BackendConfig(name="own", kind="llamacpp", options={"n_threads": 1, "parallel": 1})
    )
    await llama.start()
    running = llama.generate(_chat("Tell a long story.", max_tokens=400, ignore_eos=True))
    queued = llama.generate(_chat("And another one.", max_tokens=400, ignore_eos=True))
    await anext(running)
    waiting = asyncio.ensure_future(anext(queued))
    await asyncio.sleep(0)  # submitted: it waits behind the running one
    await llama.aclose()
    with pytest.raises(GenerationAbortedError):
        async for _ in running:
            pass
    with pytest.raises(GenerationAbortedError):
        await waiting


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
