"""Errors of the benchmark tool.

BenchError
 └── BenchConfigError   a flag or setting is invalid (``param`` names it)
"""

from __future__ import annotations

__all__ = ["BenchConfigError", "BenchError"]


class BenchError(Exception):
    """Base of the benchmark tool's errors."""


class BenchConfigError(BenchError, ValueError):
    """A setting given by the user is invalid; ``param`` names the setting or flag."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
