"""The model router without HTTP: ordering, fallback, retries, circuit, first-byte timeout.

Backends are mock backends with injected faults; hooks come from the real plugin manager
(built-in strategies registered as ordinary hookimpls), so plugins are exercised as a user's
plugin would be.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import pytest

from backends.base import (
    BackendConfig,
    ChatMessage,
    GenerationChunk,
    GenerationRequest,
    SamplingParams,
)
from backends.errors import (
    BackendError,
    BackendUnavailableError,
    InvalidRequestError,
    ModelNotFoundError,
    StreamIdleTimeoutError,
    UpstreamRateLimitError,
    UpstreamTimeoutError,
)
from backends.mock import MockBackend
from gateway.config.types import ModelConfig
from gateway.serving.router import ModelRouter, RoutedStream
from plugins.hookspecs import hookimpl
from plugins.manager import PluginHooks, create_plugin_manager


class FakeClock:
    """Time that moves only when the test says so (circuit cool-downs)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _router(
    backends: dict[str, dict[str, Any]],
    *,
    strategy: str = "priority",
    max_retries: int = 2,
    plugins: Sequence[object] = (),
    clock: Callable[[], float] | None = None,
    **backend_settings: Any,
) -> tuple[ModelRouter, dict[str, MockBackend]]:
    configs = {
        name: BackendConfig(name=name, kind="mock", options=options, **backend_settings)
        for name, options in backends.items()
    }
    mocks = {name: MockBackend(config) for name, config in configs.items()}
    pm = create_plugin_manager(load_entry_points=False)
    for plugin in plugins:
        pm.register(plugin)
    model = ModelConfig(
        alias="m", backends=list(backends), strategy=strategy, max_retries=max_retries
    )
    router = ModelRouter(
        models=[model],
        backends=mocks,
        backend_configs=configs,
        hooks=PluginHooks(pm),
        **({"clock": clock} if clock else {}),
    )
    return router, mocks


def _request(text: str = "hello there", model: str = "m") -> GenerationRequest:
    return GenerationRequest(
        request_id="r",
        model=model,
        kind="chat",
        messages=(ChatMessage(role="user", content=text),),
        params=SamplingParams(),
    )


class _Stalling:
    """A backend that sends one chunk, then nothing (until it is closed)."""

    name = "s"
    kind = "mock"
    capabilities = MockBackend(BackendConfig(name="s", kind="mock")).capabilities

    def __init__(self) -> None:
        self.closed = False

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        try:
            yield GenerationChunk(text="one")
            await asyncio.sleep(3600)
        finally:
            self.closed = True


async def _drain(stream: RoutedStream) -> str:
    return "".join([chunk.text async for chunk in stream])


async def test_priority_falls_back_before_the_first_chunk() -> None:
    router, mocks = _router({"a": {"fail_before_first_token": "unavailable"}, "b": {}})
    stream = await router.open(_request())
    assert stream.backend_name == "b"
    assert [(a.backend_name, type(a.error)) for a in stream.attempts] == [
        ("a", BackendUnavailableError),
        ("b", type(None)),
    ]
    assert await _drain(stream) == "hello there"
    assert router.outstanding() == {"a": 0, "b": 0}


async def test_client_errors_are_not_retried_elsewhere() -> None:
    router, mocks = _router({"a": {"fail_before_first_token": "invalid_request"}, "b": {}})
    with pytest.raises(InvalidRequestError):
        await router.open(_request())
    assert mocks["b"].num_started == 0


async def test_retries_stop_at_max_retries_and_surface_the_last_error() -> None:
    failing = {"fail_before_first_token": "rate_limit"}
    router, mocks = _router({n: dict(failing) for n in "abcd"}, max_retries=1)
    with pytest.raises(UpstreamRateLimitError) as caught:
        await router.open(_request())
    assert caught.value.retry_after == 1.0
    assert [mocks[n].num_started for n in "abcd"] == [1, 1, 0, 0]


async def test_no_retry_after_the_first_chunk() -> None:
    router, mocks = _router({"a": {"fail_after_tokens": 1}, "b": {}})
    stream = await router.open(_request("one two three"))
    with pytest.raises(BackendError):
        await _drain(stream)
    assert mocks["b"].num_started == 0
    assert router.outstanding()["a"] == 0


