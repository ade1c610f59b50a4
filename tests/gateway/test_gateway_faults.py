"""Faults a client can notice: broken streams, disconnects, loading, plugin hooks.

Mock backends inject the faults (they fail or stall on command); everything else is real:
uvicorn on loopback, the router, the plugin manager.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from backends.errors import GenerationAbortedError, InvalidRequestError
from backends.mock import MockBackend
from gateway.config.types import PluginsConfig
from gateway.testing import gateway_config, mock_backend
from plugins.hookspecs import hookimpl
from plugins.manager import create_plugin_manager

LONG_PROMPT = " ".join(f"w{i}" for i in range(200))


def wait_until(predicate: Callable[[], bool], timeout_s: float = 20.0) -> None:
    """Poll ``predicate`` (work happens on the server thread); fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)


class Recorder:
    """A plugin that records every notification (async hooks, as a plugin author writes)."""

    def __init__(self) -> None:
        self.responses: list[tuple[str, str, Any, str | None]] = []
        self.errors: list[tuple[str, str | None, Exception]] = []

    @hookimpl
    async def infermux_on_response(
        self, request: Any, backend_name: str, usage: Any, finish_reason: str | None
    ) -> None:
        self.responses.append((request.request_id, backend_name, usage, finish_reason))

    @hookimpl
    async def infermux_on_error(
        self, request: Any, backend_name: str | None, error: Exception
    ) -> None:
        self.errors.append((request.request_id, backend_name, error))


def recording_plugins() -> tuple[Any, Recorder]:
    pm = create_plugin_manager(load_entry_points=False)
    recorder = Recorder()
    pm.register(recorder, name="recorder")
    return pm, recorder


def test_mid_stream_failure_sends_an_error_frame_and_no_done(live_gateway: Any) -> None:
    pm, recorder = recording_plugins()
    config = gateway_config(mock_backend("flaky", fail_after_tokens=2))
    with live_gateway(config, plugin_manager=pm) as gw:
        with httpx.stream(
            "POST",
            f"{gw}/v1/chat/completions",
            json={
                "model": "echo",
                "messages": [{"role": "user", "content": "a b c d"}],
                "stream": True,
            },
        ) as response:
            assert response.status_code == 200
            frames = [f for f in response.read().decode().split("\n\n") if f]
        assert "[DONE]" not in frames[-1]
        assert frames[-1].startswith('data: {"error":')
        assert '"code":"backend_error"' in frames[-1]
        assert sum('"content":"' in f for f in frames) == 3  # role delta + 2 tokens

        client = gw.openai_client()
        with pytest.raises(openai.APIError):
            for _ in client.chat.completions.create(
                model="echo", messages=[{"role": "user", "content": "a b c d"}], stream=True
            ):
                pass

        wait_until(lambda: len(recorder.errors) == 2)
        assert recorder.responses == []
        assert all(name == "flaky" for _, name, _ in recorder.errors)


def test_mid_generation_failure_without_stream_is_an_error_response(live_gateway: Any) -> None:
    config = gateway_config(mock_backend("flaky", fail_after_tokens=1))
    with live_gateway(config) as gw:
        response = httpx.post(f"{gw}/v1/completions", json={"model": "echo", "prompt": "a b c"})
        assert response.status_code == 502
        assert response.json()["error"]["code"] == "backend_error"


def test_stream_disconnect_aborts_the_backend(live_gateway: Any) -> None:
    pm, recorder = recording_plugins()
    config = gateway_config(mock_backend("slow", token_delay_s=0.05))
    with live_gateway(config, plugin_manager=pm) as gw:
        backend = gw.backend("slow")
        with httpx.stream(
            "POST",
            f"{gw}/v1/completions",
            json={"model": "echo", "prompt": LONG_PROMPT, "max_tokens": 200, "stream": True},
        ) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
        # The client hung up after the first token: the backend stops well before 200 tokens.
        wait_until(lambda: backend.num_aborted == 1)
        assert backend.num_finished == 0
        wait_until(lambda: len(recorder.errors) == 1)
        assert isinstance(recorder.errors[0][2], GenerationAbortedError)
        assert recorder.responses == []


