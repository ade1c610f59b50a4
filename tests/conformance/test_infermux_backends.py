"""``infermux conformance`` against infermux on each real backend (the default model on the
core engine, llama.cpp and MLX, each in its worker process) and on an ``openai`` remote that
is another infermux over loopback HTTP: every applicable check passes but the known gaps,
and every n/a is a capability that backend declares it lacks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from gateway.conformance import CheckResult, Target, run_checks
from gateway.conformance.fleet import infermux_targets
from tests.conformance.expected import KNOWN_GAPS, NOT_APPLICABLE

pytestmark = pytest.mark.slow

KINDS = ("core_engine", "llamacpp", "mlx", "openai")


@pytest.fixture(scope="module")
def targets(live_gateway: Any) -> Iterator[dict[str, Target]]:
    with infermux_targets(live_gateway, KINDS) as served:
        yield served


@pytest.mark.parametrize("kind", KINDS)
def test_every_applicable_check_passes_but_the_known_gaps(targets: dict[str, Target], kind: str) -> None:
    results: list[CheckResult] = run_checks(targets[kind])
    failed = {r.name: r.evidence for r in results if r.verdict == "fail"}
    skipped = {r.name: r.evidence for r in results if r.verdict == "n/a"}
    assert set(failed) == set(KNOWN_GAPS), failed
    assert set(skipped) == NOT_APPLICABLE[kind], skipped
