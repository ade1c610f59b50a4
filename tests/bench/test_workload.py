"""Workloads: deterministic with a seed, and of the lengths asked in a real tokenizer's tokens."""

from __future__ import annotations

import asyncio
import difflib
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path

import llama_cpp
import pytest

from backends.default_model import default_model_path
from gateway.bench import BenchConfigError, WorkloadSpec, build_workload, run_benchmark
from gateway.bench.client import BenchClient
from gateway.bench.config import Target
from gateway.bench.load import arrival_offsets
from gateway.bench.runner import Calibration, calibrate

from .fake_server import Behaviour, FakeOpenAI, ServerThread, bench_config


@pytest.fixture(scope="module")
def smollm2_tokens() -> Callable[[str], int]:
    """Token count in the default model's own tokenizer (vocabulary only: no weights load)."""
    llm = llama_cpp.Llama(str(default_model_path()), vocab_only=True, verbose=False)
    return lambda text: len(llm.tokenize(text.encode(), add_bos=False, special=False))


@pytest.fixture(scope="module")
def smollm2_server(smollm2_tokens: Callable[[str], int]) -> Iterator[str]:
    """A fake server whose usage counts tokens with SmolLM2's tokenizer."""
    server = ServerThread(FakeOpenAI(Behaviour(ttft_s=0.0, gap_s=0.0, tokenize=smollm2_tokens)))
    yield server.start()
    server.stop()


@pytest.fixture(scope="module")
def tokens_per_word(smollm2_server: str) -> float:
    """Tokens per word as the tool calibrates it against the SmolLM2-counting server."""

    async def measure() -> Calibration:
        client = BenchClient(Target(label="A", url=smollm2_server), endpoint="chat", timeout_s=30)
        try:
            return await calibrate(client, seed=0)
        finally:
            await client.aclose()

    calibration = asyncio.run(measure())
    assert calibration.source == "calibrated"
    # 2 + 3 for one message; sentence breaks make the intercept a little noisy.
    assert calibration.overhead_tokens == pytest.approx(5, abs=3)
    return calibration.tokens_per_word


@pytest.mark.parametrize("name", ["fixed", "shared-prefix", "chat", "code-edit"])
def test_same_seed_same_prompts_other_seed_other_prompts(name: str) -> None:
    spec = WorkloadSpec(name=name, num_requests=5, input_len=200)
    first = build_workload(spec, seed=7, tokens_per_word=1.1)
    assert first == build_workload(spec, seed=7, tokens_per_word=1.1)
    assert first != build_workload(spec, seed=8, tokens_per_word=1.1)


def test_same_seed_same_arrival_times() -> None:
    assert arrival_offsets(50, 4.0, 1.0, seed=3) == arrival_offsets(50, 4.0, 1.0, seed=3)
    assert arrival_offsets(50, 4.0, 1.0, seed=3) != arrival_offsets(50, 4.0, 1.0, seed=4)
    assert arrival_offsets(5, None, 1.0, seed=3) == [0.0] * 5


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_arrivals_have_the_asked_rate_and_burstiness(burstiness: float) -> None:
    offsets = arrival_offsets(20_001, 8.0, burstiness, seed=0)
    gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / 8, rel=0.05)
    # Gamma with shape k: squared coefficient of variation 1/k (1 for a Poisson process).
    assert statistics.pvariance(gaps) / mean**2 == pytest.approx(1 / burstiness, rel=0.1)


