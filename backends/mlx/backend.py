"""The MLX backend's async side: options, loading, and streaming from the worker thread.

One worker thread owns the model, the prompt cache and MLX's global random state; requests
queue behind it in FIFO order (one stream at a time; the llama.cpp backend batches). Tokens go
from the worker to the event loop through ``loop.call_soon_threadsafe`` into a per-request
``asyncio.Queue`` as they are sampled. Closing the iterator sets a flag that the token loop
checks after every token and between prefill chunks, so an abandoned request stops within
one decode step.

``model_path`` is a GGUF file (Llama family; see :mod:`backends.mlx.gguf_loader`) or a local
MLX / Hugging Face directory (``config.json``, ``*.safetensors``, tokenizer files), loaded by
mlx-lm. Nothing is ever downloaded: the hub is switched off before mlx-lm is used.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

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
from backends.chat_plan import ChatOptions, ChatPlan, plan_chat
from backends.errors import (
    BackendUnavailableError,
    GenerationAbortedError,
    InfermuxError,
    UnsupportedParameterError,
)
from backends.mlx.cpu_blas import use_openblas
from backends.model_loading import load_with_progress, resolve_model_path
from backends.resume import resumed_output
from backends.token_ids import as_prompt, detokenized, tokenized

__all__ = ["MLXBackend", "MLXOptions"]

logger = logging.getLogger(__name__)

_MAX_TOP_LOGPROBS = 20


class MLXOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of a ``kind = "mlx"`` backend."""

    #: GGUF file or MLX/Hugging Face model directory; default: the embedded SmolLM2-135M GGUF.
    model_path: str | None = None
    #: Context window in tokens (None: the model's own context length).
    n_ctx: int | None = None
    #: Float type of activations, float weights and quantization scales. None: float32 on
    #: the CPU (MLX's CPU kernels for half-precision quantized matmuls are very slow),
    #: float16 on a GPU.
    dtype: Literal["float32", "float16", "bfloat16"] | None = None
    #: Turn quantized layers (Q4_0/Q4_1/Q8_0 GGUF blocks, MLX 4/8-bit) into float ones in
    #: ``dtype`` at load. None: on the CPU when OpenBLAS is under MLX (backends/mlx/cpu_blas.py)
    #: and the float weights take at most ``dequantize_max_mb``: there MLX's quantized CPU
    #: matmul is ~30x slower in prefill and 2x in decode than OpenBLAS on the float weights.
    dequantize: bool | None = None
    #: The float-weight size up to which ``dequantize = None`` dequantizes (MiB).
    dequantize_max_mb: int = 4096
    #: Prompt tokens per prefill step (cancellation is checked between steps).
    prefill_step_size: int = 512
    #: Keep the last request's KV cache and reuse its common prefix with the next prompt.
    prompt_cache: bool = True
    #: Seed for requests that send none (None: a fresh random seed per request).
    seed: int | None = None
    #: ``model_info().id`` (default: the file or directory name, without ``.gguf``).
    model_id: str | None = None
    #: Chat formatting (:class:`backends.chat_plan.ChatOptions`).
    chat: ChatOptions | None = None


