"""Every corpus template that renders assistant tool calls round-trips through its parser.

For each real template of llama.cpp's corpus that writes an assistant message's
``tool_calls``: the conversation is rendered (with our :class:`ChatTemplate`) without and
with a last assistant message holding one, then two calls (nested objects, unicode, quotes)
and ``reasoning_content``; the assistant's part is the difference (its end-of-turn marker,
which a model's stop token ends, cut off). That text, fed to the parsers
:func:`detect_chat_format` chooses - reasoning first, then tool calls, as
``backends/chat_plan.py`` chains them - in one piece, per character and in every split into
two deltas, gives back the same calls (name, arguments as parsed JSON), the same reasoning
(where the template renders it) and no content: no marker leaks.

Templates whose syntax has no parser yet, and templates that cannot render this
conversation, are listed below; the test asserts the lists are exactly those.
"""

from __future__ import annotations

import copy
import itertools
import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from core_engine.chat.formats import ChatFormat, detect_chat_format
from core_engine.chat.reasoning import ReasoningParser
from core_engine.chat.template import ChatTemplate, ChatTemplateError
from core_engine.chat.tool_calls import ParsedDelta, make_tool_call_parser
from tests.real_artifacts import templates_dir

BOS, EOS = "<s>", "</s>"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"The {name}.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    for name in ("get_weather", "get_time")
]

REASONING = 'The user wants "Paris" — é ☕, so I call the tools.'
CALLS: list[tuple[str, dict[str, Any]]] = [
    ("get_weather", {"city": "Paris", "opts": {"unit": "celsius", "q": 'a "quoted" é ☕', "days": [1, 2]}}),
    ("get_time", {"zone": "日本/東京", "nested": {"deep": {"on": True, "n": None}}}),
]
# Mistral's templates want ids of 9 letters and digits.
IDS = ["abcDEF123", "xyz789QRS"]

#: Templates whose call syntax has no parser yet -> the syntax.
NOT_COVERED: dict[str, str] = {}

#: Templates that leave null arguments out (the calls come back without them).
DROPS_NULLS = {"MiniMax-M3.jinja"}

#: Templates that mention tool_calls but cannot render this conversation -> why.
NOT_RENDERED = {
    "CohereForAI-c4ai-command-r-plus-tool_use.jinja": "wants Cohere's own tool objects (description of parameters)",
    "fireworks-ai-llama-3-firefunction-v2.jinja": "wants a `functions` variable",
    "Kimi-K2-Instruct.jinja": "mutates a list (list.append), refused by the sandbox",
    "Kimi-K2-Thinking.jinja": "mutates a list (list.append), refused by the sandbox",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja": "drops assistant tool calls from the history",
}

#: Templates that write only the first of several calls -> why.
ONE_CALL = {
    "openai-gpt-oss-120b.jinja": "writes tool_calls[0] only",
    "GigaChat3-10B-A1.8B.jinja": "writes tool_calls[0] only",
    "GigaChat3.1-10B-A1.8B.jinja": "writes tool_calls[0] only",
    "meta-llama-Llama-3.1-8B-Instruct.jinja": "raises on two calls",
    "meta-llama-Llama-3.2-3B-Instruct.jinja": "raises on two calls",
    "meta-llama-Llama-3.3-70B-Instruct.jinja": "raises on two calls",
}

#: End-of-turn markers a model's stop token ends (never given to the parsers).
_TURN_ENDS = (
    "<|im_end|>", "</s>", "<｜end▁of▁sentence｜>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>",
    "<|END_OF_TURN_TOKEN|>", "<|end|>", "<end_of_sentence>", "<seed:eos>", "<|role_end|>", "</assistant>",
    "<|endoftext|>", "<sep>", "[e~[", "<｜hy_eos:opensource｜>", "<SPECIAL_12>", "<|eot|>", "<|return|>",
    "<turn|>", "<|end_of_msg|>", "<|tool_response>", "<|message_sep|>",
)


def _template_files() -> list[Path]:
    return sorted(p for p in templates_dir().glob("*.jinja") if "tool_calls" in p.read_text(encoding="utf-8"))


def _assistant(num_calls: int, *, string_arguments: bool) -> dict[str, Any]:
    calls = []
    for (name, arguments), call_id in zip(CALLS[:num_calls], IDS, strict=False):
        args: Any = json.dumps(arguments, ensure_ascii=False) if string_arguments else copy.deepcopy(arguments)
        calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
    return {"role": "assistant", "content": "", "reasoning_content": REASONING, "tool_calls": calls}


def _common(a: str, b: str) -> int:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    if i < len(a):  # the generation prompt differs from the history: back to a boundary
        while i > 0 and a[i - 1] not in ">\n":
            i -= 1
    return i


