"""Chat completions: the body, its usage, the streamed chunks and the sampling fields.

Written from https://platform.openai.com/docs/api-reference/chat (the request fields), /chat/object
(the body) and /chat/streaming (the chunk object).
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
from gateway.conformance.runner import Exchange, NotApplicable, Probe, check

CHAT = "/v1/chat/completions"
REF = "https://platform.openai.com/docs/api-reference/chat"
STORY = [{"role": "user", "content": "Write a long story, with many chapters and characters, about a dragon who learns to fly over the wide and stormy sea."}]
FINISH_REASONS = ("stop", "length", "tool_calls", "content_filter", "function_call")


def chat(probe: Probe, **fields: Any) -> tuple[Exchange, dict[str, Any]]:
    """A greedy, non-streamed chat request (the story prompt unless ``messages`` is given)."""
    body = greedy(probe, {"messages": STORY, "max_tokens": 16, **fields})
    return ok_object(probe, CHAT, body)


def chat_stream(probe: Probe, **fields: Any) -> tuple[Exchange, list[dict[str, Any]]]:
    body = greedy(probe, {"messages": STORY, "max_tokens": 16, "stream": True, **fields})
    exchange = probe.require_ok(probe.stream(CHAT, body))
    return exchange, data_events(exchange)


def expect_chat_body(data: dict[str, Any], exchange: Exchange, *, n: int = 1) -> None:
    """The chat completion object's required fields."""
    expect(data.get("object") == "chat.completion", "object must be \"chat.completion\"", exchange)
    expect_type(data.get("id"), str, "id", exchange)
    expect_type(data.get("created"), int, "created", exchange)
    expect_type(data.get("model"), str, "model", exchange)
    choices: Any = data.get("choices")
    expect_type(choices, list, "choices", exchange)
    expect(len(choices) == n, f"expected {n} choice(s), got {len(choices)}", exchange)
    expect(sorted(c.get("index") for c in choices) == list(range(n)), "choices[].index must be 0..n-1", exchange)
    for i, choice in enumerate(choices):
        message = choice.get("message")
        expect_type(message, dict, f"choices[{i}].message", exchange)
        expect(message.get("role") == "assistant", f"choices[{i}].message.role must be \"assistant\"", exchange)
        expect_type(message.get("content"), (str, type(None)), f"choices[{i}].message.content", exchange)
        expect(choice.get("finish_reason") in FINISH_REASONS, f"choices[{i}].finish_reason is not one of {FINISH_REASONS}", exchange, offending=choice.get("finish_reason"))


@check("chat.body", "openai", f"{REF}/object (id, object, created, model, choices[].message, finish_reason)")
def chat_body(probe: Probe) -> None:
    exchange, data = chat(probe)
    expect_chat_body(data, exchange)
    expect_type(data["choices"][0]["message"]["content"], str, "choices[0].message.content", exchange)


@check("chat.usage", "openai", f"{REF}/object#chat/object-usage (prompt/completion/total_tokens)")
def chat_usage(probe: Probe) -> None:
    exchange, data = chat(probe, max_tokens=8)
    expect_usage(data.get("usage"), exchange)
    expect(data["usage"]["completion_tokens"] <= 8, "usage.completion_tokens exceeds max_tokens", exchange)


@check("chat.stream.shape", "openai", f"{REF}/streaming (chunk object, delta.role first, finish_reason once, [DONE])")
def chat_stream_shape(probe: Probe) -> None:
    exchange, chunks = chat_stream(probe)
    expect(len(chunks) >= 2, "a streamed answer needs at least a role chunk and a finish chunk", exchange)
    ids = {chunk.get("id") for chunk in chunks}
    expect(len(ids) == 1, "every chunk of a stream carries the same id", exchange, offending=sorted(map(str, ids)))
    finishes = 0
    content_deltas = 0
    for i, chunk in enumerate(chunks):
        expect(chunk.get("object") == "chat.completion.chunk", f"chunk {i}: object must be \"chat.completion.chunk\"", exchange, offending=chunk)
        expect_type(chunk.get("created"), int, f"chunk {i}: created", exchange)
        expect_type(chunk.get("model"), str, f"chunk {i}: model", exchange)
        for choice in chunk.get("choices", []):
            delta = choice.get("delta")
            expect_type(delta, dict, f"chunk {i}: choices[].delta", exchange)
            if "content" in delta and delta["content"] is not None:
                expect_type(delta["content"], str, f"chunk {i}: delta.content", exchange)
                content_deltas += 1
            if choice.get("finish_reason") is not None:
                finishes += 1
                expect(choice["finish_reason"] in FINISH_REASONS, f"chunk {i}: unknown finish_reason", exchange, offending=chunk)
    first = chunks[0]["choices"][0]["delta"] if chunks[0].get("choices") else {}
    expect(first.get("role") == "assistant", "the first chunk's delta must carry role \"assistant\"", exchange, offending=chunks[0])
    expect(content_deltas > 0, "no delta carried content", exchange)
    expect(finishes == 1, f"finish_reason must be set exactly once, it was set {finishes} times", exchange)