async def test_round_robin_spreads_requests() -> None:
    router, mocks = _router({"a": {}, "b": {}, "c": {}}, strategy="round_robin")
    served = []
    for _ in range(6):
        stream = await router.open(_request())
        served.append(stream.backend_name)
        await _drain(stream)
    assert served == ["a", "b", "c", "a", "b", "c"]


async def test_least_outstanding_avoids_the_busy_backend() -> None:
    router, mocks = _router({"a": {}, "b": {}}, strategy="least_outstanding")
    held = await router.open(_request("a long answer that stays open"))
    others = []
    for _ in range(3):
        stream = await router.open(_request())
        others.append(stream.backend_name)
        await _drain(stream)
    busy = held.backend_name
    assert all(name != busy for name in others)
    await held.aclose()
    assert router.outstanding() == {"a": 0, "b": 0}


async def test_circuit_opens_then_half_opens_after_the_cooldown() -> None:
    clock = FakeClock()
    router, mocks = _router(
        {"a": {"fail_before_first_token": "upstream_status"}, "b": {}},
        clock=clock,
        circuit_failure_threshold=2,
        circuit_cooldown_s=10.0,
    )
    for _ in range(2):
        await _drain(await router.open(_request()))
    assert router.circuit_states()["a"] == "open"
    await _drain(await router.open(_request()))
    assert mocks["a"].num_started == 2  # skipped while open

    clock.now += 10.0
    assert router.circuit_states()["a"] == "half_open"
    await _drain(await router.open(_request()))  # the probe fails: open again
    assert mocks["a"].num_started == 3
    assert router.circuit_states()["a"] == "open"

    clock.now += 10.0
    mocks["a"].options = type(mocks["a"].options)()  # the backend recovered
    stream = await router.open(_request())
    assert stream.backend_name == "a"
    await _drain(stream)
    assert router.circuit_states()["a"] == "closed"


async def test_every_circuit_open_is_unavailable_with_retry_after() -> None:
    clock = FakeClock()
    router, _ = _router(
        {"a": {"fail_before_first_token": "unavailable"}},
        clock=clock,
        circuit_failure_threshold=1,
        circuit_cooldown_s=30.0,
    )
    with pytest.raises(BackendUnavailableError):
        await router.open(_request())
    clock.now += 5.0
    with pytest.raises(BackendUnavailableError, match="circuit open") as caught:
        await router.open(_request())
    assert caught.value.retry_after == 25.0


async def test_first_byte_timeout_falls_back_and_aborts_the_slow_backend() -> None:
    router, mocks = _router(
        {"slow": {"first_token_delay_s": 30.0}, "fast": {}}, first_byte_timeout=0.2
    )
    stream = await router.open(_request())
    assert stream.backend_name == "fast"
    assert isinstance(stream.attempts[0].error, UpstreamTimeoutError)
    assert mocks["slow"].num_aborted == 1
    await _drain(stream)


async def test_pinned_backend_and_unknown_names() -> None:
    router, mocks = _router({"a": {}, "b": {}})
    stream = await router.open(_request(), pinned_backend="b")
    assert stream.backend_name == "b"
    await _drain(stream)
    with pytest.raises(InvalidRequestError) as unknown:
        await router.open(_request(), pinned_backend="zzz")
    assert (unknown.value.status_code, unknown.value.code) == (400, "unknown_backend")
    with pytest.raises(ModelNotFoundError) as missing:
        await router.open(_request(model="nope"))
    assert missing.value.param == "model"


async def test_pinned_backend_is_not_replaced_on_failure() -> None:
    router, mocks = _router({"a": {"fail_before_first_token": "unavailable"}, "b": {}})
    with pytest.raises(BackendUnavailableError):
        await router.open(_request(), pinned_backend="a")
    assert mocks["b"].num_started == 0


async def test_select_backend_hook_goes_first() -> None:
    class PreferB:
        @hookimpl
        def infermux_select_backend(
            self, request: GenerationRequest, candidates: list[str]
        ) -> str | None:
            return "b" if "b" in candidates else None

    router, _ = _router({"a": {}, "b": {}}, plugins=[PreferB()])
    stream = await router.open(_request())
    assert stream.backend_name == "b"
    await _drain(stream)


