"""Fixtures of the backend tests: fault-injecting upstream servers on loopback, and a CA for
the TLS ones."""

from __future__ import annotations

from upstream_server import test_ca, upstream_servers  # noqa: F401  (fixtures, used by name)
