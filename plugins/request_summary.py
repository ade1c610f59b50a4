"""What the gateway tells plugins when an HTTP generation request ends.

One :class:`RequestSummary` per HTTP request (``POST /v1/chat/completions`` or
``/v1/completions``), handed to ``infermux_on_request_end`` once the upstream work of every
choice has stopped and *before* the response's final bytes (``data: [DONE]``, the JSON
body, or an SSE error frame) are sent. It is self-contained: a plugin needs no per-choice
hook to account for the request. Times are measured by the gateway with a monotonic clock;
``started_at`` is wall-clock (unix seconds).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from backends.base import EnginePhases, GenerationRequest, SpeculationStats, Usage

__all__ = [
    "ChoiceOutcome",
    "ChoiceSummary",
    "RequestStatus",
    "RequestSummary",
    "http_request_id",
]


def http_request_id(request: GenerationRequest) -> str:
    """The id of the HTTP request a choice belongs to (its ``x-request-id``): the key that
    ties ``on_request_start``, the attempts of every choice and ``on_request_end`` together."""
    return request.parent_request_id or request.request_id


#: How one choice ended: "finished" (normal end), "failed" (an error, the request's or a
#: backend's), "aborted" (the client went away, or a sibling choice failed), "rejected"
#: (refused before routing: a plugin's ``transform_request`` or the router said no).
ChoiceOutcome = Literal["finished", "failed", "aborted", "rejected"]

#: "ok" when every choice finished, "aborted" when the client went away, else "error".
RequestStatus = Literal["ok", "error", "aborted"]


class ChoiceSummary(msgspec.Struct, frozen=True, kw_only=True):
    """One choice (one ``GenerationRequest``) of the HTTP request."""

    choice_index: int
    #: The backend that produced the choice's first chunk; None when no backend did.
    backend_name: str | None
    outcome: ChoiceOutcome
    finish_reason: str | None = None
    #: The backend's own usage. When the stream ended without one (failure mid-stream,
    #: client gone), the output tokens the gateway counted, with ``prompt_tokens`` 0 and
    #: ``usage_is_partial`` True. None when nothing was produced.
    usage: Usage | None = None
    usage_is_partial: bool = False
    #: The ``InfermuxError`` the choice ended with, or None.
    error: Any = None
    #: Request start to the first chunk of this choice (seconds).
    ttft_s: float | None = None
    #: Mean time per output token after the first (None with fewer than two tokens).
    tpot_s: float | None = None
    #: Gaps between consecutive output chunks (seconds), for inter-token latency.
    inter_token_s: tuple[float, ...] = ()
    #: Engine phases reported by the backend on its last chunk (core engine), or None.
    phases: EnginePhases | None = None
    #: Speculative decoding of the choice, from the backend's last chunk, or None.
    speculation: SpeculationStats | None = None
    #: Each backend's share of ``usage`` when a backend failed mid-stream and the next one
    #: continued the answer (``resume_on_failure``), in order: ``(backend name, usage)``;
    #: empty when one backend produced the whole choice.
    backend_usages: tuple[tuple[str, Usage], ...] = ()
    #: The generated text, only when the operator opted in to content capture
    #: (``[telemetry.tracing] record_content``); None otherwise.
    output_text: str | None = None


class RequestSummary(msgspec.Struct, frozen=True, kw_only=True):
    """One HTTP generation request, as it ended."""

    #: Choice 0 as the router saw it (after ``transform_request``: tenant, key id set), or
    #: as converted from the wire when it was rejected before that.
    request: GenerationRequest
    choices: tuple[ChoiceSummary, ...]
    status: RequestStatus
    #: The error the client got (``InfermuxError``), or None.
    error: Any = None
    #: Total usage the way OpenAI counts it (each prompt once, outputs of all choices
    #: summed): equal to the ``usage`` returned to the client when the request finished.
    usage: Usage
    #: Wall-clock start (unix seconds) and duration up to now (the final bytes are next).
    started_at: float
    duration_s: float
    #: Earliest first chunk over the choices (seconds since the start), or None.
    ttft_s: float | None = None
    #: Mean time per output token over all choices, or None.
    tpot_s: float | None = None
    #: Facts plugins add for plugins that run after them in ``infermux_on_request_end``
    #: (the built-in cost plugin runs first and sets ``"infermux.cost"``); the built-in
    #: tracing plugin copies every entry onto the request span. The dict is shared.
    attributes: dict[str, Any] = {}

    @property
    def request_id(self) -> str:
        """The HTTP request's id (``x-request-id``)."""
        return http_request_id(self.request)

    @property
    def num_choices(self) -> int:
        return len(self.choices)

    @property
    def backend_names(self) -> list[str]:
        """The backends that served choices (each that worked on a resumed one), without
        repeats, in choice order."""
        names = (
            name
            for c in self.choices
            for name in ([n for n, _ in c.backend_usages] or [c.backend_name or ""])
            if name
        )
        return list(dict.fromkeys(names))
