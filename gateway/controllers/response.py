"""The Responses API: ``POST /v1/responses`` (served by gateway/generation_endpoint.py),
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
conversation go to the :class:`~gateway.response_store.ResponseStore`, keyed on the API key.
Function tools are not served here yet: ``tools`` is a 400 naming it.
"""

from __future__ import annotations

import secrets
import time
from typing import Annotated, Any

import msgspec
from litestar import Controller, Request, delete, get
from litestar.di import NamedDependency
from litestar.params import Parameter

from backends.base import GenerationChunk
from backends.errors import (
    InfermuxError,
    InvalidRequestError,
    NotFoundError,
    UnsupportedParameterError,
)
from gateway.auth import api_key_guard, api_key_of
from gateway.choice_run import ChoiceRun
from gateway.generation_endpoint import GenerationEndpoint
from gateway.generation_response import Generation
from gateway.request_conversion import RequestContext, chat_generation_requests
from gateway.response_store import ResponseStore
from gateway.schemas import (
    ChatCompletionRequest,
    ChatMessageParam,
    OutputMessage,
    OutputText,
    ResponseDeleted,
    ResponseIncompleteDetails,
    ResponseObject,
    ResponseRequest,
    ResponseStreamEvent,
    ResponseUsage,
    UsageInfo,
)
from gateway.state import GatewayState

__all__ = ["ResponseController", "ResponseOutput", "responses_endpoint"]

_ROLES = frozenset({"user", "assistant", "system", "developer"})
_TEXT_PARTS = frozenset({"input_text", "output_text"})
_encoder = msgspec.json.Encoder()


