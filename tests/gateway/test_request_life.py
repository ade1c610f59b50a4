"""The one owner of a request's clean-up (gateway/serving/request_life.py): stop (abort
upstream, free the slot), end (``on_request_end``), report (``on_response``/``on_error``),
each exactly once and in that order, whichever way out the request takes. The live paths
(answered, failed mid-stream, client gone) are in tests/reliability; here the order and the
once-ness themselves, with a run and a grant that record what is asked of them."""

from __future__ import annotations

import pytest

from backends.base import Usage
from gateway.serving.request_life import RequestLife


class Recorder:
    def __init__(self, fail: str | None = None) -> None:
        self.calls: list[str] = []
        self.fail = fail

    def _step(self, name: str) -> None:
        self.calls.append(name)
        if name == self.fail:
            raise RuntimeError(f"{name} failed")


class Run(Recorder):
    async def abort(self) -> None:
        self._step("abort")

    def total_usage(self) -> Usage:
        return Usage(prompt_tokens=3, completion_tokens=4)

    async def end_request(self) -> None:
        self._step("end_request")

    async def report(self) -> None:
        self._step("report")


class Grant:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    async def release(self, num_tokens: int = 0) -> None:
        self.calls.append(f"release {num_tokens}")


def _life(fail: str | None = None) -> tuple[RequestLife, list[str]]:
    run = Run(fail)
    life = RequestLife(run, Grant(run.calls))  # type: ignore[arg-type]
    return life, run.calls


ORDER = ["abort", "release 7", "end_request", "report"]


async def test_finish_before_the_final_bytes_then_close_runs_each_step_once_in_order() -> None:
    life, calls = _life()
    await life.finish()
    assert calls == ORDER[:3]
    await life.finish()
    await life.aclose()
    await life.aclose()
    assert calls == ORDER


async def test_a_way_out_without_finish_still_runs_every_step_once() -> None:
    life, calls = _life()
    await life.aclose()
    await life.finish()  # too late: nothing runs again
    assert calls == ORDER


@pytest.mark.parametrize("failing", ["abort", "end_request"])
async def test_a_failing_step_does_not_skip_the_later_ones(failing: str) -> None:
    life, calls = _life(fail=failing)
    with pytest.raises(RuntimeError, match=f"{failing} failed"):
        await life.aclose()
    assert calls == ORDER  # a failed abort still gives the slot back; end and report run
    await life.aclose()
    assert calls == ORDER
