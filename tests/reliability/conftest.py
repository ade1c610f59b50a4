"""Fixtures of the reliability suites: fault-injecting upstream servers on loopback."""

from __future__ import annotations

from upstream_server import upstream_servers  # noqa: F401  (a fixture, used by name)
