"""Load generation: when each request arrives, and how many may be in flight.

Arrivals follow vLLM's benchmark: inter-arrival times are gamma-distributed with shape
``burstiness`` and mean ``1 / rate``; ``burstiness = 1`` is a Poisson process, lower values
are burstier, higher values more regular. A rate of ``None`` (``inf`` on the command line)
sends every request at once. A concurrency limit caps the requests in flight per endpoint;
a request that arrives while the limit is reached waits (``queued_ms``), and its latencies are
measured from when it is actually sent.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence

from gateway.bench.client import BenchClient
from gateway.bench.record import RequestRecord
from gateway.bench.workload import BenchPrompt

__all__ = ["Dispatch", "arrival_offsets", "run_block"]

# (prompt index, target label, arrival offset in seconds from the block's start)
Dispatch = tuple[int, str, float]


def arrival_offsets(
    num_requests: int, rate: float | None, burstiness: float, seed: int
) -> list[float]:
    """Arrival time of each request in seconds, the first at 0; the same for the same seed."""
    if rate is None:
        return [0.0] * num_requests
    rng = random.Random(f"arrivals:{seed}")
    scale = 1.0 / (rate * burstiness)  # mean gap = shape * scale = 1 / rate
    offsets = []
    now = 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.gammavariate(burstiness, scale)
    return offsets


async def run_block(
    dispatches: Sequence[Dispatch],
    prompts: Sequence[BenchPrompt],
    clients: dict[str, BenchClient],
    *,
    concurrency: int | None,
    request_rate: float | None,
    run_start: float,
    on_done: Callable[[RequestRecord], None],
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[list[RequestRecord], dict[str, float]]:
    """Send ``dispatches`` on their schedule; the records and each target's busy seconds."""
    block_start = clock()
    slots = {
        label: asyncio.Semaphore(concurrency) if concurrency is not None else None
        for label in clients
    }
    last_end: dict[str, float] = {}

    async def one(index: int, label: str, offset: float) -> RequestRecord:
        delay = block_start + offset - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        arrived = clock()
        slot = slots[label]
        if slot is not None:
            await slot.acquire()
        try:
            sent = clock()
            record = RequestRecord(
                index=index,
                target=label,
                request_rate=request_rate,
                scheduled_s=offset,
                start_s=sent - run_start,
                queued_ms=(sent - arrived) * 1e3,
            )
            await clients[label].send(prompts[index], record)
        finally:
            if slot is not None:
                slot.release()
        last_end[label] = max(last_end.get(label, 0.0), clock())
        on_done(record)
        return record

    # Tasks start in list order, so simultaneous arrivals keep the dispatch order (A/B order).
    records = await asyncio.gather(*(one(*dispatch) for dispatch in dispatches))
    busy = {label: end - block_start for label, end in last_end.items()}
    return list(records), busy
