"""Fixtures of the benchmark's tests: fake OpenAI-shaped servers on loopback."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from .fake_server import Behaviour, FakeOpenAI, ServerThread


@pytest.fixture
def fake_server() -> Iterator[Callable[[Behaviour], str]]:
    """Start fake servers with given behaviours; returns their base URLs; stops them after."""
    servers: list[ServerThread] = []

    def start(behaviour: Behaviour) -> str:
        server = ServerThread(FakeOpenAI(behaviour))
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.stop()
