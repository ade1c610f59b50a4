"""The benchmark against llama-cpp-python's own OpenAI server on the default model, the peer
of docs/benchmarks.md: its streams carry no usage, and it names the model by its path."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from backends.default_model import default_model_path
from backends.threads import default_num_threads
from gateway.bench import BenchConfig, Target, WorkloadSpec, run_benchmark


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def llamacpp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    # A file, not a pipe: llama.cpp logs more at load than a pipe holds unread.
    log_path = tmp_path_factory.mktemp("llamacpp") / "server.log"
    log = log_path.open("wb")
    process = subprocess.Popen(
        [
            sys.executable, "-m", "llama_cpp.server",
            "--model", str(default_model_path()),
            "--host", "127.0.0.1", "--port", str(port),
            "--n_threads", str(default_num_threads()), "--n_ctx", "2048",
            # By default a new request interrupts the running one: a benchmark must not.
            "--interrupt_requests", "False",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                output = log_path.read_text(errors="replace")
                raise RuntimeError(f"llama_cpp.server exited: {output[-2000:]}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("llama_cpp.server did not start")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


@pytest.mark.slow
async def test_bench_against_llama_cpp_python_server(llamacpp_server: str) -> None:
    result = await run_benchmark(
        BenchConfig(
            targets=[Target(label="A", url=llamacpp_server)],
            workload=WorkloadSpec(name="fixed", num_requests=2, input_len=32, output_len=5),
            concurrency=1,
            progress=False,
        )
    )
    run = result.runs[0]
    assert run.model == str(default_model_path())  # discovered through GET /v1/models
    # Calibration reads usage from non-streaming replies, which this server does send.
    assert result.calibration.source == "calibrated"
    assert 0.8 < result.calibration.tokens_per_word < 1.5
    summary = run.summary
    assert summary.num_completed == 2, summary.errors
    assert summary.usage_reported_fraction == 0.0
    for record in run.records:
        # No usage in the stream: one content chunk per token.
        assert record.output_tokens == record.num_chunks
        assert 1 <= record.num_chunks <= 5
        assert record.ttft_ms is not None and record.e2e_ms is not None
        assert record.ttft_ms <= record.e2e_ms
        assert len(record.itl_ms) == record.num_chunks - 1
