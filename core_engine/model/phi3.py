"""Phi-3 / Phi-3.5 (dense): the Llama-family decoder with q|k|v and gate|up each stored as one
fused tensor (the engine fuses them anyway), NeoX RoPE (rows in Hugging Face's order). The
long-context ones (Phi-3-mini-128k, Phi-3.5) use LongRoPE (``rope_factors_long`` / ``_short``):
the set is chosen by the engine's context window (:func:`core_engine.model.rope.longrope_freq_factors`)."""

from __future__ import annotations

from core_engine.model.architecture import Architecture

ARCHITECTURE = Architecture(name="phi3", permuted_qk_rows=False, fused_projections=True)