def _input_messages(value: str | list[Any]) -> list[dict[str, Any]]:
    """``input`` as chat messages (400 naming ``input[i]...``)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        raise InvalidRequestError("input must not be empty", param="input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        if item.type not in (None, "message"):
            raise UnsupportedParameterError(
                f"input items of type {item.type!r} are not supported; send messages",
                param=f"input[{i}].type",
            )
        if item.role not in _ROLES:
            raise InvalidRequestError(
                f"unsupported role {item.role!r}; use user, assistant, system or developer",
                param=f"input[{i}].role",
            )
        content = item.content
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
    if param.startswith("response_format"):
        return "text.format" + param.removeprefix("response_format").removeprefix(".json_schema")
    return {"max_completion_tokens": "max_output_tokens"}.get(param, param)


class ResponseOutput:
    """Accumulates the text of one response; builds the response object or its events, and
    stores the response (with ``store``) when it has ended."""

    #: The stream ends with ``response.completed``, no ``data: [DONE]``.
    sends_done = False

    def __init__(
        self,
        *,
        data: ResponseRequest,
        conversation: list[dict[str, Any]],
        store: ResponseStore | None,
        api_key_id: str | None,
    ) -> None:
        self.data = data
        self.response_id = f"resp_{secrets.token_hex(16)}"
        self.item_id = f"msg_{secrets.token_hex(16)}"
        self.created_at = int(time.time())
        self.conversation = conversation
        self.store = store
        self.api_key_id = api_key_id
        self._texts: list[str] = []
        self._finish_reason: str | None = None
        self._sequence = 0

    # -- the response object ----------------------------------------------------------

    def _response(self, status: str, output: list[OutputMessage], usage: UsageInfo | None) -> ResponseObject:
        data = self.data
        fmt = data.text.format if data.text is not None else None
        return ResponseObject(
            id=self.response_id,
            created_at=self.created_at,
            status=status,  # type: ignore[arg-type]
            model=data.model,
            output=output,
            usage=None
            if usage is None
            else ResponseUsage(
                input_tokens=usage.prompt_tokens,
                input_tokens_details={
                    "cached_tokens": usage.prompt_tokens_details.cached_tokens
                    if usage.prompt_tokens_details is not None
                    else 0
                },
                output_tokens=usage.completion_tokens,
                output_tokens_details={"reasoning_tokens": 0},
                total_tokens=usage.prompt_tokens + usage.completion_tokens,
            ),
            instructions=data.instructions,
            max_output_tokens=data.max_output_tokens,
            temperature=data.temperature,
            top_p=data.top_p,
            previous_response_id=data.previous_response_id,
            store=data.store is not False,
            text={"format": msgspec.to_builtins(fmt) if fmt is not None else {"type": "text"}},
            metadata=data.metadata or {},
            incomplete_details=ResponseIncompleteDetails(reason="max_output_tokens")
            if status == "incomplete"
            else None,
            user=data.user,
        )

    def _final(self, usage: UsageInfo) -> ResponseObject:
        status = "incomplete" if self._finish_reason == "length" else "completed"
        message = self._message(status)
        response = self._response(status, [message], usage)
        if self.store is not None and self.data.store is not False:
            text = "".join(self._texts)
            self.store.put(
                self.response_id,
                self.api_key_id,
                _encoder.encode(response),
                [*self.conversation, {"role": "assistant", "content": text}],
            )
        return response

    def _message(self, status: str, *, with_text: bool = True) -> OutputMessage:
        content = [OutputText(text="".join(self._texts))] if with_text else []
        return OutputMessage(id=self.item_id, status=status, content=content)  # type: ignore[arg-type]

    # -- OutputBuilder ----------------------------------------------------------------

    def add(self, position: int, chunk: GenerationChunk) -> None:
        if chunk.text:
            self._texts.append(chunk.text)
        if chunk.finish_reason is not None:
            self._finish_reason = chunk.finish_reason

    def body(self, run: ChoiceRun) -> ResponseObject:
        return self._final(run.total_usage())

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encoder.encode(payload) + b"\n\n"

    def _part_fields(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

    def start_frames(self) -> bytes:
        pending = self._response("in_progress", [], None)
        return b"".join(
            (
                self._event("response.created", response=pending),
                self._event("response.in_progress", response=pending),
                self._event(
                    "response.output_item.added",
                    output_index=0,
                    item=self._message("in_progress", with_text=False),
                ),
                self._event("response.content_part.added", **self._part_fields(), part=OutputText(text="")),
            )
        )

    def chunk_frames(self, position: int, chunk: GenerationChunk) -> bytes:
        self.add(position, chunk)
        if not chunk.text:
            return b""
        return self._event("response.output_text.delta", **self._part_fields(), delta=chunk.text, logprobs=[])

    def end_frames(self, usage: UsageInfo) -> bytes:
        response = self._final(usage)
        message = response.output[0]
        part = message.content[0]
        return b"".join(
            (
                self._event("response.output_text.done", **self._part_fields(), text=part.text, logprobs=[]),
                self._event("response.content_part.done", **self._part_fields(), part=part),
                self._event("response.output_item.done", output_index=0, item=message),
                self._event(
                    "response.incomplete" if response.status == "incomplete" else "response.completed",
                    response=response,
                ),
            )
        )


def responses_endpoint(store: ResponseStore) -> GenerationEndpoint[ResponseRequest]:
    """``POST /v1/responses`` for one app, storing in ``store``."""

    def prepare(data: ResponseRequest, context: RequestContext) -> Generation:
        if data.tools:
            raise UnsupportedParameterError(
                "function tools are not supported on /v1/responses yet (use /v1/chat/completions)",
                param="tools",
            )
        conversation: list[dict[str, Any]] = []
        if data.previous_response_id is not None:
            previous = store.get(data.previous_response_id, context.api_key_id)
            if previous is None:
                raise NotFoundError(
                    f"no stored response {data.previous_response_id!r}", param="previous_response_id"
                )
            conversation = list(previous.conversation)
        conversation += _input_messages(data.input)
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
        )
        try:
            requests = chat_generation_requests(chat, context)
        except InfermuxError as exc:
            exc.param = _param(exc.param)
            raise
        output = ResponseOutput(
            data=data, conversation=conversation, store=store, api_key_id=context.api_key_id
        )
        return Generation(requests, output, 1, bool(data.stream))

    return GenerationEndpoint(
        path="/v1/responses",
        operation_id="V1ResponsesCreateResponse",
        summary="Create a response",
        description="OpenAI Responses API, text only: `input` (string or messages), "
        "`instructions`, `max_output_tokens`, `temperature`, `top_p`, `text.format` "
        "(json_schema, json_object), `stream` (typed events), `store` and "
        "`previous_response_id`. `tools` is refused (400) for now.",
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
        stored = gateway.response_store.get(response_id, _key_id(request))
        if stored is None:
            raise NotFoundError(f"no stored response {response_id!r}", param="response_id")
        return msgspec.json.decode(stored.body, type=ResponseObject)

    @delete("/{response_id:str}", status_code=200, summary="Delete a stored response")
    async def delete_response(
        self, request: Request[Any, Any, Any], gateway: NamedDependency[GatewayState], response_id: ResponseId
    ) -> ResponseDeleted:
        if not gateway.response_store.delete(response_id, _key_id(request)):
            raise NotFoundError(f"no stored response {response_id!r}", param="response_id")
        return ResponseDeleted(id=response_id)


def _key_id(request: Request[Any, Any, Any]) -> str | None:
    key = api_key_of(request)
    return key.id if key is not None else None