def test_non_stream_disconnect_aborts_the_backend(live_gateway: Any) -> None:
    pm, recorder = recording_plugins()
    config = gateway_config(mock_backend("slow", token_delay_s=0.05))
    with live_gateway(config, plugin_manager=pm) as gw:
        backend = gw.backend("slow")
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{gw}/v1/completions",
                json={"model": "echo", "prompt": LONG_PROMPT, "max_tokens": 200},
                timeout=httpx.Timeout(10.0, read=0.5),
            )
        wait_until(lambda: backend.num_aborted == 1)
        assert backend.num_finished == 0
        wait_until(lambda: len(recorder.errors) == 1)
        assert isinstance(recorder.errors[0][2], GenerationAbortedError)


def test_each_choice_is_reported_exactly_once(live_gateway: Any) -> None:
    pm, recorder = recording_plugins()
    with live_gateway(gateway_config(), plugin_manager=pm) as gw:
        client = gw.openai_client()
        client.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "a b"}], n=3
        )
        list(client.completions.create(model="echo", prompt="x y", stream=True, max_tokens=1))
        wait_until(lambda: len(recorder.responses) == 4)
        time.sleep(0.2)  # nothing else may arrive
        assert len(recorder.responses) == 4
        assert recorder.errors == []
        finish = sorted(r[3] for r in recorder.responses)
        assert finish == ["length", "stop", "stop", "stop"]
        assert all(r[2] is not None and r[1] == "mock" for r in recorder.responses)
        assert len({r[0] for r in recorder.responses}) == 4  # distinct per-choice ids


def test_failing_and_hanging_plugins_do_not_affect_responses(live_gateway: Any) -> None:
    class Broken:
        @hookimpl
        def infermux_on_response(self) -> None:
            raise RuntimeError("plugin bug")

    class Hanging:
        @hookimpl
        async def infermux_on_response(self) -> None:
            await asyncio.sleep(3600)  # abandoned after hook_timeout_s

    pm, recorder = recording_plugins()
    pm.register(Broken(), name="broken")
    pm.register(Hanging(), name="hanging")
    config = gateway_config(plugins=PluginsConfig(hook_timeout_s=0.2))
    with live_gateway(config, plugin_manager=pm) as gw:
        completion = gw.openai_client().completions.create(model="echo", prompt="fine")
        assert completion.choices[0].text == "fine"
        # Called after the broken and the hanging one (LIFO): still notified.
        wait_until(lambda: len(recorder.responses) == 1)


def test_transform_request_can_rewrite_and_reject(live_gateway: Any) -> None:
    class Policy:
        @hookimpl
        async def infermux_transform_request(self, request: Any) -> Any:
            import msgspec

            if request.user == "banned":
                raise InvalidRequestError("this user may not call the API", param="user")
            return msgspec.structs.replace(request, labels={"policy": "seen"})

    pm = create_plugin_manager(load_entry_points=False)
    pm.register(Policy(), name="policy")
    with live_gateway(gateway_config(), plugin_manager=pm) as gw:
        client = gw.openai_client()
        client.completions.create(model="echo", prompt="ok")
        assert gw.backend("mock").received[-1].labels == {"policy": "seen"}
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="echo", prompt="ok", user="banned")
        assert caught.value.param == "user"


class GatedBackend(MockBackend):
    """A mock whose model 'loads' until the test opens the gate."""

    def __init__(self, config: Any, gate: threading.Event) -> None:
        super().__init__(config)
        self.gate = gate

    async def start(self) -> None:
        await asyncio.to_thread(self.gate.wait, 30)
        await super().start()


