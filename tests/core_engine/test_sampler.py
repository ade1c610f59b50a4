"""The sampler on hand-made logits: each parameter does what a user expects, per row."""

from __future__ import annotations

import pytest
import torch

from core_engine.errors import InvalidParamError
from core_engine.sampler import Sampler, SamplingMetadata, compute_prompt_logprobs
from core_engine.sampling_params import SamplingParams
from tests.core_engine.sim import make_request

V = 50


def requests(*params: SamplingParams, outputs: list[list[int]] | None = None):
    reqs = []
    for i, p in enumerate(params):
        r = make_request([1, 2, 3], params=p, max_tokens=10)
        if p.seed is not None:
            r.generator = torch.Generator().manual_seed(p.seed)
        for t in (outputs[i] if outputs else []):
            r.append_output_token(t)
        reqs.append(r)
    return reqs


def sample(logits: torch.Tensor, reqs) -> list[int]:
    return Sampler()(logits, SamplingMetadata.from_requests(reqs, V, logits.device)).sampled_token_ids


def peaked(*peaks: int) -> torch.Tensor:
    logits = torch.zeros(len(peaks), V)
    for row, peak in enumerate(peaks):
        logits[row, peak] = 5.0
    return logits


def test_greedy_rows_take_the_argmax_next_to_random_rows() -> None:
    logits = torch.randn(3, V)
    reqs = requests(SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=0))
    out = sample(logits, reqs)
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())


def test_same_seed_same_tokens_whatever_shares_the_batch() -> None:
    logits = torch.randn(1, V)
    seeded = SamplingParams(temperature=1.5, seed=1234)
    gen_alone = requests(seeded)
    draws_alone = [sample(logits, gen_alone)[0] for _ in range(20)]
    gen_batched = requests(SamplingParams(temperature=1.0), seeded, SamplingParams(temperature=0))
    batch_logits = torch.cat([torch.randn(1, V), logits, torch.randn(1, V)])
    draws_batched = [sample(batch_logits, gen_batched)[1] for _ in range(20)]
    assert draws_alone == draws_batched
    assert len(set(draws_alone)) > 1  # it really samples


def test_different_seeds_differ() -> None:
    logits = torch.zeros(1, V)
    a = requests(SamplingParams(seed=1))
    b = requests(SamplingParams(seed=2))
    assert [sample(logits, a)[0] for _ in range(10)] != [sample(logits, b)[0] for _ in range(10)]


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = torch.randn(2, V)
    reqs = requests(SamplingParams(top_k=1, seed=0), SamplingParams(top_p=1e-6, seed=0))
    for _ in range(10):
        assert sample(logits, reqs) == logits.argmax(dim=-1).tolist()


def test_top_k_keeps_only_the_k_best() -> None:
    logits = torch.arange(V, dtype=torch.float32).unsqueeze(0) / 10  # token V-1 best
    reqs = requests(SamplingParams(top_k=3, temperature=5.0, seed=0))
    seen = {sample(logits, reqs)[0] for _ in range(60)}
    assert seen == {V - 1, V - 2, V - 3}


def test_top_p_keeps_the_nucleus() -> None:
    logits = torch.full((1, V), -10.0)
    logits[0, 7], logits[0, 8], logits[0, 9] = 2.0, 2.0, 0.0  # ~0.47, 0.47, 0.06
    reqs = requests(SamplingParams(top_p=0.9, seed=0))
    assert {sample(logits, reqs)[0] for _ in range(60)} == {7, 8}


def test_min_p_drops_unlikely_tokens() -> None:
    logits = torch.full((1, V), 0.0)
    logits[0, 3] = 4.0  # others have p/p_max = e^-4 < 0.1
    reqs = requests(SamplingParams(min_p=0.1, seed=0))
    assert {sample(logits, reqs)[0] for _ in range(30)} == {3}


def test_repetition_penalty_discourages_seen_tokens() -> None:
    logits = peaked(2)  # token 2 is in the prompt [1, 2, 3]
    logits[0, 10] = 4.0
    reqs = requests(SamplingParams(temperature=0, repetition_penalty=2.0))
    assert sample(logits, reqs) == [10]
    assert sample(logits, requests(SamplingParams(temperature=0))) == [2]


def test_presence_and_frequency_penalties_apply_to_output_tokens() -> None:
    logits = peaked(20)
    logits[0, 21] = 3.5
    reqs = requests(
        SamplingParams(temperature=0, presence_penalty=2.0),
        SamplingParams(temperature=0, frequency_penalty=0.5),
        SamplingParams(temperature=0, frequency_penalty=0.5),
        outputs=[[20], [20], [20, 20, 20, 20]],
    )
    out = sample(torch.cat([logits] * 3), reqs)
    assert out == [21, 20, 21]  # 5-2 < 3.5; 5-0.5 > 3.5; 5-2 < 3.5


def test_logprobs_are_the_model_distribution_with_sorted_alternatives() -> None:
    logits = torch.randn(2, V)
    reqs = requests(SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0))
    out = Sampler()(logits, SamplingMetadata.from_requests(reqs, V, logits.device))
    ref = logits.log_softmax(-1)
    record = out.logprobs[0]
    assert record.token_id == int(logits[0].argmax())
    assert record.logprob == pytest.approx(float(ref[0].max()), abs=1e-5)
    assert [t for t, _ in record.top] == ref[0].topk(3).indices.tolist()
    assert out.logprobs[1] is None


def test_prompt_logprobs() -> None:
    logits = torch.randn(4, V)
    targets = [5, 6, 7, 8]
    recs = compute_prompt_logprobs(logits, targets, 2)
    ref = logits.log_softmax(-1)
    assert [r.token_id for r in recs] == targets
    assert recs[2].logprob == pytest.approx(float(ref[2, 7]), abs=1e-5)
    assert len(recs[0].top) == 2


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ("",)}, "stop"),
        ({"temperature": float("nan")}, "temperature"),
    ],
)
def test_invalid_params_name_the_parameter(kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidParamError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
