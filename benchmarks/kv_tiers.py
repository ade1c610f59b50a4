"""KV tiers of the core engine, in one run: with tiers, without, and llama-server as the peer.

Three measurements on the default model (SmolLM2-135M-Instruct Q4_1, the engine's "auto"
dtype):

1. **Sessions** (HTTP, the official ``openai`` client, streaming chat, greedy, ``max_tokens``
   16 with ``ignore_eos``). ``--sessions`` sessions, each with its own ~700-token system text
   (a store's order list) that its turns ask about; ``--turns`` turns each, round-robin, so a
   session comes back after every other session ran. A turn's prompt is the session's whole
   history: the system text, the earlier questions and the server's own answers. The core
   engine's device KV pool (``--kv-cache-mb``) holds ~2 sessions. Servers, one at a time
   (each is started, runs the whole workload, and is stopped before the next starts):

   * ``infermux tiers``: a ``core_engine`` backend with ``kv_host_bytes`` (room for every
     session) and ``kv_disk_dir`` (a fresh temporary folder);
   * ``infermux no tiers``: the same backend without them;
   * ``infermux int8``: no tiers, ``kv_cache_dtype = "int8"`` in the same pool;
   * ``llama-server``: ``-np 2`` (two resident sessions, as the pool) with ``--cache-reuse 256``
     and ``--cache-ram`` (its host prompt cache, which this version has);
   * ``llama-server no cache-ram``: the same with ``--cache-ram 0``.

   TTFT is the time to the first content chunk; "returning" turns are turns 2.. of a session.
   Cached prompt tokens come from the stream's usage (``prompt_tokens_details.cached_tokens``;
   llama-server: also ``timings.cache_n``), infermux's tier hits from ``/metrics``.
2. **Restore vs recompute** (in process, ``LLMEngine``): time to the first token
   (``max_tokens`` 1) of a ``--prefix-tokens`` prefix plus a 16-token question when the prefix
   is (a) not cached (an engine without tiers; also the tiers engine's own miss), (b) evicted
   from the device pool to the host tier, (c) only on disk: a fresh engine on the same disk
   folder (a restart), its files dropped from the page cache first (``posix_fadvise``), and
   again with them in the page cache. Medians of ``--repeats`` prefixes; the copy time is
   ``tiers.stats()["kv_restore_seconds:*"]``.
3. **int8 sessions held**: device capacity in tokens at the same ``--kv-cache-mb`` for the
   auto dtype, bfloat16 and int8 KV (``KVCache.bytes_per_block``; the servers' own
   ``infermux_backend_kv_cache_capacity_tokens`` next to it), and how many of the workload's
   sessions (their final length) fit; measured: the returning turns' cached share on the
   int8 server against the no-tier one.

    .venv/bin/python benchmarks/kv_tiers.py              # full run (~8 min on 2 cores)
    .venv/bin/python benchmarks/kv_tiers.py --quick      # smoke run (~4 min)
    .venv/bin/python benchmarks/kv_tiers.py --passes 2   # every server twice, ABBA

Writes ``benchmarks/results/kv_tiers/<UTC time>.json`` (every request, every trial, the
commands, the machine) and ``.png``; prints a table with the ratios and the issue's targets.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import math
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backends.default_model import default_model_path  # noqa: E402
from benchmarks.serving_vs_llama_server import (  # noqa: E402
    _free_port,
    _git_revision,
    _llama_server_binary,
    _machine,
    _machine_busy_seconds,
    _own_cpu_seconds,
    _server,
    _tree_cpu_seconds,
)

RESULTS = ROOT / "benchmarks" / "results" / "kv_tiers"
MODEL_ALIAS = "core"
BLOCK_SIZE = 16  # the core_engine backend's default block_size (tokens per KV block)
TIERS, NO_TIERS, INT8, LLAMA, LLAMA_NO_RAM = (
    "infermux tiers",
    "infermux no tiers",
    "infermux int8",
    "llama-server",
    "llama-server no cache-ram",
)
_METRIC = re.compile(
    r"^(?P<name>infermux_backend_kv_\w+)\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)$", re.M
)


# --- the workload ------------------------------------------------------------------------

_NAMES = "Ada Bruno Chen Dara Emil Farah Goran Hana Ivo Jun Kira Lena Milo Nadia Omar Petra".split()
_CITIES = (
    "Lisbon Oslo Quito Lagos Perth Busan Tartu Cork Porto Graz Lyon Turin Malmo Bergen".split()
)
_COLORS = "red blue green amber violet silver black white orange teal".split()
_THINGS = "lamp kettle chair backpack umbrella blanket notebook teapot clock mirror".split()
_CARRIERS = "PostNord, DHL, UPS, a local courier, FedEx, the national post".split(", ")
_DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()


def order_lines(rng: random.Random, count: int) -> list[str]:
    """``count`` order records, ~30 tokens each."""
    return [
        f"Order {k + 101}: {rng.choice(_NAMES)} from {rng.choice(_CITIES)} bought {rng.randint(2, 9)} "
        f"{rng.choice(_COLORS)} {rng.choice(_THINGS)}s for {rng.randint(12, 480)} dollars on "
        f"{rng.choice(_DAYS)}, shipped by {rng.choice(_CARRIERS)}."
        for k in range(count)
    ]


def session_context(session: int, num_orders: int) -> str:
    rng = random.Random(f"kv_tiers:session:{session}")
    store = f"{rng.choice(_COLORS).title()} {rng.choice(_THINGS).title()} Shop"
    header = (  # the shop number first: no two sessions share a 16-token block
        f"Shop {session + 1}. You are the order assistant of the {store}. Answer questions "
        "about the orders below in one short sentence.\n\n"
    )
    return header + "\n".join(order_lines(rng, num_orders))


def question(session: int, turn: int, num_orders: int) -> str:
    rng = random.Random(f"kv_tiers:question:{session}:{turn}")
    order = rng.randrange(num_orders) + 101
    return rng.choice(
        [
            f"Who placed order {order}, and how was it shipped?",
            f"How much did order {order} cost, and on which day?",
            f"Which city is order {order} going to?",
        ]
    )


# --- the servers -------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSpec:
    """One server of the sessions workload: how to start it."""

    label: str
    kind: str  # "infermux" or "llama-server"
    command: list[str]
    port: int
    ready_path: str
    config_toml: str | None = None  # infermux: its routing config (written by infermux_spec)


def infermux_spec(label: str, args: argparse.Namespace, work: Path, **options: Any) -> ServerSpec:
    """``infermux serve`` with one core_engine backend: the common options and ``options``."""
    port = _free_port()
    values = {
        "dtype": args.dtype,
        "num_threads": args.threads,
        "kv_cache_memory_mb": args.kv_cache_mb,
    }
    lines = ["[[backends]]", 'name = "core"', 'kind = "core_engine"', "[backends.options]"]
    lines += [f"{k} = {msgspec.json.encode(v).decode()}" for k, v in (values | options).items()]
    lines += ["", "[[models]]", f'alias = "{MODEL_ALIAS}"', 'backends = ["core"]', ""]
    config = work / f"{label.replace(' ', '-')}.toml"
    config.write_text("\n".join(lines))
    infermux = Path(sys.executable).with_name("infermux")  # .venv/bin/infermux
    command = [
        str(infermux),
        "serve",
        "--config",
        str(config),
        "--port",
        str(port),
        "--no-access-log",
    ]
    return ServerSpec(label, "infermux", command, port, "/ready", config.read_text())


def llama_spec(label: str, args: argparse.Namespace, binary: Path, cache_ram_mb: int) -> ServerSpec:
    """llama-server with ``--llama-slots`` slots, ``--cache-reuse 256`` and ``--cache-ram``."""
    port = _free_port()
    flags = (
        f"-np {args.llama_slots} -c {args.llama_slots * args.llama_ctx_per_slot} -t {args.threads} "
        f"--cache-reuse 256 --cache-ram {cache_ram_mb} --host 127.0.0.1 --port {port}"
    )
    command = [str(binary), "-m", str(default_model_path()), *flags.split()]
    return ServerSpec(label, "llama-server", command, port, "/health")


def server_spec(
    label: str, args: argparse.Namespace, work: Path, binary: Path | None
) -> ServerSpec:
    """The server behind ``label``; ``work``: a fresh folder for its config and disk tier."""
    work.mkdir(parents=True, exist_ok=True)
    if label == TIERS:
        host = args.kv_host_mb * 2**20
        return infermux_spec(label, args, work, kv_host_bytes=host, kv_disk_dir=str(work / "kv"))
    if label == NO_TIERS:
        return infermux_spec(label, args, work)
    if label == INT8:
        return infermux_spec(label, args, work, kv_cache_dtype="int8")
    assert binary is not None and label in (LLAMA, LLAMA_NO_RAM)
    return llama_spec(label, args, binary, args.llama_cache_ram_mb if label == LLAMA else 0)


def kv_metrics(url: str) -> dict[str, float]:
    """infermux's ``infermux_backend_kv_*`` series, keyed ``name{labels}``."""
    with contextlib.suppress(httpx.HTTPError):
        text = httpx.get(url + "/metrics", timeout=30).text
        return {f"{m['name']}{{{m['labels']}}}": float(m["value"]) for m in _METRIC.finditer(text)}
    return {}


