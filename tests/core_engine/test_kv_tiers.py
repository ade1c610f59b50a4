"""KV tiers (device -> host -> disk) through the real engine: restores instead of recompute,
identical outputs, restarts, bad files, a full or read-only disk, tenant quotas, and the
offload policy the engine consults each step.

Mechanism tests use a tiny random-weight GGUF (fast); the working-set test uses the default
model (SmolLM2-135M) with 1k-token prefixes.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from backends.default_model import default_model_path
from core_engine.kv_cache_manager import hash_block_tokens
from core_engine.kv_offload.block_copy import tier_block_nbytes
from core_engine.kv_offload.block_file import block_file_id
from core_engine.kv_offload.disk_store import SECRET_NAME, disk_tier_secret
from core_engine.llm_engine import LLMEngine
from core_engine.output import RequestOutput
from core_engine.policy import KVOffloadContext, KVOffloadDecision
from core_engine.sampling_params import SamplingParams
from tests.core_engine.engine_util import engine_like, make_engine
from tests.core_engine.gguf_factory import TinyLlamaSpec, write_llama_gguf

BS = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama_gguf(
        tmp_path_factory.mktemp("tiny") / "tiny.gguf", spec=TinyLlamaSpec(context_length=2048)
    )


@pytest.fixture(scope="module")
def tiny(tiny_path: Path) -> LLMEngine:
    return make_engine(tiny_path, kv_cache_memory_bytes=2**20)


def block_bytes(engine: LLMEngine) -> int:
    return tier_block_nbytes(engine.model_runner.kv_cache)


def like(engine: LLMEngine, *, device_blocks: int, **overrides: object) -> LLMEngine:
    return engine_like(engine, kv_cache_memory_bytes=device_blocks * block_bytes(engine), **overrides)


def make_prompts(n: int, length: int, seed: int, vocab: int = 200) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def generate(
    engine: LLMEngine, prompt: list[int], *, tenant: str | None = None, params: SamplingParams = GREEDY
) -> tuple[list[int], RequestOutput]:
    req_id = f"r{generate.counter}"  # type: ignore[attr-defined]
    generate.counter += 1  # type: ignore[attr-defined]
    engine.add_request(req_id, engine.make_request(req_id, prompt, params, tenant=tenant))
    tokens: list[int] = []
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            if out.finished:
                final = out
    assert final is not None
    return tokens, final


generate.counter = 0  # type: ignore[attr-defined]


def two_rounds(engine: LLMEngine, prefixes: list[list[int]]) -> list[tuple[list[int], RequestOutput]]:
    """Each prefix with a first suffix, then each again with a second suffix."""
    return [generate(engine, p + [1 + rnd]) for rnd in range(2) for p in prefixes]


def tier_files(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*.kv"))


def block_file(directory: Path, prefix: list[int], block_index: int) -> Path:
    h = None
    for i in range(block_index + 1):
        h = hash_block_tokens(h, prefix[i * BS : (i + 1) * BS])
    assert h is not None
    name = f"{block_file_id(disk_tier_secret(directory), h).hex()}.kv"  # names are keyed
    (path,) = [p for p in tier_files(directory) if p.name == name]
    return path


# -- host tier ---------------------------------------------------------------------------


def test_host_tier_brings_evicted_prefixes_back_with_identical_outputs(tiny: LLMEngine) -> None:
    prefixes = make_prompts(8, 4 * BS, seed=1)  # 8 x 4 blocks against a pool of 10 blocks
    off = two_rounds(like(tiny, device_blocks=10), prefixes)
    engine = like(tiny, device_blocks=10, kv_host_memory_bytes=64 * block_bytes(tiny))
    on = two_rounds(engine, prefixes)
    assert [t for t, _ in on] == [t for t, _ in off]
    # Without tiers the second round found nothing (each prefix was evicted by the others);
    # with them every prefix came back from host memory, none recomputed.
    assert all(out.num_cached_tokens == 0 for _, out in off)
    for _, out in on[8:]:
        assert out.num_cached_tokens == 4 * BS
        assert out.cached_tokens_by_tier == {"host": 4 * BS}
    stats = engine.tiers.stats()
    assert stats["kv_hit_tokens:host"] == 8 * 4 * BS
    assert stats["kv_restored_blocks:host"] == 8 * 4
    assert stats["kv_bytes_moved:host_to_device"] == 8 * 4 * block_bytes(tiny)
    assert stats["kv_bytes_moved:device_to_host"] >= 8 * 4 * block_bytes(tiny)


def test_host_tier_is_lru_and_bounded(tiny: LLMEngine) -> None:
    prefixes = make_prompts(8, 4 * BS, seed=2)
    engine = like(tiny, device_blocks=10, kv_host_memory_bytes=12 * block_bytes(tiny))  # 3 prefixes
    for p in prefixes:
        generate(engine, p + [1])
    assert engine.tiers.host.num_blocks <= 12
    # The oldest prefixes fell out of host memory; the most recently evicted are there.
    _, first = generate(engine, prefixes[0] + [2])
    assert first.num_cached_tokens == 0
    _, recent = generate(engine, prefixes[5] + [2])
    assert recent.cached_tokens_by_tier == {"host": 4 * BS}


# -- disk tier ---------------------------------------------------------------------------


def test_disk_tier_alone_serves_evicted_prefixes(tiny: LLMEngine, tmp_path: Path) -> None:
    prefixes = make_prompts(6, 4 * BS, seed=3)
    off = two_rounds(like(tiny, device_blocks=10), prefixes)
    engine = like(tiny, device_blocks=10, kv_disk_dir=str(tmp_path))
    on = two_rounds(engine, prefixes)
    assert [t for t, _ in on] == [t for t, _ in off]
    for _, out in on[6:]:
        assert out.cached_tokens_by_tier == {"disk": 4 * BS}
    engine.close()
    assert len(tier_files(tmp_path)) >= 6 * 4


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_a_restarted_engine_reads_the_disk_tier(tiny: LLMEngine, tmp_path: Path, kv_dtype: str) -> None:
    prefixes = make_prompts(3, 4 * BS, seed=4)
    first = like(tiny, device_blocks=64, kv_disk_dir=str(tmp_path), kv_cache_dtype=kv_dtype)
    before = [generate(first, p + [1]) for p in prefixes]
    first.close()  # the shutdown path: queued writes reach the disk
    # Another KV dtype is another layout: its blocks live apart and are never mixed up.
    other = like(tiny, device_blocks=64, kv_disk_dir=str(tmp_path), kv_cache_dtype="int8" if kv_dtype == "auto" else "auto")
    assert generate(other, prefixes[0] + [1])[1].num_cached_tokens == 0
    other.close()
    second = like(tiny, device_blocks=64, kv_disk_dir=str(tmp_path), kv_cache_dtype=kv_dtype)
    after = [generate(second, p + [1]) for p in prefixes]
    assert [t for t, _ in after] == [t for t, _ in before]
    for _, out in after:
        assert out.cached_tokens_by_tier == {"disk": 4 * BS}
    second.close()


def test_blocks_computed_with_other_weight_formats_are_not_restored(tiny_path: Path, tmp_path: Path) -> None:
    # The disk key holds the weights' storage: the KV of int8 weights differs from dense's.
    prompt = make_prompts(1, 4 * BS, seed=6)[0] + [1]

    def restarted(weight_format: str) -> RequestOutput:
        engine = make_engine(tiny_path, weight_format=weight_format, kv_cache_memory_bytes=2**20, kv_disk_dir=str(tmp_path))
        try:
            return generate(engine, prompt)[1]
        finally:
            engine.close()

    assert restarted("dense").num_cached_tokens == 0
    assert restarted("int8").num_cached_tokens == 0  # another format: its own blocks
    assert restarted("dense").cached_tokens_by_tier == {"disk": 4 * BS}
    assert restarted("int8").cached_tokens_by_tier == {"disk": 4 * BS}


def test_bad_files_are_detected_and_recomputed(tiny: LLMEngine, tiny_path: Path, tmp_path: Path) -> None:
    prefixes = make_prompts(4, 4 * BS, seed=5)
    disk = tmp_path / "kv"
    writer = like(tiny, device_blocks=64, kv_disk_dir=str(disk))
    expected = [generate(writer, p + [1])[0] for p in prefixes]
    writer.close()
    # Flip a payload byte of prefix 0's block 1, truncate prefix 1's block 2, and swap the
    # names of prefix 2's blocks 0 and 3.
    corrupt = block_file(disk, prefixes[0], 1)
    data = bytearray(corrupt.read_bytes())
    data[-100] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    truncated = block_file(disk, prefixes[1], 2)
    truncated.write_bytes(truncated.read_bytes()[:-4096])
    a, b = block_file(disk, prefixes[2], 0), block_file(disk, prefixes[2], 3)
    a.rename(tmp_path / "swap")
    b.rename(a)
    (tmp_path / "swap").rename(b)

    reader = like(tiny, device_blocks=64, kv_disk_dir=str(disk))
    results = [generate(reader, p + [1]) for p in prefixes]
    assert [t for t, _ in results] == expected
    cached = [out.num_cached_tokens for _, out in results]
    # Each prefix is served up to its first bad block and recomputed from there.
    assert cached == [1 * BS, 2 * BS, 0, 4 * BS]
    stats = reader.tiers.stats()
    assert stats["kv_disk_invalid_blocks"] >= 3
    reader.close()


def test_files_of_another_model_file_are_never_used(tiny: LLMEngine, tiny_path: Path, tmp_path: Path) -> None:
    # Same weights, a different file: outputs are the same, so only the fingerprint can tell.
    other_path = tmp_path / "other.gguf"
    other_path.write_bytes(tiny_path.read_bytes() + b"\0" * 64)
    other = engine_like(
        tiny, model_path=str(other_path), kv_cache_memory_bytes=64 * block_bytes(tiny), kv_disk_dir=str(tmp_path / "b")
    )
    prefixes = make_prompts(2, 4 * BS, seed=6)
    writer = like(tiny, device_blocks=64, kv_disk_dir=str(tmp_path / "a"))
    expected = [generate(writer, p + [1])[0] for p in prefixes]
    writer.close()
    # Copy model A's block files into model B's folder, under their own names.
    (model_b_dir,) = [d for d in (tmp_path / "b").iterdir() if d.is_dir()]
    for path in tier_files(tmp_path / "a"):
        shutil.copy(path, model_b_dir / path.name)
    shutil.copy(tmp_path / "a" / SECRET_NAME, tmp_path / "b" / SECRET_NAME)  # one installation
    other.close()  # the store indexes files at start: open B again to see the copies
    other = engine_like(other, kv_disk_dir=str(tmp_path / "b"))
    results = [generate(other, p + [1]) for p in prefixes]
    assert [t for t, _ in results] == expected
    assert all(out.num_cached_tokens == 0 for _, out in results)
    assert other.tiers.stats()["kv_disk_invalid_blocks"] >= 2
    other.close()


def _tier_off_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "KV disk tier off" in r.getMessage()]


def test_a_disk_budget_below_one_block_turns_the_tier_off_once(
    tiny: LLMEngine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    engine = like(tiny, device_blocks=10, kv_disk_dir=str(tmp_path), kv_disk_bytes=100)
    prefixes = make_prompts(4, 4 * BS, seed=7)
    expected = two_rounds(like(tiny, device_blocks=10), prefixes)
    assert [t for t, _ in two_rounds(engine, prefixes)] == [t for t, _ in expected]
    assert len(_tier_off_records(caplog)) == 1
    assert engine.tiers.stats()["kv_disk_enabled"] == 0.0
    engine.close()


@pytest.fixture()
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory the engine cannot write to, even as root (a read-only bind mount)."""
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o555)
        yield d
        d.chmod(0o755)
        return
    subprocess.run(["mount", "--bind", str(d), str(d)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(d)], check=True)
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=False)


