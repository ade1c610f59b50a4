"""``infermux_wrap_generate``: plugins around the backend call (timing, caching), live."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import msgspec
import openai
import pytest

from backends.base import GenerationChunk, GenerationRequest
from plugins.hookspecs import hookimpl
from plugins.manager import PluginHooks
from plugins.testing import gateway_config, make_plugin_manager, mock_backend

Next = Callable[[GenerationRequest], AsyncIterator[GenerationChunk]]


def chat(client: Any, text: str = "one two three four", **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": text}], **kwargs
    )


class Timer:
    """Times every backend call and counts its chunks (an async-generator wrapper)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, float]] = []

    @hookimpl
    async def infermux_wrap_generate(
        self, request: GenerationRequest, backend_name: str, call_next: Next
    ) -> AsyncIterator[GenerationChunk]:
        started = time.monotonic()
        num_chunks = 0
        try:
            async for chunk in call_next(request):
                num_chunks += 1
                yield chunk
        finally:
            self.calls.append((backend_name, num_chunks, time.monotonic() - started))


class Cache:
    """Answers repeated prompts from memory: a coroutine that returns an iterator or None."""

    def __init__(self) -> None:
        self.store: dict[str, list[GenerationChunk]] = {}

    @hookimpl
    async def infermux_wrap_generate(
        self, request: GenerationRequest, call_next: Next
    ) -> AsyncIterator[GenerationChunk] | None:
        key = msgspec.json.encode([request.messages, request.params]).decode()
        if key in self.store:
            return self._replay(self.store[key])
        if request.params.temperature > 0:
            return None  # not cacheable: leave the call unwrapped
        return self._record(key, call_next(request))

    async def _replay(self, chunks: list[GenerationChunk]) -> AsyncIterator[GenerationChunk]:
        for chunk in chunks:
            yield chunk

    async def _record(
        self, key: str, stream: AsyncIterator[GenerationChunk]
    ) -> AsyncIterator[GenerationChunk]:
        chunks = []
        async for chunk in stream:
            chunks.append(chunk)
            yield chunk
        self.store[key] = chunks


def test_a_timing_wrapper_sees_every_chunk_of_the_served_call(plugin_gateway) -> None:
    timer = Timer()
    config = gateway_config(mock_backend("a"))
    with plugin_gateway(timer, config=config) as gateway:
        reply = chat(gateway.openai_client())
    assert reply.choices[0].message.content
    [(backend_name, num_chunks, duration_s)] = timer.calls
    assert backend_name == "a"
    assert num_chunks >= 2  # tokens, then the final chunk with usage
    assert duration_s >= 0


def test_a_caching_wrapper_answers_a_repeated_prompt_without_the_backend(plugin_gateway) -> None:
    with plugin_gateway(Cache()) as gateway:
        client = gateway.openai_client()
        first = chat(client, temperature=0)
        second = chat(client, temperature=0)
        sampled = chat(client, temperature=1.0)
        backend = gateway.backend("mock")
        assert backend.num_started == 2  # the repeat never reached it; the sampled one did
    assert second.choices[0].message.content == first.choices[0].message.content
    assert second.usage.completion_tokens == first.usage.completion_tokens
    assert sampled.choices[0].message.content


def test_wrappers_nest_tryfirst_outermost_and_may_rewrite_chunks(plugin_gateway) -> None:
    order: list[str] = []

    class Outer:
        @hookimpl(tryfirst=True)
        async def infermux_wrap_generate(self, request, call_next):  # type: ignore[no-untyped-def]
            order.append("outer")
            async for chunk in call_next(request):
                yield msgspec.structs.replace(chunk, text=chunk.text.upper())

    class Inner:
        @hookimpl
        def infermux_wrap_generate(self, request, call_next):  # type: ignore[no-untyped-def]
            order.append("inner")
            return None

    with plugin_gateway(Inner(), Outer()) as gateway:
        reply = chat(gateway.openai_client(), "quiet words")
    assert order == ["outer", "inner"]
    assert reply.choices[0].message.content == reply.choices[0].message.content.upper()
    assert "QUIET" in reply.choices[0].message.content


def test_retries_still_happen_around_the_wrappers(plugin_gateway) -> None:
    timer = Timer()
    config = gateway_config(
        mock_backend("down", fail_before_first_token="unavailable"), mock_backend("up")
    )
    with plugin_gateway(timer, config=config) as gateway:
        answer = httpx.post(
            f"{gateway}/v1/chat/completions",
            json={"model": "echo", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
    assert answer.status_code == 200
    assert answer.headers["x-infermux-backend"] == "up"
    assert [name for name, _, _ in timer.calls] == ["down", "up"]


def test_a_broken_wrapper_fails_the_request_naming_the_plugin_not_the_backend(
    plugin_gateway,
) -> None:
    class Broken:
        @hookimpl
        async def infermux_wrap_generate(self, request, call_next):  # type: ignore[no-untyped-def]
            raise KeyError("a bug in the plugin")
            yield  # an async generator

    config = gateway_config(mock_backend("a"), mock_backend("b"))
    with plugin_gateway(Broken(), config=config) as gateway:
        with pytest.raises(openai.InternalServerError) as caught:
            chat(gateway.openai_client())
        # Not retried elsewhere, and no backend is blamed for it.
        assert gateway.backend("b").num_started == 0
        assert set(gateway.state.router.circuit_states().values()) == {"closed"}
    assert caught.value.status_code == 500
    assert "infermux_wrap_generate" in caught.value.message


def test_a_client_disconnect_aborts_the_backend_through_the_wrappers(plugin_gateway) -> None:
    timer = Timer()
    config = gateway_config(mock_backend("slow", token_delay_s=0.05))
    with plugin_gateway(timer, config=config) as gateway:
        with httpx.stream(
            "POST",
            f"{gateway}/v1/chat/completions",
            json={
                "model": "echo",
                "stream": True,
                "messages": [{"role": "user", "content": "word " * 200}],
            },
            timeout=30,
        ) as response:
            next(response.iter_lines())  # the stream has started; now hang up
        backend = gateway.backend("slow")
        deadline = time.monotonic() + 10
        while backend.num_aborted == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert backend.num_aborted == 1
        assert backend.num_active == 0


async def test_without_wrappers_the_backend_stream_is_used_as_it_is() -> None:
    hooks = PluginHooks(make_plugin_manager())

    async def generate(request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        yield GenerationChunk(text="x")

    request = GenerationRequest(request_id="r", model="m", kind="completion", prompt="p")
    stream = hooks.wrap_generate(request=request, backend_name="a", generate=generate)
    assert type(stream).__name__ == "async_generator"
    assert [c.text async for c in stream] == ["x"]
