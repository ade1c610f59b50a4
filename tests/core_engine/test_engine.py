"""The engine on the real SmolLM2-135M-Instruct (fp32): what a user of the engine would notice."""

from __future__ import annotations

import pytest

from backends.default_model import default_model_path
from core_engine.llm_engine import LLMEngine
from core_engine.sampling_params import SamplingParams
from tests.core_engine.engine_util import engine_like, make_engine, reference_greedy, run_all

pytestmark = pytest.mark.slow

PROMPTS = {
    "france": "The capital of France is",
    "code": "def fibonacci(n):",
    "story": "Once upon a time, in a land far away,",
    "list": "Three things to pack for a hike:\n1.",
}
SYSTEM = (
    "You are a meticulous assistant for a mountain hut. You answer questions about trails, "
    "weather, opening hours, food and lodging. Opening hours are 7am to 10pm. Breakfast is "
    "served from 7 to 9, dinner from 6 to 8. The hut has 40 beds in 6 rooms; blankets are "
    "provided, sleeping-bag liners are mandatory. The nearest village is 3 hours down the "
    "valley. Trails: the ridge trail (hard, 5 hours), the lake loop (easy, 2 hours), the "
    "glacier view path (medium, 3 hours). Always mention the weather forecast. "
) * 2


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return make_engine(default_model_path())


def greedy(max_tokens: int = 16, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)  # type: ignore[arg-type]


def test_batched_paged_greedy_equals_the_contiguous_reference(engine: LLMEngine) -> None:
    results = run_all(engine, PROMPTS, greedy())
    for req_id, prompt in PROMPTS.items():
        ids = engine.tokenizer.encode(prompt, add_special=True, parse_special=True)
        assert results[req_id]["token_ids"] == reference_greedy(engine, ids, 16), req_id
    assert "Paris" in results["france"]["text"]
    assert engine.num_free_blocks == engine.num_blocks


def test_a_request_gets_the_same_tokens_alone_or_in_a_batch(engine: LLMEngine) -> None:
    batched = run_all(engine, PROMPTS, greedy())
    alone = run_all(engine, {"code": PROMPTS["code"]}, greedy())
    assert alone["code"]["token_ids"] == batched["code"]["token_ids"]


def test_prefix_cache_hit_reports_cached_tokens_and_keeps_the_output(engine: LLMEngine) -> None:
    engine.reset_prefix_cache()
    question = "\nQuestion: when is dinner?\nAnswer:"
    cold = run_all(engine, {"cold": SYSTEM + question}, greedy(12))["cold"]
    warm = run_all(engine, {"warm": SYSTEM + question}, greedy(12))["warm"]
    other = run_all(engine, {"other": SYSTEM + "\nQuestion: how long is the lake loop?\nAnswer:"}, greedy(12))
    num_prompt = cold["final"].num_prompt_tokens
    assert cold["final"].num_cached_tokens == 0
    assert warm["final"].num_cached_tokens == (num_prompt - 1) // 16 * 16
    assert other["other"]["final"].num_cached_tokens >= 16 * (len(engine.tokenizer.encode(SYSTEM)) // 16 - 1)
    assert warm["token_ids"] == cold["token_ids"]


def test_preemption_in_a_tiny_pool_still_completes_every_request_correctly(engine: LLMEngine) -> None:
    # 12 blocks = 192 tokens for four requests of ~10 prompt + 40 output tokens each.
    small = engine_like(engine, kv_cache_memory_bytes=12 * 737_280, enable_prefix_caching=False)
    results = run_all(small, PROMPTS, greedy(40))
    assert small.scheduler.num_preemptions > 0
    roomy = run_all(engine, PROMPTS, greedy(40))
    for req_id in PROMPTS:
        assert results[req_id]["token_ids"] == roomy[req_id]["token_ids"], req_id
    assert small.num_free_blocks == small.num_blocks


def test_same_seed_same_text_different_seed_different_text(engine: LLMEngine) -> None:
    def sampled(seed: int, neighbours: bool) -> str:
        params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, seed=seed)
        prompts = {"x": PROMPTS["story"]}
        if neighbours:
            prompts |= {"n1": PROMPTS["code"], "n2": PROMPTS["list"]}
        return str(run_all(engine, prompts, params)["x"]["text"])

    first = sampled(7, neighbours=False)
    assert sampled(7, neighbours=True) == first
    assert sampled(8, neighbours=False) != first


def test_abort_frees_blocks_at_once(engine: LLMEngine) -> None:
    engine.add_request("long", SYSTEM, greedy(200))
    engine.add_request("other", PROMPTS["code"], greedy(200))
    for _ in range(3):
        engine.step()
    assert engine.num_free_blocks < engine.num_blocks
    engine.abort_request(["long", "other"])
    assert engine.num_free_blocks == engine.num_blocks
    assert not engine.has_unfinished_requests()


def test_stop_string_across_tokens_ends_the_text_before_it(engine: LLMEngine) -> None:
    full = run_all(engine, {"f": PROMPTS["code"]}, greedy(24))["f"]
    text = str(full["text"])
    stop = "return"  # the continuation of the fibonacci prompt returns something
    assert stop in text
    cut = run_all(engine, {"s": PROMPTS["code"]}, greedy(24, stop=(stop,)))["s"]
    assert cut["text"] == text[: text.index(stop)]
    assert cut["final"].finish_reason == "stop" and cut["final"].stop_reason == stop


def test_eos_finishes_with_stop_unless_ignored(engine: LLMEngine) -> None:
    chat = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    done = run_all(engine, {"c": chat}, SamplingParams(temperature=0, max_tokens=64))["c"]
    assert done["final"].finish_reason == "stop"
    assert "<|im_end|>" not in str(done["text"])
    forced = run_all(engine, {"c": chat}, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))["c"]
    assert forced["final"].finish_reason == "length" and len(forced["token_ids"]) == 64
