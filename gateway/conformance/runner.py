"""The check registry and the runner: each check is one small function against the wire.

A check is registered with :func:`check` (its name, the API it belongs to and the reference
it is written from, down to the field) and receives a :class:`Probe`, a thin layer over one
``httpx.Client`` that keeps every exchange (the request body, the status, the raw body or the
raw SSE lines) so a failure can show exactly what was sent and what came back. A check passes
by returning; it fails by raising :class:`CheckFailed` (or any other exception: a crash in a
check is a failure with its traceback, never the end of the run); it is not applicable when
the endpoint says it lacks the capability (:class:`NotApplicable`, raised by
:meth:`Probe.require_ok` on a 404/501 route or an ``unsupported_parameter`` refusal).
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import httpx

__all__ = [
    "API_NAMES",
    "Check",
    "CheckFailed",
    "CheckResult",
    "Exchange",
    "NotApplicable",
    "Probe",
    "SseEvent",
    "Target",
    "check",
    "registered_checks",
    "run_checks",
]

Api = Literal["openai", "anthropic", "responses"]
Verdict = Literal["pass", "fail", "n/a"]
API_NAMES: tuple[Api, ...] = ("openai", "anthropic", "responses")

#: The longest piece of a body quoted as evidence (a whole streamed answer is rarely needed).
MAX_EVIDENCE_CHARS = 1500


class CheckFailed(Exception):
    """The endpoint broke the contract; the message is the evidence."""


class NotApplicable(Exception):
    """The endpoint declares or shows that it lacks the capability; the message says how."""


@dataclass(frozen=True)
class Target:
    """The endpoint under test."""

    url: str  # the server root, e.g. http://127.0.0.1:8000 (a trailing ``/v1`` is dropped)
    model: str
    api_key: str | None = None
    #: Per request; a CPU model answering a small request needs seconds, not minutes.
    timeout_s: float = 120.0


@dataclass
class SseEvent:
    """One server-sent event as it came over the wire."""

    event: str | None  # the ``event:`` field, if any
    data: str  # the raw ``data:`` text (``[DONE]`` included)

    def json(self) -> Any:
        return json.loads(self.data)


@dataclass
class Exchange:
    """One request and what came back; ``str()`` is the evidence form."""

    method: str
    path: str
    body: Any
    status: int
    text: str
    events: list[SseEvent] | None = None  # for a streamed answer

    def json(self) -> Any:
        """The body as JSON; a body that is not JSON fails the check."""
        try:
            return json.loads(self.text)
        except ValueError as exc:
            raise CheckFailed(f"the body is not JSON ({exc})\n{self}") from None

    def error_body(self) -> dict[str, Any]:
        data = self.json()
        if not isinstance(data, dict):
            raise CheckFailed(f"the body is not a JSON object\n{self}")
        return data

    def __str__(self) -> str:
        sent = self.body if isinstance(self.body, str) else json.dumps(self.body)
        got = self.text
        if self.events is not None:
            got = "\n".join(
                (f"event: {e.event}\n" if e.event else "") + f"data: {e.data}" for e in self.events
            )
        return f"request: {self.method} {self.path} {_clip(sent)}\nresponse {self.status}: {_clip(got)}"


def _clip(text: str) -> str:
    if len(text) <= MAX_EVIDENCE_CHARS:
        return text
    return text[:MAX_EVIDENCE_CHARS] + f"... ({len(text) - MAX_EVIDENCE_CHARS} more chars)"


class Probe:
    """What a check talks through: raw JSON and raw SSE over one HTTP client."""

    def __init__(self, target: Target, client: httpx.Client) -> None:
        self.target = target
        self.model = target.model
        self._client = client

    def post(self, path: str, body: Any, *, raw: str | None = None) -> Exchange:
        """POST ``body`` as JSON (or the ``raw`` text as it is, for malformed bodies)."""
        content = raw if raw is not None else json.dumps(body)
        answer = self._client.post(
            path, content=content, headers={"content-type": "application/json"}
        )
        return Exchange("POST", path, raw if raw is not None else body, answer.status_code, answer.text)

    def get(self, path: str) -> Exchange:
        answer = self._client.get(path)
        return Exchange("GET", path, "", answer.status_code, answer.text)

    def stream(self, path: str, body: Any) -> Exchange:
        """POST and read the answer as server-sent events, exactly as they came."""
        with self._client.stream(
            "POST", path, content=json.dumps(body), headers={"content-type": "application/json"}
        ) as answer:
            if answer.status_code != 200:
                answer.read()
                return Exchange("POST", path, body, answer.status_code, answer.text)
            events = _parse_sse(answer.iter_lines())
        return Exchange("POST", path, body, 200, "", events)

    def require_ok(self, exchange: Exchange, *, lacking: tuple[str, ...] = ()) -> Exchange:
        """Fail on a non-200 answer, unless it says the capability is missing (n/a): a
        404/405/501 route, an ``unsupported_parameter`` code, "not supported" in the error
        message, or one of the check's own ``lacking`` phrases (what the error says when the
        capability the check needs is absent, e.g. "tokenizer" for count_tokens)."""
        if exchange.status == 200:
            return exchange
        reason = _lacks_capability(exchange, ("not supported", *lacking))
        if reason is not None:
            raise NotApplicable(reason)
        raise CheckFailed(f"expected 200\n{exchange}")


def _lacks_capability(exchange: Exchange, phrases: tuple[str, ...]) -> str | None:
    """Why the answer means "not served here", or None for an ordinary failure."""
    if exchange.status in (404, 405, 501) and "model" not in exchange.text.lower():
        return f"{exchange.method} {exchange.path} answers {exchange.status}"
    if exchange.status not in (400, 404, 422, 501):
        return None
    try:
        error = json.loads(exchange.text).get("error")  # OpenAI's and Anthropic's envelope
    except (ValueError, AttributeError):
        return None
    if not isinstance(error, dict):
        return None
    message = str(error.get("message", ""))
    if error.get("code") == "unsupported_parameter" or any(p in message.lower() for p in phrases):
        return f"{exchange.status} {error.get('code') or error.get('type')}: {message}"
    return None


def _parse_sse(lines: Iterable[str]) -> list[SseEvent]:
    """Events per the SSE spec (html.spec.whatwg.org/#event-stream-interpretation), comments
    and ``retry``/``id`` fields dropped."""
    events: list[SseEvent] = []
    name: str | None = None
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                events.append(SseEvent(name, "\n".join(data)))
            name, data = None, []
        elif line.startswith(":"):
            continue
        else:
            key, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if key == "data":
                data.append(value)
            elif key == "event":
                name = value
    if data:
        events.append(SseEvent(name, "\n".join(data)))
    return events


CheckFunction = Callable[[Probe], None]


@dataclass(frozen=True)
class Check:
    """A registered check: what it verifies and where the contract is written."""

    name: str
    api: Api
    reference: str  # the published reference and the field it checks
    function: CheckFunction


@dataclass
class CheckResult:
    """The verdict of one check against one endpoint."""

    name: str
    api: Api
    reference: str
    verdict: Verdict
    evidence: str = ""
    seconds: float = 0.0


_REGISTRY: list[Check] = []


def check(name: str, api: Api, reference: str) -> Callable[[CheckFunction], CheckFunction]:
    """Register the decorated function as the check ``name``."""

    def register(function: CheckFunction) -> CheckFunction:
        if any(existing.name == name for existing in _REGISTRY):
            raise ValueError(f"two checks are named {name!r}")
        _REGISTRY.append(Check(name, api, reference, function))
        return function

    return register


def registered_checks() -> list[Check]:
    """Every check, by API (:data:`API_NAMES` order), then in registration order (importing
    ``gateway.conformance`` imports all the ``checks_*`` modules, which register theirs)."""
    return sorted(_REGISTRY, key=lambda item: API_NAMES.index(item.api))


def run_checks(
    target: Target,
    apis: Iterable[Api] = API_NAMES,
    *,
    only: Callable[[Check], bool] | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
) -> list[CheckResult]:
    """Run every check of ``apis`` against ``target``, one after the other."""
    wanted = set(apis)
    headers = {"authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    results: list[CheckResult] = []
    # A fresh connection per request: a server that closes a kept-alive connection between
    # two requests (llama-server did, mid-run, "Server disconnected without sending a
    # response") must not turn the next check into a failure unrelated to the contract.
    limits = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(
        base_url=target.url.rstrip("/").removesuffix("/v1"),  # the checks' paths start /v1
        headers=headers,
        timeout=target.timeout_s,
        limits=limits,
    ) as client:
        probe = Probe(target, client)
        for item in registered_checks():
            if item.api not in wanted or (only is not None and not only(item)):
                continue
            result = _run_one(item, probe)
            results.append(result)
            if on_result is not None:
                on_result(result)
    return results


def _run_one(item: Check, probe: Probe) -> CheckResult:
    started = time.monotonic()
    verdict: Verdict = "pass"
    evidence = ""
    try:
        item.function(probe)
    except NotApplicable as exc:
        verdict, evidence = "n/a", str(exc)
    except CheckFailed as exc:
        verdict, evidence = "fail", str(exc)
    except httpx.HTTPError as exc:
        verdict, evidence = "fail", f"transport error: {exc!r}"
    except Exception:
        verdict, evidence = "fail", "the check raised:\n" + traceback.format_exc(limit=4)
    seconds = time.monotonic() - started
    return CheckResult(item.name, item.api, item.reference, verdict, evidence, seconds)
