"""``plan_model``: the memory and rooflines of a GGUF model on a device, and the policy's choice.

Reads the file's metadata and tensor shapes (no weights), describes the device (measured for
``"cpu"`` and an unknown local GPU, the datasheet table otherwise), and computes one
:class:`~core_engine.plan.estimate.PlanRow` per weight format x KV dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch

from core_engine.model.config import LlamaConfig
from core_engine.plan.devices import DEVICE_NAMES, DeviceSpec, named_device
from core_engine.plan.estimate import (
    NATURAL,
    PlanRow,
    WeightInventory,
    estimate_row,
    kv_dtypes,
    row_dtype,
)

__all__ = ["Plan", "PlanChoice", "PlanError", "PlanInputs", "plan_model", "resolve_model_file"]

#: Share of the device memory left out of the weights + KV sum: activations, the runtime,
#: allocator slack.
DEFAULT_RESERVE_FRACTION = 0.10


class PlanError(ValueError):
    """Bad input to :func:`plan_model`; ``param`` names the argument at fault."""

    def __init__(self, param: str, detail: str) -> None:
        super().__init__(f"{param}: {detail}")
        self.param = param
        self.detail = detail


class PlanInputs(msgspec.Struct, frozen=True, kw_only=True):
    """What the plan was asked for."""

    #: The GGUF file (a directory argument resolved to the one file in it).
    model_path: str
    device: str
    context: int
    concurrency: int
    #: Share of device memory kept for activations and runtime.
    reserve_fraction: float
    #: Tokens per KV block (``EngineConfig.block_size``).
    kv_block_size: int
    measure: bool


class PlanChoice(msgspec.Struct, frozen=True, kw_only=True):
    """What the quantization policy would load this model as on this device, and why."""

    policy: str
    weight_format: str
    weight_reason: str
    kv_dtype: str
    kv_reason: str


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    """The planner's answer (``msgspec.to_builtins`` gives the ``--json`` object)."""

    inputs: PlanInputs
    model_name: str | None
    #: GGUF file type ("Q4_1", "F16"...) when the file says.
    file_type: str | None
    config: LlamaConfig
    weights: WeightInventory
    device: DeviceSpec
    #: Device memory less the reserve: what weights + KV may take.
    usable_memory_bytes: int
    rows: tuple[PlanRow, ...]
    choice: PlanChoice
    #: Caveats of this plan (estimated figures, a context past the trained one...).
    notes: tuple[str, ...] = ()

    def row(self, weight_format: str, kv_dtype: str) -> PlanRow:
        """The row of ``weight_format`` x ``kv_dtype``; "auto" means what the policy chose
        (the KV's "auto": the compute dtype of that format). PlanError if not planned."""
        if weight_format == "auto":
            natural = any(r.weight_format == NATURAL for r in self.rows)
            if natural and self.choice.weight_format == "int4" and self.choice.weight_reason.startswith("auto"):
                weight_format = NATURAL  # the row that holds the file's 8-bit tensors at int8
            else:
                weight_format = self.choice.weight_format
        if kv_dtype == "auto":
            kv_dtype = row_dtype(self.device, weight_format)
        for row in self.rows:
            if row.weight_format == weight_format and row.kv_dtype == kv_dtype:
                return row
        formats = sorted({r.weight_format for r in self.rows})
        if weight_format not in formats:
            raise PlanError("weight_format", f"{weight_format!r} is not planned for {self.device.name}; rows: {formats}")
        kvs = sorted({r.kv_dtype for r in self.rows})
        raise PlanError("kv_dtype", f"{kv_dtype!r} is not planned for {self.device.name}; rows: {kvs}")


def resolve_model_file(model_path: str | Path) -> Path:
    """``model_path`` if it is a file; the one ``.gguf`` in it if it is a directory."""
    path = Path(model_path).expanduser()
    if path.is_dir():
        ggufs = sorted(p for p in path.iterdir() if p.suffix == ".gguf" and p.is_file())
        if len(ggufs) != 1:
            found = ", ".join(p.name for p in ggufs) or "none"
            raise PlanError("model_path", f"directory {path} must hold exactly one .gguf file (found: {found})")
        return ggufs[0]
    if not path.is_file():
        raise PlanError("model_path", f"no such file or directory: {path}")
    return path


class _ModelFacts(msgspec.Struct, frozen=True):
    config: LlamaConfig
    weights: WeightInventory
    file_type: str | None


