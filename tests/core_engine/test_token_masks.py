"""The token masks of constrained rows: how a bitmask becomes -inf logits, and when the mask
work overlaps the forward pass (core_engine/structured/masks.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from core_engine.sampling_params import SamplingParams
from core_engine.structured import StructuredOutput
from core_engine.structured.masks import apply_token_bitmask, overlaps_forward
from tests.core_engine.engine_util import make_engine, run_all


def allowed_by_bits(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The reference reading: bit i of word w allows token 32 w + i."""
    rows = [[bool((int(bitmask[r, t // 32]) >> (t % 32)) & 1) for t in range(vocab)] for r in range(bitmask.shape[0])]
    return torch.tensor(rows)


@pytest.mark.parametrize("vocab", [64, 100, 49152])
def test_forbidden_tokens_get_minus_infinity_and_allowed_ones_keep_their_logit(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=gen)
    bitmask[1] = -1  # everything allowed (bit 31, the sign bit, included)
    bitmask[2, 0] = -(2**31)  # only token 31 of the first word
    logits = torch.randn(3, vocab, generator=gen)
    logits[0, 0] = float("-inf")  # already impossible stays so
    out = apply_token_bitmask(logits, bitmask, fallback_ids=(0,))
    allowed = allowed_by_bits(bitmask, vocab) if vocab <= 100 else None
    if allowed is None:  # the big vocabulary: the same reading, vectorised
        shifts = torch.arange(32, dtype=torch.int32)
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(3, -1)[:, :vocab].bool()
    assert torch.equal(out[allowed], logits[allowed])
    assert bool((out[~allowed] == float("-inf")).all())
    assert bool(out[2, 31] == logits[2, 31])
    assert not bool(out.isnan().any())


def test_a_row_with_nothing_allowed_keeps_the_fallback_tokens() -> None:
    logits = torch.randn(2, 100)
    bitmask = torch.zeros((2, 4), dtype=torch.int32)
    bitmask[0] = -1
    given = bitmask.clone()
    out = apply_token_bitmask(logits, bitmask, fallback_ids=(2, 63, 95))
    assert torch.equal(out[0], logits[0])
    kept = (out[1] > float("-inf")).nonzero().squeeze(1).tolist()
    assert kept == [2, 63, 95]
    assert torch.equal(bitmask, given)  # the caller's mask is not changed


def test_masks_overlap_the_forward_only_where_it_leaves_a_core_free() -> None:
    cores = len(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(cores)
        assert not overlaps_forward(torch.device("cpu"))
        if cores > 1:
            torch.set_num_threads(cores - 1)
            assert overlaps_forward(torch.device("cpu"))
        assert overlaps_forward(torch.device("cuda"))  # an accelerator's forward leaves the CPU free
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("threads", ["all", "one fewer"])
def test_constrained_output_validates_whether_masks_overlap_the_forward_or_not(threads: str) -> None:
    from backends.default_model import default_model_path

    cores = len(os.sched_getaffinity(0))
    if threads == "one fewer" and cores == 1:
        pytest.fail("this test needs 2 cores to put the masks beside the forward")
    num = cores if threads == "all" else cores - 1
    before = torch.get_num_threads()
    try:
        engine = make_engine(Path(default_model_path()), num_threads=num)
        assert engine.model_runner.token_masks.overlap is (threads == "one fewer")
        schema = {"type": "object", "additionalProperties": False, "required": ["city", "year"],
                  "properties": {"city": {"type": "string", "maxLength": 20}, "year": {"type": "integer"}}}
        prompt = "<|im_start|>user\nName a city and the year it was founded, as JSON.<|im_end|>\n<|im_start|>assistant\n"
        params = {f"r{i}": SamplingParams(max_tokens=60, temperature=0.8, seed=i,
                                          structured_outputs=StructuredOutput(json=schema)) for i in range(4)}
        results = run_all(engine, {name: prompt for name in params}, params)
        for name in params:
            assert results[name]["final"].finish_reason == "stop", results[name]["text"]
            value = json.loads(results[name]["text"])
            assert set(value) == {"city", "year"} and isinstance(value["year"], int)
        assert len(engine.model_runner.token_masks.row_seconds) > 0
    finally:
        torch.set_num_threads(before)
