"""The plugin manager and its typed facade, as a plugin author experiences them."""

from __future__ import annotations

import inspect
from typing import Any

import msgspec
import pytest

import plugins.hookspecs as hookspecs
from backends.base import BackendConfig, GenerationRequest
from backends.errors import BackendUnavailableError, InvalidRequestError
from gateway.config.types import PluginsConfig
from plugins.builtin.backend_kinds import LazyBackendFactory
from plugins.hookspecs import hookimpl
from plugins.manager import PluginHooks, create_plugin_manager

REQUEST = GenerationRequest(request_id="r1", model="m", kind="completion", prompt="hi")


def hooks_with(*plugins: object) -> PluginHooks:
    pm = create_plugin_manager(load_entry_points=False)
    for i, plugin in enumerate(plugins):
        pm.register(plugin, name=f"p{i}")
    return PluginHooks(pm, hook_timeout_s=0.5)


def test_every_hookspec_is_documented_and_registered() -> None:
    specs = [
        (name, fn)
        for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
        if name.startswith("infermux_")
    ]
    assert len(specs) >= 8
    pm = create_plugin_manager(load_entry_points=False)
    for name, fn in specs:
        doc = inspect.getdoc(fn) or ""
        assert len(doc) > 80, f"{name} needs a docstring saying when, args and return"
        assert getattr(pm.hook, name).spec is not None


def test_builtins_register_kinds_and_strategies() -> None:
    hooks = PluginHooks(create_plugin_manager(load_entry_points=False))
    assert {"mock", "llamacpp", "openai", "core_engine", "mlx"} <= set(
        hooks.register_backend_kinds()
    )
    assert {"priority", "round_robin", "least_outstanding"} <= set(
        hooks.register_routing_strategies()
    )


def test_a_plugin_kind_replaces_a_builtin_one() -> None:
    def factory(config: BackendConfig) -> Any:
        return "mine"

    class MyKinds:
        @hookimpl
        def infermux_register_backend_kinds(self, register: Any) -> None:
            register("mock", factory)
            register("custom", factory)

    kinds = hooks_with(MyKinds()).register_backend_kinds()
    assert kinds["mock"] is factory
    assert kinds["custom"] is factory
    assert isinstance(kinds["llamacpp"], LazyBackendFactory)


def test_an_unavailable_kind_fails_when_used_with_an_install_hint() -> None:
    factory = LazyBackendFactory("exotic", "backends.no_such_module", 'pip install -e ".[exotic]"')
    with pytest.raises(BackendUnavailableError, match=r"kind 'exotic' is unavailable.*\[exotic\]"):
        factory(BackendConfig(name="x", kind="exotic"))


async def test_transform_request_chains_in_order_and_awaits_async_impls() -> None:
    seen: list[str] = []

    def tag(label: str) -> Any:
        def apply(request: GenerationRequest) -> GenerationRequest:
            seen.append(label)
            return msgspec.structs.replace(
                request, labels={**request.labels, "order": request.labels.get("order", "") + label}
            )

        return apply

    class First:
        @hookimpl(tryfirst=True)
        async def infermux_transform_request(self, request: GenerationRequest) -> GenerationRequest:
            return tag("F")(request)

    class A:
        @hookimpl
        def infermux_transform_request(self, request: GenerationRequest) -> GenerationRequest:
            return tag("A")(request)

    class Untouched:
        @hookimpl
        def infermux_transform_request(self, request: GenerationRequest) -> None:
            seen.append("-")

    class B:
        @hookimpl
        async def infermux_transform_request(self, request: GenerationRequest) -> GenerationRequest:
            return tag("B")(request)

    class Last:
        @hookimpl(trylast=True)
        def infermux_transform_request(self, request: GenerationRequest) -> GenerationRequest:
            return tag("L")(request)

    hooks = hooks_with(Last(), A(), Untouched(), B(), First())
    result = await hooks.transform_request(request=REQUEST)
    assert result.labels["order"] == "FABL"
    assert seen == ["F", "A", "-", "B", "L"]


async def test_transform_request_rejection_propagates() -> None:
    class Reject:
        @hookimpl
        def infermux_transform_request(self, request: GenerationRequest) -> None:
            raise InvalidRequestError("no", param="prompt")

    with pytest.raises(InvalidRequestError):
        await hooks_with(Reject()).transform_request(request=REQUEST)