@pytest.mark.parametrize("input_len", [128, 512])
@pytest.mark.parametrize("name", ["fixed", "shared-prefix"])
async def test_fixed_lengths_match_the_real_tokenizer(
    name: str, input_len: int, tokens_per_word: float, smollm2_tokens: Callable[[str], int]
) -> None:
    prompts = build_workload(
        WorkloadSpec(name=name, num_requests=20, input_len=input_len, output_len=32),
        seed=0,
        tokens_per_word=tokens_per_word,
    )
    for prompt in prompts:
        real = sum(smollm2_tokens(m["content"]) for m in prompt.messages)
        assert real == pytest.approx(input_len, rel=0.05)
        assert prompt.input_len == pytest.approx(input_len, abs=2)
        assert prompt.output_len == 32
    if name == "shared-prefix":
        prefixes = {p.messages[0]["content"] for p in prompts}
        assert len(prefixes) == 1
        assert smollm2_tokens(prefixes.pop()) == pytest.approx(input_len * 3 // 4, rel=0.05)


async def test_chat_lengths_average_to_the_asked_sizes(
    tokens_per_word: float, smollm2_tokens: Callable[[str], int]
) -> None:
    prompts = build_workload(
        WorkloadSpec(name="chat", num_requests=400, input_len=200, output_len=100),
        seed=0,
        tokens_per_word=tokens_per_word,
    )
    real = [sum(smollm2_tokens(m["content"]) for m in p.messages) for p in prompts]
    for prompt, count in zip(prompts, real, strict=True):
        assert count == pytest.approx(prompt.input_len, rel=0.1, abs=3)
    assert statistics.fmean(real) == pytest.approx(200, rel=0.1)
    assert statistics.fmean(p.output_len for p in prompts) == pytest.approx(100, rel=0.1)
    assert len({len(p.messages) for p in prompts}) >= 3  # mixed: single and multi-turn
    assert {m["role"] for p in prompts for m in p.messages} == {"system", "user", "assistant"}


async def test_code_edit_output_repeats_the_input(
    tokens_per_word: float, smollm2_tokens: Callable[[str], int]
) -> None:
    prompts = build_workload(
        WorkloadSpec(name="code-edit", num_requests=10, input_len=600),
        seed=0,
        tokens_per_word=tokens_per_word,
    )
    for prompt in prompts:
        user = prompt.messages[-1]["content"]
        code = user.split("```python\n", 1)[1].removesuffix("```")
        assert prompt.expected_output is not None
        assert sum(smollm2_tokens(m["content"]) for m in prompt.messages) == pytest.approx(
            600, rel=0.15
        )
        # The whole file comes back with one identifier changed.
        similarity = difflib.SequenceMatcher(None, code, prompt.expected_output).ratio()
        assert similarity > 0.9
        assert code != prompt.expected_output
        assert prompt.output_len == pytest.approx(smollm2_tokens(prompt.expected_output), rel=0.15)


async def test_prompt_tokens_reported_by_the_server_match_the_asked_length(
    smollm2_server: str,
) -> None:
    result = await run_benchmark(
        bench_config(
            smollm2_server,
            workload=WorkloadSpec(name="fixed", num_requests=4, input_len=300, output_len=2),
        )
    )
    assert result.calibration.source == "calibrated"
    for record in result.runs[0].records:
        assert record.prompt_tokens is not None
        assert record.prompt_tokens - 5 == pytest.approx(300, rel=0.05)  # minus the template


def test_jsonl_file_prompts_messages_lengths_and_cycling(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        '{"prompt": "one two three", "max_tokens": 7}\n'
        "\n"
        '{"messages": [{"role": "user", "content": "four five"}], "output_len": 9}\n'
    )
    prompts = build_workload(WorkloadSpec(name=str(path)), seed=0, tokens_per_word=1.0)
    assert [p.prompt for p in prompts] == ["one two three", "four five"]
    assert [p.output_len for p in prompts] == [7, 9]
    assert [p.input_len for p in prompts] == [3, 2]
    cycled = build_workload(
        WorkloadSpec(name=str(path), num_requests=5), seed=0, tokens_per_word=1.0
    )
    assert [p.prompt for p in cycled] == ["one two three", "four five"] * 2 + ["one two three"]
    fixed_output = build_workload(
        WorkloadSpec(name=str(path), output_len=3), seed=0, tokens_per_word=1.0
    )
    assert {p.output_len for p in fixed_output} == {3}


def test_bad_workloads_name_the_parameter(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n{"neither": 1}\n')
    with pytest.raises(BenchConfigError, match=r"bad.jsonl:2: give exactly one of") as info:
        build_workload(WorkloadSpec(name=str(path)), seed=0, tokens_per_word=1.0)
    assert info.value.param == "workload"
    with pytest.raises(BenchConfigError, match="neither a workload"):
        build_workload(WorkloadSpec(name="no-such-workload"), seed=0, tokens_per_word=1.0)
    with pytest.raises(BenchConfigError, match="prefix_len"):
        build_workload(
            WorkloadSpec(name="shared-prefix", input_len=100, prefix_len=100),
            seed=0,
            tokens_per_word=1.0,
        )
    with pytest.raises(BenchConfigError, match="input_len"):
        build_workload(WorkloadSpec(name="code-edit", input_len=50), seed=0, tokens_per_word=1.0)
