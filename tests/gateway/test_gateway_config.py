"""The routing config: errors name the key a person has to fix; env overrides apply."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.default_model import DEFAULT_MODEL_ALIAS
from gateway.app import create_app
from gateway.config.load import default_config, load_config
from gateway.config.types import ConfigError, InfermuxConfig

REPO = Path(__file__).resolve().parents[2]

MOCK_BACKENDS = """
[[backends]]
name = "a"
kind = "mock"

[[backends]]
name = "b"
kind = "mock"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "infermux.toml"
    path.write_text(text)
    return path


def config_error(tmp_path: Path, text: str, **kwargs: object) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, text), env={}, **kwargs)  # type: ignore[arg-type]
    return str(caught.value)


def test_a_valid_file_loads_into_frozen_structs(tmp_path: Path) -> None:
    config = load_config(
        write(
            tmp_path,
            MOCK_BACKENDS
            + """
[server]
port = 9001

[[models]]
alias = "echo"
backends = ["b", "a"]
strategy = "round_robin"
max_retries = 1
""",
        ),
        env={},
    )
    assert config.server.port == 9001
    assert config.server.host == "127.0.0.1"
    assert [b.name for b in config.backends] == ["a", "b"]
    assert config.models[0].backends == ["b", "a"]
    assert config.models[0].strategy == "round_robin"
    with pytest.raises(AttributeError):
        config.server.port = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            MOCK_BACKENDS + '[[models]]\nalias = "m"\nbackends = ["a", "x"]\n',
            "models[0].backends: unknown backend 'x'",
        ),
        (
            '[[backends]]\nname = "a"\nkind = "mock"\n[[backends]]\nname = "a"\nkind = "mock"\n'
            '[[models]]\nalias = "m"\nbackends = ["a"]\n',
            "backends[1].name: duplicate backend name 'a'",
        ),
        (
            MOCK_BACKENDS
            + '[[models]]\nalias = "m"\nbackends = ["a"]\n[[models]]\nalias = "m"\nbackends = ["b"]\n',
            "models[1].alias: duplicate model alias 'm'",
        ),
        ('[server]\nport = "eighty"\n', "server.port: expected `int`, got `str`"),
        ("[server]\nport = 70000\n", "server.port: expected `int` <= 65535"),
        ("[server]\nprot = 8000\n", "server.prot: unknown key"),
        (
            '[[backends]]\nname = "a"\n[[models]]\nalias = "m"\nbackends = ["a"]\n',
            "backends[0].kind: missing required key",
        ),
        (
            '[[backends]]\nname = "a"\nkind = "mock"\nfrist_byte_timeout = 3\n'
            '[[models]]\nalias = "m"\nbackends = ["a"]\n',
            "backends[0].frist_byte_timeout: unknown key",
        ),
        (
            '[[backends]]\nname = "a"\nkind = "mock"\nfirst_byte_timeout = -1\n'
            '[[models]]\nalias = "m"\nbackends = ["a"]\n',
            "backends[0].first_byte_timeout: must be > 0",
        ),
        (
            MOCK_BACKENDS + '[[models]]\nalias = "m"\nbackends = []\n',
            "models[0].backends: must name",
        ),
        (
            '[[backends]]\nname = "has space"\nkind = "mock"\n[[models]]\nalias = "m"\n'
            'backends = ["has space"]\n',
            "backends[0].name: 'has space' is not a valid name",
        ),
        ("[limits]\nmax_n = 0\n", "limits.max_n: expected `int` >= 1"),
        ("[[models]]\nalias = \n", "invalid TOML"),
    ],
)
def test_errors_name_the_key(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in config_error(tmp_path, text)


def test_unknown_backend_kind_and_strategy_are_named_when_the_app_is_built() -> None:
    from gateway.testing import gateway_config, mock_backend

    bad_kind = gateway_config(mock_backend("a"), mock_backend("b"))
    bad_kind = InfermuxConfig(
        backends=[bad_kind.backends[0], type(bad_kind.backends[1])(name="b", kind="foo")],
        models=bad_kind.models,
    )
    with pytest.raises(ConfigError, match=r"backends\[1\]\.kind: unknown backend kind 'foo'"):
        create_app(bad_kind)

    bad_strategy = gateway_config(mock_backend("a"), strategy="fastest")
    with pytest.raises(
        ConfigError, match=r"models\[0\]\.strategy: unknown routing strategy 'fastest'"
    ):
        create_app(bad_strategy)


def test_unknown_kind_is_named_by_load_config_given_the_registered_kinds(tmp_path: Path) -> None:
    text = '[[backends]]\nname = "a"\nkind = "mock"\n[[backends]]\nname = "b"\nkind = "foo"\n'
    text += '[[models]]\nalias = "m"\nbackends = ["a", "b"]\n'
    message = config_error(tmp_path, text, backend_kinds={"mock", "llamacpp"})
    assert message.startswith("backends[1].kind: unknown backend kind 'foo'")
    assert "llamacpp, mock" in message


def test_bad_backend_options_name_the_option() -> None:
    from gateway.testing import gateway_config, mock_backend

    config = gateway_config(mock_backend("slow", tokn_delay_s=0.1))
    with pytest.raises(ConfigError, match=r"backends\.slow\.options\.tokn_delay_s"):
        create_app(config)


def test_environment_overrides_host_port_and_config_path(tmp_path: Path) -> None:
    path = write(tmp_path, MOCK_BACKENDS + '[[models]]\nalias = "m"\nbackends = ["a"]\n')
    config = load_config(
        None,
        env={"INFERMUX_CONFIG": str(path), "INFERMUX_HOST": "0.0.0.0", "INFERMUX_PORT": "9100"},
    )
    assert [m.alias for m in config.models] == ["m"]
    assert (config.server.host, config.server.port) == ("0.0.0.0", 9100)

    with pytest.raises(ConfigError, match="INFERMUX_PORT: expected a port number"):
        load_config(path, env={"INFERMUX_PORT": "http"})


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "nope.toml", env={})


