"""The ``disaggregated`` backend over real core engines in this process, KV over TCP: the
colocated greedy text, a transfer that never arrives (retried, then served by the decode
engine whole), and the options' errors."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from backends.base import BackendConfig, ChatMessage, GenerationRequest, SamplingParams
from backends.core_engine import CoreEngineBackend
from backends.disaggregated import DisaggregatedBackend
from backends.errors import BackendConfigError

_ENGINE = {"num_threads": 1, "kv_cache_memory_mb": 64, "engine_process": False}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _core(name: str, **options: Any) -> CoreEngineBackend:
    return CoreEngineBackend(BackendConfig(name=name, kind="core_engine", options=_ENGINE | options))


def _pair(name: str, prefill: str, decode: str, **options: Any) -> DisaggregatedBackend:
    return DisaggregatedBackend(
        BackendConfig(name=name, kind="disaggregated", options={"prefill": prefill, "decode": decode} | options)
    )


def chat(text: str, **params: Any) -> GenerationRequest:
    return GenerationRequest(
        request_id="r", model="m", kind="chat", messages=(ChatMessage(role="user", content=text),),
        params=SamplingParams(temperature=0.0, max_tokens=20, **params),
    )


async def _text(backend: Any, request: GenerationRequest) -> tuple[str, str | None]:
    text, finish = "", None
    async for chunk in backend.generate(request):
        text += chunk.text
        finish = chunk.finish_reason or finish
    return text, finish


# -- options -------------------------------------------------------------------------------------


def test_a_pair_must_name_two_other_core_engines() -> None:
    with pytest.raises(ValueError, match="another backend"):
        _pair("pd", "a", "a")
    with pytest.raises(ValueError, match="itself"):
        _pair("pd", "pd", "b")
    pd = _pair("pd", "pf", "dc")
    with pytest.raises(ValueError, match="options.decode: no \\[\\[backends\\]\\] entry"):
        pd.bind_backends({"pf": _core("pf")})
    from backends.mock import create_backend as mock

    with pytest.raises(ValueError, match="not core_engine"):
        pd.bind_backends({"pf": _core("pf"), "dc": mock(BackendConfig(name="dc", kind="mock"))})


def test_a_role_needs_a_transport_and_tcp_an_address() -> None:
    with pytest.raises(BackendConfigError, match="role: role = 'decode' needs kv_transfer"):
        _core("dc", role="decode")
    with pytest.raises(BackendConfigError, match="kv_transfer.address"):
        _core("dc", role="decode", kv_transfer={"transport": "tcp"})


# -- real engines --------------------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines() -> AsyncIterator[dict[str, Any]]:
    address = f"tcp://127.0.0.1:{_free_port()}"
    nowhere = f"tcp://127.0.0.1:{_free_port()}"  # nobody listens: its sends fail
    backends: dict[str, Any] = {
        "co": _core("co"),
        "pf": _core("pf", role="prefill", kv_transfer={"transport": "tcp", "address": address}),
        "dc": _core("dc", role="decode", kv_transfer={"transport": "tcp", "address": address, "timeout_s": 2.0}),
        "lost": _core("lost", role="prefill", kv_transfer={"transport": "tcp", "address": nowhere, "timeout_s": 1.0}),
    }
    for backend in backends.values():
        await backend.start()
    backends["pd"] = _pair("pd", "pf", "dc")
    backends["pd_lost"] = _pair("pd_lost", "lost", "dc", max_attempts=2, retry_backoff_s=0.0)
    for name in ("pd", "pd_lost"):
        backends[name].bind_backends(backends)
        await backends[name].start()
    yield backends
    for backend in backends.values():
        await backend.aclose()


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_tcp_pair_answers_the_colocated_greedy_text(engines: dict[str, Any]) -> None:
    for prompt in ("Name three colours.", "Count from one to ten: " + "one two three " * 30):
        expected = await _text(engines["co"], chat(prompt))
        assert await _text(engines["pd"], chat(prompt)) == expected
    assert engines["pd"].num_disaggregated == 2
    dc = engines["dc"].stats()
    assert dc["kv_transfer_blocks:written"] > 0
    assert dc["kv_cache_num_free_blocks"] == dc["kv_cache_num_blocks"]
    assert engines["pf"].stats()["kv_cache_num_free_blocks"] == engines["pf"].stats()["kv_cache_num_blocks"]


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_a_decode_engine_out_of_reach_is_retried_then_serves_the_request_whole(
    engines: dict[str, Any],
) -> None:
    expected = await _text(engines["co"], chat("Write one sentence about the sea."))
    pd = engines["pd_lost"]
    assert await _text(pd, chat("Write one sentence about the sea.")) == expected
    assert pd.num_retries == 1 and pd.num_fallbacks == 1 and pd.num_disaggregated == 0
    for name in ("lost", "dc"):
        stats = engines[name].stats()
        assert stats["kv_cache_num_free_blocks"] == stats["kv_cache_num_blocks"]
