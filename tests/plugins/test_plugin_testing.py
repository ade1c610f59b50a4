"""The plugin author's test helpers (``plugins.testing``), used the way an author would."""

from __future__ import annotations

import pytest

from backends.base import GenerationRequest
from plugins.hookspecs import hookimpl
from plugins.manager import PluginHooks
from plugins.testing import HookRecorder, gateway_config, hook_names, mock_backend

REQUEST = GenerationRequest(request_id="r", model="m", kind="completion", prompt="hi")


def test_the_fixtures_give_a_fresh_manager_and_a_recorder_of_every_hook(
    plugin_manager, hook_recorder
) -> None:  # type: ignore[no-untyped-def]
    names = {name for name, _ in plugin_manager.list_name_plugin()}
    assert "builtin.routing" in names
    assert "length-router" not in names  # installed entry-point plugins are left out
    assert hook_recorder.hooks == hook_names()


async def test_the_recorder_sees_arguments_and_changes_nothing(plugin_manager) -> None:  # type: ignore[no-untyped-def]
    recorder = HookRecorder(["select_backend", "infermux_transform_request"])
    plugin_manager.register(recorder)
    hooks = PluginHooks(plugin_manager)
    assert hooks.select_backend(request=REQUEST, candidates=["a", "b"]) is None
    assert await hooks.transform_request(request=REQUEST) == REQUEST
    call = recorder.last("select_backend")
    assert call["candidates"] == ["a", "b"] and call["request"] is REQUEST
    assert len(recorder.calls("transform_request")) == 1
    recorder.clear()
    assert recorder.calls("select_backend") == []


def test_the_recorder_names_mistakes() -> None:
    with pytest.raises(ValueError, match="on_respons"):
        HookRecorder(["on_respons"])
    recorder = HookRecorder(["on_error"])
    with pytest.raises(KeyError, match="infermux_on_response"):
        recorder.calls("on_response")
    with pytest.raises(AssertionError, match="called 0 time"):
        recorder.wait_for("on_error", timeout_s=0.05)
    with pytest.raises(AssertionError, match="never called"):
        recorder.last("on_error")


def test_a_live_gateway_with_a_plugin_and_the_whole_request_lifecycle_recorded(
    plugin_gateway, hook_recorder
) -> None:  # type: ignore[no-untyped-def]
    class PreferB:
        @hookimpl
        def infermux_select_backend(self, candidates: list[str]) -> str:
            return "b"

    config = gateway_config(mock_backend("a"), mock_backend("b"))
    with plugin_gateway(PreferB(), hook_recorder, config=config) as gateway:
        reply = gateway.openai_client().completions.create(
            model="echo", prompt="one two", max_tokens=2
        )
        response = hook_recorder.wait_for("on_response")
        summary = hook_recorder.wait_for("on_request_end")["summary"]
    assert reply.choices[0].text
    assert response["backend_name"] == "b"
    assert response["usage"].completion_tokens == reply.usage.completion_tokens
    assert hook_recorder.last("on_attempt_end")["error"] is None
    assert summary.backend_names == ["b"]
    assert len(hook_recorder.calls("startup")) == 1
