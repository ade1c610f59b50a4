"""What structured outputs cost on the core engine: compile time, mask time, step time.

On the embedded SmolLM2-135M (default format):

* compile: every schema of the test suite (``tests/core_engine/structured_schemas.py``)
  compiled cold (no cache), p50/p99 ms;
* per-token mask: llguidance's mask computation per constrained row per step inside the
  engine (its helper thread shares the 2 cores with the forward pass), p50/p99 ms; and the
  same masks alone, replaying the test schemas' constrained outputs token by token on one
  thread with nothing else running (the figure llguidance publishes), p50/p99 ms;
* decode step time at batch 1 and 16, unconstrained vs every row constrained to a JSON schema
  (the same prompts, greedy, 64 tokens), and the ratio (target: constrained <= 1.10x). The
  two alternate for ``--rounds`` rounds and each side's figure is the median of its rounds'
  step p50s: one round each swung the ratio by +-0.1 on an idle 2-core machine.

    .venv/bin/python benchmarks/structured_outputs.py
    .venv/bin/python benchmarks/structured_outputs.py --quick

Writes ``benchmarks/results/structured_outputs-<UTC time>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gateway_overhead import _machine, _percentile  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
#: Rows keep generating under the constraint (40 items at least: no early end), so both
#: runs decode the same number of rows every step.
SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["items"],
    "properties": {"items": {"type": "array", "minItems": 40, "items": {
        "type": "object", "additionalProperties": False, "required": ["name", "note", "qty"],
        "properties": {"name": {"type": "string"}, "note": {"type": "string"}, "qty": {"type": "integer"}}}}},
}


def _steps(engine: Any, batch: int, tokens: int, constrained: bool) -> dict[str, float]:
    from core_engine.sampling_params import SamplingParams
    from core_engine.structured import StructuredOutput

    spec = StructuredOutput(json=SCHEMA) if constrained else None
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=not constrained, structured_outputs=spec)
    for i in range(batch):
        engine.add_request(f"{constrained}-{batch}-{i}", f"<|im_start|>user\nList {i + 2} things to pack, as JSON."
                           "<|im_end|>\n<|im_start|>assistant\n", params)
    engine.step()  # prefill
    steps: list[float] = []
    generated = 0
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outs = engine.step()
        steps.append(time.perf_counter() - t)
        generated += sum(len(o.new_token_ids) for o in outs)
    return {"step_p50_ms": _percentile(steps, 50) * 1e3, "step_p99_ms": _percentile(steps, 99) * 1e3,
            "tokens": generated, "steps": len(steps)}


def _replayed_masks(engine: Any, schemas: list[dict[str, Any]], tokens: int) -> list[float]:
    """Generate each schema's constrained output, then time each of its masks alone."""
    import llguidance
    import torch

    from core_engine.sampling_params import SamplingParams
    from core_engine.structured import StructuredOutput

    outputs: dict[str, list[int]] = {}
    for i, schema in enumerate(schemas):
        params = SamplingParams(temperature=0, max_tokens=tokens, structured_outputs=StructuredOutput(json=schema))
        engine.add_request(f"replay-{i}", "<|im_start|>user\nAnswer as JSON.<|im_end|>\n<|im_start|>assistant\n", params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.req_id, []).extend(out.new_token_ids)
    words = (engine.model_config.vocab_size + 31) // 32
    bitmask = torch.zeros((1, words), dtype=torch.int32)
    executor = llguidance.LLExecutor()  # the engine's own call, on this thread
    seconds: list[float] = []
    for i, schema in enumerate(schemas):
        matcher = engine.grammars.compile(StructuredOutput(json=schema))
        for token in outputs.get(f"replay-{i}", []):
            t = time.perf_counter()
            executor.unsafe_compute_mask_ptr([(matcher, 0)], bitmask.data_ptr(), words * 4, 1)
            seconds.append(time.perf_counter() - t)
            if not matcher.consume_token(token):
                break
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens = 24
        args.rounds = 1
    from backends.default_model import default_model_path
    from core_engine.config import EngineConfig
    from core_engine.llm_engine import LLMEngine
    from core_engine.structured import GrammarCompiler, StructuredOutput
    from tests.core_engine.structured_schemas import SCHEMAS

    print("loading the default model ...", flush=True)
    engine = LLMEngine.from_config(EngineConfig(model_path=str(default_model_path()), num_threads=args.threads))
    cold = GrammarCompiler(lambda: engine.grammars.lltokenizer())  # the same vocabulary, an empty cache
    cold.lltokenizer()
    for _, _, schema in SCHEMAS:
        cold.compile(StructuredOutput(json=schema))
    compile_ms = [s * 1e3 for s in cold.compile_seconds]
    results: dict[str, Any] = {"compile": {"schemas": len(compile_ms), "p50_ms": _percentile(compile_ms, 50),
                                           "p99_ms": _percentile(compile_ms, 99), "max_ms": max(compile_ms)}}
    engine.model_runner.token_masks.row_seconds.clear()
    for batch in (1, 16):
        rounds: dict[str, list[dict[str, float]]] = {"free": [], "constrained": []}
        for r in range(args.rounds):
            for constrained in (False, True):
                kind = "constrained" if constrained else "free"
                print(f"batch {batch}, {kind}, round {r + 1}/{args.rounds} ...", flush=True)
                rounds[kind].append(_steps(engine, batch, args.tokens, constrained))
        for kind, runs in rounds.items():
            results[f"batch_{batch}_{kind}"] = {
                "step_p50_ms": _percentile([run["step_p50_ms"] for run in runs], 50),
                "step_p99_ms": max(run["step_p99_ms"] for run in runs),
                "round_step_p50s_ms": [run["step_p50_ms"] for run in runs],
                "tokens": sum(run["tokens"] for run in runs), "steps": sum(run["steps"] for run in runs),
            }
    masks = [s * 1e3 for s in engine.model_runner.token_masks.row_seconds]
    results["mask_per_row"] = {"rows": len(masks), "p50_ms": _percentile(masks, 50), "p90_ms": _percentile(masks, 90),
                               "p99_ms": _percentile(masks, 99)}
    print("replaying the test schemas' outputs, one mask at a time ...", flush=True)
    alone = [s * 1e3 for s in _replayed_masks(engine, [schema for _, _, schema in SCHEMAS], args.tokens)]
    results["mask_alone"] = {"masks": len(alone), "p50_ms": _percentile(alone, 50), "p90_ms": _percentile(alone, 90),
                             "p99_ms": _percentile(alone, 99)}
    ratios = {f"batch_{b}": results[f"batch_{b}_constrained"]["step_p50_ms"] / results[f"batch_{b}_free"]["step_p50_ms"]
              for b in (1, 16)}
    print(f"\ncompile: {results['compile']}")
    print(f"mask per row, in the engine: {results['mask_per_row']}")
    print(f"mask alone (replay): {results['mask_alone']}")
    for b in (1, 16):
        free, con = results[f"batch_{b}_free"], results[f"batch_{b}_constrained"]
        print(f"batch {b:>2}: step p50 {free['step_p50_ms']:.2f} ms free, {con['step_p50_ms']:.2f} ms constrained "
              f"= {ratios[f'batch_{b}']:.2f}x")
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = RESULTS / f"structured_outputs-{stamp}.json"
    record = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
              "date": stamp, "machine": _machine(), "settings": vars(args), "results": results, "ratios": ratios}
    out.write_text(json.dumps(record, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for k, kind in enumerate(("free", "constrained")):
        ax.bar([i + (k - 0.5) * 0.38 for i in range(2)],
               [results[f"batch_{b}_{kind}"]["step_p50_ms"] for b in (1, 16)], 0.38, label=kind)
    ax.set_xticks(range(2), ["batch 1", "batch 16"])
    ax.set_ylabel("decode step p50 (ms)")
    ax.set_title("core engine, JSON-schema constraint vs none")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"wrote {out} and {out.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
