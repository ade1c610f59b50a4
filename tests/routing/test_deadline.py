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


async def test_a_deadline_cancels_at_once_while_another_cancellation_unwinds() -> None:
    # The outer deadline passes while the inner one's cancellation runs a long clean-up: as
    # asyncio.timeout, it cancels the task again at its time instead of waiting. (Clean-up
    # that must finish, closing an upstream connection, runs outside the task a deadline
    # bounds: backends/_upstream_exchange.py.)
    cleanup_cancelled = False
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        with Deadline(start + 0.06):
            with Deadline(start + 0.05):  # ends with the outer one's cancellation
                try:
                    await asyncio.sleep(5)
                finally:
                    try:
                        await asyncio.sleep(5)  # a clean-up far past the outer deadline
                    except asyncio.CancelledError:
                        cleanup_cancelled = True
                        raise
    assert cleanup_cancelled
    assert time.monotonic() - start < 1.0
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_swallowed_cancellation_does_not_disarm_a_later_deadline() -> None:
    # Code that catches a cancellation without uncancel() leaves the task "cancelling" for
    # good: a deadline entered afterwards still ends its block.
    async def swallow_then_wait() -> str:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            pass  # swallowed, not uncancelled
        try:
            with Deadline(time.monotonic() + 0.02):
                await asyncio.sleep(5)
        except TimeoutError:
            return "deadline"
        return "slept"

    task = asyncio.ensure_future(swallow_then_wait())
    await asyncio.sleep(0.01)
    task.cancel()
    started = time.monotonic()
    assert await asyncio.wait_for(task, 2.0) == "deadline"
    assert time.monotonic() - started < 1.0


async def test_a_cancellation_swallowed_inside_the_block_does_not_delay_the_deadline() -> None:
    # Swallowed after the block began, the other cancellation leaves the task "cancelling":
    # the deadline still cancels at its time, and the block ends with that cancellation
    # (not TimeoutError: someone else had asked to cancel too).
    ended_at: list[float] = []

    async def swallow_inside() -> None:
        with Deadline(time.monotonic() + 0.05):
            try:
                await asyncio.sleep(5)
            except asyncio.CancelledError:
                pass  # swallowed, not uncancelled
            try:
                await asyncio.sleep(5)
            finally:
                ended_at.append(time.monotonic())

    started = time.monotonic()
    task = asyncio.ensure_future(swallow_inside())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2.0)
    assert 0.05 <= ended_at[0] - started < 1.0


def test_earliest_ignores_unset_deadlines() -> None:
    assert earliest(None, 3.0, 2.0) == 2.0
    assert earliest(None, None) is None
