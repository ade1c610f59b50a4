"""Disaggregated prefill / decode at the engine level: a prefill engine's exported KV, sent
through the shared-memory transport (or as msgpack + bytes) and imported by a decode engine,
gives the colocated engine's greedy tokens."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest

from backends.default_model import default_model_path
from core_engine.kv_transfer import (
    KVReceiver,
    KVSender,
    KVTransferConfig,
    KVTransferMeta,
    PrefilledKV,
    open_receiver,
    open_sender,
)
from core_engine.llm_engine import LLMEngine
from core_engine.sampling_params import SamplingParams
from tests.core_engine.engine_util import collect, engine_like, make_engine, run_all

_WORDS = "the quick brown fox jumps over a lazy dog while seven tired owls count stars above".split()
_SYSTEM = "You are a careful assistant. Answer briefly and plainly, in English. " * 3


def _prompts() -> dict[str, str]:
    """32 prompts from 3 to ~300 tokens; a third share a long system prefix (decode-side reuse)."""
    prompts = {}
    for i in range(32):
        n = 2 + (i * 37) % 160
        body = " ".join(_WORDS[(i + j) % len(_WORDS)] for j in range(n))
        prompts[f"r{i}"] = (_SYSTEM + body) if i % 3 == 0 else body
    return prompts


def _params(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=1 if i % 11 == 5 else 4 + i % 9)


@pytest.fixture(scope="module")
def colocated() -> LLMEngine:
    return make_engine(default_model_path(), max_num_batched_tokens=256)


def _over_the_wire(kv: PrefilledKV) -> PrefilledKV:
    """What a transport does to a transfer: metadata as msgpack, blocks as raw bytes."""
    meta = msgspec.msgpack.decode(msgspec.msgpack.encode(kv.meta), type=KVTransferMeta)
    return PrefilledKV.from_buffer(meta, b"".join(bytes(b) for b in kv.buffers()))


@pytest.fixture()
def shm() -> Iterator[tuple[KVSender, KVReceiver]]:
    config = KVTransferConfig(transport="shm", timeout_s=5.0)
    receiver, sender = open_receiver(config), open_sender(config)
    yield sender, receiver
    sender.close()
    receiver.close()


def test_disaggregated_tokens_match_colocated_and_no_block_leaks(
    colocated: LLMEngine, shm: tuple[KVSender, KVReceiver]
) -> None:
    prompts = _prompts()
    params = {req_id: _params(i) for i, req_id in enumerate(prompts)}
    expected = run_all(colocated, prompts, params)

    # Pools that hold every prompt at once (the pool-short path has its own test).
    prefill = engine_like(colocated, kv_cache_memory_bytes=256 * 2**20)
    decode = engine_like(colocated, kv_cache_memory_bytes=256 * 2**20)
    free_at_start = (prefill.num_free_blocks, decode.num_free_blocks)
    for req_id, prompt in prompts.items():
        prefill.add_request(req_id, prefill.make_prefill_request(req_id, prompt, params[req_id]))
    sender, receiver = shm
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            if out.finished:
                assert out.prefilled is not None, out
                sender.send(f"t-{out.req_id}", out.prefilled)  # a shared-memory segment each
    transfers = {req_id: receiver.receive(f"t-{req_id}") for req_id in prompts}

    # Arrivals while others decode: 8 imports between steps.
    results: dict[str, dict[str, object]] = {}
    pending = list(prompts)
    while pending or decode.has_unfinished_requests():
        for req_id in pending[:8]:
            request = decode.make_request(req_id, prompts[req_id], params[req_id])
            decode.add_prefilled_request(request, transfers[req_id])
            results[req_id] = {"token_ids": [], "text": "", "outputs": []}
        del pending[:8]
        for out in decode.step():
            collect(results[out.req_id], out)

    for req_id in prompts:
        assert results[req_id]["token_ids"] == expected[req_id]["token_ids"], req_id
        assert results[req_id]["text"] == expected[req_id]["text"], req_id
        assert results[req_id]["final"].finish_reason == expected[req_id]["final"].finish_reason  # type: ignore[attr-defined]
    # The shared system prefix was written once and then found in the decode prefix cache.
    assert decode.handoff.num_reused_blocks > 0 and decode.handoff.num_deferred == 0
    assert decode.handoff.num_written_blocks + decode.handoff.num_reused_blocks == sum(
        t.meta.num_blocks for r, t in transfers.items() if params[r].max_tokens != 1
    )
    assert (prefill.num_free_blocks, decode.num_free_blocks) == free_at_start
    assert not prefill.has_unfinished_requests() and not prefill._prefilled


def _prefill_one(engine: LLMEngine, req_id: str, prompt: str, params: SamplingParams) -> PrefilledKV:
    engine.add_request(req_id, engine.make_prefill_request(req_id, prompt, params))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out.prefilled
    raise AssertionError("the prefill request did not finish")


def test_an_import_the_pool_cannot_hold_waits_and_is_recomputed(colocated: LLMEngine) -> None:
    prompt = " ".join(_WORDS * 6)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    expected = run_all(colocated, {"a": prompt}, params)["a"]["token_ids"]
    kv = _over_the_wire(_prefill_one(engine_like(colocated), "a", prompt, params))
    # A decode pool of 12 blocks, 9 of them held by another request: the import waits, and
    # the request is prefilled again there once the other one is done.
    decode = engine_like(colocated, kv_cache_memory_bytes=colocated.handoff.blocks.block_nbytes * 12)
    decode.add_request("hog", list(range(10, 10 + 16 * 8)), SamplingParams(temperature=0.0, max_tokens=8))
    decode.step()
    decode.add_prefilled_request(decode.make_request("a", prompt, params), kv)
    assert decode.handoff.num_written_blocks == 0 and decode.handoff.num_deferred == 1
    tokens: list[int] = []
    while decode.has_unfinished_requests():
        for out in decode.step():
            if out.req_id == "a":
                tokens.extend(out.new_token_ids)
    assert tokens == expected
    assert decode.num_free_blocks == decode.num_blocks


def test_foreign_kv_is_refused(colocated: LLMEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=3)
    kv = _prefill_one(engine_like(colocated), "a", "hello there", params)
    decode = engine_like(colocated)
    with pytest.raises(ValueError, match="another prompt"):
        decode.add_prefilled_request(decode.make_request("b", "something else", params), kv)
    assert decode.num_free_blocks == decode.num_blocks and not decode.has_unfinished_requests()
