"""Tool-call and reasoning parsers on recorded model outputs, streamed in every split.

Whatever way the text is cut into deltas - one piece, every single cut point, every pair of
cut points, one character at a time - the content, the reasoning and the reassembled tool
calls are the same, and the calls' first deltas carry index, id and name before any argument
fragment (as OpenAI streams them).
"""

from __future__ import annotations

import itertools
import json

import pytest

from core_engine.chat.reasoning import ReasoningParser
from core_engine.chat.tool_calls import ParsedDelta, make_tool_call_parser

WEATHER = '{"city": "Paris", "unit": "celsius"}'

# (format, recorded output, expected content, expected [(name, arguments JSON)])
TOOL_CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": ' + WEATHER + "}\n</tool_call>", "",
     [("get_weather", WEATHER)]),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>', "Let me check.",
     [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "Europe/Paris"}')]),
    ("hermes", '<tool_call>\n{"arguments": {"q": "a \\"quoted\\" } brace"}, "name": "search"}\n</tool_call>', "",
     [("search", '{"q": "a \\"quoted\\" } brace"}')]),
    ("hermes", "No tools needed: 2 < 3 and <tool is not a tag.", "No tools needed: 2 < 3 and <tool is not a tag.", []),
    ("hermes", "<tool_call>not json</tool_call> done", "<tool_call>not json</tool_call> done", []),
    ("hermes", '<tool_call>{"name": "ping", "arguments": {}}</tool_call>', "", [("ping", "{}")]),
    ("hermes", '<tool_call>{"name": "ping"}</tool_call>', "", [("ping", "{}")]),
    ("hermes", '<tool_call>{"name": "enc", "arguments": "{\\"x\\": 1}"}</tool_call>', "", [("enc", '{"x": 1}')]),
    ("hermes", "Café ☕ — no call", "Café ☕ — no call", []),
    # Unconstrained output repeating a key: the first name and arguments (they may have
    # streamed already), never the tail of the second value appended under the same index.
    ("hermes", '<tool_call>{"name": "t", "arguments": {"tz": "Oslo"}, "arguments": {"tz": "America/New_York"}}</tool_call>',
     "", [("t", '{"tz": "Oslo"}')]),
    ("hermes", '<tool_call>{"name": "t", "arguments": {"tz": "Oslo"}, "name": "w", "parameters": {}}</tool_call>',
     "", [("t", '{"tz": "Oslo"}')]),
    ("llama3_json", '{"name": "get_weather", "parameters": ' + WEATHER + "}", "", [("get_weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": [1, 2, {"y": "}"}]}}; {"name": "b", "parameters": {}}',
     "", [("a", '{"x": [1, 2, {"y": "}"}]}'), ("b", "{}")]),
    ("llama3_json", "The weather in Paris is mild.", "The weather in Paris is mild.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + WEATHER + '}, {"name": "get_time", "arguments": {}}]',
     "", [("get_weather", WEATHER), ("get_time", "{}")]),
    ("mistral", "Sure. [TOOL_CALLS]get_weather[ARGS]" + WEATHER, "Sure.", [("get_weather", WEATHER)]),
    ("mistral", "[TOOL_CALLS]a[ARGS]{\"k\": \"[ARGS]\"}[TOOL_CALLS]b[ARGS]{}", "", [("a", '{"k": "[ARGS]"}'), ("b", "{}")]),
    ("mistral", "Just [text] with brackets.", "Just [text] with brackets.", []),
    ("mistral", '[TOOL_CALLS]a[CALL_ID]abcDEF123[ARGS]{"x": 1}', "", [("a", '{"x": 1}')]),
    # Formats read a whole call at a time (arguments as written, or re-encoded for XML-ish ones).
    ("deepseek", "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>" + WEATHER
     + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "Checking.", [("get_weather", WEATHER)]),
    ("deepseek", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>a\n```json\n{\"k\": \"```\"}\n```"
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "", [("a", '{"k": "```"}')]),
    ("deepseek", "Plain <｜answer｜> text.", "Plain <｜answer｜> text.", []),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.a:0<|tool_call_argument_begin|>{}"
     "<|tool_call_end|><|tool_call_begin|>functions.b:1<|tool_call_argument_begin|>{\"x\": [1]}<|tool_call_end|>"
     "<|tool_calls_section_end|>", "", [("a", "{}"), ("b", '{"x": [1]}')]),
    ("glm", "<tool_call>a\n<arg_key>q</arg_key>\n<arg_value>x < y</arg_value>\n<arg_key>n</arg_key>"
     "<arg_value>[1, 2]</arg_value>\n</tool_call>", "", [("a", '{"q": "x < y", "n": [1, 2]}')]),
    ("qwen_xml", "Sure.\n<tool_call>\n<function=a>\n<parameter=q>\nline 1\nline 2\n</parameter>\n</function>\n</tool_call>",
     "Sure.", [("a", '{"q": "line 1\\nline 2"}')]),
    ("dsml", '<｜DSML｜function_calls>\n<｜DSML｜invoke name="a">\n<｜DSML｜parameter name="n" string="true">42'
     '</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>', "", [("a", '{"n": "42"}')]),
    ("json_list", '<|tool_call|>[{"name": "a", "arguments": {"x": "]"}}, {"name": "b", "arguments": {}}]', "",
     [("a", '{"x": "]"}'), ("b", "{}")]),
    ("command_r", 'Action: ```json\n[{"tool_name": "a", "parameters": {}}]\n```', "", [("a", "{}")]),
    ("json_list", "A <tool> and an Action: plain.", "A <tool> and an Action: plain.", []),
    ("functionary_v3_1", '<function=a>{"x": "</function>"}</function>', "", [("a", '{"x": "</function>"}')]),
    ("functionary_v3_2", 'all\nLet me see.>>>a\n{"x": 1}', "Let me see.", [("a", '{"x": 1}')]),
    ("functionary_v3_2", "all\nJust text > here.", "Just text > here.", []),
    ("harmony", '<|start|>assistant to=functions.a<|channel|>commentary <|constrain|>json<|message|>{"x": 1}<|call|>',
     "", [("a", '{"x": 1}')]),
    ("harmony", "<|channel|>final<|message|>Paris is nice.<|return|>", "Paris is nice.", []),
]


