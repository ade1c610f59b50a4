"""``vllm bench serve``'s flag names: each one gives the workload its native flag gives, the
flags with no counterpart are refused naming themselves, and a command line written for
vLLM's benchmark runs against a real gateway."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

from gateway.bench.cli import add_arguments, config_from_args, main
from gateway.bench.config import BenchConfig
from gateway.testing import LiveGateway, gateway_config, mock_backend

URL = "http://127.0.0.1:9"
PROMPTS_FILE = "<prompts.jsonl>"  # replaced by a file under tmp_path


def parsed(argv: list[str], tmp_path: Path) -> tuple[BenchConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "one two three"}\n{"prompt": "four five"}\n')
    args = parser.parse_args([str(prompts) if a == PROMPTS_FILE else a for a in argv])
    return config_from_args(args), args


@pytest.mark.parametrize(
    ("vllm", "native"),
    [
        (["--base-url", URL], ["--url", URL]),
        (["--host", "127.0.0.1", "--port", "9"], ["--url", URL]),
        (["--base-url", URL, "--num-prompts", "7"], ["--url", URL, "--num-requests", "7"]),
        (
            ["--base-url", URL, "--random-input-len", "64", "--random-output-len", "8"],
            ["--url", URL, "--input-len", "64", "--output-len", "8"],
        ),
        (["--base-url", URL, "--max-concurrency", "4"], ["--url", URL, "--concurrency", "4"]),
        (["--base-url", URL, "--num-warmups", "2"], ["--url", URL, "--warmup", "2"]),
        (["--base-url", URL, "--disable-tqdm"], ["--url", URL, "--no-progress"]),
        (
            ["--base-url", URL, "--endpoint", "/v1/completions"],
            ["--url", URL, "--endpoint", "completions"],
        ),
        (
            ["--base-url", URL, "--endpoint", "/v1/chat/completions"],
            ["--url", URL, "--endpoint", "chat"],
        ),
        (["--base-url", URL, "--backend", "openai"], ["--url", URL, "--endpoint", "completions"]),
        (["--base-url", URL, "--backend", "openai-chat"], ["--url", URL, "--endpoint", "chat"]),
        (
            ["--base-url", URL, "--dataset-name", "random"],
            ["--url", URL, "--workload", "fixed", "--ignore-eos"],
        ),
        (
            ["--base-url", URL, "--dataset-name", "custom", "--dataset-path", PROMPTS_FILE],
            ["--url", URL, "--workload", PROMPTS_FILE],
        ),
        (
            ["--base-url", URL, "--random-input-len", "64", "--random-prefix-len", "32"],
            ["--url", URL, "--workload", "shared-prefix", "--prefix-len", "32", "--input-len", "96"],
        ),
        (
            ["--base-url", URL, "--goodput", "ttft:500", "tpot:50", "e2el:2000"],
            ["--url", URL, "--slo", "ttft=500ms,tpot=50ms,e2e=2000ms"],
        ),
        (
            ["--base-url", URL, "--model", "org/weights", "--served-model-name", "m"],
            ["--url", URL, "--model", "m"],
        ),
        (
            ["--base-url", URL, "--top-p", "0.9", "--top-k", "5", "--extra-body", '{"top_k": 7}'],
            ["--url", URL, "--extra-body", '{"top_p": 0.9, "top_k": 7}'],
        ),
        (["--base-url", URL, "--header", "x-a=1", "x-b=2"], ["--url", URL, "--header", "x-a:1", "--header", "x-b:2"]),
        (
            [
                "--base-url", URL, "--random-range-ratio", "0",
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            ],
            ["--url", URL],
        ),
    ],
)  # fmt: skip
def test_each_vllm_flag_gives_the_workload_of_its_native_flag(
    vllm: list[str], native: list[str], tmp_path: Path
) -> None:
    theirs, _ = parsed(vllm, tmp_path)
    ours, _ = parsed(native, tmp_path)
    assert theirs == ours


def test_save_result_writes_where_json_would(tmp_path: Path) -> None:
    _, args = parsed(
        ["--base-url", URL, "--save-result", "--result-dir", "out", "--result-filename", "r.json"],
        tmp_path,
    )
    assert args.json == str(Path("out") / "r.json")


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--tokenizer", "org/model"], "--tokenizer"),
        (["--trust-remote-code"], "--trust-remote-code"),
        (["--ramp-up-strategy", "linear"], "--ramp-up-strategy"),
        (["--dataset-name", "sharegpt"], "--dataset-name"),
        (["--dataset-path", "x.json"], "--dataset-path"),
        (["--random-range-ratio", "0.5"], "--random-range-ratio"),
        (["--metric-percentiles", "75"], "--metric-percentiles"),
        (["--percentile-metrics", "latency"], "--percentile-metrics"),
        (["--goodput", "ttft500"], "--goodput"),
        (["--host", "127.0.0.1"], "--host"),
        (["--backend", "openai-chat", "--endpoint", "completions"], "--backend"),
        (["--result-dir", "out"], "--result-dir"),
        (["--dataset-name", "random", "--workload", "chat"], "--dataset-name"),
    ],
)
def test_vllm_flags_without_a_counterpart_are_refused_by_name(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--url", URL, *flags]) == 2
    err = capsys.readouterr().err
    assert f"error: {named}" in err


def test_no_endpoint_at_all_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--num-prompts", "3"]) == 2
    assert "--url" in capsys.readouterr().err


@pytest.fixture(scope="module")
def gateway(
    live_gateway: Callable[..., AbstractContextManager[LiveGateway]],
) -> Iterator[LiveGateway]:
    with live_gateway(gateway_config(mock_backend("a"))) as gw:
        yield gw


def test_a_vllm_command_line_runs_against_a_gateway(
    gateway: LiveGateway, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The flags of a typical ``vllm bench serve`` run, and the same run in native flags:
    the same requests, the same report and JSON fields."""
    url = str(gateway)
    vllm = [
        "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", "echo", "--dataset-name", "random", "--num-prompts", "4",
        "--random-input-len", "12", "--random-output-len", "3", "--max-concurrency", "2",
        "--request-rate", "inf", "--seed", "1", "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "99",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "vllm.json",
    ]  # fmt: skip
    native = [
        "--url", url, "--endpoint", "completions", "--model", "echo",
        "--workload", "fixed", "--ignore-eos", "--num-requests", "4",
        "--input-len", "12", "--output-len", "3", "--concurrency", "2",
        "--request-rate", "inf", "--seed", "1", "--no-progress",
        "--json", str(tmp_path / "native.json"),
    ]  # fmt: skip
    assert main(vllm) == 0
    vllm_out = capsys.readouterr().out
    assert main(native) == 0
    native_out = capsys.readouterr().out

    def fields(report: str) -> list[str]:
        return [line.split("  ")[0] for line in report.splitlines() if line and line[0] != " "]

    assert "TTFT p99 (ms)" in vllm_out
    assert fields(vllm_out)[:-1] == fields(native_out)[:-1]  # the last: "wrote <file>"
    theirs: dict[str, Any] = json.loads((tmp_path / "vllm.json").read_text())
    ours: dict[str, Any] = json.loads((tmp_path / "native.json").read_text())
    assert theirs["config"] == ours["config"]
    (run,) = theirs["runs"]
    assert run["summary"].keys() == ours["runs"][0]["summary"].keys()
    assert run["summary"]["num_completed"] == 4
    assert [r["output_tokens"] for r in run["records"]] == [3] * 4
    sent = [r["input_len"] for r in run["records"]]
    assert sent == [r["input_len"] for r in ours["runs"][0]["records"]]
