"""Issue 44 at the backends: a prompt-prefix cache hits only within one ``cache_salt``.

llama.cpp's slots and MLX's prompt cache keep the KV of the last prompt for the next one that
starts the same way. The gateway sets each request's ``cache_salt`` from its tenant; were a
cache shared across salts, one API key would learn from ``usage.cached_tokens`` (and its first
token's latency) whether another key's prompt began the same way. Each backend here runs with
the real default model: tenant A's prompt twice (a hit), tenant B's same prompt (cold:
nothing cached), then A's again, whose greedy output must still be its first run's. The last
test sends the same through a live gateway with two API keys of two tenants, whose salt the
gateway derives, to a llama.cpp backend in its worker process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
import pytest

from backends.base import Backend, BackendConfig, GenerationChunk, GenerationRequest, SamplingParams
from backends.llamacpp import create_backend as create_llamacpp
from backends.mlx import create_backend as create_mlx
from gateway.config.types import ApiKeyConfig, AuthConfig
from gateway.http.auth import hash_key
from gateway.testing import gateway_config

pytestmark = pytest.mark.slow

#: About 300 tokens of one tenant's private context.
PROMPT = (
    "Internal memo, project Bluefin, restricted to the finance team. "
    + " ".join(
        f"Line {i}: the quarterly forecast for region {i} was revised after the audit."
        for i in range(18)
    )
    + " Summary:"
)


def _request(salt: str | None) -> GenerationRequest:
    return GenerationRequest(
        request_id="r",
        model="smollm2",
        kind="completion",
        prompt=PROMPT,
        params=SamplingParams(max_tokens=4, temperature=0),
        cache_salt=salt,
    )


async def _run(backend: Backend, salt: str | None) -> tuple[str, int, int]:
    """The greedy text, prompt tokens and cached tokens of ``PROMPT`` under ``salt``."""
    chunks: Sequence[GenerationChunk] = [c async for c in backend.generate(_request(salt))]
    usage = chunks[-1].usage
    assert usage is not None and usage.cached_tokens is not None
    return "".join(c.text for c in chunks), usage.prompt_tokens, usage.cached_tokens


@pytest.mark.asyncio
@pytest.mark.parametrize("parallel", [1, 2])
async def test_llamacpp_slot_reuse_stays_within_one_salt(parallel: int) -> None:
    # One slot: B's prompt must clear A's KV from it. Two: B takes the unused one and A's
    # slot stays warm for A.
    backend = create_llamacpp(
        BackendConfig(
            name="llama",
            kind="llamacpp",
            options={"n_threads": 1, "n_ctx": 1024, "parallel": parallel},
        )
    )
    await backend.start()
    try:
        text, num_prompt, cached = await _run(backend, "tenant-a")
        assert num_prompt > 250 and cached == 0 and text
        assert (await _run(backend, "tenant-a"))[2] > 250  # same tenant: the prefix is reused
        assert (await _run(backend, "tenant-b")) == (text, num_prompt, 0)  # another: cold
        again, _, cached = await _run(backend, "tenant-a")
        assert again == text
        # One slot now holds B's prompt; with two, A's own slot is still warm.
        assert cached == (0 if parallel == 1 else num_prompt - 1)
        assert (await _run(backend, None))[2] == 0  # no salt is a partition of its own
    finally:
        await backend.aclose()


@pytest.mark.asyncio
async def test_mlx_prompt_cache_stays_within_one_salt() -> None:
    backend = create_mlx(BackendConfig(name="mlx", kind="mlx", options={"n_ctx": 1024}))
    await backend.start()
    try:
        text, num_prompt, cached = await _run(backend, "tenant-a")
        assert num_prompt > 250 and cached == 0 and text
        assert (await _run(backend, "tenant-a"))[2] > 250  # same tenant: the prefix is reused
        assert (await _run(backend, "tenant-b")) == (text, num_prompt, 0)  # another: cold
        assert (await _run(backend, "tenant-b"))[2] > 250  # B's own prompt is now cached
        assert (await _run(backend, None))[2] == 0  # no salt is a partition of its own
        assert (await _run(backend, "tenant-a")) == (text, num_prompt, 0)
    finally:
        await backend.aclose()


def test_two_tenants_keys_share_no_cached_prefix_through_the_gateway(live_gateway: Any) -> None:
    keys = AuthConfig(
        keys=[
            ApiKeyConfig(id=tenant, tenant=tenant, key_sha256=hash_key(f"imx-{tenant}-cache"))
            for tenant in ("acme", "globex")
        ]
    )
    # One slot: globex's prompt lands on the slot acme's filled.
    llama = BackendConfig(
        name="llama", kind="llamacpp", options={"n_threads": 1, "n_ctx": 1024, "parallel": 1}
    )
    body = {"model": "echo", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}

    def complete(tenant: str) -> tuple[str, int]:
        answer = httpx.post(
            f"{gw}/v1/completions",
            json=body,
            headers={"authorization": f"Bearer imx-{tenant}-cache"},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        reply = answer.json()
        details = reply["usage"].get("prompt_tokens_details") or {}
        return reply["choices"][0]["text"], details.get("cached_tokens", 0)

    with live_gateway(gateway_config(llama, auth=keys)) as gw:
        text, cached = complete("acme")
        assert text and cached == 0
        assert complete("acme")[1] > 250  # the tenant's own prefix is reused
        assert complete("globex") == (text, 0)  # another tenant's: a cold prefill
        assert complete("acme") == (text, 0)  # globex's prompt took the slot
