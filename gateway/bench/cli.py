"""``infermux bench``: the command line of the serving benchmark.

``gateway.cli`` registers it with :func:`add_parser`; ``python -m gateway.bench`` runs it alone
through :func:`main`. See docs/bench.md for the metrics. ``vllm bench serve``'s flag names are
accepted too: the plain renames as second option strings below (``--num-prompts``), the rest
in :mod:`gateway.bench.vllm_flags`.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from typing import Any

import msgspec

from gateway.bench.config import BenchConfig, Target, parse_prices, parse_slo
from gateway.bench.errors import BenchConfigError, BenchError
from gateway.bench.vllm_flags import add_vllm_arguments, apply_vllm_flags
from gateway.bench.workload import WORKLOAD_NAMES, WorkloadSpec

__all__ = ["add_arguments", "add_parser", "config_from_args", "main", "run"]

_DESCRIPTION = (
    "Benchmark any OpenAI-compatible endpoint: TTFT, ITL, TPOT, end-to-end latency "
    "percentiles, throughput, goodput under SLOs, prefix-cache hit rate and cost; "
    "optionally two endpoints side by side (--compare)."
)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench`` on an argparse subparsers object; the handler is ``args.func``."""
    parser = subparsers.add_parser(
        "bench",
        help="benchmark an OpenAI-compatible endpoint",
        description=_DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags."""
    target = parser.add_argument_group("endpoint")
    target.add_argument(
        "--url", "--base-url", help="base URL, e.g. http://127.0.0.1:8000 (required)"
    )
    target.add_argument("--model", help="model name; default: the first of GET /v1/models")
    target.add_argument("--api-key", help="bearer key (default: $OPENAI_API_KEY)")
    target.add_argument(
        "--header",
        action="extend",
        nargs="+",
        default=[],
        metavar="K:V",
        help="extra header, K:V or K=V (repeatable)",
    )
    target.add_argument(
        "--endpoint",
        type=_endpoint,
        help="chat (default) or completions; vLLM's /v1/chat/completions, /v1/completions too",
    )

    compare = parser.add_argument_group("comparison (B against A = --url)")
    compare.add_argument(
        "--compare", metavar="URL2", help="second endpoint, measured in the same run"
    )
    compare.add_argument("--model2", help="model on URL2; default: the first it lists")
    compare.add_argument("--api-key2", help="bearer key for URL2 (default: --api-key)")
    compare.add_argument(
        "--header2",
        action="append",
        default=[],
        metavar="K:V",
        help="header only for URL2, added to --header (repeatable)",
    )
    compare.add_argument(
        "--compare-mode",
        choices=("alternate", "concurrent"),
        default="alternate",
        help="alternate: blocks of requests go to A and B in turn (ABBA), never both at once; "
        "concurrent: both get the whole load at the same time",
    )
    compare.add_argument(
        "--compare-block",
        type=int,
        metavar="N",
        help="requests per block in alternate mode (default: 1 at concurrency 1, else 4 x concurrency)",
    )

    workload = parser.add_argument_group("workload")
    workload.add_argument(
        "--workload",
        metavar="NAME|FILE",
        help=f"one of {', '.join(WORKLOAD_NAMES)} (default: fixed), or a JSONL file of prompts",
    )
    workload.add_argument(
        "--num-requests", "--num-prompts", type=int, help="default: 100 (a file: every line)"
    )
    workload.add_argument(
        "--input-len",
        "--random-input-len",
        type=int,
        default=256,
        help="prompt tokens (approximate)",
    )
    workload.add_argument(
        "--output-len",
        "--random-output-len",
        type=int,
        help="max_tokens; default 128 (code-edit: the file's length)",
    )
    workload.add_argument(
        "--prefix-len", type=int, help="shared-prefix: shared tokens (default 3/4 of input)"
    )
    workload.add_argument(
        "--num-prefixes", type=int, default=1, help="shared-prefix: distinct prefixes"
    )
    workload.add_argument(
        "--tokens-per-word",
        default="auto",
        help="tokens per word of synthetic text; auto: measured from the endpoint's usage",
    )
    workload.add_argument("--seed", type=int, default=0, help="seeds prompts and arrival times")

    load = parser.add_argument_group("load")
    load.add_argument(
        "--concurrency",
        "--max-concurrency",
        type=int,
        help="most requests in flight per endpoint",
    )
    load.add_argument(
        "--request-rate",
        action="append",
        default=[],
        metavar="R",
        help="requests/s (Poisson arrivals); repeat or give a comma list for a sweep; "
        "inf sends all at once (default)",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of inter-arrival times: 1 Poisson, <1 burstier, >1 more regular",
    )
    load.add_argument(
        "--warmup",
        "--num-warmups",
        type=int,
        default=0,
        help="unrecorded requests per endpoint first",
    )

    request = parser.add_argument_group("request")
    request.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos (vLLM, infermux) and min_tokens=max_tokens (llama-cpp-python, vLLM) so output lengths are fixed",
    )
    request.add_argument("--temperature", default="0", help="sampling temperature; 'none' omits it")
    request.add_argument(
        "--extra-body", metavar="JSON", help="JSON object merged into every request body"
    )
    request.add_argument("--timeout", type=float, default=600.0, help="seconds per request")

    report = parser.add_argument_group("report")
    report.add_argument(
        "--slo", help="goodput targets, e.g. ttft=500ms,tpot=50ms (keys: ttft, tpot, itl, e2e)"
    )
    report.add_argument("--price", help="per 1M tokens, e.g. input=0.15,output=0.6,cached=0.075")
    report.add_argument("--json", metavar="FILE", help="write every result and record as JSON")
    report.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR")
    report.add_argument(
        "--no-progress", "--disable-tqdm", action="store_true", help="no progress bar"
    )
    add_vllm_arguments(parser)


#: --endpoint values: ours, and the API paths vLLM's --endpoint takes.
_ENDPOINTS = {
    "chat": "chat",
    "completions": "completions",
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
}


def _endpoint(text: str) -> str:
    try:
        return _ENDPOINTS[text]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: use one of {', '.join(map(repr, _ENDPOINTS))}"
        ) from None


def _headers(items: list[str], param: str) -> dict[str, str]:
    headers = {}
    for item in items:
        # K:V (ours) or KEY=VALUE (vLLM's): a header name holds neither character, so the
        # first of them ends the name.
        cut = min((i for i in (item.find(":"), item.find("=")) if i >= 0), default=-1)
        key, value = item[:cut], item[cut + 1 :]
        if cut < 0 or not key.strip():
            raise BenchConfigError(f"expected K:V or K=V, got {item!r}", param=param)
        headers[key.strip()] = value.strip()
    return headers


def _rates(items: list[str]) -> list[float | None]:
    rates: list[float | None] = []
    for item in items:
        for part in item.split(","):
            if not part.strip():
                continue
            try:
                rate = float(part)
            except ValueError as exc:
                raise BenchConfigError(f"not a number: {part!r}", param="--request-rate") from exc
            if not rate > 0:
                raise BenchConfigError(f"must be positive, got {part!r}", param="--request-rate")
            rates.append(None if math.isinf(rate) else rate)
    return rates or [None]


def _optional_float(text: str, none_word: str, param: str) -> float | None:
    if text.strip().lower() == none_word:
        return None
    try:
        return float(text)
    except ValueError as exc:
        raise BenchConfigError(
            f"expected a number or {none_word!r}, got {text!r}", param=param
        ) from exc


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Turn parsed flags into a validated BenchConfig (BenchConfigError names the flag)."""
    sampling = apply_vllm_flags(args)
    headers = _headers(args.header, "--header")
    # From the environment here, not as an argparse default, so --help never prints a key.
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    targets = [Target(label="A", url=args.url, model=args.model, api_key=api_key, headers=headers)]
    if args.compare:
        targets.append(
            Target(
                label="B",
                url=args.compare,
                model=args.model2,
                api_key=args.api_key2 or api_key,
                headers={**headers, **_headers(args.header2, "--header2")},
            )
        )
    elif args.model2 or args.header2 or args.api_key2:
        raise BenchConfigError(
            "only meaningful with --compare", param="--model2/--header2/--api-key2"
        )
    extra_body: dict[str, Any] = {}
    if args.extra_body:
        try:
            extra_body = msgspec.json.decode(args.extra_body)
        except msgspec.DecodeError as exc:
            raise BenchConfigError(f"not JSON: {exc}", param="--extra-body") from exc
        if not isinstance(extra_body, dict):
            raise BenchConfigError("must be a JSON object", param="--extra-body")
    extra_body = {**sampling, **extra_body}  # --extra-body wins, as in vLLM
    config = BenchConfig(
        targets=targets,
        workload=WorkloadSpec(
            name=args.workload or "fixed",
            num_requests=args.num_requests,
            input_len=args.input_len,
            output_len=args.output_len,
            prefix_len=args.prefix_len,
            num_prefixes=args.num_prefixes,
        ),
        endpoint=args.endpoint or "chat",
        concurrency=args.concurrency,
        request_rates=_rates(args.request_rate),
        burstiness=args.burstiness,
        seed=args.seed,
        tokens_per_word=_optional_float(args.tokens_per_word, "auto", "--tokens-per-word"),
        ignore_eos=args.ignore_eos,
        temperature=_optional_float(args.temperature, "none", "--temperature"),
        timeout_s=args.timeout,
        warmup=args.warmup,
        slo=parse_slo(args.slo),
        prices=parse_prices(args.price),
        compare_mode=args.compare_mode,
        compare_block=args.compare_block,
        extra_body=extra_body,
        progress=not args.no_progress,
    )
    config.validate()
    return config


def run(args: argparse.Namespace) -> int:
    """Run the benchmark the flags describe; print the report; the process exit code."""
    # Imported here so that `infermux --help` does not pay for tqdm, numpy and matplotlib.
    from gateway.bench.report import format_report, write_json
    from gateway.bench.runner import run_benchmark

    try:
        config = config_from_args(args)
        result = asyncio.run(run_benchmark(config))
    except BenchConfigError as exc:
        print(f"infermux bench: error: {exc}", file=sys.stderr)
        return 2
    except BenchError as exc:
        print(f"infermux bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("infermux bench: interrupted", file=sys.stderr)
        return 130
    print(format_report(result))
    if args.json:
        print(f"wrote {write_json(result, args.json)}")
    if args.plot:
        from gateway.bench.plot import write_plots

        for path in write_plots(result, args.plot):
            print(f"wrote {path}")
    # Non-zero when some endpoint and rate completed nothing: the figures would be empty.
    return 1 if any(run.summary.num_completed == 0 for run in result.runs) else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m gateway.bench``."""
    parser = argparse.ArgumentParser(
        prog="python -m gateway.bench",
        description=_DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
