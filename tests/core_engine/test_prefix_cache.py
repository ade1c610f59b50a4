"""Prefix caching through the scheduler, on the simulated cache (the real model: test_engine)."""

from __future__ import annotations

from tests.core_engine.sim import expected_outputs, make_request, make_scheduler, run_to_completion

SYSTEM = list(range(100, 132))  # 32 tokens = 8 full blocks of 4


def test_second_request_reuses_the_shared_prefix_and_reports_it() -> None:
    sched = make_scheduler(num_blocks=64)
    first = make_request([*SYSTEM, 1, 2, 3], max_tokens=4)
    sched.add_request(first)
    run_to_completion(sched)
    assert first.num_cached_tokens == 0
    second = make_request([*SYSTEM, 7, 8], max_tokens=4)
    sched.add_request(second)
    so = sched.schedule()
    (item,) = so.scheduled
    # The whole shared prefix is served from the cache; only the suffix is computed.
    assert second.num_cached_tokens == 32
    assert item.num_computed_tokens == 32 and item.num_new_tokens == 2


def test_cached_prefix_survives_until_the_pool_needs_its_blocks() -> None:
    sched = make_scheduler(num_blocks=12)
    sched.add_request(make_request([*SYSTEM, 1], max_tokens=1))
    run_to_completion(sched)
    probe = make_request([*SYSTEM, 2], max_tokens=1)
    assert sched.kv_cache_manager.get_computed_blocks(probe)[1] == 32
    # A request that needs 11 of the 12 blocks evicts the (unreferenced) cached prefix.
    big = make_request(44, max_tokens=1)
    sched.add_request(big)
    run_to_completion(sched)
    assert sched.kv_cache_manager.get_computed_blocks(probe)[1] < 32


def test_least_recently_used_prefix_is_evicted_first() -> None:
    sched = make_scheduler(num_blocks=10)
    old = [*range(200, 216)]  # 4 blocks
    new = [*range(300, 316)]
    for prompt in (old, new):
        sched.add_request(make_request([*prompt, 1], max_tokens=1))
        run_to_completion(sched)
    # 4 more blocks needed: taken from the least recently freed (old) prefix first.
    sched.add_request(make_request(14, max_tokens=1))
    run_to_completion(sched)
    kv = sched.kv_cache_manager
    assert kv.get_computed_blocks(make_request([*new, 9]))[1] == 16
    assert kv.get_computed_blocks(make_request([*old, 9]))[1] < 16


def test_identical_prompts_in_the_same_step_share_blocks() -> None:
    sched = make_scheduler(num_blocks=64)
    a = make_request([*SYSTEM, 5], max_tokens=3)
    b = make_request([*SYSTEM, 5], max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    so = sched.schedule()
    # b is scheduled after a in the same step and hits a's just-registered blocks (their K/V
    # are written before any attention of the step reads them).
    assert b.num_cached_tokens == 32
    kv = sched.kv_cache_manager
    assert kv.get_block_ids(a.req_id)[:8] == kv.get_block_ids(b.req_id)[:8]
    from tests.core_engine.sim import fake_runner_output

    sched.update_from_output(so, fake_runner_output(so))
    run_to_completion(sched)
    assert a.output_token_ids == b.output_token_ids == expected_outputs(a)


def test_preemption_with_prefix_caching_on_keeps_outputs_exact() -> None:
    sched = make_scheduler(num_blocks=10, block_size=4)
    reqs = [make_request(8, max_tokens=12) for _ in range(3)]
    for r in reqs:
        sched.add_request(r)
    outputs = run_to_completion(sched)
    assert any(so.preempted_req_ids for so in outputs)
    for r in reqs:
        assert r.output_token_ids == expected_outputs(r)