# --- 1. sessions over HTTP -------------------------------------------------------------------


@dataclass
class Turn:
    """One request of the sessions workload, as the client saw it."""

    session: int | None  # None: the warm-up request
    turn: int | None  # 0: the session's first request; later ones are "returning"
    ttft_s: float | None  # None: no content chunk came
    e2e_s: float
    prompt_tokens: int | None
    cached_tokens: int | None  # usage.prompt_tokens_details, else llama-server's timings.cache_n
    completion_tokens: int | None
    server_prompt_ms: float | None  # llama-server's own timings.prompt_ms (infermux: None)
    text: str


def ask(
    client: openai.OpenAI,
    messages: list[Any],
    max_tokens: int,
    session: int | None,
    turn: int | None,
) -> Turn:
    """One streaming greedy chat request of exactly ``max_tokens`` tokens."""
    started = time.perf_counter()
    ttft = None
    parts: list[str] = []
    usage: Any = None
    timings: dict[str, Any] = {}
    stream = client.chat.completions.create(
        model=MODEL_ALIAS,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - started
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
        if isinstance(extra := (chunk.model_extra or {}).get("timings"), dict):
            timings = extra
    e2e = time.perf_counter() - started
    cached = getattr(getattr(usage, "prompt_tokens_details", None), "cached_tokens", None)
    return Turn(
        session=session,
        turn=turn,
        ttft_s=ttft,
        e2e_s=e2e,
        prompt_tokens=getattr(usage, "prompt_tokens", None),
        cached_tokens=timings.get("cache_n") if cached is None else cached,
        completion_tokens=getattr(usage, "completion_tokens", None),
        server_prompt_ms=timings.get("prompt_ms"),
        text="".join(parts),
    )


def run_sessions(url: str, args: argparse.Namespace, label: str) -> list[Turn]:
    """The whole workload against one server: turn by turn, session by session."""
    client = openai.OpenAI(
        base_url=f"{url}/v1", api_key="unused", timeout=args.timeout, max_retries=0
    )
    ask(client, [{"role": "user", "content": "Say hello."}], 4, None, None)  # shares nothing
    histories = [
        [{"role": "system", "content": session_context(s, args.num_orders)}]
        for s in range(args.sessions)
    ]
    turns: list[Turn] = []
    total = args.sessions * args.turns
    for t in range(args.turns):
        for s in range(args.sessions):
            messages = [*histories[s], {"role": "user", "content": question(s, t, args.num_orders)}]
            record = ask(client, messages, args.max_tokens, s, t)
            turns.append(record)
            histories[s] = [*messages, {"role": "assistant", "content": record.text}]
            ttft = "-" if record.ttft_s is None else f"{record.ttft_s * 1000:.0f} ms"
            print(
                f"  [{label}] {len(turns)}/{total} session {s + 1} turn {t + 1}: TTFT {ttft}, "
                f"prompt {record.prompt_tokens}, cached {record.cached_tokens}",
                flush=True,
            )
    return turns


def measure_server(
    spec: ServerSpec, args: argparse.Namespace, log_dir: Path, run: str
) -> dict[str, Any]:
    """Start the server, run the workload, stop it: the run's record."""
    print(f"\n== sessions: {spec.label} ({run})", flush=True)
    name = spec.label.replace(" ", "-")
    with _server(name, spec.command, spec.port, spec.ready_path, log_dir) as server:
        before = kv_metrics(server.url) if spec.kind == "infermux" else {}
        cpu_before = _tree_cpu_seconds(server.process.pid)
        client_before, machine_before = _own_cpu_seconds(), _machine_busy_seconds()
        wall_started = time.perf_counter()
        turns = run_sessions(server.url, args, spec.label)
        wall = time.perf_counter() - wall_started
        server_cpu = _tree_cpu_seconds(server.process.pid) - cpu_before
        client_cpu = _own_cpu_seconds() - client_before
        machine_cpu = _machine_busy_seconds() - machine_before
        time.sleep(0.3)  # metrics are recorded just after a request's last bytes
        after = kv_metrics(server.url) if spec.kind == "infermux" else {}
    metrics = {k: v - before.get(k, 0.0) if "_total" in k else v for k, v in after.items()}
    return {
        "label": spec.label,
        "command": shlex.join(spec.command),
        "config_toml": spec.config_toml,
        "wall_s": wall,
        "server_cpu_s": server_cpu,
        # Cores that processes other than this server and this client kept busy meanwhile.
        "other_cores": max(0.0, machine_cpu - server_cpu - client_cpu) / wall,
        "kv_metrics": metrics,
        "turns": [vars(t) for t in turns],
        "summary": summarise_turns(turns),
    }


def merge_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A server's runs (one per pass) as one record: figures over all their turns."""
    turns = [Turn(**t) for run in runs for t in run["turns"]]
    return {
        "summary": summarise_turns(turns),
        "other_cores": max(run["other_cores"] for run in runs),
        "kv_metrics": runs[-1]["kv_metrics"],
        "runs": runs,
    }


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarise_turns(turns: list[Turn]) -> dict[str, Any]:
    def ttfts(rows: list[Turn]) -> list[float]:
        return [r.ttft_s for r in rows if r.ttft_s is not None]

    first = [r for r in turns if r.turn == 0]
    back = [r for r in turns if r.turn is not None and r.turn > 0]
    prompt = sum(r.prompt_tokens or 0 for r in back)
    cached = sum(r.cached_tokens or 0 for r in back)
    last_turn = max(r.turn or 0 for r in turns)
    last = [
        r.prompt_tokens + (r.completion_tokens or 0)
        for r in turns
        if r.prompt_tokens and r.turn == last_turn
    ]
    return {
        "first_ttft_p50_s": _percentile(ttfts(first), 0.5),
        "returning_ttft_p50_s": _percentile(ttfts(back), 0.5),
        "returning_ttft_p95_s": _percentile(ttfts(back), 0.95),
        "returning_prompt_tokens_mean": prompt / len(back) if back else None,
        "returning_cached_share": cached / prompt if prompt else None,
        "final_session_tokens_mean": statistics.fmean(last) if last else None,
        "num_without_ttft": sum(1 for r in turns if r.ttft_s is None),
        "completion_tokens": sorted({r.completion_tokens for r in turns}, key=str),
    }


# --- 2. restore vs recompute, in process -----------------------------------------------------


@dataclass
class RestoreResult:
    trials: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def add(self, case: str, trial: dict[str, Any]) -> None:
        self.trials.setdefault(case, []).append(trial)
        by_tier = trial.get("cached_tokens_by_tier")
        print(f"  {case}: TTFT {trial['ttft_s'] * 1000:.0f} ms, cached {by_tier}", flush=True)

    def median(self, case: str, key: str = "ttft_s") -> float | None:
        values = [t[key] for t in self.trials.get(case, []) if t.get(key) is not None]
        return statistics.median(values) if values else None


def first_token(engine: Any, prompt: list[int], req_id: str) -> dict[str, Any]:
    """Time to the first token of one greedy request, alone in ``engine``; tier counters moved."""
    from core_engine.sampling_params import SamplingParams

    stats_before = engine.tiers.stats() if engine.tiers is not None else {}
    params = SamplingParams(max_tokens=1, temperature=0.0)
    t0 = time.perf_counter()
    engine.add_request(req_id, engine.make_request(req_id, prompt, params))
    ttft = None
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if ttft is None and out.new_token_ids:
                ttft = time.perf_counter() - t0
            if out.finished:
                final = out
    assert final is not None and ttft is not None
    stats = engine.tiers.stats() if engine.tiers is not None else {}
    moved = {
        k: v - stats_before.get(k, 0.0) for k, v in stats.items() if v != stats_before.get(k, 0.0)
    }
    return {
        "ttft_s": ttft,
        "prompt_tokens": len(prompt),
        "cached_tokens": final.num_cached_tokens,
        "cached_tokens_by_tier": final.cached_tokens_by_tier,
        "copy_s": moved.get("kv_restore_seconds:host", 0.0)
        + moved.get("kv_restore_seconds:disk", 0.0),
        "tier_stats_moved": moved,
    }


def drop_from_page_cache(directory: Path) -> int:
    """fsync and ``POSIX_FADV_DONTNEED`` every block file: the next reads come from the disk."""
    count = 0
    for path in directory.rglob("*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            count += 1
        finally:
            os.close(fd)
    return count


def measure_restore(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch

    from core_engine.config import EngineConfig
    from core_engine.llm_engine import LLMEngine
    from core_engine.paged_attention import KVCache

    print(
        f"\n== restore vs recompute: {args.prefix_tokens}-token prefixes, {args.repeats} each",
        flush=True,
    )
    t0 = time.perf_counter()
    base = EngineConfig(
        model_path=str(default_model_path()),
        dtype=args.dtype,
        num_threads=args.threads,
        kv_cache_memory_bytes=2**20,
    )
    loader = LLMEngine.from_config(base)
    model, tokenizer, dtype = (
        loader.model_runner.model,
        loader.tokenizer,
        loader.model_runner.kv_cache.dtype,
    )
    mc: Any = model.config  # LlamaConfig
    print(f"  model loaded in {time.perf_counter() - t0:.0f} s ({dtype})", flush=True)
    block_bytes = KVCache.bytes_per_block(
        num_layers=mc.num_layers,
        block_size=base.block_size,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        dtype=dtype,
    )
    prefix_blocks = math.ceil((args.prefix_tokens + 16) / base.block_size)
    # A pool of ~1.15 prompts: each new prompt evicts the one before it (to the host tier).
    device_bytes = int(1.15 * prefix_blocks) * block_bytes
    host_bytes = (args.repeats + 3) * prefix_blocks * 2 * block_bytes
    disk_dir = work / "restore-disk"

    def engine(**overrides: Any) -> Any:
        config = msgspec.structs.replace(base, kv_cache_memory_bytes=device_bytes, **overrides)
        return LLMEngine(config, model, tokenizer, dtype=dtype)

    rng = random.Random("kv_tiers:restore")
    prefixes = []
    for i in range(args.repeats + 2):  # the last two push the others out of the device pool
        text = f"Archive {i}.\n" + "\n".join(order_lines(rng, args.prefix_tokens // 24 + 2))
        ids = tokenizer.encode(text, add_special=True)
        assert len(ids) >= args.prefix_tokens, (len(ids), args.prefix_tokens)
        prefixes.append(ids[: args.prefix_tokens])

    def suffix(i: int, case: str) -> list[int]:
        ids = tokenizer.encode(
            f"\nQuestion {case} {i}: who placed order {101 + i}?", add_special=False
        )
        return (ids + ids)[:16]

    result = RestoreResult()
    with torch.inference_mode():
        plain = engine()
        first_token(plain, tokenizer.encode("Warm-up.", add_special=True), "warm")
        for i, prefix in enumerate(prefixes[: args.repeats]):
            result.add("recompute", first_token(plain, prefix + suffix(i, "a"), f"plain{i}"))
        del plain
        tiered = engine(kv_host_memory_bytes=host_bytes, kv_disk_dir=str(disk_dir))
        for i, prefix in enumerate(prefixes):
            result.add("miss with tiers", first_token(tiered, prefix + suffix(i, "a"), f"miss{i}"))
        for i, prefix in enumerate(prefixes[: args.repeats]):
            result.add("host", first_token(tiered, prefix + suffix(i, "b"), f"host{i}"))
        tiered.close()  # queued disk writes finish
        del tiered
        num_files = drop_from_page_cache(disk_dir)
        print(f"  {num_files} block files fsynced and dropped from the page cache", flush=True)
        restarted = engine(kv_disk_dir=str(disk_dir))  # a restart: nothing on the device or host
        for i, prefix in enumerate(prefixes[: args.repeats]):
            result.add(
                "disk (cold page cache)",
                first_token(restarted, prefix + suffix(i, "c"), f"disk{i}"),
            )
        restarted.close()
        del restarted
        again = engine(kv_disk_dir=str(disk_dir))  # the files are in the page cache now
        for i, prefix in enumerate(prefixes[: args.repeats]):
            result.add(
                "disk (page cache)", first_token(again, prefix + suffix(i, "d"), f"warmdisk{i}")
            )
        again.close()
        del again, loader
    gc.collect()
    recompute = result.median("recompute")
    assert recompute is not None
    cases = list(result.trials)
    return {
        "prefix_tokens": args.prefix_tokens,
        "device_pool_blocks": device_bytes // block_bytes,
        "block_bytes": block_bytes,
        "medians_s": {case: result.median(case) for case in cases},
        "copy_medians_s": {case: result.median(case, "copy_s") for case in cases},
        "ratios_to_recompute": {
            case: (result.median(case) or math.nan) / recompute for case in cases
        },
        "trials": result.trials,
    }


# --- 3. capacity ---------------------------------------------------------------------------------


def capacity(args: argparse.Namespace, session_tokens: float | None) -> dict[str, Any]:
    """Device tokens (and sessions of ``session_tokens``) the pool holds per KV dtype."""
    from core_engine.config import resolve_dtype
    from core_engine.gguf_loader import GGUFFile
    from core_engine.paged_attention import KVCache

    mc = GGUFFile(default_model_path()).llama_config()
    dtype = resolve_dtype(args.dtype, "cpu")
    rows = {}
    for cache_dtype in ("auto", "bfloat16", "int8"):
        block = KVCache.bytes_per_block(
            num_layers=mc.num_layers,
            block_size=BLOCK_SIZE,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            dtype=dtype,
            cache_dtype=cache_dtype,
        )
        tokens = (args.kv_cache_mb * 2**20 // block) * BLOCK_SIZE
        rows[cache_dtype] = {
            "block_bytes": block,
            "capacity_tokens": tokens,
            "sessions_held": None if not session_tokens else math.floor(tokens / session_tokens),
        }
    return {"compute_dtype": str(dtype), "kv_cache_mb": args.kv_cache_mb, "by_kv_dtype": rows}


def problems(
    servers: dict[str, dict[str, Any]], restore: dict[str, Any] | None, max_tokens: int
) -> list[str]:
    """What makes figures incomparable: answers of another length, missing first chunks, and
    restore trials that did not hit the tier they were meant to."""
    found = []
    for label, result in servers.items():
        s = result["summary"]
        if s["num_without_ttft"]:
            found.append(f"{label}: {s['num_without_ttft']} requests without a content chunk")
        if s["completion_tokens"] != [max_tokens]:
            found.append(f"{label}: completion tokens {s['completion_tokens']}, not {max_tokens}")
    if restore is not None:
        prefix = restore["prefix_tokens"]
        expected = {"host": "host", "disk (cold page cache)": "disk", "disk (page cache)": "disk"}
        for case, trials in restore["trials"].items():
            want = {expected[case]: prefix} if case in expected else None  # recompute: nothing
            for trial in trials:
                got = trial["cached_tokens_by_tier"] or None
                if got != want or trial["cached_tokens"] != (prefix if want else 0):
                    found.append(
                        f"restore {case}: cached {trial['cached_tokens']} {got}, not {want}"
                    )
    return found


# --- the report ----------------------------------------------------------------------------------


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.0f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _grid(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(line.rstrip() for line in lines)


def targets(
    servers: dict[str, dict[str, Any]], restore: dict[str, Any] | None, cap: dict[str, Any]
) -> list[dict[str, Any]]:
    """The issue's targets: what, the measured ratio, the bound, met or not (None: not run)."""

    def p50(label: str) -> float | None:
        return servers[label]["summary"]["returning_ttft_p50_s"] if label in servers else None

    rows = [
        ("returning-turn TTFT p50, tiers / no tiers", _ratio(p50(TIERS), p50(NO_TIERS)), "<=", 0.5)
    ]
    if restore is not None:
        prefix, ratios = restore["prefix_tokens"], restore["ratios_to_recompute"]
        for case, bound in (
            ("host", 0.3),
            ("disk (cold page cache)", 0.6),
            ("disk (page cache)", 0.6),
        ):
            rows.append(
                (f"{prefix}-token prefix from {case} / recompute", ratios.get(case), "<=", bound)
            )
    by_dtype = cap["by_kv_dtype"]
    for base in ("auto", "bfloat16"):
        held = _ratio(by_dtype["int8"]["sessions_held"], by_dtype[base]["sessions_held"])
        rows.append((f"sessions held, int8 / {base} KV (same pool)", held, ">=", 2.0))
    out = []
    for what, value, op, bound in rows:
        met = None if value is None else value <= bound if op == "<=" else value >= bound
        out.append({"target": what, "value": value, "bound": f"{op} {bound}", "met": met})
    return out


def report(
    servers: dict[str, dict[str, Any]],
    restore: dict[str, Any] | None,
    cap: dict[str, Any],
    goals: list[dict[str, Any]],
) -> str:
    header = "server|first TTFT p50 ms|returning TTFT p50 ms|p95 ms|returning cached|returning prompt tok|other cores"
    rows = [header.split("|")]
    for label, result in servers.items():
        s = result["summary"]
        share, prompt = s["returning_cached_share"], s["returning_prompt_tokens_mean"]
        rows.append(
            [
                label,
                *(
                    _ms(s[k])
                    for k in ("first_ttft_p50_s", "returning_ttft_p50_s", "returning_ttft_p95_s")
                ),
            ]
            + ["-" if share is None else f"{share:.0%}", "-" if prompt is None else f"{prompt:.0f}"]
            + [f"{result['other_cores']:.2f}"]
        )
    for a, b in ((TIERS, NO_TIERS), (TIERS, LLAMA), (INT8, NO_TIERS), (LLAMA, LLAMA_NO_RAM)):
        if a in servers and b in servers:
            sa, sb = servers[a]["summary"], servers[b]["summary"]
            keys = ("first_ttft_p50_s", "returning_ttft_p50_s", "returning_ttft_p95_s")
            rows.append([f"{a} / {b}", *(_x(_ratio(sa[k], sb[k])) for k in keys), "", "", ""])
    parts = [
        "Sessions (TTFT = first content chunk; returning = turns 2.. of a session)",
        _grid(rows),
    ]
    if restore is not None:
        rows = [["case", "TTFT median ms", "of which copy ms", "/ recompute"]]
        for case, median in restore["medians_s"].items():
            rows.append(
                [
                    case,
                    _ms(median),
                    _ms(restore["copy_medians_s"][case]),
                    _x(restore["ratios_to_recompute"][case]),
                ]
            )
        parts += [
            "",
            f"Restore vs recompute ({restore['prefix_tokens']}-token prefix + 16-token question, max_tokens 1)",
            _grid(rows),
        ]
    rows = [["KV dtype", "bytes/block", "capacity tokens", "x auto", "sessions held", "measured"]]
    by_dtype = cap["by_kv_dtype"]
    measured_on = {"auto": NO_TIERS, "int8": INT8}
    for name, row in by_dtype.items():
        seen = "-"
        if (server := servers.get(measured_on.get(name, ""))) is not None:
            share = server["summary"]["returning_cached_share"]
            key = 'infermux_backend_kv_cache_capacity_tokens{backend="core"}'
            tokens = server["kv_metrics"].get(key)
            if tokens is not None and share is not None:
                seen = f"server capacity {tokens:.0f}, returning turns cached {share:.0%}"
        dtype = cap["compute_dtype"].removeprefix("torch.")
        rows.append(
            [
                f"auto ({dtype})" if name == "auto" else name,
                str(row["block_bytes"]),
                str(row["capacity_tokens"]),
                _x(row["capacity_tokens"] / by_dtype["auto"]["capacity_tokens"]),
                str(row["sessions_held"]),
                seen,
            ]
        )
    parts += ["", f"Device pool of {cap['kv_cache_mb']} MiB", _grid(rows)]
    rows = [["target", "measured", "bound", "met"]]
    for goal in goals:
        met = "-" if goal["met"] is None else "met" if goal["met"] else "NOT met"
        rows.append([goal["target"], _x(goal["value"]), goal["bound"], met])
    parts += ["", "Targets", _grid(rows)]
    return "\n".join(parts)


def plot(document: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    servers = document["sessions"]
    figure, axes = plt.subplots(2, 2, figsize=(13, 9))
    axis = axes[0, 0]
    xs: list[int] = []
    for index, (label, result) in enumerate(servers.items()):
        for number, run in enumerate(result["runs"]):  # later passes dashed
            ys = [t["ttft_s"] * 1000 if t["ttft_s"] else float("nan") for t in run["turns"]]
            xs = list(range(len(ys)))
            style = {
                "linestyle": "-" if number == 0 else "--",
                "alpha": 0.9 if number == 0 else 0.5,
            }
            name = label if number == 0 else None
            axis.plot(xs, ys, marker=".", color=f"C{index}", label=name, **style)  # type: ignore[arg-type]
    num_sessions = document["settings"]["sessions"]
    for boundary in range(num_sessions, len(xs), num_sessions):
        axis.axvline(boundary - 0.5, color="grey", linestyle=":")
    axis.set_yscale("log")
    axis.set_xlabel(f"request (round-robin over {num_sessions} sessions; dotted: next turn)")
    axis.set_ylabel("TTFT (ms, log scale)")
    axis.set_title("TTFT of every request", fontsize=9)
    axis.legend(fontsize=7)
    axis.grid(alpha=0.3)

    axis = axes[0, 1]
    labels = list(servers)
    width = 0.38
    for k, (key, name) in enumerate(
        (("first_ttft_p50_s", "first turn p50"), ("returning_ttft_p50_s", "returning p50"))
    ):
        values = [(servers[label]["summary"][key] or float("nan")) * 1000 for label in labels]
        bars = axis.bar(
            [i - width / 2 + k * width for i in range(len(labels))],
            values,
            width,
            label=name,
            color=f"C{k + 5}",
        )
        axis.bar_label(bars, fmt="%.0f", fontsize=7)
    axis.set_xticks(
        range(len(labels)), [label.replace(" ", "\n", 1) for label in labels], fontsize=7
    )
    axis.set_yscale("log")
    axis.set_ylabel("TTFT (ms, log scale)")
    axis.set_title("TTFT p50: first turn vs returning turns", fontsize=9)
    axis.legend(fontsize=7)

    axis = axes[1, 0]
    restore = document.get("restore")
    if restore is None:
        axis.axis("off")
    else:
        cases = list(restore["medians_s"])
        values = [restore["medians_s"][c] * 1000 for c in cases]
        copies = [(restore["copy_medians_s"][c] or 0.0) * 1000 for c in cases]
        bars = axis.bar(range(len(cases)), values, 0.6, color="C2", label="TTFT median")
        axis.bar(range(len(cases)), copies, 0.3, color="C3", label="of which copy to device")
        axis.bar_label(
            bars,
            labels=[
                f"{v:.0f} ms\n{restore['ratios_to_recompute'][c]:.2f}x"
                for v, c in zip(values, cases, strict=True)
            ],
            fontsize=7,
        )
        axis.set_xticks(range(len(cases)), [c.replace(" (", "\n(") for c in cases], fontsize=7)
        axis.set_ylabel("ms")
        axis.set_title(
            f"{restore['prefix_tokens']}-token prefix: restore vs recompute (ratio to recompute)",
            fontsize=9,
        )
        axis.legend(fontsize=7)

    axis = axes[1, 1]
    cap = document["capacity"]["by_kv_dtype"]
    names = list(cap)
    bars = axis.bar(range(len(names)), [cap[n]["capacity_tokens"] for n in names], 0.6, color="C4")
    axis.bar_label(
        bars,
        labels=[
            f"{cap[n]['capacity_tokens']} tok\n{cap[n]['sessions_held']} sessions" for n in names
        ],
        fontsize=7,
    )
    dtype = document["capacity"]["compute_dtype"].removeprefix("torch.")
    axis.set_xticks(range(len(names)), [f"auto ({dtype})" if n == "auto" else n for n in names])
    axis.set_ylabel("device capacity (tokens)")
    axis.set_title(
        f"KV dtype at a {document['capacity']['kv_cache_mb']} MiB device pool", fontsize=9
    )
    for axis in axes.flat[1:]:
        axis.margins(y=0.15)  # room for the bar labels
    figure.suptitle(document["title"], fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# --- the command line ----------------------------------------------------------------------------


def wait_for_quiet(max_wait_s: float) -> list[str]:
    """Wait (checking every 30 s) until no pytest runs but ours; what was seen."""
    seen: list[str] = []
    deadline = time.monotonic() + max_wait_s
    while True:
        others = [
            line
            for line in os.popen("pgrep -af pytest").read().splitlines()
            if line.split()[0] != str(os.getpid()) and "pgrep" not in line
        ]
        if not others or time.monotonic() >= deadline:
            if others:
                seen.append(f"still running after {max_wait_s:.0f} s: {others}")
            return seen
        seen.append(
            f"{dt.datetime.now(dt.UTC):%H:%M:%S} {len(others)} pytest processes, load {os.getloadavg()}"
        )
        print(f"waiting for other pytest runs to finish: {others[0][:100]}", flush=True)
        time.sleep(30)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="smoke run: 4 sessions x 2 turns, 512-token prefix")
    add("--sessions", type=int, help="sessions (default 8; --quick 4)")
    add("--turns", type=int, help="turns per session (default 3; --quick 2)")
    add(
        "--num-orders",
        type=int,
        help="order lines per session's system text, ~32 tokens each (default 20; --quick 8)",
    )
    add("--max-tokens", type=int, default=16, help="answer tokens per turn (default 16)")
    add(
        "--kv-cache-mb",
        type=int,
        help="core engine device KV pool, MiB (default 80: ~2 sessions; --quick 24)",
    )
    add("--kv-host-mb", type=int, default=1024, help="host tier, MiB (default 1024: every session)")
    add("--prefix-tokens", type=int, help="restore vs recompute prefix (default 1536; --quick 512)")
    add("--repeats", type=int, help="restore trials per case (default 3; --quick 1)")
    add("--dtype", default="auto", help="core engine compute dtype (default auto)")
    add(
        "--threads",
        type=int,
        default=2,
        help="threads of the core engine and llama-server (default 2)",
    )
    add(
        "--llama-server",
        metavar="PATH",
        help="the binary (default: scripts/build_llama_server.sh's)",
    )
    add(
        "--llama-slots",
        type=int,
        default=2,
        help="llama-server -np (default 2: two resident sessions)",
    )
    add("--llama-ctx-per-slot", type=int, default=2048)
    add(
        "--llama-cache-ram-mb",
        type=int,
        default=1024,
        help="llama-server --cache-ram (default 1024)",
    )
    add(
        "--servers",
        default=",".join([LLAMA, TIERS, NO_TIERS, INT8, LLAMA_NO_RAM]),
        help="comma list, run in this order",
    )
    add("--passes", type=int, default=1, help="runs of every server, order reversed each pass")
    add("--skip-restore", action="store_true", help="no in-process restore measurement")
    add(
        "--wait-for-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="first wait up to S s until no other pytest runs",
    )
    add("--timeout", type=float, default=600.0, help="seconds per request")
    add("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    defaults = {
        "sessions": (8, 4),
        "turns": (3, 2),
        "num_orders": (20, 8),
        "kv_cache_mb": (80, 24),
        "prefix_tokens": (1536, 512),
        "repeats": (3, 1),
    }
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = set(args.servers) - {LLAMA, TIERS, NO_TIERS, INT8, LLAMA_NO_RAM}
    if unknown:
        parser.error(f"--servers: unknown {sorted(unknown)}")
    if args.turns < 2:
        parser.error("--turns: at least 2 (returning turns are what is measured)")
    return args


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM unwinds like Ctrl-C: the servers are stopped either way


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    waited = wait_for_quiet(args.wait_for_quiet) if args.wait_for_quiet else []
    load_before = Path("/proc/loadavg").read_text().strip()
    started_at = dt.datetime.now(dt.UTC)
    machine = _machine()
    print(
        f"kv_tiers: {machine.get('cpu_model')} x {machine['cpus']}, load {load_before}", flush=True
    )
    work = Path(tempfile.mkdtemp(prefix="kv_tiers-"))
    print(f"work folder (configs, server logs; disk tiers, removed at the end): {work}", flush=True)
    binary = None
    if any(s.startswith("llama-server") for s in args.servers):
        binary = _llama_server_binary(args.llama_server)
    phase_s: dict[str, float] = {}
    try:
        runs: dict[str, list[dict[str, Any]]] = {label: [] for label in args.servers}
        for number in range(1, args.passes + 1):
            order = args.servers if number % 2 else args.servers[::-1]  # ABBA over passes
            for label in order:
                run = f"pass {number}/{args.passes}"
                t0 = time.perf_counter()
                folder = work / f"pass{number}"  # its config, log and disk tier
                spec = server_spec(label, args, folder, binary)
                runs[label].append(measure_server(spec, args, folder, run))
                phase_s[f"{label} ({run})"] = took = time.perf_counter() - t0
                p50 = runs[label][-1]["summary"]["returning_ttft_p50_s"]
                print(f"  {label}: returning TTFT p50 {_ms(p50)} ms; {took:.0f} s", flush=True)
        servers = {label: merge_runs(label_runs) for label, label_runs in runs.items()}
        restore = None
        if not args.skip_restore:
            t0 = time.perf_counter()
            restore = measure_restore(args, work)
            phase_s["restore"] = time.perf_counter() - t0
    except KeyboardInterrupt:
        print("interrupted; the servers are stopped", file=sys.stderr)
        return 130
    finally:  # the disk tiers' block files (hundreds of MB); configs and logs stay
        for folder in [work / "restore-disk", *work.glob("pass*/kv")]:
            shutil.rmtree(folder, ignore_errors=True)
    # A session's final length (the same prompts on every server, answers of a few tokens
    # more or less): the most any server saw.
    final_tokens = [r["summary"]["final_session_tokens_mean"] for r in servers.values()]
    cap = capacity(args, max((t for t in final_tokens if t), default=None))
    goals = targets(servers, restore, cap)
    table = report(servers, restore, cap, goals)
    print("\n" + table)
    issues = problems(servers, restore, args.max_tokens)
    for issue in issues:
        print(f"!! {issue}", file=sys.stderr)
    finished_at = dt.datetime.now(dt.UTC)
    title = (
        f"KV tiers: core engine with / without tiers vs llama-server · {default_model_path().name}\n"
        f"{args.sessions} sessions x {args.turns} turns, pool {args.kv_cache_mb} MiB · "
        f"{machine.get('cpu_model', '?')} x {machine['cpus']} · {started_at:%Y-%m-%d %H:%M} UTC"
        + (" · QUICK (smoke run)" if args.quick else "")
    )
    version = None
    if binary is not None:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
        version = (done.stdout + done.stderr).strip()
    document = {
        "benchmark": "kv_tiers",
        "title": title,
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "started_at": started_at.isoformat(timespec="seconds"),
        "finished_at": finished_at.isoformat(timespec="seconds"),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model": str(default_model_path()),
        "llama_server_version": version,
        "machine": machine,
        "loadavg_before": load_before,
        "loadavg_after": Path("/proc/loadavg").read_text().strip(),
        "waited_for_other_pytest": waited,
        "phase_seconds": phase_s,
        "infermux_revision": _git_revision(),
        "table": table,
        "targets": goals,
        "issues": issues,
        "sessions": servers,
        "restore": restore,
        "capacity": cap,
    }
    stamp = started_at.strftime("%Y%m%dT%H%M%SZ") + ("-quick" if args.quick else "")
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = args.out / f"{stamp}.json", args.out / f"{stamp}.png"
    json_path.write_bytes(msgspec.json.format(msgspec.json.encode(document), indent=1) + b"\n")
    plot(document, png_path)
    print(f"\nwrote {json_path} and {png_path}")
    return 1 if issues else 0


if __name__ == "__main__":
    sys.exit(main())
