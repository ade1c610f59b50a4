"""KV-cache quantization (int8, fp8): incremental writes, accuracy on the real model, capacity,
and the engine's prefix caching, chunked prefill, preemption and speculation over int8 KV.

The accuracy figures are printed (``pytest -s``): teacher-forced top-1 agreement and mean
KL(fp || quantized) of the default model's next-token distributions over ~300 positions whose
attention reads the quantized cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from backends.default_model import default_model_path
from core_engine import kv_quant
from core_engine.config import EngineConfig, SpeculationConfig
from core_engine.kv_quant import dequantize, plan_kv_write, resolve_kv_cache_dtype, write_quantized
from core_engine.llm_engine import LLMEngine
from core_engine.paged_attention import KVCache, PagedAttention, build_attention_metadata
from core_engine.policy import EnginePolicies, FixedSpeculationPolicy
from core_engine.sampling_params import SamplingParams
from tests.core_engine.engine_util import engine_like, make_engine, run_all
from tests.core_engine.test_engine import PROMPTS, SYSTEM

CPU = torch.device("cpu")


def _fp8_supported(name: str) -> bool:
    try:
        resolve_kv_cache_dtype(name, torch.float32, "cpu")
    except ValueError:
        return False
    return True


QUANTIZED = ["int8"] + [name for name in ("fp8_e4m3", "fp8_e5m2") if _fp8_supported(name)]
#: Largest reconstruction error of a written value, as a fraction of its block's (and head's)
#: absolute maximum: one rounding to the final scale plus the re-encodings of scale growth.
RECONSTRUCTION_TOLERANCE = {"int8": 0.02, "fp8_e4m3": 0.125, "fp8_e5m2": 0.25}


# -- incremental writes (no model) ---------------------------------------------------------


class _Pool:
    """One layer's quantized pool and a dense copy of everything written, per token."""

    def __init__(self, name: str, *, num_blocks: int = 8, block_size: int = 4, num_kv_heads: int = 2, head_dim: int = 8) -> None:
        self.cache = KVCache(
            num_layers=1, num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
            head_dim=head_dim, dtype=torch.float32, cache_dtype=name,
        )
        self.block_size = block_size

    def write(self, slots: Sequence[int], key: Tensor, value: Tensor) -> None:
        c = self.cache
        assert c.scales is not None
        plan = plan_kv_write(torch.tensor(list(slots)), self.block_size)
        write_quantized(c.storage[0], c.scales[0], key, value, plan, c.quant)

    def read(self, slots: Sequence[int]) -> tuple[Tensor, Tensor]:
        c = self.cache
        assert c.scales is not None
        index = torch.tensor(list(slots))
        blocks = index // self.block_size
        keys = dequantize(c.k_slots[0][index], c.scales[0, 0][blocks], c.quant, torch.float32)
        values = dequantize(c.v_slots[0][index], c.scales[0, 1][blocks], c.quant, torch.float32)
        return keys, values

    def slots(self, table: Sequence[int], start: int, end: int) -> list[int]:
        return [table[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, end)]


def _relative_error(pool: _Pool, slots: list[int], keys: Tensor, values: Tensor) -> float:
    """Largest |error| over the amax of the block and head each value belongs to."""
    worst = 0.0
    got_k, got_v = pool.read(slots)
    blocks = torch.tensor(slots) // pool.block_size
    for got, want in ((got_k, keys), (got_v, values)):
        for b in blocks.unique():
            rows = blocks == b
            amax = want[rows].abs().amax(dim=(0, 2))  # (n_kv,)
            err = (got[rows] - want[rows]).abs().amax(dim=(0, 2))
            worst = max(worst, float((err / amax).max()))
    return worst


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize(
    "schedule",
    [[1] * 22, [7, 5, 8, 2], [3, 1, 1, 9, 1, 7]],
    ids=["decode-one-by-one", "chunks", "mixed"],
)
def test_incremental_writes_reconstruct_the_values(name: str, schedule: list[int]) -> None:
    # 22 tokens over six blocks of 4, in a shuffled block table; values grow along the
    # sequence, so a block's scale grows within it and its earlier codes are re-encoded.
    pool = _Pool(name)
    table = [5, 0, 3, 6, 1, 7]
    gen = torch.Generator().manual_seed(0)
    n = sum(schedule)
    growth = torch.linspace(0.2, 3.0, n).view(n, 1, 1)
    keys = torch.randn(n, 2, 8, generator=gen) * growth
    values = torch.randn(n, 2, 8, generator=gen) * growth
    pos = 0
    for count in schedule:
        pool.write(pool.slots(table, pos, pos + count), keys[pos : pos + count], values[pos : pos + count])
        pos += count
    error = _relative_error(pool, pool.slots(table, 0, n), keys, values)
    assert error <= RECONSTRUCTION_TOLERANCE[name], f"{name}: error {error:.4f} of the block range"


