"""INFERMUX_NUM_THREADS: the threads of every engine whose config names none."""

from __future__ import annotations

import pytest

from backends.base import BackendConfig
from backends.core_engine import CoreEngineOptions
from backends.llamacpp import LlamaCppBackend, LlamaCppOptions
from backends.threads import default_num_threads


def test_the_default_is_two_and_the_environment_sets_every_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INFERMUX_NUM_THREADS", raising=False)
    assert default_num_threads() == 2
    assert LlamaCppOptions().n_threads == 2 and CoreEngineOptions().num_threads == 2
    monkeypatch.setenv("INFERMUX_NUM_THREADS", "1")
    assert LlamaCppOptions().n_threads == 1 and CoreEngineOptions().num_threads == 1
    # A backend built from a config (as `infermux serve` does) takes it; an option still wins.
    assert LlamaCppBackend(BackendConfig(name="l", kind="llamacpp")).options.n_threads == 1
    named = LlamaCppBackend(BackendConfig(name="l", kind="llamacpp", options={"n_threads": 3}))
    assert named.options.n_threads == 3


@pytest.mark.parametrize("raw", ["0", "two", "-1"])
def test_a_bad_value_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("INFERMUX_NUM_THREADS", raw)
    with pytest.raises(ValueError, match="INFERMUX_NUM_THREADS"):
        default_num_threads()
