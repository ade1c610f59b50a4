"""``vllm bench serve``'s flag names, accepted by ``infermux bench`` (docs/bench.md's table).

A command written for vLLM's benchmark runs unchanged where the two tools share a meaning:
the pure renames (``--num-prompts``, ``--max-concurrency``, ``--random-input-len`` ...) are
second option strings of the native flags in :mod:`gateway.bench.cli`; the flags whose value
differs in form (``--base-url``/``--host``/``--port``, ``--backend``, ``--dataset-name``,
``--goodput``, ``--save-result`` ...) are added here and turned into the native settings by
:func:`apply_vllm_flags` before the config is built. vLLM flags with no counterpart here (a
tokenizer, ramp-up, beam search ...) are refused with the reason, never ignored.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from gateway.bench.errors import BenchConfigError

__all__ = ["add_vllm_arguments", "apply_vllm_flags"]

#: --backend value -> the API it speaks (vLLM's "openai" and "vllm" send /v1/completions).
_BACKENDS = {"openai": "completions", "vllm": "completions", "openai-chat": "chat"}
#: vLLM's sampling flags, sent as request fields of the same name.
_SAMPLING = {
    "--top-p": ("top_p", float),
    "--top-k": ("top_k", int),
    "--min-p": ("min_p", float),
    "--frequency-penalty": ("frequency_penalty", float),
    "--presence-penalty": ("presence_penalty", float),
    "--repetition-penalty": ("repetition_penalty", float),
}
_PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
#: The percentiles every report prints (gateway.bench.metrics.PERCENTILES).
_REPORTED_PERCENTILES = (50.0, 90.0, 95.0, 99.0)

#: vLLM flags without a counterpart: flag -> (takes a value, why it is refused).
_REFUSED = {
    "--tokenizer": (
        True,
        "no tokenizer here: token lengths are calibrated on the endpoint's "
        "usage, or set with --tokens-per-word",
    ),
    "--tokenizer-mode": (True, "no tokenizer here (see --tokens-per-word)"),
    "--trust-remote-code": (False, "no tokenizer is loaded, so no remote code either"),
    "--label": (True, "results are labelled by endpoint (A, B); use --result-filename"),
    "--use-beam-search": (False, "beam search is not an OpenAI API parameter"),
    "--logprobs": (True, "logprobs are not requested by the benchmark; use --extra-body"),
    "--profile": (False, "needs vLLM's torch profiler endpoints"),
    "--save-detailed": (False, "the JSON file always holds every request's record"),
    "--append-result": (False, "each run writes its own JSON file"),
    "--metadata": (True, "the JSON file has no free-form metadata section"),
    "--ramp-up-strategy": (True, "no ramp-up; sweep rates with --request-rate R1,R2,..."),
    "--ramp-up-start-rps": (True, "no ramp-up; sweep rates with --request-rate R1,R2,..."),
    "--ramp-up-end-rps": (True, "no ramp-up; sweep rates with --request-rate R1,R2,..."),
    "--lora-modules": (True, "pick a model per run with --model"),
    "--request-id-prefix": (True, "requests carry no client-chosen ids"),
    "--ready-check-timeout-sec": (True, "no ready check: the calibration probe fails fast"),
}


def _dest(flag: str) -> str:
    return "vllm_" + flag.removeprefix("--").replace("-", "_")


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    """The vLLM flags that are not plain second names of native flags."""
    group = parser.add_argument_group(
        "vllm bench serve names (docs/bench.md; the plain renames are listed with their flags)"
    )
    add = group.add_argument
    add("--host", dest="vllm_host", metavar="HOST", help="with --port: --url http://HOST:PORT")
    add(
        "--port",
        dest="vllm_port",
        type=int,
        metavar="PORT",
        help="with --host: --url http://HOST:PORT",
    )
    add(
        "--backend",
        dest="vllm_backend",
        choices=sorted(_BACKENDS),
        help="openai, vllm: --endpoint completions; openai-chat: --endpoint chat",
    )
    add(
        "--dataset-name",
        dest="vllm_dataset_name",
        metavar="NAME",
        help="random: --workload fixed (with --ignore-eos, as vLLM does); "
        "custom: --workload FILE from --dataset-path",
    )
    add(
        "--dataset-path",
        dest="vllm_dataset_path",
        metavar="FILE",
        help="a JSONL file, with --dataset-name custom",
    )
    add(
        "--random-range-ratio",
        dest="vllm_random_range_ratio",
        metavar="R",
        type=float,
        help="only 0 (fixed lengths); --workload chat varies them",
    )
    add(
        "--random-prefix-len",
        dest="vllm_random_prefix_len",
        metavar="P",
        type=int,
        help="P > 0: --workload shared-prefix --prefix-len P, input P + --random-input-len",
    )
    add(
        "--served-model-name",
        dest="vllm_served_model_name",
        metavar="NAME",
        help="--model (the API's name)",
    )
    add(
        "--goodput",
        dest="vllm_goodput",
        nargs="+",
        metavar="KEY:MS",
        help="--slo in milliseconds, e.g. ttft:500 tpot:50 e2el:2000",
    )
    add(
        "--percentile-metrics",
        dest="vllm_percentile_metrics",
        metavar="LIST",
        help="any of ttft,tpot,itl,e2el: every report has them all",
    )
    add(
        "--metric-percentiles",
        dest="vllm_metric_percentiles",
        metavar="LIST",
        help="any of 50,90,95,99: every report has them all",
    )
    add("--save-result", dest="vllm_save_result", action="store_true", help="write --json")
    add(
        "--result-dir",
        dest="vllm_result_dir",
        metavar="DIR",
        help="--json's directory; none given: the current one",
    )
    add(
        "--result-filename",
        dest="vllm_result_filename",
        metavar="FILE",
        help="--json's file name; none given: infermux-bench-<time>.json",
    )
    for flag, (dest, kind) in _SAMPLING.items():
        add(
            flag, dest=_dest(flag), type=kind, metavar="X", help=f"sent as {dest} (as --extra-body)"
        )
    refused = parser.add_argument_group("vllm bench serve flags refused (no counterpart)")
    for flag, (takes_value, reason) in _REFUSED.items():
        if takes_value:
            refused.add_argument(
                flag, dest=_dest(flag), nargs="*", default=None, metavar="VALUE", help=reason
            )
        else:
            refused.add_argument(flag, dest=_dest(flag), action="store_true", help=reason)


def _refuse(flag: str, reason: str) -> BenchConfigError:
    return BenchConfigError(
        f"vllm bench serve's flag has no counterpart here: {reason}", param=flag
    )


def apply_vllm_flags(args: argparse.Namespace) -> dict[str, Any]:
    """Turn the vLLM-named flags in ``args`` into the native ones, in place; return the
    request fields vLLM's sampling flags ask for (merged under ``--extra-body``'s).

    Raises BenchConfigError naming the flag for a refused flag, a value with no counterpart,
    or a vLLM flag that contradicts a native one given too.
    """
    for flag, (_takes_value, reason) in _REFUSED.items():
        value = getattr(args, _dest(flag), None)
        if value is not None and value is not False:
            raise _refuse(flag, reason)
    _apply_target(args)
    _apply_workload(args)
    _apply_report(args)
    return {
        field: getattr(args, _dest(flag))
        for flag, (field, _kind) in _SAMPLING.items()
        if getattr(args, _dest(flag)) is not None
    }


def _apply_target(args: argparse.Namespace) -> None:
    host, port = args.vllm_host, args.vllm_port
    if host is not None or port is not None:
        if args.url is not None:
            raise BenchConfigError(
                "give either --url / --base-url or --host/--port", param="--host"
            )
        # vLLM's defaults for the half not given.
        args.url = f"http://{host or '127.0.0.1'}:{port or 8000}"
    if args.url is None:
        raise BenchConfigError(
            "give the endpoint (or vLLM's --base-url, --host/--port)", param="--url"
        )
    if args.vllm_served_model_name is not None:
        # vLLM then reads --model as the tokenizer, which is not needed here.
        args.model = args.vllm_served_model_name
    if args.vllm_backend is not None:
        endpoint = _BACKENDS[args.vllm_backend]
        if args.endpoint is not None and args.endpoint != endpoint:
            raise BenchConfigError(
                f"--backend {args.vllm_backend} speaks {endpoint}, --endpoint says {args.endpoint}",
                param="--backend",
            )
        args.endpoint = endpoint


def _apply_workload(args: argparse.Namespace) -> None:
    dataset, path = args.vllm_dataset_name, args.vllm_dataset_path
    if dataset is None and path is not None:
        raise BenchConfigError("only with --dataset-name custom", param="--dataset-path")
    if dataset is not None and args.workload is not None:
        raise BenchConfigError("give either --workload or --dataset-name", param="--dataset-name")
    if dataset == "random":
        args.workload = "fixed"
        # vLLM's random dataset always ignores EOS, so the output lengths are the asked ones.
        args.ignore_eos = True
    elif dataset == "custom":
        if path is None:
            raise BenchConfigError(
                "--dataset-name custom needs --dataset-path", param="--dataset-path"
            )
        args.workload = path
    elif dataset is not None:
        raise _refuse(
            "--dataset-name",
            f"no {dataset!r} dataset; use random, or custom with a JSONL --dataset-path "
            "(or --workload)",
        )
    ratio = args.vllm_random_range_ratio
    if ratio is not None and ratio != 0:
        raise _refuse(
            "--random-range-ratio", "prompt lengths are fixed; --workload chat varies them"
        )
    prefix = args.vllm_random_prefix_len
    if prefix:
        if (args.workload or "fixed") != "fixed" or args.prefix_len is not None:
            raise BenchConfigError(
                "only with the fixed workload (vLLM's random dataset)", param="--random-prefix-len"
            )
        args.workload = "shared-prefix"
        args.prefix_len = prefix
        args.input_len += prefix  # vLLM's input length does not count the prefix


def _apply_report(args: argparse.Namespace) -> None:
    if args.vllm_goodput:
        if args.slo:
            raise BenchConfigError("give either --slo or --goodput", param="--goodput")
        pairs = []
        for item in args.vllm_goodput:
            key, sep, value = item.partition(":")
            if not sep:
                raise BenchConfigError(
                    f"expected KEY:MILLISECONDS, got {item!r}", param="--goodput"
                )
            pairs.append(f"{key.strip()}={value.strip()}ms")
        args.slo = ",".join(pairs)
    if args.vllm_percentile_metrics is not None:
        for name in args.vllm_percentile_metrics.split(","):
            if name.strip() not in _PERCENTILE_METRICS:
                raise _refuse(
                    "--percentile-metrics",
                    f"no {name.strip()!r} figure; use {','.join(_PERCENTILE_METRICS)}",
                )
    if args.vllm_metric_percentiles is not None:
        for text in args.vllm_metric_percentiles.split(","):
            try:
                percentile = float(text)
            except ValueError as exc:
                raise BenchConfigError(
                    f"not a number: {text!r}", param="--metric-percentiles"
                ) from exc
            if percentile not in _REPORTED_PERCENTILES:
                raise _refuse(
                    "--metric-percentiles",
                    f"reports give p50, p90, p95 and p99, not p{text.strip()}",
                )
    if args.vllm_result_dir is not None or args.vllm_result_filename is not None:
        if not args.vllm_save_result:
            raise BenchConfigError(
                "only with --save-result", param="--result-dir/--result-filename"
            )
    if args.vllm_save_result:
        if args.json:
            raise BenchConfigError("give either --json or --save-result", param="--save-result")
        name = args.vllm_result_filename or time.strftime("infermux-bench-%Y%m%d-%H%M%S.json")
        args.json = str(Path(args.vllm_result_dir or ".") / name)
