"""The llama.cpp backend: llama-cpp-python in-process, from a GGUF file.

One llama.cpp context serves one request at a time (contexts are not thread-safe), on one
dedicated worker thread; requests queue in FIFO order behind it, so concurrency on this
backend is one stream at a time. Tokens travel from the worker to the event loop through
``loop.call_soon_threadsafe`` into a per-request ``asyncio.Queue`` as they are sampled.
Closing the iterator sets a flag the token loop checks before every token (and between
prompt batches), so an abandoned request stops within one decode step.

The chat template comes from the GGUF metadata (``tokenizer.chat_template``), rendered in
the sandbox of :mod:`core_engine.chat_template`. The context keeps the previous request's
tokens; a new prompt that shares a prefix with them skips that prefix, and the number of
skipped tokens is reported as ``cached_tokens``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec

from backends._option import decode_options
from backends._thread_job import ThreadJob, stream_job
from backends.base import (
    BackendConfig,
    Capabilities,
    GenerationChunk,
    GenerationRequest,
    HealthStatus,
    ModelInfo,
)
from backends.errors import (
    BackendUnavailableError,
    GenerationAbortedError,
    InfermuxError,
)

__all__ = ["LlamaCppBackend", "LlamaCppOptions", "create_backend"]

logger = logging.getLogger(__name__)

_PROGRESS_EVERY_S = 2.0


class LlamaCppOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of a ``kind = "llamacpp"`` backend."""

    #: GGUF file; default: the embedded SmolLM2-135M-Instruct.
    model_path: str | None = None
    n_ctx: int = 2048
    n_threads: int = 2
    n_threads_batch: int | None = None
    n_batch: int = 512
    #: Seed for requests that send none (None: a fresh random seed per request).
    seed: int | None = None
    #: ``model_info().id`` (default: the file name without ``.gguf``).
    model_id: str | None = None
    use_mmap: bool = True
    #: Let llama.cpp print its own logs to stderr.
    verbose: bool = False


class LlamaCppBackend:
    """A GGUF model served by llama.cpp in this process; see the module docstring."""

    kind = "llamacpp"

    def __init__(self, config: BackendConfig) -> None:
        self.name = config.name
        self.config = config
        self.options = decode_options(config, LlamaCppOptions)
        if self.options.n_ctx < 16:
            raise ValueError(f"backends.{config.name}.options.n_ctx: must be at least 16")
        if self.options.n_threads < 1:
            raise ValueError(f"backends.{config.name}.options.n_threads: must be at least 1")
        self.capabilities = Capabilities(
            logprobs=True, echo=True, structured_outputs=False, max_top_logprobs=20
        )
        self._executor: ThreadPoolExecutor | None = None
        self._runner: Any | None = None
        self._jobs: set[ThreadJob] = set()
        self._model_path: Path | None = None

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the GGUF on the worker thread, logging progress while it loads."""
        if self._runner is not None:
            return
        path = self._resolve_model_path()
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"llamacpp-{self.name}"
        )
        size_mib = path.stat().st_size / 2**20
        logger.info("backend %s: loading %s (%.0f MiB)", self.name, path.name, size_mib)
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, self._load, path)
        while True:
            done, _ = await asyncio.wait({future}, timeout=_PROGRESS_EVERY_S)
            if done:
                break
            logger.info(
                "backend %s: still loading %s (%.0f s)",
                self.name,
                path.name,
                time.monotonic() - started,
            )
        try:
            self._runner = future.result()
        except InfermuxError:
            self._shutdown_executor()
            raise
        logger.info(
            "backend %s: loaded %s in %.1f s (n_ctx=%d, n_threads=%d)",
            self.name,
            path.name,
            time.monotonic() - started,
            self.options.n_ctx,
            self.options.n_threads,
        )

    def _resolve_model_path(self) -> Path:
        if self.options.model_path is not None:
            path = Path(self.options.model_path).expanduser()
        else:
            from backends.default_model import default_model_path

            try:
                path = default_model_path()
            except FileNotFoundError as exc:
                raise BackendUnavailableError(f"backend {self.name!r}: {exc}") from exc
        if not path.is_file():
            raise BackendUnavailableError(
                f"backend {self.name!r}: model file not found: {path} "
                f"(backends.{self.name}.options.model_path)"
            )
        self._model_path = path
        return path

    def _load(self, path: Path) -> Any:
        try:
            from llama_cpp import Llama
        except ImportError as exc:
            raise BackendUnavailableError(
                "the llamacpp backend needs llama-cpp-python: pip install 'infermux[llamacpp]'"
            ) from exc
        from backends._llamacpp_loop import LlamaRunner

        options = self.options

        def make_llm(*, logits_all: bool) -> Any:
            try:
                return Llama(
                    str(path),
                    n_ctx=options.n_ctx,
                    n_threads=options.n_threads,
                    n_threads_batch=options.n_threads_batch or options.n_threads,
                    n_batch=options.n_batch,
                    use_mmap=options.use_mmap,
                    logits_all=logits_all,
                    verbose=options.verbose,
                )
            except (ValueError, RuntimeError, OSError) as exc:
                raise BackendUnavailableError(
                    f"backend {self.name!r}: llama.cpp could not load {path}: {exc}"
                ) from exc

        llm = make_llm(logits_all=False)
        return LlamaRunner(
            llm,
            make_echo_llm=lambda: make_llm(logits_all=True),
            default_seed=options.seed,
        )

    def model_info(self) -> ModelInfo:
        """The file's name, the context length in use, and the template from the metadata."""
        path = self._model_path
        model_id = self.options.model_id or (path.name.removesuffix(".gguf") if path else self.name)
        runner = self._runner
        return ModelInfo(
            id=model_id,
            context_length=runner.n_ctx if runner is not None else self.options.n_ctx,
            chat_template=runner.template_source if runner is not None else None,
        )

    async def health(self) -> HealthStatus:
        """Loaded or not (no generation)."""
        if self._runner is None:
            return HealthStatus(ok=False, detail="model not loaded")
        return HealthStatus(ok=True, detail="loaded")

    async def aclose(self) -> None:
        """Stop the worker thread after the current token and free the contexts."""
        runner, self._runner = self._runner, None
        executor = self._executor
        if executor is None:
            return
        for job in list(self._jobs):
            # Running and queued generations stop at their next token; their readers get
            # an error now rather than waiting on a queue that no worker will fill.
            job.cancelled.set()
            job.send(GenerationAbortedError(f"backend {self.name!r} is shutting down"))
        if runner is not None:
            await asyncio.get_running_loop().run_in_executor(executor, runner.close)
        self._shutdown_executor()

    def _shutdown_executor(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    async def wait_idle(self) -> None:
        """Wait until every generation queued so far has left the worker (drain, tests)."""
        if self._executor is not None:
            await asyncio.get_running_loop().run_in_executor(self._executor, lambda: None)

    @property
    def num_generated_tokens(self) -> int:
        """Tokens sampled since start, across requests (including abandoned ones)."""
        return self._runner.num_generated_tokens if self._runner is not None else 0

    # -- serving --------------------------------------------------------------------------

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream one choice; closing the iterator stops generation after the current token."""
        return stream_job(
            request,
            backend_name=self.name,
            runner=self._runner,
            executor=self._executor,
            jobs=self._jobs,
            library="llama.cpp",
        )


def create_backend(config: BackendConfig) -> LlamaCppBackend:
    """Factory registered for kind ``"llamacpp"``."""
    return LlamaCppBackend(config)
