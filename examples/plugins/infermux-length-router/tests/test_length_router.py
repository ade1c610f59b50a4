"""The length router, through infermux's plugin manager and a live gateway."""

from __future__ import annotations

import httpx
import pytest
from infermux_length_router.length_router import create_plugin, prompt_length

from plugins import ChatMessage, GenerationRequest
from plugins.manager import PluginHooks
from plugins.testing import gateway_config, make_plugin_manager, mock_backend

SETTINGS = {"threshold_chars": 100, "long_backend": "big", "short_backend": "small"}


def chat(text: str, model: str = "echo") -> GenerationRequest:
    return GenerationRequest(
        request_id="r", model=model, kind="chat", messages=(ChatMessage(role="user", content=text),)
    )


def select(settings: dict[str, object], request: GenerationRequest) -> str | None:
    hooks = PluginHooks(make_plugin_manager(create_plugin(settings)))
    return hooks.select_backend(request=request, candidates=["small", "big"])


def test_long_prompts_go_to_the_long_backend_and_short_ones_to_the_short() -> None:
    assert select(SETTINGS, chat("x" * 100)) == "big"
    assert select(SETTINGS, chat("x" * 99)) == "small"


def test_token_id_prompts_count_four_characters_per_token() -> None:
    request = GenerationRequest(request_id="r", model="m", kind="completion", prompt=(1,) * 25)
    assert prompt_length(request) == 100


def test_it_abstains_when_unconfigured_for_other_models_or_unknown_backends() -> None:
    assert select({}, chat("x" * 1000)) is None
    assert select({**SETTINGS, "models": ["other"]}, chat("x" * 1000)) is None
    assert select({**SETTINGS, "long_backend": "gone"}, chat("x" * 1000)) is None


def test_bad_settings_name_the_key() -> None:
    with pytest.raises(ValueError, match="plugins.settings.length-router.*threshold_chars"):
        create_plugin({"threshold_chars": 0})
    with pytest.raises(ValueError, match="plugins.settings.length-router.*long_backnd"):
        create_plugin({"long_backnd": "big"})


def test_a_live_gateway_routes_by_length(plugin_gateway, hook_recorder) -> None:
    config = gateway_config(mock_backend("small"), mock_backend("big"))
    with plugin_gateway(create_plugin(SETTINGS), hook_recorder, config=config) as gateway:
        served = {}
        for name, text in (("short", "hello there"), ("long", "word " * 40)):
            answer = httpx.post(
                f"{gateway}/v1/chat/completions",
                json={
                    "model": "echo",
                    "max_tokens": 3,
                    "messages": [{"role": "user", "content": text}],
                },
                timeout=30,
            )
            assert answer.status_code == 200, answer.text
            served[name] = answer.headers["x-infermux-backend"]
        hook_recorder.wait_for("on_response", count=2)
    assert served == {"short": "small", "long": "big"}
