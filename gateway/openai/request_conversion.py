"""Wire request -> backend-neutral :class:`GenerationRequest`s (one per choice).

Checks that need more than a type (roles, content parts, caps from ``[limits]``,
combinations such as ``top_logprobs`` without ``logprobs``) live here and raise
:class:`InvalidRequestError` naming the parameter. ``n`` and prompt lists fan out: choice
``k`` of prompt ``p`` has ``choice_index = p * n + k`` and ``seed + k``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from backends.base import ChatMessage, GenerationRequest, ResumeState, SamplingParams, ToolCall
from backends.errors import InvalidRequestError, UnsupportedParameterError
from core_engine.chat.template import RESERVED_TEMPLATE_VARIABLES
from gateway.config.types import LimitsConfig, ReasoningConfig
from gateway.openai.response_format import checked_response_format
from gateway.openai.schemas import ChatCompletionRequest, CompletionRequest
from gateway.openai.structured_outputs import structured_outputs_of
from gateway.openai.tools import OfferedTool, check_named_choice, check_tools

__all__ = [
    "RESERVED_TEMPLATE_KWARGS",
    "SMUGGLING_FIELDS",
    "RequestContext",
    "check_smuggled_fields",
    "chat_generation_requests",
    "completion_generation_requests",
    "header_labels",
    "usage_chunk_wanted",
]

#: Fields that would let a request redirect the gateway or reprogram the model's template.
#: (``chat_template_kwargs``, plain variables for the model's own template, is accepted on
#: chat completions: see :data:`RESERVED_TEMPLATE_KWARGS`.)
SMUGGLING_FIELDS = frozenset({"api_base", "base_url", "api_key", "api_version", "chat_template"})

#: ``chat_template_kwargs`` keys a request may not send: the variables the server sets
#: itself (the conversation, the offered tools, the special tokens) and the functions
#: templates call, as the renderer defines them.
RESERVED_TEMPLATE_KWARGS = RESERVED_TEMPLATE_VARIABLES

# "developer" is OpenAI's newer name for "system"; chat templates know "system".
_ROLE_ALIASES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}

#: OpenAI's documented default for the legacy completions endpoint.
_COMPLETION_DEFAULT_MAX_TOKENS = 16


def check_smuggled_fields(raw_body: object) -> None:
    """400 for fields that try to choose the upstream or the chat template."""
    if not isinstance(raw_body, Mapping):
        return
    for field in SMUGGLING_FIELDS:
        if field in raw_body:
            raise UnsupportedParameterError(
                f"'{field}' cannot be set by a request: infermux routes to the backends of its "
                "own config and uses the model's own chat template",
                param=field,
            )


def header_labels(headers: Mapping[str, str], names: Sequence[str]) -> dict[str, str]:
    """The allow-listed request headers (``[plugins] request_headers``) as request labels.

    ``headers`` are looked up by lower-case name. Label keys are the lower-cased header
    names; absent headers are left out. Plugins read them from ``GenerationRequest.labels``
    (e.g. a tenant tagger reading ``x-tenant-id``).
    """
    labels: dict[str, str] = {}
    for name in names:
        key = name.lower()
        value = headers.get(key)
        if value is not None:
            labels[key] = value
    return labels


class RequestContext(msgspec.Struct, frozen=True, kw_only=True):
    """What turning a generation body into backend requests needs besides the body."""

    request_id: str
    limits: LimitsConfig
    reasoning: ReasoningConfig = ReasoningConfig()
    traceparent: str | None = None
    #: The allow-listed request headers (``[plugins] request_headers``).
    labels: dict[str, str] = {}
    #: The id of the API key that sent it (None in open mode): the Responses API keys
    #: its stored responses on it.
    api_key_id: str | None = None
    #: That key's tenant (None in open mode): the Responses API's per-tenant byte quota.
    tenant: str | None = None
    #: The prefix-cache partition of the key's tenant (``CacheConfig.partition_of``: the
    #: tenant's own, or its sharing group's). None in open mode: one local user, one tenant.
    cache_partition: str | None = None

    def cache_salt(self, client_salt: str | None) -> str | None:
        """``GenerationRequest.cache_salt``: a digest of the partition and the request's own
        ``cache_salt``, which can only narrow the partition (a client never names another
        tenant's partition: the partition comes from its key). None (the one unsalted
        partition) in open mode without a client salt: there is no other tenant to keep
        apart, and the engine's own users (offline, benchmarks) share its cache as before."""
        if self.cache_partition is None and client_salt is None:
            return None
        digest = hashlib.sha256(b"infermux-cache-salt\0")
        digest.update(msgspec.json.encode([self.cache_partition, client_salt]))
        return digest.hexdigest()


