"""The Responses API: ``POST /v1/responses`` (served by gateway/http/endpoint.py),
``GET`` and ``DELETE /v1/responses/{id}``.

A response is a chat completion underneath: ``input`` (a string or message items), the
stored conversation of ``previous_response_id`` and ``instructions`` (a system message,
not carried over to follow-ups, as OpenAI does) become chat messages; ``max_output_tokens``,
``temperature``, ``top_p`` and ``text.format`` (``json_schema`` / ``json_object``, the
structured outputs of ``response_format``) map to the chat fields, and the chat path's own
conversion checks them. So every backend serves it, through the same admission, plugins,
router, ledger (``kind = "chat"``) and traces as chat. The answer is OpenAI's response
object, or its typed event stream (``response.created`` ... ``response.completed``, each
with its ``sequence_number``). With ``store`` (the default) the response and its
conversation go to the response store (gateway/openai/response_store.py: Postgres shared by
replicas, or the ledger's SQLite file), keyed on the API key; every store call runs on the
store's worker threads, awaited, never on the event loop. A new response is stored before
its body or last frames are sent, so a follow-up on any replica finds it.
Function ``tools`` (and ``tool_choice``, ``parallel_tool_calls``) are chat's tools in
Responses' flat shape; the model's calls are ``function_call`` output items, and a
follow-up sends ``function_call_output`` items back (as chat's ``role = "tool"`` turns).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from litestar import Controller, Request, delete, get
from litestar.di import NamedDependency
from litestar.params import Parameter

from backends.errors import (
    InfermuxError,
    InvalidRequestError,
    NotFoundError,
    UnsupportedParameterError,
)
from gateway.http.auth import api_key_guard, api_key_of
from gateway.http.endpoint import GenerationEndpoint
from gateway.http.errors import invalid_body_error
from gateway.http.respond import Generation
from gateway.openai.request_conversion import RequestContext, chat_generation_requests
from gateway.openai.response_output import ResponseOutput
from gateway.openai.response_store import StoredResponses
from gateway.openai.schemas import (
    ChatCompletionRequest,
    ChatMessageParam,
    FunctionToolChoice,
    NamedToolChoice,
    ResponseDeleted,
    ResponseObject,
    ResponseRequest,
    ResponseStreamEvent,
    ToolParam,
)
from gateway.state import GatewayState

__all__ = ["ResponseController", "responses_endpoint"]

_ROLES = frozenset({"user", "assistant", "system", "developer"})
_TEXT_PARTS = frozenset({"input_text", "output_text"})
_encoder = msgspec.json.Encoder()


def _input_messages(value: str | list[Any]) -> list[dict[str, Any]]:
    """``input`` as chat messages (400 naming ``input[i]...``): messages, the model's
    function calls (consecutive ones become one assistant turn) and their outputs."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        raise InvalidRequestError("input must not be empty", param="input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        if item.type == "function_call":
            if not (item.call_id and item.name and item.arguments is not None):
                raise InvalidRequestError(
                    "a function_call item needs call_id, name and arguments", param=f"input[{i}]"
                )
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            continue
        if item.type == "function_call_output":
            if not item.call_id or item.output is None:
                raise InvalidRequestError(
                    "a function_call_output item needs call_id and output", param=f"input[{i}]"
                )
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
            continue
        if item.type not in (None, "message"):
            raise UnsupportedParameterError(
                f"input items of type {item.type!r} are not supported; send messages, "
                "function_call or function_call_output items",
                param=f"input[{i}].type",
            )
        if item.role not in _ROLES:
            raise InvalidRequestError(
                f"unsupported role {item.role!r}; use user, assistant, system or developer",
                param=f"input[{i}].role",
            )
        content = item.content
        if content is None:
            raise InvalidRequestError("a message needs content", param=f"input[{i}].content")
        if not isinstance(content, str):
            texts: list[str] = []
            for j, part in enumerate(content):
                if part.type not in _TEXT_PARTS or part.text is None:
                    raise UnsupportedParameterError(
                        f"content parts of type {part.type!r} are not supported; only text",
                        param=f"input[{i}].content[{j}]",
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        messages.append({"role": item.role, "content": content})
    return messages


def _chat_tools(data: ResponseRequest) -> tuple[list[dict[str, Any]] | None, Any]:
    """``tools`` and ``tool_choice`` in chat's nesting (``{"function": {...}}``)."""
    tools = None
    if data.tools:
        tools = []
        for i, tool in enumerate(data.tools):
            if tool.type != "function":
                raise UnsupportedParameterError(
                    f"tools of type {tool.type!r} are not supported; only function tools",
                    param=f"tools[{i}].type",
                )
            if not tool.name:
                raise InvalidRequestError("a function tool needs its name", param=f"tools[{i}].name")
            function = {"name": tool.name}
            for key in ("description", "parameters", "strict"):
                if getattr(tool, key) is not None:
                    function[key] = getattr(tool, key)
            tools.append({"type": "function", "function": function})
    choice: Any = data.tool_choice
    if isinstance(choice, FunctionToolChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    return tools, choice


def _response_format(data: ResponseRequest) -> dict[str, Any] | None:
    fmt = data.text.format if data.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema is None:
        raise InvalidRequestError("a json_schema format needs its schema", param="text.format.schema")
    spec: dict[str, Any] = {"name": fmt.name or "response", "schema": fmt.schema}
    if fmt.strict is not None:
        spec["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": spec}


def _param(param: str | None) -> str | None:
    """A chat field's name as the Responses API calls it."""
    if param is None:
        return None
    if param.startswith("messages"):
        return "input"
    if param.startswith("tools[") and ".function" in param:
        return param.replace(".function", "")
    if param.startswith("response_format"):
        return "text.format" + param.removeprefix("response_format").removeprefix(".json_schema")
    return {"max_completion_tokens": "max_output_tokens"}.get(param, param)


def responses_endpoint(store: StoredResponses) -> GenerationEndpoint[ResponseRequest]:
    """``POST /v1/responses`` for one app, storing in ``store``."""

    async def prepare(data: ResponseRequest, context: RequestContext) -> Generation:
        tools, tool_choice = _chat_tools(data)
        conversation: list[dict[str, Any]] = []
        if data.previous_response_id is not None:
            previous = await store.get(data.previous_response_id, context.api_key_id)
            if previous is None:
                raise NotFoundError(
                    f"no stored response {data.previous_response_id!r}", param="previous_response_id"
                )
            conversation = list(previous.conversation)
        conversation += _input_messages(data.input)
        chat_tools = None
        if tools is not None:
            try:
                chat_tools = msgspec.convert(tools, list[ToolParam])
            except msgspec.ValidationError as exc:  # a bad function name: chat's own rule
                where = invalid_body_error(exc).param or ""
                param = "tools" + where.replace(".function", "")
                raise InvalidRequestError(f"invalid value for '{param}': {exc}", param=param) from None
        messages = [{"role": "system", "content": data.instructions}] if data.instructions else []
        messages += conversation
        chat = ChatCompletionRequest(
            model=data.model,
            messages=msgspec.convert(messages, list[ChatMessageParam]),
            max_completion_tokens=data.max_output_tokens,
            temperature=data.temperature,
            top_p=data.top_p,
            response_format=_response_format(data),
            user=data.user,
            stream=data.stream,
            tools=chat_tools,
            tool_choice=msgspec.convert(tool_choice, Literal["none", "auto", "required"] | NamedToolChoice | None),
            parallel_tool_calls=data.parallel_tool_calls,
        )
        try:
            requests = chat_generation_requests(chat, context)
        except InfermuxError as exc:
            exc.param = _param(exc.param)
            raise
        output = ResponseOutput(
            data=data, conversation=conversation, store=store, api_key_id=context.api_key_id,
            tenant=context.tenant,
        )
        # The stream ends with response.completed (or .incomplete): no "data: [DONE]".
        return Generation(requests, output, 1, bool(data.stream), done_frame=b"", persist=output.persist)

    return GenerationEndpoint(
        path="/v1/responses",
        operation_id="V1ResponsesCreateResponse",
        summary="Create a response",
        description="OpenAI Responses API, text only: `input` (string or messages), "
        "`instructions`, `max_output_tokens`, `temperature`, `top_p`, `text.format` "
        "(json_schema, json_object), function `tools` / `tool_choice` (calls as "
        "`function_call` items, answered by `function_call_output` items), `stream` "
        "(typed events), `store` and `previous_response_id`.",
        body_type=ResponseRequest,
        response_type=ResponseObject,
        prepare=prepare,
        stream_type=ResponseStreamEvent,
    )


ResponseId = Annotated[str, Parameter(max_length=256)]


class ResponseController(Controller):
    """Stored responses: read or delete one (the key that created it only)."""

    path = "/v1/responses"
    tags = ["responses"]
    guards = [api_key_guard]

    @get("/{response_id:str}", summary="Retrieve a stored response")
    async def get_response(
        self, request: Request[Any, Any, Any], gateway: NamedDependency[GatewayState], response_id: ResponseId
    ) -> ResponseObject:
        stored = await gateway.response_store.get(response_id, _key_id(request))
        if stored is None:
            raise NotFoundError(f"no stored response {response_id!r}", param="response_id")
        return msgspec.json.decode(stored.body, type=ResponseObject)

    @delete("/{response_id:str}", status_code=200, summary="Delete a stored response")
    async def delete_response(
        self, request: Request[Any, Any, Any], gateway: NamedDependency[GatewayState], response_id: ResponseId
    ) -> ResponseDeleted:
        if not await gateway.response_store.delete(response_id, _key_id(request)):
            raise NotFoundError(f"no stored response {response_id!r}", param="response_id")
        return ResponseDeleted(id=response_id)


def _key_id(request: Request[Any, Any, Any]) -> str | None:
    key = api_key_of(request)
    return key.id if key is not None else None
