"""Backend chunks -> text completion wire output (one body, or SSE frames).

Logprobs use OpenAI's legacy parallel-list shape (``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``). With ``echo`` the prompt comes first, its tokens
included; the first prompt token has ``null`` logprob and alternatives (nothing predicts
it). ``text_offset`` counts characters from the start of the returned text.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from backends.base import GenerationChunk, TokenLogprob
from gateway.openai.schemas import (
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    UsageInfo,
)
from gateway.openai.sse import data_frame
from gateway.openai.usage import usage_info
from gateway.serving.choices import ChoiceRun

__all__ = ["CompletionOutput"]


class _LegacyLogprobs:
    """Parallel lists for one choice, with the running character offset."""

    __slots__ = ("tokens", "token_logprobs", "top_logprobs", "text_offset", "offset")

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []
        self.offset = 0

    def extend(self, entries: Sequence[TokenLogprob], top: int) -> None:
        for entry in entries:
            self.tokens.append(entry.token)
            self.token_logprobs.append(entry.logprob)
            self.top_logprobs.append(
                None
                if entry.logprob is None
                else {alt.token: alt.logprob for alt in entry.top_logprobs[:top]}
            )
            self.text_offset.append(
                entry.text_offset if entry.text_offset is not None else self.offset
            )
            self.offset += len(entry.token)

    def struct(self) -> CompletionLogprobs:
        return CompletionLogprobs(
            tokens=self.tokens,
            token_logprobs=self.token_logprobs,
            top_logprobs=self.top_logprobs,
            text_offset=self.text_offset,
        )


class CompletionOutput:
    """Accumulates one completions request's output; builds the body or the stream frames."""

    def __init__(
        self,
        *,
        response_id: str,
        created: int,
        model: str,
        num_choices: int,
        logprobs: int | None,
        include_usage: bool,
    ) -> None:
        self.response_id = response_id
        self.created = created
        self.model = model
        self.num_choices = num_choices
        self.logprobs = logprobs
        self.include_usage = include_usage
        self._texts: list[list[str]] = [[] for _ in range(num_choices)]
        self._logprobs = [_LegacyLogprobs() for _ in range(num_choices)]
        self._stop_sequences: list[str | None] = [None] * num_choices

    def _take(self, position: int, chunk: GenerationChunk) -> tuple[str, bool]:
        """Text of this chunk (echoed prompt first) and whether it carried logprobs."""
        text = chunk.text
        if chunk.prompt_text is not None:
            text = chunk.prompt_text + text
        carried = False
        if self.logprobs is not None:
            entries = (chunk.prompt_logprobs or ()) + (chunk.logprobs or ())
            if entries:
                self._logprobs[position].extend(entries, self.logprobs)
                carried = True
        return text, carried

    # -- one body -------------------------------------------------------------------------

    def add(self, position: int, chunk: GenerationChunk) -> None:
        """Keep a chunk for :meth:`body`."""
        text, _ = self._take(position, chunk)
        if text:
            self._texts[position].append(text)
        if chunk.stop_sequence is not None:
            self._stop_sequences[position] = chunk.stop_sequence

    def body(self, run: ChoiceRun) -> Completion:
        """The non-streaming response, after every choice finished."""
        choices = [
            CompletionChoice(
                index=position,
                text="".join(self._texts[position]),
                logprobs=self._logprobs[position].struct() if self.logprobs is not None else None,
                finish_reason=choice.finish_reason or "stop",
                stop_reason=self._stop_sequences[position],
            )
            for position, choice in enumerate(run.choices)
        ]
        return Completion(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage_info(run.total_usage()),
        )

    # -- stream frames --------------------------------------------------------------------

    def start_frames(self) -> bytes:
        """Completions streams have no role delta."""
        return b""

    def chunk_frames(self, position: int, chunk: GenerationChunk) -> bytes:
        """One frame with this chunk's text, logprobs and finish reason (may be empty)."""
        state = self._logprobs[position]
        first = len(state.tokens)
        text, carried = self._take(position, chunk)
        if not text and not carried and chunk.finish_reason is None:
            return b""
        logprobs = None
        if carried:
            logprobs = CompletionLogprobs(
                tokens=state.tokens[first:],
                token_logprobs=state.token_logprobs[first:],
                top_logprobs=state.top_logprobs[first:],
                text_offset=state.text_offset[first:],
            )
        return data_frame(
            CompletionChunk(
                id=self.response_id,
                created=self.created,
                model=self.model,
                choices=[
                    CompletionChoice(
                        index=position,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=chunk.finish_reason,
                        stop_reason=chunk.stop_sequence
                        if chunk.finish_reason is not None
                        else msgspec.UNSET,
                    )
                ],
                usage=None if self.include_usage else msgspec.UNSET,
            )
        )

    def end_frames(self, usage: UsageInfo) -> bytes:
        """The usage chunk (``choices: []``) when ``stream_options.include_usage``."""
        if not self.include_usage:
            return b""
        return data_frame(
            CompletionChunk(
                id=self.response_id,
                created=self.created,
                model=self.model,
                choices=[],
                usage=usage,
            )
        )
