"""AsyncLLM: concurrent streams, cancellation freeing blocks, errors, shutdown (tiny GGUF)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from core_engine.async_llm import AsyncLLM
from core_engine.errors import EngineDeadError, InvalidParamError, RequestTooLongError
from core_engine.llm_engine import LLMEngine
from core_engine.sampling_params import SamplingParams
from tests.core_engine.engine_util import engine_like, make_engine, reference_greedy
from tests.core_engine.gguf_factory import write_llama_gguf

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def base_engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    return make_engine(write_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf"))


@pytest.fixture()
async def llm(base_engine: LLMEngine) -> AsyncIterator[AsyncLLM]:
    async with AsyncLLM(engine_like(base_engine)) as llm:
        yield llm


async def collect(llm: AsyncLLM, req_id: str, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    tokens: list[int] = []
    async for out in llm.generate(prompt, params, req_id):
        tokens.extend(out.new_token_ids)
    return tokens


async def test_concurrent_streams_each_get_their_own_tokens(llm: AsyncLLM) -> None:
    prompts = {f"r{i}": [3 + i, 40 + 2 * i, 7, 90 - i] * (i + 1) for i in range(6)}
    results = await asyncio.gather(*(collect(llm, rid, p) for rid, p in prompts.items()))
    for (rid, prompt), tokens in zip(prompts.items(), results, strict=True):
        assert tokens == reference_greedy(llm.engine, prompt, 10), rid


async def test_closing_the_stream_aborts_and_frees_blocks(llm: AsyncLLM) -> None:
    total = await llm.call(lambda e: e.num_blocks)
    stream = llm.generate([5, 6, 7] * 20, SamplingParams(temperature=0, max_tokens=150, ignore_eos=True), "gone")
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 3:
            break
    await stream.aclose()
    # Commands run in order on the engine thread: once this call returns, the abort is done.
    assert await llm.call(lambda e: (e.num_free_blocks, e.has_unfinished_requests())) == (total, False)


async def test_cancelled_task_aborts_its_request(llm: AsyncLLM) -> None:
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in llm.generate([9] * 30, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), "c"):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await llm.call(lambda e: e.has_unfinished_requests()) is False


async def test_invalid_requests_fail_before_the_first_output(llm: AsyncLLM) -> None:
    with pytest.raises(RequestTooLongError):
        await collect(llm, "long", [5] * 250, SamplingParams(max_tokens=50))
    with pytest.raises(InvalidParamError):
        await collect(llm, "empty", [])


async def test_duplicate_request_id_is_refused_and_the_original_keeps_running(llm: AsyncLLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    original = asyncio.create_task(collect(llm, "dup", [4, 5, 6], params))
    await asyncio.sleep(0)
    while not await llm.call(lambda e: "dup" in e.scheduler.requests):
        await asyncio.sleep(0.01)
    with pytest.raises(InvalidParamError):
        await collect(llm, "dup", [7, 8])
    assert len(await original) == 30


async def test_shutdown_fails_open_streams_and_refuses_new_ones(base_engine: LLMEngine) -> None:
    llm = AsyncLLM(engine_like(base_engine))
    llm.start()
    stream = llm.generate([3, 4], SamplingParams(temperature=0, max_tokens=250, ignore_eos=True), "s")
    await stream.__anext__()
    await llm.shutdown()
    with pytest.raises(EngineDeadError):
        async for _ in stream:
            pass
    with pytest.raises(EngineDeadError):
        await collect(llm, "late", [3])
