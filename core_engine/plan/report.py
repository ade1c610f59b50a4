"""How ``infermux plan`` shows a :class:`~core_engine.plan.planner.Plan`: a text table or JSON."""

from __future__ import annotations

import json

import msgspec

from core_engine.plan.devices import DeviceSpec, Figure
from core_engine.plan.estimate import PlanRow
from core_engine.plan.planner import Plan

__all__ = ["format_plan", "plan_json"]


def plan_json(plan: Plan) -> str:
    """The plan as one JSON object (inputs, model, device with each figure's source, rows, choice)."""
    return json.dumps(msgspec.to_builtins(plan), indent=2)


def _scaled(value: float, unit: str) -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {prefix}{unit}"
    return f"{value:.1f} {unit}" if value != int(value) else f"{int(value)} {unit}"


def _count(value: int) -> str:
    return _scaled(value, "").strip()


def _rate(value: float | None, bound: str | None = None) -> str:
    if value is None:
        return "-"
    text = f"{value:,.0f}" if value >= 100 else f"{value:.1f}"
    return f"{text} ({bound})" if bound else text


def _figure(label: str, figure: Figure | None, unit: str, *, show_note: bool) -> str:
    if figure is None:
        return f"  {label:<14}-"
    source = f"{figure.source}: {figure.note}" if show_note and figure.note else figure.source
    return f"  {label:<14}{_scaled(figure.value, unit):<16}{source}"


def _device_lines(spec: DeviceSpec) -> list[str]:
    from_table = bool(spec.reference)
    lines = [f"device    {spec.name}: {spec.description}"]
    if from_table:
        lines.append(f"  figures       {spec.reference}")
    lines.append(_figure("memory", spec.memory_bytes, "B", show_note=spec.memory_bytes.source != "datasheet"))
    lines.append(_figure("bandwidth", spec.memory_bandwidth, "B/s", show_note=not from_table))
    for dtype, figure in spec.flops.items():
        lines.append(_figure(dtype, figure, "FLOP/s", show_note=not from_table))
    if spec.name == "cpu" and not spec.has_native_bf16:
        lines.append(f"  {'bfloat16':<14}{'emulated':<16}(no avx512_bf16 / amx_bf16: not measured)")
    if spec.int8_ops is not None or spec.flops:
        lines.append(_figure("int8", spec.int8_ops, "OP/s", show_note=not from_table))
    for fmt, figure in spec.kernel_ops.items():
        lines.append(_figure(f"{fmt} kernel", figure, "OP/s", show_note=True))
    for fmt, figure in spec.kernel_stream.items():
        lines.append(_figure(f"{fmt} stream", figure, "B/s", show_note=True))
    if spec.call_overhead_s is not None:
        c = spec.call_overhead_s
        lines.append(f"  {'kernel call':<14}{f'{c.value * 1e6:.1f} us':<16}{c.source}: {c.note}")
    if spec.kind == "cuda":
        lines.append(_figure("fp8", spec.fp8_flops, "FLOP/s", show_note=False))
    lines.append(f"  {'compute dtype':<14}{spec.compute_dtype}; fp8 KV: {'yes' if spec.has_fp8_kv else 'no'}")
    return lines


_HEADER = ("  FORMAT", "KV", "WEIGHTS", "KV/TOKEN", "KV/REQUEST", "MAX CONC.")


def _table(plan: Plan) -> list[str]:
    concurrency = plan.inputs.concurrency
    header = (*_HEADER, "DECODE@1 tok/s", f"DECODE@{concurrency} tok/s", "PREFILL tok/s")
    auto = plan.choice.weight_reason.startswith("auto")
    chosen = plan.row("auto" if auto else plan.choice.weight_format, plan.choice.kv_dtype)
    cells: list[tuple[str, ...]] = [header]
    for row in plan.rows:
        cells.append(_cells(row, mark=row is chosen))
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    lines = []
    for line in cells:
        lines.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True))).rstrip())
    return lines


def _cells(row: PlanRow, *, mark: bool) -> tuple[str, ...]:
    batched = _rate(row.decode_tok_s_concurrency, row.bound_concurrency)
    return (
        ("* " if mark else "  ") + row.weight_format,
        row.kv_dtype,
        _scaled(row.weight_bytes, "B"),
        _scaled(row.kv_bytes_per_token, "B"),
        _scaled(row.kv_bytes_per_request, "B"),
        str(row.max_concurrency),
        _rate(row.decode_tok_s_batch1, row.bound_batch1),
        batched if row.fits_concurrency else f"{batched} !",
        _rate(row.prefill_tok_s),
    )


def format_plan(plan: Plan) -> str:
    """The terminal report: model, device figures, one row per format x KV dtype, the choice."""
    cfg, weights, inputs = plan.config, plan.weights, plan.inputs
    head = "the tied embedding table" if weights.tied_embeddings else "output.weight"
    lines = [
        f"model     {inputs.model_path}",
        f"  {plan.model_name or cfg.architecture}; {cfg.architecture}, {plan.file_type or 'unknown'} file",
        f"  {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} heads / {cfg.num_kv_heads} kv heads"
        f" x {cfg.head_dim}, intermediate {cfg.intermediate_size}, vocab {cfg.vocab_size}"
        f"{', tied embeddings' if weights.tied_embeddings else ''}",
        f"  parameters: {_count(weights.layer_params)} in the layers' products, {_count(weights.head_params)} head"
        f" ({head}), {_count(weights.embedding_params)} embedding, {_count(weights.vector_params)} norms/biases",
        "",
        *_device_lines(plan.device),
        "",
        f"requests  {inputs.concurrency} x {inputs.context} tokens (KV in blocks of {inputs.kv_block_size});"
        f" {inputs.reserve_fraction:.0%} of memory kept for activations and runtime:"
        f" {_scaled(plan.usable_memory_bytes, 'B')} for weights + KV",
        "",
        *_table(plan),
        "",
        "  * the policy's choice; (memory)/(compute): the bound that binds;"
        f" !: {inputs.concurrency} requests do not fit; -: no figure",
        "  decode reads KV at half the context; WEIGHTS: resident; bytes are decimal (1 GB = 10^9 B)",
        "",
        f"choice    {plan.choice.weight_format} weights, {plan.choice.kv_dtype} KV ({plan.choice.policy})",
        f"  weights: {plan.choice.weight_reason}",
        f"  KV: {plan.choice.kv_reason}",
    ]
    if plan.notes:
        lines += ["", "notes", *(f"  - {note}" for note in plan.notes)]
    return "\n".join(lines)
