"""Continuous batching in the llama.cpp backend, with the real default model (SmolLM2-135M).

Several requests share each ``llama_decode``; each must still get exactly its own output
(sampler, seed, stop strings, limits, logprobs), its own slot of the prompt cache, and its own
cancellation and errors.

Alone-versus-together comparisons use short prompts on fresh backends. There llama.cpp's CPU
kernels compute a sequence's rows the same way whatever else is in the batch, so texts must be
equal. Outside that regime llama.cpp itself rounds differently: its flash attention takes other
kernels for batches of 64+ tokens and for one-token batches over 512+ KV cells, and sums the
KV cells (in f16) in cell order, which differs from position order once a reused slot's new
tokens land in cells freed by another slot. There the first token's logprobs moved by up to
0.15 nats on this small model, enough to flip a near tie.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import llama_cpp
import pytest
import pytest_asyncio

from backends._llamacpp_slot import SlotPool
from backends.base import (
    BackendConfig,
    ChatMessage,
    GenerationChunk,
    GenerationRequest,
    SamplingParams,
)
from backends.errors import BackendError, ContextLengthExceededError, UpstreamTimeoutError
from backends.llamacpp import LlamaCppBackend, create_backend
from tests.backends.llamacpp_util import _chat, _collect, _completion

F = TypeVar("F", bound=Callable[..., Any])

PARALLEL = 4


def real_model(test: F) -> F:
    """A test on the module's backend (one event loop for the module, as the fixture)."""
    return pytest.mark.slow(pytest.mark.asyncio(loop_scope="module")(test))


async def _started(**options: object) -> LlamaCppBackend:
    # One thread: two OpenMP threads on a busy 2-core machine stall at every barrier.
    llama = create_backend(
        BackendConfig(name="batched", kind="llamacpp", options={"n_threads": 1} | options)
    )
    await llama.start()
    return llama


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backend() -> AsyncIterator[LlamaCppBackend]:
    llama = await _started(parallel=PARALLEL, n_ctx=512)
    yield llama
    await llama.aclose()


@pytest_asyncio.fixture(loop_scope="module")
async def fresh() -> AsyncIterator[Callable[[], Awaitable[LlamaCppBackend]]]:
    """Starts backends of the test's own, with empty KV caches (closed after the test)."""
    started: list[LlamaCppBackend] = []

    async def start() -> LlamaCppBackend:
        started.append(await _started(parallel=PARALLEL, n_ctx=128))
        return started[-1]

    yield start
    for llama in started:
        await llama.aclose()


Fresh = Callable[[], Awaitable[LlamaCppBackend]]


async def _alone(
    backend: LlamaCppBackend, requests: list[GenerationRequest]
) -> list[list[GenerationChunk]]:
    return [await _collect(backend, r) for r in requests]


async def _together(
    backend: LlamaCppBackend, requests: list[GenerationRequest]
) -> list[list[GenerationChunk]]:
    return list(await asyncio.gather(*(_collect(backend, r) for r in requests)))


async def _drain(stream: AsyncIterator[GenerationChunk]) -> list[GenerationChunk]:
    return [chunk async for chunk in stream]


def _text(chunks: list[GenerationChunk]) -> str:
    return "".join(c.text for c in chunks)


def _runner(backend: LlamaCppBackend) -> Any:
    return backend._runner  # the decode counters live on the runner


PROMPTS = [
    "Name three colours.",
    "What is the capital of France?",
    "Write one sentence about cats.",
    "Count from one to five.",
]
#: Completions prompts of a few tokens each: four of them stay under 64 tokens per batch.
SHORT = [
    "The capital of France is",
    "My favourite colour is",
    "Cats like to",
    "One, two, three,",
]


@real_model
async def test_concurrent_greedy_requests_match_each_alone(fresh: Fresh) -> None:
    requests = [_completion(p, max_tokens=16, temperature=0) for p in SHORT]
    alone = await _alone(await fresh(), requests)
    together = await _together(await fresh(), requests)
    assert [_text(c) for c in together] == [_text(c) for c in alone]
    assert len({_text(c) for c in together}) == len(SHORT)  # each got its own answer


