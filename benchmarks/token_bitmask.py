"""Applying a batch's llguidance bitmasks to the logits: infermux's table lookup against
llguidance's own ``llguidance.torch.apply_token_bitmask_inplace`` and a plain ``masked_fill``.

Rows of SmolLM2's 49,152-token vocabulary at batch 1 and 16, with three kinds of mask: random
bits, a string's mask (almost everything allowed) and a closing mask (a few tokens allowed).
Each figure is the least of ``--repeats`` timings (ms), so a busy core does not enter it.

    .venv/bin/python benchmarks/token_bitmask.py

Writes ``benchmarks/results/token_bitmask-<UTC time>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gateway_overhead import _machine  # noqa: E402

VOCAB = 49152


def _least(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    import torch
    from llguidance.torch import apply_token_bitmask_inplace

    from core_engine.structured.masks import apply_token_bitmask

    torch.set_num_threads(args.threads)
    shifts = torch.arange(32, dtype=torch.int32)

    def masked_fill(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(logits.shape[0], -1)[:, :VOCAB].bool()
        return logits.masked_fill(~allowed, float("-inf"))

    def llguidance_inplace(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        out = logits.clone()  # the others leave the logits as they are
        apply_token_bitmask_inplace(out, bitmask)
        return out

    words = VOCAB // 32
    gen = torch.Generator().manual_seed(0)
    results: dict[str, dict[str, float]] = {}
    for batch in (1, 16):
        logits = torch.randn(batch, VOCAB, generator=gen)
        masks = {
            "random": torch.randint(-(2**31), 2**31 - 1, (batch, words), dtype=torch.int32, generator=gen),
            "string": torch.full((batch, words), -1, dtype=torch.int32),
            "closing": torch.zeros((batch, words), dtype=torch.int32),
        }
        masks["string"][:, 0] = 0
        masks["closing"][:, 3] = 5
        for kind, bitmask in masks.items():
            reference = masked_fill(logits, bitmask)
            row: dict[str, float] = {}
            ways: tuple[tuple[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]], ...] = (
                ("table (infermux)", lambda lg, bm: apply_token_bitmask(lg, bm, ())),
                ("llguidance.torch", llguidance_inplace),
                ("masked_fill", masked_fill),
            )
            for name, way in ways:
                assert torch.equal(way(logits, bitmask), reference), name
                row[name] = _least(functools.partial(way, logits, bitmask), args.repeats)
            results[f"batch {batch}, {kind}"] = row
            print(f"batch {batch:>2}, {kind:<8}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in row.items()), flush=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = ROOT / "benchmarks" / "results" / f"token_bitmask-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]), "date": stamp,
                               "machine": _machine(), "settings": vars(args), "results_ms": results}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
