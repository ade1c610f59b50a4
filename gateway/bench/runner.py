"""One benchmark run, start to end: calibrate, build the workload, drive each rate, summarise.

Comparison (two targets) sends every prompt to both endpoints. In ``alternate`` mode the
prompts are cut into blocks; each block runs on A then B, the next on B then A (ABBA...), with
the same arrival offsets, so servers sharing a machine never compete and slow drift of the
machine hits both. In ``concurrent`` mode each endpoint gets the whole load at once, the two
requests of a prompt dispatched together in alternating order.
"""

from __future__ import annotations

import datetime as dt
import random
import sys
import time
from collections.abc import Callable
from typing import Literal

import httpx
import msgspec
from tqdm import tqdm

from gateway.bench.client import BenchClient
from gateway.bench.config import BenchConfig
from gateway.bench.errors import BenchError
from gateway.bench.load import Dispatch, arrival_offsets, run_block
from gateway.bench.metrics import RunSummary, summarise
from gateway.bench.record import RequestRecord
from gateway.bench.workload import (
    DEFAULT_TOKENS_PER_WORD,
    BenchPrompt,
    build_workload,
    sentences,
)

__all__ = ["BenchResult", "Calibration", "RunResult", "calibrate", "run_benchmark"]

_CALIBRATION_WORDS = (24, 152)  # short, to keep the probes cheap on slow servers


class Calibration(msgspec.Struct, kw_only=True, frozen=True):
    """How word counts were turned into token counts."""

    tokens_per_word: float
    overhead_tokens: float | None  # chat template + BOS tokens around the content
    source: Literal["calibrated", "given", "default"]
    note: str | None = None  # why calibration fell back to the default


class RunResult(msgspec.Struct, kw_only=True, frozen=True):
    """One target at one request rate."""

    target: str
    url: str
    model: str
    request_rate: float | None  # None: all at once (inf)
    summary: RunSummary
    records: list[RequestRecord]


class BenchResult(msgspec.Struct, kw_only=True, frozen=True):
    """Everything a run produced; ``--json`` writes it."""

    config: BenchConfig
    calibration: Calibration
    started_at: str  # ISO 8601, UTC
    runs: list[RunResult]

    def run_for(self, target: str, request_rate: float | None) -> RunResult:
        for run in self.runs:
            if run.target == target and run.request_rate == request_rate:
                return run
        raise KeyError((target, request_rate))


async def calibrate(client: BenchClient, *, seed: int) -> Calibration:
    """Measure tokens per word from ``usage.prompt_tokens`` of two prompts of known length.

    The difference of the two counts cancels the chat template's overhead; with no usage in
    the replies the default of 1.3 tokens per word is used and ``note`` says why.
    """
    rng = random.Random(f"calibration:{seed}")
    counts = []
    try:
        for num_words in _CALIBRATION_WORDS:
            prompt = BenchPrompt(
                messages=[{"role": "user", "content": sentences(rng, num_words)}],
                input_len=0,
                output_len=1,
            )
            counts.append(await client.prompt_tokens(prompt))
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return _default_calibration(f"calibration request failed: {exc}")
    small, large = counts
    if small is None or large is None or large <= small:
        return _default_calibration("the endpoint reported no usable usage.prompt_tokens")
    tokens_per_word = (large - small) / (_CALIBRATION_WORDS[1] - _CALIBRATION_WORDS[0])
    overhead = small - _CALIBRATION_WORDS[0] * tokens_per_word
    return Calibration(
        tokens_per_word=tokens_per_word, overhead_tokens=overhead, source="calibrated"
    )


def _default_calibration(note: str) -> Calibration:
    return Calibration(
        tokens_per_word=DEFAULT_TOKENS_PER_WORD, overhead_tokens=None, source="default", note=note
    )