def test_ready_is_503_while_backends_load_and_requests_wait_for_them(live_gateway: Any) -> None:
    config = gateway_config(mock_backend("slowload"))
    gate = threading.Event()
    backend = GatedBackend(config.backends[0], gate)
    with live_gateway(config, backends={"slowload": backend}, wait_ready=False) as gw:
        ready = httpx.get(f"{gw}/ready")
        assert ready.status_code == 503
        assert ready.json()["status"] == "loading"
        assert ready.json()["backends"] == {"slowload": "loading"}
        assert httpx.get(f"{gw}/health").status_code == 200
        early = httpx.post(f"{gw}/v1/completions", json={"model": "echo", "prompt": "x"})
        assert early.status_code == 503
        assert early.json()["error"]["code"] == "backend_unavailable"
        assert early.headers["retry-after"] == "1"
        gate.set()
        wait_until(lambda: httpx.get(f"{gw}/ready").status_code == 200)
        assert (
            httpx.post(f"{gw}/v1/completions", json={"model": "echo", "prompt": "x"}).status_code
            == 200
        )


def test_a_backend_that_fails_to_start_is_reported_and_skipped(
    live_gateway: Any, caplog: pytest.LogCaptureFixture
) -> None:
    class Unloadable(MockBackend):
        async def start(self) -> None:
            raise RuntimeError("weights not found")

    config = gateway_config(mock_backend("broken"), mock_backend("fine"))
    with live_gateway(
        config, backends={"broken": Unloadable(config.backends[0])}, allow_failed_backends=True
    ) as gw:
        ready = httpx.get(f"{gw}/ready").json()
        # The state only (the probe is public); the reason is in the log.
        assert ready["backends"] == {"broken": "failed", "fine": "ready"}
        assert "weights not found" not in str(ready)
        assert "RuntimeError: weights not found" in caplog.text
        raw = gw.openai_client().completions.with_raw_response.create(model="echo", prompt="x")
        assert raw.headers["x-infermux-backend"] == "fine"


def test_draining_refuses_new_work_and_fails_readiness(live_gateway: Any) -> None:
    with live_gateway(gateway_config()) as gw:
        gw.state.draining = True
        assert httpx.get(f"{gw}/ready").json()["status"] == "draining"
        refused = httpx.post(f"{gw}/v1/completions", json={"model": "echo", "prompt": "x"})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "server_is_overloaded"


def test_disconnect_before_the_first_token_aborts_and_reports(live_gateway: Any) -> None:
    pm, recorder = recording_plugins()
    config = gateway_config(mock_backend("stalled", first_token_delay_s=30.0))
    with live_gateway(config, plugin_manager=pm) as gw:
        backend = gw.backend("stalled")
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{gw}/v1/chat/completions",
                json={
                    "model": "echo",
                    "messages": [{"role": "user", "content": "hi"}],
                    "stream": True,
                },
                timeout=httpx.Timeout(10.0, read=0.5),
            )
        wait_until(lambda: backend.num_aborted == 1)
        wait_until(lambda: len(recorder.errors) == 1)
        assert isinstance(recorder.errors[0][2], GenerationAbortedError)
        assert httpx.get(f"{gw}/ready").json()["circuits"] == {"stalled": "closed"}


class SecondChoiceFails(MockBackend):
    """Fails choice 1 before its first token; choice 0 streams slowly."""

    async def _produce(self, request: Any) -> Any:
        if request.choice_index == 1:
            await asyncio.sleep(0.05)
            raise InvalidRequestError("choice 1 cannot be served", param="n")
        async for chunk in super()._produce(request):
            yield chunk


def test_a_failing_choice_fails_the_request_and_aborts_its_siblings(live_gateway: Any) -> None:
    pm, recorder = recording_plugins()
    config = gateway_config(mock_backend("mixed", token_delay_s=0.05))
    backend = SecondChoiceFails(config.backends[0])
    with live_gateway(config, plugin_manager=pm, backends={"mixed": backend}) as gw:
        response = httpx.post(
            f"{gw}/v1/completions",
            json={"model": "echo", "prompt": LONG_PROMPT, "max_tokens": 100, "n": 2},
        )
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "n"
        wait_until(lambda: len(recorder.errors) == 2)
        kinds = sorted(type(error).__name__ for _, _, error in recorder.errors)
        assert kinds == ["GenerationAbortedError", "InvalidRequestError"]
        wait_until(lambda: backend.num_active == 0)
        assert backend.num_finished == 0