@cache
def _rendered(name: str, num_calls: int) -> tuple[str, bool] | str:
    """(the assistant's rendered text, output starts inside the thinking block), or why not."""
    source = (templates_dir() / name).read_text(encoding="utf-8")
    template = ChatTemplate(source, bos_token=BOS, eos_token=EOS)
    fmt = detect_chat_format(source)
    user = {"role": "user", "content": "Weather and time?"}
    try:
        prompt = template.render([user], add_generation_prompt=True, tools=TOOLS)
    except ChatTemplateError as exc:
        return f"prompt: {exc}"
    errors = []
    for string_arguments in (False, True):
        try:
            history = template.render(
                [user, _assistant(num_calls, string_arguments=string_arguments)], add_generation_prompt=False,
                tools=TOOLS,
            )
            break
        except ChatTemplateError as exc:
            errors.append(str(exc))
    else:
        return f"history: {errors}"
    start = _common(prompt, history)
    text = history[start:]
    try:
        plain = template.render([user, {"role": "assistant", "content": "XYZZY"}], add_generation_prompt=False)
        turn_end = plain[plain.rfind("XYZZY") + 5:].strip()
    except ChatTemplateError:
        turn_end = ""
    for end in (turn_end, *_TURN_ENDS):
        if end and end in text and end not in ("<|end|>",):
            cut = text.find(end, text.rfind(CALLS[num_calls - 1][0]))
            if cut >= 0:
                text = text[:cut]
    changed = True
    while changed:
        changed = False
        for end in _TURN_ENDS:
            if text.rstrip().endswith(end):
                text, changed = text.rstrip()[: -len(end)], True
    markers = fmt.reasoning_markers
    # The generation prompt opened the thinking block (the output starts inside it), or the
    # history writes only its end.
    open_at_start = markers is not None and (
        (
            markers[0] not in text
            and (REASONING in text or start == len(prompt))
            and any(p.rstrip().endswith(markers[0].rstrip()) for p in (prompt[:start], prompt))
        )
        or text.lstrip().startswith(markers[1])
    )
    return text, open_at_start


def _parse(fmt: ChatFormat, open_at_start: bool, pieces: list[str]) -> tuple[str, str, list[tuple[str, Any]]]:
    ids = (f"id{i}" for i in itertools.count())
    markers = fmt.reasoning_markers
    reasoning = ReasoningParser(*markers, open_at_start=open_at_start) if markers is not None else None
    tools = make_tool_call_parser(fmt.tool_calls, make_id=lambda: next(ids))
    thought, total = "", ParsedDelta()
    for piece in [*pieces, None]:
        if reasoning is not None:
            r, c = reasoning.feed(piece) if piece is not None else reasoning.finish()
        else:
            r, c = "", piece or ""
        thought += r
        total.extend(tools.feed(c))
        if piece is None:
            total.extend(tools.finish())
    calls: dict[int, dict[str, str]] = {}
    for delta in total.tool_calls:
        if delta.index not in calls:
            assert delta.id is not None and delta.name is not None and delta.arguments == ""
            calls[delta.index] = {"name": delta.name, "arguments": ""}
        else:
            assert delta.id is None and delta.name is None
        calls[delta.index]["arguments"] += delta.arguments
    assert sorted(calls) == list(range(len(calls)))
    return thought, total.content, [(c["name"], json.loads(c["arguments"])) for c in calls.values()]


def _splits(text: str):
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


def _renders_calls(name: str) -> bool:
    rendered = _rendered(name, 1)
    return not isinstance(rendered, str) and CALLS[0][0] in rendered[0]


def test_the_lists_of_uncovered_templates_are_exact() -> None:
    names = [p.name for p in _template_files()]
    not_rendered = {n for n in names if not _renders_calls(n)}
    assert not_rendered == set(NOT_RENDERED), {n: _rendered(n, 1) for n in not_rendered ^ set(NOT_RENDERED)}
    failing = set()
    for n in names:
        if n in not_rendered:
            continue
        try:
            _check(n, 1, every_split=False)
        except AssertionError:
            failing.add(n)
    assert failing == set(NOT_COVERED)
    covered = len(names) - len(not_rendered) - len(failing)
    print(f"\ntool-call round trip: {covered} / {len(names) - len(not_rendered)} templates that render calls covered")


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    return value


def _check(name: str, num_calls: int, *, every_split: bool = True) -> bool:
    rendered = _rendered(name, num_calls)
    if isinstance(rendered, str):
        assert num_calls > 1, rendered  # a single call always renders
        return False
    text, open_at_start = rendered
    source = (templates_dir() / name).read_text(encoding="utf-8")
    fmt = detect_chat_format(source)
    want_reasoning = REASONING if REASONING in text else ""
    want_calls = [(n, json.loads(json.dumps(a))) for n, a in CALLS[:num_calls]]
    if name in DROPS_NULLS:
        want_calls = [(n, _without_nulls(a)) for n, a in want_calls]
    for pieces in _splits(text) if every_split else [[text], list(text)]:
        thought, content, calls = _parse(fmt, open_at_start, pieces)
        assert (thought.strip(), content.strip(), calls) == (want_reasoning, "", want_calls), (fmt, pieces)
    return True


