"""PagedAttention on the Triton kernels with per-layer attention variants (interpreter or
CUDA): a scale alone runs in the Triton decode kernel; a window or soft-cap, which it does not
take, decodes on the torch path over the gather the context builds from the block tables."""

from __future__ import annotations

import pytest
import torch
from kernel_case import assert_close, reference_attention

from core_engine.attention import LayerAttention
from core_engine.paged_attention import KVCache, PagedAttention, build_attention_metadata

N_HEADS, N_KV, HEAD_DIM, BLOCK_SIZE = 4, 2, 16, 4
#: (num_cached, num_new, blocks): two single-token decodes, then a prefill over a prefix.
SEQS = [(13, 1, [3, 8, 1, 12]), (6, 1, [0, 5]), (9, 5, [4, 9, 10, 11])]


@pytest.mark.parametrize(
    "spec",
    [
        LayerAttention(scale=0.1),
        LayerAttention(window=3),
        LayerAttention(softcap=1.0),
        LayerAttention(scale=0.1, window=8, softcap=1.0),
    ],
    ids=["scale", "window", "softcap", "all"],
)
def test_paged_attention_on_the_kernels_honours_the_layer_spec(device: torch.device, spec: LayerAttention) -> None:
    cache = KVCache(
        num_layers=1, num_blocks=14, block_size=BLOCK_SIZE, num_kv_heads=N_KV, head_dim=HEAD_DIM,
        dtype=torch.float32, device=device,
    )
    attn = PagedAttention(cache, num_heads=N_HEADS, use_kernels=True)
    assert attn.uses_kernel
    kernel = attn._decode_kernel
    assert kernel is not None
    kernel_calls: list[int] = []

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        kernel_calls.append(1)
        return kernel(*args, **kwargs)

    attn._decode_kernel = counted  # a spy: which path the decodes took
    gen = torch.Generator().manual_seed(3)
    kv = []
    for num_cached, num_new, blocks in SEQS:
        k = torch.randn(num_cached + num_new, N_KV, HEAD_DIM, generator=gen).to(device)
        v = torch.randn(num_cached + num_new, N_KV, HEAD_DIM, generator=gen).to(device)
        kv.append((k, v))
        attn.prepare(build_attention_metadata(
            block_size=BLOCK_SIZE, decodes=[], prefills=[(0, num_cached, blocks)], device=device, use_kernel=True,
        ))
        attn.forward(0, torch.zeros(num_cached, N_HEADS, HEAD_DIM, device=device), k[:num_cached], v[:num_cached], spec)
    kernel_calls.clear()
    attn.prepare(build_attention_metadata(
        block_size=BLOCK_SIZE, decodes=[(n, b) for n, _, b in SEQS[:2]], prefills=[SEQS[2]], device=device,
        use_kernel=True,
    ))
    q = torch.randn(7, N_HEADS, HEAD_DIM, generator=gen).to(device)
    new_k = torch.cat([k[n:] for (n, _, _), (k, _) in zip(SEQS, kv, strict=True)])
    new_v = torch.cat([v[n:] for (n, _, _), (_, v) in zip(SEQS, kv, strict=True)])
    got = attn.forward(0, q, new_k, new_v, spec)
    assert bool(kernel_calls) == (spec.window is None and spec.softcap is None)
    want, row = [], 0
    for (num_cached, num_new, _), (k, v) in zip(SEQS, kv, strict=True):
        positions = torch.arange(num_cached, num_cached + num_new)
        want.append(reference_attention(q[row : row + num_new].cpu(), k.cpu(), v.cpu(), positions, spec))
        row += num_new
    assert_close(got, torch.cat(want), torch.float32)
