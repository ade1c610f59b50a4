"""The core_engine backend with the real default model (SmolLM2-135M-Instruct, loaded once)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from backends._option import BackendOptionError
from backends.base import (
    BackendConfig,
    ChatMessage,
    GenerationChunk,
    GenerationRequest,
    SamplingParams,
)
from backends.core_engine import CoreEngineBackend, create_backend
from backends.errors import ContextLengthExceededError, InvalidRequestError

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

SYSTEM = (
    "You are the assistant of a mountain hut. Breakfast is served from 7 to 9 and dinner from "
    "6 to 8. The hut has 40 beds in 6 rooms; blankets are provided and sleeping-bag liners are "
    "mandatory. The ridge trail takes 5 hours, the lake loop 2 hours, the glacier path 3 hours. "
    "Always mention the weather forecast and the opening hours, which are 7am to 10pm. "
) * 2


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backend() -> AsyncIterator[CoreEngineBackend]:
    engine = create_backend(
        BackendConfig(
            name="core", kind="core_engine",
            # Dense fp32: the batching test compares answers token for token, and the second
            # (batched) run reads the first run's prompts from the prefix cache, whose attention
            # sums in another order; under the default int4 format's 8-bit activations such a
            # 1e-7 difference flips near-ties (seen: one of four greedy answers changed).
            options={"num_threads": 1, "dtype": "float32", "weight_format": "dense", "kv_cache_memory_mb": 128},
        )
    )
    await engine.start()
    yield engine
    await engine.aclose()


def chat(text: str, system: str | None = None, **params: object) -> GenerationRequest:
    messages = ((ChatMessage(role="system", content=system),) if system else ()) + (
        ChatMessage(role="user", content=text),
    )
    return GenerationRequest(
        request_id="r", model="smollm2", kind="chat", messages=messages,
        params=SamplingParams(**params),  # type: ignore[arg-type]
    )


def completion(prompt: str | tuple[int, ...], **params: object) -> GenerationRequest:
    return GenerationRequest(
        request_id="r", model="smollm2", kind="completion", prompt=prompt,
        params=SamplingParams(**params),  # type: ignore[arg-type]
    )


async def collect(backend: CoreEngineBackend, request: GenerationRequest) -> list[GenerationChunk]:
    return [chunk async for chunk in backend.generate(request)]


def text_of(chunks: list[GenerationChunk]) -> str:
    return "".join(c.text for c in chunks)


async def idle(backend: CoreEngineBackend) -> tuple[int, int, bool]:
    llm = backend._llm
    assert llm is not None
    return await llm.call(lambda e: (e.num_free_blocks, e.num_blocks, e.has_unfinished_requests()))


async def test_chat_streams_with_usage_and_phases(backend: CoreEngineBackend) -> None:
    chunks = await collect(backend, chat("Name three colours.", max_tokens=12, temperature=0))
    assert len([c for c in chunks if c.text]) > 3
    last = chunks[-1]
    assert last.finish_reason in ("stop", "length")
    assert last.usage is not None and last.usage.prompt_tokens > 5
    assert 0 < last.usage.completion_tokens <= 12
    assert last.phases is not None and last.phases.prefill_s is not None and last.phases.decode_s is not None
    info = backend.model_info()
    assert info.id == "SmolLM2-135M-Instruct.Q4_1" and "<|im_start|>" in (info.chat_template or "")
    assert "<|im_end|>" not in text_of(chunks)


async def test_shared_system_prompt_is_served_from_the_prefix_cache(backend: CoreEngineBackend) -> None:
    first = await collect(backend, chat("When is dinner?", SYSTEM, max_tokens=8, temperature=0))
    again = await collect(backend, chat("When is dinner?", SYSTEM, max_tokens=8, temperature=0))
    other = await collect(backend, chat("How long is the lake loop?", SYSTEM, max_tokens=8, temperature=0))
    assert text_of(again) == text_of(first)
    assert again[-1].usage is not None and again[-1].usage.cached_tokens
    assert again[-1].usage.cached_tokens >= again[-1].usage.prompt_tokens - 16
    assert other[-1].usage is not None and (other[-1].usage.cached_tokens or 0) >= 128
    # What /metrics shows: a hit rate that counts these cached prompt tokens, nothing running.
    stats = backend.stats()
    assert 0.0 < stats["prefix_cache_hit_rate"] < 1.0
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert 0.0 <= stats["kv_cache_usage"] <= 1.0


async def test_concurrent_requests_are_batched_and_each_gets_its_answer(backend: CoreEngineBackend) -> None:
    questions = ["What is 2+2?", "Name a fruit.", "Say hello.", "What colour is the sky?"]
    alone = [text_of(await collect(backend, chat(q, max_tokens=10, temperature=0))) for q in questions]
    together = await asyncio.gather(*(collect(backend, chat(q, max_tokens=10, temperature=0)) for q in questions))
    assert [text_of(c) for c in together] == alone


async def test_echo_with_logprobs_returns_prompt_logprobs(backend: CoreEngineBackend) -> None:
    chunks = await collect(
        backend, completion("The capital of France is", max_tokens=3, temperature=0, echo=True, logprobs=True, top_logprobs=2)
    )
    first = chunks[0]
    assert first.prompt_text == "The capital of France is"
    assert first.prompt_logprobs is not None
    assert first.prompt_logprobs[0].logprob is None
    assert all(e.logprob is not None and e.logprob <= 0 for e in first.prompt_logprobs[1:])
    assert "".join(e.token for e in first.prompt_logprobs) == "The capital of France is"
    assert [e.text_offset for e in first.prompt_logprobs][:2] == [0, len(first.prompt_logprobs[0].token)]
    generated = [e for c in chunks[1:] for e in (c.logprobs or ())]
    assert len(generated) == 3
    # Greedy: the sampled token is the most likely alternative.
    assert all(e.top_logprobs[0].token_id == e.token_id for e in generated)
    assert "".join(e.token for e in generated) == text_of(chunks)


async def test_token_id_prompt(backend: CoreEngineBackend) -> None:
    ids = tuple(backend.engine.tokenizer.encode("The capital of France is"))
    by_ids = text_of(await collect(backend, completion(ids, max_tokens=4, temperature=0)))
    by_text = text_of(await collect(backend, completion("The capital of France is", max_tokens=4, temperature=0)))
    assert by_ids == by_text


async def test_stop_string_is_not_leaked(backend: CoreEngineBackend) -> None:
    full = text_of(await collect(backend, completion("def fibonacci(n):", max_tokens=20, temperature=0)))
    assert "return" in full
    chunks = await collect(backend, completion("def fibonacci(n):", max_tokens=20, temperature=0, stop=("return",)))
    assert text_of(chunks) == full[: full.index("return")]
    assert chunks[-1].finish_reason == "stop"


async def test_same_seed_same_output(backend: CoreEngineBackend) -> None:
    request = chat("Write a short poem about the sea.", max_tokens=16, temperature=1.0, seed=99)
    assert text_of(await collect(backend, request)) == text_of(await collect(backend, request))


async def test_context_overflow_and_bad_params_are_client_errors(backend: CoreEngineBackend) -> None:
    with pytest.raises(ContextLengthExceededError) as info:
        await collect(backend, completion("hello", max_tokens=10**6))
    assert info.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError) as bad:
        await collect(backend, completion("hello", top_p=0.0))
    assert bad.value.param == "top_p"
    with pytest.raises(InvalidRequestError) as vocab:
        await collect(backend, completion((10**7,)))
    assert vocab.value.param == "prompt"
    assert (await idle(backend))[2] is False


async def test_closing_the_stream_aborts_and_frees_blocks(backend: CoreEngineBackend) -> None:
    stream = backend.generate(completion("Tell me a very long story.", max_tokens=400, temperature=0, ignore_eos=True))
    async for chunk in stream:
        if chunk.text:
            break
    await stream.aclose()
    free, total, busy = await idle(backend)
    assert not busy and free == total


async def test_health_and_unknown_option() -> None:
    with pytest.raises(BackendOptionError, match="backends.x.options.bogus"):
        create_backend(BackendConfig(name="x", kind="core_engine", options={"bogus": 1}))
    cold = create_backend(BackendConfig(name="y", kind="core_engine"))
    assert (await cold.health()).ok is False


async def test_the_engine_runs_in_its_own_process_unless_engine_process_is_false() -> None:
    from backends.worker import WorkerBackend
    from gateway.app import create_app
    from gateway.testing import gateway_config

    def built(**fields: Any) -> Any:
        config = gateway_config(BackendConfig(name="c", kind="core_engine", **fields), models={"m": ["c"]})
        return create_app(config).state.gateway.backends["c"]

    assert isinstance(built(), WorkerBackend)  # the default: nothing loads until start
    assert isinstance(built(options={"engine_process": True}), WorkerBackend)
    assert isinstance(built(options={"engine_process": False}), CoreEngineBackend)
    assert isinstance(built(worker_process=False), CoreEngineBackend)
    with pytest.raises(Exception, match=r"backends.c.options.engine_process: contradicts"):
        built(options={"engine_process": False}, worker_process=True)