@real_model
async def test_seeded_sample_is_the_same_alone_and_beside_others(fresh: Fresh) -> None:
    seeded = _completion("A poem about the sea:", max_tokens=20, temperature=1.0, seed=7)
    (alone,) = await _alone(await fresh(), [seeded])
    others = [_completion(p, max_tokens=20, temperature=1.0) for p in SHORT[:3]]
    together = await _together(await fresh(), [others[0], seeded, others[1], others[2]])
    assert _text(together[1]) == _text(alone)
    other_seed = await _collect(
        await fresh(),
        _completion("A poem about the sea:", max_tokens=20, temperature=1.0, seed=8),
    )
    assert _text(other_seed) != _text(alone)  # the seed, not luck, made them equal


@real_model
async def test_concurrent_requests_keep_their_own_limits_stops_and_logprobs(
    fresh: Fresh,
) -> None:
    week = "The days of the week are Monday, Tuesday,"
    (reference,) = await _alone(await fresh(), [_completion(week, max_tokens=16, temperature=0)])
    full = _text(reference)
    stop = full.split()[1]  # the second day the model names
    requests = [
        _completion(week, max_tokens=16, temperature=0, stop=(stop,)),
        _completion("Hello", max_tokens=7, temperature=0, ignore_eos=True),
        _completion("Say hello.", max_tokens=5, temperature=0, logprobs=True, top_logprobs=3),
        _completion("The cat sat on the", max_tokens=3, temperature=0, echo=True, logprobs=True),
    ]
    alone = await _alone(await fresh(), requests)
    stopped, limited, with_logprobs, echoed = await _together(await fresh(), requests)

    assert _text(stopped) == full[: full.index(stop)]
    assert stopped[-1].finish_reason == "stop"

    assert limited[-1].finish_reason == "length"
    assert limited[-1].usage is not None and limited[-1].usage.completion_tokens == 7

    entries = [e for c in with_logprobs if c.logprobs for e in c.logprobs]
    assert len(entries) == with_logprobs[-1].usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(e.top_logprobs) == 3 for e in entries)
    assert all(e.top_logprobs[0].token_id == e.token_id for e in entries)  # greedy
    alone_entries = [e for c in alone[2] if c.logprobs for e in c.logprobs]
    assert [e.token_id for e in entries] == [e.token_id for e in alone_entries]
    assert [e.logprob for e in entries] == [e.logprob for e in alone_entries]

    prompt_entries = echoed[0].prompt_logprobs
    assert echoed[0].prompt_text == "The cat sat on the"
    assert prompt_entries is not None
    assert len(prompt_entries) == echoed[-1].usage.prompt_tokens  # type: ignore[union-attr]
    assert "".join(e.token for e in prompt_entries) == "The cat sat on the"
    assert prompt_entries[0].logprob is None
    alone_prompt = alone[3][0].prompt_logprobs
    assert alone_prompt is not None
    assert [e.logprob for e in prompt_entries] == [e.logprob for e in alone_prompt]

    for mine, single in zip([stopped, limited, with_logprobs, echoed], alone, strict=True):
        assert _text(mine) == _text(single)


@real_model
async def test_repeated_prompts_reuse_their_own_slot(backend: LlamaCppBackend) -> None:
    first = _completion("The quick brown fox jumps over the lazy dog.", max_tokens=4)
    second = _completion("Zebras live in Africa and eat grass all day.", max_tokens=4)
    before = await _together(backend, [first, second])
    after = await _together(backend, [first, second])
    for old, new in zip(before, after, strict=True):
        usage = new[-1].usage
        assert usage is not None and usage.cached_tokens is not None
        # Everything but the last prompt token, whose logits are sampled, came from the slot.
        assert usage.cached_tokens == usage.prompt_tokens - 1
        assert old[-1].usage is not None and old[-1].usage.prompt_tokens == usage.prompt_tokens


@real_model
async def test_cancelling_one_stream_leaves_the_others_running(
    backend: LlamaCppBackend,
) -> None:
    await backend.wait_idle()
    before = backend.num_generated_tokens
    requests = [_chat(p, max_tokens=30, ignore_eos=True, temperature=0) for p in PROMPTS[:3]]
    streams = [backend.generate(r) for r in requests]
    for stream in streams:
        await anext(stream)
    await streams[1].aclose()  # type: ignore[attr-defined]
    rest = await asyncio.gather(_drain(streams[0]), _drain(streams[2]))
    await backend.wait_idle()
    for chunks in rest:
        assert chunks[-1].finish_reason == "length"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 30
    generated = backend.num_generated_tokens - before
    assert generated < 2 * 30 + 10, f"{generated} tokens: the closed stream went on"


