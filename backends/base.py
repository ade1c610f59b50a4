"""The Backend contract and the backend-neutral messages that cross it.

The gateway converts each wire request into one frozen :class:`GenerationRequest` (one
choice: ``n`` and prompt lists are fanned out by the gateway, choice ``i`` gets ``seed + i``).
A backend answers with an async iterator of :class:`GenerationChunk`; the last chunk carries
``finish_reason`` and ``usage``. Closing the iterator (``aclose()``, or the task being
cancelled) must abort the work upstream: HTTP stream closed, engine request aborted, KV
blocks freed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec

__all__ = [
    "Backend",
    "BackendConfig",
    "Capabilities",
    "ChatMessage",
    "EnginePhases",
    "GenerationChunk",
    "GenerationRequest",
    "HealthStatus",
    "ModelInfo",
    "PrefixPin",
    "ResumeState",
    "SamplingParams",
    "SpeculationStats",
    "TokenLogprob",
    "ToolCall",
    "ToolCallDelta",
    "TopLogprob",
    "Usage",
]

FinishReason = Literal["stop", "length", "abort", "error", "tool_calls", "content_filter"]


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """A function call an assistant turn made (``arguments``: JSON text, as the model wrote it)."""

    id: str
    name: str
    arguments: str


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    """One chat turn; ``content`` is plain text (content-part arrays are joined by the gateway).

    Roles: ``system``, ``user``, ``assistant`` (with ``tool_calls`` when it called tools) and
    ``tool`` (a call's result, ``tool_call_id`` naming the call).
    """

    role: str
    content: str
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Sampling for one choice. ``None`` means "the backend's default"."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None  # None or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    #: Return the sampled token's logprob (chat ``logprobs`` / completions ``logprobs``).
    logprobs: bool = False
    #: How many alternatives per position (chat ``top_logprobs`` / completions ``logprobs=N``).
    top_logprobs: int = 0
    #: Completions ``echo``: the prompt is part of the output, with prompt logprobs if asked.
    echo: bool = False


class PrefixPin(msgspec.Struct, frozen=True, kw_only=True):
    """Keep the prompt's prefix through its first ``num_messages`` messages (tools
    included) in the prefix cache for ``ttl_s`` after the request (Anthropic's
    ``cache_control`` breakpoints; engines with a prefix cache honour it)."""

    num_messages: int
    ttl_s: float


class ResumeState(msgspec.Struct, frozen=True, kw_only=True):
    """The output an earlier backend produced before it failed mid-stream; the backend
    continues it (the router's ``resume_on_failure``, gateway/serving/stream_resume.py).

    A backend that advertises ``Capabilities.resume`` prefills the prompt followed by
    ``token_ids`` (same model) or, when ``token_ids`` is empty, by the tokens of ``text``
    (another model: the partial answer as the start of the assistant turn), and streams
    only what comes after ``text``: stop strings are matched over the whole output, and
    the bytes of a character cut by the failure are completed, not replaced.
    """

    #: Every output token id the failed backend sent (text held back included); empty when
    #: they do not apply to this backend's vocabulary.
    token_ids: tuple[int, ...] = ()
    #: The answer text the client has received.
    text: str = ""
    #: How many leading characters of ``text`` the client wrote itself (vLLM's
    #: ``continue_final_message``): stop strings are not matched over them, as vLLM matches
    #: generated text only.
    num_given_chars: int = 0


class GenerationRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One backend-neutral generation (one choice). Built by the controller; frozen."""

    request_id: str
    model: str  # the alias the client asked for
    #: ``tokenize`` / ``detokenize`` (``POST /tokenize``, ``/detokenize``): the prompt's
    #: tokens (``messages`` rendered, or ``prompt`` text) or the text of ``prompt``'s ids,
    #: answered in one chunk without generating.
    kind: Literal["chat", "completion", "embedding", "tokenize", "detokenize"]
    messages: tuple[ChatMessage, ...] | None = None  # chat
    prompt: str | tuple[int, ...] | None = None  # completion: text or token ids
    #: Embeddings: every input of the request (text or token ids), embedded in one call so
    #: that an engine can batch them; the answer is one chunk with ``embeddings``.
    inputs: tuple[str | tuple[int, ...], ...] | None = None
    #: Embeddings ``dimensions`` as sent (None: the model's own size).
    dimensions: int | None = None
    #: Chat messages are rendered with the template's assistant prefix (tokenize may ask
    #: for the messages alone).
    add_generation_prompt: bool = True
    #: vLLM's ``chat_template_kwargs``: extra variables for the chat template, as sent
    #: (plain JSON, e.g. ``{"enable_thinking": false}``; never a variable the renderer sets,
    #: the gateway checks). Native backends pass them to the template's render.
    chat_template_kwargs: dict[str, Any] = {}
    params: SamplingParams = SamplingParams()
    stream: bool = False
    choice_index: int = 0
    tenant: str | None = None
    api_key_id: str | None = None
    user: str | None = None
    #: The prefix-cache partition of this request (issue 44): a digest the gateway derives
    #: from the authenticated tenant (or the sharing group an operator declared for it) and
    #: the request's own ``cache_salt``, never from a field a client can copy. Every cache
    #: that can report or speed up a hit (engine KV tiers, llama.cpp slots, MLX's prompt
    #: cache, the cache-aware router) hits only within one salt. None: one shared partition
    #: (a backend used without the gateway).
    cache_salt: str | None = None
    #: Absolute ``time.monotonic()`` deadline, or None.
    deadline: float | None = None
    #: OpenAI's ``response_format`` as sent (json_object / json_schema), for remotes.
    response_format: dict[str, Any] | None = None
    #: The request's output constraint, normalised (gateway/openai/structured_outputs.py): one of
    #: ``json`` (a schema), ``json_object``, ``regex``, ``choice``, ``grammar``, and
    #: ``param``, the request field it came from. Native backends enforce it.
    structured_outputs: dict[str, Any] | None = None
    #: Tools offered to the model (OpenAI tool objects ``{"type": "function", "function":
    #: {"name", "description", "parameters"}}``), ``tool_choice`` normalised to ``none``,
    #: ``auto``, ``required`` or ``function`` (then ``tool_function`` names it), and
    #: ``parallel_tool_calls``. Native backends render, constrain and parse them
    #: (:mod:`backends.chat_plan`); remotes get them passed through.
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: Literal["none", "auto", "required", "function"] = "auto"
    tool_function: str | None = None
    parallel_tool_calls: bool = True
    #: Reasoning: the client's ``reasoning_effort`` and ``max_reasoning_tokens`` (passed to
    #: remotes as sent), and the thinking budget native engines enforce (the explicit maximum,
    #: or the effort's budget from ``[reasoning]``; None: no budget).
    reasoning_effort: str | None = None
    max_reasoning_tokens: int | None = None
    reasoning_budget: int | None = None
    #: Prefixes to keep cached (the core engine pins them).
    prefix_pins: tuple[PrefixPin, ...] = ()
    #: Incoming W3C trace context to propagate to remote backends.
    traceparent: str | None = None
    #: Free-form labels plugins may attach (routing hints, tenant tags).
    labels: dict[str, str] = {}
    #: The id of the HTTP request this choice belongs to when it has several choices
    #: (``n`` > 1 or a list of prompts: ``request_id`` is then ``<parent>.<index>``); None
    #: when the request has one choice (``request_id`` is the HTTP request's id).
    parent_request_id: str | None = None
    #: Continue an answer another backend began (mid-stream failover); None: a new answer.
    resume: ResumeState | None = None


class TopLogprob(msgspec.Struct, frozen=True, kw_only=True):
    token: str
    logprob: float
    token_id: int | None = None
    bytes: list[int] | None = None


class TokenLogprob(msgspec.Struct, frozen=True, kw_only=True):
    """Logprob of one emitted (or, for echo, prompt) token and its top alternatives."""

    token: str
    logprob: float | None  # None for the first prompt token (nothing predicts it)
    token_id: int | None = None
    bytes: list[int] | None = None
    top_logprobs: tuple[TopLogprob, ...] = ()
    text_offset: int | None = None


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    #: Prompt tokens served from a prefix cache; None when the backend cannot tell.
    cached_tokens: int | None = None
    #: ``cached_tokens`` by the KV tier they came from ("device", "host", "disk"), for
    #: engines with KV tiers (tracing); None otherwise.
    cached_tokens_by_tier: dict[str, int] | None = None
    #: Output tokens spent thinking (reasoning models); None when there is no reasoning.
    reasoning_tokens: int | None = None


class EnginePhases(msgspec.Struct, frozen=True, kw_only=True):
    """Time spent in engine phases, for tracing (seconds; None when unknown)."""

    queued_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None


class SpeculationStats(msgspec.Struct, frozen=True, kw_only=True):
    """Speculative decoding of one choice, on its last chunk (engines that speculate).

    Counted as vLLM's ``spec_decode`` series: a *draft* is one proposal of one or more
    tokens verified in one forward; mean accepted length per draft is
    ``num_accepted_tokens / num_drafts``, and each draft also yields one token of the
    target's own (the correction or the bonus token).
    """

    #: "ngram" or "draft" (the last method used), None when nothing was proposed.
    method: str | None = None
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        return self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


class ToolCallDelta(msgspec.Struct, frozen=True, kw_only=True):
    """A piece of one tool call, as OpenAI streams it: the first piece of call ``index``
    has its ``id`` and ``name``, the next ones ``arguments`` fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class GenerationChunk(msgspec.Struct, frozen=True, kw_only=True):
    """A piece of output. Text deltas are already detokenized (never split a UTF-8 char).

    On chat requests ``text`` is the answer's content; ``reasoning`` the thinking of a
    reasoning model and ``tool_calls`` the calls, both already split out of the model's text.
    """

    text: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    token_ids: tuple[int, ...] = ()
    #: How many output tokens the chunk carries when ``token_ids`` does not say; None: one
    #: per chunk of text (an HTTP upstream's events that arrived together, merged for an
    #: answer sent in one body, say how many they were).
    token_count: int | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    #: Completions ``echo``: prompt text with its per-token logprobs, on the first chunk only.
    prompt_text: str | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: FinishReason | None = None
    #: On the last chunk, when a stop string ended the output: the string that matched
    #: (Anthropic's ``stop_sequence``, vLLM's ``stop_reason``).
    stop_sequence: str | None = None
    #: Set on the last chunk (and on error, with what was produced so far).
    usage: Usage | None = None
    phases: EnginePhases | None = None
    #: On the last chunk of a backend that speculates (None: no speculation).
    speculation: SpeculationStats | None = None
    #: Embedding requests: one vector per input, in order, as little-endian float32 bytes
    #: (OpenAI's base64 payload; compact across the worker-process boundary).
    embeddings: tuple[bytes, ...] | None = None


class Capabilities(msgspec.Struct, frozen=True, kw_only=True):
    """What a backend honestly supports; the gateway answers 400 for the rest."""

    streaming: bool = True
    logprobs: bool = False
    echo: bool = False
    top_k: bool = True
    min_p: bool = True
    seed: bool = True
    penalties: bool = True
    repetition_penalty: bool = True
    structured_outputs: bool = False
    tools: bool = False
    embeddings: bool = False
    #: ``kind`` tokenize / detokenize requests (the backend has the model's tokenizer).
    tokenize: bool = False
    #: Honours ``GenerationRequest.resume`` (continues another backend's partial answer).
    resume: bool = False
    max_top_logprobs: int = 20


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a backend knows about the model it serves."""

    id: str  # the backend's own model name (file stem, upstream id)
    context_length: int | None = None
    chat_template: str | None = None
    owned_by: str = "infermux"


class HealthStatus(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool
    detail: str = ""


class BackendConfig(msgspec.Struct, frozen=True, kw_only=True):
    """One ``[[backends]]`` table of the routing config.

    ``options`` is the kind-specific table (``model_path``, ``url``, ``n_ctx``...); each kind
    decodes it into its own Struct and names bad keys as ``backends.<name>.options.<key>``.
    """

    name: str
    kind: str
    options: dict[str, Any] = {}
    #: Timeouts in seconds (None: no limit).
    connect_timeout: float | None = 5.0
    first_byte_timeout: float | None = 60.0
    idle_timeout: float | None = 30.0
    total_timeout: float | None = 600.0
    #: Consecutive failures that open the circuit, and its cool-down before half-open.
    circuit_failure_threshold: int = 5
    circuit_cooldown_s: float = 10.0
    max_concurrency: int | None = None
    #: Run the backend in a supervised worker process (:mod:`backends.worker`); None: the
    #: kind's default (on for ``llamacpp``, ``mlx`` and ``core_engine``, whose option
    #: ``engine_process`` says the same; off for the others).
    worker_process: bool | None = None
    #: When it cannot start as configured (``BackendConfigError``: a missing model file,
    #: options this machine cannot run), ``infermux serve`` logs it and goes on without it
    #: instead of exiting at start-up.
    optional: bool = False


@runtime_checkable
class Backend(Protocol):
    """An inference backend for one model.

    Lifecycle: constructed cheaply from a :class:`BackendConfig`, ``await start()`` loads the
    model (showing progress), ``generate`` serves, ``await aclose()`` frees everything.
    """

    name: str
    kind: str
    capabilities: Capabilities

    async def start(self) -> None:
        """Load the model / open clients. Raises ``BackendUnavailableError`` on failure."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream the output of one choice.

        Raises (from the iterator) only :mod:`backends.errors` types. Before the first chunk a
        retryable error lets the router try another backend. Closing the iterator aborts the
        work. The last chunk has ``finish_reason`` and ``usage``.
        """
        ...

    def model_info(self) -> ModelInfo:
        """The served model's id, context length and chat template (after ``start``)."""
        ...

    async def health(self) -> HealthStatus:
        """Cheap liveness probe (no generation)."""
        ...

    async def aclose(self) -> None:
        """Release the model, threads and connections. Idempotent."""
        ...