async def test_notifications_reach_every_plugin_despite_failures() -> None:
    calls: list[str] = []

    class Good:
        @hookimpl
        async def infermux_on_response(self, backend_name: str, usage: Any) -> None:
            calls.append(f"good:{backend_name}")

    class Raises:
        @hookimpl
        def infermux_on_response(self) -> None:
            raise RuntimeError("bug")

    class Hangs:
        @hookimpl
        async def infermux_on_response(self) -> None:
            import asyncio

            await asyncio.sleep(60)

    class ErrorListener:
        @hookimpl
        def infermux_on_error(self, error: Exception, usage: Any) -> None:
            calls.append(f"error:{type(error).__name__}:{usage}")

    hooks = hooks_with(Good(), Raises(), Hangs(), ErrorListener())
    await hooks.on_response(request=REQUEST, backend_name="b", usage=None, finish_reason="stop")
    await hooks.on_error(request=REQUEST, backend_name="b", error=BackendUnavailableError("x"))
    assert calls == ["good:b", "error:BackendUnavailableError:None"]


def test_select_backend_first_valid_answer_wins() -> None:
    class Abstains:
        @hookimpl
        def infermux_select_backend(self, candidates: list[str]) -> None:
            return None

    class PicksLast:
        @hookimpl
        def infermux_select_backend(self, candidates: list[str]) -> str:
            return candidates[-1]

    class Invents:
        @hookimpl
        def infermux_select_backend(self) -> str:
            return "not-a-candidate"

    class Raises:
        @hookimpl
        def infermux_select_backend(self) -> str:
            raise RuntimeError("bug")

    candidates = ["a", "b", "c"]
    assert hooks_with().select_backend(request=REQUEST, candidates=candidates) is None
    assert (
        hooks_with(PicksLast(), Abstains()).select_backend(request=REQUEST, candidates=candidates)
        == "c"
    )
    assert hooks_with(Invents()).select_backend(request=REQUEST, candidates=candidates) is None
    assert hooks_with(Raises()).select_backend(request=REQUEST, candidates=candidates) is None


def test_a_plugin_with_an_unknown_hook_is_reported_and_dropped() -> None:
    pm = create_plugin_manager(load_entry_points=False)

    class Typo:
        @hookimpl
        def infermux_on_respons(self) -> None:  # missing "e": not a hook
            pass

    pm.register(Typo(), name="typo")
    pm.drop_invalid_plugins()
    assert pm.get_plugin("typo") is None
    record = next(r for r in pm.plugin_records() if r.name == "typo")
    assert record.status == "failed"
    assert "infermux_on_respons" in (record.error or "")


def test_disabled_builtins_are_not_registered() -> None:
    pm = create_plugin_manager(
        config=PluginsConfig(disable=["builtin.routing"]), load_entry_points=False
    )
    assert PluginHooks(pm).register_routing_strategies() == {}
    statuses = {r.name: r.status for r in pm.plugin_records()}
    assert statuses["builtin.routing"] == "disabled"
    assert statuses["builtin.backend_kinds"] == "loaded"


def test_plugins_are_loaded_from_entry_points(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "ep_plugin.py").write_text(
        "from plugins.hookspecs import hookimpl\n\n"
        "@hookimpl\n"
        "def infermux_select_backend(candidates):\n"
        "    return candidates[0]\n\n"
        "@hookimpl\n"
        "def infermux_on_error(nonexistent_argument):\n"
        "    pass\n"
    )
    (tmp_path / "ok_plugin.py").write_text(
        "from plugins.hookspecs import hookimpl\n\n@hookimpl\ndef infermux_shutdown():\n    pass\n"
    )
    dist = tmp_path / "eps-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: eps\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[infermux]\nbad-args = ep_plugin\nok = ok_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    pm = create_plugin_manager()
    records = {r.name: r for r in pm.plugin_records()}
    assert records["ok"].status == "loaded"
    assert records["ok"].source == "entry point"
    assert records["ok"].distribution == "eps 0.1"
    assert records["ok"].hooks == ("infermux_shutdown",)
    # A hookimpl asking for an argument the spec does not have is refused at registration.
    assert records["bad-args"].status == "failed"
    assert pm.get_plugin("bad-args") is None