class MLXBackend:
    """A model served by MLX in this process; see the module docstring."""

    kind = "mlx"

    def __init__(self, config: BackendConfig) -> None:
        self.name = config.name
        self.config = config
        self.options = decode_options(config, MLXOptions)
        # Before MLX is first imported (create_backend does the same): backends/mlx/cpu_blas.py.
        use_openblas()
        prefix = f"backends.{config.name}.options"
        if self.options.n_ctx is not None and self.options.n_ctx < 16:
            raise ValueError(f"{prefix}.n_ctx: must be at least 16")
        if self.options.prefill_step_size < 1:
            raise ValueError(f"{prefix}.prefill_step_size: must be at least 1")
        self.capabilities = Capabilities(
            logprobs=True,
            echo=False,
            structured_outputs=True,
            tools=True,
            resume=True,
            tokenize=True,
            max_top_logprobs=_MAX_TOP_LOGPROBS,
        )
        self._executor: ThreadPoolExecutor | None = None
        self._runner: Any | None = None
        self._model_path: Path | None = None
        #: Generations queued or running, so that ``aclose`` can cancel them.
        self._jobs: set[ThreadJob] = set()

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the model on the worker thread, logging progress while it loads."""
        if self._runner is not None:
            return
        path = self._resolve_model_path()
        self._executor = executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mlx-{self.name}")
        try:
            runner, took = await load_with_progress(
                self.name, path, lambda: self._load(path), executor=executor
            )
        except BaseException:
            self._shutdown_executor()
            raise
        self._runner = runner
        logger.info("backend %s: loaded %s in %.1f s (n_ctx=%d)", self.name, path.name, took, runner.n_ctx)

    def _resolve_model_path(self) -> Path:
        self._model_path = resolve_model_path(
            self.name,
            self.options.model_path,
            accepts=lambda path: path.is_file() or path.is_dir(),
            expected="a GGUF file or a local MLX/Hugging Face model directory",
        )
        return self._model_path
    def _load(self, path: Path) -> Any:
        """Worker-thread body of ``start``: the model, its tokenizer, and the runner."""
        import mlx.core as mx

        from backends.mlx.runner import MLXRunner

        dtype_name = self.options.dtype
        if dtype_name is None:
            on_cpu = mx.default_device().type == mx.cpu
            dtype_name = "float32" if on_cpu else "float16"
        dtype = getattr(mx, dtype_name)
        try:
            if path.is_file():
                from backends.mlx.gguf_loader import load_gguf_model
                from backends.mlx.tokenizer import load_gguf_tokenizer

                loaded = load_gguf_model(path, dtype=dtype)
                model, context_length = loaded.model, loaded.context_length
                tokenizer = load_gguf_tokenizer(path, loaded.metadata)
            else:
                model, tokenizer, context_length = _load_directory(path, dtype)
        except InfermuxError:
            raise
        except Exception as exc:  # loader errors of every kind: bad files, missing keys
            raise BackendUnavailableError(
                f"backend {self.name!r}: MLX could not load {path}: {exc}"
            ) from exc
        self._maybe_dequantize(model, dtype)
        n_ctx = self.options.n_ctx or context_length or 2048
        return MLXRunner(
            model,
            tokenizer,
            n_ctx=n_ctx,
            prefill_step_size=self.options.prefill_step_size,
            use_prompt_cache=self.options.prompt_cache,
            default_seed=self.options.seed,
            chat=self.options.chat,
        )

    def _maybe_dequantize(self, model: Any, dtype: Any) -> None:
        """Apply the ``dequantize`` option (see :class:`MLXOptions`) to the loaded model."""
        import mlx.core as mx

        from backends.mlx.cpu_blas import dense_bytes, dequantize

        wanted = self.options.dequantize
        size_mb = dense_bytes(model) / 2**20
        if wanted is None:
            on_cpu = mx.default_device().type == mx.cpu
            wanted = on_cpu and use_openblas() is not None and size_mb <= self.options.dequantize_max_mb
        if wanted:
            count = dequantize(model, dtype)
            if count:
                logger.info("backend %s: %d quantized layers made float (%.0f MiB)", self.name, count, size_mb)

    def model_info(self) -> ModelInfo:
        """The file/directory name, the context length in use and the model's chat template."""
        path = self._model_path
        model_id = self.options.model_id or (path.name.removesuffix(".gguf") if path else self.name)
        runner = self._runner
        return ModelInfo(
            id=model_id,
            context_length=runner.n_ctx if runner is not None else self.options.n_ctx,
            chat_template=runner.tokenizer.chat_template if runner is not None else None,
        )

    async def health(self) -> HealthStatus:
        """Loaded or not (no generation)."""
        if self._runner is None:
            return HealthStatus(ok=False, detail="model not loaded")
        return HealthStatus(ok=True, detail="loaded")

    async def aclose(self) -> None:
        """Cancel queued and running generations, free the model, stop the worker thread."""
        runner, self._runner = self._runner, None
        executor = self._executor
        if executor is None:
            return
        for job in list(self._jobs):
            job.cancelled.set()
            job.send(GenerationAbortedError(f"backend {self.name!r} was closed"))
        loop = asyncio.get_running_loop()
        if runner is not None:
            await loop.run_in_executor(executor, runner.close)
        self._shutdown_executor()
        # Join the worker: MLX's thread teardown must not overlap interpreter exit.
        await loop.run_in_executor(None, functools.partial(executor.shutdown, wait=True))

    def _shutdown_executor(self) -> None:
        if self._executor is not None:
            # The last job: MLX's per-thread streams must go before their thread does, or
            # the process may abort at exit (ml-explore/mlx#3126).
            self._executor.submit(_release_thread_streams)
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
        if request.kind in ("tokenize", "detokenize"):
            return self._tokenize(request)
        return self._generate(request)

    async def _tokenize(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """The prompt's token ids (as a generation of it would see them: the chat template
        rendered), or the text of ``prompt``'s ids; one chunk."""
        runner = self._runner
        if runner is None:
            raise BackendUnavailableError(f"backend {self.name!r} is not loaded")
        if request.kind == "detokenize":
            tokenizer = runner.tokenizer
            yield detokenized(
                request, runner.n_vocab,
                lambda ids: b"".join(tokenizer.token_bytes(t) for t in ids).decode("utf-8", errors="replace"),
            )
            return
        yield tokenized(runner.prompt_tokens(as_prompt(request)))

    async def _generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        self._check_supported(request)
        runner = self._runner
        plan = None
        if request.kind == "chat" and runner is not None:
            plan = plan_chat(request, runner.template, runner.chat_format)
            runner = _PlannedRunner(runner, plan)
        stream: AsyncIterator[GenerationChunk] = stream_job(
            request,
            backend_name=self.name,
            runner=runner,
            executor=self._executor,
            jobs=self._jobs,
            library="MLX",
        )
        resume = request.resume
        if resume is not None and self._runner is not None:
            # The runner prefills the prompt and the earlier output; the text is made again
            # over the whole output (backends/resume.py).
            core = self._runner
            prompt = core.resumed_prompt(core.prompt_tokens(request, plan), resume)
            parsed = resumed_output(
                stream, resume, piece=core.tokenizer.token_bytes, stop=request.params.stop,
                num_prompt_tokens=len(prompt),
            )
        else:
            parsed = plan.parse(stream) if plan is not None else stream
        async with contextlib.aclosing(parsed):  # type: ignore[type-var]  # closing us must cancel the job at once
            async for chunk in parsed:
                yield chunk

    def _check_supported(self, request: GenerationRequest) -> None:
        """400 for what this backend cannot honour, before any work is queued."""
        params = request.params
        if params.echo:
            raise UnsupportedParameterError(
                f"echo is not supported by backends of kind 'mlx' (backend {self.name!r})",
                param="echo",
            )
        if params.top_logprobs > _MAX_TOP_LOGPROBS:
            raise UnsupportedParameterError(
                f"top_logprobs above {_MAX_TOP_LOGPROBS} is not supported by backend {self.name!r}",
                param="top_logprobs",
            )


def _release_thread_streams() -> None:
    import mlx.core as mx

    mx.synchronize()
    mx.clear_streams()


def _load_directory(path: Path, dtype: Any) -> tuple[Any, Any, int | None]:
    """An MLX / Hugging Face directory through mlx-lm's own loader (local files only)."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import load

    from backends.mlx.tokenizer import HFTokenizer

    model, wrapper, config = load(str(path), return_config=True)  # type: ignore[misc]
    # Float parameters in the requested type; quantized weights stay packed.
    model.update(
        tree_map(
            lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p,
            model.parameters(),
        )
    )
    mx.eval(model.parameters())
    context_length = config.get("max_position_embeddings")
    return model, HFTokenizer.from_mlx_lm(wrapper), context_length


class _PlannedRunner:
    """The runner, handed one chat's plan (its prompt text and constraint)."""

    def __init__(self, runner: Any, plan: ChatPlan) -> None:
        self._runner = runner
        self._plan = plan

    def run(self, request: GenerationRequest, emit: Any, is_cancelled: Any) -> None:
        self._runner.run(request, emit, is_cancelled, plan=self._plan)
