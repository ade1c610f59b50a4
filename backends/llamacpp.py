"""The llama.cpp backend: llama-cpp-python in-process, from a GGUF file.

One llama.cpp context serves up to ``parallel`` requests at once, batched into one
``llama_decode`` per step on one dedicated worker thread (contexts are not thread-safe), the
way ``llama-server -np N`` batches: :mod:`backends._llamacpp_loop` describes the step. Each
request has its own sampler chain, stop strings, logprobs and slot of the KV cache, so a
request with a fixed seed gives the same output alone or beside others, up to llama.cpp's
rounding (which can depend on the batch's size and on where in the cache the request's KV
cells lie: a near tie may then go the other way). Requests beyond ``parallel`` queue in FIFO
order. Tokens travel from the worker to the event loop through ``loop.call_soon_threadsafe``
into a per-request ``asyncio.Queue`` as they are sampled. Closing the iterator sets a flag
the worker checks before every step, so an abandoned request leaves the batch within one
decode step.

The chat template comes from the GGUF metadata (``tokenizer.chat_template``), rendered in
the sandbox of :mod:`core_engine.chat.template`. Each slot keeps the tokens of its last
request in the KV cache; a new prompt goes to the free slot sharing the longest prefix with
it, skips that prefix, and the number of skipped tokens is reported as ``cached_tokens``.
Only a slot filled under the request's ``cache_salt`` (its tenant) counts: a prompt of
another salt gets a cold prefill, so no tenant learns how another's prompts began.

With ``options.speculation`` the runner proposes tokens by n-gram lookup in each sequence's
own prompt and output and verifies them in the same ``llama_decode`` (greedy output is the
plain output, up to llama.cpp's rounding of a multi-row batch; sampled output keeps the
target distribution). ``use_policies`` gives it the speculation policy it asks per
sequence and step (default: ``EnginePolicies()``'s ``AdaptiveSpeculationPolicy``); each
final chunk carries ``SpeculationStats`` and ``stats()`` the ``spec_decode_*`` counters.
In a worker process the gateway's policy is asked once per request instead
(:mod:`backends.worker.supervisor`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from backends._option import decode_options
from backends._thread_job import ThreadJob, drain
from backends.base import (
    BackendConfig,
    Capabilities,
    GenerationChunk,
    GenerationRequest,
    HealthStatus,
    ModelInfo,
    Usage,
)
from backends.chat_plan import ChatOptions, plan_chat
from backends.errors import (
    BackendConfigError,
    BackendUnavailableError,
    InvalidRequestError,
    UnsupportedParameterError,
)
from backends.model_loading import load_with_progress, resolve_model_path
from backends.resume import resumed_output
from backends.threads import default_num_threads
from backends.token_ids import as_prompt, detokenized, tokenized
from core_engine.chat.template import ChatTemplateError
from core_engine.policy import EnginePolicies, SpeculationMethod

if TYPE_CHECKING:
    from backends._llamacpp_embedding import LlamaEmbedder
    from backends._llamacpp_loop import LlamaRunner

__all__ = ["LlamaCppBackend", "LlamaCppOptions", "LlamaCppSpeculation", "create_backend"]

logger = logging.getLogger(__name__)

#: The default ``parallel`` where its KV cache fits (see ``LlamaCppOptions.parallel``).
_DEFAULT_PARALLEL = 16
#: The share of physical memory the KV cache of the default ``parallel`` may take.
_KV_MEMORY_SHARE = 1 / 8
#: llama.cpp's limit on sequence ids (``LLAMA_MAX_SEQ``).
_MAX_PARALLEL = 256
#: The most tokens one sequence may propose per step.
_MAX_PROPOSAL = 64


class LlamaCppSpeculation(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``options.speculation``: n-gram (prompt-lookup) speculative decoding."""

    #: Proposal methods; only "ngram" (a draft model is not something this backend runs).
    methods: list[str] = msgspec.field(default_factory=lambda: ["ngram"])
    #: The most tokens proposed for one sequence in one step (the policy's ``k`` is clipped).
    max_proposal: int = 8
    #: The longest suffix looked up in the sequence's earlier tokens
    #: (``LlamaPromptLookupDecoding``'s ``max_ngram_size``).
    ngram_size: int = 3


class LlamaCppOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of a ``kind = "llamacpp"`` backend."""

    #: GGUF file; default: the embedded SmolLM2-135M-Instruct.
    model_path: str | None = None
    #: Context length of one request (prompt plus output); the KV cache holds
    #: ``parallel * n_ctx`` token positions.
    n_ctx: int = 2048
    #: Requests served at once, batched into each ``llama_decode`` (llama-server's ``-np``);
    #: more queue. None: 16, or fewer when the KV cache of 16 x ``n_ctx`` positions (f16 K
    #: and V in every layer) would take more than 1/8 of the machine's physical memory: the
    #: most that fits in that 1/8, and at least 1.
    parallel: int | None = None
    #: Threads of decode (default: backends/threads.py, ``INFERMUX_NUM_THREADS`` or 2).
    n_threads: int = msgspec.field(default_factory=default_num_threads)
    n_threads_batch: int | None = None
    #: Most tokens in one ``llama_decode`` (prompt chunks plus one per generating request);
    #: raised to ``parallel`` if below.
    n_batch: int = 512
    #: Seed for requests that send none (None: a fresh random seed per request).
    seed: int | None = None
    #: ``model_info().id`` (default: the file name without ``.gguf``).
    model_id: str | None = None
    use_mmap: bool = True
    #: Let llama.cpp print its own logs to stderr.
    verbose: bool = False
    #: Speculative decoding (None: off). See "Speculative decoding (llama.cpp)" in
    #: docs/backends.md.
    speculation: LlamaCppSpeculation | None = None
    #: ``POST /v1/embeddings``: llama.cpp's pooling of a sequence's final hidden states
    #: ("mean" or "last"), L2-normalised; run in a second context created on first use.
    embedding_pooling: Literal["mean", "last"] = "mean"
    #: Chat formatting (:class:`backends.chat_plan.ChatOptions`).
    chat: ChatOptions | None = None


class LlamaCppBackend:
    """A GGUF model served by llama.cpp in this process; see the module docstring."""

    kind = "llamacpp"

    def __init__(self, config: BackendConfig) -> None:
        self.name = config.name
        self.config = config
        self.options = decode_options(config, LlamaCppOptions)
        prefix = f"backends.{config.name}.options"
        if self.options.n_ctx < 16:
            raise ValueError(f"{prefix}.n_ctx: must be at least 16")
        if self.options.n_threads < 1:
            raise ValueError(f"{prefix}.n_threads: must be at least 1")
        if self.options.n_batch < 1:
            raise ValueError(f"{prefix}.n_batch: must be at least 1")
        parallel = self.options.parallel
        if parallel is not None and not 1 <= parallel <= _MAX_PARALLEL:
            raise ValueError(f"{prefix}.parallel: must be between 1 and {_MAX_PARALLEL}")
        if self.options.speculation is not None:
            _check_speculation(self.options.speculation, f"{prefix}.speculation")
        self.capabilities = Capabilities(
            logprobs=True,
            echo=True,
            structured_outputs=True,
            tools=True,
            embeddings=True,
            tokenize=True,
            resume=True,
            max_top_logprobs=20,
        )
        self._runner: LlamaRunner | None = None
        self._embedder: LlamaEmbedder | None = None
        #: Structured-output constraints over llama.cpp's vocabulary (built on first use).
        self._grammars: Any = None
        self._model_path: Path | None = None
        self._policies = EnginePolicies()

    @property
    def speculation_methods(self) -> tuple[SpeculationMethod, ...]:
        """The speculation methods configured (empty: this backend does not speculate)."""
        return ("ngram",) if self.options.speculation is not None else ()

    def use_policies(self, policies: EnginePolicies) -> None:
        """Consult ``policies.speculation`` per generating sequence and step (when
        ``options.speculation`` is set); the default is :class:`EnginePolicies`'s own."""
        self._policies = policies
        if self._runner is not None:
            self._runner.use_speculation_policy(policies.speculation)

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the GGUF off the event loop, logging progress while it loads."""
        if self._runner is not None:
            return
        path = self._resolve_model_path()
        runner, took = await load_with_progress(self.name, path, lambda: self._load(path))
        self._runner = runner
        from backends._llamacpp_embedding import LlamaEmbedder

        self._embedder = LlamaEmbedder(
            runner.model,
            n_ctx=self.options.n_ctx,
            n_threads=self.options.n_threads_batch or self.options.n_threads,
            pooling=self.options.embedding_pooling,
        )
        logger.info(
            "backend %s: loaded %s in %.1f s (n_ctx=%d, parallel=%d, n_threads=%d)",
            self.name,
            path.name,
            took,
            runner.n_ctx,
            runner.parallel,
            self.options.n_threads,
        )

    def _resolve_model_path(self) -> Path:
        self._model_path = resolve_model_path(
            self.name, self.options.model_path, accepts=Path.is_file, expected="a GGUF file"
        )
        return self._model_path
    def _load(self, path: Path) -> LlamaRunner:
        try:
            import llama_cpp  # noqa: F401  (the package also installs llama.cpp's log callback)
        except ImportError as exc:
            raise BackendUnavailableError(
                "the llamacpp backend needs llama-cpp-python: pip install 'infermux[llamacpp]'"
            ) from exc
        from backends._llamacpp_loop import LlamaRunner
        from backends._llamacpp_model import LlamaModel

        options = self.options
        # llama-cpp-python's log callback prints llama.cpp's lines at this logger's level.
        logging.getLogger("llama-cpp-python").setLevel(
            logging.DEBUG if options.verbose else logging.ERROR
        )
        try:
            model = LlamaModel(path, use_mmap=options.use_mmap, chat=options.chat)
        except ChatTemplateError as exc:
            raise BackendConfigError(f"backend {self.name!r}: {exc}") from exc
        except (ValueError, RuntimeError, OSError) as exc:
            raise BackendUnavailableError(
                f"backend {self.name!r}: llama.cpp could not load {path}: {exc}"
            ) from exc
        parallel = options.parallel or _default_parallel(options.n_ctx, model.kv_bytes_per_token)
        speculation = options.speculation
        try:
            return LlamaRunner(
                model,
                name=self.name,
                n_ctx=options.n_ctx,
                parallel=parallel,
                n_batch=options.n_batch,
                n_threads=options.n_threads,
                n_threads_batch=options.n_threads_batch or options.n_threads,
                default_seed=options.seed,
                speculation_policy=self._policies.speculation if speculation else None,
                max_proposal=speculation.max_proposal if speculation else 0,
                ngram_size=speculation.ngram_size if speculation else 0,
            )
        except RuntimeError as exc:
            model.close()
            raise BackendUnavailableError(
                f"backend {self.name!r}: llama.cpp could not create its context: {exc}"
            ) from exc

    def model_info(self) -> ModelInfo:
        """The file's name, the context length of a request, the template from the metadata."""
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
        """Abort queued and running generations, stop the worker thread, free the context."""
        runner, self._runner = self._runner, None
        embedder, self._embedder = self._embedder, None
        if runner is None:
            return
        # Readers get GenerationAbortedError now, not after the worker's current step.
        runner.stop()
        if embedder is not None:  # its context goes before the model it runs
            await asyncio.to_thread(embedder.close)
        await asyncio.to_thread(runner.close)

    async def wait_idle(self) -> None:
        """Wait until every generation submitted so far has left the worker (drain, tests)."""
        if self._runner is not None:
            await asyncio.to_thread(self._runner.wait_idle)

    @property
    def num_generated_tokens(self) -> int:
        """Tokens sampled since start, across requests (including abandoned ones)."""
        return self._runner.num_generated_tokens if self._runner is not None else 0

    def stats(self) -> dict[str, float]:
        """Speculation counters since start (vLLM's ``spec_decode`` series), when it is on."""
        runner = self._runner
        if runner is None or not runner.speculates:
            return {}
        return {
            "spec_decode_num_drafts": float(runner.spec_decode_num_drafts),
            "spec_decode_num_draft_tokens": float(runner.spec_decode_num_draft_tokens),
            "spec_decode_num_accepted_tokens": float(runner.spec_decode_num_accepted_tokens),
        }

    # -- serving --------------------------------------------------------------------------

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream one choice; closing the iterator takes it out of the batch at the next step."""
        if request.kind == "embedding":
            return self._embed(request)
        if request.kind in ("tokenize", "detokenize"):
            return self._tokenize(request)
        return self._stream(request)

    async def _tokenize(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """The prompt's token ids (as a generation of it would see them), or the text of
        ``prompt``'s ids; one chunk, worked out on a worker thread (the model's vocabulary is
        read-only: any thread), so that a body of megabytes does not stall the event loop."""
        runner = self._runner
        if runner is None:
            raise BackendUnavailableError(f"backend {self.name!r} is not loaded")
        yield await asyncio.to_thread(_tokenized, request, runner.model)

    async def _embed(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Every input's vector in one chunk (:mod:`backends._llamacpp_embedding`)."""
        runner, embedder = self._runner, self._embedder
        if runner is None or embedder is None:
            raise BackendUnavailableError(f"backend {self.name!r} is not loaded")
        if request.dimensions is not None and request.dimensions != embedder.n_embd:
            raise UnsupportedParameterError(
                f"the model {request.model!r} gives vectors of {embedder.n_embd} dimensions "
                f"only (backend {self.name!r} cannot shorten them)",
                param="dimensions",
            )
        model = runner.model
        token_ids: list[list[int]] = []
        for i, item in enumerate(request.inputs or ()):
            if isinstance(item, tuple):
                if any(not 0 <= t < model.n_vocab for t in item):
                    raise InvalidRequestError(
                        f"token ids must be below the vocabulary size {model.n_vocab}",
                        param=f"input[{i}]",
                    )
                ids = list(item)
            else:
                ids = model.tokenize(item, add_bos=model.add_bos)
            if not ids:
                raise InvalidRequestError("the input has no tokens", param=f"input[{i}]")
            token_ids.append(ids)
        vectors = await asyncio.to_thread(embedder.embed, token_ids)
        yield GenerationChunk(
            embeddings=tuple(vectors),
            finish_reason="stop",
            usage=Usage(prompt_tokens=sum(len(ids) for ids in token_ids), completion_tokens=0),
        )

    async def _stream(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        runner = self._runner
        if runner is None:
            raise BackendUnavailableError(f"backend {self.name!r} is not loaded")
        job = ThreadJob(request, asyncio.get_running_loop())
        structured = request.structured_outputs
        plan = None
        if request.kind == "chat":
            plan = plan_chat(request, runner.model.template, runner.model.chat_format)
            job.chat_text, structured = plan.text, plan.structured_outputs
            if plan.thinking is not None:
                job.thinking = runner.model.thinking_budget(plan.thinking)
        if structured is not None:
            # Compiled here, off the batch loop's thread (cached by constraint).
            job.matcher = await asyncio.to_thread(self._compile, runner, structured)
        resume = request.resume
        if resume is not None:
            # The runner prefills the prompt and the earlier output (_llamacpp_loop);
            # the text is made again over the whole output (backends/resume.py).
            model = runner.model
            prompt, _ = model.prompt_tokens(request, job.chat_text)
            num_prompt = len(model.resumed_prompt(prompt, resume))
            runner.submit(job)
            resumed = resumed_output(
                drain(job), resume, piece=model.piece, stop=request.params.stop,
                num_prompt_tokens=num_prompt,
            )
            async for chunk in resumed:
                yield chunk
            return
        runner.submit(job)
        chunks = drain(job)
        async for chunk in (plan.parse(chunks) if plan is not None else chunks):
            yield chunk

    def _compile(self, runner: LlamaRunner, structured: dict[str, Any]) -> Any:
        """An llguidance matcher for the request's constraint (the core engine's compiler,
        over llama.cpp's own vocabulary); ``InvalidRequestError`` naming the field."""
        from core_engine.errors import InvalidParamError
        from core_engine.structured import GrammarCompiler, StructuredOutput

        if self._grammars is None:
            model = runner.model

            def make_tokenizer() -> Any:
                from llguidance.llamacpp import lltokenizer_from_vocab

                return lltokenizer_from_vocab(model.vocab, n_vocab=model.n_vocab, eos_token=sorted(model.eog_ids))

            self._grammars = GrammarCompiler(make_tokenizer)
        try:
            return self._grammars.compile(StructuredOutput.from_request(structured))
        except InvalidParamError as exc:
            raise InvalidRequestError(exc.message, param=exc.param) from exc


def _tokenized(request: GenerationRequest, model: Any) -> GenerationChunk:
    """:meth:`LlamaCppBackend._tokenize`'s chunk, computed on the calling thread."""
    if request.kind == "detokenize":
        return detokenized(
            request, model.n_vocab,
            lambda ids: b"".join(model.token_text(t) for t in ids).decode("utf-8", errors="replace"),
        )
    prompt_request = as_prompt(request)
    chat_text = None
    if prompt_request.kind == "chat":
        chat_text = plan_chat(prompt_request, model.template, model.chat_format).text
    tokens, _ = model.prompt_tokens(prompt_request, chat_text)
    return tokenized(tokens)


def _check_speculation(speculation: LlamaCppSpeculation, prefix: str) -> None:
    """``ValueError`` naming the field for options this backend cannot run."""
    if "draft" in speculation.methods:
        raise ValueError(
            f'{prefix}.methods: "draft" needs a draft model, which the llamacpp backend '
            'does not run; use ["ngram"] (prompt lookup)'
        )
    unknown = [m for m in speculation.methods if m != "ngram"]
    if unknown:
        raise ValueError(f'{prefix}.methods: unknown method {unknown[0]!r} (only "ngram")')
    if not speculation.methods:
        raise ValueError(f'{prefix}.methods: name "ngram" (leave speculation out to turn it off)')
    if not 1 <= speculation.max_proposal <= _MAX_PROPOSAL:
        raise ValueError(f"{prefix}.max_proposal: must be between 1 and {_MAX_PROPOSAL}")
    if speculation.ngram_size < 1:
        raise ValueError(f"{prefix}.ngram_size: must be at least 1")


def _default_parallel(n_ctx: int, kv_bytes_per_token: int) -> int:
    """``parallel`` when the options leave it unset: see :class:`LlamaCppOptions`."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf names (Windows)
        memory = 8 * 2**30
    fitting = int(memory * _KV_MEMORY_SHARE) // max(1, n_ctx * kv_bytes_per_token)
    return max(1, min(_DEFAULT_PARALLEL, fitting))


def create_backend(config: BackendConfig) -> LlamaCppBackend:
    """Factory registered for kind ``"llamacpp"``."""
    return LlamaCppBackend(config)


#: llama.cpp runs in a supervised worker process unless ``worker_process = false``
#: (backends/worker): a crash in its kernels must not take the gateway down.
create_backend.worker_process_default = True  # type: ignore[attr-defined]
