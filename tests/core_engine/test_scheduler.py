"""Scheduler behaviour on a simulated KV cache and a fake model runner (see ``sim.py``)."""

from __future__ import annotations

from core_engine.request import RequestStatus
from tests.core_engine.sim import (
    expected_outputs,
    make_request,
    make_scheduler,
    run_step,
    run_to_completion,
)


def test_every_request_gets_the_tokens_it_would_get_alone() -> None:
    sched = make_scheduler(num_blocks=64)
    reqs = [make_request(n, max_tokens=m) for n, m in [(5, 3), (17, 9), (2, 12), (33, 1)]]
    for r in reqs:
        sched.add_request(r)
    run_to_completion(sched)
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == expected_outputs(r)
    assert sched.kv_cache_manager.num_free_blocks == 64


def test_requests_join_and_leave_between_steps() -> None:
    sched = make_scheduler(num_blocks=64)
    short, long = make_request(4, max_tokens=2), make_request(4, max_tokens=10)
    sched.add_request(short)
    sched.add_request(long)
    run_step(sched)
    run_step(sched)
    assert short.is_finished and not long.is_finished
    late = make_request(4, max_tokens=3)
    sched.add_request(late)
    so, _ = run_step(sched)
    # The newcomer is prefilled in the same step as the running decode.
    assert {item.request.req_id for item in so.scheduled} == {long.req_id, late.req_id}
    run_to_completion(sched)
    assert long.output_token_ids == expected_outputs(long)
    assert late.output_token_ids == expected_outputs(late)


def test_long_prompt_is_chunked_and_does_not_stall_decodes() -> None:
    sched = make_scheduler(num_blocks=256, max_num_batched_tokens=16)
    decoders = [make_request(3, max_tokens=40) for _ in range(4)]
    for r in decoders:
        sched.add_request(r)
    run_step(sched)  # prefill the four short prompts
    long = make_request(100, max_tokens=2)
    sched.add_request(long)
    chunks = []
    while not long.output_token_ids:
        so, _ = run_step(sched)
        assert so.total_num_scheduled_tokens <= 16
        by_id = {item.request.req_id: item for item in so.scheduled}
        # Every running decode advances by one token in every step of the long prefill.
        assert all(by_id[r.req_id].num_new_tokens == 1 for r in decoders)
        chunks.append(by_id[long.req_id].num_new_tokens)
    assert sum(chunks) == 100 and max(chunks) == 12
    run_to_completion(sched)
    assert long.output_token_ids == expected_outputs(long)


def test_pool_exhaustion_preempts_the_newest_and_everything_completes() -> None:
    # 12 blocks of 4 tokens; six requests of 6 prompt + 14 output tokens need 5 blocks each.
    sched = make_scheduler(num_blocks=12, block_size=4, enable_caching=False)
    reqs = [make_request(6, max_tokens=14) for _ in range(6)]
    for r in reqs:
        sched.add_request(r)
    outputs = run_to_completion(sched)
    preempted = [rid for so in outputs for rid in so.preempted_req_ids]
    assert preempted, "the tiny pool should have forced preemption"
    # The oldest request is never the victim.
    assert reqs[0].req_id not in preempted
    for r in reqs:
        assert r.output_token_ids == expected_outputs(r)
    assert sched.kv_cache_manager.num_free_blocks == 12


def test_preempted_request_resumes_from_the_front_of_the_queue() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, enable_caching=False)
    a, b = make_request(4, max_tokens=8), make_request(4, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    victim = None
    while victim is None:
        so, _ = run_step(sched)
        victim = so.preempted_req_ids[0] if so.preempted_req_ids else None
    assert victim == b.req_id
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    waiting_newcomer = make_request(2, max_tokens=1)
    sched.add_request(waiting_newcomer)
    assert sched.waiting[0] is b
    run_to_completion(sched)
    assert b.output_token_ids == expected_outputs(b)


def test_max_num_seqs_caps_the_batch() -> None:
    sched = make_scheduler(num_blocks=128, max_num_seqs=3)
    for _ in range(5):
        sched.add_request(make_request(4, max_tokens=4))
    so, _ = run_step(sched)
    assert len(so.scheduled) == 3
    assert len(sched.waiting) == 2


def test_abort_frees_blocks_immediately() -> None:
    sched = make_scheduler(num_blocks=32)
    running, queued = make_request(20, max_tokens=50), make_request(4, max_tokens=5)
    sched.add_request(running)
    run_step(sched)
    sched.add_request(queued)
    assert sched.kv_cache_manager.num_free_blocks < 32
    sched.finish_requests([running.req_id, queued.req_id], RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache_manager.num_free_blocks == 32
    assert running.status == RequestStatus.FINISHED_ABORTED
    assert not sched.has_unfinished_requests()


def test_eos_and_stop_token_ids_finish_requests() -> None:
    from core_engine.sampling_params import SamplingParams

    sched = make_scheduler(num_blocks=32)
    probe = make_request(4, max_tokens=5)
    stop_at = expected_outputs(probe)[2]
    req = make_request(probe.prompt_token_ids, max_tokens=5, params=SamplingParams(stop_token_ids=(stop_at,)))
    sched.add_request(req)
    run_to_completion(sched)
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == stop_at
    assert req.output_token_ids == expected_outputs(probe)[:3]
