"""Fixtures of the reliability suites: fault-injecting upstream servers on loopback."""

from __future__ import annotations

from upstream_server import test_ca, upstream_servers  # noqa: F401  (fixtures, used by name)
