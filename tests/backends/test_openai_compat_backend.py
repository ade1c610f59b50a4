"""The ``openai`` backend against a real OpenAI-shaped server on loopback.

The upstream (tests/upstream_server.py) is told per test to answer, refuse, stall, rate
limit, fail, or die mid-stream; each test checks what a gateway user would see.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from typing import Any

import pytest
from upstream_server import Behaviour, TLSFiles, UpstreamServer, closed_port_url

from backends._sse import SSEParser
from backends.base import (
    BackendConfig,
    ChatMessage,
    GenerationChunk,
    GenerationRequest,
    ResumeState,
    SamplingParams,
)
from backends.deadline import Deadline
from backends.errors import (
    BackendError,
    BackendUnavailableError,
    InvalidRequestError,
    NotFoundError,
    StreamIdleTimeoutError,
    UpstreamRateLimitError,
    UpstreamStatusError,
    UpstreamStreamBrokenError,
    UpstreamTimeoutError,
)
from backends.openai_compat import OpenAICompatBackend, _Events, create_backend
from gateway.serving.router import RoutedStream

StartUpstream = Callable[..., UpstreamServer]


def _backend(base_url: str, **config: Any) -> OpenAICompatBackend:
    options = {"base_url": base_url, **config.pop("options", {})}
    return create_backend(BackendConfig(name="remote", kind="openai", options=options, **config))


def _chat(
    text: str = "hello from the test", *, stream: bool = True, **params: Any
) -> GenerationRequest:
    return GenerationRequest(
        request_id="req-1",
        model="alias",
        kind="chat",
        messages=(ChatMessage(role="user", content=text),),
        params=SamplingParams(**params),
        stream=stream,
        traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    )


async def _collect(
    backend: OpenAICompatBackend, request: GenerationRequest
) -> list[GenerationChunk]:
    try:
        return [chunk async for chunk in backend.generate(request)]
    finally:
        await backend.aclose()


async def _collect_without_closing(
    backend: OpenAICompatBackend, request: GenerationRequest
) -> list[GenerationChunk]:
    return [chunk async for chunk in backend.generate(request)]


@pytest.mark.parametrize("transport", ["native", "httpx"])
async def test_streams_chunk_by_chunk_with_usage(
    upstream_servers: StartUpstream, transport: str
) -> None:
    upstream = upstream_servers(Behaviour(cached_tokens=2))
    backend = _backend(
        upstream.base_url, options={"model": "upstream-name", "http_transport": transport}
    )
    chunks = await _collect(backend, _chat(max_tokens=50))
    assert [c.text for c in chunks[:-1]] == ["hello", " from", " the", " test"]
    assert chunks[-1].finish_reason == "stop"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.cached_tokens == 2
    sent = upstream.requests[-1]
    assert sent.json["stream"] is True
    assert sent.json["stream_options"] == {"include_usage": True}
    assert sent.json["model"] == "upstream-name"
    assert sent.json["max_tokens"] == 50
    assert sent.headers["traceparent"] == _chat().traceparent


async def test_for_an_answer_in_one_body_events_read_together_become_one_chunk(
    upstream_servers: StartUpstream,
) -> None:
    backend = _backend(upstream_servers(Behaviour()).base_url)
    events = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        *({"choices": [{"index": 0, "delta": {"content": w}}]} for w in ["a", " b", " c"]),
        {"choices": [{"index": 0, "delta": {"content": " d"}, "logprobs": {"content": []}}]},
        {"choices": [{"index": 0, "delta": {"content": " e"}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}},
    ]
    wire = SSEParser().feed(b"".join(b"data: %s\n\n" % json.dumps(e).encode() for e in events))

    def take(stream: bool) -> list[GenerationChunk]:
        return backend._take(_Events(_chat(stream=stream)), wire, not stream)

    # Streamed to the client: one chunk per event, as the upstream sent them.
    assert [(c.text, c.token_count) for c in take(stream=True)] == [
        ("a", None),
        (" b", None),
        (" c", None),
        (" d", None),
        (" e", None),
    ]
    # In one body: the plain text events run together, saying how many tokens they were;
    # an event with logprobs stays on its own.
    merged = take(stream=False)
    assert [(c.text, c.token_count) for c in merged] == [
        ("a b c", 3),
        (" d", None),
        (" e", None),
    ]
    assert merged[1].logprobs == ()
    await backend.aclose()


async def test_an_answer_in_one_body_cut_short_counts_every_token_it_got(
    upstream_servers: StartUpstream,
) -> None:
    """The gateway charges a broken answer for the tokens that arrived (merged or not)."""
    upstream = upstream_servers(Behaviour(mode="die_mid_stream", after_chunks=3))
    backend = _backend(upstream.base_url)
    received: list[GenerationChunk] = []
    with pytest.raises(BackendError):
        async for chunk in backend.generate(_chat("one two three four", stream=False)):
            received.append(chunk)
    await backend.aclose()
    assert "".join(c.text for c in received) == "one two three"
    assert sum(c.token_count or 1 for c in received) == 3


async def test_connections_are_kept_alive_and_stale_ones_replaced(
    upstream_servers: StartUpstream,
) -> None:
    upstream = upstream_servers()
    backend = _backend(upstream.base_url)
    for _ in range(3):
        chunks = [c async for c in backend.generate(_chat())]
        assert chunks[-1].finish_reason == "stop"
    assert upstream.num_connections == 1  # one connection served all three
    # The upstream drops idle connections from now on; every request must still succeed.
    upstream.behaviour = Behaviour(close_after_response=True)
    for _ in range(3):
        chunks = [c async for c in backend.generate(_chat())]
        assert chunks[-1].finish_reason == "stop"
    await backend.aclose()
    assert upstream.num_requests == 6


async def test_logprobs_pass_through(upstream_servers: StartUpstream) -> None:
    upstream = upstream_servers()
    chunks = await _collect(
        _backend(upstream.base_url), _chat("a b", logprobs=True, top_logprobs=1)
    )
    entries = [e for c in chunks if c.logprobs for e in c.logprobs]
    assert [e.token for e in entries] == ["a", " b"]
    assert all(e.top_logprobs[0].token == e.token for e in entries)
    assert upstream.requests[-1].json["top_logprobs"] == 1


async def test_completions_with_echo_and_legacy_logprobs(upstream_servers: StartUpstream) -> None:
    upstream = upstream_servers(Behaviour(reply="out put"))
    request = GenerationRequest(
        request_id="r",
        model="alias",
        kind="completion",
        prompt="in put",
        params=SamplingParams(echo=True),
    )
    chunks = await _collect(_backend(upstream.base_url), request)
    assert chunks[0].prompt_text == "in put"
    assert "".join(c.text for c in chunks) == "out put"
    assert "echo" not in upstream.requests[-1].json  # answered here, not by the upstream

    with_logprobs = msgspec_replace(request, params=SamplingParams(logprobs=True, top_logprobs=1))
    chunks = await _collect(_backend(upstream.base_url), with_logprobs)
    entries = [e for c in chunks if c.logprobs for e in c.logprobs]
    assert [(e.token, e.text_offset) for e in entries] == [("out", 0), (" put", 3)]


async def test_api_key_comes_from_the_named_environment_variable(
    upstream_servers: StartUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    upstream = upstream_servers()
    monkeypatch.setenv("UPSTREAM_KEY_FOR_TEST", "sk-test-123")
    backend = _backend(upstream.base_url, options={"api_key_env": "UPSTREAM_KEY_FOR_TEST"})
    await _collect(backend, _chat())
    assert upstream.requests[-1].headers["authorization"] == "Bearer sk-test-123"

    monkeypatch.delenv("UPSTREAM_KEY_FOR_TEST")
    missing = _backend(upstream.base_url, options={"api_key_env": "UPSTREAM_KEY_FOR_TEST"})
    with pytest.raises(BackendUnavailableError, match=r"options\.api_key_env"):
        await missing.start()


async def test_refused_connection_is_retryable_unavailable() -> None:
    with pytest.raises(BackendUnavailableError) as caught:
        await _collect(_backend(closed_port_url()), _chat())
    assert caught.value.retryable


@pytest.mark.parametrize(
    ("behaviour", "error_type", "retryable"),
    [
        (Behaviour(mode="status", status=500), UpstreamStatusError, True),
        (Behaviour(mode="status", status=503), UpstreamStatusError, True),
        (Behaviour(mode="close_without_response"), BackendUnavailableError, True),
        (Behaviour(mode="status", status=401), BackendError, False),
    ],
    ids=["500", "503", "dropped", "401"],
)
async def test_upstream_failures_before_output(
    upstream_servers: StartUpstream, behaviour: Behaviour, error_type: type, retryable: bool
) -> None:
    upstream = upstream_servers(behaviour)
    with pytest.raises(error_type) as caught:
        await _collect(_backend(upstream.base_url), _chat())
    assert caught.value.retryable is retryable


async def test_rate_limit_carries_retry_after(upstream_servers: StartUpstream) -> None:
    upstream = upstream_servers(Behaviour(mode="status", status=429, retry_after="7"))
    with pytest.raises(UpstreamRateLimitError) as caught:
        await _collect(_backend(upstream.base_url), _chat())
    assert caught.value.retry_after == 7.0
    assert caught.value.status_code == 429


async def test_client_errors_pass_the_upstream_message_through(
    upstream_servers: StartUpstream,
) -> None:
    upstream = upstream_servers(
        Behaviour(
            mode="status",
            status=400,
            error_message="temperature too hot",
            error_param="temperature",
        )
    )
    with pytest.raises(InvalidRequestError) as caught:
        await _collect(_backend(upstream.base_url), _chat())
    assert (caught.value.message, caught.value.param) == ("temperature too hot", "temperature")
    assert not caught.value.retryable

    upstream.behaviour = Behaviour(mode="status", status=404, error_message="no such model")
    with pytest.raises(NotFoundError) as not_found:
        await _collect(_backend(upstream.base_url), _chat())
    assert not_found.value.status_code == 404


async def test_silence_before_headers_is_an_upstream_timeout(
    upstream_servers: StartUpstream,
) -> None:
    upstream = upstream_servers(Behaviour(mode="stall_before_headers"))
    with pytest.raises(UpstreamTimeoutError):
        await _collect(_backend(upstream.base_url, first_byte_timeout=0.3), _chat())
    await upstream.until(lambda: upstream.num_disconnects == 1)  # the request was abandoned


async def test_silence_after_headers_is_an_upstream_timeout(
    upstream_servers: StartUpstream,
) -> None:
    upstream = upstream_servers(Behaviour(mode="stall_before_first_chunk"))
    with pytest.raises(UpstreamTimeoutError):
        await _collect(_backend(upstream.base_url, first_byte_timeout=0.3), _chat())
    await upstream.until(lambda: upstream.num_disconnects == 1)


async def test_death_mid_stream_is_a_broken_stream_only_a_resume_may_act_on(
    upstream_servers: StartUpstream,
) -> None:
    """Retryable (``resume_on_failure`` continues the answer elsewhere); the router itself
    never retries after the first chunk (tests/reliability/test_upstream_faults.py)."""
    upstream = upstream_servers(Behaviour(mode="die_mid_stream", after_chunks=2))
    received: list[str] = []
    backend = _backend(upstream.base_url)
    with pytest.raises(UpstreamStreamBrokenError) as caught:
        async for chunk in backend.generate(_chat("one two three four")):
            received.append(chunk.text)
    await backend.aclose()
    assert received == ["one", " two"]
    assert caught.value.retryable
    assert caught.value.code == "upstream_stream_broken"


async def test_stall_mid_stream_hits_the_idle_timeout(upstream_servers: StartUpstream) -> None:
    upstream = upstream_servers(Behaviour(mode="stall_mid_stream", after_chunks=1))
    backend = _backend(upstream.base_url, idle_timeout=0.3)
    with pytest.raises(StreamIdleTimeoutError):
        await _collect(backend, _chat("one two three"))
    await upstream.until(lambda: upstream.num_disconnects == 1)


async def test_closing_the_iterator_closes_the_upstream_stream(
    upstream_servers: StartUpstream,
) -> None:
    upstream = upstream_servers(Behaviour(mode="stall_mid_stream", after_chunks=1))
    backend = _backend(upstream.base_url)
    stream = backend.generate(_chat("one two three"))
    assert (await anext(stream)).text == "one"
    await stream.aclose()  # type: ignore[attr-defined]
    await upstream.until(lambda: upstream.num_disconnects == 1)
    await backend.aclose()


@pytest.mark.parametrize("scheme", ["http", "https"])
async def test_a_deadline_expiring_while_another_unwinds_still_closes_the_upstream(
    test_ca: TLSFiles, scheme: str
) -> None:
    # The router bounds the first chunk and the backend bounds it again, a fraction of a
    # millisecond later. When the second deadline fired while the first one's cancellation
    # was unwinding through httpx's close, the close stopped half-way: the upstream kept its
    # connection and went on generating (a CI run saw it, 2026-12-05). Sweep the gap.
    # A request the gateway kept open ends "stalled" after ``stall_s``; one it closed ends
    # "disconnected" as soon as the upstream's thread gets to it (on a loaded machine, not
    # within any short bound: the wait below is only a hang guard, the outcome is what
    # counts).
    upstream = UpstreamServer(
        Behaviour(mode="stall_before_first_chunk", stall_s=5.0),
        tls=test_ca if scheme == "https" else None,
    ).start()
    options: dict[str, Any] = {"http_transport": "httpx"}
    if scheme == "https":
        options["ca_bundle"] = str(test_ca.ca_bundle)
    backend = _backend(upstream.base_url, options=options, first_byte_timeout=0.05)
    kept_open: list[float] = []
    try:
        # A first request opens the connection pool and the TLS context off the clock (cold,
        # it can take longer than the 50 ms: then once more).
        upstream.script(Behaviour())
        for _ in range(5):
            try:
                await _collect_without_closing(backend, _chat())
                break
            except UpstreamTimeoutError:
                pass
        num_warm_up = upstream.num_requests
        #: Requests (indexes in ``upstream.requests``) already checked.
        checked = len(upstream.requests)

        for step in range(60):
            gap_s = step * 25e-6
            with pytest.raises((TimeoutError, UpstreamTimeoutError)):
                with Deadline(time.monotonic() + 0.05 - gap_s):
                    async for _ in backend.generate(_chat()):
                        pass
            # Every request the upstream got was closed (a request cut before it was sent
            # never reaches it, and is nothing it could keep open; one that reaches it only
            # now is checked with the next step).
            received = upstream.requests[checked : len(upstream.requests)]
            checked += len(received)
            try:
                await upstream.until(
                    lambda received=received: all(r.outcome != "open" for r in received), 10.0
                )
            except AssertionError:
                pass  # still open: kept open, as below
            if any(r.outcome != "disconnected" for r in received):
                kept_open.append(gap_s)  # go on sweeping
        assert upstream.num_requests - num_warm_up >= 50, "most steps must reach the upstream"
        assert kept_open == [], (
            f"the upstream streamed on with the outer deadline {kept_open[0] * 1e6:.0f} us "
            "before the backend's"
        )
    finally:
        await backend.aclose()
        upstream.stop()


@pytest.mark.parametrize("scheme", ["http", "https"])
async def test_the_router_total_deadline_next_to_the_backend_one_still_closes_the_upstream(
    test_ca: TLSFiles, scheme: str
) -> None:
    # Mid-stream, the router's stream timer (RoutedStream) and the backend's own deadline
    # bound the same total timeout and fire microseconds apart, in either order. When the
    # router's cancelled the task while the backend's cancellation was unwinding through
    # httpx's close over TLS, the upstream kept its connection and streamed on (a CI run
    # saw it, 2026-12-06). Sweep the gap both ways.
    upstream = UpstreamServer(
        Behaviour(reply=" ".join(f"t{i}" for i in range(400)), chunk_delay_s=0.005),
        tls=test_ca if scheme == "https" else None,
    ).start()
    options: dict[str, Any] = {"http_transport": "httpx"}
    if scheme == "https":
        options["ca_bundle"] = str(test_ca.ca_bundle)
    backend = _backend(upstream.base_url, options=options)
    kept_open: float | None = None
    try:
        # A first request opens the connection pool and the TLS context (over 80 ms on a
        # loaded machine), so that every step below gets its first chunk in time.
        upstream.script(Behaviour())
        assert (await _collect_without_closing(backend, _chat()))[-1].finish_reason == "stop"
        #: Requests (indexes in ``upstream.requests``) already checked.
        checked = len(upstream.requests)

        steps = list(range(-20, 40))
        num_late = 0
        while steps:
            gap_s = steps[0] * 25e-6
            deadline = time.monotonic() + 0.08
            stream = backend.generate(msgspec_replace(_chat(), deadline=deadline))
            try:
                first = await anext(stream)
            except UpstreamTimeoutError:
                # No first chunk within the 80 ms (a loaded machine): the deadlines never
                # met mid-stream, so this gap runs again (the upstream must still see a
                # close, checked below).
                num_late += 1
                assert num_late < 20, "the upstream's first chunk keeps coming too late"
            else:
                steps.pop(0)
                routed = RoutedStream(
                    backend_name="remote",
                    attempts=[],
                    first=first,
                    stream=stream,
                    on_done=lambda *_: None,
                    deadline=deadline + gap_s,
                )
                with pytest.raises(UpstreamTimeoutError):
                    async for _ in routed:
                        pass
            # Every request the upstream got ends "disconnected" (a request cut before it was
            # sent never reaches it; one that reaches it only now is checked with the next
            # step). Kept open, it streams on and ends "ok" (400 events 5 ms apart: 2 s). A
            # close is seen at the upstream's next write, whenever its thread gets to run on a
            # loaded machine: the wait is only a hang guard, the outcome is what counts.
            received = upstream.requests[checked : len(upstream.requests)]
            checked += len(received)
            try:
                await upstream.until(
                    lambda received=received: all(r.outcome != "open" for r in received), 10.0
                )
            except AssertionError:
                pass  # still open: kept open, as below
            if any(r.outcome != "disconnected" for r in received):
                kept_open = gap_s
                break
        assert kept_open is None, (
            f"the upstream streamed on with the router's timer {kept_open * 1e6:+.0f} us "
            "after the backend's deadline"
        )
    finally:
        await backend.aclose()
        upstream.stop()


@pytest.mark.parametrize("first", ["router_total", "backend_deadline", "disconnect", "aclose"])
@pytest.mark.parametrize("transport", ["native", "httpx", "https"])
async def test_the_upstream_sees_one_close_per_request_whichever_cancellation_comes_first(
    test_ca: TLSFiles, transport: str, first: str
) -> None:
    # Mid-stream, four hands end a request: the router's total timeout (RoutedStream's
    # timer), the backend's own deadline (its idle and total deadlines are one Deadline
    # block), the client's disconnect (the consuming task cancelled) and an abort
    # (RoutedStream.aclose from another task). ``first`` is due first, the three others
    # ``gap`` later: at gap 0 all land in the same loop turn, at the larger gaps while the
    # first one's cancellation unwinds. However they pile up, the upstream sees its request
    # closed once and the consumer ends.
    loop = asyncio.get_running_loop()
    upstream = UpstreamServer(
        Behaviour(mode="stall_mid_stream", after_chunks=1),
        tls=test_ca if transport == "https" else None,
    ).start()
    options: dict[str, Any] = {"http_transport": "native" if transport == "native" else "httpx"}
    if transport == "https":
        options["ca_bundle"] = str(test_ca.ca_bundle)
    backend = _backend(upstream.base_url, options=options)
    gaps_s = [0.0, 0.0, 50e-6, 200e-6, 1e-3]
    try:
        upstream.script(Behaviour())  # opens the pool (and TLS) off the clock
        await _collect_without_closing(backend, _chat())
        for gap_s in gaps_s:
            at = time.monotonic() + 0.2
            later = math.nextafter(at + gap_s, math.inf)
            due = {
                name: at if name == first else later
                for name in ("router_total", "backend_deadline", "disconnect", "aclose")
            }
            stream = backend.generate(msgspec_replace(_chat(), deadline=due["backend_deadline"]))
            routed = RoutedStream(
                backend_name="remote",
                attempts=[],
                first=await anext(stream),
                stream=stream,
                on_done=lambda *_: None,
                deadline=due["router_total"],
            )

            async def consume(routed: RoutedStream = routed) -> None:
                try:
                    async for _ in routed:
                        pass
                finally:
                    await routed.aclose()

            consumer = asyncio.ensure_future(consume())
            abort: asyncio.Future[asyncio.Task[None]] = loop.create_future()
            loop.call_at(due["disconnect"], consumer.cancel)
            loop.call_at(
                due["aclose"],
                lambda r=routed, f=abort: f.set_result(asyncio.ensure_future(r.aclose())),
            )
            await asyncio.wait([consumer], timeout=5.0)
            assert consumer.done(), "the consumer did not end"
            if not consumer.cancelled():
                assert isinstance(consumer.exception(), UpstreamTimeoutError)
            await asyncio.wait_for(await asyncio.wait_for(abort, 5.0), 5.0)
        await upstream.until(lambda: upstream.num_disconnects == len(gaps_s), 5.0)
        closed = [r.outcome for r in upstream.requests if r.method == "POST"][1:]
        assert closed == ["disconnected"] * len(gaps_s)
    finally:
        await backend.aclose()
        upstream.stop()


@pytest.mark.parametrize("scheme", ["http", "https"])
async def test_a_second_cancellation_while_waiting_for_headers_still_closes_the_upstream(
    test_ca: TLSFiles, scheme: str
) -> None:
    # A client that leaves while its request is being dropped for a timeout: two
    # cancellations in a row. The send's clean-up runs to its end in a task of its own.
    upstream = UpstreamServer(
        Behaviour(mode="stall_before_headers"), tls=test_ca if scheme == "https" else None
    ).start()
    options: dict[str, Any] = {"http_transport": "httpx"}
    if scheme == "https":
        options["ca_bundle"] = str(test_ca.ca_bundle)
    backend = _backend(upstream.base_url, options=options)

    async def consume() -> None:
        async for _ in backend.generate(_chat()):
            pass

    try:
        task = asyncio.ensure_future(consume())
        await upstream.until(lambda: upstream.num_requests == 1)
        task.cancel()
        asyncio.get_running_loop().call_soon(task.cancel)
        with pytest.raises(asyncio.CancelledError):
            await task
        await upstream.until(lambda: upstream.num_disconnects == 1, 5.0)
    finally:
        await backend.aclose()
        upstream.stop()


async def test_a_resumed_chat_goes_upstream_as_an_open_assistant_message(
    upstream_servers: StartUpstream,
) -> None:
    """With ``continue_final_message`` the partial answer is sent as vLLM's extension wants
    it, and the upstream's events (only the new text) pass through as they are."""
    upstream = upstream_servers(Behaviour(reply="au lait"))
    backend = _backend(upstream.base_url, options={"continue_final_message": True})
    assert backend.capabilities.resume
    request = msgspec_replace(
        _chat("Say it", max_tokens=5), resume=ResumeState(token_ids=(7, 8), text="Café")
    )
    chunks = await _collect(backend, request)
    assert "".join(c.text for c in chunks) == "au lait"
    body = upstream.requests[-1].json
    assert body["messages"] == [
        {"role": "user", "content": "Say it"},
        {"role": "assistant", "content": "Café"},
    ]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_tokens"] == 5