@functools.lru_cache(maxsize=8)
def _read_model(path: str, mtime_ns: int, size: int) -> _ModelFacts:
    """Config, parameter counts and file type (cached per file version: gguf's reader takes
    seconds over a large vocabulary)."""
    from core_engine.gguf_loader import GGUFFile

    gguf_file = GGUFFile(path)
    config = gguf_file.llama_config()
    from gguf import GGMLQuantizationType

    from core_engine.model.block_weights import is_exact

    def eight_bit(tensor: Any) -> bool:
        return not is_exact("int4", GGMLQuantizationType(tensor.tensor_type))

    layer = head = embedding = vector = eight_bit_layer = experts = 0
    head_eight_bit = False
    for tensor in gguf_file.tensors:
        count = int(tensor.n_elements)
        if tensor.name == "token_embd.weight":
            embedding = count
            if config.tie_word_embeddings:
                head_eight_bit = eight_bit(tensor)
        elif tensor.name == "output.weight":
            head = count
            head_eight_bit = eight_bit(tensor)
        elif tensor.name == "rope_freqs.weight":
            continue  # folded into the RoPE tables, not a weight the model holds
        elif sum(1 for n in tensor.shape.tolist() if n > 1) >= 2:
            layer += count
            eight_bit_layer += count if eight_bit(tensor) else 0
            experts += count if "_exps." in tensor.name else 0
        else:
            vector += count
    weights = WeightInventory(
        layer_params=layer,
        head_params=embedding if config.tie_word_embeddings else head,
        embedding_params=embedding,
        vector_params=vector,
        tied_embeddings=config.tie_word_embeddings,
        eight_bit_layer_params=eight_bit_layer,
        eight_bit_head=head_eight_bit,
        expert_params=experts,
        expert_fraction=config.num_experts_used / config.num_experts if config.num_experts else 1.0,
    )
    return _ModelFacts(config, weights, gguf_file.file_type)


def _natural_row(spec: DeviceSpec, facts: _ModelFacts) -> tuple[str, ...]:
    """``("auto",)`` where ``weight_format = "auto"`` stores the products in their file's
    precision (a 4-bit file on a CPU: int4, with the file's 8-bit tensors at int8)."""
    from core_engine.model.formats import auto_weight_format

    auto = auto_weight_format(spec.kind, getattr(torch, spec.compute_dtype), facts.file_type, family=spec.cpu_family)  # type: ignore[arg-type]
    mixed = facts.weights.eight_bit_head or 0 < facts.weights.eight_bit_layer_params < facts.weights.layer_params
    return (NATURAL,) if spec.kind == "cpu" and auto.weight_format == "int4" and mixed else ()


def _kv_block_size() -> int:
    from core_engine.config import EngineConfig

    return next(int(f.default) for f in msgspec.structs.fields(EngineConfig) if f.name == "block_size")


def _device_spec(device: str, config: LlamaConfig, *, measure: bool, progress: Callable[[str], None] | None) -> DeviceSpec:
    from core_engine.plan import probe

    if device == "cpu":
        return probe.cpu_spec(config, measure=measure, progress=progress)
    if device == "cuda":
        try:
            return probe.cuda_spec(measure=measure, progress=progress)
        except probe.NoCudaError as exc:
            raise PlanError("device", f"'cuda': {exc}") from exc
    spec = named_device(device)
    assert spec is not None, device  # checked against DEVICE_NAMES
    return spec


def _choose(
    model_path: Path, facts: _ModelFacts, spec: DeviceSpec, *, usable: int, context: int
) -> PlanChoice:
    """Ask the default quantization policy, as the engine does at load, and resolve "auto"."""
    from core_engine.model.formats import auto_weight_format
    from core_engine.policy import DefaultQuantizationPolicy, QuantizationContext

    policy = DefaultQuantizationPolicy()
    weights = facts.weights
    decision = policy.choose_quantization(
        QuantizationContext(
            model_name=model_path.stem,
            model_path=str(model_path),
            device=spec.kind,
            file_type=facts.file_type,
            num_params=weights.layer_params + weights.embedding_params + weights.vector_params
            + (0 if weights.tied_embeddings else weights.head_params),
            device_memory_bytes=usable,
            max_model_len=context,
        )
    )
    if decision.weights == "auto":
        auto = auto_weight_format(spec.kind, getattr(torch, spec.compute_dtype), facts.file_type,
                                  family=spec.cpu_family)  # type: ignore[arg-type]
        weight_format, weight_reason = auto.weight_format, f"auto: {auto.reason}"
    else:
        named = {"float16": "fp16", "bfloat16": "dense", "float32": "dense"}
        weight_format = named.get(decision.weights, decision.weights)
        weight_reason = f"the policy asked for weights={decision.weights!r}"
    if decision.kv_cache == "auto":
        kv_dtype, kv_reason = row_dtype(spec, weight_format), "auto: the compute dtype"
    else:
        kv_dtype, kv_reason = decision.kv_cache, f"the policy asked for kv_cache={decision.kv_cache!r}"
    return PlanChoice(policy=type(policy).__name__, weight_format=weight_format, weight_reason=weight_reason,
                      kv_dtype=kv_dtype, kv_reason=kv_reason)


