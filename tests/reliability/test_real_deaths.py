"""Failover and resume after real deaths: processes killed with SIGKILL, sockets cut.

The alias of the issue: an ``openai`` remote first, then a backend serving the same model,
``strategy = "priority"``, with and without ``resume_on_failure``; a greedy streamed chat of
``MAX_TOKENS`` tokens through the official ``openai`` client. The remotes die for real:

- another ``infermux serve`` (the default model on the core engine, in its own process),
  SIGKILLed once ``KILL_AFTER_LINES`` SSE lines of the answer reached the client;
- llama.cpp's ``llama-server`` (scripts/build_llama_server.sh), SIGKILLed the same way, before
  an in-process ``llamacpp`` backend of the same GGUF;
- a loopback HTTP server (tests/upstream_server.py) replaying the SSE answer recorded from the
  real upstream for the same prompt, then misbehaving after ``CUT_AFTER`` events: a TCP reset
  (SO_LINGER 0), a chunked body cut without its terminating chunk, silence on an open socket
  (the backend's ``idle_timeout``), and over TLS a close without close_notify.

The failed backend is an ``openai`` remote, whose chunks carry text but no token ids: the next
backend continues from the text received (the partial answer as the start of the assistant
turn; ``Watcher.from_ids`` checks that). Both core engines run float32 dense weights, where a
prefill computes the logits a token-by-token decode computes, so the resumed answer is the
unbroken one (llama-server to llamacpp: the text received, continued, as the two need not
agree on a near-tie after the break). Without ``resume_on_failure`` the stream ends with one error frame, code
``upstream_stream_broken`` (``stream_idle_timeout`` for the silence), and no ``[DONE]``.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from reliability_util import ledger_rows, wait_until, with_ledger
from served_upstream import ServedUpstream, infermux_upstream, llama_server, llama_server_binary
from upstream_server import Behaviour, TLSFiles, UpstreamServer, backend_tls_options

from backends.base import BackendConfig
from backends.default_model import default_model_path
from gateway.testing import LiveGateway, gateway_config
from plugins.manager import create_plugin_manager
from tests.routing.test_resume_live import Breaker

pytestmark = pytest.mark.slow

#: float32 dense: greedy choices do not flip between a prefill and a decode.
CORE = {"num_threads": 1, "kv_cache_memory_mb": 64, "dtype": "float32", "weight_format": "dense"}
LLAMA = {"n_ctx": 512, "n_threads": 1}
CHAT = [{"role": "user", "content": "Write a long story about a brave knight and a dragon."}]
MAX_TOKENS = 120
KILL_AFTER_LINES = 25
#: A top-2 logprob gap below this is a near-tie: float rounding alone can swap the two
#: (tests/backends/test_mlx_agreement.py holds MLX to llama.cpp with the same bar).
NEAR_TIE = 0.5
CUT_AFTER = 25
#: The replaying servers' silence is noticed after this long (no test asserts a timing).
IDLE_TIMEOUT_S = 0.5
#: Failures must never open a circuit here: every test needs its remote tried first.
NEVER_OPEN = 1000


class Watcher(Breaker):
    """test_resume_live's Breaker, never armed: it observes (never alters) every try, the
    chunks each backend sent and, for each resumed try, whether it continued from the failed
    backend's token ids or from its text."""

    def reset(self) -> None:
        self.arm(None, None)

    def text(self, backend: str) -> str:
        return "".join(c.text for c in self.chunks.get(backend, []))

    def num_tokens(self, backend: str) -> int:
        """Output tokens of ``backend``'s chunks (a remote's SSE event is one token)."""
        return sum(
            c.token_count or len(c.token_ids) or 1
            for c in self.chunks.get(backend, [])
            if c.text or c.token_ids
        )


@dataclass
class Answer:
    """What the client received."""

    request_id: str | None
    text: str = ""
    finish_reason: str | None = None
    usage: Any = None
    #: The error frame, as the ``openai`` client raises it mid-stream.
    error: openai.APIError | None = None
    num_events: int = 0
    deltas: list[str] = field(default_factory=list)
    #: (token text, its logprob, the best other token's logprob), with ``logprobs=True``.
    tokens: list[tuple[str, float, float]] = field(default_factory=list)