def _dispatch_plan(
    config: BenchConfig, labels: list[str], offsets: list[float]
) -> list[list[Dispatch]]:
    """The blocks of one rate's run, each a list of dispatches run together."""
    indices = range(len(offsets))
    if len(labels) == 1:
        return [[(i, labels[0], offsets[i]) for i in indices]]
    if config.compare_mode == "concurrent":
        return [
            [
                (i, label, offsets[i])
                for i in indices
                for label in labels[:: 1 if i % 2 == 0 else -1]
            ]
        ]
    size = config.block_size(len(offsets))
    blocks = []
    for number, first in enumerate(range(0, len(offsets), size)):
        block = range(first, min(first + size, len(offsets)))
        for label in labels[:: 1 if number % 2 == 0 else -1]:
            blocks.append([(i, label, offsets[i] - offsets[first]) for i in block])
    return blocks


async def run_benchmark(
    config: BenchConfig, *, clock: Callable[[], float] = time.perf_counter
) -> BenchResult:
    """Run the benchmark ``config`` describes and return every record and summary.

    ``clock`` (seconds) times requests, arrivals and runs; tests give a virtual one."""
    config.validate()
    started_at = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    clients = {
        target.label: BenchClient(
            target,
            endpoint=config.endpoint,
            timeout_s=config.timeout_s,
            ignore_eos=config.ignore_eos,
            temperature=config.temperature,
            extra_body=config.extra_body,
            clock=clock,
        )
        for target in config.targets
    }
    try:
        for client in clients.values():
            try:
                await client.resolve_model()
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
                raise BenchError(
                    f"could not list the models of {client.target.url} ({exc}); give --model"
                ) from exc
        first = clients[config.targets[0].label]
        if config.tokens_per_word is not None:
            calibration = Calibration(
                tokens_per_word=config.tokens_per_word, overhead_tokens=None, source="given"
            )
        else:
            calibration = await calibrate(first, seed=config.seed)
        prompts = build_workload(
            config.workload, seed=config.seed, tokens_per_word=calibration.tokens_per_word
        )
        for client in clients.values():
            for index in range(min(config.warmup, len(prompts))):
                await client.send(
                    prompts[index],
                    RequestRecord(
                        index=index,
                        target=client.target.label,
                        request_rate=None,
                        scheduled_s=0.0,
                        start_s=0.0,
                        queued_ms=0.0,
                    ),
                )
        runs = await _run_rates(config, clients, prompts, calibration, clock)
    finally:
        for client in clients.values():
            await client.aclose()
    return BenchResult(config=config, calibration=calibration, started_at=started_at, runs=runs)


async def _run_rates(
    config: BenchConfig,
    clients: dict[str, BenchClient],
    prompts: list[BenchPrompt],
    calibration: Calibration,
    clock: Callable[[], float],
) -> list[RunResult]:
    labels = list(clients)
    total = len(config.request_rates) * len(labels) * len(prompts)
    runs: list[RunResult] = []
    num_failed = 0
    with tqdm(
        total=total, unit="req", file=sys.stderr, disable=not config.progress, dynamic_ncols=True
    ) as bar:

        def on_done(record: RequestRecord) -> None:
            nonlocal num_failed
            bar.update(1)
            if not record.ok:
                num_failed += 1
                bar.set_postfix(failed=num_failed)

        for rate in config.request_rates:
            bar.set_description(f"rate {'inf' if rate is None else f'{rate:g}'}")
            offsets = arrival_offsets(len(prompts), rate, config.burstiness, config.seed)
            records: dict[str, list[RequestRecord]] = {label: [] for label in labels}
            busy_s = dict.fromkeys(labels, 0.0)
            run_start = clock()
            for block in _dispatch_plan(config, labels, offsets):
                block_records, block_busy = await run_block(
                    block,
                    prompts,
                    clients,
                    concurrency=config.concurrency,
                    request_rate=rate,
                    run_start=run_start,
                    on_done=on_done,
                    clock=clock,
                )
                for record in block_records:
                    records[record.target].append(record)
                for label, seconds in block_busy.items():
                    busy_s[label] += seconds
            for label in labels:
                target_records = sorted(records[label], key=lambda r: r.index)
                runs.append(
                    RunResult(
                        target=label,
                        url=clients[label].target.url,
                        model=clients[label].model or "",
                        request_rate=rate,
                        summary=summarise(
                            target_records,
                            duration_s=busy_s[label],
                            slo=config.slo,
                            prices=config.prices,
                            prompt_overhead_tokens=calibration.overhead_tokens,
                        ),
                        records=target_records,
                    )
                )
    return runs