@real_model
async def test_concurrent_requests_share_decode_calls(fresh: Fresh) -> None:
    llama = await fresh()
    requests = [_chat(p, max_tokens=16, ignore_eos=True, temperature=0) for p in PROMPTS]
    results = await _together(llama, requests)
    assert all(r[-1].usage is not None and r[-1].usage.completion_tokens == 16 for r in results)
    runner = _runner(llama)
    # One at a time, 4 x 16 tokens would take 64 decodes (plus the prompts').
    assert runner.num_decode_calls < 2 * 16, f"{runner.num_decode_calls} llama_decode calls"
    assert runner.max_sequences_per_decode == PARALLEL


@real_model
async def test_requests_beyond_parallel_wait_for_a_slot(backend: LlamaCppBackend) -> None:
    requests = [_chat(f"Say the number {i}.", max_tokens=6, temperature=0) for i in range(6)]
    together = await _together(backend, requests)
    alone = await _alone(backend, requests[4:])
    assert [_text(c) for c in together[4:]] == [_text(c) for c in alone]
    assert all(c[-1].finish_reason in ("stop", "length") for c in together)


@real_model
async def test_context_length_is_per_request(backend: LlamaCppBackend) -> None:
    assert backend.model_info().context_length == 512
    with pytest.raises(ContextLengthExceededError) as too_many:
        await _collect(backend, _completion("Hello", max_tokens=520))
    assert too_many.value.param == "max_tokens"
    # Four requests that each use most of their 512 positions fit side by side.
    long_prompt = "one two three four five six seven eight nine ten " * 30
    requests = [
        _completion(long_prompt + str(i), max_tokens=100, ignore_eos=True) for i in range(4)
    ]
    results = await _together(backend, requests)
    for chunks in results:
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens > 300
        assert usage.completion_tokens == 100


@real_model
async def test_a_passed_deadline_ends_only_its_request(backend: LlamaCppBackend) -> None:
    expiring = GenerationRequest(
        request_id="late",
        model="smollm2",
        kind="chat",
        messages=(ChatMessage(role="user", content="Tell a long story."),),
        params=SamplingParams(max_tokens=400, ignore_eos=True),
        deadline=time.monotonic() + 0.2,
    )
    others = [_chat(p, max_tokens=8, temperature=0) for p in PROMPTS[:2]]
    outcomes = await asyncio.gather(
        _collect(backend, expiring), *(_collect(backend, r) for r in others),
        return_exceptions=True,
    )  # fmt: skip
    assert isinstance(outcomes[0], UpstreamTimeoutError)
    for chunks in outcomes[1:]:
        assert isinstance(chunks, list) and chunks[-1].finish_reason in ("stop", "length")


@real_model
async def test_a_failed_decode_fails_its_batch_and_serving_goes_on(
    backend: LlamaCppBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A real context never runs out of KV cells (each request fits its n_ctx), so the
    # failure llama.cpp reports then (return code 1) is injected once.
    real_decode = llama_cpp.llama_decode
    failures = iter([1])

    def failing_once(ctx: Any, batch: Any) -> int:
        return next(failures, None) or real_decode(ctx, batch)

    monkeypatch.setattr(llama_cpp, "llama_decode", failing_once)
    with pytest.raises(BackendError, match="llama_decode"):
        await _collect(backend, _chat("Hi", max_tokens=4))
    again = await _collect(backend, _chat("Hi", max_tokens=4, temperature=0))
    assert again[-1].finish_reason in ("stop", "length")


def test_parallel_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"backends\.x\.options\.parallel"):
        create_backend(BackendConfig(name="x", kind="llamacpp", options={"parallel": 0}))


def test_a_prompt_takes_the_free_slot_with_the_longest_common_prefix() -> None:
    pool = SlotPool(3)
    a, shared = pool.acquire([1, 2, 3])
    assert shared == 0
    a.tokens = [1, 2, 3, 4]
    pool.release(a)
    b, shared = pool.acquire([9, 9])  # no prefix anywhere: an unused slot, not the warm one
    assert b is not a and shared == 0
    b.tokens = [9, 9, 9]
    pool.release(b)
    again, shared = pool.acquire([1, 2, 3, 7])
    assert again is a and shared == 3
    c, shared = pool.acquire([5])  # a is busy; b and the unused slot tie at 0: the unused one
    assert c is not a and c is not b and shared == 0
