"""The command line: `python -m gateway.bench` in a subprocess, `infermux bench` through
add_parser, the JSON file, the PNG plots and flag errors."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import matplotlib.image
import pytest

from gateway.bench.cli import add_parser, config_from_args, main, run

from .fake_server import Behaviour

REPO = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_valid_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    height, width, _channels = matplotlib.image.imread(path).shape
    assert height > 100 and width > 100


def test_subprocess_sweep_writes_json_and_plots(
    fake_server: Callable[[Behaviour], str], tmp_path: Path
) -> None:
    url = fake_server(Behaviour(ttft_s=0.05, gap_s=0.01, slow_every=3, slow_ttft_s=0.3))
    completed = subprocess.run(
        [
            sys.executable, "-m", "gateway.bench",
            "--url", url, "--api-key", "sk-very-secret",
            "--workload", "fixed", "--num-requests", "6", "--input-len", "32", "--output-len", "4",
            "--request-rate", "20", "--request-rate", "40,inf",
            "--slo", "ttft=200ms", "--price", "input=0.15,output=0.6",
            "--json", str(tmp_path / "out.json"), "--plot", str(tmp_path / "plots"),
        ],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    out = completed.stdout
    for rate in ("20", "40", "inf"):
        assert f"== request rate {rate} req/s" in out
    assert (
        "TTFT p99 (ms)" in out and "goodput (req/s) [ttft<=200ms]" in out and "== sweep ==" in out
    )
    assert "sk-very-secret" not in out

    text = (tmp_path / "out.json").read_text()
    assert "sk-very-secret" not in text
    data = json.loads(text)
    assert data["config"]["request_rates"] == [20.0, 40.0, None]
    assert data["calibration"]["source"] == "calibrated"
    assert len(data["runs"]) == 3
    for run_data in data["runs"]:
        summary = run_data["summary"]
        assert summary["num_completed"] == 6
        # The --slo flag is applied to what was measured (the figures themselves are real time,
        # so they are not held to the injected delays here; test_timing.py does that).
        within = [r["ttft_ms"] <= 200 for r in run_data["records"]]
        assert summary["slo_attainment"] == pytest.approx(sum(within) / 6)
        assert summary["cost"] > 0
        assert len(run_data["records"]) == 6
        record = run_data["records"][0]
        assert len(record["itl_ms"]) == 3 and record["output_tokens"] == 4
        assert all(0 < r["ttft_ms"] <= r["e2e_ms"] for r in run_data["records"])

    plots = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert plots == [
        "goodput_vs_rate.png",
        "latency_cdf.png",
        "latency_vs_rate.png",
        "throughput_vs_rate.png",
    ]
    for name in plots:
        assert_valid_png(tmp_path / "plots" / name)


def infermux_parser() -> argparse.ArgumentParser:
    """What gateway/cli.py does with this module."""
    parser = argparse.ArgumentParser(prog="infermux")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_parser(subparsers)
    return parser


def test_infermux_bench_subcommand_with_compare_and_headers(
    fake_server: Callable[[Behaviour], str], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = Behaviour(ttft_s=0.02, gap_s=0.005), Behaviour(ttft_s=0.02, gap_s=0.005)
    url_a, url_b = fake_server(a), fake_server(b)
    args = infermux_parser().parse_args(
        [
            "bench", "--url", url_a, "--compare", url_b, "--model2", "other",
            "--header", "x-team:bench", "--header2", "x-infermux-backend:core_engine",
            "--num-requests", "3", "--input-len", "16", "--output-len", "3",
            "--concurrency", "1", "--tokens-per-word", "1.3", "--no-progress",
        ]
    )  # fmt: skip
    assert args.func is run
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "B = other at" in out and "[x-team: bench, x-infermux-backend: core_engine]" in out
    streamed_a = [h for h in a.headers if "x-team" in h]
    streamed_b = [h for h in b.headers if "x-team" in h]
    assert all("x-infermux-backend" not in h for h in streamed_a)
    assert all(h["x-infermux-backend"] == "core_engine" for h in streamed_b)
    assert [body["model"] for body in b.bodies] == ["other"] * 3
    assert "tokens per word 1.300 (given)" in out


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--slo", "ttft=fast"], "--slo"),
        (["--price", "input=1"], "--price"),
        (["--request-rate", "0"], "--request-rate"),
        (["--header", "no-colon"], "--header"),
        (["--model2", "m"], "--model2"),
        (["--concurrency", "0"], "concurrency"),
        (["--extra-body", "[1]"], "--extra-body"),
        (["--tokens-per-word", "many"], "--tokens-per-word"),
        (["--workload", "no/such/file.jsonl"], "workload"),
        (["--workload", "shared-prefix", "--prefix-len", "999"], "prefix_len"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--url", "http://127.0.0.1:9", *flags]) == 2
    assert named in capsys.readouterr().err


def test_unreachable_endpoint_fails_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    # Port 9 (discard) is closed on loopback: nothing listens there.
    code = main(["--url", "http://127.0.0.1:9", "--no-progress", "--num-requests", "2"])
    assert code == 1
    assert "give --model" in capsys.readouterr().err


def test_api_key_from_the_environment_is_not_a_help_default(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
    parser = infermux_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--help"])
    assert "sk-from-env" not in capsys.readouterr().out
    config = config_from_args(parser.parse_args(["bench", "--url", "http://x"]))
    assert config.targets[0].api_key == "sk-from-env"