def _round_trip_cases() -> list[Any]:
    """(template, number of calls) of every template that renders calls; the listed ones are
    left out here, and test_the_lists_of_uncovered_templates_are_exact holds the lists."""
    if not templates_dir().is_dir():
        return []  # real_artifacts fails the test that reads the corpus
    names = [p.name for p in _template_files() if p.name not in NOT_RENDERED and p.name not in NOT_COVERED]
    return [pytest.param(name, n, id=f"{name}-{n}") for name in names for n in (1, 2)]


@pytest.mark.parametrize(("name", "num_calls"), _round_trip_cases())
def test_round_trip(name: str, num_calls: int) -> None:
    if num_calls == 2 and name in ONE_CALL:
        # Such a template writes the first call only (or refuses two): that is what holds.
        rendered = _rendered(name, 2)
        assert isinstance(rendered, str) or CALLS[1][0] not in rendered[0], ONE_CALL[name]
        return
    assert _check(name, num_calls)


# -- tool_choice = "required" / a named function: the forced text is what the parser reads --

_FORCED_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]

#: format -> a text its grammar (both tools, parallel) accepts: get_weather(city="Paris", unit="c"), get_time().
FORCED = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; '
                   '{"name": "get_time", "parameters": {}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
               '{"name": "get_time", "arguments": {}}]',
    "json_list": '<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
                 '{"name": "get_time", "arguments": {}}]</tool_calls>',
    "command_r": '<|START_ACTION|>[{"tool_name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}, '
                 '{"tool_name": "get_time", "parameters": {}}]<|END_ACTION|>',
    "deepseek": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "unit": "c"}'
                '<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "kimi_k2": '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
               '{"city": "Paris", "unit": "c"}<|tool_call_end|><|tool_call_begin|>functions.get_time:0'
               '<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>',
    "solar": '<|tool_calls|><|tool_call:begin|>call<|tool_call:name|>get_weather<|tool_call:args|>'
             '{"city": "Paris", "unit": "c"}<|tool_call:end|><|tool_call:begin|>call<|tool_call:name|>get_time'
             '<|tool_call:args|>{}<|tool_call:end|><|calls|>',
    "functionary_v3_1": '<function=get_weather>{"city": "Paris", "unit": "c"}</function><function=get_time>{}</function>',
    "functionary_v3_2": 'get_weather\n{"city": "Paris", "unit": "c"}>>>get_time\n{}',
    "harmony": '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "unit": "c"}',
    "glm": '<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>"Paris"</arg_value>\n<arg_key>unit</arg_key>\n'
           '<arg_value>"c"</arg_value>\n</tool_call>\n<tool_call>get_time\n</tool_call>',
    "hunyuan": '<tool_calls:opensource>\n<tool_call:opensource>get_weather<tool_sep:opensource>\n'
               '<arg_key:opensource>city</arg_key:opensource>\n<arg_value:opensource>"Paris"</arg_value:opensource>\n'
               '<arg_key:opensource>unit</arg_key:opensource>\n<arg_value:opensource>"c"</arg_value:opensource>\n'
               '</tool_call:opensource>\n<tool_call:opensource>get_time<tool_sep:opensource>\n'
               '</tool_call:opensource>\n</tool_calls:opensource>',
    "qwen_xml": '<tool_call>\n<function=get_weather>\n<parameter=city>\n"Paris"\n</parameter>\n<parameter=unit>\n"c"\n'
                '</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>',
    "minimax_xml": '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">"Paris"</parameter>\n'
                   '<parameter name="unit">"c"</parameter>\n</invoke>\n<invoke name="get_time">\n</invoke>\n'
                   '</minimax:tool_call>',
    "kimi_k3": '<|open|>tools<|sep|><|open|>call tool="get_weather" index="0"<|sep|><|open|>argument key="city" '
               'type="json"<|sep|>"Paris"<|close|>argument<|sep|><|open|>argument key="unit" type="json"<|sep|>"c"'
               '<|close|>argument<|sep|><|close|>call<|sep|><|open|>call tool="get_time" index="0"<|sep|>'
               '<|close|>call<|sep|><|close|>tools<|sep|>',
    "muse": ' to=functions<|message|><atem:function_calls>\n<atem:invoke name="get_weather">\n'
            '<atem:parameter name="city">"Paris"</atem:parameter>\n<atem:parameter name="unit">"c"</atem:parameter>\n'
            '</atem:invoke>\n<atem:invoke name="get_time">\n</atem:invoke>\n</atem:function_calls>',
    "minimax_m3": '<tool_call>\n<invoke name="get_weather"><city>"Paris"</city><unit>"c"</unit></invoke>\n'
                  '<invoke name="get_time"></invoke>\n</tool_call>',
    "gigachat": '<|function_call|>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}',
    "minicpm": '<function name="get_weather"><param name="city">"Paris"</param><param name="unit">"c"</param>'
               '</function>\n<function name="get_time"></function>',
    "pythonic": '<|tool_call_start|>[get_weather(city="Paris", unit="c", ), get_time()]<|tool_call_end|>',
    "gemma4": '<|tool_call>call:get_weather{"city": "Paris", "unit": "c"}<tool_call|><|tool_call>call:get_time{}'
              '<tool_call|>',
    "dsml": '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="false">'
            '"Paris"</｜DSML｜parameter>\n<｜DSML｜parameter name="unit" string="false">"c"</｜DSML｜parameter>\n'
            '</｜DSML｜invoke>\n<｜DSML｜invoke name="get_time">\n</｜DSML｜invoke>\n</｜DSML｜function_calls>',
}


