"""Phi-3 / Phi-3.5 (dense): the Llama-family decoder with q|k|v and gate|up each stored as one
fused tensor (the engine fuses them anyway), NeoX RoPE (rows in Hugging Face's order). LongRoPE
(``rope_factors_long`` / ``_short``) is not supported: such files are refused at load."""

from __future__ import annotations

from core_engine.model.architectures import Architecture

ARCHITECTURE = Architecture(name="phi3", permuted_qk_rows=False, fused_projections=True)