async def test_a_resumed_text_completion_goes_on_from_the_prompt_and_the_text(
    upstream_servers: StartUpstream,
) -> None:
    upstream = upstream_servers(Behaviour(reply="lait"))
    backend = _backend(upstream.base_url, options={"continue_final_message": True})
    request = GenerationRequest(
        request_id="r",
        model="alias",
        kind="completion",
        prompt="Un café",
        resume=ResumeState(text=" au"),
    )
    await _collect(backend, request)
    body = upstream.requests[-1].json
    assert body["prompt"] == "Un café au"
    assert "continue_final_message" not in body


async def test_without_the_option_a_remote_does_not_resume_and_sends_no_extension(
    upstream_servers: StartUpstream,
) -> None:
    upstream = upstream_servers()
    backend = _backend(upstream.base_url)
    assert not backend.capabilities.resume
    await _collect(backend, _chat())
    assert "continue_final_message" not in upstream.requests[-1].json
    assert "add_generation_prompt" not in upstream.requests[-1].json


@pytest.mark.parametrize(
    ("options", "key"),
    [
        (
            {"base_url": "http://h/v1", "continue_final_message": "sometimes"},
            "continue_final_message",
        ),
        ({"base_url": "ftp://host/v1"}, "base_url"),
        ({"base_url": "http://h/v1", "headers": {"Authorization": "Bearer x"}}, "headers"),
        ({"base_url": "http://h/v1", "api_key": "sk-x"}, "api_key"),
    ],
)
def test_bad_options_name_the_key(options: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=rf"backends\.remote\.options\.{key}"):
        create_backend(BackendConfig(name="remote", kind="openai", options=options))


def msgspec_replace(request: GenerationRequest, **changes: Any) -> GenerationRequest:
    import msgspec

    return msgspec.structs.replace(request, **changes)
