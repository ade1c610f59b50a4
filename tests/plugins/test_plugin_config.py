"""Plugins chosen and configured by the routing config: enable, disable, modules, settings,
strict loading, request headers handed to plugins; and what ``infermux plugins`` shows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from gateway.config.load import config_from_dict
from gateway.config.types import ConfigError, PluginsConfig
from plugins.builtin.cost.plugin import ENV_LEDGER_PATH
from plugins.manager import PluginLoadError, PluginRecord, create_plugin_manager
from plugins.testing import HookRecorder, gateway_config

REPO = Path(__file__).resolve().parents[2]

SETTINGS_PLUGIN = """
from plugins.hookspecs import hookimpl

class Greeter:
    def __init__(self, greeting):
        self.greeting = greeting

    @hookimpl
    def infermux_transform_request(self, request):
        import msgspec
        return msgspec.structs.replace(request, labels={**request.labels, "greeting": self.greeting})

def create_plugin(settings):
    return Greeter(settings.get("greeting", "hello"))
"""


@pytest.fixture(autouse=True)
def private_ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The built-in cost plugin's ledger (./var by default) stays in the test's directory.
    monkeypatch.setenv(ENV_LEDGER_PATH, str(tmp_path / "ledger.sqlite3"))


@pytest.fixture()
def plugin_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory on sys.path with plugin modules and an installed distribution ``eps``."""
    (tmp_path / "greeter.py").write_text(SETTINGS_PLUGIN)
    (tmp_path / "plain.py").write_text(
        textwrap.dedent(
            """
            from plugins.hookspecs import hookimpl

            class Shutdown:
                @hookimpl
                def infermux_shutdown(self):
                    pass

            shutdown_plugin = Shutdown()

            @hookimpl
            def infermux_startup(config):
                pass
            """
        )
    )
    (tmp_path / "broken.py").write_text("import a_module_that_is_not_there\n")
    dist = tmp_path / "eps-2.5.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: eps\nVersion: 2.5\n")
    (dist / "entry_points.txt").write_text("[infermux]\ngreeter = greeter\nplain = plain\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def records(config: PluginsConfig, **kwargs: bool) -> dict[str, PluginRecord]:
    return {r.name: r for r in create_plugin_manager(config=config, **kwargs).plugin_records()}


def test_config_modules_are_loaded_by_import_path_with_source_config(plugin_path: Path) -> None:
    config = PluginsConfig(modules=["plain", "plain:shutdown_plugin"], enable=[])
    found = records(config)
    assert found["plain"].source == "config"
    assert found["plain"].hooks == ("infermux_startup",)
    assert found["plain:shutdown_plugin"].hooks == ("infermux_shutdown",)
    assert found["greeter"].status == "disabled"  # enable=[]: no entry-point plugin


def test_settings_tables_reach_create_plugin(plugin_path: Path) -> None:
    config = PluginsConfig(settings={"greeter": {"greeting": "bonjour"}}, enable=["greeter"])
    recorder = HookRecorder(["on_response"])
    pm = create_plugin_manager(config=config)
    pm.register(recorder)
    from gateway.testing import run_gateway

    with run_gateway(gateway_config(plugins=config), plugin_manager=pm) as gateway:
        gateway.openai_client().completions.create(model="echo", prompt="hi", max_tokens=1)
        request = recorder.wait_for("on_response")["request"]
    assert request.labels["greeting"] == "bonjour"


def test_enable_restricts_entry_points_and_disable_wins(plugin_path: Path) -> None:
    found = records(PluginsConfig(enable=["plain"]))
    assert found["plain"].status == "loaded"
    assert found["plain"].version == "2.5"
    assert found["greeter"].status == "disabled"
    found = records(PluginsConfig(enable=["plain"], disable=["plain", "builtin.cost"]))
    assert found["plain"].status == "disabled"
    assert found["builtin.cost"].status == "disabled"


def test_a_failing_plugin_is_skipped_unless_strict(plugin_path: Path) -> None:
    config = PluginsConfig(modules=["broken", "no_such_module"], enable=[])
    found = records(config)
    assert found["broken"].status == "failed"
    assert "ModuleNotFoundError" in (found["broken"].error or "")
    assert found["builtin.routing"].status == "loaded"  # the rest still loads
    with pytest.raises(PluginLoadError) as caught:
        create_plugin_manager(config=PluginsConfig(modules=["broken"], enable=[], strict=True))
    assert [r.name for r in caught.value.records] == ["broken"]


def test_builtins_report_infermux_s_version() -> None:
    from importlib.metadata import version

    found = records(PluginsConfig(), load_entry_points=False)
    assert found["builtin.routing"].version == version("infermux")


def test_the_config_validates_plugin_modules_and_request_headers() -> None:
    for plugins, key in (
        ({"modules": ["not a path"]}, "plugins.modules[0]"),
        ({"request_headers": ["x-ok", "Authorization"]}, "plugins.request_headers[1]"),
        ({"request_headers": ["bad header"]}, "plugins.request_headers[0]"),
        ({"strict": "yes"}, "plugins.strict"),
    ):
        with pytest.raises(ConfigError) as caught:
            config_from_dict({"plugins": plugins})
        assert str(caught.value).startswith(key), str(caught.value)


def test_only_allow_listed_headers_reach_the_request_labels(plugin_gateway) -> None:  # type: ignore[no-untyped-def]
    recorder = HookRecorder(["on_response"])
    config = gateway_config(plugins=PluginsConfig(request_headers=["x-team"]))
    with plugin_gateway(recorder, config=config) as gateway:
        answer = httpx.post(
            f"{gateway}/v1/completions",
            json={"model": "echo", "prompt": "hi", "max_tokens": 1},
            headers={"X-Team": "search", "X-Other": "secret"},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        request = recorder.wait_for("on_response")["request"]
    assert request.labels == {"x-team": "search"}


# -- the command line ---------------------------------------------------------------------


def infermux(*args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ}
    env["PYTHONPATH"] = os.pathsep.join(
        str(p) for p in (REPO, pythonpath, env.get("PYTHONPATH")) if p
    )
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_infermux_plugins_shows_config_modules_and_is_strict_on_request(
    plugin_path: Path, tmp_path: Path
) -> None:
    config = tmp_path / "plugins.toml"
    config.write_text('[plugins]\nmodules = ["plain", "broken"]\nenable = []\n')
    listed = infermux("plugins", "--config", str(config), "--json", pythonpath=plugin_path)
    assert listed.returncode == 0, listed.stderr
    found = {p["name"]: p for p in json.loads(listed.stdout)["plugins"]}
    assert found["plain"]["source"] == "config"
    assert found["broken"]["status"] == "failed"

    strict = infermux("plugins", "--config", str(config), "--strict", pythonpath=plugin_path)
    assert strict.returncode == 1
    assert "broken" in strict.stderr


def test_serve_strict_plugins_refuses_to_start_with_a_broken_plugin(
    plugin_path: Path, tmp_path: Path
) -> None:
    config = tmp_path / "serve.toml"
    config.write_text(
        textwrap.dedent(
            """
            [[backends]]
            name = "mock"
            kind = "mock"

            [[models]]
            alias = "echo"
            backends = ["mock"]

            [plugins]
            modules = ["broken"]
            """
        )
    )
    result = infermux(
        "serve", "--config", str(config), "--port", "0", "--strict-plugins", pythonpath=plugin_path
    )
    assert result.returncode == 2
    assert "broken" in result.stderr and "ModuleNotFoundError" in result.stderr