def test_a_growing_scale_re_encodes_the_codes_already_in_the_block() -> None:
    pool = _Pool("int8")
    small = torch.tensor([[0.5, -1.0, 0.25, 0.0, 0.1, 0.2, 0.3, -0.4]]).repeat(3, 2, 1)  # (3, 2, 8)
    pool.write([0, 1, 2], small, small)
    assert pool.cache.scales is not None
    assert torch.allclose(pool.cache.scales[0, :, 0], torch.full((2, 2), 1.0 / 127))
    big = small[:1] * 20  # amax 20: the scale grows 20x
    pool.write([3], big, big)
    assert torch.allclose(pool.cache.scales[0, :, 0], torch.full((2, 2), 20.0 / 127))
    keys, _ = pool.read([0, 1, 2, 3])
    # Within half a step of the new scale (plus half of the old one, the first rounding).
    assert (keys[:3] - small).abs().max() <= 0.5 * (20 + 1) / 127
    assert (keys[3] - big[0]).abs().max() <= 0.5 * 20 / 127
    # A smaller token later keeps the scale (scales never shrink within a block).
    pool.write([1], small[:1] * 0.1, small[:1] * 0.1)
    assert torch.allclose(pool.cache.scales[0, :, 0], torch.full((2, 2), 20.0 / 127))


def test_writing_offset_zero_starts_a_reused_block_afresh() -> None:
    pool = _Pool("int8")
    loud = torch.full((4, 2, 8), 100.0)
    pool.write([4, 5, 6, 7], loud, loud)  # block 1, full, scale 100/127
    quiet = torch.linspace(-0.01, 0.01, 16).view(2, 8).unsqueeze(0)  # (1, 2, 8)
    pool.write([4], quiet, quiet)  # the block is reused: offset 0 again
    assert pool.cache.scales is not None
    assert torch.allclose(pool.cache.scales[0, :, 1], torch.full((2, 2), 0.01 / 127))
    keys, values = pool.read([4])
    assert (keys - quiet).abs().max() <= 0.5 * 0.01 / 127 + 1e-9
    # The stale codes of the old content were cleared, not re-encoded into the new range.
    stale, _ = pool.read([5, 6, 7])
    assert stale.abs().max() <= 0.01 + 1e-6


def test_all_zero_tokens_keep_a_zero_scale_and_no_nan() -> None:
    pool = _Pool("int8")
    zeros = torch.zeros(2, 2, 8)
    pool.write([8, 9], zeros, zeros)
    assert pool.cache.scales is not None
    assert torch.equal(pool.cache.scales[0, :, 2], torch.zeros(2, 2))
    keys, values = pool.read([8, 9])
    assert torch.equal(keys, zeros) and torch.equal(values, zeros)
    ones = torch.ones(1, 2, 8)
    pool.write([10], ones, -ones)  # later tokens of the same block set the scale
    keys, values = pool.read([8, 9, 10])
    assert not keys.isnan().any() and torch.equal(keys[:2], zeros[:2])
    assert torch.allclose(keys[2], ones[0]) and torch.allclose(values[2], -ones[0])