def _splits(text: str):
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    if len(text) <= 140:
        for i, j in itertools.combinations(range(1, len(text)), 2):
            yield [text[:i], text[i:j], text[j:]]


def _run_tools(fmt: str, pieces: list[str]):
    ids = (f"call_{i}" for i in itertools.count())
    parser = make_tool_call_parser(fmt, make_id=lambda: next(ids))
    total = ParsedDelta()
    for piece in pieces:
        total.extend(parser.feed(piece))
    total.extend(parser.finish())
    calls: dict[int, dict[str, str]] = {}
    for delta in total.tool_calls:
        if delta.index not in calls:
            # The first delta of a call names it, with its id, before any argument text.
            assert delta.id is not None and delta.name is not None and delta.arguments == ""
            calls[delta.index] = {"id": delta.id, "name": delta.name, "arguments": ""}
        else:
            assert delta.id is None and delta.name is None
        calls[delta.index]["arguments"] += delta.arguments
    assert sorted(calls) == list(range(len(calls)))
    return total.content, [(c["name"], c["arguments"]) for c in calls.values()]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), TOOL_CASES)
def test_tool_calls_parse_the_same_in_every_split(fmt, text, content, calls):
    for pieces in _splits(text):
        got_content, got_calls = _run_tools(fmt, pieces)
        assert (got_content, got_calls) == (content, calls), pieces
    for _, arguments in calls:
        json.loads(arguments)


def test_arguments_stream_before_the_call_is_complete():
    parser = make_tool_call_parser("hermes")
    out = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert [d.name for d in out.tool_calls if d.name] == ["get_weather"]
    assert "".join(d.arguments for d in out.tool_calls) == '{"city": "Pa'


REASONING_CASES = [
    # (markers, open_at_start, output, reasoning, content)
    (("<think>", "</think>"), False, "<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.", "\nThe user wants 2+2.\n",
     "It is 4."),
    (("<think>", "</think>"), True, "Okay, 2+2 is 4.\n</think>\n\n4", "Okay, 2+2 is 4.\n", "4"),
    (("<think>", "</think>"), False, "4, without thinking. <think> is literal here.", "",
     "4, without thinking. <think> is literal here."),
    (("<think>", "</think>"), True, "I ran out of budget <", "I ran out of budget <", ""),
    (("[THINK]", "[/THINK]"), False, "[THINK]Paris is in France.[/THINK]Paris.", "Paris is in France.", "Paris."),
    (("<seed:think>", "</seed:think>"), False, "  <seed:think>héhé ☕</seed:think>Réponse", "héhé ☕", "Réponse"),
    (("<|channel|>analysis<|message|>", "<|end|>"), False,
     "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi", "Think.",
     "<|start|>assistant<|channel|>final<|message|>Hi"),
    (("<|START_THINKING|>", "<|END_THINKING|>"), False, "<|START_THINKING|>Plan.<|END_THINKING|>Go", "Plan.", "Go"),
]


@pytest.mark.parametrize(("markers", "open_at_start", "text", "reasoning", "content"), REASONING_CASES)
def test_reasoning_splits_the_same_in_every_split(markers, open_at_start, text, reasoning, content):
    for pieces in _splits(text):
        parser = ReasoningParser(*markers, open_at_start=open_at_start)
        got_reasoning, got_content = "", ""
        for piece in pieces:
            r, c = parser.feed(piece)
            got_reasoning += r
            got_content += c
        r, c = parser.finish()
        assert (got_reasoning + r, got_content + c) == (reasoning, content), pieces