def test_a_read_only_disk_tier_directory_keeps_the_engine_serving(
    tiny: LLMEngine, read_only_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    engine = like(tiny, device_blocks=10, kv_disk_dir=str(read_only_dir), kv_host_memory_bytes=16 * block_bytes(tiny))
    prefixes = make_prompts(4, 4 * BS, seed=8)
    expected = two_rounds(like(tiny, device_blocks=10), prefixes)
    assert [t for t, _ in two_rounds(engine, prefixes)] == [t for t, _ in expected]
    assert len(_tier_off_records(caplog)) == 1
    # The host tier still works without the disk.
    assert engine.tiers.stats()["kv_hit_tokens:host"] > 0
    engine.close()


@pytest.fixture()
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs: writes fail with ENOSPC once it is full."""
    d = tmp_path / "full"
    d.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(d)], check=False)
    if mounted.returncode != 0:
        pytest.skip("this machine refused to mount a tmpfs")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=False)


def test_a_full_disk_turns_the_tier_off_once_and_the_engine_keeps_serving(
    tiny: LLMEngine, tiny_tmpfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    engine = like(tiny, device_blocks=10, kv_disk_dir=str(tiny_tmpfs))  # budget 8 GiB, disk 256 KiB
    prefixes = make_prompts(12, 4 * BS, seed=9)  # 48 blocks of ~8 KiB: more than the tmpfs holds
    expected = two_rounds(like(tiny, device_blocks=10), prefixes)
    assert [t for t, _ in two_rounds(engine, prefixes)] == [t for t, _ in expected]
    engine.close()
    assert len(_tier_off_records(caplog)) == 1
    assert engine.tiers.stats()["kv_disk_write_errors"] >= 1


# -- tenant quota ------------------------------------------------------------------------


@pytest.mark.parametrize("quota", [None, 0.5])
def test_one_tenant_cannot_push_another_tenants_prefixes_out(tiny: LLMEngine, quota: float | None) -> None:
    engine = like(tiny, device_blocks=24, kv_tenant_quota=quota)
    b_prefixes = make_prompts(2, 4 * BS, seed=10)
    for p in b_prefixes:
        generate(engine, p + [1], tenant="b")  # B caches 8 blocks, within a quota of 12
    for p in make_prompts(10, 4 * BS, seed=11):
        generate(engine, p + [1], tenant="a")  # A's traffic: 40 blocks of cached prefixes
    cached = [generate(engine, p + [2], tenant="b")[1].num_cached_tokens for p in b_prefixes]
    if quota is None:
        assert cached == [0, 0]  # plain LRU: A's newer blocks pushed B out
    else:
        assert cached == [4 * BS, 4 * BS]
        assert engine.kv_cache_manager.block_pool.num_tenant_cached_blocks("a") <= 12


# -- the offload policy --------------------------------------------------------------------


class RecordingPolicy:
    """Offloads every preempted request to the host tier; remembers what it was shown."""

    def __init__(self) -> None:
        self.contexts: list[KVOffloadContext] = []

    def plan_kv_offload(self, context: KVOffloadContext) -> KVOffloadDecision:
        self.contexts.append(context)
        preempted = tuple(r.req_id for r in context.requests if r.status == "preempted" and r.tier == "device")
        return KVOffloadDecision(offload=preempted, offload_tier="host")


def _preempting_workload(engine: LLMEngine) -> dict[str, list[int]]:
    """Three long generations in a pool too small for all of them: preemptions happen."""
    prompts = make_prompts(3, 3 * BS, seed=12)
    params = SamplingParams(max_tokens=5 * BS, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, params)
    tokens: dict[str, list[int]] = {f"p{i}": [] for i in range(3)}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.req_id].extend(out.new_token_ids)
    return tokens


def test_the_engine_asks_the_offload_policy_every_step_and_swaps_preempted_requests(tiny: LLMEngine) -> None:
    expected = _preempting_workload(like(tiny, device_blocks=14))
    policy = RecordingPolicy()
    engine = like(tiny, device_blocks=14, kv_host_memory_bytes=64 * block_bytes(tiny))
    engine.tiers.policy = policy
    steps_before = engine.tiers._step
    assert _preempting_workload(engine) == expected
    assert engine.scheduler.num_preemptions > 0
    assert len(policy.contexts) == engine.tiers._step - steps_before
    shown = [r for c in policy.contexts for r in c.requests]
    assert {r.status for r in shown} >= {"running", "preempted"}
    assert all(c.num_device_blocks == 14 for c in policy.contexts)
    # The preempted requests' blocks went to host memory and came back from there.
    stats = engine.tiers.stats()
    assert stats["kv_offload_policy_moves"] > 0
    assert stats["kv_restored_blocks:host"] > 0


def test_a_policy_that_raises_falls_back_to_the_default_and_is_logged_once(
    tiny: LLMEngine, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken:
        def plan_kv_offload(self, context: KVOffloadContext) -> KVOffloadDecision:
            raise RuntimeError("plugin bug")

    caplog.set_level(logging.WARNING)
    expected = _preempting_workload(like(tiny, device_blocks=14))
    engine = like(tiny, device_blocks=14, kv_host_memory_bytes=64 * block_bytes(tiny))
    engine.tiers.policy = Broken()
    assert _preempting_workload(engine) == expected
    assert len([r for r in caplog.records if "KV offload policy failed" in r.getMessage()]) == 1


# -- the default model, 1k-token prefixes ----------------------------------------------------


@pytest.fixture(scope="module")
def smollm() -> LLMEngine:
    return make_engine(default_model_path(), kv_cache_memory_bytes=2**20, max_num_batched_tokens=1024)


def test_a_working_set_four_times_the_device_pool_is_served_from_host_and_disk(
    smollm: LLMEngine, tmp_path: Path
) -> None:
    prefixes = make_prompts(4, 512, seed=13, vocab=40000)  # 4 x 32 blocks
    params = SamplingParams(max_tokens=4, temperature=0.0)
    device = 36  # one prefix and a bit
    off = like(smollm, device_blocks=device)
    expected = [generate(off, p + [1 + rnd], params=params)[0] for rnd in range(2) for p in prefixes]
    engine = like(
        smollm, device_blocks=device, kv_host_memory_bytes=65 * block_bytes(smollm), kv_disk_dir=str(tmp_path)
    )
    results = [generate(engine, p + [1 + rnd], params=params) for rnd in range(2) for p in prefixes]
    assert [t for t, _ in results] == expected
    second = [out for _, out in results[4:]]
    assert all(out.num_cached_tokens == 512 for out in second)
    assert all(sum((out.cached_tokens_by_tier or {}).values()) == 512 for out in second)
    # Host holds two prefixes, disk all of them: the second round uses both lower tiers.
    stats = engine.tiers.stats()
    assert stats["kv_hit_tokens:host"] > 0 and stats["kv_hit_tokens:disk"] > 0
    assert stats["kv_hit_tokens:host"] + stats["kv_hit_tokens:disk"] == 4 * 512
    engine.close()