def usage_chunk_wanted(body: ChatCompletionRequest | CompletionRequest) -> bool:
    """``stream_options.include_usage`` on a streamed request: usage in a final chunk."""
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


def chat_generation_requests(
    body: ChatCompletionRequest, context: RequestContext
) -> list[GenerationRequest]:
    """One request per choice of a chat completion."""
    request_id, limits = context.request_id, context.limits
    _check_model(body.model)
    if len(body.messages) > limits.max_messages:
        raise InvalidRequestError(
            f"at most {limits.max_messages} messages are allowed per request", param="messages"
        )
    messages = tuple(_chat_message(i, m) for i, m in enumerate(body.messages))
    if body.top_logprobs and not body.logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
    top_logprobs = body.top_logprobs or 0
    _check_top_logprobs(top_logprobs, limits, "top_logprobs")
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    _check_max_tokens(
        max_tokens,
        limits,
        "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens",
    )
    params = _sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=bool(body.logprobs),
        top_logprobs=top_logprobs,
        echo=False,
        limits=limits,
    )
    n = _choice_count(body.n, 1, limits)
    _check_stream_options(body.stream, body.stream_options is not None)
    response_format = checked_response_format(body.response_format, limits)
    structured = structured_outputs_of(body, response_format, limits)
    tools, tool_choice, tool_function = _tools(body, limits)
    if structured is not None and tool_choice in ("required", "function"):
        raise InvalidRequestError(
            f"tool_choice {tool_choice!r} forces a tool call, which {structured['param']} cannot also "
            "constrain; send one of them",
            param="tool_choice",
        )
    budget = body.max_reasoning_tokens
    if budget is None and body.reasoning_effort is not None:
        budget = context.reasoning.effort_budgets.get(body.reasoning_effort)
    resume = _continued_message(body, messages)
    if resume is not None:
        constraint = (
            "tools" if tools and tool_choice != "none"
            else structured["param"] if structured is not None
            else "a thinking budget" if budget is not None
            else None
        )
        if constraint is not None:
            raise UnsupportedParameterError(
                f"continue_final_message cannot be combined with {constraint}: the output's "
                "constraint or parser would start in the middle of the message",
                param="continue_final_message",
            )
        messages = messages[:-1]
    template_kwargs = _template_kwargs(body.chat_template_kwargs)
    template = GenerationRequest(
        request_id=request_id,
        model=body.model,
        kind="chat",
        messages=messages,
        chat_template_kwargs=template_kwargs,
        params=params,
        stream=bool(body.stream),
        user=body.user,
        response_format=response_format,
        structured_outputs=structured,
        tools=tools,
        tool_choice=tool_choice,
        tool_function=tool_function,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        reasoning_effort=body.reasoning_effort,
        max_reasoning_tokens=body.max_reasoning_tokens,
        reasoning_budget=budget,
        traceparent=context.traceparent,
        labels=dict(context.labels),
        cache_salt=context.cache_salt(body.cache_salt),
        resume=resume,
    )
    return _fan_out([template], n, request_id)


def _template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM's ``chat_template_kwargs``: extra variables for the model's own template (the
    decoder checked it is a JSON object); 400 for a variable the server sets itself."""
    if not kwargs:
        return {}
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise InvalidRequestError(
            f"chat_template_kwargs cannot set {', '.join(repr(k) for k in reserved)}: the server sets "
            "these template variables itself (send messages, tools and add_generation_prompt as "
            "request fields)",
            param="chat_template_kwargs",
        )
    return dict(kwargs)


def _continued_message(body: ChatCompletionRequest, messages: tuple[ChatMessage, ...]) -> ResumeState | None:
    """vLLM's ``continue_final_message``: the last message, an assistant's partial answer,
    continued as a resumed answer (``GenerationRequest.resume`` with its text, the chat
    without it); None for a new turn. ``add_generation_prompt`` false is accepted only
    with it: a chat rendered without the assistant's turn opened is not served."""
    if not body.continue_final_message:
        if body.add_generation_prompt is False:
            raise UnsupportedParameterError(
                "add_generation_prompt false is supported only with continue_final_message true",
                param="add_generation_prompt",
            )
        return None
    if body.add_generation_prompt is not False:
        raise InvalidRequestError(
            "continue_final_message and add_generation_prompt cannot both be true "
            "(add_generation_prompt defaults to true: send it as false)",
            param="continue_final_message",
        )
    last, wire = messages[-1], body.messages[-1]
    if last.role != "assistant" or wire.content is None or last.tool_calls:
        raise InvalidRequestError(
            "continue_final_message needs the last message to be an assistant message with "
            "text content (the partial answer to continue)",
            param="messages",
        )
    return ResumeState(text=last.content, num_given_chars=len(last.content))


