"""``backends.deadline.Deadline``: asyncio.timeout_at's outcome on monotonic deadlines."""

from __future__ import annotations

import asyncio
import time

import pytest

from backends.deadline import Deadline, earliest


async def test_a_passed_deadline_ends_the_block_with_timeout_error() -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        with Deadline(started + 0.05):
            await asyncio.sleep(5)
    assert time.monotonic() - started < 1.0
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
    await asyncio.sleep(0)  # the task is not left cancelled


async def test_no_deadline_or_a_later_one_changes_nothing() -> None:
    with Deadline(None):
        await asyncio.sleep(0.01)
    with Deadline(time.monotonic() + 5):
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.06)  # the cancelled timer never fires


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
