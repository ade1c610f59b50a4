"""Text completions: the body, streaming, ``echo``, ``logprobs`` and ``stop``.

Written from https://platform.openai.com/docs/api-reference/completions (legacy, still served
by every OpenAI-compatible server).
"""

from __future__ import annotations

from typing import Any

from gateway.conformance.expect import (
    data_events,
    expect,
    expect_type,
    expect_usage,
    greedy,
    ok_object,
    stop_string_of,
)
from gateway.conformance.runner import Exchange, Probe, check

COMPLETIONS = "/v1/completions"
REF = "https://platform.openai.com/docs/api-reference/completions"
PROMPT = "Once upon a time, in a small village by the sea, there lived"
FINISH_REASONS = ("stop", "length", "content_filter")


def complete(probe: Probe, **fields: Any) -> tuple[Exchange, dict[str, Any]]:
    body = greedy(probe, {"prompt": PROMPT, "max_tokens": 12, **fields})
    return ok_object(probe, COMPLETIONS, body)


@check("completions.body", "openai", f"{REF}/object (id, object \"text_completion\", choices[].text/index/logprobs/finish_reason, usage)")
def completions_body(probe: Probe) -> None:
    exchange, data = complete(probe)
    expect(data.get("object") == "text_completion", "object must be \"text_completion\"", exchange)
    expect_type(data.get("id"), str, "id", exchange)
    expect_type(data.get("created"), int, "created", exchange)
    expect_type(data.get("model"), str, "model", exchange)
    choices: Any = data.get("choices")
    expect(isinstance(choices, list) and len(choices) == 1, "choices must hold one choice", exchange)
    choice = choices[0]
    expect_type(choice.get("text"), str, "choices[0].text", exchange)
    expect(choice.get("index") == 0, "choices[0].index must be 0", exchange)
    expect("logprobs" in choice and choice["logprobs"] is None, "choices[0].logprobs must be null when not asked for", exchange)
    expect(choice.get("finish_reason") in FINISH_REASONS, "choices[0].finish_reason", exchange, offending=choice.get("finish_reason"))
    expect_usage(data.get("usage"), exchange)
    expect(data["usage"]["completion_tokens"] <= 12, "usage.completion_tokens exceeds max_tokens", exchange)


@check("completions.stream", "openai", f"{REF}/create#completions-create-stream (text_completion chunks, finish_reason once, usage chunk, [DONE])")
def completions_stream(probe: Probe) -> None:
    body = greedy(probe, {"prompt": PROMPT, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}})
    exchange = probe.require_ok(probe.stream(COMPLETIONS, body))
    chunks = data_events(exchange)
    finishes = 0
    for i, chunk in enumerate(chunks):
        expect(chunk.get("object") == "text_completion", f"chunk {i}: object must be \"text_completion\"", exchange, offending=chunk)
        for choice in chunk.get("choices", []):
            expect_type(choice.get("text"), str, f"chunk {i}: choices[].text", exchange)
            finishes += choice.get("finish_reason") is not None
    expect(finishes == 1, f"finish_reason must be set exactly once, it was set {finishes} times", exchange)
    last = chunks[-1]
    expect(last.get("choices") == [], "the usage chunk (last before [DONE]) must have choices []", exchange, offending=last)
    expect_usage(last.get("usage"), exchange, field="last chunk: usage")


@check("completions.echo", "openai", f"{REF}/create#completions-create-echo (the prompt echoed before the completion)")
def completions_echo(probe: Probe) -> None:
    exchange, plain = complete(probe, max_tokens=4)
    exchange, data = complete(probe, max_tokens=4, echo=True)
    text = data["choices"][0]["text"]
    expected = PROMPT + plain["choices"][0]["text"]
    expect(text == expected, f"echo=true: the text must be the prompt followed by the completion ({expected!r})", exchange, offending=text)


@check("completions.logprobs", "openai", f"{REF}/object#completions/object-choices (logprobs.tokens/token_logprobs/top_logprobs/text_offset)")
def completions_logprobs(probe: Probe) -> None:
    exchange, data = complete(probe, logprobs=2, max_tokens=4)
    logprobs = data["choices"][0].get("logprobs")
    expect_type(logprobs, dict, "choices[0].logprobs", exchange)
    columns = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    for name in columns:
        expect_type(logprobs.get(name), list, f"logprobs.{name}", exchange)
    lengths = {name: len(logprobs[name]) for name in columns}
    expect(len(set(lengths.values())) == 1, "logprobs.* must have one entry per token", exchange, offending=lengths)
    expect(lengths["tokens"] == data["usage"]["completion_tokens"], "one logprobs entry per completion token", exchange, offending=lengths)
    expect("".join(logprobs["tokens"]) == data["choices"][0]["text"], "logprobs.tokens must spell the text", exchange, offending=logprobs["tokens"])
    for i, top in enumerate(logprobs["top_logprobs"]):
        expect(isinstance(top, dict) and 1 <= len(top) <= 2, f"logprobs.top_logprobs[{i}] must map at most logprobs=2 tokens", exchange, offending=top)
    offsets = logprobs["text_offset"]
    expect(offsets == sorted(offsets), "logprobs.text_offset must not decrease", exchange, offending=offsets)


@check("completions.stop", "openai", f"{REF}/create#completions-create-stop (not in the returned text)")
def completions_stop(probe: Probe) -> None:
    _, first = complete(probe, max_tokens=24)
    text = first["choices"][0]["text"]
    stop = stop_string_of(text)
    exchange, data = complete(probe, max_tokens=24, stop=[stop])
    got = data["choices"][0]["text"]
    expected = text[: text.index(stop)]
    expect(got == expected, f"with stop={[stop]!r} the text must be the greedy answer up to the stop string, excluded ({expected!r})", exchange, offending=got)
    expect(data["choices"][0]["finish_reason"] == "stop", "a matched stop string ends with finish_reason \"stop\"", exchange)
