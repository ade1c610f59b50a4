"""``[state]`` and ``[cost] database`` mistakes stop start-up with the key named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from servers import REPO

from gateway.config.load import config_from_dict
from gateway.config.types import ConfigError
from plugins.shared_state import StateConfigError, open_state


def test_redis_state_needs_url_env() -> None:
    with pytest.raises(ConfigError) as caught:
        config_from_dict({"state": {"backend": "redis"}})
    assert caught.value.key == "state.url_env"


def test_unknown_state_backend_is_named() -> None:
    with pytest.raises(ConfigError) as caught:
        config_from_dict({"state": {"backend": "etcd"}})
    assert "state.backend" in str(caught.value)


def test_the_url_variable_must_be_set_and_a_redis_url() -> None:
    state = config_from_dict({"state": {"backend": "redis", "url_env": "X_URL"}}).state
    with pytest.raises(StateConfigError, match="'X_URL'.*is not set") as caught:
        open_state(state, {})
    assert caught.value.key == "state.url_env"
    with pytest.raises(StateConfigError, match=r"redis://"):
        open_state(state, {"X_URL": "http://127.0.0.1:6379"})
    assert open_state(config_from_dict({}).state, {}) is None


def test_cost_database_must_be_postgres() -> None:
    with pytest.raises(ConfigError) as caught:
        config_from_dict({"cost": {"database": "mysql://db/ledger"}})
    assert caught.value.key == "cost.database"


def test_serve_exits_naming_the_unset_variable(tmp_path: Path) -> None:
    config = tmp_path / "state.toml"
    config.write_text(
        '[state]\nbackend = "redis"\nurl_env = "INFERMUX_TEST_UNSET_URL"\n'
        '[[backends]]\nname = "mock"\nkind = "mock"\n'
        '[[models]]\nalias = "echo"\nbackends = ["mock"]\n'
    )
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--port", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode != 0
    assert "state.url_env" in done.stderr and "INFERMUX_TEST_UNSET_URL" in done.stderr