def test_default_config_serves_smollm2_through_llamacpp() -> None:
    config = default_config()
    # llama.cpp is the default (first in priority); the other engines serve the same file.
    assert (config.backends[0].name, config.backends[0].kind) == ("llamacpp", "llamacpp")
    assert {b.name: b.kind for b in config.backends}.items() <= {
        "llamacpp": "llamacpp",
        "core_engine": "core_engine",
        "mlx": "mlx",
    }.items()
    assert config.models[0].alias == DEFAULT_MODEL_ALIAS == "smollm2"
    assert config.models[0].backends == [b.name for b in config.backends]
    assert Path(config.backends[0].options["model_path"]).is_file()
    # Requests queue for llama.cpp's slots under load instead of spilling, after a first-byte
    # timeout, onto the other engines on the same cores; total_timeout still bounds them.
    assert config.backends[0].first_byte_timeout is None
    assert config.backends[0].total_timeout is not None
    assert load_config(None, env={}) == config


def test_a_server_only_file_keeps_the_default_model(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "[server]\nport = 8123\n"), env={})
    assert config.server.port == 8123
    assert [m.alias for m in config.models] == ["smollm2"]


def test_the_example_config_is_valid() -> None:
    from plugins.manager import PluginHooks, create_plugin_manager

    hooks = PluginHooks(create_plugin_manager(load_entry_points=False))
    config = load_config(
        REPO / "examples" / "config.toml",
        env={},
        backend_kinds=hooks.register_backend_kinds(),
        routing_strategies=hooks.register_routing_strategies(),
    )
    assert config.models


def test_the_deploy_config_is_valid() -> None:
    from plugins.manager import PluginHooks, create_plugin_manager

    hooks = PluginHooks(create_plugin_manager(load_entry_points=False))
    config = load_config(
        REPO / "deploy" / "gpu-pool.toml",
        env={},
        backend_kinds=hooks.register_backend_kinds(),
        routing_strategies=hooks.register_routing_strategies(),
    )
    assert [m.alias for m in config.models] == ["smollm2"]
    assert config.models[0].strategy == "least_outstanding"
