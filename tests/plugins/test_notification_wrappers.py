"""Wrapper hookimpls of notification hooks run as pluggy runs them: around the plain ones,
outermost first, with their answers; a broken wrapper is isolated like a broken plugin."""

from __future__ import annotations

from typing import Any

import pluggy

from backends.base import GenerationRequest
from plugins.hookspecs import hookimpl
from plugins.manager import PluginHooks, create_plugin_manager
from plugins.testing import gateway_config, mock_backend

REQUEST = GenerationRequest(request_id="r1", model="m", kind="completion", prompt="hi")


class Plain:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    @hookimpl
    def infermux_on_request_end(self, summary: Any) -> None:
        self.calls.append(f"plain:{summary.status}")

    @hookimpl
    def infermux_on_attempt_start(self, backend_name: str) -> str:
        return f"00-{'1' * 32}-{'2' * 16}-01:{backend_name}"


class Around:
    """A new-style wrapper (``wrapper=True``) around the request-end notification."""

    def __init__(self, calls: list[str], name: str = "around") -> None:
        self.calls, self.name = calls, name

    @hookimpl(wrapper=True)
    def infermux_on_request_end(self, summary: Any):  # type: ignore[no-untyped-def]
        self.calls.append(f"{self.name}:before")
        answers = yield
        self.calls.append(f"{self.name}:after:{answers}")
        return answers


class OldStyle:
    """An old-style ``hookwrapper`` reading the answers through ``pluggy.Result``."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    @hookimpl(hookwrapper=True)
    def infermux_on_attempt_start(self, attempt: int):  # type: ignore[no-untyped-def]
        outcome = yield
        assert isinstance(outcome, pluggy.Result)
        self.seen.append((attempt, outcome.get_result()))


def test_a_wrapper_runs_around_the_plain_notifications_of_a_real_request(plugin_gateway) -> None:
    calls: list[str] = []
    old = OldStyle()
    with plugin_gateway(Plain(calls), Around(calls), old, config=gateway_config(mock_backend("a"))) as gateway:
        reply = gateway.openai_client().chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "one two"}]
        )
    assert reply.choices[0].message.content
    # The built-in plugins answer None (not collected); the plain plugin appends, no answer.
    assert calls == ["around:before", "plain:ok", "around:after:[]"], calls
    [(attempt, answers)] = old.seen
    assert attempt == 0 and answers == [f"00-{'1' * 32}-{'2' * 16}-01:a"], old.seen


def _hooks(*plugins: object) -> PluginHooks:
    pm = create_plugin_manager(load_entry_points=False)
    for i, plugin in enumerate(plugins):
        pm.register(plugin, name=f"p{i}")
    return PluginHooks(pm, hook_timeout_s=0.5)


async def test_wrappers_nest_the_later_registered_outermost_as_pluggy_does() -> None:
    calls: list[str] = []
    hooks = _hooks(Around(calls, "inner"), Around(calls, "outer"))

    class Summary:
        status = "ok"

    await hooks._notify("infermux_on_request_end", {"summary": Summary()})
    assert calls == ["outer:before", "inner:before", "inner:after:[]", "outer:after:[]"], calls


async def test_a_wrapper_that_raises_does_not_stop_the_notification() -> None:
    calls: list[str] = []

    class BrokenBefore:
        @hookimpl(wrapper=True)
        def infermux_on_response(self):  # type: ignore[no-untyped-def]
            raise RuntimeError("bug before the yield")
            yield  # noqa: B901 (a generator that never gets there)

    class BrokenAfter:
        @hookimpl(wrapper=True)
        def infermux_on_response(self):  # type: ignore[no-untyped-def]
            yield
            raise RuntimeError("bug after the yield")

    class Listener:
        @hookimpl
        def infermux_on_response(self, backend_name: str) -> None:
            calls.append(backend_name)

    hooks = _hooks(Listener(), BrokenBefore(), BrokenAfter())
    await hooks.on_response(request=REQUEST, backend_name="b", usage=None, finish_reason="stop")
    hooks.on_attempt_end(request=REQUEST, backend_name="b", attempt=0, error=None)  # no wrappers: plain path
    assert calls == ["b"]