def test_every_format_has_a_forced_example() -> None:
    from core_engine.chat.formats import TOOL_CALL_FORMATS

    assert set(FORCED) == set(TOOL_CALL_FORMATS)


@pytest.mark.parametrize("fmt", sorted(FORCED))
def test_the_forced_grammar_writes_what_the_parser_reads(fmt: str) -> None:
    llguidance = pytest.importorskip("llguidance")
    from core_engine.chat.tool_grammar import tool_call_grammar

    tokenizer = llguidance.LLTokenizer("byte")
    for parallel in (False, True):
        grammar = llguidance.LLMatcher.grammar_from_lark(tool_call_grammar(fmt, _FORCED_TOOLS, parallel=parallel))
        assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    text = FORCED[fmt]
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    assert matcher.consume_tokens(tokenizer.tokenize_str(text)), matcher.get_error()
    assert matcher.is_accepting(), text
    want = [("get_weather", {"city": "Paris", "unit": "c"})]
    one_call = fmt in ("harmony", "gigachat")  # one call per message
    if not one_call:
        want.append(("get_time", {}))
    for pieces in _splits(text):
        _, content, calls = _parse(ChatFormat(tool_calls=fmt), False, pieces)  # type: ignore[arg-type]
        assert (content, calls) == ("", want), pieces
    # Without parallel calls the grammar stops after the first: the two-call text is refused.
    single = llguidance.LLMatcher(
        tokenizer, llguidance.LLMatcher.grammar_from_lark(tool_call_grammar(fmt, _FORCED_TOOLS, parallel=False))
    )
    accepted = single.consume_tokens(tokenizer.tokenize_str(text)) and single.is_accepting()
    assert accepted == one_call


# -- markers that are special tokens reach the parsers ------------------------------------


class _Vocab:
    """A toy vocabulary: [TOOL_CALLS] and <|channel|> special markers, </s> (EOS) and
    <|call|> (a stop token and a marker), <|im_start|> a special non-marker."""

    pieces = [b"[TOOL_CALLS]", b"a", b"</s>", b"<|im_start|>", b"<|call|>", b"<|channel|>"]
    special = {0, 2, 3, 4, 5}
    eos_token_id = 2
    stop_token_ids = frozenset({2, 4})

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special

    def token_to_bytes(self, token_id: int, *, skip_special: bool = True) -> bytes:
        return b"" if skip_special and token_id in self.special else self.pieces[token_id]


def test_special_marker_tokens_reach_the_parser_text() -> None:
    from core_engine.tokenizer.detokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(_Vocab(), skip_special=True)  # type: ignore[arg-type]
    assert detok.add_many([0, 1, 3, 5, 1, 4, 2]) == "[TOOL_CALLS]a<|channel|>a"
    assert IncrementalDetokenizer(_Vocab(), skip_special=False).add_many([0, 3, 2]) == "[TOOL_CALLS]<|im_start|></s>"  # type: ignore[arg-type]


PLAIN = 'Plain answer — é ☕: a < b, [x] {"y": 1} >> z <|not a marker|> </done>'


@pytest.mark.parametrize("fmt", sorted(FORCED))
def test_an_answer_without_calls_is_content_unchanged(fmt: str) -> None:
    text = ("all\n" if fmt == "functionary_v3_2" else "") + PLAIN  # v3.2 names the recipient first
    for pieces in _splits(text):
        _, content, calls = _parse(ChatFormat(tool_calls=fmt), False, pieces)  # type: ignore[arg-type]
        assert (content, calls) == (PLAIN, []), pieces