def completion_generation_requests(
    body: CompletionRequest, context: RequestContext
) -> list[GenerationRequest]:
    """One request per (prompt, choice) of a text completion."""
    request_id, limits = context.request_id, context.limits
    _check_model(body.model)
    if body.suffix is not None:
        raise UnsupportedParameterError("suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != 1:
        raise UnsupportedParameterError("best_of is not supported; use n", param="best_of")
    prompts = _prompts(body.prompt)
    echo = bool(body.echo)
    max_tokens = body.max_tokens if body.max_tokens is not None else _COMPLETION_DEFAULT_MAX_TOKENS
    _check_max_tokens(max_tokens, limits, "max_tokens")
    if max_tokens == 0 and not echo:
        raise InvalidRequestError(
            "max_tokens must be at least 1 (0 is allowed only with echo)", param="max_tokens"
        )
    top_logprobs = body.logprobs or 0
    _check_top_logprobs(top_logprobs, limits, "logprobs")
    params = _sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=body.logprobs is not None,
        top_logprobs=top_logprobs,
        echo=echo,
        limits=limits,
    )
    n = _choice_count(body.n, len(prompts), limits)
    _check_stream_options(body.stream, body.stream_options is not None)
    structured = structured_outputs_of(body, None, limits)
    cache_salt = context.cache_salt(body.cache_salt)
    templates = [
        GenerationRequest(
            request_id=request_id,
            model=body.model,
            kind="completion",
            prompt=prompt,
            params=params,
            stream=bool(body.stream),
            user=body.user,
            structured_outputs=structured,
            traceparent=context.traceparent,
            labels=dict(context.labels),
            cache_salt=cache_salt,
        )
        for prompt in prompts
    ]
    return _fan_out(templates, n, request_id)


def _fan_out(
    templates: list[GenerationRequest], n: int, request_id: str
) -> list[GenerationRequest]:
    if len(templates) == 1 and n == 1:
        return templates
    requests: list[GenerationRequest] = []
    for prompt_index, template in enumerate(templates):
        for k in range(n):
            index = prompt_index * n + k
            params = template.params
            if params.seed is not None and k:
                params = msgspec.structs.replace(params, seed=params.seed + k)
            # Engines key their work on request_id; choices must not collide.
            requests.append(
                msgspec.structs.replace(
                    template,
                    request_id=f"{request_id}.{index}",
                    parent_request_id=request_id,
                    choice_index=index,
                    params=params,
                )
            )
    return requests


def _check_model(model: str) -> None:
    if not model.strip():
        raise InvalidRequestError("model must name a model (see GET /v1/models)", param="model")


def _tools(
    body: ChatCompletionRequest, limits: LimitsConfig
) -> tuple[tuple[dict[str, Any], ...], Any, str | None]:
    """The offered tools as plain dicts, ``tool_choice`` normalised, the named function."""
    tools = body.tools or []
    names = check_tools(
        [
            OfferedTool(t.function.name, t.function.parameters, f"tools[{i}].function.name", f"tools[{i}].function.parameters")
            for i, t in enumerate(tools)
        ],
        limits,
    )
    offered = [msgspec.to_builtins(tool) for tool in tools]
    choice = body.tool_choice
    if choice is None:
        return tuple(offered), ("auto" if offered else "none"), None
    if isinstance(choice, str):
        if choice == "required" and not offered:
            raise InvalidRequestError("tool_choice 'required' needs tools", param="tool_choice")
        return tuple(offered), choice, None
    name = choice.function.name
    check_named_choice(name, names, "tool_choice")
    return tuple(offered), "function", name


