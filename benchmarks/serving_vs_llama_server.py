"""infermux serve (no config) against llama.cpp's own C++ llama-server, in one run.

Both servers serve the default model (SmolLM2-135M-Instruct Q4_1) on 127.0.0.1:

* ``infermux``: ``.venv/bin/infermux serve --port P``, what ``make serve`` runs (no config,
  and no ``INFERMUX_*`` variables passed on). ``--infermux-backend a,b`` pins backends with
  ``x-infermux-backend``, each measured against the same llama-server run.
* ``llama-server``: ``llama-server -m MODEL -np 16 -t 2 -c 32768 -cb --port Q``: 16 slots of
  2,048 tokens, continuous batching, no ``--cache-reuse`` (no two prompts share a prefix
  worth reusing). Built by ``scripts/build_llama_server.sh`` from the llama.cpp tree vendored
  in the llama-cpp-python sdist that infermux's ``llamacpp`` backend is built from.

Requests come from ``gateway.bench`` (the engine of ``infermux bench``): streaming chat, the
``fixed`` workload, temperature 0, ``max_tokens`` 128 with ``ignore_eos`` so that every answer
is exactly 128 tokens (checked against each stream's usage; a mismatch fails the run). The two
servers are never loaded together (2 cores): each concurrency level runs in blocks, one
server's block then the other's, the order flipping from block to block and from level to
level (ABBA), after a few warm-up requests. A block's prompts are new (no prefix-cache hits
between blocks) and the same for every server. Each block records the CPU seconds of both
servers' process trees (an idle server that kept a core busy would show), the cores other
processes of the machine kept busy (a shared machine's noise, ``/proc/stat``) and, for
infermux, which backends served it (``GET /metrics``: a fallback from ``llamacpp`` would show).

    .venv/bin/python benchmarks/serving_vs_llama_server.py                   # full run
    .venv/bin/python benchmarks/serving_vs_llama_server.py --quick           # smoke run
    .venv/bin/python benchmarks/serving_vs_llama_server.py --infermux-backend llamacpp,core_engine

Writes ``benchmarks/results/serving_vs_llama_server/<UTC time>.json`` (every figure, the
command lines, the machine) and ``.png``; prints a table with infermux/llama-server ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import functools
import os
import platform
import re
import resource
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec

from backends.default_model import DEFAULT_MODEL_ALIAS, default_model_path
from gateway.bench import (
    BenchConfig,
    RunResult,
    RunSummary,
    Slo,
    Target,
    WorkloadSpec,
    run_benchmark,
)
from gateway.bench.client import BenchClient
from gateway.bench.metrics import summarise
from gateway.bench.runner import calibrate

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "serving_vs_llama_server"
PEER = "llama-server"
PIN_HEADER = "x-infermux-backend"
#: The flags llama.cpp's CPU kernels dispatch on, named in the machine record.
_CPU_FLAGS = (
    "sse4_2 avx avx2 fma f16c avx_vnni avx512f avx512bw avx512vl avx512_vnni avx512_bf16 "
    "amx_tile amx_int8 amx_bf16"
).split()
_REQUESTS_TOTAL = re.compile(r"^infermux_requests_total\{(?P<labels>[^}]*)\}\s+(?P<n>\S+)$", re.M)


# --- the servers -------------------------------------------------------------------------


@dataclass(frozen=True)
class Server:
    """A server process this benchmark started."""

    name: str  # "infermux" or "llama-server"
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path


@dataclass(frozen=True)
class Contender:
    """What one column of the results measures: a server, for infermux maybe a pinned backend."""

    label: str  # "llama-server", "infermux", "infermux:core_engine"
    server: Server
    target: Target


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def _server(
    name: str, command: list[str], port: int, ready_path: str, log_dir: Path
) -> Iterator[Server]:
    """Start ``command`` in its own process group, wait until ``ready_path`` answers 200, and
    stop the whole group (TERM, then KILL) however the block is left."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INFERMUX_", "LLAMA_ARG_"))}
    log_path = log_dir / f"{name}.log"
    print(f"starting {name}: {shlex.join(command)}", flush=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    server = Server(name, f"http://127.0.0.1:{port}", process, log_path)
    try:
        _wait_ready(server, ready_path, timeout_s=900)
        yield server
    finally:
        for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=wait_s)
                break
        with contextlib.suppress(ProcessLookupError):  # children that outlived the leader
            os.killpg(process.pid, signal.SIGKILL)


