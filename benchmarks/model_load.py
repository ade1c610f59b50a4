"""Reading a GGUF's header, and loading the default model in the core engine.

gguf-py's ``GGUFReader`` against ``core_engine.gguf_reader.read_gguf`` (both read every
key/value and tensor record; tensor data stays memory-mapped) on the default model and the
largest vocabulary of llama.cpp's corpus; and ``LLMEngine`` start-up on the default model
(dense and the default ``auto`` format), each in a fresh process (page cache warm). Every run
is kept; medians and min-max are reported.

    .venv/bin/python benchmarks/model_load.py                 # 5 runs each
    .venv/bin/python benchmarks/model_load.py --runs 9

Writes ``benchmarks/results/model_load-<UTC time>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gateway_overhead import _machine  # noqa: E402

_READ = """
import sys, time
from pathlib import Path
path = Path(sys.argv[2])
if sys.argv[1] == "gguf-py":
    from gguf import GGUFReader
    started = time.perf_counter(); reader = GGUFReader(str(path)); n = len(reader.tensors)
else:
    from core_engine.gguf_reader import read_gguf
    started = time.perf_counter(); index = read_gguf(path); n = len(index.tensors)
print(time.perf_counter() - started, n)
"""

_ENGINE = """
import sys, time
from backends.default_model import default_model_path
from core_engine.config import EngineConfig
from core_engine.llm_engine import LLMEngine
started = time.perf_counter()
engine = LLMEngine.from_config(EngineConfig(model_path=str(default_model_path()), weight_format=sys.argv[1]))
print(time.perf_counter() - started, engine.num_blocks)
"""


def _run(code: str, *args: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.split()
    return float(out[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    from backends.default_model import default_model_path
    from tests.real_artifacts import vocab_dir

    files = {"SmolLM2-135M Q4_1": default_model_path(), "ggml-vocab-gemma-4 (262k tokens)": vocab_dir() / "ggml-vocab-gemma-4.gguf"}
    cases: dict[str, tuple[str, tuple[str, ...]]] = {}
    for label, path in files.items():
        for reader in ("gguf-py", "read_gguf"):
            cases[f"{reader}: {label}"] = (_READ, (reader, str(path)))
    for fmt in ("dense", "auto"):
        cases[f"engine start-up, weight_format={fmt}"] = (_ENGINE, (fmt,))
    runs: dict[str, list[float]] = {name: [] for name in cases}
    for round_ in range(args.runs):  # interleaved: every case once per round
        for name, (code, case_args) in cases.items():
            runs[name].append(_run(code, *case_args))
            print(f"round {round_ + 1}/{args.runs} {name}: {runs[name][-1]:.3f} s", flush=True)
    summary = {
        name: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v), "runs_s": v}
        for name, v in runs.items()
    }
    print()
    for name, row in summary.items():
        print(f"{name:55s} {row['median_s']:7.3f} s  ({row['min_s']:.3f}-{row['max_s']:.3f})")
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = ROOT / "benchmarks" / "results" / f"model_load-{stamp}.json"
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout.strip())
    record = {"machine": _machine(), "commit": commit, "dirty": dirty, "runs": args.runs, "results": summary}
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
