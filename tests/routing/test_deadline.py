"""``backends.deadline.Deadline``: asyncio.timeout_at's outcome on monotonic deadlines."""

from __future__ import annotations

import asyncio
import time

import pytest

from backends.deadline import Deadline, earliest


async def test_a_passed_deadline_ends_the_block_with_timeout_error() -> None:
    # Timers fire in the order of their times: a marker due 0.5 s after the deadline must not
    # have fired when the deadline ends the block (a late or missed deadline would let it).
    loop = asyncio.get_running_loop()
    marker_fired = asyncio.Event()
    when = time.monotonic() + 0.05
    marker = loop.call_at(loop.time() + 0.55, marker_fired.set)
    try:
        with pytest.raises(TimeoutError):
            with Deadline(when):
                await asyncio.sleep(5)
        assert not marker_fired.is_set()
    finally:
        marker.cancel()
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
    await asyncio.sleep(0)  # the task is not left cancelled


async def test_no_deadline_or_a_later_one_changes_nothing() -> None:
    with Deadline(None):
        await asyncio.sleep(0.01)
    with Deadline(time.monotonic() + 5):
        await asyncio.sleep(0.01)
    # A block that ends before its deadline cancels the timer: sleeping past that deadline
    # afterwards is not interrupted (a timer left behind would cancel this sleep).
    with Deadline(time.monotonic() + 0.02):
        pass
    assert await asyncio.sleep(0.06, result="slept") == "slept"
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_cancellation_from_outside_stays_a_cancellation() -> None:
    async def wait() -> None:
        with Deadline(time.monotonic() + 5):
            await asyncio.sleep(5)

    task = asyncio.ensure_future(wait())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_earliest_ignores_unset_deadlines() -> None:
    assert earliest(None, 3.0, 2.0) == 2.0
    assert earliest(None, None) is None