def _wait_ready(server: Server, path: str, timeout_s: float) -> None:
    """Poll ``path`` until 200, echoing the log's last line every 10 s; fail with its tail."""
    started = time.monotonic()
    next_note = started + 10
    while time.monotonic() - started < timeout_s and server.process.poll() is None:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(server.url + path, timeout=2.0).status_code == 200:
                print(f"  {server.name} ready after {time.monotonic() - started:.0f} s", flush=True)
                return
        if time.monotonic() >= next_note:
            lines = server.log_path.read_text(errors="replace").strip().splitlines()
            lines = [line for line in lines if f"{path} HTTP" not in line]  # not our own polls
            print(f"  ... {server.name}: {lines[-1][:110] if lines else ''}", flush=True)
            next_note += 10
        time.sleep(0.5)
    code = server.process.poll()
    tail = "\n".join(server.log_path.read_text(errors="replace").splitlines()[-30:])
    state = "not ready" if code is None else f"exited with {code}"
    raise SystemExit(f"{server.name} {state} ({server.url}{path}); end of its log:\n{tail}")


def _llama_server_binary(path: str | None) -> Path:
    """``--llama-server``, else what scripts/build_llama_server.sh built (or builds now)."""
    if path:
        return Path(path)
    print("llama-server: scripts/build_llama_server.sh (the first build takes minutes)", flush=True)
    script = ROOT / "scripts" / "build_llama_server.sh"
    output = subprocess.run([str(script)], check=True, stdout=subprocess.PIPE, text=True).stdout
    return Path(output.strip().splitlines()[-1])