def _notes(plan_inputs: PlanInputs, config: LlamaConfig, spec: DeviceSpec, rows: tuple[PlanRow, ...]) -> tuple[str, ...]:
    notes = []
    if plan_inputs.context > config.context_length:
        notes.append(f"context {plan_inputs.context} is longer than the model's trained context ({config.context_length})")
    if spec.kind == "cpu" and not spec.has_native_bf16 and spec.name == "cpu":
        notes.append("bf16 is emulated on this CPU (no avx512_bf16 / amx_bf16): the engine computes in float32")
    if spec.int8_ops is not None and spec.int8_ops.source == "estimated":
        notes.append(f"int8/int4 decode compute bounds use an estimated int8 rate: {spec.int8_ops.note}")
    if spec.kind == "cuda":
        notes.append("on a GPU the int8/int4 formats are weight-only (dequantised to the compute dtype in the "
                     "kernel): their compute bound is the dense rate; int8 TOPS and fp8 TFLOPS are listed, not used")
    if spec.kind == "cpu" and not spec.flops:
        notes.append("no FLOP/s figure for this device: decode figures are the bandwidth bound, no prefill figure"
                     if spec.memory_bandwidth is not None else "not measured: memory figures only")
    if not any(row.fits_concurrency for row in rows):
        notes.append(f"no format x KV dtype fits {plan_inputs.concurrency} requests of {plan_inputs.context} tokens")
    return tuple(notes)


def plan_model(
    model_path: str | Path,
    *,
    device: str = "cpu",
    context: int = 8192,
    concurrency: int = 32,
    measure: bool = True,
    reserve_fraction: float = DEFAULT_RESERVE_FRACTION,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """Memory and rooflines of the model at ``model_path`` (a .gguf, or a directory holding
    one) on ``device`` (see :data:`~core_engine.plan.devices.DEVICE_NAMES`).

    ``measure``: time this machine ("cpu", or a GPU the table does not know); False keeps to
    memory figures there. ``progress`` receives a line per measurement. :class:`PlanError`
    names the argument at fault; the loader's errors (not a GGUF, not a llama file) come as
    ``PlanError("model_path", ...)`` with the loader's message.
    """
    from core_engine.gguf_loader import GGUFLoadError

    if device not in DEVICE_NAMES:
        raise PlanError("device", f"unknown device {device!r}; one of {', '.join(DEVICE_NAMES)}")
    for name, value in (("context", context), ("concurrency", concurrency)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(name, f"must be an integer >= 1, got {value!r}")
    if not 0.0 <= reserve_fraction < 1.0:
        raise PlanError("reserve_fraction", f"must be in [0, 1), got {reserve_fraction!r}")
    path = resolve_model_file(model_path)
    try:
        stat = path.stat()
        facts = _read_model(str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    except (GGUFLoadError, OSError) as exc:
        raise PlanError("model_path", str(exc)) from exc
    config = facts.config
    spec = _device_spec(device, config, measure=measure, progress=progress)
    usable = int(spec.memory_bytes.value * (1.0 - reserve_fraction))
    block_size = _kv_block_size()
    rows = tuple(
        estimate_row(config=config, weights=facts.weights, spec=spec, weight_format=fmt, kv_dtype=kv,
                     context=context, concurrency=concurrency, usable_memory_bytes=usable, block_size=block_size)
        for fmt in (*spec.weight_formats, *_natural_row(spec, facts))
        for kv in kv_dtypes(spec)
    )
    inputs = PlanInputs(model_path=str(path), device=device, context=context, concurrency=concurrency,
                        reserve_fraction=reserve_fraction, kv_block_size=block_size, measure=measure)
    return Plan(
        inputs=inputs,
        model_name=config.name,
        file_type=facts.file_type,
        config=config,
        weights=facts.weights,
        device=spec,
        usable_memory_bytes=usable,
        rows=rows,
        choice=_choose(path, facts, spec, usable=usable, context=context),
        notes=_notes(inputs, config, spec, rows),
    )
