"""Shared fixtures: a live gateway on a free loopback port (see :mod:`gateway.testing`).

``live_gateway`` is session-scoped and returns a context-manager factory, so fixtures and
tests of any scope can start a real server::

    def test_x(live_gateway):
        with live_gateway(gateway_config(mock_backend("a"))) as gw:
            gw.openai_client().models.list()

    @pytest.fixture(scope="module")
    def real(live_gateway):
        with live_gateway(default_config()) as gw:      # loads the real model once
            yield gw

Each gateway it starts keeps its files (the usage ledger and the stored responses in it,
unless the config names a ledger) in a fresh directory of the session's temporary
directory, never in the working directory's ``var/``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import pytest

from gateway.config.types import InfermuxConfig
from gateway.testing import LiveGateway, gateway_config, run_gateway

# The plugin author's fixtures (plugin_manager, hook_recorder, plugin_gateway), as a plugin
# package's own conftest would load them (docs/plugins.md).
pytest_plugins = ["plugins.testing"]


def pytest_configure(config: pytest.Config) -> None:
    """OpenBLAS under MLX (backends/mlx/cpu_blas.py) must be loaded before MLX is imported,
    and test modules import MLX at collection: the backend does it too late in a test worker."""
    from backends import mlx as mlx_backend

    if mlx_backend.is_installed():
        from backends.mlx.cpu_blas import use_openblas

        use_openblas()



@pytest.fixture(scope="session")
def live_gateway(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., AbstractContextManager[LiveGateway]]:
    """``with live_gateway(config, plugin_manager=..., backends=...) as gw:``."""

    def start(config: InfermuxConfig, **options: Any) -> AbstractContextManager[LiveGateway]:
        options.setdefault("data_dir", tmp_path_factory.mktemp("gateway"))
        return run_gateway(config, **options)

    return start


@pytest.fixture()
def echo_gateway(
    live_gateway: Callable[..., AbstractContextManager[LiveGateway]],
) -> Iterator[LiveGateway]:
    """A gateway with one mock backend "mock" serving the alias "echo"."""
    with live_gateway(gateway_config()) as gateway:
        yield gateway
