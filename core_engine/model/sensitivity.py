"""Which layers to keep dense when the weights must fit a memory budget.

Measured at load on a short calibration text: the exact (dense) model's next-token
distributions are the reference; each decoder layer in turn (and the LM head) is stored in the
fast format alone — its products packed as the engine would pack them, multiplied by the same
kernels — and the mean KL divergence of the model's distributions from the reference is that
layer's sensitivity. Then every product starts in the fast format, and the layers that buy the
most KL per extra byte go back to dense while the budget allows (a greedy knapsack; the KLs
of single layers add up closely enough for a ranking).

Cost: one forward of the calibration text per layer (31 for SmolLM2-135M, ~2-4 s on two
cores). Nothing runs unless a budget is given.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import Tensor

from core_engine.attention import ContiguousAttention
from core_engine.model.formats import bytes_per_weight

__all__ = ["CALIBRATION_TEXT", "BudgetFit", "fit_weight_budget", "layer_sensitivity"]

logger = logging.getLogger(__name__)

#: Mixed prose, a list, code and numbers: ~100 tokens of the kinds of text a chat model sees.
CALIBRATION_TEXT = (
    "The history of the city begins in the early twelfth century, when farmers settled along the "
    "river. Three things made it grow: a bridge, a market and a charter.\n"
    "def mean(values):\n    return sum(values) / len(values)\n"
    "Q: What is 17 times 23? A: 391. The train leaves at 09:45 from platform 4."
)


class BudgetFit:
    """The outcome of :func:`fit_weight_budget`."""

    __slots__ = ("layer_formats", "resident_bytes", "sensitivity", "summary")

    def __init__(self, layer_formats: dict[str, str], resident_bytes: int, sensitivity: dict[str, float], summary: str):
        self.layer_formats = layer_formats
        self.resident_bytes = resident_bytes
        self.sensitivity = sensitivity
        self.summary = summary


def _log_probs(model: Any, ids: Tensor) -> Tensor:
    with torch.inference_mode():
        logits = model(ids, torch.arange(ids.numel()), ContiguousAttention(model.config.num_layers))
    return logits.float().log_softmax(-1)


def _groups(model: Any) -> dict[str, list[str]]:
    """Layer name -> its product names (a decoder layer's four, or the head)."""
    groups = {f"layers.{i}": [f"layers.{i}.{p}" for p in model.layers[i].PRODUCTS] for i in range(len(model.layers))}
    groups["head"] = ["head"]
    return groups


def _dense_weight(model: Any, name: str) -> tuple[Tensor, Tensor | None]:
    if name == "head":
        return model.lm_head, None
    _, idx, product = name.split(".")
    return model.layers[int(idx)].dense_weights()[product]


def layer_sensitivity(model: Any, ids: Tensor, formats: dict[str, str]) -> dict[str, float]:
    """Mean KL (nats) from the dense model when one layer's products take ``formats[name]``.

    ``model`` must still be dense (before :meth:`~core_engine.model.llama.LlamaModel.set_weight_format`).
    """
    from core_engine.model.llama import _pack

    reference = _log_probs(model, ids)
    probs = reference.exp()
    source = getattr(model, "block_source", None)
    result: dict[str, float] = {}
    for group, names in _groups(model).items():
        if all(formats[n] == "dense" for n in names):
            result[group] = 0.0
            continue
        saved = {n: model.product(n) for n in names}
        for n in names:
            weight, bias = _dense_weight(model, n)
            _set_product(model, n, _pack(formats[n], n, weight, bias, source))
        try:
            kl = (probs * (reference - _log_probs(model, ids))).sum(-1).mean().item()
        finally:
            for n, product in saved.items():
                _set_product(model, n, product)
        result[group] = max(kl, 0.0)
    return result


def _set_product(model: Any, name: str, product: Any) -> None:
    if name == "head":
        model.head = product
    else:
        _, idx, attr = name.split(".")
        setattr(model.layers[int(idx)], attr, product)


def fit_weight_budget(
    model: Any, budget_bytes: int, tokenizer: Any, *, weight_format: str = "auto",
    layer_formats: dict[str, str] | None = None, file_type: str | None = None,
) -> BudgetFit:
    """The ``layer_formats`` that fit the resident weights into ``budget_bytes`` with the least
    measured loss: every product in ``weight_format`` (as resolved for this model), the most
    sensitive layers dense while they fit. ``layer_formats`` the caller fixed are kept.

    Raises ValueError naming ``weight_memory_bytes`` when even the fast format does not fit.
    """
    from core_engine.model.llama import _match_format

    started = time.perf_counter()
    from core_engine.model.linear import resolve_weight_format

    fixed = dict(layer_formats or {})
    resolved = resolve_weight_format(weight_format, dtype=model.dtype, device=model.device, file_type=file_type)
    source = getattr(model, "block_source", None)
    natural = getattr(source, "natural_format", None) if weight_format == "auto" and resolved in ("int4", "int8") else None
    fast = {
        n: _match_format(n, fixed, natural(n) if natural else resolved, dtype=model.dtype, device=model.device,
                         file_type=file_type)
        for n in model.product_names()
    }
    dense_bytes = {n: _dense_weight(model, n)[0].numel() for n in fast}  # weights per product
    dense_size = float(torch.empty((), dtype=model.dtype).element_size())

    tied = model.config.tie_word_embeddings

    def product_bytes(name: str, fmt: str) -> float:
        if name == "head" and tied and fmt == "dense":
            return 0.0  # the embedding table itself
        return dense_bytes[name] * bytes_per_weight(fmt, model.dtype)

    # What stays resident whatever the products are: the embedding table, norms, RoPE, and a
    # tied head's table (kept for lookups) on top of its packed product.
    base = model.resident_weight_bytes() - sum(dense_bytes[n] * dense_size for n in fast if n != "head")
    if not tied:
        base -= dense_bytes["head"] * dense_size

    def total(formats: dict[str, str]) -> float:
        return base + sum(product_bytes(n, f) for n, f in formats.items())

    if total(fast) > budget_bytes:
        raise ValueError(
            f"weight_memory_bytes={budget_bytes} is below what the fastest format needs "
            f"({total(fast) / 2**20:.0f} MiB for {resolved})"
        )
    ids = torch.tensor(tokenizer.encode(CALIBRATION_TEXT), dtype=torch.long)
    sensitivity = layer_sensitivity(model, ids, fast)
    chosen = dict(fast)
    groups = _groups(model)
    free = [g for g in groups if not any(n in fixed or _fixed_by_pattern(n, fixed) for n in groups[g])]

    def extra(group: str) -> float:
        return sum(product_bytes(n, "dense") - product_bytes(n, fast[n]) for n in groups[group])

    ranked = sorted((g for g in free if sensitivity[g] > 0 and extra(g) > 0), key=lambda g: -sensitivity[g] / extra(g))
    upgraded = []
    for group in ranked:
        trial = dict(chosen)
        trial.update({n: "dense" for n in groups[group]})
        if total(trial) <= budget_bytes:
            chosen = trial
            upgraded.append(group)
    resident = int(total(chosen))
    kept = sum(sensitivity[g] for g in groups if g not in upgraded)
    summary = (
        f"{len(upgraded)} of {len(groups)} layers dense ({', '.join(upgraded[:6])}{'...' if len(upgraded) > 6 else ''}), "
        f"~{resident / 2**20:.0f} MiB; summed single-layer KL {kept:.4f} (all {resolved}: "
        f"{sum(sensitivity.values()):.4f}); measured in {time.perf_counter() - started:.1f} s"
    )
    layer_formats_out = {n: f for n, f in chosen.items() if f != fast[n] or n in fixed}
    return BudgetFit(layer_formats_out, resident, sensitivity, summary)


def _fixed_by_pattern(name: str, fixed: dict[str, str]) -> bool:
    import fnmatch

    return any(fnmatch.fnmatchcase(name, pattern) for pattern in fixed)
