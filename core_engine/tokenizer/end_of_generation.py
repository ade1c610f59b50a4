"""The token texts that end generation whatever a file's ``eos_token_id`` says: the end-of-turn
markers of common chat formats, as llama.cpp's vocabulary loader lists them. One list for every
backend that reads a vocabulary itself (the core engine's tokenizers, the MLX backend)."""

from __future__ import annotations

__all__ = ["END_OF_GENERATION_TEXTS"]

END_OF_GENERATION_TEXTS: frozenset[str] = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
        "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
    }
)
