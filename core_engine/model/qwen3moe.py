"""Qwen3-MoE (e.g. Qwen3-30B-A3B): Qwen3's attention (q/k norms, NeoX RoPE) with a mixture of
experts in every layer instead of the dense FFN (:mod:`core_engine.model.moe`)."""

from __future__ import annotations

from core_engine.model.architecture import Architecture

ARCHITECTURE = Architecture(name="qwen3moe", permuted_qk_rows=False, qk_norm=True, moe=True)
