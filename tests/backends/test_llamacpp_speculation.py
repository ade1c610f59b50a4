"""N-gram speculative decoding in the llama.cpp backend, with the real default model.

A "repeat this passage" prompt is the case prompt lookup is for: the output copies the prompt,
so most proposals are accepted. Greedy output with speculation must be the plain backend's
greedy output, up to llama.cpp's rounding: a step verifies ``1 + k`` rows in one batch where
the plain backend decodes one row, and llama.cpp's kernels may round the two differently. So
the rule is: equal token ids, or, at the first position where they differ, the plain run's
two best logprobs there are within 0.5 nats of each other (a near tie that rounding can flip).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from backends.base import BackendConfig, GenerationChunk, GenerationRequest
from backends.llamacpp import LlamaCppBackend, create_backend
from backends.worker import WorkerBackend
from backends.worker.protocol import PolicySource
from core_engine.policy import (
    AdaptiveSpeculationPolicy,
    EnginePolicies,
    SpeculationContext,
    SpeculationDecision,
)
from plugins.testing import installed_plugin
from tests.backends.llamacpp_util import _chat, _collect

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small "
    "brass lamp and a notebook bound in green leather. At the top he trimmed the wick, polished "
    "the great lens until it gleamed, and wrote down the direction of the wind, the colour of "
    "the sea, and the names of the ships that passed the rocks before midnight."
)
# One thread: two OpenMP threads on a busy 2-core machine stall at every barrier.
OPTIONS: dict[str, Any] = {"n_threads": 1, "parallel": 2, "n_ctx": 512}
SPECULATION: dict[str, Any] = {"speculation": {}}
MAX_TOKENS = 40


def _repeat(request_id: str = "r", **params: Any) -> GenerationRequest:
    params = {"temperature": 0, "max_tokens": MAX_TOKENS} | params
    request = _chat(f"Repeat this text exactly:\n\n{PASSAGE}", **params)
    return msgspec.structs.replace(request, request_id=request_id)


def _labelled(request_id: str, tenant: str) -> GenerationRequest:
    return msgspec.structs.replace(_repeat(request_id), labels={"tenant": tenant})


def _ids(chunks: list[GenerationChunk]) -> list[int]:
    return [token for chunk in chunks for token in chunk.token_ids]


def _text(chunks: list[GenerationChunk]) -> str:
    return "".join(chunk.text for chunk in chunks)


async def _started(name: str, options: dict[str, Any]) -> LlamaCppBackend:
    llama = create_backend(BackendConfig(name=name, kind="llamacpp", options=options))
    await llama.start()
    return llama


class TenantOff:
    """Speculation off for tenant "x"; the default policy for everyone else."""

    def __init__(self) -> None:
        self.default = AdaptiveSpeculationPolicy()

    def choose_speculation(self, context: SpeculationContext) -> SpeculationDecision:
        if context.labels.get("tenant") == "x":
            return SpeculationDecision()
        return self.default.choose_speculation(context)


class Raising:
    def choose_speculation(self, context: SpeculationContext) -> SpeculationDecision:
        raise RuntimeError("a broken policy")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def plain() -> AsyncIterator[LlamaCppBackend]:
    llama = await _started("plain", OPTIONS)
    yield llama
    await llama.aclose()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def spec() -> AsyncIterator[LlamaCppBackend]:
    llama = await _started("spec", OPTIONS | SPECULATION)
    yield llama
    await llama.aclose()


@pytest.fixture()
def policy(spec: LlamaCppBackend) -> Iterator[Any]:
    """Sets the speculation backend's policy for one test, then restores the default."""

    def use(speculation: Any) -> None:
        spec.use_policies(EnginePolicies(speculation=speculation))

    yield use
    spec.use_policies(EnginePolicies())


# -- options (no model) ------------------------------------------


