"""Native backends in supervised worker processes: a worker that dies never takes the gateway.

The worker processes are real (``python -m backends.worker.child``) and are killed for real
with SIGKILL and SIGSEGV: mid-stream, before the first token, and under load. The mock
backend runs in a worker where the timing must be exact (it can hold its first token); the
real llama.cpp backend runs in one under load, as it does by default.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from reliability_util import (
    assert_still_serving,
    ledger_rows,
    sse_frames,
    wait_until,
    with_ledger,
)

from backends.base import BackendConfig
from backends.worker import WorkerBackend
from backends.worker import supervisor as worker_supervisor
from gateway.testing import LiveGateway, gateway_config, mock_backend

WORDS = " ".join(f"w{i}" for i in range(120))


def in_worker(config: BackendConfig) -> BackendConfig:
    return msgspec.structs.replace(config, worker_process=True)


def stream_chat(
    gw: str, model: str, content: str, *, first_tokens: threading.Event | None = None, **fields: Any
) -> tuple[int, list[str], str]:
    """Stream a chat; ``first_tokens`` is set once a frame with choices has arrived."""
    body = {"model": model, "messages": [{"role": "user", "content": content}], "stream": True}
    with httpx.stream(
        "POST", f"{gw}/v1/chat/completions", json=body | fields, timeout=120
    ) as response:
        frames: list[str] = []
        if response.status_code != 200:
            response.read()
        elif first_tokens is None:
            frames = sse_frames(response)
        else:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    frames.append(line[len("data: ") :])
                    if '"choices":[{' in frames[-1].replace(" ", ""):
                        first_tokens.set()
        return response.status_code, frames, response.headers.get("x-request-id", "")


def worker_of(gw: LiveGateway, name: str) -> WorkerBackend:
    backend = gw.backend(name)
    assert isinstance(backend, WorkerBackend)
    return backend


def kill_when_running(backend: WorkerBackend, sig: signal.Signals) -> int:
    """Wait until the worker runs a generation, then send it ``sig``; returns the old pid."""
    wait_until(lambda: backend.stats().get("worker_tasks", 0) >= 1, timeout_s=30)
    pid = backend.pid
    assert pid is not None and pid != os.getpid()
    os.kill(pid, sig)
    return pid


def wait_restarted(backend: WorkerBackend, restarts: int) -> None:
    wait_until(lambda: backend.state == "up" and backend.restarts >= restarts, timeout_s=120)


# -- the mock backend in a worker --------------------------------------------------------------


@pytest.fixture()
def mock_worker_gateway(live_gateway: Any, tmp_path: Path) -> Iterator[LiveGateway]:
    config = gateway_config(
        in_worker(mock_backend("slow_start", first_token_delay_s=30.0)),
        in_worker(mock_backend("w", token_delay_s=0.02)),
        mock_backend("local"),
        models={"fallback": ["slow_start", "local"], "worker": ["w"], "local": ["local"]},
    )
    with live_gateway(with_ledger(config, tmp_path / "ledger.sqlite3")) as gw:
        yield gw


def test_a_worker_backend_runs_in_its_own_process_and_streams(
    mock_worker_gateway: LiveGateway,
) -> None:
    gw = mock_worker_gateway
    backend = worker_of(gw, "w")
    assert backend.pid not in (None, os.getpid())
    status, frames, _ = stream_chat(gw, "worker", "one two three")
    assert status == 200 and frames[-1] == "[DONE]"
    text = "".join(
        c["choices"][0]["delta"].get("content") or ""
        for c in map(json.loads, frames[:-1])
        if c["choices"]
    )
    assert text.split() == ["one", "two", "three"]
    reply = gw.openai_client().chat.completions.create(
        model="worker", messages=[{"role": "user", "content": "a b"}], logprobs=True
    )
    assert reply.choices[0].message.content == "a b"
    assert reply.choices[0].logprobs is not None and len(reply.choices[0].logprobs.content) == 2
    assert reply.usage is not None and reply.usage.completion_tokens == 2


def test_a_client_that_goes_away_cancels_the_generation_in_the_worker(
    mock_worker_gateway: LiveGateway,
) -> None:
    backend = worker_of(mock_worker_gateway, "w")
    before = backend.stats().get("num_aborted", 0)
    body = {"model": "worker", "messages": [{"role": "user", "content": WORDS}], "stream": True}
    with httpx.stream(
        "POST", f"{mock_worker_gateway}/v1/chat/completions", json=body, timeout=60
    ) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
    wait_until(lambda: backend.stats().get("num_aborted", 0) == before + 1, timeout_s=30)
    assert backend.stats()["worker_tasks"] == 0


def test_a_worker_killed_before_the_first_token_falls_back_to_the_next_backend(
    mock_worker_gateway: LiveGateway,
) -> None:
    gw = mock_worker_gateway
    backend = worker_of(gw, "slow_start")
    answer: dict[str, httpx.Response] = {}
    body = {"model": "fallback", "messages": [{"role": "user", "content": "hello there"}]}
    thread = threading.Thread(
        target=lambda: answer.setdefault(
            "r", httpx.post(f"{gw}/v1/chat/completions", json=body, timeout=120)
        )
    )
    thread.start()
    kill_when_running(backend, signal.SIGKILL)
    thread.join(timeout=120)
    response = answer["r"]
    assert response.status_code == 200, response.text
    assert response.headers["x-infermux-backend"] == "local"
    assert response.json()["choices"][0]["message"]["content"] == "hello there"
    wait_restarted(backend, 1)
    assert "SIGKILL" in (backend.last_exit or "")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV], ids=["SIGKILL", "SIGSEGV"])
def test_a_worker_killed_mid_stream_ends_the_stream_with_an_error_frame(
    mock_worker_gateway: LiveGateway, tmp_path: Path, sig: signal.Signals
) -> None:
    gw = mock_worker_gateway
    backend = worker_of(gw, "w")
    restarts = backend.restarts
    result: dict[str, Any] = {}
    first_tokens = threading.Event()
    thread = threading.Thread(
        target=lambda: result.setdefault("r", stream_chat(gw, "worker", WORDS, first_tokens=first_tokens))
    )
    thread.start()
    assert first_tokens.wait(timeout=30)  # the client has its first tokens
    kill_when_running(backend, sig)
    thread.join(timeout=60)
    status, frames, request_id = result["r"]
    assert status == 200
    assert "[DONE]" not in frames
    error = json.loads(frames[-1])["error"]
    assert error["code"] == "backend_unavailable"
    assert sig.name in error["message"]
    assert any(json.loads(f).get("choices") for f in frames[:-1])  # tokens came first
    assert_still_serving(gw, model="local")  # the gateway and the other backends live
    wait_restarted(backend, restarts + 1)
    status, frames, _ = stream_chat(gw, "worker", "back again")
    assert status == 200 and frames[-1] == "[DONE]"
    wait_until(lambda: len(ledger_rows(tmp_path / "ledger.sqlite3", request_id)) == 1)


def test_ready_and_metrics_say_when_a_worker_is_down(
    live_gateway: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A longer first back-off, so that the "restarting" state lasts long enough to be seen.
    monkeypatch.setattr(worker_supervisor, "_BACKOFF_FIRST_S", 3.0)
    config = gateway_config(
        in_worker(mock_backend("w")), mock_backend("other"),
        models={"only_worker": ["w"], "other": ["other"]},
    )  # fmt: skip
    with live_gateway(config) as gw:
        backend = worker_of(gw, "w")
        assert httpx.get(f"{gw}/ready").status_code == 200
        assert 'infermux_backend_worker_up{backend="w"} 1.0' in httpx.get(f"{gw}/metrics").text
        os.kill(backend.pid or 0, signal.SIGKILL)
        wait_until(lambda: backend.state == "restarting", timeout_s=10)
        ready = httpx.get(f"{gw}/ready")
        assert ready.status_code == 503
        body = ready.json()
        assert body["status"] == "unavailable"
        assert body["models"] == {"only_worker": "no started backend"}
        assert body["backends"] == {"w": "restarting", "other": "ready"}
        # States only on the public probe; why the worker died is in the log.
        assert "SIGKILL" not in ready.text
        assert "was killed by SIGKILL" in caplog.text
        metrics = httpx.get(f"{gw}/metrics").text
        assert 'infermux_backend_worker_up{backend="w"} 0.0' in metrics
        error = httpx.post(
            f"{gw}/v1/chat/completions",
            json={"model": "only_worker", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert error.status_code == 503
        assert error.json()["error"]["code"] == "backend_unavailable"
        wait_restarted(backend, 1)
        assert httpx.get(f"{gw}/ready").status_code == 200
        metrics = httpx.get(f"{gw}/metrics").text
        assert 'infermux_backend_worker_restarts_total{backend="w"} 1.0' in metrics
        assert 'infermux_backend_worker_up{backend="w"} 1.0' in metrics


# -- the real llama.cpp backend in its (default) worker ----------------------------------------


@pytest.fixture(scope="module")
def llama_gateway(live_gateway: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    ledger = tmp_path_factory.mktemp("ledger") / "ledger.sqlite3"
    config = gateway_config(
        BackendConfig(name="llama", kind="llamacpp", options={"n_ctx": 512}),
        models={"llama": ["llama"]},
    )
    with live_gateway(with_ledger(config, ledger)) as gw:
        yield gw, ledger


@pytest.mark.slow
def test_llamacpp_runs_in_a_worker_by_default_with_logprobs_and_cached_prompts(
    llama_gateway: Any,
) -> None:
    gw, _ = llama_gateway
    backend = worker_of(gw, "llama")
    assert backend.kind == "llamacpp"
    client = gw.openai_client()
    messages = [{"role": "user", "content": "Name three colours of the rainbow, please."}]
    first = client.chat.completions.create(
        model="llama", messages=messages, max_tokens=8, temperature=0, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    again = client.chat.completions.create(
        model="llama", messages=messages, max_tokens=8, temperature=0
    )
    assert first.choices[0].message.content == again.choices[0].message.content
    content = first.choices[0].logprobs.content
    assert len(content) == first.usage.completion_tokens and len(content[0].top_logprobs) == 2
    assert again.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGKILL], ids=["SIGSEGV", "SIGKILL"])
def test_a_llamacpp_worker_crash_under_load_fails_requests_cleanly(
    llama_gateway: Any, sig: signal.Signals
) -> None:
    gw, ledger = llama_gateway
    backend = worker_of(gw, "llama")
    restarts = backend.restarts
    results: list[tuple[int, list[str], str]] = []
    lock = threading.Lock()

    def one(k: int) -> None:
        outcome = stream_chat(
            gw, "llama", f"Story {k}: once upon a time", max_tokens=200, ignore_eos=True
        )
        with lock:
            results.append(outcome)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(6)]
    for thread in threads:
        thread.start()
    wait_until(lambda: backend.num_generated_tokens > 20, timeout_s=60)
    os.kill(backend.pid or 0, sig)
    for thread in threads:
        thread.join(timeout=120)
        assert not thread.is_alive(), "a request hung after the worker died"
    assert len(results) == 6
    for status, frames, _ in results:
        if status == 200:  # streamed: either finished before the crash or ended by the error
            if frames[-1] != "[DONE]":
                assert json.loads(frames[-1])["error"]["code"] == "backend_unavailable"
        else:  # not started yet when it died: a retryable 503 before the first byte
            assert status == 503
    assert any(frames and frames[-1] != "[DONE]" for _, frames, _ in results)
    assert httpx.get(f"{gw}/health").status_code == 200
    wait_restarted(backend, restarts + 1)
    assert_still_serving(gw, model="llama")
    for _, _, request_id in results:
        wait_until(lambda rid=request_id: len(ledger_rows(ledger, rid)) == 1)


# -- the core engine in its (default) engine process --------------------------------------------


@pytest.fixture(scope="module")
def core_gateway(live_gateway: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    ledger = tmp_path_factory.mktemp("ledger") / "ledger.sqlite3"
    config = gateway_config(
        BackendConfig(
            name="core", kind="core_engine",
            options={"num_threads": 1, "kv_cache_memory_mb": 128, "max_num_seqs": 8},
        ),
        mock_backend("local"),
        models={"core": ["core"], "core_or_local": ["core", "local"], "local": ["local"]},
    )  # fmt: skip
    with live_gateway(with_ledger(config, ledger)) as gw:
        yield gw, ledger


def greedy(gw: LiveGateway, model: str = "core") -> str:
    reply = gw.openai_client().chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=12, temperature=0,
    )  # fmt: skip
    return reply.choices[0].message.content or ""


@pytest.mark.slow
def test_the_core_engine_runs_in_its_own_process_by_default(core_gateway: Any) -> None:
    gw, _ = core_gateway
    backend = worker_of(gw, "core")
    assert backend.kind == "core_engine" and backend.pid not in (None, os.getpid())
    text = greedy(gw)
    assert text and greedy(gw) == text
    # The engine's figures cross the channel (for /metrics).
    wait_until(lambda: backend.stats().get("kv_cache_num_blocks", 0) > 0, timeout_s=10)
    metrics = httpx.get(f"{gw}/metrics").text
    assert 'infermux_backend_worker_up{backend="core"} 1.0' in metrics


@pytest.mark.slow
def test_a_killed_engine_process_falls_back_turns_unready_restarts_and_serves_again(
    core_gateway: Any,
) -> None:
    gw, ledger = core_gateway
    backend = worker_of(gw, "core")
    before = greedy(gw)
    restarts = backend.restarts
    results: dict[str, httpx.Response] = {}
    lock = threading.Lock()

    def one(name: str, content: str) -> None:
        body = {
            "model": "core_or_local", "max_tokens": 400, "ignore_eos": True,
            "messages": [{"role": "user", "content": content}],
        }  # fmt: skip
        response = httpx.post(f"{gw}/v1/chat/completions", json=body, timeout=120)
        with lock:
            results[name] = response

    threads = [
        threading.Thread(target=one, args=(f"decoding-{k}", f"Story {k}: once upon a time"))
        for k in range(3)
    ]
    for thread in threads:
        thread.start()
    wait_until(lambda: backend.num_generated_tokens > 20, timeout_s=60)
    # A long prompt is still being prefilled (no first token yet) when the process dies.
    threads.append(threading.Thread(target=one, args=("prefilling", WORDS * 3)))
    threads[-1].start()
    wait_until(lambda: backend.stats().get("worker_tasks", 0) >= 4, timeout_s=60)
    os.kill(backend.pid or 0, signal.SIGKILL)
    wait_until(lambda: backend.state == "restarting", timeout_s=10)
    ready = httpx.get(f"{gw}/ready")
    assert ready.status_code == 503 and ready.json()["backends"]["core"] == "restarting"
    for thread in threads:
        thread.join(timeout=120)
        assert not thread.is_alive(), "a request hung after the engine process died"
    # Before its first chunk a request is retried on the alias's next backend; after it (the
    # engine had begun answering), it fails with a retryable 503 naming the signal.
    fell_back = results.pop("prefilling")
    assert fell_back.status_code == 200 and fell_back.headers["x-infermux-backend"] == "local"
    for response in results.values():
        if response.status_code != 200:
            assert response.status_code == 503 and "retry-after" in response.headers
            error = response.json()["error"]
            assert error["code"] == "backend_unavailable" and "SIGKILL" in error["message"]
    results["prefilling"] = fell_back
    wait_restarted(backend, restarts + 1)
    assert httpx.get(f"{gw}/ready").status_code == 200
    assert greedy(gw) == before
    for response in results.values():
        rid = response.headers["x-request-id"]
        wait_until(lambda rid=rid: len(ledger_rows(ledger, rid)) == 1)


# -- start-up: ready means ready ---------------------------------------------------------------


def test_ready_is_503_naming_the_model_while_it_has_no_started_backend(
    live_gateway: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = str(tmp_path / "missing.gguf")
    config = gateway_config(
        BackendConfig(
            name="broken", kind="llamacpp", options={"model_path": missing}, optional=True
        ),
        mock_backend("fine"),
        models={"needs_broken": ["broken"], "served": ["broken", "fine"]},
    )
    with live_gateway(config, allow_failed_backends=True) as gw:
        ready = httpx.get(f"{gw}/ready")
        assert ready.status_code == 503
        body = ready.json()
        assert body["status"] == "unavailable"
        assert body["models"] == {"needs_broken": "no started backend"}
        assert body["backends"] == {"broken": "failed", "fine": "ready"}
        # The reason, with the model file's path, goes to the log, not to the public probe.
        assert missing not in ready.text and "model file not found" in caplog.text
        assert_still_serving(gw, model="served")


def _serve(config_path: Path, port: int) -> subprocess.Popen[str]:
    # Run in the config's folder (the test's tmp_path), the usage ledger with it: never ./var.
    env = {**os.environ, "INFERMUX_LEDGER_PATH": str(config_path.parent / "ledger.sqlite3")}
    return subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config_path),
         "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=config_path.parent, env=env,
    )  # fmt: skip


def _serve_until_it_exits(config_path: Path) -> tuple[int, str]:
    """``infermux serve`` of a config it must refuse: its exit code and output."""
    proc = _serve(config_path, _free_port())
    try:
        output, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, output


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_serve_exits_non_zero_when_a_backend_cannot_start_as_configured(tmp_path: Path) -> None:
    config = tmp_path / "infermux.toml"
    config.write_text(
        f"""
