"""Backend chunks -> the Responses API's wire output: the response object, or its typed
event stream (``response.created`` ... ``response.completed``), and the stored response.

Output items are numbered in the order they start: the message when the first text
arrives, each function call when its first delta does (so a tool-only answer has no empty
message before its calls). The response is stored by :meth:`ResponseOutput.persist`, which
the serving code awaits once the body or last frames are built and before they are sent.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import msgspec

from backends.base import GenerationChunk
from gateway.openai.response_store import StoredResponses
from gateway.openai.schemas import (
    FunctionCallItem,
    OutputMessage,
    OutputText,
    ResponseIncompleteDetails,
    ResponseObject,
    ResponseRequest,
    ResponseUsage,
    UsageInfo,
)
from gateway.openai.usage import usage_info
from gateway.serving.choices import ChoiceRun

__all__ = ["ResponseOutput"]

_encoder = msgspec.json.Encoder()


class _Call:
    """One function call being assembled from its deltas."""

    __slots__ = ("item_id", "call_id", "name", "arguments", "output_index")

    def __init__(self, output_index: int) -> None:
        self.item_id = f"fc_{secrets.token_hex(16)}"
        self.call_id = ""
        self.name = ""
        self.arguments: list[str] = []
        self.output_index = output_index

    def item(self, status: str) -> FunctionCallItem:
        return FunctionCallItem(
            id=self.item_id,
            call_id=self.call_id,
            name=self.name,
            arguments="".join(self.arguments),
            status=status,  # type: ignore[arg-type]
        )


class ResponseOutput:
    """Accumulates one response's text and function calls; builds the response object or
    its events, and stores the response (with ``store``) when it has ended.

    Output items are numbered in the order they start: the message when the first text
    arrives, each function call when its first delta does.
    """

    def __init__(
        self,
        *,
        data: ResponseRequest,
        conversation: list[dict[str, Any]],
        store: StoredResponses | None,
        api_key_id: str | None,
        tenant: str | None = None,
    ) -> None:
        self.data = data
        self.response_id = f"resp_{secrets.token_hex(16)}"
        self.item_id = f"msg_{secrets.token_hex(16)}"
        self.created_at = int(time.time())
        self.conversation = conversation
        self.store = store
        self.api_key_id = api_key_id
        self.tenant = tenant
        self._texts: list[str] = []
        self._message_index: int | None = None
        self._calls: dict[int, _Call] = {}
        self._num_items = 0
        self._finish_reason: str | None = None
        self._sequence = 0
        #: What :meth:`persist` stores: the final body and the conversation it ends.
        self._to_store: tuple[bytes, list[dict[str, Any]]] | None = None

    # -- the response object ----------------------------------------------------------

    def _response(
        self, status: str, output: list[OutputMessage | FunctionCallItem], usage: UsageInfo | None
    ) -> ResponseObject:
        data = self.data
        fmt = data.text.format if data.text is not None else None
        tool_choice = data.tool_choice if data.tool_choice is not None else "auto"
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
            parallel_tool_calls=data.parallel_tool_calls is not False,
            tool_choice=msgspec.to_builtins(tool_choice),
            tools=[msgspec.to_builtins(t) for t in data.tools or ()],
            user=data.user,
        )

    def _items(self, status: str) -> list[OutputMessage | FunctionCallItem]:
        if self._message_index is None and not self._calls:
            self._message_index = self._next_index()  # an empty answer is an empty message
        placed: list[tuple[int, OutputMessage | FunctionCallItem]] = []
        if self._message_index is not None:
            placed.append((self._message_index, self._message(status)))
        placed += [(call.output_index, call.item(status)) for call in self._calls.values()]
        return [item for _, item in sorted(placed, key=lambda pair: pair[0])]

    def _final(self, usage: UsageInfo) -> ResponseObject:
        status = "incomplete" if self._finish_reason == "length" else "completed"
        response = self._response(status, self._items(status), usage)
        if self.store is not None and self.data.store is not False:
            turn: dict[str, Any] = {"role": "assistant", "content": "".join(self._texts)}
            if self._calls:
                turn["tool_calls"] = [
                    {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": "".join(c.arguments)}}
                    for c in self._calls.values()
                ]
            self._to_store = (_encoder.encode(response), [*self.conversation, turn])
        return response

    async def persist(self) -> None:
        """Store the ended response (with ``store``), on the store's worker threads."""
        if self.store is not None and self._to_store is not None:
            body, conversation = self._to_store
            await self.store.put(self.response_id, self.api_key_id, body, conversation, self.tenant)

    def _message(self, status: str, *, with_text: bool = True) -> OutputMessage:
        content = [OutputText(text="".join(self._texts))] if with_text else []
        return OutputMessage(id=self.item_id, status=status, content=content)  # type: ignore[arg-type]

    def _next_index(self) -> int:
        self._num_items += 1
        return self._num_items - 1

    # -- OutputBuilder ----------------------------------------------------------------

    def add(self, position: int, chunk: GenerationChunk) -> None:
        self._take(chunk)

    def _take(self, chunk: GenerationChunk) -> list[bytes]:
        """Record ``chunk``; the stream events it makes."""
        frames: list[bytes] = []
        if chunk.text:
            if self._message_index is None:
                self._message_index = self._next_index()
                frames += self._message_opened()
            self._texts.append(chunk.text)
            frames.append(self._event("response.output_text.delta", **self._part_fields(), delta=chunk.text, logprobs=[]))
        for delta in chunk.tool_calls:
            call = self._calls.get(delta.index)
            if call is None:
                call = self._calls[delta.index] = _Call(self._next_index())
                call.call_id = delta.id or f"call_{secrets.token_hex(12)}"
                call.name = delta.name or ""
                frames.append(self._event("response.output_item.added", output_index=call.output_index, item=call.item("in_progress")))
            if delta.arguments:
                call.arguments.append(delta.arguments)
                frames.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=call.item_id,
                        output_index=call.output_index,
                        delta=delta.arguments,
                    )
                )
        if chunk.finish_reason is not None:
            self._finish_reason = chunk.finish_reason
        return frames

    def body(self, run: ChoiceRun) -> ResponseObject:
        return self._final(usage_info(run.total_usage()))

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encoder.encode(payload) + b"\n\n"

    def _part_fields(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": self._message_index, "content_index": 0}

    def _message_opened(self) -> list[bytes]:
        return [
            self._event(
                "response.output_item.added",
                output_index=self._message_index,
                item=self._message("in_progress", with_text=False),
            ),
            self._event("response.content_part.added", **self._part_fields(), part=OutputText(text="")),
        ]

    def start_frames(self) -> bytes:
        pending = self._response("in_progress", [], None)
        return self._event("response.created", response=pending) + self._event(
            "response.in_progress", response=pending
        )

    def chunk_frames(self, position: int, chunk: GenerationChunk) -> bytes:
        return b"".join(self._take(chunk))

    def end_frames(self, usage: UsageInfo) -> bytes:
        opened_message = self._message_index is not None
        response = self._final(usage)
        frames: list[bytes] = []
        if not opened_message and self._message_index is not None:  # an empty answer
            frames += self._message_opened()
        for index, item in enumerate(response.output):
            if isinstance(item, OutputMessage):
                part = item.content[0]
                frames.append(self._event("response.output_text.done", **self._part_fields(), text=part.text, logprobs=[]))
                frames.append(self._event("response.content_part.done", **self._part_fields(), part=part))
            else:
                frames.append(
                    self._event(
                        "response.function_call_arguments.done",
                        item_id=item.id,
                        output_index=index,
                        arguments=item.arguments,
                    )
                )
            frames.append(self._event("response.output_item.done", output_index=index, item=item))
        kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
        frames.append(self._event(kind, response=response))
        return b"".join(frames)