def stream_chat(
    gw: LiveGateway, alias: str, *, on_event: Callable[[int], None] | None = None, **extra: Any
) -> Answer:
    """A greedy streamed chat; ``on_event(n)`` after the client got its n-th SSE event."""
    client = gw.openai_client(timeout=120.0)
    fields: dict[str, Any] = {"messages": CHAT, "max_tokens": MAX_TOKENS, **extra}
    raw = client.chat.completions.with_raw_response.create(
        model=alias, temperature=0, stream=True, stream_options={"include_usage": True}, **fields
    )
    answer = Answer(request_id=raw.headers.get("x-request-id"))
    try:
        for event in raw.parse():
            answer.num_events += 1
            if event.choices:
                piece = event.choices[0].delta.content or ""
                answer.text += piece
                if piece:
                    answer.deltas.append(piece)
                logprobs = event.choices[0].logprobs
                for entry in (logprobs.content or []) if logprobs is not None else []:
                    others = [t.logprob for t in entry.top_logprobs if t.token != entry.token]
                    answer.tokens.append((entry.token, entry.logprob, max(others, default=float("-inf"))))
                answer.finish_reason = event.choices[0].finish_reason or answer.finish_reason
            if event.usage is not None:
                answer.usage = event.usage
            if on_event is not None:
                on_event(answer.num_events)
    except openai.APIError as exc:  # the client raises on an error frame mid-stream
        answer.error = exc
    return answer


def first_divergence(unbroken: Answer, text: str) -> tuple[int, float] | None:
    """Where ``text`` leaves the unbroken answer: (token index, the unbroken token's lead in
    logprob over the next best there), or None where it does not."""
    offset = 0
    for index, (token, logprob, runner_up) in enumerate(unbroken.tokens):
        if text[offset : offset + len(token)] != token:
            return index, logprob - runner_up
        offset += len(token)
    return None


def kill_after(upstream: ServedUpstream, num_lines: int) -> Callable[[int], None]:
    def on_event(number: int) -> None:
        if number == num_lines:
            os.kill(upstream.pid, signal.SIGKILL)

    return on_event


def one_ledger_row(ledger: Path, request_id: str | None) -> dict[str, Any]:
    assert request_id is not None
    wait_until(lambda: len(ledger_rows(ledger, request_id)) >= 1)
    (row,) = ledger_rows(ledger, request_id)
    return row


def remote(name: str, base_url: str, **settings: Any) -> BackendConfig:
    options = {"base_url": base_url, "model": "smollm2", **backend_tls_options(base_url)}
    return BackendConfig(
        name=name, kind="openai", options=options, circuit_failure_threshold=NEVER_OPEN, **settings
    )


def assert_resumed(
    answer: Answer,
    watcher: Watcher,
    ledger: Path,
    *,
    failed: str,
    next_backend: str,
    expected: Expected | None,
) -> None:
    """The client got the failed backend's part then the next one's, the ``expected`` answer
    whole (None: any finished one), with no error frame; the usage and the one ledger row
    count both tries once."""
    assert answer.error is None, answer.error
    if expected is not None:
        assert answer.text == expected.text
        assert answer.finish_reason == expected.finish_reason
    assert answer.finish_reason in ("stop", "length")
    assert watcher.text(failed) + watcher.text(next_backend) == answer.text
    assert watcher.text(failed) and watcher.text(next_backend)
    assert watcher.from_ids == [False]  # a remote's output has no token ids: from the text
    num_failed, num_next = watcher.num_tokens(failed), watcher.num_tokens(next_backend)
    assert answer.usage.completion_tokens == num_failed + num_next
    if expected is not None:
        assert num_failed + num_next == expected.num_tokens
    row = one_ledger_row(ledger, answer.request_id)
    assert (row["status"], row["backend"]) == ("ok", f"{failed},{next_backend}")
    assert row["output_tokens"] == answer.usage.completion_tokens
    assert row["input_tokens"] == answer.usage.prompt_tokens


def assert_error_frame(
    answer: Answer, watcher: Watcher, ledger: Path, *, failed: str, code: str, words: str
) -> None:
    """The documented end of a broken stream: what the remote sent, then one error frame."""
    assert answer.error is not None, "the stream ended without an error frame"
    assert answer.error.code == code
    assert words in answer.error.message and f"backend {failed!r}" in answer.error.message
    assert answer.text == watcher.text(failed) and answer.finish_reason is None
    assert set(watcher.chunks) == {failed}  # nobody continued
    row = one_ledger_row(ledger, answer.request_id)
    assert (row["status"], row["backend"], row["error_code"]) == ("error", failed, code)
    assert row["output_tokens"] == watcher.num_tokens(failed)


# -- an infermux upstream and replaying servers before the core engine ---------------------


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedUpstream]:
    """Another ``infermux serve`` of the default model (core engine, float32 dense)."""
    served = infermux_upstream(tmp_path_factory.mktemp("upstream"), CORE)
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture
def live_upstream(upstream: ServedUpstream) -> ServedUpstream:
    """:func:`upstream`, started again (same port) if a test killed it."""
    assert upstream.process is not None
    if upstream.process.poll() is not None:
        upstream.start()
    return upstream


