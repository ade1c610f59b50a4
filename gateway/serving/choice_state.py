"""One choice of a request as it runs: its stream, what it produced, how it ended (written by
:class:`~gateway.serving.choices.ChoiceRun`, read by :mod:`gateway.serving.summary`)."""

from __future__ import annotations

import time
from array import array
from typing import TYPE_CHECKING

from backends.base import EnginePhases, GenerationRequest, SpeculationStats, Usage
from backends.errors import InfermuxError

if TYPE_CHECKING:
    from gateway.serving.router import RoutedStream
    from gateway.serving.stream_resume import ResumingStream

__all__ = ["ChoiceState"]


class ChoiceState:
    """One choice: the request the backend saw, its stream, and how it ended."""

    __slots__ = (
        "request",
        "stream",
        "usage",
        "finish_reason",
        "outcome",
        "error",
        "num_streamed_tokens",
        "first_chunk_at",
        "last_output_at",
        "output_gaps",
        "phases",
        "speculation",
        "text_parts",
    )

    def __init__(
        self,
        request: GenerationRequest,
        stream: RoutedStream | ResumingStream,
        *,
        first_chunk_at: float | None = None,
        capture_output: bool = False,
    ) -> None:
        self.request = request
        self.stream = stream
        #: The router returns a stream once its first chunk exists: that moment (monotonic).
        self.first_chunk_at = first_chunk_at if first_chunk_at is not None else time.monotonic()
        self.last_output_at: float | None = None
        #: Seconds between consecutive chunks that carried output (inter-token latency).
        self.output_gaps = array("d")
        #: Engine phases from the backend's last chunk (core engine), for tracing.
        self.phases: EnginePhases | None = None
        #: Speculative decoding figures from the backend's last chunk, for tracing.
        self.speculation: SpeculationStats | None = None
        #: The output text, kept only when content capture is on (tracing record_content).
        self.text_parts: list[str] | None = [] if capture_output else None
        self.usage: Usage | None = None
        self.finish_reason: str | None = None
        #: Output tokens seen so far (token ids, else one per text chunk): partial usage.
        self.num_streamed_tokens = 0
        #: "open" -> "finished" | "failed" | "aborted".
        self.outcome = "open"
        self.error: InfermuxError | None = None

    @property
    def backend_name(self) -> str:
        return self.stream.backend_name

    def usage_so_far(self) -> Usage | None:
        """The backend's usage; else, for a choice that stopped before its backend reported
        one (backends report usage on their last chunk), the output tokens streamed so far
        (prompt tokens 0); None when nothing was streamed. The one partial-usage rule: the
        ``on_error`` hook's usage and the request summary's both."""
        if self.usage is not None:
            return self.usage
        if self.num_streamed_tokens == 0:
            return None
        return Usage(prompt_tokens=0, completion_tokens=self.num_streamed_tokens)