def _chat_message(index: int, message: Any) -> ChatMessage:
    role = _ROLE_ALIASES.get(message.role)
    if role is None:
        raise InvalidRequestError(
            f"unsupported role {message.role!r}; use system, developer, user, assistant or tool",
            param=f"messages[{index}].role",
        )
    tool_calls: tuple[ToolCall, ...] = ()
    if message.tool_calls:
        if role != "assistant":
            raise InvalidRequestError(
                "only assistant messages carry tool_calls", param=f"messages[{index}].tool_calls"
            )
        tool_calls = tuple(
            ToolCall(id=call.id, name=call.function.name, arguments=call.function.arguments)
            for call in message.tool_calls
        )
    if role == "tool" and not message.tool_call_id:
        raise InvalidRequestError(
            "a tool message needs the tool_call_id of the call it answers", param=f"messages[{index}].tool_call_id"
        )
    content = message.content
    if content is None:
        if role != "assistant":
            raise InvalidRequestError(
                f"a {message.role} message needs content", param=f"messages[{index}].content"
            )
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        texts: list[str] = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise UnsupportedParameterError(
                    f"content part type {part.type!r} is not supported; only text parts are",
                    param=f"messages[{index}].content",
                )
            texts.append(part.text)
        text = "\n".join(texts)
    return ChatMessage(
        role=role,
        content=text,
        name=message.name,
        tool_calls=tool_calls,
        tool_call_id=message.tool_call_id if role == "tool" else None,
    )


def _prompts(prompt: str | list[Any]) -> list[str | tuple[int, ...]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, int) for p in prompt):
        return [_token_ids(prompt, "prompt")]
    if all(isinstance(p, list) for p in prompt):
        return [_token_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    raise InvalidRequestError(
        "prompt must be a string, a list of strings, a list of token ids or a list of "
        "token-id lists",
        param="prompt",
    )


def _token_ids(ids: Sequence[int], param: str) -> tuple[int, ...]:
    if not ids:
        raise InvalidRequestError("a token-id prompt must not be empty", param=param)
    if any(token_id < 0 for token_id in ids):
        raise InvalidRequestError("token ids must be >= 0", param=param)
    return tuple(ids)


def _choice_count(n: int | None, num_prompts: int, limits: LimitsConfig) -> int:
    n = 1 if n is None else n
    if n > limits.max_n:
        raise InvalidRequestError(f"n must be at most {limits.max_n}", param="n")
    if n * num_prompts > limits.max_choices:
        raise InvalidRequestError(
            f"n times the number of prompts must be at most {limits.max_choices}",
            param="n" if num_prompts == 1 else "prompt",
        )
    return n


def _check_max_tokens(max_tokens: int | None, limits: LimitsConfig, param: str) -> None:
    if max_tokens is not None and max_tokens > limits.max_output_tokens:
        raise InvalidRequestError(
            f"{param} must be at most {limits.max_output_tokens} on this server", param=param
        )


def _check_top_logprobs(value: int, limits: LimitsConfig, param: str) -> None:
    if value > limits.max_top_logprobs:
        raise InvalidRequestError(f"{param} must be at most {limits.max_top_logprobs}", param=param)


def _check_stream_options(stream: bool | None, has_options: bool) -> None:
    if has_options and not stream:
        raise InvalidRequestError(
            "stream_options is only allowed when stream is true", param="stream_options"
        )


def _stop(stop: str | list[str] | None, limits: LimitsConfig) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > limits.max_stop_sequences:
        raise InvalidRequestError(
            f"at most {limits.max_stop_sequences} stop sequences are allowed", param="stop"
        )
    for s in stops:
        if not s:
            raise InvalidRequestError("stop sequences must not be empty", param="stop")
        if len(s) > limits.max_stop_chars:
            raise InvalidRequestError(
                f"a stop sequence may have at most {limits.max_stop_chars} characters",
                param="stop",
            )
    return tuple(stops)


def _sampling_params(
    body: ChatCompletionRequest | CompletionRequest,
    *,
    max_tokens: int | None,
    logprobs: bool,
    top_logprobs: int,
    echo: bool,
    limits: LimitsConfig,
) -> SamplingParams:
    top_k = body.top_k
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        # vLLM clients send -1 (older) or 0 (newer) for "disabled".
        top_k=None if top_k is None or top_k <= 0 else top_k,
        min_p=0.0 if body.min_p is None else body.min_p,
        seed=body.seed,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        stop=_stop(body.stop, limits),
        ignore_eos=bool(body.ignore_eos),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        echo=echo,
    )