@check("chat.stream.include_usage", "openai", f"{REF}/create#chat-create-stream_options (include_usage: a last chunk with empty choices and usage)")
def chat_stream_usage(probe: Probe) -> None:
    exchange, chunks = chat_stream(probe, stream_options={"include_usage": True})
    last = chunks[-1]
    expect(last.get("choices") == [], "the usage chunk (last before [DONE]) must have choices []", exchange, offending=last)
    expect_usage(last.get("usage"), exchange, field="last chunk: usage")
    for i, chunk in enumerate(chunks[:-1]):
        expect(chunk.get("usage") is None, f"chunk {i}: usage must be null except on the last chunk", exchange, offending=chunk)


@check("chat.n", "openai", f"{REF}/create#chat-create-n (n choices, index 0..n-1)")
def chat_n(probe: Probe) -> None:
    exchange, data = chat(probe, n=2, temperature=1.0, max_tokens=6)
    expect_chat_body(data, exchange, n=2)
    exchange, chunks = chat_stream(probe, n=2, temperature=1.0, max_tokens=6)
    finishes = [c["index"] for chunk in chunks for c in chunk.get("choices", []) if c.get("finish_reason")]
    expect(sorted(finishes) == [0, 1], "streamed with n=2: each index must finish exactly once", exchange, offending=finishes)


def _expect_stopped(stop: str | list[str], text: str, exchange: Exchange, data: dict[str, Any]) -> None:
    """``data`` is the greedy answer ``text`` cut before the first match of ``stop``."""
    stop_string = stop if isinstance(stop, str) else stop[0]
    got = data["choices"][0]["message"]["content"]
    expected = text[: text.index(stop_string)]
    expect(got == expected, f"with stop={stop!r} the text must be the greedy answer up to the stop string, excluded ({expected!r})", exchange, offending=got)
    expect(data["choices"][0]["finish_reason"] == "stop", "a matched stop string ends with finish_reason \"stop\"", exchange)


@check("chat.stop", "openai", f"{REF}/create#chat-create-stop (a string or up to 4; not in the returned text)")
def chat_stop(probe: Probe) -> None:
    _, first = chat(probe, max_tokens=24)
    text = first["choices"][0]["message"]["content"]
    stop = stop_string_of(text)
    for value in (stop, [stop, "\u2603never"]):
        exchange, data = chat(probe, max_tokens=24, stop=value)
        _expect_stopped(value, text, exchange, data)


@check("chat.seed", "openai", f"{REF}/create#chat-create-seed (same seed and parameters: same answer)")
def chat_seed(probe: Probe) -> None:
    answers = []
    for _ in range(2):
        exchange, data = chat(probe, temperature=1.0, seed=1234, max_tokens=12)
        answers.append(data["choices"][0]["message"]["content"])
    expect(answers[0] == answers[1], "two sampled answers with the same seed differ", exchange, offending=answers)


@check("chat.max_tokens", "openai", f"{REF}/create#chat-create-max_tokens (finish_reason \"length\" at the limit)")
def chat_max_tokens(probe: Probe) -> None:
    for field in ("max_tokens", "max_completion_tokens"):
        exchange = probe.require_ok(probe.post(CHAT, greedy(probe, {"messages": STORY, field: 3})))
        data = exchange.json()
        usage = data.get("usage") or {}
        expect(data["choices"][0]["finish_reason"] == "length", f"{field}=3 on a long story must end with finish_reason \"length\"", exchange)
        expect(usage.get("completion_tokens") == 3, f"{field}=3: usage.completion_tokens must be 3", exchange, offending=usage)


