"""Speculative decoding in the real engine: exactness, distribution, policy, and no leaks.

Greedy equality runs the default model (SmolLM2-135M, fp32) with n-gram lookup and with the
model as its own draft; distribution preservation runs a tiny random GGUF whose draft is its
own first layer (so proposals are often rejected and the residual path is exercised).
"""

# Engines here pin weight_format="dense": speculative and plain decoding must agree token for
# token, exact in fp32; the int4 default's 8-bit activations can flip near-ties between the two
# attention paths (see docs/core-engine-model.md).
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backends.default_model import default_model_path as find_default_model
from core_engine.config import SpeculationConfig
from core_engine.llm import LLM
from core_engine.policy import (
    AdaptiveSpeculationPolicy,
    EnginePolicies,
    FixedSpeculationPolicy,
    SpeculationContext,
    SpeculationDecision,
)
from core_engine.sampling_params import SamplingParams
from core_engine.spec_decode.ngram import NgramProposer
from tests.core_engine.engine_util import run_all
from tests.core_engine.gguf_factory import write_first_layers_copy, write_llama_gguf

PASSAGE = (
    "def moving_average(values, window):\n"
    "    if window <= 0:\n"
    "        raise ValueError('window must be positive')\n"
    "    total = 0.0\n"
    "    out = []\n"
    "    for i, value in enumerate(values):\n"
    "        total += value\n"
    "        if i >= window:\n"
    "            total -= values[i - window]\n"
    "        out.append(total / min(i + 1, window))\n"
    "    return out\n"
)

QUESTIONS = [
    f"Rewrite this function with the variable `out` renamed to `result`:\n{PASSAGE}",
    f"Repeat this code exactly:\n{PASSAGE}",
    "Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat.",
    "List the numbers from one to twenty in words, separated by commas.",
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "Copy this sentence twice: Speculative decoding verifies proposed tokens in one forward pass.",
]


