"""The grammar that makes ``tool_choice = "required"`` (or a named function) always valid.

llguidance compiles it like any other constraint (``structured_outputs.grammar``, errors
naming ``tool_choice``): Lark rules for the format's framing around an embedded JSON Schema
(``%json``) per call - ``{"name": <one of the offered functions>, "arguments": <that
function's parameters schema>}``, laid out on one line (``", "`` and ``": "``); formats that
write the name outside the JSON (DeepSeek, Kimi K2, harmony, functionary, ...) get the name as
a literal and the parameters schema as the JSON, XML-style formats (GLM, Qwen3-Coder, MiniMax,
DSML) one ``%json`` per parameter value. With ``parallel_tool_calls`` several calls may follow
each other; without it, exactly one (harmony: always one, its output stops at ``<|call|>``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["tool_call_grammar"]


def _call_schema(tool: Mapping[str, Any], args_key: str, name_key: str = "name") -> dict[str, Any]:
    function = tool["function"]
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {name_key: {"const": function["name"]}, args_key: parameters},
        "required": [name_key, args_key],
        "additionalProperties": False,
    }


def _lark(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


_COMPACT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def _json_rule(name: str, schema: Mapping[str, Any]) -> str:
    # One layout, as the fallback prompt shows it: a small model given free whitespace can
    # spend its whole max_tokens on newlines inside the object.
    return f"{name}: %json " + json.dumps({**schema, "x-guidance": _COMPACT}, ensure_ascii=False)


def _parameters(tool: Mapping[str, Any]) -> dict[str, Any]:
    return dict(tool["function"].get("parameters") or {"type": "object", "properties": {}})


#: Formats that write a call's name, then its arguments as one JSON object, between markers:
#: format -> (before the calls, before a name, between name and arguments, after a call,
#: after the calls). Calls follow each other directly.
_MARKED: dict[str, tuple[str, str, str, str, str]] = {
    "deepseek": ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
                 "<｜tool▁calls▁end｜>"),
    "kimi_k2": ("<|tool_calls_section_begin|>", "<|tool_call_begin|>functions.", ":0<|tool_call_argument_begin|>",
                "<|tool_call_end|>", "<|tool_calls_section_end|>"),
    "solar": ("<|tool_calls|>", "<|tool_call:begin|>call<|tool_call:name|>", "<|tool_call:args|>", "<|tool_call:end|>",
              "<|calls|>"),
    "functionary_v3_1": ("", "<function=", ">", "</function>", ""),
    # The generation prompt ends with ">>>": the first recipient follows it.
    "functionary_v3_2": ("", "", "\n", "", ""),
    # One call per message (the output stops at <|call|>); the prompt ends "<|start|>assistant".
    # <|call|> (a stop token) is left to the model: the grammar ends with the arguments.
    "harmony": ("", "<|channel|>commentary to=functions.", " <|constrain|>json<|message|>", "", ""),
    # Gemma 4 writes its own object notation; the forced arguments are JSON, which it reads too.
    "gemma4": ("", "<|tool_call>call:", "", "<tool_call|>", ""),
}

#: Formats that write each argument between markers, its value as text: format ->
#: (before the calls, before a name, after the name, before a key, between key and value,
#: after a value, after a call, after the calls). Values are written as JSON (the parsers
#: decode a value that is JSON; a string stays quoted JSON and decodes to itself).
_XML: dict[str, tuple[str, str, str, str, str, str, str, str]] = {
    "glm": ("", "<tool_call>", "\n", "<arg_key>", "</arg_key>\n<arg_value>", "</arg_value>\n", "</tool_call>", ""),
    "hunyuan": ("<tool_calls:opensource>\n", "<tool_call:opensource>", "<tool_sep:opensource>\n",
                "<arg_key:opensource>", "</arg_key:opensource>\n<arg_value:opensource>", "</arg_value:opensource>\n",
                "</tool_call:opensource>\n", "</tool_calls:opensource>"),
    "qwen_xml": ("", "<tool_call>\n<function=", ">\n", "<parameter=", ">\n", "\n</parameter>\n",
                 "</function>\n</tool_call>", ""),
    "minimax_xml": ("<minimax:tool_call>\n", '<invoke name="', '">\n', '<parameter name="', '">', "</parameter>\n",
                    "</invoke>\n", "</minimax:tool_call>"),
    "kimi_k3": ("<|open|>tools<|sep|>", '<|open|>call tool="', '" index="0"<|sep|>', '<|open|>argument key="',
                '" type="json"<|sep|>', "<|close|>argument<|sep|>", "<|close|>call<|sep|>", "<|close|>tools<|sep|>"),
    # muse: one call message (its header follows the prompt's "<|start|>assistant").
    "muse": (" to=functions<|message|><atem:function_calls>\n", '<atem:invoke name="', '">\n',
             '<atem:parameter name="', '">', "</atem:parameter>\n", "</atem:invoke>\n", "</atem:function_calls>"),
    # MiniMax M3 writes a tag per key ("{key}": the key); the ]<]minimax[>[ separators between
    # tags are left out (the parser drops them).
    "minimax_m3": ("<tool_call>\n", '<invoke name="', '">', "<", ">", "</{key}>", "</invoke>\n", "</tool_call>"),
    "minicpm": ("", '<function name="', '">', '<param name="', '">', "</param>", "</function>", ""),
    # Python keyword arguments (a trailing ", " is valid Python); JSON values, decoded as JSON.
    "pythonic": ("<|tool_call_start|>[", "", "(", "", "=", ", ", ")", "]<|tool_call_end|>"),
    "dsml": ("<｜DSML｜function_calls>\n", '<｜DSML｜invoke name="', '">\n', '<｜DSML｜parameter name="',
             '" string="false">', "</｜DSML｜parameter>\n", "</｜DSML｜invoke>\n", "</｜DSML｜function_calls>"),
}


def _repeat(rule: str, parallel: bool, separator: str = "") -> str:
    if not parallel:
        return rule
    return f"{rule} ({_lark(separator)} {rule})*" if separator else f"{rule}+"


def _marked(fmt: str, tools: Sequence[Mapping[str, Any]], parallel: bool) -> str:
    before, name_open, name_close, call_close, after = _MARKED[fmt]
    rules, alternatives = [], []
    for i, tool in enumerate(tools):
        rules.append(_json_rule(f"args_{i}", _parameters(tool)))
        parts = [_lark(name_open + tool["function"]["name"] + name_close), f"args_{i}"]
        if call_close:
            parts.append(_lark(call_close))
        alternatives.append(" ".join(parts))
    separator = ">>>" if fmt == "functionary_v3_2" else ""
    framing = [_lark(before)] if before else []
    framing.append(_repeat("call", parallel and fmt != "harmony", separator))
    if after:
        framing.append(_lark(after))
    return "\n".join([f"start: {' '.join(framing)}", "call: " + " | ".join(alternatives), *rules])


def _xml(fmt: str, tools: Sequence[Mapping[str, Any]], parallel: bool) -> str:
    before, name_open, name_close, key_open, key_close, value_close, call_close, after = _XML[fmt]
    rules, alternatives = [], []
    for i, tool in enumerate(tools):
        parameters = _parameters(tool)
        properties = parameters.get("properties") or {}
        required = set(parameters.get("required") or ())
        parts = [_lark(name_open + tool["function"]["name"] + name_close)]
        for j, (key, schema) in enumerate(properties.items()):
            rules.append(_json_rule(f"v_{i}_{j}", schema if isinstance(schema, Mapping) else {}))
            arg = f"{_lark(key_open + key + key_close)} v_{i}_{j} {_lark(value_close.replace('{key}', key))}"
            parts.append(arg if key in required else f"({arg})?")
        parts.append(_lark(call_close))
        alternatives.append(" ".join(parts))
    framing = [_lark(before)] if before else []
    separator = {"glm": "\n", "qwen_xml": "\n", "minicpm": "\n", "pythonic": ", "}.get(fmt, "")
    framing.append(_repeat("call", parallel, separator))
    if after:
        framing.append(_lark(after))
    return "\n".join([f"start: {' '.join(framing)}", "call: " + " | ".join(alternatives), *rules])


def tool_call_grammar(fmt: str, tools: Sequence[Mapping[str, Any]], *, parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) for one or more calls of ``tools`` in ``fmt``.

    Every format of :data:`~core_engine.chat.formats.TOOL_CALL_FORMATS` has one, in a layout
    its parser reads: the model's own syntax, except where one format name covers several
    (``json_list`` forces ``<tool_calls>[...]</tool_calls>``, ``command_r``
    ``<|START_ACTION|>[...]<|END_ACTION|>``, ``deepseek`` V3.1's layout, ``gigachat``
    GigaChat 3.1's ``<|function_call|>``), and Gemma 4, whose arguments are forced as JSON
    rather than its own object notation (its parser reads both). XML-style formats
    write each value as JSON (a string quoted), which their parsers decode; optional
    parameters are optional and in the schema's order, required ones always written."""
    if fmt in _MARKED:
        return _marked(fmt, tools, parallel)
    if fmt in _XML:
        return _xml(fmt, tools, parallel)
    name_key, args_key = "name", "parameters" if fmt == "llama3_json" else "arguments"
    if fmt == "command_r":
        name_key, args_key = "tool_name", "parameters"
    schemas = [_call_schema(tool, args_key, name_key) for tool in tools]
    schema: dict[str, Any] = dict(schemas[0]) if len(schemas) == 1 else {"anyOf": schemas}
    body = _json_rule("body", schema)
    if fmt == "hermes":
        call = f"call: {_lark('<tool_call>' + chr(10))} body {_lark(chr(10) + '</tool_call>')}"
        start = f"start: call ({_lark(chr(10))} call)*" if parallel else "start: call"
    elif fmt == "llama3_json":
        call = "call: body"
        start = f"start: call ({_lark('; ')} call)*" if parallel else "start: call"
    elif fmt == "gigachat":  # one call per message
        call = "call: body"
        start = f"start: {_lark('<|function_call|>')} call"
    elif fmt in ("mistral", "json_list", "command_r"):
        opening, closing = {
            "mistral": ("[TOOL_CALLS][", "]"),
            "json_list": ("<tool_calls>[", "]</tool_calls>"),
            "command_r": ("<|START_ACTION|>[", "]<|END_ACTION|>"),
        }[fmt]
        call = "call: body"
        more = f" ({_lark(', ')} call)*" if parallel else ""
        start = f"start: {_lark(opening)} call{more} {_lark(closing)}"
    else:
        raise ValueError(f"unknown tool-call format {fmt!r}")
    return "\n".join((start, call, body))