@check("chat.logprobs", "openai", f"{REF}/object#chat/object-choices-logprobs (content[].token/logprob/bytes/top_logprobs)")
def chat_logprobs(probe: Probe) -> None:
    exchange, data = chat(probe, logprobs=True, top_logprobs=2, max_tokens=5)
    logprobs = data["choices"][0].get("logprobs")
    expect_type(logprobs, dict, "choices[0].logprobs", exchange)
    content = logprobs.get("content")
    expect_type(content, list, "choices[0].logprobs.content", exchange)
    expect(len(content) == data["usage"]["completion_tokens"], "one logprobs entry per completion token", exchange, offending=len(content))
    for i, entry in enumerate(content):
        _expect_token_logprob(entry, f"logprobs.content[{i}]", exchange)
        tops = entry.get("top_logprobs")
        expect_type(tops, list, f"logprobs.content[{i}].top_logprobs", exchange)
        expect(len(tops) == 2, f"logprobs.content[{i}].top_logprobs must hold top_logprobs=2 entries", exchange, offending=tops)
        for j, top in enumerate(tops):
            _expect_token_logprob(top, f"logprobs.content[{i}].top_logprobs[{j}]", exchange)
    exchange, plain = chat(probe, max_tokens=3)
    choice = plain["choices"][0]
    expect("logprobs" in choice and choice["logprobs"] is None, "choices[].logprobs must be null when not asked for", exchange, offending=choice)


def _expect_token_logprob(entry: Any, field: str, exchange: Exchange) -> None:
    expect_type(entry, dict, field, exchange)
    expect_type(entry.get("token"), str, f"{field}.token", exchange)
    expect_type(entry.get("logprob"), (float, int), f"{field}.logprob", exchange)
    expect(entry["logprob"] <= 0, f"{field}.logprob must be <= 0", exchange, offending=entry)
    expect("bytes" in entry, f"{field}.bytes is missing (null when not representable)", exchange)
    if entry["bytes"] is not None:
        expect(isinstance(entry["bytes"], list) and all(isinstance(b, int) and 0 <= b < 256 for b in entry["bytes"]), f"{field}.bytes must be a list of byte values", exchange, offending=entry)


@check("chat.cached_tokens", "openai", f"{REF}/object#chat/object-usage-prompt_tokens_details (cached_tokens on a repeated prefix)")
def chat_cached_tokens(probe: Probe) -> None:
    system = " ".join(f"Rule {i}: answer briefly and politely, in plain English." for i in range(24))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Say hello."}]
    for _ in range(2):
        exchange, data = chat(probe, messages=messages, max_tokens=2)
    usage = data.get("usage") or {}
    details: Any = usage.get("prompt_tokens_details")
    expect_type(details, dict, "usage.prompt_tokens_details", exchange)
    cached = details.get("cached_tokens")
    expect_type(cached, int, "usage.prompt_tokens_details.cached_tokens", exchange)
    expect(0 <= cached <= usage["prompt_tokens"], "cached_tokens must be within prompt_tokens", exchange, offending=usage)
    if cached == 0:
        raise NotApplicable("no prefix cache: cached_tokens is 0 on a repeated prefix")


@check("chat.reasoning", "openai", "https://platform.openai.com/docs/guides/reasoning (reasoning_content / reasoning, where present, is text apart from content)")
def chat_reasoning(probe: Probe) -> None:
    exchange, data = chat(probe, messages=[{"role": "user", "content": "What is 12 + 30? Think first."}], max_tokens=24)
    message = data["choices"][0]["message"]
    fields = [key for key in ("reasoning_content", "reasoning") if message.get(key) is not None]
    if not fields:
        raise NotApplicable("the model returns no reasoning field")
    for key in fields:
        expect_type(message[key], str, f"choices[0].message.{key}", exchange)
    exchange, chunks = chat_stream(probe, messages=[{"role": "user", "content": "What is 12 + 30? Think first."}], max_tokens=24)
    for i, chunk in enumerate(chunks):
        for choice in chunk.get("choices", []):
            for key in fields:
                if choice["delta"].get(key) is not None:
                    expect_type(choice["delta"][key], str, f"chunk {i}: delta.{key}", exchange)
