"""The token texts that end generation whatever a file's ``eos_token_id`` says: the end-of-turn
markers of common chat formats, as llama.cpp's vocabulary loader lists them (``llama_vocab::impl::load``,
with its exceptions applied in :class:`~core_engine.tokenizer.bpe.Tokenizer`). One list for every
backend that reads a vocabulary itself (the core engine's tokenizers, the MLX backend)."""

from __future__ import annotations

__all__ = ["END_OF_GENERATION_TEXTS"]

END_OF_GENERATION_TEXTS: frozenset[str] = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
        "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
        "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
    }
)