[[backends]]
name = "llama"
kind = "llamacpp"
options = {{ model_path = "{tmp_path / "nope.gguf"}" }}

[[models]]
alias = "m"
backends = ["llama"]
"""
    )
    returncode, output = _serve_until_it_exits(config)
    assert returncode == 2, output
    assert "cannot start as configured" in output
    assert "nope.gguf" in output and "optional = true" in output


def test_serve_goes_on_without_an_optional_backend(tmp_path: Path) -> None:
    config = tmp_path / "infermux.toml"
    config.write_text(
        f"""
[[backends]]
name = "llama"
kind = "llamacpp"
optional = true
options = {{ model_path = "{tmp_path / "nope.gguf"}" }}

[[backends]]
name = "echo"
kind = "mock"

[[models]]
alias = "m"
backends = ["llama", "echo"]
"""
    )
    port = _free_port()
    proc = _serve(config, port)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                ready = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5)
                if ready.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "not ready"
            time.sleep(0.2)
        assert_still_serving(f"http://127.0.0.1:{port}", model="m")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == 0


def test_a_weight_format_this_cpu_cannot_run_is_refused_when_the_config_is_read(tmp_path: Path) -> None:
    # Seen on an AMX Xeon: dtype "auto" picked bf16 and weight_format "int8" refused it, yet
    # /ready said 200 and every request got 503. Every weight_format x dtype that cannot run
    # is now a configuration error, before any model is loaded (int8/int4 run with bf16;
    # fbgemm's fp16 weights still need float32).
    config = tmp_path / "infermux.toml"
    config.write_text(
        """
[[backends]]
name = "core"
kind = "core_engine"
options = { dtype = "bfloat16", weight_format = "fp16" }

[[models]]
alias = "m"
backends = ["core"]
"""
    )
    returncode, output = _serve_until_it_exits(config)
    assert returncode != 0, output
    assert "backends.core.options" in output
    assert "weight_format='fp16'" in output and "dtype='bfloat16'" in output
    assert "Traceback" not in output
