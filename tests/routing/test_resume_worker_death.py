"""Resumed failover when the engine's worker process is really killed mid-stream.

Two core-engine backends in their (default) worker processes; a plugin around the stream
SIGKILLs the first backend's worker once it has sent a few chunks. Tokens already on their
way may still arrive before the death is noticed, so the break point is wherever the kill
lands; the answer must be the unbroken one all the same.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from backends.base import BackendConfig, GenerationChunk, GenerationRequest
from gateway.testing import LiveGateway, gateway_config
from plugins.hookspecs import hookimpl
from plugins.manager import create_plugin_manager

pytestmark = pytest.mark.slow

CORE = {"num_threads": 1, "kv_cache_memory_mb": 64, "dtype": "float32", "weight_format": "dense"}
CHAT = [{"role": "user", "content": "Say hello in French, with accents."}]


class Killer:
    """SIGKILLs ``pid`` once the stream of ``backend`` has sent ``after`` chunks."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.after = 3
        self.backends: list[str] = []

    @hookimpl
    async def infermux_wrap_generate(
        self,
        request: GenerationRequest,
        backend_name: str,
        call_next: Callable[[GenerationRequest], AsyncIterator[GenerationChunk]],
    ) -> AsyncIterator[GenerationChunk]:
        self.backends.append(backend_name)
        num_chunks = 0
        async for chunk in call_next(request):
            yield chunk
            num_chunks += 1
            if backend_name == "core1" and num_chunks == self.after and self.pid is not None:
                os.kill(self.pid, signal.SIGKILL)
                self.pid = None


@pytest.fixture(scope="module")
def setup(live_gateway: Any) -> Iterator[tuple[LiveGateway, Killer]]:
    killer = Killer()
    pm = create_plugin_manager(load_entry_points=False)
    pm.register(killer, name="killer")
    config = gateway_config(
        BackendConfig(name="core1", kind="core_engine", options=CORE, worker_process=True),
        BackendConfig(name="core2", kind="core_engine", options=CORE, worker_process=True),
        models={"cc": ["core1", "core2"]},
        resume_on_failure=("cc",),
    )
    with live_gateway(config, plugin_manager=pm) as gateway:
        yield gateway, killer


def test_a_killed_engine_worker_mid_stream_is_continued_to_the_unbroken_answer(
    setup: tuple[LiveGateway, Killer],
) -> None:
    gw, killer = setup
    client = gw.openai_client(timeout=300.0)

    def ask() -> tuple[str, Any]:
        stream = client.chat.completions.create(
            model="cc", messages=CHAT, temperature=0, max_tokens=24, stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        for event in stream:
            if event.choices:
                text += event.choices[0].delta.content or ""
            if event.usage is not None:
                usage = event.usage
        return text, usage

    unbroken, unbroken_usage = ask()
    killer.backends = []
    killer.pid = gw.backend("core1").pid
    resumed, usage = ask()
    assert killer.backends == ["core1", "core2"]
    assert resumed == unbroken
    assert usage.completion_tokens == unbroken_usage.completion_tokens == 24
    assert usage.prompt_tokens > 2 * unbroken_usage.prompt_tokens  # the re-prefill counted
