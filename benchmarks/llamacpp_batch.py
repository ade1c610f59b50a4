"""llama.cpp driven through llama-cpp-python's low-level batch API, for benchmarks.

One context with a unified KV cache holds every sequence; each decode step is one
``llama_decode`` over a ``llama_batch`` carrying one token per live sequence (each with its own
``seq_id``), greedy-sampled with numpy. This is llama.cpp's own batched-decoding path (what
``llama-batched`` and the server's continuous batching use) without any HTTP in between, so
it is the stronger of the two ways to drive llama.cpp at concurrency.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from pathlib import Path

import llama_cpp
import numpy as np

__all__ = ["LlamaCppBatch"]


class LlamaCppBatch:
    """A model plus one context of ``n_ctx`` tokens shared by up to ``max_seqs`` sequences."""

    def __init__(
        self,
        model_path: Path,
        *,
        threads: int,
        max_seqs: int,
        n_ctx: int,
        n_batch: int = 512,
        kv_unified: bool = True,
    ) -> None:
        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = max(n_batch, max_seqs)
        cparams.n_ubatch = max(n_batch, max_seqs)
        cparams.n_seq_max = max_seqs
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.kv_unified = kv_unified
        cparams.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_batch = cparams.n_batch
        self.max_seqs = max_seqs
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, max_seqs)

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Drop the cached tokens of ``seq_id`` from position ``num_tokens`` on (prefix reuse)."""
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self.ctx), seq_id, num_tokens, -1)

    def _decode(self, entries: Sequence[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, seq_id, wants_logits)."""
        batch = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        batch.n_tokens = len(entries)
        rc = llama_cpp.llama_decode(self.ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, index: int) -> int:
        pointer = llama_cpp.llama_get_logits_ith(self.ctx, index)
        logits = np.ctypeslib.as_array(
            ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,)
        )
        return int(logits.argmax())

    def prefill(
        self, prompts: Sequence[Sequence[int]], *, start: Sequence[int] | None = None
    ) -> list[int]:
        """Evaluate each prompt (from ``start[s]`` on, the rest being cached) as sequence ``s``;
        returns each sequence's greedy next token."""
        entries = []
        for seq, prompt in enumerate(prompts):
            first = start[seq] if start else 0
            for pos in range(first, len(prompt)):
                entries.append((prompt[pos], pos, seq, pos == len(prompt) - 1))
        next_tokens: dict[int, int] = {}
        for lo in range(0, len(entries), self.n_batch):
            chunk = entries[lo : lo + self.n_batch]
            self._decode(chunk)
            for i, (_, _, seq, logits) in enumerate(chunk):
                if logits:
                    next_tokens[seq] = self._argmax(i)
        return [next_tokens[s] for s in range(len(prompts))]

    def generate(
        self, prompts: Sequence[Sequence[int]], max_tokens: int
    ) -> tuple[list[list[int]], float]:
        """Greedy ``max_tokens`` per prompt, all sequences batched; returns (outputs, seconds)."""
        self.clear()
        started = time.perf_counter()
        tokens = self.prefill(prompts)
        outputs = [[t] for t in tokens]
        lengths = [len(p) for p in prompts]
        for _ in range(max_tokens - 1):
            entries = [
                (outputs[s][-1], lengths[s] + len(outputs[s]) - 1, s, True)
                for s in range(len(prompts))
            ]
            self._decode(entries)
            for s in range(len(prompts)):
                outputs[s].append(self._argmax(s))
        return outputs, time.perf_counter() - started
