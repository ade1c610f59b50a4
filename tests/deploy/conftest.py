"""What tests/deploy's files share: the metrics a real gateway exports."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gateway.testing import gateway_config, mock_backend


@pytest.fixture(scope="session")
def exported_metrics(live_gateway: Any) -> set[str]:
    """The metric families a real gateway's ``GET /metrics`` declares."""
    with live_gateway(gateway_config(mock_backend("mock"))) as gw:
        text = httpx.get(f"{gw}/metrics", timeout=30).text
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
