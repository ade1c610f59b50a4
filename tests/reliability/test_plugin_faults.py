"""Plugins that raise or hang are contained: the request fails cleanly or is unaffected."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import httpx
import pytest
from reliability_util import (
    assert_still_serving,
    chat_body,
    envelope,
    recording_plugins,
    wait_until,
)

from gateway.config.types import LimitsConfig, PluginsConfig
from gateway.testing import gateway_config, mock_backend
from plugins.hookspecs import hookimpl


class RaisingPolicy:
    @hookimpl
    def infermux_transform_request(self, request: Any) -> Any:
        if request.user == "trigger":
            raise RuntimeError("policy bug")
        return None


class HangingPolicy:
    @hookimpl
    async def infermux_transform_request(self, request: Any) -> Any:
        if request.user == "trigger":
            await asyncio.sleep(3600)
        return None


@pytest.mark.parametrize("policy", [RaisingPolicy(), HangingPolicy()], ids=["raises", "hangs"])
def test_a_broken_transform_request_is_a_500_quoting_the_request_id(
    live_gateway: Any, caplog: pytest.LogCaptureFixture, policy: object
) -> None:
    pm, recorder = recording_plugins(policy)
    config = gateway_config(mock_backend("mock"), plugins=PluginsConfig(hook_timeout_s=0.3))
    with live_gateway(config, plugin_manager=pm) as gw, caplog.at_level(logging.ERROR):
        for stream in (False, True):
            response = httpx.post(
                f"{gw}/v1/chat/completions",
                json=chat_body(user="trigger", stream=stream),
                timeout=30,
            )
            error = envelope(response, 500)
            request_id = response.headers["x-request-id"]
            assert (error["type"], error["code"]) == ("server_error", "internal_error")
            assert request_id in error["message"]
            assert "policy bug" not in error["message"]  # internals stay in the log
            assert any(request_id in r.getMessage() for r in caplog.records)
        assert gw.backend("mock").num_started == 0  # a broken policy is never bypassed
        assert recorder.records == []
        assert_still_serving(gw)


class BrokenObserver:
    @hookimpl
    def infermux_on_response(self) -> None:
        raise RuntimeError("observer bug")

    @hookimpl
    def infermux_on_error(self) -> None:
        raise RuntimeError("observer bug")


class HangingObserver:
    """Hangs in every notification until :attr:`release` is set (or the hook times out)."""

    def __init__(self) -> None:
        self.num_calls = 0
        self.release = threading.Event()

    async def _hang(self) -> None:
        self.num_calls += 1
        while not self.release.is_set():
            await asyncio.sleep(0.05)

    @hookimpl
    async def infermux_on_response(self) -> None:
        await self._hang()

    @hookimpl
    async def infermux_on_error(self) -> None:
        await self._hang()


def test_observers_that_raise_or_hang_do_not_affect_requests(live_gateway: Any) -> None:
    hanging = HangingObserver()
    pm, recorder = recording_plugins(BrokenObserver(), hanging)
    config = gateway_config(
        mock_backend("mock"),
        mock_backend("flaky", fail_after_tokens=1),
        models={"echo": ["mock"], "flaky": ["flaky"]},
        plugins=PluginsConfig(hook_timeout_s=0.3),
    )
    with live_gateway(config, plugin_manager=pm) as gw:
        client = gw.openai_client()
        results: list[str] = []

        def one(index: int) -> None:
            if index % 2:
                chunks = client.chat.completions.create(
                    model="echo", messages=[{"role": "user", "content": f"s{index}"}], stream=True
                )
                results.append(
                    "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                )
            else:
                answer = client.completions.create(model="echo", prompt=f"c{index}")
                results.append(answer.choices[0].text)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert sorted(results) == sorted(f"{'s' if i % 2 else 'c'}{i}" for i in range(8))
        broken = httpx.post(
            f"{gw}/v1/completions", json={"model": "flaky", "prompt": "a b c"}, timeout=30
        )
        assert envelope(broken, 502)["code"] == "backend_error"
        # The recorder, called after the failing and the hanging plugins, still heard of all.
        wait_until(lambda: len(recorder.records) == 9)
        assert hanging.num_calls == 9
        assert_still_serving(gw)


def test_a_hanging_observer_never_holds_a_request_slot(live_gateway: Any) -> None:
    # One slot; the observer hangs for 30 s each time: the next request must not wait for it.
    hanging = HangingObserver()
    pm, _ = recording_plugins(hanging)
    config = gateway_config(
        mock_backend("mock"),
        plugins=PluginsConfig(hook_timeout_s=30),
        limits=LimitsConfig(max_concurrent_requests=1, max_queued_requests=0),
    )
    with live_gateway(config, plugin_manager=pm) as gw:
        for index in range(3):
            response = httpx.post(
                f"{gw}/v1/completions",
                json={"model": "echo", "prompt": f"p{index}"},
                timeout=httpx.Timeout(10.0),
            )
            assert response.status_code == 200, response.text
            wait_until(lambda: gw.state.admission.num_in_flight == 0, timeout_s=5)
        assert hanging.num_calls == 3  # all three still hanging, none holding a slot
        hanging.release.set()


class FailingLifecycle:
    @hookimpl
    def infermux_startup(self) -> None:
        raise RuntimeError("cannot reach the collector")

    @hookimpl
    async def infermux_shutdown(self) -> None:
        await asyncio.sleep(3600)


class FailingSelector:
    @hookimpl
    def infermux_select_backend(self) -> str:
        raise RuntimeError("selector bug")


def test_failing_lifecycle_and_selection_hooks_are_not_fatal(live_gateway: Any) -> None:
    pm, recorder = recording_plugins(FailingLifecycle(), FailingSelector())
    config = gateway_config(
        mock_backend("a"), mock_backend("b"), plugins=PluginsConfig(hook_timeout_s=0.3)
    )
    with live_gateway(config, plugin_manager=pm) as gw:
        response = httpx.post(f"{gw}/v1/completions", json={"model": "echo", "prompt": "x"})
        assert response.headers["x-infermux-backend"] == "a"  # the strategy decided
        assert_still_serving(gw)
        wait_until(lambda: len(recorder.responses) == 2)
    # Leaving the block stopped the server although the shutdown hook hangs.
