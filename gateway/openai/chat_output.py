"""Backend chunks -> chat completion wire output (one body, or SSE frames)."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from backends.base import GenerationChunk, TokenLogprob, ToolCallDelta
from gateway.openai.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDeltaItem,
    UsageInfo,
)
from gateway.openai.sse import data_frame
from gateway.openai.usage import usage_info
from gateway.serving.choices import ChoiceRun

__all__ = ["ChatOutput", "chat_logprobs"]

# OpenAI's stand-in for "so unlikely that the value is meaningless".
_UNKNOWN_LOGPROB = -9999.0
_ROLE_DELTA = ChatDelta(role="assistant", content="")
_EMPTY_DELTA = ChatDelta()


def chat_logprobs(entries: Sequence[TokenLogprob], top_logprobs: int) -> ChatLogprobs:
    """``{"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}``."""
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=entry.token,
                logprob=_UNKNOWN_LOGPROB if entry.logprob is None else entry.logprob,
                bytes=entry.bytes if entry.bytes is not None else list(entry.token.encode()),
                top_logprobs=[
                    ChatTopLogprob(
                        token=top.token,
                        logprob=top.logprob,
                        bytes=top.bytes if top.bytes is not None else list(top.token.encode()),
                    )
                    for top in entry.top_logprobs[:top_logprobs]
                ],
            )
            for entry in entries
        ]
    )


def _tool_call_delta(delta: ToolCallDelta) -> ToolCallDeltaItem:
    if delta.id is not None:  # a call's first piece: its id and name
        return ToolCallDeltaItem(
            index=delta.index,
            id=delta.id,
            type="function",
            function=FunctionCallDelta(name=delta.name or "", arguments=delta.arguments),
        )
    return ToolCallDeltaItem(index=delta.index, function=FunctionCallDelta(arguments=delta.arguments))


class ChatOutput:
    """Accumulates one chat request's output; builds the body or the stream frames."""

    def __init__(
        self,
        *,
        response_id: str,
        created: int,
        model: str,
        num_choices: int,
        logprobs: bool,
        top_logprobs: int,
        include_usage: bool,
    ) -> None:
        self.response_id = response_id
        self.created = created
        self.model = model
        self.num_choices = num_choices
        self.logprobs = logprobs
        self.top_logprobs = top_logprobs
        self.include_usage = include_usage
        self._texts: list[list[str]] = [[] for _ in range(num_choices)]
        self._reasoning: list[list[str]] = [[] for _ in range(num_choices)]
        #: Per choice: call index -> [id, name, argument fragments...].
        self._calls: list[dict[int, list[str]]] = [{} for _ in range(num_choices)]
        self._entries: list[list[TokenLogprob]] = [[] for _ in range(num_choices)]
        self._stop_sequences: list[str | None] = [None] * num_choices

    # -- one body -------------------------------------------------------------------------

    def add(self, position: int, chunk: GenerationChunk) -> None:
        """Keep a chunk for :meth:`body`."""
        if chunk.text:
            self._texts[position].append(chunk.text)
        if chunk.reasoning:
            self._reasoning[position].append(chunk.reasoning)
        for delta in chunk.tool_calls:
            call = self._calls[position].setdefault(delta.index, [delta.id or "", delta.name or ""])
            call.append(delta.arguments)
        if self.logprobs and chunk.logprobs:
            self._entries[position].extend(chunk.logprobs)
        if chunk.stop_sequence is not None:
            self._stop_sequences[position] = chunk.stop_sequence

    def body(self, run: ChoiceRun) -> ChatCompletion:
        """The non-streaming response, after every choice finished."""
        choices = [
            ChatChoice(
                index=position,
                message=self._message(position),
                logprobs=chat_logprobs(self._entries[position], self.top_logprobs)
                if self.logprobs
                else None,
                finish_reason=choice.finish_reason or "stop",
                stop_reason=self._stop_sequences[position],
            )
            for position, choice in enumerate(run.choices)
        ]
        return ChatCompletion(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage_info(run.total_usage()),
        )

    def _message(self, position: int) -> ChatResponseMessage:
        text = "".join(self._texts[position])
        calls = self._calls[position]
        reasoning = self._reasoning[position]
        return ChatResponseMessage(
            content=None if calls and not text else text,
            reasoning_content="".join(reasoning) if reasoning else msgspec.UNSET,
            tool_calls=[
                ToolCall(id=call[0], function=FunctionCall(name=call[1], arguments="".join(call[2:])))
                for _, call in sorted(calls.items())
            ]
            if calls
            else msgspec.UNSET,
        )

    # -- stream frames --------------------------------------------------------------------

    def start_frames(self) -> bytes:
        """The role delta of every choice, before any content (as OpenAI sends it)."""
        return b"".join(
            self._frame(ChatChunkChoice(index=position, delta=_ROLE_DELTA))
            for position in range(self.num_choices)
        )

    def chunk_frames(self, position: int, chunk: GenerationChunk) -> bytes:
        """A content delta and/or a finish frame for one backend chunk (may be empty)."""
        frames = b""
        has_logprobs = self.logprobs and bool(chunk.logprobs)
        if chunk.text or chunk.reasoning or chunk.tool_calls or has_logprobs:
            frames += self._frame(
                ChatChunkChoice(
                    index=position,
                    delta=ChatDelta(
                        content=chunk.text if chunk.text or not (chunk.reasoning or chunk.tool_calls) else msgspec.UNSET,
                        reasoning_content=chunk.reasoning or msgspec.UNSET,
                        tool_calls=[_tool_call_delta(d) for d in chunk.tool_calls] if chunk.tool_calls else msgspec.UNSET,
                    ),
                    logprobs=chat_logprobs(chunk.logprobs or (), self.top_logprobs)
                    if has_logprobs
                    else None,
                )
            )
        if chunk.finish_reason is not None:
            frames += self._frame(
                ChatChunkChoice(
                    index=position,
                    delta=_EMPTY_DELTA,
                    finish_reason=chunk.finish_reason,
                    stop_reason=chunk.stop_sequence,
                )
            )
        return frames

    def end_frames(self, usage: UsageInfo) -> bytes:
        """The usage chunk (``choices: []``) when ``stream_options.include_usage``."""
        if not self.include_usage:
            return b""
        return data_frame(
            ChatCompletionChunk(
                id=self.response_id,
                created=self.created,
                model=self.model,
                choices=[],
                usage=usage,
            )
        )

    def _frame(self, choice: ChatChunkChoice) -> bytes:
        return data_frame(
            ChatCompletionChunk(
                id=self.response_id,
                created=self.created,
                model=self.model,
                choices=[choice],
                usage=None if self.include_usage else msgspec.UNSET,
            )
        )
