"""The KV disk tier survives a restart of the gateway process, after SIGTERM and after SIGKILL.

A real ``infermux serve`` process (loopback) serves the default model through the core engine
with a disk tier. It answers some prompts and is stopped; a new process on the same directory
serves the same prompts from disk (``cached_tokens`` > 0, the disk tier's hit counter in
``/metrics``) with the same greedy outputs. A SIGKILL skips every shutdown path, so the test
waits until the disk writer's queue is empty (``/metrics``) before killing: what reached the
disk by then must be reusable. Files damaged between the two runs are detected and recomputed:
same outputs, no error.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.telemetry.served_process import ServedGateway

WORDS = "harbor maple ticket violet engine amber meadow lantern copper puzzle".split()


def passage(seed: int, words: int = 200) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


PROMPTS = [passage(seed) for seed in range(3)]


def write_config(path: Path, disk_dir: Path) -> Path:
    path.write_text(
        "\n".join(
            [
                "[[backends]]",
                'name = "core"',
                'kind = "core_engine"',
                "[backends.options]",
                'dtype = "float32"',
                # Dense fp32: outputs before and after the restart are compared token for
                # token; the int4 default's 8-bit activations can flip a near-tie between a
                # cold prefill and one over blocks read from disk (docs/core-engine-model.md).
                'weight_format = "dense"',
                "num_threads = 1",
                "kv_cache_memory_mb = 64",
                f'kv_disk_dir = "{disk_dir}"',
                "",
                "[[models]]",
                'alias = "core"',
                'backends = ["core"]',
                "",
            ]
        )
    )
    return path


def ask_all(gateway: ServedGateway) -> list[tuple[str, int]]:
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", timeout=300.0)
    out = []
    for prompt in PROMPTS:
        reply = client.completions.create(model="core", prompt=prompt, max_tokens=6, temperature=0)
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        out.append((reply.choices[0].text, reply.usage.prompt_tokens_details.cached_tokens or 0))
    return out


def metric(gateway: ServedGateway, prefix: str) -> float:
    text = httpx.get(f"{gateway.url}/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


@pytest.mark.parametrize("stop", ["sigterm", "sigkill", "sigterm-then-corrupt"])
def test_a_restarted_gateway_reads_its_kv_blocks_from_disk(tmp_path: Path, stop: str) -> None:
    disk_dir = tmp_path / "kv"
    config = write_config(tmp_path / "infermux.toml", disk_dir)
    with ServedGateway(config, env={}, log=tmp_path / "first.log") as first:
        before = ask_all(first)
        assert all(cached == 0 for _, cached in before)
        if stop == "sigkill":
            deadline = time.monotonic() + 60
            while metric(first, 'infermux_backend_kv_disk_pending_writes{backend="core"}') > 0:
                assert time.monotonic() < deadline, "the disk writer did not drain"
                time.sleep(0.1)
            first.kill()
        else:
            assert first.stop() == 0
    files = list(disk_dir.rglob("*.kv"))
    assert files, "nothing reached the disk tier"
    if stop == "sigterm-then-corrupt":
        for path in files:  # one flipped payload byte in every block file
            data = bytearray(path.read_bytes())
            data[-1] ^= 0x55
            path.write_bytes(bytes(data))

    with ServedGateway(config, env={}, log=tmp_path / "second.log") as second:
        after = ask_all(second)  # the client raises on any 5xx
        hit_tokens = metric(second, 'infermux_backend_kv_tier_hit_tokens_total{backend="core",tier="disk"}')
        invalid = metric(second, 'infermux_backend_kv_disk_invalid_blocks_total{backend="core"}')
    assert [text for text, _ in after] == [text for text, _ in before]
    if stop == "sigterm-then-corrupt":
        # Every first block failed its checksum: everything was recomputed, nothing was used.
        assert all(cached == 0 for _, cached in after)
        assert hit_tokens == 0 and invalid >= len(PROMPTS)
    else:
        assert all(cached > 0 for _, cached in after)
        assert hit_tokens == sum(cached for _, cached in after)
