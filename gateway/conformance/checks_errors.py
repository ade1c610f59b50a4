"""The error envelope and status for bad inputs, one check per input.

Written from https://platform.openai.com/docs/guides/error-codes (400 for an invalid request,
404 for an unknown model or route) and the envelope every OpenAI error has:
``{"error": {"message", "type", "param", "code"}}`` (api-reference/introduction, "Errors").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.conformance.expect import expect_error_envelope
from gateway.conformance.runner import Probe, check

REF = "https://platform.openai.com/docs/guides/error-codes"
CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "Hello"}]

#: name -> (path, the body given the model (None: send ``raw``), raw text, expected status(es), what is wrong)
BadInput = tuple[str, Callable[[str], Any] | None, str | None, int | tuple[int, ...], str]
BAD_INPUTS: dict[str, BadInput] = {
    "malformed_json": (CHAT, None, '{"model": "x", "messages": [', 400, "a body that is not JSON"),
    "missing_model": (CHAT, lambda m: {"messages": HELLO}, None, 400, "no model"),
    "unknown_model": (CHAT, lambda m: {"model": "no-such-model-conformance", "messages": HELLO}, None, (400, 404), "an unknown model"),
    "missing_messages": (CHAT, lambda m: {"model": m}, None, 400, "no messages"),
    "messages_not_array": (CHAT, lambda m: {"model": m, "messages": "Hello"}, None, 400, "messages a string"),
    "bad_role": (CHAT, lambda m: {"model": m, "messages": [{"role": "wizard", "content": "Hi"}]}, None, 400, "an unknown role"),
    "temperature_range": (CHAT, lambda m: {"model": m, "messages": HELLO, "temperature": 5}, None, 400, "temperature 5 (0..2)"),
    "top_p_range": (CHAT, lambda m: {"model": m, "messages": HELLO, "top_p": 1.5}, None, 400, "top_p 1.5 (0..1)"),
    "max_tokens_negative": (CHAT, lambda m: {"model": m, "messages": HELLO, "max_tokens": -1}, None, 400, "max_tokens -1"),
    "n_zero": (CHAT, lambda m: {"model": m, "messages": HELLO, "n": 0}, None, 400, "n 0"),
    "presence_penalty_range": (CHAT, lambda m: {"model": m, "messages": HELLO, "presence_penalty": 3}, None, 400, "presence_penalty 3 (-2..2)"),
    "top_logprobs_range": (CHAT, lambda m: {"model": m, "messages": HELLO, "logprobs": True, "top_logprobs": 50}, None, 400, "top_logprobs 50 (0..20)"),
    "empty_messages": (CHAT, lambda m: {"model": m, "messages": []}, None, 400, "an empty messages array"),
    "unknown_response_format": (CHAT, lambda m: {"model": m, "messages": HELLO, "response_format": {"type": "xml"}}, None, 400, "response_format type \"xml\""),
    "wrong_type": (CHAT, lambda m: {"model": m, "messages": HELLO, "max_tokens": "ten"}, None, 400, "max_tokens a string"),
    "completions_missing_prompt": ("/v1/completions", lambda m: {"model": m, "max_tokens": 4}, None, 400, "a completion without prompt"),
    "unknown_route": ("/v1/no-such-route", lambda m: {"model": m}, None, 404, "an unknown route"),
}


def _register(name: str, bad: BadInput) -> None:
    path, make_body, raw, status, what = bad

    def run(probe: Probe) -> None:
        exchange = probe.post(path, None if make_body is None else make_body(probe.model), raw=raw)
        expect_error_envelope(exchange, status)

    statuses = status if isinstance(status, tuple) else (status,)
    reference = f"{REF} ({what}: {'/'.join(map(str, statuses))} and error.message/type/param/code)"
    check(f"errors.{name}", "openai", reference)(run)


for _name, _bad in BAD_INPUTS.items():
    _register(_name, _bad)
