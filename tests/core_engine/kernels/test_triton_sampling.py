"""Triton greedy pick and logits filter against the torch references."""

from __future__ import annotations

import pytest
import torch

from core_engine.kernels import (
    filter_logits,
    filter_logits_reference,
    greedy_sample,
    greedy_sample_reference,
)
from core_engine.kernels.triton_ops.sampling import filter_logits_triton, greedy_sample_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_sample(device: torch.device, dtype: torch.dtype) -> None:
    logits = (
        (torch.randn(4, 300, generator=torch.Generator().manual_seed(17)) * 4).to(dtype).to(device)
    )
    logits[1, 5] = logits[1, 290] = 40.0  # tie across vocabulary chunks: the first index wins
    logits[2, :] = -1e4
    logits[2, 299] = 0.0  # the very last token
    token_ids, logprobs = greedy_sample_triton(logits)
    expected_ids, expected_logprobs = greedy_sample_reference(logits)
    assert token_ids.dtype == torch.int64
    assert token_ids.tolist() == expected_ids.tolist()
    assert token_ids[1] == 5 and token_ids[2] == 299
    torch.testing.assert_close(logprobs.cpu(), expected_logprobs.cpu(), atol=1e-5, rtol=1e-5)
    assert torch.equal(greedy_sample(logits)[0], token_ids)


def _params(device: torch.device, vocab: int) -> tuple[torch.Tensor, ...]:
    temperature = torch.tensor([1.0, 0.7, 1.3, 0.5, 1.0, 2.0])
    top_k = torch.tensor([vocab, 5, 50, 1, 20, vocab + 9], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.3, 0.95, 0.8])
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.0, 0.1, 0.0])
    return tuple(t.to(device) for t in (temperature, top_k, top_p, min_p))


@pytest.mark.parametrize("block_v", [None, 64])  # 64: several chunks per row
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_filter_logits_keeps_exactly_the_reference_set(
    device: torch.device, dtype: torch.dtype, block_v: int | None
) -> None:
    vocab = 300
    gen = torch.Generator().manual_seed(19)
    logits = (torch.randn(6, vocab, generator=gen) * 3).to(dtype)
    logits[1, 7] = logits[1, 200] = 30.0  # a tie at the top
    logits[4, :40] = logits[4, 40:80]  # many ties inside the top-k boundary region
    logits[5, 10] = -float("inf")  # already banned tokens stay banned
    logits = logits.to(device)
    params = _params(device, vocab)
    out = filter_logits_triton(logits, *params, block_v=block_v)
    expected = filter_logits_reference(logits, *params)
    # The thresholds are exact, so the kept set and the kept values are identical.
    assert torch.equal(out.isfinite(), expected.isfinite())
    assert torch.equal(out, expected)
    assert out.isfinite().sum(dim=1)[0] == vocab
    assert torch.equal(filter_logits(logits, *params), out)


def test_filter_logits_on_values_spanning_many_magnitudes(device: torch.device) -> None:
    # Tiny and huge magnitudes and both signs stress the integer-key search.
    gen = torch.Generator().manual_seed(23)
    exponents = torch.randint(-30, 30, (4, 200), generator=gen).float()
    mags = (1 + torch.rand(4, 200, generator=gen)) * torch.pow(10.0, exponents)  # distinct values
    signs = torch.where(torch.rand(4, 200, generator=gen) < 0.5, -1.0, 1.0)
    logits = (mags * signs).clamp(-1e30, 1e30).to(device)
    temperature = torch.ones(4, device=device)
    top_k = torch.tensor([3, 17, 100, 199], dtype=torch.int32, device=device)
    top_p = torch.ones(4, device=device)
    min_p = torch.zeros(4, device=device)
    out = filter_logits_triton(logits, temperature, top_k, top_p, min_p, block_v=128)
    assert torch.equal(out, filter_logits_reference(logits, temperature, top_k, top_p, min_p))
    assert out.isfinite().sum(dim=1).tolist() == [3, 17, 100, 199]
