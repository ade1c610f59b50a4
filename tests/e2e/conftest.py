"""Fixtures of the end-to-end tests: the real default model behind a live gateway.

The model loads once per test session (shared by every e2e module); each test talks to it
over real HTTP on loopback with the official client.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import pytest

from gateway.config.load import default_config
from gateway.testing import LiveGateway


@pytest.fixture(scope="session")
def default_gateway(
    live_gateway: Callable[..., AbstractContextManager[LiveGateway]],
) -> Iterator[LiveGateway]:
    """``infermux serve`` with no config: SmolLM2-135M-Instruct as ``smollm2`` (llama.cpp)."""
    with live_gateway(default_config()) as gateway:
        yield gateway


@pytest.fixture(scope="session")
def default_client(default_gateway: LiveGateway) -> Any:
    """The official ``openai`` client for :func:`default_gateway` (no retries)."""
    return default_gateway.openai_client(timeout=300.0)