@pytest.fixture(scope="module")
def replayers(test_ca: TLSFiles) -> Iterator[dict[str, UpstreamServer]]:
    """The replaying servers, over plain HTTP and over TLS."""
    servers = {
        "replay": UpstreamServer(name="replay").start(),
        "replay_tls": UpstreamServer(name="replay_tls", tls=test_ca).start(),
    }
    try:
        yield servers
    finally:
        for server in servers.values():
            server.stop()


@pytest.fixture(scope="module")
def front(
    live_gateway: Any,
    upstream: ServedUpstream,
    replayers: dict[str, UpstreamServer],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[LiveGateway, Watcher, Path]]:
    watcher = Watcher()
    pm = create_plugin_manager(load_entry_points=False)
    pm.register(watcher, name="watcher")
    ledger = tmp_path_factory.mktemp("ledger") / "ledger.sqlite3"
    replay_settings = {"idle_timeout": IDLE_TIMEOUT_S}
    config = gateway_config(
        remote("remote", upstream.openai_base_url),
        remote("replay", replayers["replay"].base_url, **replay_settings),
        remote("replay_tls", replayers["replay_tls"].base_url, **replay_settings),
        BackendConfig(name="local", kind="core_engine", options=CORE, worker_process=False),
        models={
            "smollm2": ["remote", "local"],
            "smollm2_off": ["remote", "local"],
            "replay": ["replay", "local"],
            "replay_off": ["replay", "local"],
            "replay_tls": ["replay_tls", "local"],
            "replay_tls_off": ["replay_tls", "local"],
            "local": ["local"],
        },
        resume_on_failure=("smollm2", "replay", "replay_tls"),
    )
    with live_gateway(with_ledger(config, ledger), plugin_manager=pm) as gateway:
        yield gateway, watcher, ledger


@dataclass(frozen=True)
class Expected:
    """The answer a client must get."""

    text: str
    finish_reason: str
    num_tokens: int


@dataclass(frozen=True)
class Unbroken(Expected):
    #: The real upstream's SSE content deltas for the same chat, one token each.
    upstream_deltas: list[str]