async def test_plugin_registered_strategy() -> None:
    class Reverse:
        def order(self, candidates: list[str], request: Any, outstanding: Any) -> list[str]:
            return candidates[::-1]

    class ReversePlugin:
        @hookimpl
        def infermux_register_routing_strategies(self, register: Callable[..., None]) -> None:
            register("reverse", Reverse)

    router, _ = _router({"a": {}, "b": {}}, strategy="reverse", plugins=[ReversePlugin()])
    stream = await router.open(_request())
    assert stream.backend_name == "b"
    await _drain(stream)


def test_unknown_strategy_names_the_key() -> None:
    with pytest.raises(
        ValueError, match=r"models\[0\]\.strategy: unknown routing strategy 'fastest'"
    ):
        _router({"a": {}}, strategy="fastest")


async def test_closing_a_routed_stream_aborts_the_backend() -> None:
    router, mocks = _router({"a": {"token_delay_s": 0.05}})
    stream = await router.open(_request("many words in this answer"))
    await stream.aclose()
    assert mocks["a"].num_aborted == 1
    assert router.outstanding() == {"a": 0}


async def _fed(stream: RoutedStream) -> str:
    texts: list[str] = []
    await stream.feed(lambda chunk: texts.append(chunk.text))
    return "".join(texts)


#: The two ways to consume a routed stream: iterating it, or having it push its chunks.
CONSUMERS = pytest.mark.parametrize("consume", [_drain, _fed], ids=["iterate", "feed"])


@CONSUMERS
async def test_a_steady_stream_outlasts_its_idle_timeout_and_a_stall_ends_it(
    consume: Callable[[RoutedStream], Awaitable[str]],
) -> None:
    # Chunks every 0.05 s for ~0.5 s under a 0.2 s idle timeout: the deadline moves on.
    router, mocks = _router({"a": {"token_delay_s": 0.05}}, idle_timeout=0.2)
    stream = await router.open(_request(" ".join(f"w{i}" for i in range(10))))
    assert (await consume(stream)).split() == [f"w{i}" for i in range(10)]
    assert router.outstanding() == {"a": 0}

    # A backend that stalls after its first chunk.
    stalling = _Stalling()
    config = BackendConfig(name="s", kind="mock", idle_timeout=0.2)
    router = ModelRouter(
        models=[ModelConfig(alias="m", backends=["s"])],
        backends={"s": stalling},  # type: ignore[dict-item]
        backend_configs={"s": config},
        hooks=PluginHooks(create_plugin_manager(load_entry_points=False)),
    )
    stream = await router.open(_request())
    # The stalled backend would sleep an hour: only the idle timer can end this (the outer
    # timeout turns a hang into a failure of a different kind).
    async with asyncio.timeout(60):
        with pytest.raises(StreamIdleTimeoutError) as raised:
            await consume(stream)
    assert "idle timeout (0.2 s)" in str(raised.value)
    assert stalling.closed
    assert router.outstanding() == {"s": 0}


@CONSUMERS
async def test_the_total_timeout_ends_a_steady_stream(
    consume: Callable[[RoutedStream], Awaitable[str]],
) -> None:
    router, mocks = _router({"a": {"token_delay_s": 0.05}}, idle_timeout=1.0, total_timeout=0.3)
    stream = await router.open(_request(" ".join(f"w{i}" for i in range(20))))
    with pytest.raises(UpstreamTimeoutError):
        await consume(stream)
    assert mocks["a"].num_aborted == 1


@CONSUMERS
async def test_an_outside_cancellation_of_a_wait_is_not_a_timeout(
    consume: Callable[[RoutedStream], Awaitable[str]],
) -> None:
    # The consumer waits on the stream under an armed idle timer (30 s: never reached) when
    # it is cancelled from outside; a few loop turns put it in that wait, no clock involved.
    router, mocks = _router({"a": {"token_delay_s": 0.2}}, idle_timeout=30.0)
    stream = await router.open(_request(" ".join(["word"] * 200)))
    task = asyncio.ensure_future(consume(stream))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await stream.aclose()
    assert router.outstanding() == {"a": 0}


async def test_a_fed_stream_raises_a_backend_failure_once_it_began() -> None:
    router, mocks = _router({"a": {"fail_after_tokens": 1}, "b": {}})
    stream = await router.open(_request("one two three"))
    texts: list[str] = []
    with pytest.raises(BackendError):
        await stream.feed(lambda chunk: texts.append(chunk.text))
    assert texts == ["one"]
    assert mocks["b"].num_started == 0
    assert router.outstanding()["a"] == 0
