"""Llama-family model in torch. Build one with :func:`core_engine.gguf_loader.load_model`."""

from __future__ import annotations

from core_engine.model.config import LlamaConfig, RopeScaling
from core_engine.model.llama import LlamaDecoderLayer, LlamaModel

__all__ = ["LlamaConfig", "LlamaDecoderLayer", "LlamaModel", "RopeScaling"]