@pytest.mark.parametrize(
    ("speculation", "match"),
    [
        ({"methods": ["draft"]}, r"backends\.v\.options\.speculation\.methods: \"draft\" needs"),
        ({"methods": ["eagle"]}, r"backends\.v\.options\.speculation\.methods: unknown"),
        ({"max_proposal": 0}, r"backends\.v\.options\.speculation\.max_proposal"),
        ({"ngram_size": 0}, r"backends\.v\.options\.speculation\.ngram_size"),
    ],
)
def test_bad_speculation_options_are_named(speculation: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        create_backend(
            BackendConfig(name="v", kind="llamacpp", options={"speculation": speculation})
        )


def test_without_the_option_the_backend_does_not_speculate() -> None:
    llama = create_backend(BackendConfig(name="v", kind="llamacpp"))
    assert llama.speculation_methods == ()
    assert llama.stats() == {}


# -- the real model in this process -------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_greedy_output_is_the_plain_output_in_fewer_decodes(
    plain: LlamaCppBackend, spec: LlamaCppBackend
) -> None:
    """Equal ids, or the first difference at a near tie of the plain run (module docstring)."""
    request = _repeat(logprobs=True, top_logprobs=2)
    expected = await _collect(plain, request)
    runner: Any = spec._runner
    decodes = runner.num_decode_calls
    got = await _collect(spec, request)
    decodes = runner.num_decode_calls - decodes

    assert expected[-1].speculation is None and plain.stats() == {}
    plain_ids, spec_ids = _ids(expected), _ids(got)
    assert len(plain_ids) > 20
    if plain_ids != spec_ids:
        at = next(
            (i for i, (a, b) in enumerate(zip(plain_ids, spec_ids, strict=False)) if a != b),
            min(len(plain_ids), len(spec_ids)),
        )
        entries = [entry for chunk in expected for entry in chunk.logprobs or ()]
        best, second = entries[at].top_logprobs[:2]
        assert best.logprob - second.logprob < 0.5, f"diverged at {at} without a near tie"
    stats = got[-1].speculation
    assert stats is not None and stats.method == "ngram"
    assert stats.num_drafts > 0 and stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    assert decodes < len(spec_ids)
    logprobs = [entry for chunk in got for entry in chunk.logprobs or ()]
    assert [entry.token_id for entry in logprobs] == spec_ids  # one per emitted token
    counters = spec.stats()
    assert counters["spec_decode_num_draft_tokens"] >= stats.num_draft_tokens
    assert counters["spec_decode_num_accepted_tokens"] >= stats.num_accepted_tokens


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_a_policy_turns_speculation_off_for_one_tenant(
    spec: LlamaCppBackend, policy: Any
) -> None:
    policy(TenantOff())
    off, on = await asyncio.gather(
        _collect(spec, _labelled("a", "x")), _collect(spec, _labelled("b", "y"))
    )
    assert off[-1].speculation is not None and on[-1].speculation is not None
    assert off[-1].speculation.num_draft_tokens == 0
    assert on[-1].speculation.num_draft_tokens > 0


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_a_raising_policy_falls_back_to_the_default(
    spec: LlamaCppBackend, policy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    policy(Raising())
    with caplog.at_level(logging.WARNING, logger="backends._llamacpp_speculation"):
        first = await _collect(spec, _repeat(max_tokens=16))
        second = await _collect(spec, _repeat(max_tokens=16))
    for chunks in (first, second):
        assert chunks[-1].finish_reason == "length"
        assert chunks[-1].speculation is not None
        assert chunks[-1].speculation.num_draft_tokens > 0  # AdaptiveSpeculationPolicy's
    assert len([r for r in caplog.records if "speculation policy failed" in r.message]) == 1


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_a_stop_string_inside_a_proposal_ends_the_text_before_it(
    spec: LlamaCppBackend,
) -> None:
    full = _text(await _collect(spec, _repeat()))
    assert "notebook" in full
    chunks = await _collect(spec, _repeat(stop=("notebook",)))
    assert chunks[-1].finish_reason == "stop"
    assert _text(chunks) == full.split("notebook")[0]
    stats = chunks[-1].speculation
    assert stats is not None and stats.num_accepted_tokens > 0


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_cancelling_mid_stream_leaves_the_runner_and_its_cache_right(
    spec: LlamaCppBackend,
) -> None:
    request = _repeat()
    before = _ids(await _collect(spec, request))
    stream = spec.generate(request)
    seen = 0
    async for chunk in stream:
        seen += len(chunk.token_ids)
        if seen >= 8:
            break
    await stream.aclose()  # type: ignore[attr-defined]
    await spec.wait_idle()
    runner: Any = spec._runner
    assert not runner._running and runner._slots.num_free == runner.parallel
    # The next request reuses the cancelled one's cached prompt: its KV must be intact.
    after = await _collect(spec, request)
    assert after[-1].usage is not None and after[-1].usage.cached_tokens
    assert _ids(after) == before


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_a_sampled_request_speculates_and_a_seed_repeats(spec: LlamaCppBackend) -> None:
    request = _repeat(temperature=0.8, seed=7)
    first = await _collect(spec, request)
    second = await _collect(spec, request)
    assert _text(first) == _text(second)
    assert first[-1].finish_reason in ("stop", "length")
    stats = first[-1].speculation
    assert stats is not None and stats.num_draft_tokens > 0


# -- the real model in a worker process ---------------------------------------------------------


async def _wait_for(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


#: A policy plugin as a distribution ships it: speculation off for tenant "x".
TENANT_OFF_PLUGIN = """
    from plugins.hookspecs import hookimpl
    from core_engine.policy import SpeculationDecision


    @hookimpl
    def infermux_choose_speculation(context):
        if context.labels.get("tenant") == "x":
            return SpeculationDecision()
        return None  # the built-in adaptive policy decides
"""


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_a_worker_process_asks_the_installed_policy_plugin_per_request(tmp_path: Path) -> None:
    config = BackendConfig(
        name="w", kind="llamacpp", options=OPTIONS | SPECULATION, worker_process=True
    )
    worker = WorkerBackend(config, create_backend, create_backend(config))
    with installed_plugin(tmp_path, "tenant-off", TENANT_OFF_PLUGIN):
        worker.use_policy_source(PolicySource(factory="plugins.policy:worker_policies"))
        await worker.start()
    try:
        off = await _collect(worker, _labelled("a", "x"))
        on = await _collect(worker, _labelled("b", "y"))
        assert off[-1].speculation is not None and on[-1].speculation is not None
        assert off[-1].speculation.num_draft_tokens == 0
        assert on[-1].speculation.num_draft_tokens > 0
        await _wait_for(lambda: worker.stats().get("spec_decode_num_draft_tokens", 0) > 0)
        stats = worker.stats()
        assert stats["spec_decode_num_accepted_tokens"] > 0
        assert "spec_decode_num_drafts" in stats
    finally:
        await worker.aclose()
