"""``infermux plan``: memory and roofline estimates of a model on a device.

::

    infermux plan --model model.gguf                       # this machine's CPU, measured
    infermux plan --model models/ --device h100 --context 32768 --concurrency 64
    infermux plan --model model.gguf --device l4 --json

One row per weight format x KV dtype: resident weight bytes, KV bytes per token and per
request, the most requests that fit, decode tokens/s at batch 1 and at ``--concurrency``
(the lesser of the bandwidth and compute bounds, named), prefill tokens/s; then what the
quantization policy would choose and why. See docs/plan.md.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["add_parser", "run"]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_parser(subparsers: Any) -> None:
    """Register ``plan``."""
    from core_engine.plan.devices import DEVICE_NAMES

    parser = subparsers.add_parser(
        "plan",
        help="memory and roofline estimates of a model on a device",
        description="Memory and roofline estimates of a GGUF model for each weight format and KV "
        "cache dtype on a device: 'cpu' measures this machine (a few seconds), 'cuda' the local "
        "GPU, the other names use published datasheet figures.",
    )
    parser.add_argument("--model", required=True, metavar="FILE_OR_DIR",
                        help="a .gguf file, or a directory holding exactly one")
    parser.add_argument("--context", type=_positive_int, default=8192,
                        help="tokens per request (default: 8192)")
    parser.add_argument("--concurrency", type=_positive_int, default=32,
                        help="requests decoding together (default: 32)")
    parser.add_argument("--device", default="cpu", choices=DEVICE_NAMES, metavar="DEVICE",
                        help=f"one of {', '.join(DEVICE_NAMES)} (default: cpu)")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    parser.set_defaults(func=run, usage_error=parser.error)


#: plan_model's parameter -> the option that sets it.
_OPTIONS = {"model_path": "--model", "device": "--device", "context": "--context", "concurrency": "--concurrency"}


def run(args: argparse.Namespace) -> int:
    """Print the plan; argparse's exit (2, naming the option) when an input is refused."""
    from core_engine.plan.planner import PlanError, plan_model
    from core_engine.plan.report import format_plan, plan_json

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        plan = plan_model(args.model, device=args.device, context=args.context,
                          concurrency=args.concurrency, progress=progress)
    except PlanError as exc:
        args.usage_error(f"argument {_OPTIONS.get(exc.param, exc.param)}: {exc.detail}")
        return 2  # not reached: argparse's error() exits with 2
    print(plan_json(plan) if args.json else format_plan(plan))
    return 0
