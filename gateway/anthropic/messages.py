"""``POST /v1/messages``: Anthropic's Messages API on the chat-completions path.

A Messages body becomes one chat :class:`~backends.base.GenerationRequest`: ``system`` the
system turn, ``tool_use`` blocks the assistant turn's ``tool_calls``, ``tool_result`` blocks
``role = "tool"`` turns, ``tools`` / ``tool_choice`` (``auto``, ``any`` -> ``required``,
``tool`` -> a named function, ``none``) and ``thinking.budget_tokens`` (the thinking budget)
the same fields chat has, so every backend serves it as it serves chat - tool grammar,
parsers, router, plugins, limits, traces and ledger included.

The answer is Anthropic's: one body (``content`` blocks ``thinking``, ``text``,
``tool_use``), or the event stream ``message_start``, ``ping``, ``content_block_start`` /
``content_block_delta`` (``text_delta``, ``thinking_delta``, ``input_json_delta``) /
``content_block_stop`` per block, ``message_delta`` with ``stop_reason``, ``stop_sequence``
and usage, and ``message_stop``; errors in Anthropic's envelope (gateway/anthropic/errors.py).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from backends.base import (
    ChatMessage,
    GenerationChunk,
    GenerationRequest,
    PrefixPin,
    SamplingParams,
    ToolCall,
)
from backends.errors import InvalidRequestError
from gateway.anthropic.errors import anthropic_error_frame
from gateway.anthropic.schemas import (
    CacheControl,
    Message,
    MessagesRequest,
    TextBlock,
    TextBlockParam,
    ThinkingBlock,
    ThinkingBlockParam,
    ToolResultBlockParam,
    ToolUseBlock,
    ToolUseBlockParam,
    Usage,
)
from gateway.http.endpoint import GenerationEndpoint
from gateway.http.respond import Generation
from gateway.openai.request_conversion import RequestContext
from gateway.openai.schemas import UsageInfo
from gateway.openai.tools import OfferedTool, check_named_choice, check_tools
from gateway.openai.usage import usage_info
from gateway.serving.choices import ChoiceRun

__all__ = ["MESSAGES", "messages_generation_request"]

_TTL_S = {"5m": 300.0, "1h": 3600.0}
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_encoder = msgspec.json.Encoder()


def _system_text(system: str | list[TextBlockParam] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system
    return "\n".join(block.text for block in system)


def _turns(index: int, role: str, content: Any) -> list[ChatMessage]:
    """One Messages turn as chat turns (tool results first, as Anthropic orders them)."""
    if isinstance(content, str):
        return [ChatMessage(role=role, content=content)]
    texts: list[str] = []
    calls: list[ToolCall] = []
    results: list[ChatMessage] = []
    for j, block in enumerate(content):
        param = f"messages[{index}].content[{j}]"
        if isinstance(block, TextBlockParam):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlockParam):
            if role != "assistant":
                raise InvalidRequestError("tool_use blocks belong to assistant turns", param=param)
            calls.append(ToolCall(id=block.id, name=block.name, arguments=json.dumps(block.input, ensure_ascii=False)))
        elif isinstance(block, ToolResultBlockParam):
            if role != "user":
                raise InvalidRequestError("tool_result blocks belong to user turns", param=param)
            result = block.content
            text = result if isinstance(result, str) else "\n".join(b.text for b in result or ())
            if block.is_error:
                text = f"Error: {text}"
            results.append(ChatMessage(role="tool", content=text, tool_call_id=block.tool_use_id))
        elif isinstance(block, ThinkingBlockParam):
            continue  # earlier thinking is not shown to the model again
    turns = results
    if role == "assistant":
        turns.append(ChatMessage(role="assistant", content="\n".join(texts), tool_calls=tuple(calls)))
    elif texts or not results:
        turns.append(ChatMessage(role="user", content="\n".join(texts)))
    return turns


def _tools(body: MessagesRequest, context: RequestContext) -> dict[str, Any]:
    tools = body.tools or []
    names = check_tools(
        [OfferedTool(t.name, t.input_schema, f"tools[{i}].name", f"tools[{i}].input_schema") for i, t in enumerate(tools)],
        context.limits,
    )
    offered = []
    for tool in tools:
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        offered.append({"type": "function", "function": function})
    choice = body.tool_choice
    fields: dict[str, Any] = {"tools": tuple(offered), "tool_choice": "auto" if offered else "none"}
    if choice is None:
        return fields
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    if choice.type == "tool":
        check_named_choice(choice.name, names, "tool_choice.name")
        fields.update(tool_choice="function", tool_function=choice.name)
    elif choice.type == "any":
        if not offered:
            raise InvalidRequestError("tool_choice 'any' needs tools", param="tool_choice")
        fields["tool_choice"] = "required"
    else:
        fields["tool_choice"] = choice.type
    return fields


def messages_generation_request(body: MessagesRequest, context: RequestContext) -> GenerationRequest:
    """The one chat request a Messages body is."""
    limits = context.limits
    if not body.model.strip():
        raise InvalidRequestError("model must name a model (see GET /v1/models)", param="model")
    if len(body.messages) > limits.max_messages:
        raise InvalidRequestError(f"at most {limits.max_messages} messages are allowed per request", param="messages")
    if body.max_tokens > limits.max_output_tokens:
        raise InvalidRequestError(f"max_tokens must be at most {limits.max_output_tokens} on this server",
                                  param="max_tokens")
    stops = body.stop_sequences or []
    if len(stops) > limits.max_stop_sequences or any(not s or len(s) > limits.max_stop_chars for s in stops):
        raise InvalidRequestError(
            f"at most {limits.max_stop_sequences} non-empty stop sequences of at most {limits.max_stop_chars} "
            "characters are allowed", param="stop_sequences",
        )
    messages: list[ChatMessage] = []
    # cache_control breakpoints: the prefix through the marked block's turn stays cached.
    pins: dict[int, float] = {}

    def mark(control: CacheControl | None) -> None:
        if control is not None:
            ttl = _TTL_S[control.ttl or "5m"]
            pins[len(messages)] = max(ttl, pins.get(len(messages), 0.0))

    for tool in body.tools or ():
        mark(tool.cache_control)
    system = _system_text(body.system)
    if system:
        messages.append(ChatMessage(role="system", content=system))
        for system_block in body.system if isinstance(body.system, list) else ():
            mark(system_block.cache_control)
    for i, message in enumerate(body.messages):
        messages.extend(_turns(i, message.role, message.content))
        for block in message.content if isinstance(message.content, list) else ():
            if not isinstance(block, ThinkingBlockParam):
                mark(block.cache_control)
    mark(body.cache_control)
    budget = None
    if body.thinking is not None:
        budget = (body.thinking.budget_tokens or 0) if body.thinking.type == "enabled" else 0
    params = SamplingParams(
        max_tokens=body.max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or None,
        stop=tuple(stops),
    )
    return GenerationRequest(
        request_id=context.request_id,
        model=body.model,
        kind="chat",
        messages=tuple(messages),
        params=params,
        stream=bool(body.stream),
        user=body.metadata.user_id if body.metadata is not None else None,
        reasoning_budget=budget,
        max_reasoning_tokens=budget,
        prefix_pins=tuple(PrefixPin(num_messages=n, ttl_s=ttl) for n, ttl in sorted(pins.items())),
        traceparent=context.traceparent,
        labels=dict(context.labels),
        cache_salt=context.cache_salt(None),
        **_tools(body, context),
    )


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _encoder.encode({"type": kind, **payload}) + b"\n\n"


class MessagesOutput:
    """Accumulates the answer; builds the Message or the event stream (one choice)."""

    def __init__(self, *, message_id: str, model: str) -> None:
        self.message_id = message_id
        self.model = model
        self._thinking: list[str] = []
        self._text: list[str] = []
        #: Tool calls by index: [id, name, argument fragments...].
        self._calls: dict[int, list[str]] = {}
        self._finish: str | None = None
        #: The stop string that ended the answer (``stop_reason: "stop_sequence"``), if one did.
        self._stop_sequence: str | None = None
        # The stream's open block: its index and kind ("thinking", "text", "tool_use").
        self._block: tuple[int, str] | None = None
        self._num_blocks = 0

    # -- one body -------------------------------------------------------------------------

    def add(self, position: int, chunk: GenerationChunk) -> None:
        if chunk.reasoning:
            self._thinking.append(chunk.reasoning)
        if chunk.text:
            self._text.append(chunk.text)
        for delta in chunk.tool_calls:
            self._calls.setdefault(delta.index, [delta.id or "", delta.name or ""]).append(delta.arguments)
        if chunk.stop_sequence is not None:
            self._stop_sequence = chunk.stop_sequence

    def body(self, run: ChoiceRun) -> Message:
        content: list[TextBlock | ThinkingBlock | ToolUseBlock] = []
        if self._thinking:
            content.append(ThinkingBlock(thinking="".join(self._thinking)))
        if self._text or not self._calls:
            content.append(TextBlock(text="".join(self._text)))
        for _, call in sorted(self._calls.items()):
            arguments = "".join(call[2:])
            try:
                value = json.loads(arguments) if arguments else {}
            except ValueError:
                value = {"_raw": arguments}  # a call cut by max_tokens
            content.append(ToolUseBlock(id=call[0], name=call[1], input=value))
        finish = run.choices[0].finish_reason if run.choices else None
        stop_reason, stop_sequence = self._stop(finish)
        return Message(
            id=self.message_id,
            model=self.model,
            content=content,
            stop_reason=stop_reason,
            stop_sequence=stop_sequence,
            usage=_usage(usage_info(run.total_usage())),
        )

    # -- stream events --------------------------------------------------------------------

    def start_frames(self) -> bytes:
        start = Message(
            id=self.message_id, model=self.model, content=[], stop_reason=None,
            usage=Usage(input_tokens=0, output_tokens=0),  # known at the end: message_delta has them
        )
        return _event("message_start", {"message": msgspec.to_builtins(start)}) + _event("ping", {})

    def _open(self, kind: str, block: dict[str, Any]) -> bytes:
        frames = self._close()
        index = self._num_blocks
        self._num_blocks += 1
        self._block = (index, kind)
        return frames + _event("content_block_start", {"index": index, "content_block": block})

    def _close(self) -> bytes:
        if self._block is None:
            return b""
        index, _ = self._block
        self._block = None
        return _event("content_block_stop", {"index": index})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        assert self._block is not None
        return _event("content_block_delta", {"index": self._block[0], "delta": delta})

    def chunk_frames(self, position: int, chunk: GenerationChunk) -> bytes:
        frames = b""
        if chunk.reasoning:
            if self._block is None or self._block[1] != "thinking":
                frames += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            frames += self._delta({"type": "thinking_delta", "thinking": chunk.reasoning})
        if chunk.text:
            if self._block is None or self._block[1] != "text":
                frames += self._open("text", {"type": "text", "text": ""})
            frames += self._delta({"type": "text_delta", "text": chunk.text})
        for delta in chunk.tool_calls:
            if delta.id is not None:
                frames += self._open(
                    "tool_use", {"type": "tool_use", "id": delta.id, "name": delta.name or "", "input": {}}
                )
            if delta.arguments and self._block is not None and self._block[1] == "tool_use":
                frames += self._delta({"type": "input_json_delta", "partial_json": delta.arguments})
        if chunk.finish_reason is not None:
            self._finish = chunk.finish_reason
        if chunk.stop_sequence is not None:
            self._stop_sequence = chunk.stop_sequence
        return frames

    def end_frames(self, usage: UsageInfo) -> bytes:
        frames = b""
        if self._num_blocks == 0:  # an empty answer still has its (empty) text block
            frames += self._open("text", {"type": "text", "text": ""})
        frames += self._close()
        stop_reason, stop_sequence = self._stop(self._finish)
        frames += _event(
            "message_delta",
            {
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": msgspec.to_builtins(_usage(usage)),
            },
        )
        return frames + _event("message_stop", {})

    def _stop(self, finish: str | None) -> tuple[str, str | None]:
        """``stop_reason`` and ``stop_sequence``: the matched stop string where one ended the
        answer (a tool call the answer made still ends it with ``tool_use``)."""
        if (finish or "stop") == "stop" and self._stop_sequence is not None:
            return "stop_sequence", self._stop_sequence
        return _STOP_REASONS.get(finish or "stop", "end_turn"), None


def _usage(usage: UsageInfo) -> Usage:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details is not None else None
    return Usage(
        input_tokens=usage.prompt_tokens - (cached or 0),
        output_tokens=usage.completion_tokens,
        cache_read_input_tokens=cached,
        cache_creation_input_tokens=None if cached is None else 0,
    )


def _prepare(data: MessagesRequest, context: RequestContext) -> Generation:
    request = messages_generation_request(data, context)
    output = MessagesOutput(message_id=f"msg_{context.request_id}", model=data.model)
    return Generation([request], output, 1, bool(data.stream), done_frame=b"", error_frame=anthropic_error_frame)


#: Anthropic's Messages API, streamed (SSE events) or in one body.
MESSAGES = GenerationEndpoint(
    path="/v1/messages",
    operation_id="V1MessagesCreateMessage",
    summary="Create a message (Anthropic Messages API)",
    description="Anthropic-compatible: the official `anthropic` client works against it. Errors come in "
    "Anthropic's envelope. Served by the same backends as chat completions.",
    body_type=MessagesRequest,
    response_type=Message,
    prepare=_prepare,
)