def chat(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


PROMPTS = [chat(q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def default_model_path() -> Path:
    return find_default_model()


@pytest.fixture(scope="module")
def plain(default_model_path: Path) -> LLM:
    return LLM(str(default_model_path), dtype="float32", weight_format="dense", num_threads=1, kv_cache_memory_bytes=2**26)


@pytest.fixture(scope="module")
def speculative(default_model_path: Path) -> LLM:
    """n-gram and the model as its own draft, one engine; the policy picks per test."""
    return LLM(
        str(default_model_path),
        dtype="float32",
        weight_format="dense",
        num_threads=1,
        kv_cache_memory_bytes=2**26,
        speculation=SpeculationConfig(
            methods=("ngram", "draft"), draft_model_path=str(default_model_path), max_proposal=8
        ),
    )


@pytest.fixture(scope="module")
def plain_greedy(plain: LLM) -> list[list[int]]:
    return [o.token_ids for o in plain.generate(PROMPTS, SamplingParams(max_tokens=48, temperature=0.0))]


def leak_free(llm: LLM) -> None:
    engine = llm.engine
    assert engine.num_free_blocks == engine.num_blocks, "target KV blocks leaked"
    draft = engine.speculator.draft
    if draft is not None:
        assert draft.num_free_blocks == draft.num_blocks, "draft KV blocks leaked"


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_output_is_token_for_token_the_plain_output(
    speculative: LLM, plain_greedy: list[list[int]], method: str, k: int
) -> None:
    speculative.engine.use_policies(EnginePolicies(speculation=FixedSpeculationPolicy(k, method)))  # type: ignore[arg-type]
    outs = speculative.generate(PROMPTS, SamplingParams(max_tokens=48, temperature=0.0))
    for i, (out, expected) in enumerate(zip(outs, plain_greedy, strict=True)):
        assert out.token_ids == expected, f"prompt {i} differs with {method}, k={k}"
    proposed = sum(o.speculation.num_draft_tokens for o in outs)
    accepted = sum(o.speculation.num_accepted_tokens for o in outs)
    assert proposed > 0 and accepted > 0
    if method == "draft":  # its own draft: every proposal is the target's own argmax
        assert accepted == proposed
    leak_free(speculative)


class _EveryOther:
    """Speculate on the even-numbered requests only (a mixed batch)."""

    def choose_speculation(self, context: SpeculationContext) -> SpeculationDecision:
        if int(context.req_id.rsplit("-", 1)[1]) % 2:
            return SpeculationDecision()
        return SpeculationDecision(method="ngram", num_speculative_tokens=4)


def test_a_batch_of_mixed_speculative_and_plain_requests(speculative: LLM, plain_greedy: list[list[int]]) -> None:
    speculative.engine.use_policies(EnginePolicies(speculation=_EveryOther()))  # type: ignore[arg-type]
    outs = speculative.generate(PROMPTS, SamplingParams(max_tokens=48, temperature=0.0))
    assert [o.token_ids for o in outs] == plain_greedy
    by_parity = [[o.speculation.num_draft_tokens for o in outs if int(o.req_id.rsplit("-", 1)[1]) % 2 == p] for p in (0, 1)]
    assert sum(by_parity[0]) > 0 and sum(by_parity[1]) == 0


def test_logprobs_penalties_and_seeds_behave_as_without_speculation(plain: LLM, speculative: LLM) -> None:
    speculative.engine.use_policies(EnginePolicies(speculation=FixedSpeculationPolicy(4, "ngram")))  # type: ignore[arg-type]
    prompts = PROMPTS[:3]
    for params in (
        SamplingParams(max_tokens=32, temperature=0.0, logprobs=3),
        SamplingParams(max_tokens=32, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(max_tokens=32, temperature=0.9, top_p=0.95, seed=1234),
    ):
        want = plain.generate(prompts, params)
        got = speculative.generate(prompts, params)
        for a, b in zip(want, got, strict=True):
            assert b.token_ids == a.token_ids, params
            assert b.text == a.text
            if params.logprobs is not None:
                assert a.logprobs is not None and b.logprobs is not None
                assert len(b.logprobs) == len(a.logprobs)
                for x, y in zip(a.logprobs, b.logprobs, strict=True):
                    assert y.token_id == x.token_id
                    assert y.logprob == pytest.approx(x.logprob, abs=1e-3)
                    assert [t for t, _ in y.top] == [t for t, _ in x.top]
    assert sum(o.speculation.num_draft_tokens for o in got) > 0
    leak_free(speculative)


def test_a_stop_string_inside_an_accepted_proposal_ends_the_output_there(plain: LLM, speculative: LLM) -> None:
    speculative.engine.use_policies(EnginePolicies(speculation=FixedSpeculationPolicy(8, "ngram")))  # type: ignore[arg-type]
    prompt = chat(f"Repeat this code exactly:\n{PASSAGE}")
    free = plain.generate(prompt, SamplingParams(max_tokens=64, temperature=0.0))[0]
    assert "be positive" in free.text
    params = SamplingParams(max_tokens=64, temperature=0.0, stop=("be positive",))
    want = plain.generate(prompt, params)[0]
    got = speculative.generate(prompt, params)[0]
    assert got.finish_reason == "stop" and got.stop_reason == "be positive"
    assert got.text == want.text and got.text.endswith("must ")
    assert got.token_ids == want.token_ids
    assert got.speculation.num_accepted_tokens > 0
    leak_free(speculative)


def test_abort_and_preemption_mid_speculation_leak_no_block(default_model_path: Path) -> None:
    # 12 blocks of 16 tokens for 4 requests of ~40 + 60 tokens: they preempt each other.
    llm = LLM(
        str(default_model_path), dtype="float32", weight_format="dense", num_threads=1,
        kv_cache_memory_bytes=12 * 16 * 30 * 2 * 64 * 3 * 4,  # 12 blocks: layers x K/V x heads x dims x fp32
        speculation=SpeculationConfig(methods=("ngram", "draft"), draft_model_path=str(default_model_path)),
        policies=EnginePolicies(speculation=FixedSpeculationPolicy(6, "ngram")),
    )
    engine = llm.engine
    assert engine.num_blocks == 12
    prompt = chat("Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat.")
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    plain_out = llm.generate(prompt, params)[0]
    results = run_all(engine, {f"r{i}": prompt for i in range(4)}, params)
    assert engine.scheduler.num_preemptions > 0
    for result in results.values():
        assert result["token_ids"] == plain_out.token_ids
    assert engine.num_free_blocks == engine.num_blocks
    # Abort in the middle of speculating, with the draft method this time.
    engine.use_policies(EnginePolicies(speculation=FixedSpeculationPolicy(4, "draft")))
    engine.add_request("a", prompt, params)
    engine.add_request("b", prompt, params)
    for _ in range(6):
        engine.step()
    assert engine.scheduler.num_spec_drafts > 0
    engine.abort_request(["a", "b"])
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks == engine.num_blocks
    assert engine.speculator.draft.num_free_blocks == engine.speculator.draft.num_blocks


class _Raises:
    def choose_speculation(self, context: SpeculationContext) -> SpeculationDecision:
        raise RuntimeError("policy bug")


def test_a_policy_that_raises_falls_back_to_the_default(speculative: LLM, plain_greedy: list[list[int]]) -> None:
    speculative.engine.use_policies(EnginePolicies(speculation=_Raises()))  # type: ignore[arg-type]
    outs = speculative.generate(PROMPTS[:2], SamplingParams(max_tokens=48, temperature=0.0))
    assert [o.token_ids for o in outs] == plain_greedy[:2]
    # The default (AdaptiveSpeculationPolicy) speculates at this batch size.
    assert sum(o.speculation.num_draft_tokens for o in outs) > 0


def test_the_adaptive_policy_switches_off_above_its_batch_size(speculative: LLM) -> None:
    policy = AdaptiveSpeculationPolicy(max_tokens=4, max_batch=4)
    speculative.engine.use_policies(EnginePolicies(speculation=policy))
    outs = speculative.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    # Eight requests decode together for the whole run: nothing is proposed.
    assert sum(o.speculation.num_draft_tokens for o in outs) == 0


def test_near_ties_are_the_only_divergence_in_bfloat16(default_model_path: Path) -> None:
    """In bf16 a (k+1)-row verification GEMM and a 1-row decode GEMV may round differently;
    a greedy divergence is allowed only where the plain run's two top logprobs were within
    ``MARGIN`` nats of each other."""
    margin = 0.3
    options = {"dtype": "bfloat16", "weight_format": "dense", "num_threads": 1, "kv_cache_memory_bytes": 2**26}
    plain = LLM(str(default_model_path), **options)
    spec = LLM(
        str(default_model_path), **options,
        speculation=SpeculationConfig(methods=("ngram",)),
        policies=EnginePolicies(speculation=FixedSpeculationPolicy(4, "ngram")),
    )
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)
    prompts = PROMPTS[1:4]
    for a, b in zip(plain.generate(prompts, params), spec.generate(prompts, params), strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y), None)
        if n is None:
            assert a.token_ids == b.token_ids
            continue
        top = a.logprobs[n].top
        assert top[0][1] - top[1][1] < margin, f"divergence at token {n} is not a near-tie: {top}"


def test_ngram_lookup_proposes_the_most_recent_continuation() -> None:
    class R:
        def __init__(self, req_id: str, tokens: list[int]) -> None:
            self.req_id, self.all_token_ids = req_id, tokens

    proposer = NgramProposer(ngram_max=3, ngram_min=1)
    out = proposer.propose(
        [R("a", [1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3]), R("b", [7, 8]), R("c", [5, 6, 5])], [2, 3, 4]
    )
    assert out == [[4, 5], [], [6, 5]]
    assert proposer.num_calls == 1 and proposer.seconds > 0


# -- distribution preservation ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("spec")
    target = write_llama_gguf(root / "target.gguf")
    return target, write_first_layers_copy(target, root / "draft.gguf", 1)


def _samples(llm: LLM, prompt: list[int], params: SamplingParams, num_requests: int) -> list[list[int]]:
    outs = llm.generate([prompt] * num_requests, params)
    return [o.token_ids for o in outs]


def _two_sample_p_value(a: list[int], b: list[int]) -> float:
    """Chi-square test that two samples come from one categorical distribution (cells with
    an expected count below 5 are pooled)."""
    counts_a = torch.bincount(torch.tensor(a), minlength=max(a + b) + 1).double()
    counts_b = torch.bincount(torch.tensor(b), minlength=max(a + b) + 1).double()
    total = counts_a + counts_b
    order = total.argsort(descending=True)
    counts_a, counts_b, total = counts_a[order], counts_b[order], total[order]
    frac_a = counts_a.sum() / total.sum()
    keep = (total * min(frac_a, 1 - frac_a)) >= 5
    ca = torch.cat([counts_a[keep], counts_a[~keep].sum().unsqueeze(0)])
    cb = torch.cat([counts_b[keep], counts_b[~keep].sum().unsqueeze(0)])
    if ca[-1] + cb[-1] == 0:
        ca, cb = ca[:-1], cb[:-1]
    tot = ca + cb
    ea, eb = tot * frac_a, tot * (1 - frac_a)
    stat = float((((ca - ea) ** 2) / ea + ((cb - eb) ** 2) / eb).sum())
    df = len(tot) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_sampled_tokens_keep_the_target_distribution(tiny_pair: tuple[Path, Path], method: str, top_p: float) -> None:
    target, draft = tiny_pair
    options = {"dtype": "float32", "weight_format": "dense", "num_threads": 1, "kv_cache_memory_bytes": 2**24, "max_num_seqs": 256}
    # A prompt that repeats itself, so n-gram lookup finds a continuation at every step.
    prompt = [5, 40, 77, 101, 9, 63, 5, 40, 77, 101, 9, 63, 5, 40, 77]
    params = SamplingParams(max_tokens=4, temperature=1.0, top_p=top_p, ignore_eos=True)
    num_requests = 7000  # x 3 tokens after the prefill's: 21k tokens sampled through verification
    plain = LLM(str(target), seed=1, **options)
    spec = LLM(
        str(target), seed=2, **options,
        speculation=SpeculationConfig(methods=(method,), draft_model_path=str(draft)),
        policies=EnginePolicies(speculation=FixedSpeculationPolicy(3, method)),  # type: ignore[arg-type]
    )
    want = _samples(plain, prompt, params, num_requests)
    got = _samples(spec, prompt, params, num_requests)
    stats = spec.engine.scheduler
    assert stats.num_spec_draft_tokens > 0
    # Some proposals are rejected, some accepted: both paths of the rule are exercised.
    assert 0 < stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens
    # Output positions 2 and 3 come from verified proposals (accepted ones, corrections and
    # bonus tokens); position 0 is the prefill's, and 1 is always a plain draw from row 0.
    # One p-value per test: the smaller of the two, Bonferroni-corrected.
    p_values = [_two_sample_p_value([t[pos] for t in want], [t[pos] for t in got]) for pos in (2, 3)]
    assert 2 * min(p_values) > 0.01, f"p-values at positions 2, 3: {p_values}"