def _tree_cpu_seconds(root_pid: int) -> float:
    """User + system CPU seconds of a process and its live descendants (Linux /proc)."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            pid = int(stat.parent.name)
            parents[pid] = int(fields[1])
            cpu[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    tree, frontier = {root_pid}, [root_pid]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier.extend(children)
    return sum(cpu.get(pid, 0.0) for pid in tree)


def _own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _machine_busy_seconds() -> float:
    """CPU seconds every process of the machine has used so far, all cores (/proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


async def _requests_per_backend(server: Server) -> dict[str, float] | None:
    """infermux's ``infermux_requests_total`` per backend (None for llama-server, or when
    ``/metrics`` does not answer)."""
    if server.name != "infermux":
        return None
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            text = (await http.get(server.url + "/metrics")).raise_for_status().text
    except httpx.HTTPError:
        return None
    counts: dict[str, float] = {}
    for match in _REQUESTS_TOTAL.finditer(text):
        backend = dict(re.findall(r'(\w+)="([^"]*)"', match["labels"])).get("backend", "?")
        counts[backend] = counts.get(backend, 0.0) + float(match["n"])
    return counts


# --- the measurement ---------------------------------------------------------------------


async def _probe(contender: Contender) -> dict[str, Any]:
    """One short forced-length request: the model id, who served it, whether ignore_eos works."""
    target = contender.target
    async with httpx.AsyncClient(base_url=target.url, headers=target.headers, timeout=600) as http:
        model = target.model or (await http.get("/v1/models")).json()["data"][0]["id"]
        messages = [{"role": "user", "content": "Say hi."}]
        body = {"model": model, "messages": messages, "max_tokens": 8, "ignore_eos": True}
        reply = await http.post("/v1/chat/completions", json=body | {"temperature": 0})
    if reply.status_code != 200:
        raise SystemExit(f"{contender.label}: HTTP {reply.status_code}: {reply.text[:300]}")
    return {
        "model": model,
        "served_by": reply.headers.get(PIN_HEADER),
        "completion_tokens_of_8": (reply.json().get("usage") or {}).get("completion_tokens"),
    }


def _bench_config(
    target: Target,
    args: argparse.Namespace,
    tokens_per_word: float,
    concurrency: int,
    *,
    num_requests: int,
    seed: int,
    progress: bool,
) -> BenchConfig:
    workload = WorkloadSpec(
        name="fixed",
        num_requests=num_requests,
        input_len=args.input_len,
        output_len=args.max_tokens,
    )
    return BenchConfig(
        targets=[target],
        workload=workload,
        concurrency=concurrency,
        seed=seed,
        tokens_per_word=tokens_per_word,
        ignore_eos=True,
        temperature=0.0,
        timeout_s=args.timeout,
        progress=progress,
    )


async def _run_block(
    contender: Contender, servers: list[Server], config: BenchConfig
) -> tuple[RunResult, dict[str, Any]]:
    """One block on one contender: its result, and what every server did meanwhile."""
    served_before = await _requests_per_backend(contender.server)
    cpu_before = {s.name: _tree_cpu_seconds(s.process.pid) for s in servers}
    client_before, machine_before = _own_cpu_seconds(), _machine_busy_seconds()
    started = time.perf_counter()
    run = (await run_benchmark(config)).runs[0]
    wall_s = time.perf_counter() - started
    client_cpu_s = _own_cpu_seconds() - client_before
    machine_cpu_s = _machine_busy_seconds() - machine_before
    cpu_s = {s.name: _tree_cpu_seconds(s.process.pid) - cpu_before[s.name] for s in servers}
    await asyncio.sleep(0.3)  # infermux records metrics just after a request's final bytes
    served_after = await _requests_per_backend(contender.server)
    served_by = None
    if served_before is not None and served_after is not None:
        served_by = {
            backend: round(n - served_before.get(backend, 0.0))
            for backend, n in served_after.items()
            if n > served_before.get(backend, 0.0)
        }
    block = {
        "label": contender.label,
        "seed": config.seed,
        "duration_s": run.summary.duration_s,
        "output_throughput": run.summary.output_throughput,
        "server_cpu_s": cpu_s,
        "client_cpu_s": client_cpu_s,
        # Cores that processes other than the servers and this client kept busy: on a shared
        # machine, the figures of a block with more than a few tenths here are not results.
        "other_cores": max(0.0, machine_cpu_s - sum(cpu_s.values()) - client_cpu_s) / wall_s,
        "served_by": served_by,
    }
    return run, block


def _problems(run: RunResult, contender: Contender, max_tokens: int, served_by: Any) -> list[str]:
    """What makes a block's figures incomparable: failures, missing or wrong usage, and a
    pinned infermux backend that did not serve its requests."""
    problems = [f"{n} x {message}" for message, n in run.summary.errors.items()]
    done = [r for r in run.records if r.ok]
    if missing := sum(1 for r in done if not r.usage_reported):
        problems.append(f"{missing} streams without usage")
    if wrong := sorted({r.output_tokens for r in done if r.output_tokens != max_tokens}, key=str):
        problems.append(f"output tokens {wrong}, not {max_tokens}")
    pinned = contender.target.headers.get(PIN_HEADER)
    if pinned and served_by and set(served_by) != {pinned}:
        problems.append(f"served by {served_by}")
    return problems


async def _measure_level(
    args: argparse.Namespace, contenders: list[Contender], level: int, tokens_per_word: float
) -> tuple[dict[str, Any], list[str]]:
    concurrency = args.concurrency[level]
    per_slot = 1 if args.quick else 2  # requests per concurrency slot and block
    num_requests = args.requests or max(args.min_requests, per_slot * concurrency)
    servers = list({c.server.name: c.server for c in contenders}.values())
    records: dict[str, list[Any]] = {c.label: [] for c in contenders}
    blocks: list[dict[str, Any]] = []
    issues: list[str] = []
    for repeat in range(args.repeats):
        seed = args.seed + 1000 * level + 2 * repeat  # warm-up prompts: seed + 1
        order = contenders if (level + repeat) % 2 == 0 else contenders[::-1]
        for contender in order:
            print(
                f"[c={concurrency} block {repeat + 1}/{args.repeats}] {contender.label}: "
                f"{args.warmup} warm-up + {num_requests} requests x {args.max_tokens} tokens",
                flush=True,
            )
            config = functools.partial(
                _bench_config, contender.target, args, tokens_per_word, concurrency
            )
            if args.warmup:
                await run_benchmark(config(num_requests=args.warmup, seed=seed + 1, progress=False))
            run, block = await _run_block(
                contender,
                servers,
                config(num_requests=num_requests, seed=seed, progress=not args.no_progress),
            )
            served = f"; served by {block['served_by']}" if block["served_by"] is not None else ""
            print(
                f"  {block['output_throughput']:,.1f} output tok/s; other processes kept "
                f"{block['other_cores']:.2f} cores busy{served}",
                flush=True,
            )
            records[contender.label] += run.records
            blocks.append(block | {"repeat": repeat})
            problems = _problems(run, contender, args.max_tokens, block["served_by"])
            issues += [f"c={concurrency} {contender.label}: {p}" for p in problems]
    summaries = {
        label: summarise(
            recs,
            duration_s=sum(b["duration_s"] for b in blocks if b["label"] == label),
            slo=Slo(),
            prices=None,
        )
        for label, recs in records.items()
    }
    served_by: dict[str, dict[str, int]] = {}
    for block in blocks:
        counts = served_by.setdefault(block["label"], {})
        for backend, n in (block["served_by"] or {}).items():
            counts[backend] = counts.get(backend, 0) + n
    result = {
        "concurrency": concurrency,
        "requests_per_block": num_requests,
        "summaries": summaries,
        "ratios": {
            label: _ratios(summary, summaries[PEER])
            for label, summary in summaries.items()
            if label != PEER
        },
        "served_by": served_by,  # infermux's own count per backend (GET /metrics)
        "blocks": blocks,
        # Every request's figures, less the per-gap ITL lists (pooled in the summaries).
        "records": {
            label: [msgspec.structs.replace(r, itl_ms=[]) for r in recs]
            for label, recs in records.items()
        },
    }
    return result, issues


async def _measure(args: argparse.Namespace, contenders: list[Contender]) -> dict[str, Any]:
    probes = {c.label: await _probe(c) for c in contenders}
    issues = []
    for label, probe in probes.items():
        print(f"  probe {label}: {probe}", flush=True)
        if probe["completion_tokens_of_8"] != 8:
            issues.append(f"{label}: ignore_eos probe gave {probe['completion_tokens_of_8']} of 8")
    # Both servers stay up; only one is loaded at a time. What does the other use when idle?
    pids = {c.server.name: c.server.process.pid for c in contenders}
    before = {name: _tree_cpu_seconds(pid) for name, pid in pids.items()}
    await asyncio.sleep(3.0)
    idle = {name: (_tree_cpu_seconds(pid) - before[name]) / 3.0 for name, pid in pids.items()}
    print(f"  idle CPU (cores): {', '.join(f'{k} {v:.2f}' for k, v in idle.items())}", flush=True)
    # Word -> token lengths from the peer's usage, given to every block: the same prompts.
    peer = msgspec.structs.replace(contenders[0].target, model=probes[PEER]["model"])
    client = BenchClient(peer, endpoint="chat", timeout_s=args.timeout)
    try:
        calibration = await calibrate(client, seed=args.seed)
    finally:
        await client.aclose()
    print(f"  {calibration}", flush=True)
    levels = []
    for level in range(len(args.concurrency)):
        result, level_issues = await _measure_level(
            args, contenders, level, calibration.tokens_per_word
        )
        levels.append(result)
        issues += level_issues
    return {
        "probes": probes,
        "idle_cpu_cores": idle,
        "calibration": calibration,
        "levels": levels,
        "issues": issues,
    }


# --- the report --------------------------------------------------------------------------


def _latency(field: str, p: str) -> Callable[[RunSummary], float | None]:
    return lambda s: getattr(getattr(s, field), p)


#: (column title, figure of a RunSummary); ratios are taken of these.
_COLUMNS: list[tuple[str, Callable[[RunSummary], float | None]]] = [
    ("out tok/s", lambda s: s.output_throughput),
    ("req/s", lambda s: s.request_throughput),
    *(
        (f"{name} {p}", _latency(field, p))
        for name, field in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"))
        for p in ("p50", "p95", "p99")
    ),
]


def _ratios(summary: RunSummary, peer: RunSummary) -> dict[str, float | None]:
    ratios: dict[str, float | None] = {}
    for title, get in _COLUMNS:
        value, base = get(summary), get(peer)
        ratios[title] = value / base if value is not None and base else None
    return ratios


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _table(levels: list[dict[str, Any]]) -> str:
    extra = ["prompt tok", "other cores", "served by"]
    rows = [["c", "server", *(title for title, _ in _COLUMNS), *extra]]
    for level in levels:
        for label, summary in level["summaries"].items():
            prompt = summary.mean_prompt_tokens
            blocks = [b for b in level["blocks"] if b["label"] == label]
            others = sum(b["other_cores"] * b["duration_s"] for b in blocks) / max(
                sum(b["duration_s"] for b in blocks), 1e-9
            )
            served = level["served_by"].get(label, {})
            rows.append(
                [str(level["concurrency"]), label]
                + [_fmt(get(summary)) for _, get in _COLUMNS]
                + ["-" if prompt is None else f"{prompt:.0f}", f"{others:.2f}"]
                + [" ".join(f"{backend}:{n}" for backend, n in served.items())]
            )
        for label, ratios in level["ratios"].items():
            rows.append(
                ["", f"{label} / {PEER}"]
                + ["-" if ratios[t] is None else f"{ratios[t]:.2f}x" for t, _ in _COLUMNS]
                + [""] * len(extra)
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 1 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]
    lines.insert(1, "-" * max(len(line) for line in lines))
    note = (
        "(latencies in ms; a ratio above 1 is faster for throughput, slower for latency; "
        "other cores: CPU that processes other than the servers and this client used)"
    )
    return "\n".join([*lines, note])


def _plot(levels: list[dict[str, Any]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    xs = [level["concurrency"] for level in levels]
    labels = list(levels[0]["summaries"])
    figure, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    panels = [
        (axes[0, 0], "output throughput (tok/s)", ["out tok/s"]),
        (axes[0, 1], "TTFT (ms, log scale)", ["TTFT p50", "TTFT p99"]),
        (axes[1, 0], "TPOT (ms)", ["TPOT p50", "TPOT p99"]),
    ]
    columns = dict(_COLUMNS)
    for axis, ylabel, titles in panels:
        for index, label in enumerate(labels):
            for column, style in zip(titles, ("-", "--"), strict=False):
                ys = [columns[column](level["summaries"][label]) for level in levels]
                name = label if len(titles) == 1 else f"{label} {column.split()[-1]}"
                axis.plot(
                    xs,
                    [float("nan") if y is None else y for y in ys],
                    style,
                    marker="o",
                    color=f"C{index}",
                    label=name,
                )
        axis.set_xscale("log", base=2)
        axis.set_xticks(xs, [str(x) for x in xs])
        axis.set_xlabel("concurrent requests")
        axis.set_ylabel(ylabel)
        axis.set_yscale("log" if "log" in ylabel else "linear")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    axis = axes[1, 1]
    metrics = ("out tok/s", "TTFT p50", "TPOT p50")
    pairs = [(metric, label) for metric in metrics for label in labels if label != PEER]
    width = 0.8 / len(pairs)
    for k, (metric, label) in enumerate(pairs):
        values = [level["ratios"][label][metric] or float("nan") for level in levels]
        positions = [i - 0.4 + (k + 0.5) * width for i in range(len(xs))]
        name = metric if len(pairs) == len(metrics) else f"{metric} · {label}"
        bars = axis.bar(positions, values, width, color=f"C{k + len(labels)}", label=name)
        axis.bar_label(bars, fmt="%.2f", fontsize=7)
    axis.axhline(1.0, color="grey", linestyle=":")
    axis.set_yscale("log")  # 0.5x and 2x equally far from 1
    ticks = [0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100]
    axis.yaxis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
    axis.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    axis.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axis.set_xticks(range(len(xs)), [str(x) for x in xs])
    axis.set_xlabel("concurrent requests")
    axis.set_ylabel(f"infermux / {PEER} (log scale)")
    axis.set_title("ratios: throughput higher is better, latency lower", fontsize=9)
    axis.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _machine() -> dict[str, Any]:
    info: dict[str, Any] = {"cpus": os.cpu_count()}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name":
                info.setdefault("cpu_model", value)
            elif key == "flags":
                flags = set(value.split())
                info["cpu_flags"] = [flag for flag in _CPU_FLAGS if flag in flags]
                info["num_cpu_flags"] = len(flags)
                break
    with contextlib.suppress(OSError, IndexError, ValueError):
        info["mem_total_kb"] = int(Path("/proc/meminfo").read_text().split()[1])
    info |= {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_avg": os.getloadavg(),
    }
    return info


def _git_revision() -> dict[str, Any]:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}


# --- the command line --------------------------------------------------------------------


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--concurrency", default="1,16,64", help="comma list of levels (default: %(default)s)")
    add(
        "--infermux-backend",
        default="",
        metavar="NAMES",
        help="comma list of infermux backends to pin, each measured against llama-server; "
        "default: none pinned (infermux routes: llamacpp first)",
    )
    add("--max-tokens", type=int, help="output tokens per request (default 128; --quick 16)")
    add("--input-len", type=int, help="prompt tokens, approximately (default 256; --quick 64)")
    add(
        "--requests",
        type=int,
        help="requests per server and block (default: max(MIN, 2 x c); --quick: max(MIN, c))",
    )
    add("--min-requests", type=int, metavar="MIN", help="default 8; --quick 4")
    add("--repeats", type=int, default=2, help="blocks per server and level (default 2: ABBA)")
    add("--warmup", type=int, help="warm-up requests before each block (default 2; --quick 1)")
    add("--seed", type=int, default=0)
    add("--timeout", type=float, default=900.0, help="seconds per request (default 900)")
    add("--llama-server", metavar="PATH", help="the binary (default: build or reuse the cache)")
    add("--parallel", type=int, default=16, help="llama-server -np (default 16)")
    add("--threads", type=int, default=2, help="llama-server -t (default 2)")
    add(
        "--ctx-per-slot", type=int, default=2048, help="llama-server -c = this x -np (default 2048)"
    )
    add("--out", type=Path, default=RESULTS, help="folder for the JSON and the PNG")
    add("--quick", action="store_true", help="smoke run: short prompts and answers")
    add("--no-progress", action="store_true", help="no progress bar per block")
    args = parser.parse_args(argv)
    defaults = {
        "max_tokens": (128, 16),
        "input_len": (256, 64),
        "min_requests": (8, 4),
        "warmup": (2, 1),
    }
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    try:
        args.concurrency = [int(part) for part in args.concurrency.split(",") if part.strip()]
    except ValueError:
        parser.error(f"--concurrency: expected a comma list of integers, got {args.concurrency!r}")
    if not args.concurrency or min(args.concurrency) < 1:
        parser.error("--concurrency: give levels of at least 1")
    args.infermux_backend = [b.strip() for b in args.infermux_backend.split(",") if b.strip()]
    return args


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM unwinds like Ctrl-C: the servers are stopped either way


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    started = dt.datetime.now(dt.UTC)
    machine = _machine()
    binary = _llama_server_binary(args.llama_server)
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    model_path = default_model_path()
    infermux_bin = Path(sys.executable).with_name("infermux")  # .venv/bin/infermux
    infermux_port, llama_port = _free_port(), _free_port()
    infermux_cmd = [str(infermux_bin), "serve", "--port", str(infermux_port)]
    llama_cmd = [
        str(binary),
        "-m",
        str(model_path),
        "-np",
        str(args.parallel),
        "-t",
        str(args.threads),
        "-c",
        str(args.parallel * args.ctx_per_slot),
        "-cb",
        "--host",
        "127.0.0.1",
        "--port",
        str(llama_port),
    ]
    log_dir = Path(tempfile.mkdtemp(prefix="serving_vs_llama_server-"))
    print(f"server logs in {log_dir}", flush=True)
    try:
        with contextlib.ExitStack() as stack:
            llama = stack.enter_context(_server(PEER, llama_cmd, llama_port, "/health", log_dir))
            infermux = stack.enter_context(
                _server("infermux", infermux_cmd, infermux_port, "/ready", log_dir)
            )
            contenders = [Contender(PEER, llama, Target(label=PEER, url=llama.url))]
            for backend in args.infermux_backend or [None]:
                label = "infermux" if backend is None else f"infermux:{backend}"
                headers = {} if backend is None else {PIN_HEADER: backend}
                target = Target(
                    label=label, url=infermux.url, model=DEFAULT_MODEL_ALIAS, headers=headers
                )
                contenders.append(Contender(label, infermux, target))
            measured = asyncio.run(_measure(args, contenders))
    except KeyboardInterrupt:
        print("interrupted; the servers are stopped", file=sys.stderr)
        return 130
    finished = dt.datetime.now(dt.UTC)
    table = _table(measured["levels"])
    print("\n" + table)
    for issue in measured["issues"]:
        print(f"!! {issue}", file=sys.stderr)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "no_progress")}
    document = {
        "benchmark": "serving_vs_llama_server",
        "started_at": started.isoformat(timespec="seconds"),
        "finished_at": finished.isoformat(timespec="seconds"),
        "settings": settings | {"llama_server": str(binary), "model": str(model_path)},
        "commands": {"infermux": shlex.join(infermux_cmd), PEER: shlex.join(llama_cmd)},
        "llama_server_version": (version.stdout + version.stderr).strip(),
        "machine": machine | {"load_avg_at_end": os.getloadavg()},
        "infermux_revision": _git_revision(),
        "table": table,
        **measured,
    }
    stamp = started.strftime("%Y%m%dT%H%M%SZ") + ("-quick" if args.quick else "")
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = args.out / f"{stamp}.json", args.out / f"{stamp}.png"
    json_path.write_bytes(msgspec.json.format(msgspec.json.encode(document), indent=1) + b"\n")
    title = (
        f"infermux serve vs {PEER} -np {args.parallel} · {model_path.name} · {args.max_tokens} "
        f"output tokens per request · {machine.get('cpu_model', '?')} x {machine['cpus']} · "
        f"{started:%Y-%m-%d %H:%M} UTC" + (" · QUICK (smoke run)" if args.quick else "")
    )
    _plot(measured["levels"], title, png_path)
    print(f"\nwrote {json_path} and {png_path}")
    return 1 if measured["issues"] else 0


if __name__ == "__main__":
    sys.exit(main())
