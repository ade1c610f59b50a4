"""Simulated engine parts for model-free tests (SGLang's ``create_simulated`` habit).

:func:`fake_runner_output` plays the model runner: the token sampled after a context is a pure
function of the context length and the request's first prompt token, so any schedule —
chunked, batched, preempted and recomputed — must yield the same tokens as a request run alone.
"""

from __future__ import annotations

import itertools

from core_engine.kv_cache_manager import KVCacheManager
from core_engine.request import Request
from core_engine.sampling_params import SamplingParams
from core_engine.scheduler import ModelRunnerOutput, Scheduler, SchedulerOutput

VOCAB = 1000
EOS = 999
_ids = itertools.count()


def make_request(
    prompt: list[int] | int,
    *,
    max_tokens: int = 8,
    req_id: str | None = None,
    params: SamplingParams | None = None,
) -> Request:
    """A request with ``prompt`` ids (or ``prompt`` distinct ids when an int)."""
    if isinstance(prompt, int):
        base = next(_ids) * 7919 % 500
        prompt = [(base + i) % 500 for i in range(prompt)]
    return Request(
        req_id or f"r{next(_ids)}",
        prompt,
        params or SamplingParams(max_tokens=max_tokens),
        max_tokens=max_tokens,
        eos_token_ids=frozenset({EOS}),
    )


def expected_token(request: Request, context_len: int) -> int:
    return (request.prompt_token_ids[0] * 31 + context_len) % 499 + 500  # never EOS


def fake_runner_output(so: SchedulerOutput) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        sampled_token_ids=[
            expected_token(item.request, item.num_computed_tokens + item.num_new_tokens) if item.sample else None
            for item in so.scheduled
        ]
    )


def make_scheduler(
    num_blocks: int, block_size: int = 4, *, max_num_seqs: int = 16, max_num_batched_tokens: int = 64,
    max_model_len: int = 4096, enable_caching: bool = True,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_caching=enable_caching)
    return Scheduler(
        kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len
    )


def run_step(scheduler: Scheduler) -> tuple[SchedulerOutput, list[Request]]:
    so = scheduler.schedule()
    return so, scheduler.update_from_output(so, fake_runner_output(so))


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outputs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        so, _ = run_step(scheduler)
        outputs.append(so)
    raise AssertionError("the scheduler did not finish its requests")


def expected_outputs(request: Request) -> list[int]:
    """The tokens ``request`` yields when run alone."""
    n = request.num_prompt_tokens
    return [expected_token(request, n + i) for i in range(request.max_tokens)]
