"""Qwen2 / Qwen2.5: the Llama-family decoder with biases on q, k and v (the loader reads them
when the file has them) and NeoX RoPE, so its q/k rows stay in Hugging Face's order."""

from __future__ import annotations

from core_engine.model.architecture import Architecture

ARCHITECTURE = Architecture(name="qwen2", permuted_qk_rows=False)
