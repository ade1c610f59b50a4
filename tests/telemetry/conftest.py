"""Fixtures of the telemetry and accounting tests.

The built-in tracing / metrics plugins are swapped for instances wired to in-memory OTel
exporters (the plugins' own constructor arguments); everything else is the real gateway on
loopback. Every gateway writes its ledger under the test's ``tmp_path``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path

import pytest
from upstream_server import upstream_servers  # noqa: F401  (a fixture, used by name)

from gateway.testing import LiveGateway
from tests.telemetry.telemetry_util import Telemetry, telemetry_gateway_for

StartGateway = Callable[..., AbstractContextManager[LiveGateway]]


@pytest.fixture()
def telemetry() -> Iterator[Telemetry]:
    recorder = Telemetry()
    yield recorder
    recorder.tracer_provider.shutdown()
    recorder.meter_provider.shutdown()


@pytest.fixture()
def telemetry_gateway(telemetry: Telemetry, tmp_path: Path) -> StartGateway:
    """``with telemetry_gateway(config) as gw:`` (see ``telemetry_gateway_for``)."""
    return partial(telemetry_gateway_for, telemetry, tmp_path)
