"""Speculative decoding, side by side: core_engine and llama.cpp, each with and without it.

Four engines on the default model (SmolLM2-135M-Instruct), loaded in this process one at a
time: ``core_engine`` without speculation, ``core_engine`` with n-gram lookup (the default
adaptive policy), ``llamacpp`` without, and ``llamacpp`` with llama-cpp-python's
prompt-lookup draft. Two greedy workloads:

* **grounded** — "correct the spelling mistake and write out the whole text" over four
  ~200-token prose passages with one word misspelt (230-250 prompt tokens with the
  instruction): the output copies the input, as edits and rewrites do;
* **open** — free generation (stories, explanations) where lookup rarely finds anything.

Each at 1 stream (``--rounds`` requests one after another) and at ``--concurrency`` streams
(``--waves`` waves of that many requests). An engine and its speculative twin are loaded
together and their runs alternate (A B B A ...), so both see the same machine. Per request the decode rate is the tokens after the first
chunk over the time from the first to the last chunk (prefill left out); a wave's
throughput is all output tokens over the wave's wall time. Prints the ratios, writes JSON
and a PNG::

    .venv/bin/python benchmarks/speculative.py                    # all engines
    .venv/bin/python benchmarks/speculative.py --engines core,core+ngram --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import re
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backends.base import BackendConfig, GenerationRequest, SamplingParams  # noqa: E402
from core_engine.cpu_features import cpu_model  # noqa: E402

ENGINES: dict[str, tuple[str, dict[str, Any]]] = {
    "core": ("core_engine", {}),
    "core+ngram": ("core_engine", {"speculation": {"methods": ["ngram"], "max_proposal": 16}}),
    "llamacpp": ("llamacpp", {}),
    "llamacpp+lookup": ("llamacpp", {"speculation": {"methods": ["ngram"], "max_proposal": 16}}),
}
#: The engine each speculative one is compared with.
BASELINE = {"core+ngram": "core", "llamacpp+lookup": "llamacpp"}

OPEN_QUESTIONS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, step by step.",
    "Describe a day in the life of a honeybee.",
    "Write a letter to a friend about a trip to the mountains.",
]


#: Plain prose of ~200 tokens each: text a 135M model copies when asked to (long, technical
#: passages it mostly paraphrases instead; measured while writing this benchmark).
PASSAGES = [
    "The city council met on Tuesday evening to discuss the budget for the coming year. "
    "Members agreed to increase funding for public parks and libraries, while reducing spending "
    "on road repairs that had already been planned for the summer. The mayor said the changes "
    "would improve the quality of life for residents, especially for families with young "
    "children who use the parks every weekend. Several citizens spoke during the public comment "
    "period. One resident asked the council to consider more bike lanes on the main streets, and "
    "another asked for better lighting near the train station, where people walk home late at "
    "night. A local teacher thanked the council for supporting the libraries and described how "
    "her students borrow books every week. The council will vote on the final budget next month, "
    "after a second public hearing. Copies of the proposal are available at the city hall and on "
    "the city website, and residents can send written comments until the end of the month.",
    "Every morning the bakery on the corner opens its doors at six o'clock. The baker arrives an "
    "hour earlier to heat the ovens and prepare the dough that rested overnight in the cold room. "
    "By the time the first customers arrive, the shelves are full of fresh bread, warm rolls and "
    "small cakes covered with sugar. Most people buy a loaf of bread and a coffee on their way to "
    "work. On Saturdays the line reaches the end of the street, because the bakery also sells "
    "fruit pies that are only made at the weekend. The baker learned the trade from his "
    "grandmother, who ran the same shop for forty years. He still uses her recipe for the apple "
    "pie, although he changed the oven and added a few new kinds of bread. In the afternoon the "
    "bakery is quiet, and the baker cleans the kitchen and writes the list of what he needs for "
    "the next day. At six in the evening he closes the doors and gives the bread that was not "
    "sold to a shelter nearby.",
    "The museum will open a new exhibition about the history of the river next week. The "
    "exhibition shows how the river changed the life of the town over the last three hundred "
    "years. Visitors can see old maps, photographs of the first bridge, and tools that were used "
    "by fishermen and boat builders. One room is about the great flood, when the water rose so "
    "high that the main square was under water for two weeks. Another room shows how the river "
    "was cleaned in the last thirty years, and how fish and birds came back to its banks. "
    "Children can try a small model of a water mill and learn how it was used to grind grain. "
    "The exhibition is open every day except Monday, from ten in the morning to five in the "
    "afternoon. Entry is free for children and students, and guided tours are offered on "
    "Saturday and Sunday at eleven o'clock. The museum cafe will serve a special menu with fish "
    "from the river during the first month of the exhibition.",
    "Our team will move to the new office on the third floor at the start of next month. The new "
    "office has more space, larger windows and a kitchen with a coffee machine and a fridge. Each "
    "person will have a desk near the window, and there are two meeting rooms that can be booked "
    "from the shared calendar. Please pack your personal things in the boxes that will be "
    "delivered on Wednesday, and write your name on every box. The movers will come on Friday "
    "afternoon and carry the boxes and the computers to the new floor. On Monday morning your "
    "desk will be ready, and the computers will be connected to the network. If something is "
    "missing or broken, please write to the office manager as soon as possible. Parking does not "
    "change, and the entrance to the building stays the same. We will have a small lunch in the "
    "new kitchen on Monday to celebrate the move, and everyone is welcome to join.",
]


def _passages(num: int) -> list[str]:
    return [PASSAGES[i % len(PASSAGES)] for i in range(num)]


def _misspell(text: str) -> str:
    """Double one letter of the first long word past the middle."""
    words = list(re.finditer(r"[A-Za-z]{7,}", text))
    if not words:
        return text
    word = next((w for w in words if w.start() > len(text) // 2), words[-1])
    i = word.start() + 3
    return text[:i] + text[i] + text[i:]


def _requests(workload: str, count: int, max_tokens: int) -> list[GenerationRequest]:
    from backends.base import ChatMessage

    if workload == "grounded":
        passages = _passages(max(count, 4))
        contents = [
            "Correct the spelling mistake in the text below and write out the whole corrected "
            f"text, unchanged otherwise.\n\n{_misspell(p)}"
            for p in passages
        ]
    else:
        contents = OPEN_QUESTIONS
    return [
        GenerationRequest(
            request_id=f"{workload}-{i}",
            model="m",
            kind="chat",
            messages=(ChatMessage(role="user", content=contents[i % len(contents)]),),
            params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
            stream=True,
        )
        for i in range(count)
    ]


async def _one(backend: Any, request: GenerationRequest) -> dict[str, Any]:
    started = time.perf_counter()
    first = last = None
    first_tokens = count = 0
    spec = None
    async for chunk in backend.generate(request):
        n = len(chunk.token_ids) or (1 if chunk.text else 0)
        if n:
            now = time.perf_counter()
            if first is None:
                first, first_tokens = now, n
            last = now
            count += n
        if chunk.speculation is not None:
            spec = chunk.speculation
    decode = None
    if first is not None and last is not None and last > first:
        decode = (count - first_tokens) / (last - first)
    return {
        "tokens": count,
        "ttft_s": None if first is None else first - started,
        "decode_tok_s": decode,
        "drafts": spec.num_drafts if spec else 0,
        "draft_tokens": spec.num_draft_tokens if spec else 0,
        "accepted_tokens": spec.num_accepted_tokens if spec else 0,
    }


async def _wave(backend: Any, requests: list[GenerationRequest]) -> dict[str, Any]:
    started = time.perf_counter()
    results = await asyncio.gather(*(_one(backend, r) for r in requests))
    wall = time.perf_counter() - started
    return {"wall_s": wall, "requests": results}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    reqs = [r for run in runs for r in run["requests"]]
    tokens = sum(r["tokens"] for r in reqs)
    wall = sum(run["wall_s"] for run in runs)
    decode = [r["decode_tok_s"] for r in reqs if r["decode_tok_s"]]
    drafts = sum(r["drafts"] for r in reqs)
    proposed = sum(r["draft_tokens"] for r in reqs)
    accepted = sum(r["accepted_tokens"] for r in reqs)
    return {
        "output_tokens": tokens,
        "throughput_tok_s": tokens / wall if wall else 0.0,
        "decode_tok_s_median": statistics.median(decode) if decode else None,
        "ttft_s_median": statistics.median(r["ttft_s"] for r in reqs if r["ttft_s"] is not None),
        "acceptance_rate": accepted / proposed if proposed else None,
        "mean_accepted_length": accepted / drafts if drafts else None,
        "num_drafts": drafts,
    }


async def _start(name: str, args: argparse.Namespace) -> Any:
    kind, extra = ENGINES[name]
    options: dict[str, Any] = dict(extra)
    if kind == "llamacpp":
        from backends.llamacpp import create_backend

        options |= {"n_ctx": 2048, "parallel": max(16, args.concurrency), "n_threads": args.threads}
    else:
        from backends.core_engine import create_backend

        options["num_threads"] = args.threads
    backend = create_backend(BackendConfig(name=name, kind=kind, options=options))
    print(f"[{name}] loading", flush=True)
    await backend.start()
    await _one(backend, _requests("open", 1, 8)[0])  # warm-up
    return backend


async def _bench_family(names: list[str], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """An engine and its speculative twin, loaded together; their runs alternate (ABBA...)."""
    backends = {name: await _start(name, args) for name in names}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {name: {} for name in names}
    try:
        for workload in ("grounded", "open"):
            for streams in (1, args.concurrency):
                key = f"{workload}/{streams}"
                rounds = args.rounds if streams == 1 else args.waves
                for r in range(rounds):
                    order = names if r % 2 == 0 else names[::-1]
                    for name in order:
                        requests = _requests(workload, streams, args.tokens)
                        if streams == 1:  # a different passage / question each round
                            requests = [_requests(workload, rounds, args.tokens)[r]]
                        runs[name].setdefault(key, []).append(await _wave(backends[name], requests))
                    print(f"[{'|'.join(names)}] {key}: round {r + 1}/{rounds}", flush=True)
                for name in names:
                    s = _summary(runs[name][key])
                    rate = s["acceptance_rate"]
                    print(
                        f"[{name}] {key}: {s['throughput_tok_s']:.1f} tok/s, decode "
                        f"{s['decode_tok_s_median'] or 0:.1f} tok/s/stream, acceptance "
                        f"{'-' if rate is None else f'{rate:.2f}'}",
                        flush=True,
                    )
    finally:
        for backend in backends.values():
            await backend.aclose()
    return {name: {key: _summary(r) for key, r in per.items()} for name, per in runs.items()}


def _plot(results: dict[str, Any], path: Path, concurrency: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["grounded/1", "open/1", f"grounded/{concurrency}", f"open/{concurrency}"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = list(results)
    width = 0.8 / max(1, len(names))
    for j, name in enumerate(names):
        values = []
        for key in keys:
            s = results[name].get(key, {})
            values.append((s.get("decode_tok_s_median") or 0) if key.endswith("/1") else s.get("throughput_tok_s", 0))
        ax.bar([i + j * width for i in range(len(keys))], values, width, label=name)
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(keys))])
    labels = [
        k.split("/")[0] + (" 1 stream (decode)" if k.endswith("/1") else f" {concurrency} streams")
        for k in keys
    ]
    ax.set_xticklabels(labels)
    ax.set_ylabel("tokens / s")
    ax.set_title("Speculative decoding on SmolLM2-135M (greedy)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--rounds", type=int, default=4, help="single-stream requests per workload")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--waves", type=int, default=2, help="waves of --concurrency requests per workload")
    parser.add_argument("--tokens", type=int, default=256, help="max_tokens per request")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "speculative")
    args = parser.parse_args()
    names = [n for n in args.engines.split(",") if n]
    unknown = [n for n in names if n not in ENGINES]
    if unknown:
        raise SystemExit(f"unknown engines {unknown}; choose from {list(ENGINES)}")
    results: dict[str, Any] = {}
    for family in (["core", "core+ngram"], ["llamacpp", "llamacpp+lookup"]):
        chosen = [n for n in family if n in names]
        if chosen:
            results |= asyncio.run(_bench_family(chosen, args))
    ratios: dict[str, dict[str, float]] = {}
    for name, base in BASELINE.items():
        if name not in results or base not in results:
            continue
        ratios[f"{name} / {base}"] = {}
        for key, s in results[name].items():
            b = results[base][key]
            metric = "decode_tok_s_median" if key.endswith("/1") else "throughput_tok_s"
            if s.get(metric) and b.get(metric):
                ratios[f"{name} / {base}"][key] = s[metric] / b[metric]
    if "core+ngram" in results and "llamacpp+lookup" in results:
        ratios["core+ngram / llamacpp+lookup"] = {
            key: results["core+ngram"][key][m] / results["llamacpp+lookup"][key][m]
            for key in results["core+ngram"]
            for m in ["decode_tok_s_median" if key.endswith("/1") else "throughput_tok_s"]
            if results["core+ngram"][key].get(m) and results["llamacpp+lookup"][key].get(m)
        }
    print("\nratios (1 stream: decode tok/s; N streams: throughput)")
    for label, values in ratios.items():
        print(f"  {label}: " + ", ".join(f"{k} {v:.2f}x" for k, v in values.items()))
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    record = {
        "date": stamp,
        "command": " ".join(sys.argv),
        "machine": {"cpu": cpu_model(), "python": platform.python_version()},
        "args": {k: str(v) for k, v in vars(args).items()},
        "results": results,
        "ratios": ratios,
    }
    json_path = args.out / f"speculative-{stamp}.json"
    json_path.write_text(json.dumps(record, indent=2))
    _plot(results, args.out / f"speculative-{stamp}.png", args.concurrency)
    print(f"wrote {json_path} and the PNG beside it")


if __name__ == "__main__":
    main()
