"""Embeddings from llama.cpp: a second context of the loaded model, in embedding mode.

The generation context (:mod:`backends._llamacpp_loop`) computes logits and is owned by its
worker thread; embeddings need a context created with ``embeddings = true`` and a pooling
type, so this one is separate, created on the first embeddings request (no memory is spent
on it otherwise) and used under a lock by one thread at a time. Its KV cache is unified:
the inputs of a request share its ``n_ctx`` cells and go through ``llama_decode`` together
(as many per decode as fit), each as its own sequence; llama.cpp pools each sequence's final
hidden states ("mean" or "last") and the vector is L2-normalised here, as llama-server's
``/v1/embeddings`` does.
"""

from __future__ import annotations

import ctypes
import math
import struct
import threading
from typing import Literal

import llama_cpp

from backends._llamacpp_batch import TokenBatch
from backends._llamacpp_model import LlamaModel
from backends.errors import BackendError, ContextLengthExceededError

__all__ = ["LlamaEmbedder"]

_POOLING = {"mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN, "last": llama_cpp.LLAMA_POOLING_TYPE_LAST}
#: The most inputs one decode carries (sequence ids of the embedding context).
_MAX_SEQUENCES = 64


class LlamaEmbedder:
    """Embeds token sequences with ``model``; blocking (call it off the event loop)."""

    def __init__(
        self, model: LlamaModel, *, n_ctx: int, n_threads: int, pooling: Literal["mean", "last"]
    ) -> None:
        self.model = model
        self.n_ctx = n_ctx
        self.n_threads = n_threads
        self.pooling = pooling
        self.n_embd: int = llama_cpp.llama_model_n_embd(model.model)
        self._lock = threading.Lock()
        self._ctx: object | None = None
        self._batch: TokenBatch | None = None
        self._closed = False

    def _open(self) -> object:
        params = llama_cpp.llama_context_default_params()
        params.embeddings = True
        params.pooling_type = _POOLING[self.pooling]
        params.n_ctx = self.n_ctx
        params.n_batch = self.n_ctx
        params.n_ubatch = self.n_ctx  # pooling needs a sequence whole in one ubatch
        params.n_seq_max = _MAX_SEQUENCES
        params.kv_unified = True  # the sequences of a decode share the n_ctx cells
        params.n_threads = self.n_threads
        params.n_threads_batch = self.n_threads
        params.no_perf = True
        ctx = llama_cpp.llama_init_from_model(self.model.model, params)
        if not ctx:
            raise BackendError(f"llama.cpp could not create an embedding context of {self.n_ctx}")
        self._batch = TokenBatch(self.n_ctx)
        return ctx

    def embed(self, token_ids: list[list[int]]) -> list[bytes]:
        """One L2-normalised vector per sequence, as little-endian float32 bytes.

        ``ContextLengthExceededError`` (param ``input[i]``) for a sequence over ``n_ctx``.
        """
        for i, ids in enumerate(token_ids):
            if len(ids) > self.n_ctx:
                raise ContextLengthExceededError(
                    f"this model's maximum context length is {self.n_ctx} tokens; input {i} "
                    f"has {len(ids)}",
                    param=f"input[{i}]",
                )
        with self._lock:
            if self._closed:
                raise BackendError("the llama.cpp embedding context is closed")
            if self._ctx is None:
                self._ctx = self._open()
            vectors: list[bytes] = []
            group: list[list[int]] = []
            num_tokens = 0
            for ids in token_ids:
                if group and (num_tokens + len(ids) > self.n_ctx or len(group) == _MAX_SEQUENCES):
                    vectors.extend(self._decode(group))
                    group, num_tokens = [], 0
                group.append(ids)
                num_tokens += len(ids)
            if group:
                vectors.extend(self._decode(group))
            return vectors

    def _decode(self, group: list[list[int]]) -> list[bytes]:
        ctx, batch = self._ctx, self._batch
        assert batch is not None
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        batch.clear()
        for seq_id, ids in enumerate(group):
            for position, token in enumerate(ids):
                batch.add(token, position, seq_id, True)
        code = batch.decode(ctx)
        if code != 0:
            raise BackendError(f"llama.cpp embedding decode failed (code {code})")
        out: list[bytes] = []
        for seq_id in range(len(group)):
            pointer = llama_cpp.llama_get_embeddings_seq(ctx, seq_id)
            if not pointer:
                raise BackendError("llama.cpp returned no pooled embedding")
            values = ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float))[: self.n_embd]
            norm = math.sqrt(sum(v * v for v in values)) or 1.0
            out.append(struct.pack(f"<{self.n_embd}f", *(v / norm for v in values)))
        return out

    def close(self) -> None:
        """Free the context (waits for an embedding in progress)."""
        with self._lock:
            self._closed = True
            if self._batch is not None:
                self._batch.free()
                self._batch = None
            if self._ctx is not None:
                llama_cpp.llama_free(self._ctx)
                self._ctx = None