def test_paged_attention_reads_the_quantized_cache_in_every_kind_of_step() -> None:
    # One step with a single-token decode, a 3-token (speculative) decode and a 3-token prefill
    # chunk over a cached prefix; its attention over int8 KV is close to the same over fp32 KV.
    n_kv, n_heads, head_dim, block_size = 2, 4, 16, 4
    cached = {"decode": 7, "multi": 6, "prefill": 8}  # tokens in the cache before the step
    new = {"decode": 1, "multi": 3, "prefill": 3}
    tables = {"decode": [3, 8], "multi": [0, 5, 9], "prefill": [2, 7, 4]}
    gen = torch.Generator().manual_seed(0)
    kv = {
        key: (torch.randn(n + new[key], n_kv, head_dim, generator=gen), torch.randn(n + new[key], n_kv, head_dim, generator=gen))
        for key, n in cached.items()
    }
    q = torch.randn(7, n_heads, head_dim, generator=gen)
    outs = {}
    for name in ("auto", "int8"):
        cache = KVCache(
            num_layers=1, num_blocks=10, block_size=block_size, num_kv_heads=n_kv, head_dim=head_dim,
            dtype=torch.float32, cache_dtype=name,
        )
        attn = PagedAttention(cache, num_heads=n_heads)
        for key, n in cached.items():  # the history: a first chunk of 4, then one over a prefix
            for start, end in ((0, 4), (4, n)):
                attn.prepare(build_attention_metadata(
                    block_size=block_size, decodes=[], prefills=[(start, end - start, tables[key])],
                    device=CPU, use_kernel=False,
                ))
                attn.forward(0, torch.zeros(end - start, n_heads, head_dim), kv[key][0][start:end], kv[key][1][start:end])
        attn.prepare(build_attention_metadata(
            block_size=block_size,
            decodes=[(cached["decode"], tables["decode"]), (cached["multi"], tables["multi"], 3)],
            prefills=[(cached["prefill"], 3, tables["prefill"])],
            device=CPU, use_kernel=False,
        ))
        new_k = torch.cat([kv[key][0][cached[key]:] for key in ("decode", "multi", "prefill")])
        new_v = torch.cat([kv[key][1][cached[key]:] for key in ("decode", "multi", "prefill")])
        outs[name] = attn.forward(0, q, new_k, new_v)
    assert not outs["int8"].isnan().any()
    torch.testing.assert_close(outs["int8"], outs["auto"], atol=0.03, rtol=0.0)


