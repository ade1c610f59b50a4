"""The reference external plugin package, installed into the environment like a user's.

``examples/plugins/infermux-length-router`` is pip-installed once by ``make install`` (the
tests never install into the virtualenv; without it they fail, naming that command),
discovered through the ``infermux`` entry-point group and used by a live gateway built the
way ``infermux serve`` builds it.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from gateway.config.load import config_from_dict
from gateway.config.types import InfermuxConfig
from gateway.testing import run_gateway
from plugins.builtin.cost.plugin import ENV_LEDGER_PATH
from plugins.manager import create_plugin_manager
from plugins.testing import HookRecorder

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIR = REPO / "examples" / "plugins" / "infermux-length-router"
DIST_NAME = "infermux-length-router"

CONFIG = """
[[backends]]
name = "small"
kind = "mock"

[[backends]]
name = "big"
kind = "mock"

[[models]]
alias = "chat"
backends = ["small", "big"]

[plugins]
request_headers = ["x-tenant-id"]
{plugins}

[plugins.settings.length-router]
threshold_chars = 200
long_backend = "big"
short_backend = "small"
"""


def is_installed() -> bool:
    try:
        dist = importlib.metadata.distribution(DIST_NAME)
    except importlib.metadata.PackageNotFoundError:
        return False
    return any(ep.group == "infermux" for ep in dist.entry_points)


@pytest.fixture(scope="module", autouse=True)
def installed_package() -> None:
    if not is_installed():
        pytest.fail(f"{DIST_NAME} is not installed in this environment: `make install` installs it "
                    f"(pip install --no-deps --no-build-isolation -e {PACKAGE_DIR})", pytrace=False)


@pytest.fixture(autouse=True)
def private_ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_LEDGER_PATH, str(tmp_path / "ledger.sqlite3"))


def config(plugins: str = "") -> InfermuxConfig:
    """The routing config above, with ``plugins`` lines added to its ``[plugins]`` table."""
    return config_from_dict(msgspec.toml.decode(CONFIG.format(plugins=plugins).encode()))


def ask(gateway: str, text: str, headers: dict[str, str] | None = None) -> httpx.Response:
    answer = httpx.post(
        f"{gateway}/v1/chat/completions",
        json={"model": "chat", "max_tokens": 3, "messages": [{"role": "user", "content": text}]},
        headers=headers,
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    return answer


def test_both_plugins_are_discovered_through_their_entry_points() -> None:
    records = {r.name: r for r in create_plugin_manager().plugin_records()}
    for name, hook in (
        ("length-router", "infermux_select_backend"),
        ("tenant-tagger", "infermux_transform_request"),
    ):
        record = records[name]
        assert record.status == "loaded", record.error
        assert record.source == "entry point"
        assert record.version == "0.1.0"
        assert record.distribution == f"{DIST_NAME} 0.1.0"
        assert hook in record.hooks


def test_a_live_gateway_routes_long_prompts_to_one_backend_and_short_to_the_other() -> None:
    cfg = config()
    # The plugin manager `infermux serve` would build (entry points on), plus a recorder.
    pm = create_plugin_manager(config=cfg.plugins)
    recorder = HookRecorder(["on_response"])
    pm.register(recorder)
    with run_gateway(cfg, plugin_manager=pm) as gateway:
        short = ask(gateway, "hello there")
        long = ask(gateway, "many words " * 30, headers={"x-tenant-id": "acme"})
        tagged = recorder.wait_for("on_response", count=2)["request"]
    assert short.headers["x-infermux-backend"] == "small"
    assert long.headers["x-infermux-backend"] == "big"
    # The other plugin of the package: the tenant came from the allow-listed header.
    assert tagged.tenant == "acme"
    assert tagged.labels["tenant"] == "acme"


def test_the_config_can_leave_an_installed_plugin_out() -> None:
    # Only the tenant tagger enabled: the strategy ("priority": small first) decides again.
    cfg = config('enable = ["tenant-tagger"]')
    with run_gateway(cfg) as gateway:
        long = ask(gateway, "many words " * 30)
        assert long.headers["x-infermux-backend"] == "small"
    records = {r.name: r.status for r in create_plugin_manager(config=cfg.plugins).plugin_records()}
    assert records["length-router"] == "disabled"
    assert records["tenant-tagger"] == "loaded"


def test_infermux_plugins_lists_the_package_with_its_version() -> None:
    result = _run("-m", "gateway.cli", "plugins")
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if line.startswith("length-router"))
    assert row.split()[:2] == ["length-router", "0.1.0"]
    assert f"entry point ({DIST_NAME} 0.1.0)" in row
    assert "select_backend" in row


def test_the_package_s_own_tests_pass() -> None:
    result = _run("-m", "pytest", "-q", "-p", "no:cacheprovider", str(PACKAGE_DIR))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env: dict[str, Any] = {**os.environ}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), str(PACKAGE_DIR), env.get("PYTHONPATH", "")) if p
    )
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