@pytest.fixture(scope="module")
def unbroken(front: tuple[LiveGateway, Watcher, Path], upstream: ServedUpstream) -> Unbroken:
    """The unbroken greedy answer (the front's core engine alone) and the real upstream's
    answer to the same chat as it streamed it, recorded for the replaying servers."""
    gw, watcher, _ = front
    answer = stream_chat(gw, "local")
    assert answer.error is None and answer.finish_reason in ("stop", "length")
    num_tokens = answer.usage.completion_tokens
    assert num_tokens > 2 * max(CUT_AFTER, KILL_AFTER_LINES)  # the faults come mid-answer
    body = {
        "model": "smollm2",
        "messages": CHAT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    deltas: list[str] = []
    with httpx.stream(
        "POST", f"{upstream.openai_base_url}/chat/completions", json=body, timeout=120
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[len("data: ") :])
                for choice in event["choices"]:
                    if choice["delta"].get("content"):
                        deltas.append(choice["delta"]["content"])
    assert "".join(deltas) == answer.text  # the same model, greedy, float32 on both
    assert len(deltas) == num_tokens
    watcher.reset()
    return Unbroken(answer.text, answer.finish_reason, num_tokens, deltas)


def test_an_upstream_gateway_killed_mid_stream_is_continued_to_the_unbroken_answer(
    front: tuple[LiveGateway, Watcher, Path], live_upstream: ServedUpstream, unbroken: Unbroken
) -> None:
    gw, watcher, ledger = front
    watcher.reset()
    answer = stream_chat(gw, "smollm2", on_event=kill_after(live_upstream, KILL_AFTER_LINES))
    assert live_upstream.process is not None and live_upstream.process.poll() == -signal.SIGKILL
    assert_resumed(
        answer, watcher, ledger, failed="remote", next_backend="local", expected=unbroken
    )


def test_an_upstream_gateway_killed_mid_stream_without_resume_ends_with_the_error_frame(
    front: tuple[LiveGateway, Watcher, Path], live_upstream: ServedUpstream, unbroken: Unbroken
) -> None:
    gw, watcher, ledger = front
    watcher.reset()
    answer = stream_chat(gw, "smollm2_off", on_event=kill_after(live_upstream, KILL_AFTER_LINES))
    assert_error_frame(
        answer,
        watcher,
        ledger,
        failed="remote",
        code="upstream_stream_broken",
        words="stream broke",
    )
    assert unbroken.text.startswith(answer.text) and len(answer.text) < len(unbroken.text)


#: fault -> (replaying server, its Behaviour mode, the error code without resume, words of it)
FAULTS = {
    "rst": ("replay", "reset_mid_stream", "upstream_stream_broken", "stream broke"),
    "chunked_cut": ("replay", "die_mid_stream", "upstream_stream_broken", "stream broke"),
    "stall": ("replay", "stall_mid_stream", "stream_idle_timeout", "idle timeout"),
    "tls_without_close_notify": (
        "replay_tls",
        "die_mid_stream",
        "upstream_stream_broken",
        "stream broke",
    ),
}


@pytest.mark.parametrize("resume", [True, False], ids=["resume", "no_resume"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_stream_cut_mid_body_by_the_upstream(
    front: tuple[LiveGateway, Watcher, Path],
    replayers: dict[str, UpstreamServer],
    unbroken: Unbroken,
    fault: str,
    resume: bool,
) -> None:
    gw, watcher, ledger = front
    server_name, mode, code, words = FAULTS[fault]
    server = replayers[server_name]
    deltas = [{"content": piece} for piece in unbroken.upstream_deltas]
    behaviour = Behaviour(
        mode=mode, deltas=deltas, finish_reason=unbroken.finish_reason, after_chunks=CUT_AFTER
    )  # type: ignore[arg-type]
    server.script(behaviour)
    watcher.reset()
    answer = stream_chat(gw, server_name if resume else f"{server_name}_off")
    assert watcher.text(server_name) == "".join(unbroken.upstream_deltas[:CUT_AFTER])
    if resume:
        assert_resumed(
            answer,
            watcher,
            ledger,
            failed=server_name,
            next_backend="local",
            expected=unbroken,
        )
    else:
        assert_error_frame(answer, watcher, ledger, failed=server_name, code=code, words=words)
    server.wait_until(lambda: server.requests[-1].outcome != "open")  # it saw the end too


# -- llama.cpp's llama-server before the in-process llamacpp backend ------------------------


@pytest.fixture(scope="module")
def llama_front(
    live_gateway: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LiveGateway, Watcher, Path, ServedUpstream]]:
    server = llama_server(
        llama_server_binary(), default_model_path(), tmp_path_factory.mktemp("llama-server")
    )
    watcher = Watcher()
    pm = create_plugin_manager(load_entry_points=False)
    pm.register(watcher, name="watcher")
    ledger = tmp_path_factory.mktemp("ledger") / "ledger.sqlite3"
    config = gateway_config(
        remote("llama_server", server.openai_base_url),
        BackendConfig(name="llama", kind="llamacpp", options=LLAMA, worker_process=False),
        models={
            "smollm2": ["llama_server", "llama"],
            "llama_server": ["llama_server"],
            "llama": ["llama"],
        },
        resume_on_failure=("smollm2",),
    )
    try:
        with live_gateway(with_ledger(config, ledger), plugin_manager=pm) as gateway:
            yield gateway, watcher, ledger, server
    finally:
        server.stop()


def test_a_llama_server_killed_mid_stream_is_continued_by_llamacpp(
    llama_front: tuple[LiveGateway, Watcher, Path, ServedUpstream],
) -> None:
    """Across engines the text only: llama-server decoded the text received token by token,
    llamacpp prefills it as a batch (and may reuse a cached prefix), so a near-tie may go the
    other way after the break. The client's answer is llama-server's part followed by
    llamacpp's continuation of it, whole, with no error frame, and it is the unbroken greedy
    answer up to the first near-tie (seen: 28 tokens in, a lead of 0.15 nats)."""
    gw, watcher, ledger, server = llama_front
    unbroken = stream_chat(gw, "llama_server", logprobs=True, top_logprobs=2)
    assert unbroken.error is None and unbroken.finish_reason in ("stop", "length")
    assert unbroken.usage.completion_tokens > 2 * KILL_AFTER_LINES
    assert "".join(t for t, _, _ in unbroken.tokens) == unbroken.text
    watcher.reset()
    answer = stream_chat(gw, "smollm2", on_event=kill_after(server, KILL_AFTER_LINES))
    assert server.process is not None and server.process.poll() == -signal.SIGKILL
    received = watcher.text("llama_server")
    assert unbroken.text.startswith(received) and len(received) < len(unbroken.text)
    assert answer.text.startswith(received) and len(answer.text) > len(received)
    # The unbroken greedy answer, but for near-ties: the text may leave it only where
    # llama-server's own top two were within NEAR_TIE of each other (llamacpp prefills the
    # received text as a batch, llama-server decoded it token by token: other roundings).
    diverged = first_divergence(unbroken, answer.text)
    if diverged is None:
        assert answer.text == unbroken.text
    else:
        index, lead = diverged
        assert "".join(t for t, _, _ in unbroken.tokens[:index]).startswith(received)
        assert lead < NEAR_TIE, f"left the unbroken answer at token {index}, {lead:.2f} nats clear"
    assert_resumed(
        answer, watcher, ledger, failed="llama_server", next_backend="llama", expected=None
    )
