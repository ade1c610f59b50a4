"""The paged engine against the contiguous reference on a tiny random GGUF (fast, fp32).

Every scheduling path is driven on purpose: many requests in one batch, chunked prefill with a
small token budget, prefix-cache hits, and preemption in a pool too small for the batch.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from core_engine.errors import InvalidParamError, RequestTooLongError
from core_engine.sampling_params import SamplingParams
from tests.core_engine.engine_util import make_engine, reference_greedy, run_all
from tests.core_engine.gguf_factory import write_llama_gguf

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
#: KV bytes per block of the tiny model: K and V x 2 layers x 16 tokens x 2 kv heads x 16 dims x fp32.
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def random_prompts(n: int, vocab: int, seed: int, shared_prefix: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(shared_prefix)]
    return {f"p{i}": prefix + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 40))] for i in range(n)}


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # everything in one step
        {"max_num_batched_tokens": 7},  # prompts chunked over many steps
        {"max_num_seqs": 3},  # requests queue and join as others leave
        {"kv_cache_memory_bytes": 10 * BLOCK_BYTES},  # 10 blocks for 12 requests: preemption
    ],
    ids=["batched", "chunked", "few-seqs", "preempting"],
)
def test_paged_engine_matches_the_contiguous_reference(tiny_path: Path, overrides: dict) -> None:
    engine = make_engine(tiny_path, **overrides)
    prompts = random_prompts(12, engine.model_config.vocab_size, seed=1)
    results = run_all(engine, prompts, GREEDY)
    for req_id, prompt in prompts.items():
        assert results[req_id]["token_ids"] == reference_greedy(engine, prompt, 12), req_id
    if "kv_cache_memory_bytes" in overrides:
        assert engine.scheduler.num_preemptions > 0
    assert engine.num_free_blocks == engine.num_blocks


def test_prefix_cache_hits_give_the_same_tokens(tiny_path: Path) -> None:
    engine = make_engine(tiny_path)
    prompts = random_prompts(6, engine.model_config.vocab_size, seed=2, shared_prefix=70)
    first = run_all(engine, dict(list(prompts.items())[:1]), GREEDY)
    rest = run_all(engine, dict(list(prompts.items())[1:]), GREEDY)
    assert first["p0"]["final"].num_cached_tokens == 0
    for req_id, prompt in prompts.items():
        result = first.get(req_id) or rest[req_id]
        assert result["token_ids"] == reference_greedy(engine, prompt, 12)
        if req_id != "p0":
            assert result["final"].num_cached_tokens == 64  # 4 full blocks of the shared 70


def test_requests_that_can_never_fit_are_rejected_up_front(tiny_path: Path) -> None:
    engine = make_engine(tiny_path, kv_cache_memory_bytes=4 * BLOCK_BYTES)  # 64 tokens
    with pytest.raises(RequestTooLongError) as info:
        engine.add_request("big", list(range(3, 60)), SamplingParams(max_tokens=20))
    assert info.value.param == "max_tokens"
    with pytest.raises(RequestTooLongError):
        engine.add_request("ctx", [5] * 250, SamplingParams(max_tokens=10))  # context is 256
    with pytest.raises(InvalidParamError) as info:
        engine.add_request("empty", [], SamplingParams())
    assert info.value.param == "prompt"
    assert not engine.has_unfinished_requests()
    # No max_tokens: "until the context is full", capped to what the pool can ever hold.
    open_ended = engine.add_request("open", [5] * 10, SamplingParams(max_tokens=None))
    assert open_ended.max_tokens == 64 - 10
    engine.abort_request("open")


def test_identical_prompts_in_one_step_share_blocks_and_tokens(tiny_path: Path) -> None:
    engine = make_engine(tiny_path)
    prompt = random_prompts(1, engine.model_config.vocab_size, seed=3, shared_prefix=50)["p0"]
    results = run_all(engine, {"a": prompt, "b": prompt}, GREEDY)
    # b hit the blocks a registered earlier in the same step (written before being read).
    assert results["b"]["final"].num_cached_tokens == (len(prompt) - 1) // 16 * 16
    assert results["a"]["token_ids"] == results["b"]["token_ids"] == reference_greedy(engine, prompt, 12)


def test_prompt_logprobs_match_a_full_forward_even_when_chunked(tiny_path: Path) -> None:
    import torch

    from core_engine.attention import ContiguousAttention

    engine = make_engine(tiny_path, max_num_batched_tokens=5)
    prompt = random_prompts(1, engine.model_config.vocab_size, seed=4, shared_prefix=30)["p0"]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2, logprobs=1)
    final = run_all(engine, {"echo": prompt}, params)["echo"]
    outputs = final["outputs"]
    (prompt_logprobs,) = [o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None]
    model = engine.model_runner.model
    with torch.inference_mode():
        logits = model(torch.tensor(prompt), torch.arange(len(prompt)), ContiguousAttention(model.config.num_layers))
    ref = logits.log_softmax(-1)
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        record = prompt_logprobs[pos]
        assert record.token_id == prompt[pos]
        assert record.logprob == pytest.approx(float(ref[pos - 1, prompt[pos]]), abs=1e-4)
        assert [t for t, _ in record.top] == ref[pos - 1].topk(2).indices.tolist()
    sampled = [lp for o in outputs for lp in (o.logprobs or ())]
    assert [r.token_id for r in sampled] == final["token_ids"]
    assert sampled[0].logprob == pytest.approx(float(ref[-1].max()), abs=1e-4)


def test_offline_llm_generate_keeps_prompt_order(tiny_path: Path) -> None:
    from core_engine.llm import LLM

    llm = LLM(str(tiny_path), dtype="float32", num_threads=1, kv_cache_memory_bytes=64 * BLOCK_BYTES)
    prompts = ["The quick brown fox", "Hello world!", "def forward(self):"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1))
    assert [o.prompt for o in outs] == prompts
    for o in outs:
        assert len(o.token_ids) == 6 and o.finish_reason == "length"
        assert o.token_ids == reference_greedy(llm.engine, o.prompt_token_ids, 6)
        assert o.logprobs is not None and [r.token_id for r in o.logprobs] == o.token_ids
    # A single prompt (string or token ids) works too.
    (single,) = llm.generate(outs[0].prompt_token_ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert single.token_ids == outs[0].token_ids
