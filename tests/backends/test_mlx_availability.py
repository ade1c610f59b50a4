"""Without MLX the ``mlx`` kind reports itself unavailable with an install hint; the rest works.

A machine without ``mlx``/``mlx-lm`` is simulated by making their import fail
(``sys.modules[name] = None``), which also hides them from ``importlib.util.find_spec``.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from backends.base import BackendConfig
from backends.errors import BackendUnavailableError
from backends.mlx import INSTALL_HINT, create_backend, is_available, is_installed
from gateway.app import create_app
from gateway.config.load import default_config
from gateway.config.types import ConfigError
from gateway.testing import gateway_config, mock_backend

MLX = BackendConfig(name="mlx", kind="mlx")


@pytest.fixture(params=["mlx", "mlx_lm"])
def without_mlx(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The named module (and so the MLX backend) cannot be imported."""
    monkeypatch.setitem(sys.modules, request.param, None)
    if request.param == "mlx":
        monkeypatch.setitem(sys.modules, "mlx.core", None)
    return str(request.param)


def test_kind_reports_unavailable_with_the_install_hint(without_mlx: str) -> None:
    available, reason = is_available()
    assert not available
    assert INSTALL_HINT in reason and without_mlx in reason
    assert not is_installed()
    with pytest.raises(BackendUnavailableError) as caught:
        create_backend(MLX)
    assert INSTALL_HINT in caught.value.message
    assert caught.value.retryable


def test_a_config_naming_an_mlx_backend_fails_with_the_hint(without_mlx: str) -> None:
    config = gateway_config(mock_backend("mock"), MLX, models={"echo": ["mock", "mlx"]})
    with pytest.raises(ConfigError) as caught:
        create_app(config)
    assert str(caught.value).startswith("backends[1].kind")
    assert INSTALL_HINT in str(caught.value)


def test_the_rest_of_infermux_works_without_mlx(without_mlx: str, live_gateway: Any) -> None:
    assert all(b.kind != "mlx" for b in default_config().backends)
    with live_gateway(gateway_config(mock_backend("mock"))) as gateway:
        response = gateway.openai_client().chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "still here"}]
        )
    assert response.choices[0].message.content == "still here"


def test_default_config_serves_the_default_model_through_mlx_when_installed() -> None:
    assert is_available() == (True, "")
    config = default_config()
    backends = {b.name: b for b in config.backends}
    assert backends["mlx"].kind == "mlx"
    (smollm2,) = [m for m in config.models if m.alias == "smollm2"]
    assert smollm2.backends[0] == "llamacpp"  # llama.cpp stays first in priority
    assert "mlx" in smollm2.backends