_KERNEL_SCRIPT = r"""
import sys
from core_engine.paged_attention import PagedAttention
from core_engine.sampling_params import SamplingParams
from tests.core_engine.engine_util import engine_like, make_engine, run_all
from tests.core_engine.gguf_factory import TinyLlamaSpec, write_llama_gguf

path = write_llama_gguf(sys.argv[1], spec=TinyLlamaSpec(num_layers=1))
prompts = {"a": [5, 6, 7], "b": list(range(3, 24)), "c": [40] * 17}
params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
torch_path = make_engine(path, kv_cache_dtype=sys.argv[2], max_num_batched_tokens=8)
kernel_path = engine_like(torch_path)
runner = kernel_path.model_runner
runner.attn = PagedAttention(runner.kv_cache, num_heads=kernel_path.model_config.num_heads, use_kernels=True)
want, got = run_all(torch_path, prompts, params), run_all(kernel_path, prompts, params)
for rid in prompts:
    assert got[rid]["token_ids"] == want[rid]["token_ids"], (rid, got[rid]["token_ids"], want[rid]["token_ids"])
print("quantized kernel path ok")
"""


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_engine_on_the_triton_decode_kernel_reads_the_quantized_cache(tmp_path: Path, name: str) -> None:
    # The CUDA path (Triton decode kernel dequantizing in its tile loop), run by the Triton
    # CPU interpreter in a child (TRITON_INTERPRET=1 must be set before triton loads).
    pytest.importorskip("triton", reason="the dev extra installs triton")
    if name not in QUANTIZED:
        pytest.skip(f"this torch cannot store {name} on the CPU")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root), "INFERMUX_KERNELS": "auto"}
    proc = subprocess.run(
        [sys.executable, "-c", _KERNEL_SCRIPT, str(tmp_path / "tiny.gguf"), name],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "quantized kernel path ok" in proc.stdout


# -- the pool: sizes, block moves, dtype checks ---------------------------------------------


def test_int8_blocks_cost_half_of_bf16_and_a_quarter_of_fp32() -> None:
    shape: dict[str, Any] = dict(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.float32)
    size = {name: KVCache.bytes_per_block(**shape, cache_dtype=name) for name in ("auto", "bfloat16", "int8")}
    assert size["bfloat16"] / size["int8"] >= 1.9
    assert size["auto"] / size["int8"] >= 3.9
    cache = KVCache(**shape, num_blocks=3, cache_dtype="int8")
    assert cache.block_nbytes == size["int8"] and cache.nbytes == 3 * size["int8"]


@pytest.mark.parametrize("name", ["auto", *QUANTIZED])
def test_gathered_blocks_scatter_back_to_the_same_values(name: str) -> None:
    cache = KVCache(
        num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32,
        cache_dtype=name,
    )
    x = torch.randn(8, 2, 8)
    for layer in range(2):  # blocks 0 and 1 of both layers
        if cache.scales is None:
            cache.k_slots[layer][:8], cache.v_slots[layer][:8] = x, -x
        else:
            write_quantized(cache.storage[layer], cache.scales[layer], x * (layer + 1), -x, plan_kv_write(torch.arange(8), 4), cache.quant)
    data, scales = cache.gather_blocks(torch.tensor([0, 1]))
    assert (scales is None) == (name == "auto")
    assert data.shape == (2, 2, 2, 4, 2, 8) and data.dtype == cache.storage.dtype
    nbytes = data.numel() * data.element_size() + (0 if scales is None else scales.numel() * 4)
    assert nbytes == 2 * cache.block_nbytes
    cache.scatter_blocks(torch.tensor([6, 3]), data.clone(), None if scales is None else scales.clone())
    assert torch.equal(cache.storage[:, :, [6, 3]], cache.storage[:, :, [0, 1]])
    if cache.scales is not None:
        assert torch.equal(cache.scales[:, :, [6, 3]], cache.scales[:, :, [0, 1]])
        with pytest.raises(ValueError, match="scales"):
            cache.scatter_blocks(torch.tensor([2]), data[:, :, :1], None)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_is_accepted_where_this_torch_casts_it_else_named_at_start_up(name: str) -> None:
    shape: dict[str, Any] = dict(num_layers=1, num_blocks=2, block_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    if _fp8_supported(name):
        cache = KVCache(**shape, cache_dtype=name)
        assert cache.storage.dtype == torch.uint8 and cache.quant.code_dtype.is_floating_point
    else:
        with pytest.raises(ValueError, match=f"kv_cache_dtype='{name}'"):
            KVCache(**shape, cache_dtype=name)


def test_an_fp8_cache_the_device_cannot_cast_is_refused_naming_kv_cache_dtype(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A torch without float8 casts on the device cannot be had here: stand its probe in.
    monkeypatch.setattr(kv_quant, "_fp8_round_trips", lambda code_dtype, device: False)
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8_e4m3'.*use 'int8'"):
        KVCache(num_layers=1, num_blocks=2, block_size=4, num_kv_heads=1, head_dim=8,
                dtype=torch.float32, cache_dtype="fp8_e4m3")


def test_an_unknown_kv_cache_dtype_is_refused_by_the_config() -> None:
    with pytest.raises(ValueError, match="EngineConfig.kv_cache_dtype"):
        EngineConfig(model_path="m.gguf", kv_cache_dtype="int4")  # type: ignore[arg-type]


# -- the real model -------------------------------------------------------------------------

#: ~320 tokens of plain prose for teacher forcing.
TEXT = (
    "The history of the lighthouse on the northern cape begins in 1852, when a merchant ship "
    "carrying grain and timber ran aground on the rocks below the cliffs during a winter storm. "
    "The crew of fourteen was rescued by fishermen from the village, who rowed out through the "
    "breaking waves in two small boats. After the accident, the harbour council asked the "
    "government for a light, and the first tower, built of local granite, was finished six "
    "years later. Its lamp burned whale oil and could be seen from twelve miles away on a clear "
    "night. The keeper lived in a small cottage at the foot of the tower with his wife and three "
    "children, and every evening at sunset he climbed the ninety-two steps to light the lamp and "
    "wind the clockwork that turned the lens. In 1904 the oil lamp was replaced by a paraffin "
    "burner, and in 1931 the station was connected to the electric grid. The last keeper left in "
    "1987, when the light became automatic. Today the cottage is a small museum. Visitors can see "
    "the keeper's logbooks, which record the weather, passing ships and the hours the lamp was "
    "lit, as well as a collection of photographs of the village and its fishing fleet. On summer "
    "weekends volunteers guide groups up the stairs to the lantern room, where the view reaches "
    "across the bay to the islands in the west. The walk from the village car park to the "
    "lighthouse takes about forty minutes along the cliff path, which is steep in places and can "
    "be slippery after rain, so good shoes are recommended."
)
#: Per kv_cache_dtype: (least top-1 agreement, largest mean KL) with fp32 KV. int8 is the
#: contract (measured 98.1% / 0.0015); the fp8 bounds are what the dev machine measured
#: (e4m3 96.8% / 0.0051, e5m2 91.4% / 0.019) plus a margin for other CPUs.
ACCURACY_BOUNDS = {"int8": (0.97, 0.01), "fp8_e4m3": (0.93, 0.015), "fp8_e5m2": (0.85, 0.05)}
#: A greedy divergence from fp KV is allowed only where fp's two best tokens were this close
#: (int8 KV moved a logit gap of 0.33 nats on a Sapphire Rapids, 2026-12-02; 0.3 held on AVX2).
NEAR_TIE_NATS = 0.5


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return make_engine(default_model_path())


def _teacher_forced_logits(engine: LLMEngine, token_ids: list[int], cache_dtype: str) -> Tensor:
    """(len - first chunk, vocab) logits of every position after the first chunk, fed through
    PagedAttention as prefill chunks over a cached prefix, then single-token decodes, so that
    attention reads the (quantized) cache at every measured position."""
    model = engine.model_runner.model
    config = engine.model_config
    block_size = 16
    num_blocks = -(-len(token_ids) // block_size) + 1
    cache = KVCache(
        num_layers=config.num_layers, num_blocks=num_blocks, block_size=block_size,
        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=torch.float32,
        cache_dtype=cache_dtype,
    )
    attn = PagedAttention(cache, num_heads=config.num_heads)
    blocks = list(range(num_blocks))[::-1]
    n = len(token_ids)
    # 8 tokens (no prefix), chunks of 12 (straddling blocks), then decodes. Each forward
    # reads all weights once, so fewer, longer chunks keep the test short.
    sizes = [8] + [12] * ((n - 8 - 20) // 12)
    sizes += [1] * (n - sum(sizes))
    logits: list[Tensor] = []
    pos = 0
    with torch.inference_mode():
        for size in sizes:
            if size == 1:
                md = build_attention_metadata(block_size=block_size, decodes=[(pos, blocks)], prefills=[], device=CPU, use_kernel=False)
            else:
                md = build_attention_metadata(block_size=block_size, decodes=[], prefills=[(pos, size, blocks)], device=CPU, use_kernel=False)
            attn.prepare(md)
            out = model(
                torch.tensor(token_ids[pos : pos + size]), torch.arange(pos, pos + size), attn,
                logits_indices=torch.arange(size),
            )
            if pos > 0:
                logits.append(out.float())
            pos += size
    return torch.cat(logits)


@pytest.fixture(scope="module")
def fp_logits(engine: LLMEngine) -> tuple[list[int], Tensor]:
    ids = engine.tokenizer.encode(TEXT, add_special=True, parse_special=True)
    return ids, _teacher_forced_logits(engine, ids, "auto")


@pytest.mark.slow
@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized_kv_keeps_the_next_token_distribution(
    engine: LLMEngine, fp_logits: tuple[list[int], Tensor], name: str
) -> None:
    ids, reference = fp_logits
    quantized = _teacher_forced_logits(engine, ids, name)
    assert reference.shape[0] >= 256
    top1 = float((reference.argmax(-1) == quantized.argmax(-1)).float().mean())
    log_p, log_q = reference.log_softmax(-1), quantized.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # (positions,)
    print(
        f"\n{name} KV vs fp32 KV over {reference.shape[0]} positions: top-1 {top1:.2%}, "
        f"mean KL {float(kl.mean()):.5f}, max KL {float(kl.max()):.4f}"
    )
    min_top1, max_kl = ACCURACY_BOUNDS[name]
    assert top1 >= min_top1 and float(kl.mean()) <= max_kl


@pytest.mark.slow
def test_int8_holds_about_twice_the_blocks_of_bf16_in_the_same_memory(engine: LLMEngine) -> None:
    bf16 = engine_like(engine, kv_cache_dtype="bfloat16")
    int8 = engine_like(engine, kv_cache_dtype="int8")
    print(f"\nblocks in {engine.config.kv_cache_memory_bytes >> 20} MiB: fp32 {engine.num_blocks}, "
          f"bf16 {bf16.num_blocks}, int8 {int8.num_blocks} ({int8.num_blocks / bf16.num_blocks:.3f}x bf16)")
    assert int8.num_blocks >= 1.9 * bf16.num_blocks
    assert int8.num_blocks >= 3.9 * engine.num_blocks
    # bf16 storage under fp32 compute runs too (values converted on write and read).
    out = run_all(bf16, {"france": PROMPTS["france"]}, _greedy(8))
    assert "Paris" in str(out["france"]["text"])


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)


def _assert_agrees_with_fp(got: dict[str, dict[str, object]], fp: dict[str, dict[str, object]]) -> None:
    """Each greedy output equals fp KV's until a point where fp's two best tokens were within
    ``NEAR_TIE_NATS`` (and took the runner-up there); most tokens agree overall."""
    agreed = total = 0
    for req_id, want in fp.items():
        a, b = list(want["token_ids"]), list(got[req_id]["token_ids"])  # type: ignore[call-overload]
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        agreed, total = agreed + n, total + len(a)
        if n < len(a):
            lps = [lp for out in want["outputs"] for lp in out.logprobs]  # type: ignore[attr-defined]
            (best, lp_best), (second, lp_second) = lps[n].top[:2]
            assert b[n] == second and lp_best - lp_second < NEAR_TIE_NATS, (
                f"{req_id}: token {n} is {b[n]}, fp's top two were {lps[n].top}"
            )
    assert agreed >= 0.5 * total, f"only {agreed} of {total} greedy tokens agree with fp KV"


@pytest.mark.slow
def test_int8_engine_with_prefix_caching_and_chunked_prefill_agrees_with_fp(engine: LLMEngine) -> None:
    prompts: dict[str, str | list[int]] = {**PROMPTS, "hut": SYSTEM + "\nQuestion: when is dinner?\nAnswer:"}
    fp = run_all(engine, prompts, _greedy(16))
    int8 = engine_like(engine, kv_cache_dtype="int8")
    cold = run_all(int8, prompts, _greedy(16))
    assert "Paris" in str(cold["france"]["text"])
    _assert_agrees_with_fp(cold, fp)
    # The same prompt again reads its prefix from the quantized blocks.
    warm = run_all(int8, {"hut": prompts["hut"]}, _greedy(16))
    assert warm["hut"]["final"].num_cached_tokens > 0  # type: ignore[attr-defined]
    _assert_agrees_with_fp(warm, {"hut": fp["hut"]})
    # Chunks of 8 tokens: every chunk after the first attends over quantized context.
    chunked = engine_like(engine, kv_cache_dtype="int8", max_num_batched_tokens=8)
    some: dict[str, str | list[int]] = {key: prompts[key] for key in ("hut", "france")}
    _assert_agrees_with_fp(run_all(chunked, some, _greedy(16)), {key: fp[key] for key in some})
    assert int8.num_free_blocks == int8.num_blocks and chunked.num_free_blocks == chunked.num_blocks


@pytest.mark.slow
def test_int8_engine_under_preemption_in_a_tiny_pool_agrees_with_fp(engine: LLMEngine) -> None:
    block = KVCache.bytes_per_block(
        num_layers=engine.model_config.num_layers, block_size=16, num_kv_heads=engine.model_config.num_kv_heads,
        head_dim=engine.model_config.head_dim, dtype=torch.float32, cache_dtype="int8",
    )
    # 10 blocks = 160 tokens for four requests of ~10 prompt + 32 output tokens each.
    small = engine_like(engine, kv_cache_dtype="int8", kv_cache_memory_bytes=10 * block, enable_prefix_caching=False)
    assert small.num_blocks == 10
    prompts: dict[str, str | list[int]] = dict(PROMPTS)
    results = run_all(small, prompts, _greedy(32))
    assert small.scheduler.num_preemptions > 0
    _assert_agrees_with_fp(results, run_all(engine, prompts, _greedy(32)))
    assert small.num_free_blocks == small.num_blocks


@pytest.mark.slow
def test_int8_engine_with_speculative_multi_token_decodes_agrees_with_fp(engine: LLMEngine) -> None:
    spec = engine_like(engine, kv_cache_dtype="int8", speculation=SpeculationConfig(methods=("ngram",)))
    spec.use_policies(EnginePolicies(speculation=FixedSpeculationPolicy(4, "ngram")))  # type: ignore[arg-type]
    prompts: dict[str, str | list[int]] = {
        "code": "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
        "cats": "the cat sat on the mat, the cat sat on the mat, the cat sat on the mat, the cat",
    }
    results = run_all(spec, prompts, _greedy(24))
    finals = [r["final"] for r in results.values()]
    assert sum(f.speculation.num_accepted_tokens for f in finals) > 0  # type: ignore[attr-defined]
    _assert_agrees_with_fp(results, run_all(engine, prompts, _greedy(24)))
    assert spec.num_free_blocks == spec.num_blocks
