"""Mid-stream failover that resumes on an ``openai`` remote (``continue_final_message``), live.

Two real gateways on loopback. The upstream one serves the default model on the core
engine. The front one has the alias's first backend, a core engine failed on cue by the
Breaker plugin of test_resume_live.py, followed by ``openai`` remotes whose ``base_url`` is the
upstream gateway: one with ``continue_final_message = true``, one without. Greedy, float32
dense weights on both engines (a prefill computes the logits a decode computes), asked
through the official ``openai`` client.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from test_resume_live import CHAT, CORE, MAX_TOKENS, Breaker, chat

from backends.base import BackendConfig, GenerationChunk, GenerationRequest
from gateway.testing import LiveGateway, gateway_config
from plugins.hookspecs import hookimpl
from plugins.manager import create_plugin_manager

pytestmark = pytest.mark.slow


class ResumeRecorder(Breaker):
    """The Breaker, also keeping the text each resumed try was given."""

    def __init__(self) -> None:
        super().__init__()
        self.resume_texts: list[str] = []

    def arm(self, backend: str | None, after: int | None) -> None:
        super().arm(backend, after)
        self.resume_texts = []

    @hookimpl
    def infermux_on_attempt_start(self, request: GenerationRequest, backend_name: str, attempt: int) -> None:
        super().infermux_on_attempt_start(request, backend_name, attempt)
        if request.resume is not None:
            self.resume_texts.append(request.resume.text)


@pytest.fixture(scope="module")
def setup(live_gateway: Any) -> Iterator[tuple[LiveGateway, ResumeRecorder]]:
    upstream_config = gateway_config(
        BackendConfig(name="core", kind="core_engine", options=CORE, worker_process=False),
        models={"up": ["core"]},
    )
    with live_gateway(upstream_config) as upstream:
        remote = {"base_url": upstream.openai_base_url, "model": "up"}
        breaker = ResumeRecorder()
        pm = create_plugin_manager(load_entry_points=False)
        pm.register(breaker, name="breaker")
        config = gateway_config(
            BackendConfig(name="core1", kind="core_engine", options=CORE, worker_process=False),
            BackendConfig(name="core2", kind="core_engine", options=CORE, worker_process=False),
            BackendConfig(name="vllm_like", kind="openai", options={**remote, "continue_final_message": True}),
            BackendConfig(name="plain", kind="openai", options=remote),
            models={
                "cr": ["core1", "vllm_like"],
                "cp": ["core1", "plain"],
                "cpc": ["core1", "plain", "core2"],
            },
            resume_on_failure=("cr", "cp", "cpc"),
        )
        with live_gateway(config, plugin_manager=pm) as gateway:
            yield gateway, breaker


@pytest.fixture(scope="module")
def unbroken(setup: tuple[LiveGateway, ResumeRecorder]) -> tuple[str, list[GenerationChunk]]:
    """The unbroken greedy answer (from core1) and the chunks core1 sent for it."""
    gw, breaker = setup
    breaker.arm(None, None)
    answer = chat(gw, "cr")
    assert answer.finish_reason == "length" and set(breaker.chunks) == {"core1"}
    return answer.text, breaker.chunks["core1"]


@pytest.mark.parametrize("point", ["first_token", "mid_answer", "last_token"])
def test_a_remote_that_speaks_continue_final_message_continues_the_answer(
    setup: tuple[LiveGateway, ResumeRecorder], unbroken: tuple[str, list[GenerationChunk]], point: str
) -> None:
    gw, breaker = setup
    text, chunks = unbroken
    num_chunks = len(chunks)
    after = {"first_token": 1, "mid_answer": num_chunks // 2, "last_token": num_chunks - 2}[point]
    breaker.arm("core1", after)
    resumed = chat(gw, "cr")
    assert breaker.attempts == [("core1", 0, False), ("vllm_like", 1, True)]
    assert breaker.from_ids == [False]  # another model id: from the text received
    before = "".join(c.text for c in breaker.chunks["core1"])
    # The remote sent only what follows the text the client had.
    assert before + "".join(c.text for c in breaker.chunks["vllm_like"]) == resumed.text
    assert resumed.text == text
    assert resumed.finish_reason == "length"
    assert resumed.usage.completion_tokens == MAX_TOKENS


def test_a_continued_assistant_message_failing_mid_stream_goes_on_from_the_whole_text(
    setup: tuple[LiveGateway, ResumeRecorder], unbroken: tuple[str, list[GenerationChunk]]
) -> None:
    """A continue_final_message request broken mid-stream: the remote is given the client's
    partial message followed by what core1 streamed, and the answer is still the unbroken one."""
    gw, breaker = setup
    text, chunks = unbroken
    given = "".join(c.text for c in chunks[:4])
    num_given = sum(len(c.token_ids) for c in chunks[:4])
    breaker.arm("core1", 3)
    client = gw.openai_client(timeout=300.0)
    streamed, finish = "", None
    for event in client.chat.completions.create(
        model="cr",
        messages=[*CHAT, {"role": "assistant", "content": given}],
        temperature=0,
        max_tokens=MAX_TOKENS - num_given,
        stream=True,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    ):
        if event.choices:
            streamed += event.choices[0].delta.content or ""
            finish = event.choices[0].finish_reason or finish
    assert breaker.attempts == [("core1", 0, True), ("vllm_like", 1, True)]
    assert breaker.from_ids == [False, False]
    sent = "".join(c.text for c in breaker.chunks["core1"])
    assert sent and streamed.startswith(sent) and len(streamed) > len(sent)
    assert breaker.resume_texts == [given, given + sent]
    # Only the continuation, and it is the rest of the unbroken answer.
    assert streamed == text[len(given):]
    assert finish == "length"


def test_a_remote_without_the_option_is_not_resumed_on(setup: tuple[LiveGateway, ResumeRecorder]) -> None:
    gw, breaker = setup
    breaker.arm("core1", 3)
    client = gw.openai_client(timeout=300.0)
    text = ""
    with pytest.raises(openai.APIError, match="worker died"):
        for event in client.chat.completions.create(
            model="cp", messages=CHAT, temperature=0, max_tokens=MAX_TOKENS, stream=True
        ):
            if event.choices:
                text += event.choices[0].delta.content or ""
    assert set(breaker.chunks) == {"core1"}  # nobody continued
    assert text


def test_the_next_backend_that_can_resume_is_used_past_one_that_cannot(
    setup: tuple[LiveGateway, ResumeRecorder], unbroken: tuple[str, list[GenerationChunk]]
) -> None:
    gw, breaker = setup
    breaker.arm("core1", 4)
    resumed = chat(gw, "cpc")
    assert breaker.attempts == [("core1", 0, False), ("core2", 1, True)]
    assert resumed.text == unbroken[0]
