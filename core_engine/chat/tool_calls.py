"""Tool calls parsed out of a model's output text as it streams, one parser per format.

Each parser is fed text deltas and answers :class:`ParsedDelta`\\ s: the content to show and
:class:`ToolCallDelta`\\ s shaped as OpenAI streams them - the first delta of a call carries
its ``index``, ``id`` and ``name`` (and empty ``arguments``), the next ones argument
fragments, so ``"".join(fragments)`` is the call's ``arguments`` text as the model wrote it.
Arguments stream as they are generated (the JSON structure is tracked character by character,
strings and escapes included), not when the call is complete.

Formats (:mod:`core_engine.chat.formats` picks one from the chat template):

- ``hermes`` (Hermes, Qwen 2.5/3, and infermux's fallback prompt):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call;
- ``llama3_json`` (Llama 3.1+): the answer *is* a JSON object ``{"name": ..., "parameters":
  {...}}`` (optionally after ``<|python_tag|>``), several separated by ``;``;
- ``mistral``: ``[TOOL_CALLS]`` followed by a JSON array of calls (v3 tokenizers) or by
  ``name[ARGS]{...}`` (v11+ tokenizers).

Formats read a whole call at a time (its header and arguments go out when the call is
complete; the JSON of a call is still tracked so a marker inside a string is text):

- ``deepseek`` (V3/V3.1/R1 ``<｜tool▁calls▁begin｜>...<｜tool▁sep｜>...``), ``kimi_k2``
  (``<|tool_calls_section_begin|>``), ``solar`` (``<|tool_call:begin|>``), ``functionary_v3_1``
  (``<function=NAME>{...}</function>``), ``functionary_v3_2`` (``>>>NAME`` newline ``{...}``), ``harmony``
  (gpt-oss: messages ``to=functions.NAME ... <|message|>{...}<|call|>``, ``final`` as content);
- ``json_list`` / ``command_r``: JSON calls in a section (``<tool_calls>[...]``, ``<TOOLCALL>``,
  ``<|tool_call|>``, ``<|tools_prefix|>``, ``<|START_ACTION|>``, ``Action: ```json``);
- XML-style arguments, each value JSON when it parses (else a Python literal, else text):
  ``glm`` (``<arg_key>``/``<arg_value>``), ``hunyuan`` (the same, ``:opensource`` tags),
  ``qwen_xml`` (``<function=NAME><parameter=K>``), ``minimax_xml`` / ``dsml`` / ``muse``
  (``<invoke name=...><parameter name=...>``), ``minicpm`` (``<function name=...><param
  name=...>``), ``kimi_k3`` (``<|open|>call tool=...`` blocks), ``minimax_m3`` (a tag per key);
- ``gigachat`` (``<|function_call|>{...}``), ``pythonic`` (LFM2: ``[NAME(k=v, ...)]``),
  ``gemma4`` (``<|tool_call>call:NAME{k:<|"|>v<|"|>}<tool_call|>``).

Whitespace next to a tool call is dropped (templates put newlines around the tags); text that
is not a well-formed call stays content when nothing of the call was streamed yet.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from core_engine.chat.reasoning import held_back

__all__ = ["ParsedDelta", "ToolCallDelta", "ToolCallParser", "make_tool_call_parser", "new_tool_call_id"]


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """One piece of one tool call (OpenAI's ``delta.tool_calls[i]``)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: ParsedDelta) -> None:
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


class _CallScanner:
    """Tracks one JSON call object ``{"name": ..., <args key>: ...}`` character by character.

    Knows, at any point, the call's name (once its string closed) and how much of the
    arguments value is final text (all of an open object or array so far; a string or scalar
    value only once it ends). A repeated ``name`` or arguments key (unconstrained output) is
    ignored: the first ones may have streamed already, and a split must not change the call.
    """

    def __init__(self, args_keys: tuple[str, ...]) -> None:
        self.args_keys = args_keys
        self.buf: list[str] = []
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.string_start = 0
        self.after_colon = False
        self.key: str | None = None
        self.value_start: int | None = None
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.args_is_string = False
        self.is_done = False
        self.is_failed = False

    @property
    def text(self) -> str:
        return "".join(self.buf)

    def feed(self, text: str) -> int:
        """Consume characters until the object closes; returns how many were consumed."""
        for offset, char in enumerate(text):
            self._char(char)
            if self.is_done or self.is_failed:
                return offset + 1
        return len(text)

    def _end_value(self, end: int) -> None:
        start, key = self.value_start, self.key
        if start is not None and key is not None:
            raw = "".join(self.buf[start:end])
            if key == "name" and raw.startswith('"') and self.name is None:
                try:
                    name = json.loads(raw)
                except ValueError:
                    name = None
                self.name = name if isinstance(name, str) else None
            elif key in self.args_keys and start == self.args_start:
                self.args_end = end
                self.args_is_string = raw.startswith('"')
        self.key, self.value_start, self.after_colon = None, None, False

    def _char(self, char: str) -> None:
        i = len(self.buf)
        self.buf.append(char)
        if self.in_string:
            if self.escape:
                self.escape = False
            elif char == "\\":
                self.escape = True
            elif char == '"':
                self.in_string = False
                if self.depth == 1:
                    if self.after_colon:
                        self._end_value(i + 1)
                    else:
                        try:
                            self.key = json.loads("".join(self.buf[self.string_start : i + 1]))
                        except ValueError:
                            self.key = None
            return
        if char.isspace():
            return
        if self.depth == 0:
            if char == "{":
                self.depth = 1
            else:
                self.is_failed = True
            return
        if self.depth == 1 and self.after_colon and self.value_start is None:
            self.value_start = i
            # The first arguments value is the call's: it may have streamed already, so a
            # repeated key (unconstrained output) must not restart it under the same index.
            if self.key in self.args_keys and self.args_start is None:
                self.args_start = i
        if char == '"':
            self.in_string, self.string_start = True, i
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            if self.depth == 1 and self.after_colon:
                self._end_value(i + 1)
            elif self.depth == 0:
                if self.after_colon:  # a scalar value ends at the object's end
                    self._end_value(self._last_non_space(i))
                self.is_done = True
        elif self.depth == 1 and char == ":":
            self.after_colon = True
        elif self.depth == 1 and char == ",":
            if self.after_colon:
                self._end_value(self._last_non_space(i))

    def _last_non_space(self, end: int) -> int:
        while end > 0 and self.buf[end - 1].isspace():
            end -= 1
        return end

    def args_available(self) -> int | None:
        """End of the arguments text that is final, or None while none is."""
        if self.args_start is None:
            return None
        if self.args_end is not None:
            return self.args_end
        if self.buf[self.args_start] in "{[":
            return len(self.buf)
        return None


class _JsonValueScanner:
    """Tracks one JSON object or array (Mistral's ``[ARGS]`` value) to its end."""

    def __init__(self) -> None:
        self.buf: list[str] = []
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.is_done = False
        self.is_failed = False

    def feed(self, text: str) -> int:
        for offset, char in enumerate(text):
            if self.in_string:
                self.buf.append(char)
                if self.escape:
                    self.escape = False
                elif char == "\\":
                    self.escape = True
                elif char == '"':
                    self.in_string = False
                continue
            if self.depth == 0 and char.isspace():
                continue
            if self.depth == 0 and char not in "{[":
                self.is_failed = True
                return offset + 1
            self.buf.append(char)
            if char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.is_done = True
                    return offset + 1
        return len(text)


class ToolCallParser:
    """Base: content handling (whitespace next to calls dropped) and call bookkeeping."""

    def __init__(self, make_id: Callable[[], str] = new_tool_call_id) -> None:
        self._make_id = make_id
        self._buffer = ""
        self._space = ""  # trailing whitespace of content, held until more content follows
        self.num_calls = 0
        # The call being streamed: its scanner, whether its header went out, args sent so far.
        self._scanner: _CallScanner | None = None
        self._header_sent = False
        self._args_sent = 0

    # -- content ----------------------------------------------------------------------
    def _content(self, out: ParsedDelta, text: str) -> None:
        if not text:
            return
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        out.content += body

    def _drop_space(self) -> None:
        self._space = ""

    # -- calls ------------------------------------------------------------------------
    def _start_call(self, args_keys: tuple[str, ...]) -> None:
        self._drop_space()
        self._scanner = _CallScanner(args_keys)
        self._header_sent = False
        self._args_sent = 0

    def _stream_call(self, out: ParsedDelta, *, final: bool = False) -> None:
        scanner = self._scanner
        assert scanner is not None
        if not self._header_sent and scanner.name is not None and (scanner.args_start is not None or final):
            out.tool_calls.append(ToolCallDelta(index=self.num_calls, id=self._make_id(), name=scanner.name))
            self._header_sent = True
        if not self._header_sent:
            return
        if scanner.args_is_string and scanner.args_end is not None:
            if self._args_sent == 0:
                raw = scanner.text[scanner.args_start : scanner.args_end]
                try:
                    decoded = json.loads(raw)
                except ValueError:
                    decoded = raw
                out.tool_calls.append(ToolCallDelta(index=self.num_calls, arguments=str(decoded)))
                self._args_sent = len(raw)
            return
        end = scanner.args_available()
        if end is None:
            if final and self._args_sent == 0 and scanner.args_start is None:
                out.tool_calls.append(ToolCallDelta(index=self.num_calls, arguments="{}"))
                self._args_sent = 2
            return
        assert scanner.args_start is not None
        start = scanner.args_start + self._args_sent
        if end > start:
            out.tool_calls.append(ToolCallDelta(index=self.num_calls, arguments=scanner.text[start:end]))
            self._args_sent = end - scanner.args_start

    def _end_call(self, out: ParsedDelta, opening: str, *, require_args: bool) -> bool:
        """Close the scanned call: True if it was one (streamed), False if it is content."""
        scanner = self._scanner
        assert scanner is not None
        self._scanner = None
        is_call = scanner.is_done and scanner.name is not None and (scanner.args_start is not None or not require_args)
        if self._header_sent or is_call:
            self._scanner = scanner
            self._stream_call(out, final=True)
            self._scanner = None
            self.num_calls += 1
            return True
        out.content += opening + scanner.text  # not a call: what the model wrote, verbatim
        return False

    def _flush_call(self, out: ParsedDelta, opening: str) -> None:
        """The output ended inside a call: finish what was streamed, else give it back as text."""
        assert self._scanner is not None
        self._stream_call(out, final=True)
        if self._header_sent:
            self.num_calls += 1
        else:
            out.content += opening + self._scanner.text
        self._scanner = None

    def _flush_content(self, out: ParsedDelta) -> None:
        """The output ended in content: what was held back (trailing space only without calls)."""
        out.content += self._space + self._buffer if not self.num_calls else self._buffer.rstrip()

    def feed(self, delta: str) -> ParsedDelta:
        raise NotImplementedError

    def finish(self) -> ParsedDelta:
        raise NotImplementedError


class HermesToolCallParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, repeated."""

    START = "<tool_call>"
    END = "</tool_call>"

    def __init__(self, make_id: Callable[[], str] = new_tool_call_id) -> None:
        super().__init__(make_id)
        self._state = "content"

    def feed(self, delta: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buffer += delta
        while self._buffer:
            if self._state == "content":
                index = self._buffer.find(self.START)
                if index >= 0:
                    self._content(out, self._buffer[:index])
                    self._buffer = self._buffer[index + len(self.START):]
                    self._start_call(("arguments", "parameters"))
                    self._state = "call"
                    continue
                keep = held_back(self._buffer, self.START)
                self._content(out, self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            if self._state == "call":
                assert self._scanner is not None
                used = self._scanner.feed(self._buffer)
                self._buffer = self._buffer[used:]
                self._stream_call(out)
                if self._scanner.is_done or self._scanner.is_failed:
                    was_call = self._end_call(out, self.START, require_args=False)
                    self._state = "after" if was_call else "content"
                continue
            # after a call: its closing tag, whitespace
            stripped = self._buffer.lstrip()
            if not stripped:
                self._buffer = ""
                break
            if stripped.startswith(self.END):
                self._buffer = stripped[len(self.END):].lstrip()
                self._state = "content"
                continue
            if self.END.startswith(stripped):
                self._buffer = stripped
                break
            self._buffer = stripped
            self._state = "content"
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._state == "call" and self._scanner is not None:
            self._flush_call(out, self.START)
        elif self._state == "content":
            self._flush_content(out)
        self._buffer, self._space = "", ""
        return out


class Llama3JsonToolCallParser(ToolCallParser):
    """An answer that is ``{"name": ..., "parameters": ...}`` (``; `` between several)."""

    TAG = "<|python_tag|>"

    def __init__(self, make_id: Callable[[], str] = new_tool_call_id) -> None:
        super().__init__(make_id)
        self._state = "start"
        self._opening = ""

    def feed(self, delta: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buffer += delta
        while self._buffer:
            if self._state == "start":
                stripped = self._buffer.lstrip()
                if not stripped:
                    break
                if stripped.startswith(self.TAG):
                    self._opening += self._buffer[: len(self._buffer) - len(stripped) + len(self.TAG)]
                    self._buffer = stripped[len(self.TAG):]
                    continue
                if self.TAG.startswith(stripped):
                    break
                if stripped.startswith("{"):
                    self._buffer = stripped
                    self._start_call(("parameters", "arguments"))
                    self._state = "call"
                    continue
                self._state = "content"
                self._buffer = (self._opening + self._buffer) if not self.num_calls else stripped
                self._opening = ""
                continue
            if self._state == "between":
                stripped = self._buffer.lstrip()
                if not stripped:
                    self._buffer = ""
                    break
                self._state = "start" if stripped.startswith(";") else "content"
                self._buffer = stripped[1:] if stripped.startswith(";") else stripped
                continue
            if self._state == "call":
                assert self._scanner is not None
                used = self._scanner.feed(self._buffer)
                self._buffer = self._buffer[used:]
                self._stream_call(out)
                if self._scanner.is_done or self._scanner.is_failed:
                    was_call = self._end_call(out, self._opening, require_args=True)
                    self._opening = ""
                    self._state = "between" if was_call else "content"
                continue
            self._content(out, self._buffer)
            self._buffer = ""
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._state == "call" and self._scanner is not None:
            self._flush_call(out, self._opening)
        elif self._state in ("start", "content"):
            out.content += self._space + (self._opening if not self.num_calls else "") + self._buffer
        self._buffer, self._space = "", ""
        return out


class MistralToolCallParser(ToolCallParser):
    """``[TOOL_CALLS][{"name": ..., "arguments": ...}, ...]`` or ``[TOOL_CALLS]name[ARGS]{...}``."""

    START = "[TOOL_CALLS]"
    ARGS = "[ARGS]"

    def __init__(self, make_id: Callable[[], str] = new_tool_call_id) -> None:
        super().__init__(make_id)
        self._state = "content"
        self._name = ""
        self._value: _JsonValueScanner | None = None
        self._value_sent = 0

    def feed(self, delta: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buffer += delta
        while self._buffer:
            state = self._state
            if state == "content":
                index = self._buffer.find(self.START)
                if index >= 0:
                    self._content(out, self._buffer[:index])
                    self._drop_space()
                    self._buffer = self._buffer[index + len(self.START):]
                    self._state = "marker"
                    continue
                keep = held_back(self._buffer, self.START)
                self._content(out, self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            if state == "marker":  # after [TOOL_CALLS]: an array, or a name
                stripped = self._buffer.lstrip()
                if not stripped:
                    self._buffer = ""
                    break
                if stripped.startswith("["):
                    self._buffer = stripped[1:]
                    self._state = "array"
                else:
                    self._buffer = stripped
                    self._name = ""
                    self._state = "name"
                continue
            if state == "array":  # between elements
                stripped = self._buffer.lstrip()
                if stripped.startswith(","):
                    stripped = stripped[1:].lstrip()
                if not stripped:
                    self._buffer = ""
                    break
                if stripped.startswith("]"):
                    self._buffer = stripped[1:]
                    self._state = "content"
                    continue
                self._buffer = stripped
                self._start_call(("arguments", "parameters"))
                self._state = "element"
                continue
            if state == "element":
                assert self._scanner is not None
                used = self._scanner.feed(self._buffer)
                self._buffer = self._buffer[used:]
                self._stream_call(out)
                if self._scanner.is_done or self._scanner.is_failed:
                    was_call = self._end_call(out, self.START + "[", require_args=False)
                    self._state = "array" if was_call else "content"
                continue
            if state == "name":
                index = self._buffer.find(self.ARGS)
                brace = self._buffer.find("{")
                cut = min(i for i in (index, brace) if i >= 0) if max(index, brace) >= 0 else -1
                if cut < 0:
                    keep = held_back(self._buffer, self.ARGS)
                    self._name += self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    break
                self._name += self._buffer[:cut]
                self._buffer = self._buffer[cut + (len(self.ARGS) if cut == index else 0):]
                out.tool_calls.append(
                    # Mistral Small 3.2 writes ``name[CALL_ID]id[ARGS]``.
                    ToolCallDelta(index=self.num_calls, id=self._make_id(), name=self._name.split("[CALL_ID]")[0].strip())
                )
                self._value, self._value_sent = _JsonValueScanner(), 0
                self._state = "args"
                continue
            # args of the name[ARGS] form
            assert self._value is not None
            used = self._value.feed(self._buffer)
            self._buffer = self._buffer[used:]
            self._send_value(out)
            if self._value.is_done or self._value.is_failed:
                self._value = None
                self.num_calls += 1
                self._state = "content"
        return out

    def _send_value(self, out: ParsedDelta) -> None:
        assert self._value is not None
        text = "".join(self._value.buf)
        if len(text) > self._value_sent:
            out.tool_calls.append(ToolCallDelta(index=self.num_calls, arguments=text[self._value_sent:]))
            self._value_sent = len(text)

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._state == "element" and self._scanner is not None:
            self._stream_call(out, final=True)
            if self._header_sent:
                self.num_calls += 1
            self._scanner = None
        elif self._state == "args" and self._value is not None:
            self._send_value(out)
            self.num_calls += 1
        elif self._state == "content":
            self._flush_content(out)
        self._buffer, self._space = "", ""
        return out



# -- formats whose calls are read a whole call at a time --------------------------------------


def _decode_value(raw: str) -> Any:
    """A parameter value written as text (XML-style formats): JSON when it is, else a Python
    literal (templates that write ``{{ value }}`` of a dict), else the string itself."""
    text = raw.strip()
    if not text:
        return raw
    try:
        return json.loads(text)
    except ValueError:
        pass
    if text[0] in "{[('\"":
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            pass
    return raw


def _json_args(raw: str) -> str:
    """Arguments written as JSON: the text as the model wrote it (``{}`` when empty)."""
    text = raw.strip()
    if text.startswith("```"):
        text = text.removeprefix("```json").removeprefix("```").strip()
        text = text.removesuffix("```").strip()
    return text or "{}"


def _dumps(arguments: Mapping[str, Any]) -> str:
    return json.dumps(dict(arguments), ensure_ascii=False)


#: (name, arguments JSON text) of one complete call.
_Call = tuple[str, str]


class _SectionParser(ToolCallParser):
    """Content, then a tool section opened by one of :attr:`STARTS`, read one call at a time.

    Content streams (text that may be the start of a marker held back); inside the section
    :meth:`_step` reads the buffer: a complete call, the section's end, or "need more text".
    A call goes out (header, then its arguments) as soon as it is complete, so the result does
    not depend on how the text was cut. Text after the section is content again.
    """

    STARTS: tuple[str, ...] = ()

    def __init__(self, make_id: Callable[[], str] = new_tool_call_id) -> None:
        super().__init__(make_id)
        self._state = "content"
        self._strip_lead = False
        self._section = ""

    # -- subclass hooks -----------------------------------------------------------------
    def _step(self, buf: str, final: bool) -> tuple[int, _Call | None, bool] | None:
        """Read the section at ``buf``: ``(consumed, call or None, section ended)``, or None
        when more text is needed (``final``: no more will come)."""
        raise NotImplementedError

    # -- machinery ----------------------------------------------------------------------
    def _emit(self, out: ParsedDelta, call: _Call) -> None:
        name, arguments = call
        out.tool_calls.append(ToolCallDelta(index=self.num_calls, id=self._make_id(), name=name.strip()))
        out.tool_calls.append(ToolCallDelta(index=self.num_calls, arguments=arguments))
        self.num_calls += 1

    def _find_start(self, buf: str) -> tuple[int, str] | None:
        found = [(buf.find(m), m) for m in self.STARTS if m in buf]
        return min(found, key=lambda item: (item[0], -len(item[1]))) if found else None

    def _run(self, out: ParsedDelta, final: bool) -> None:
        while True:
            if self._state == "content":
                if self._strip_lead:
                    stripped = self._buffer.lstrip()
                    if not stripped:
                        self._buffer = ""
                        return
                    self._buffer, self._strip_lead = stripped, False
                start = self._find_start(self._buffer)
                if start is not None:
                    index, marker = start
                    self._content(out, self._buffer[:index])
                    self._drop_space()
                    self._buffer = self._buffer[index + len(marker):]
                    self._section = marker
                    self._state = "section"
                    continue
                keep = 0 if final else max((held_back(self._buffer, m) for m in self.STARTS), default=0)
                self._content(out, self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return
            step = self._step(self._buffer, final)
            if step is None:
                if final:
                    self._buffer = ""  # an unfinished call: nothing more of it can be read
                return
            used, call, ended = step
            self._buffer = self._buffer[used:]
            if call is not None:
                self._emit(out, call)
            if ended:
                self._state, self._strip_lead = "content", True

    def feed(self, delta: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buffer += delta
        self._run(out, final=False)
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        self._run(out, final=True)
        if self._state == "content":
            self._flush_content(out)
        self._buffer, self._space = "", ""
        return out


def _until(buf: str, ends: Sequence[str], final: bool) -> tuple[int, int] | None:
    """``(end of the text before the first of ends, end of that marker)``; at the end of the
    output the whole buffer; None while the marker may still come."""
    found = [(buf.find(e), e) for e in ends if e in buf]
    if found:
        index, end = min(found, key=lambda item: item[0])
        return index, index + len(end)
    return (len(buf), len(buf)) if final else None


class _MarkedCallsParser(_SectionParser):
    """Calls framed by markers: ``CALL_START name NAME_END arguments CALL_END``, repeated,
    in a section closed by ``SECTION_END`` (empty: calls follow each other directly)."""

    CALL_START = ""
    NAME_END = ""
    CALL_END: tuple[str, ...] = ()
    SECTION_END = ""

    def _name(self, header: str) -> str:
        return header

    def _json_end(self, body: str, final: bool) -> tuple[int, int] | None:
        """Arguments that are a JSON object end where it closes (a marker inside one of its
        strings is text), then the call's end marker: ``(end, after)`` as :func:`_until`; None
        while either may still come."""
        scanner = _JsonValueScanner()
        end = scanner.feed(body)
        if not scanner.is_done:
            return (len(body), len(body)) if final else None
        tail = body[end:]
        stripped = tail.lstrip()
        for marker in self.CALL_END:
            if stripped.startswith(marker):
                return end, end + len(tail) - len(stripped) + len(marker)
        if not final and any(m.startswith(stripped) for m in self.CALL_END):
            return None
        return _until(body, self.CALL_END, final)

    def _arguments(self, body: str) -> str:
        return _json_args(body)

    def _step(self, buf: str, final: bool) -> tuple[int, _Call | None, bool] | None:
        stripped = buf.lstrip()
        lead = len(buf) - len(stripped)
        if self.SECTION_END and stripped.startswith(self.SECTION_END):
            return lead + len(self.SECTION_END), None, True
        call_start = self.CALL_START or ""
        if call_start and not stripped.startswith(call_start):
            if not final and (call_start.startswith(stripped) or self.SECTION_END.startswith(stripped)):
                return None
            return (lead, None, True) if stripped or final else None
        rest = stripped[len(call_start):]
        name_end = rest.find(self.NAME_END)
        if name_end < 0:
            return (len(buf), None, True) if final else None
        body_start = name_end + len(self.NAME_END)
        body = rest[body_start:]
        is_json = body.lstrip().startswith("{")
        until = self._json_end(body, final) if is_json else _until(body, self.CALL_END, final)
        if until is None:
            return None
        end, after = until
        call = (self._name(rest[:name_end]), self._arguments(rest[body_start : body_start + end]))
        used = lead + len(call_start) + body_start + after
        return used, call, not self.SECTION_END and not self.CALL_START


class DeepSeekToolCallParser(_MarkedCallsParser):
    """DeepSeek V3/V3.1/R1: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
    <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``; V3/R1 write ``function<｜tool▁sep｜>NAME`` and
    the arguments in a ```` ```json ```` fence."""

    STARTS = ("<｜tool▁calls▁begin｜>",)
    CALL_START = "<｜tool▁call▁begin｜>"
    NAME_END = "<｜tool▁sep｜>"
    CALL_END = ("<｜tool▁call▁end｜>",)
    SECTION_END = "<｜tool▁calls▁end｜>"

    def _step(self, buf: str, final: bool) -> tuple[int, _Call | None, bool] | None:
        step = super()._step(buf, final)
        if step is not None and step[1] is not None:
            name, arguments = step[1]
            if name == "function":  # V3/R1: the call's type, then NAME and a fenced JSON
                raw = buf[: step[0]]
                body = raw.split(self.NAME_END, 1)[1]
                body = body.split(self.CALL_END[0], 1)[0]
                name, _, rest = body.partition("\n")
                step = step[0], (name.strip(), _json_args(rest)), step[2]
        return step


class KimiK2ToolCallParser(_MarkedCallsParser):
    """Kimi K2: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
    <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>``."""

    STARTS = ("<|tool_calls_section_begin|>",)
    CALL_START = "<|tool_call_begin|>"
    NAME_END = "<|tool_call_argument_begin|>"
    CALL_END = ("<|tool_call_end|>",)
    SECTION_END = "<|tool_calls_section_end|>"

    def _name(self, header: str) -> str:
        name = header.strip().removeprefix("functions.")
        head, sep, tail = name.rpartition(":")
        return head if sep and tail.isdigit() else name


class SolarToolCallParser(_MarkedCallsParser):
    """Solar Open: ``<|tool_calls|><|tool_call:begin|>ID<|tool_call:name|>NAME
    <|tool_call:args|>{...}<|tool_call:end|>...<|calls|>``."""

    STARTS = ("<|tool_calls|>",)
    CALL_START = "<|tool_call:begin|>"
    NAME_END = "<|tool_call:args|>"
    CALL_END = ("<|tool_call:end|>",)
    SECTION_END = "<|calls|>"

    def _name(self, header: str) -> str:
        return header.partition("<|tool_call:name|>")[2].strip()


class FunctionaryV31ToolCallParser(_MarkedCallsParser):
    """functionary v3.1 (Llama 3.1 based): ``<function=NAME>{...}</function>``, repeated."""

    STARTS = ("<function=",)
    NAME_END = ">"
    CALL_END = ("</function>",)


class FunctionaryV32ToolCallParser(_SectionParser):
    """functionary v3.2: ``>>>NAME\\n{...}`` per message, ``>>>all\\n`` for text. The prompt
    ends with ``>>>``, so the output starts with a recipient."""

    STARTS = (">>>",)

    def __init__(self, make_id: Callable[[], str] = new_tool_call_id) -> None:
        super().__init__(make_id)
        self._buffer = ">>>"  # the generation prompt's
        self._text = False

    def _run(self, out: ParsedDelta, final: bool) -> None:
        if self._text:  # inside ">>>all": content up to the next recipient
            index = self._buffer.find(">>>")
            if index < 0:
                keep = 0 if final else held_back(self._buffer, ">>>")
                self._content(out, self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return
            self._content(out, self._buffer[:index])
            self._buffer, self._text, self._state = self._buffer[index + 3:], False, "section"
        super()._run(out, final)

    def _step(self, buf: str, final: bool) -> tuple[int, _Call | None, bool] | None:
        self._text = False
        newline = buf.find("\n")
        if newline < 0:
            return (len(buf), None, True) if final else None
        name = buf[:newline].strip()
        if name == "all":
            self._text, self._state = True, "content"
            self._buffer = buf[newline + 1:]
            return 0, None, False
        scanner = _JsonValueScanner()
        body = buf[newline + 1:]
        used = scanner.feed(body)
        if scanner.is_failed:
            return newline + 1 + used, None, True
        if not scanner.is_done:
            return (len(buf), (name, "".join(scanner.buf) or "{}"), True) if final else None
        return newline + 1 + used, (name, "".join(scanner.buf)), True

    def _flush_content(self, out: ParsedDelta) -> None:
        if self._buffer == ">>>" and not self.num_calls:
            self._buffer = ""
        super()._flush_content(out)

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        self._run(out, final=True)
        if self._state == "content":
            self._flush_content(out)
        self._buffer, self._space = "", ""
        return out


class GlmToolCallParser(_SectionParser):
    """GLM 4.5+/4.6/4.7 (and Spark, Ling, Laguna): ``<tool_call>NAME<arg_key>K</arg_key>
    <arg_value>V</arg_value>...</tool_call>``; a value is JSON when it parses, else a string."""

    STARTS: tuple[str, ...] = ("<tool_call>",)
    END = "</tool_call>"
    KEY = ("<arg_key>", "</arg_key>")
    VALUE = ("<arg_value>", "</arg_value>")
    NAME_SEP = ""

    def _step(self, buf: str, final: bool) -> tuple[int, _Call | None, bool] | None:
        until = _until(buf, (self.END,), final)
        if until is None:
            return None
        end, after = until
        body = buf[:end]
        head, _, _ = body.partition(self.KEY[0])
        name = head.partition(self.NAME_SEP)[0] if self.NAME_SEP else head
        arguments: dict[str, Any] = {}
        rest = body[len(head):]
        while self.KEY[0] in rest:
            _, _, rest = rest.partition(self.KEY[0])
            key, _, rest = rest.partition(self.KEY[1])
            _, _, rest = rest.partition(self.VALUE[0])
            value, _, rest = rest.partition(self.VALUE[1])
            arguments[key.strip()] = _decode_value(value)
        return after, (name.strip(), _dumps(arguments)), True


class HunyuanToolCallParser(GlmToolCallParser):
    """Tencent Hunyuan (Hy3): GLM's layout with ``:opensource`` tags and ``<tool_sep:…>``."""

    END = "</tool_call:opensource>"
    KEY = ("<arg_key:opensource>", "</arg_key:opensource>")
    VALUE = ("<arg_value:opensource>", "</arg_value:opensource>")
    NAME_SEP = "<tool_sep:opensource>"
    SECTION = ("<tool_calls:opensource>", "</tool_calls:opensource>")

    STARTS = (SECTION[0], "<tool_call:opensource>")

    def _step(self, buf: str, final: bool) -> tuple[int, _Call | None, bool] | None:
        if self._section != self.SECTION[0]:
            return super()._step(buf, final)
        stripped = buf.lstrip()
        lead = len(buf) - len(stripped)
        for marker, ends in ((self.SECTION[1], True), (self.STARTS[1], False)):
            if stripped.startswith(marker):
                if ends:
                    return lead + len(marker), None, True
                step = super()._step(stripped[len(marker):], final)
                if step is None:
                    return None
                return lead + len(marker) + step[0], step[1], False
        if not final and any(m.startswith(stripped) for m in (self.SECTION[1], self.STARTS[1])):
            return None
        return lead, None, True



class _BlockParser(_SectionParser):
    """A section read whole (up to :attr:`END`), then its calls given out one per step."""

    END = ""

    def __init__(self, make_id: Callable[[], str] = new_tool_call_id) -> None:
        super().__init__(make_id)
        self._pending: list[_Call] = []

    def _calls(self, block: str) -> list[_Call]:
        """Every call of one complete section's text."""
        raise NotImplementedError

    def _step(self, buf: str, final: bool) -> tuple[int, _Call | None, bool] | None:
        if self._pending:
            return 0, self._pending.pop(0), not self._pending
        until = _until(buf, (self.END,), final)
        if until is None:
            return None
        end, after = until
        calls = self._calls(buf[:end])
        if not calls:
            return after, None, True
        self._pending = calls[1:]
        return after, calls[0], not self._pending


class _XmlParamsParser(_BlockParser):
    """``<function=NAME><parameter=K>V</parameter>...</function>`` and the ``<invoke name=...>``
    / ``<parameter name=...>`` layouts; one section may hold several invokes."""

    INVOKE = ""  # regex of an invoke's opening tag, group 1 the name
    INVOKE_END = ""
    PARAM = ""  # regex of a parameter's opening tag: group 1 the key, group 2 string="..."
    PARAM_END = ""

    def _calls(self, body: str) -> list[_Call]:
        calls = []
        for match in re.finditer(self.INVOKE, body):
            rest = body[match.end():]
            inner = rest.split(self.INVOKE_END, 1)[0]
            arguments: dict[str, Any] = {}
            for param in re.finditer(self.PARAM, inner):
                value = inner[param.end():].split(self.PARAM_END, 1)[0]
                is_string = param.lastindex is not None and param.lastindex >= 2 and param.group(2) == "true"
                if not is_string:
                    value = _decode_value(value.removeprefix("\n").removesuffix("\n"))
                arguments[param.group(1)] = value
            calls.append((match.group(1), _dumps(arguments)))
        return calls


class QwenXmlToolCallParser(_XmlParamsParser):
    """Qwen3-Coder / Qwen3.5 / Nemotron 3 / Step 3.5 / Seed-OSS: ``<tool_call>\\n<function=NAME>
    \\n<parameter=K>\\nV\\n</parameter>\\n</function>\\n</tool_call>``."""

    STARTS = ("<tool_call>", "<seed:tool_call>")
    END = "</tool_call>"
    INVOKE = r"<function=([^>\n]+)>"
    INVOKE_END = "</function>"
    PARAM = r"<parameter=([^>\n]+)>"
    PARAM_END = "</parameter>"

    def _step(self, buf: str, final: bool) -> tuple[int, _Call | None, bool] | None:
        self.END = "</seed:tool_call>" if self._section == "<seed:tool_call>" else "</tool_call>"
        return super()._step(buf, final)


class InvokeXmlToolCallParser(_XmlParamsParser):
    """MiniMax M2 (``<minimax:tool_call>``) and DeepSeek V3.2/V4 DSML (``<｜DSML｜function_calls>``
    / ``<｜DSML｜tool_calls>``): ``<invoke name="NAME"><parameter name="K" [string="true"]>V
    </parameter>...</invoke>``; muse (``<atem:function_calls>``) the same."""

    STARTS: tuple[str, ...] = ("<minimax:tool_call>", "<｜DSML｜function_calls>", "<｜DSML｜tool_calls>", "<atem:function_calls>")
    _PREFIX = {"<minimax:tool_call>": "", "<｜DSML｜function_calls>": "｜DSML｜", "<｜DSML｜tool_calls>": "｜DSML｜",
               "<atem:function_calls>": "atem:"}

    def _step(self, buf: str, final: bool) -> tuple[int, _Call | None, bool] | None:
        prefix = re.escape(self._PREFIX.get(self._section, ""))
        self.END = "</" + self._section[1:]
        self.INVOKE = "<" + prefix + r'invoke name="([^"]*)">'
        self.INVOKE_END = "</" + self._PREFIX.get(self._section, "") + "invoke>"
        self.PARAM = "<" + prefix + r'parameter name="([^"]*)"(?: string="(true|false)")?>'
        self.PARAM_END = "</" + self._PREFIX.get(self._section, "") + "parameter>"
        return super()._step(buf, final)


class JsonListToolCallParser(_SectionParser):
    """Calls as JSON objects in a section: a JSON array (Granite ``<|tool_call|>[...]``,
    Apriel ``<tool_calls>[...]</tool_calls>``, Nemotron ``<TOOLCALL>[...]</TOOLCALL>``,
    Command R7B ``<|START_ACTION|>[...]<|END_ACTION|>``, Command R+ ``Action: ```json [...]```\u0060``,
    Apertus ``<|tools_prefix|>[{NAME: {...}}]<|tools_suffix|>``) or objects one per line
    (MiniMax M1 ``<tool_calls>``). Name keys ``name`` / ``tool_name``, arguments keys
    ``arguments`` / ``parameters``; a one-key object is ``{NAME: arguments}``."""

    SECTIONS: dict[str, str] = {
        "<|tool_call|>": "",
        "<tool_calls>": "</tool_calls>",
        "<TOOLCALL>": "</TOOLCALL>",
        "<|START_ACTION|>": "<|END_ACTION|>",
        "Action: ```json": "```",
        "<|tools_prefix|>": "<|tools_suffix|>",
        # GigaChat 3.1, and GigaChat 3's "function call" message.
        "<|function_call|>": "",
        "<|message_sep|>\n\nfunction call<|role_sep|>\n": "",
    }
    STARTS = tuple(SECTIONS)

    def __init__(self, make_id: Callable[[], str] = new_tool_call_id) -> None:
        super().__init__(make_id)
        self._in_array = False
        self._opened = False

    def _step(self, buf: str, final: bool) -> tuple[int, _Call | None, bool] | None:
        end = self.SECTIONS[self._section]
        stripped = buf.lstrip()
        lead = len(buf) - len(stripped)
        if not self._opened:
            if not stripped:
                return (len(buf), None, True) if final else None
            self._opened = True
            if stripped.startswith("["):
                self._in_array = True
                return lead + 1, None, False
        if self._in_array and stripped.startswith(","):
            stripped = stripped[1:].lstrip()
            lead = len(buf) - len(stripped)
        if end and stripped.startswith(end):
            self._opened = self._in_array = False
            return lead + len(end), None, True
        if self._in_array and stripped.startswith("]"):
            self._in_array = False
            return lead + 1, None, False
        if not stripped:
            if final:
                self._opened = self._in_array = False
                return len(buf), None, True
            return None
        if not stripped.startswith("{"):
            if not final and end.startswith(stripped):
                return None
            self._opened = self._in_array = False
            return lead, None, True
        scanner = _JsonValueScanner()
        used = scanner.feed(stripped)
        if not scanner.is_done:
            if final:
                self._opened = self._in_array = False
                return len(buf), None, True
            return None
        text = "".join(scanner.buf)
        call = self._call(text)
        return lead + used, call, False

    def _call(self, text: str) -> _Call | None:
        try:
            obj = json.loads(text)
        except ValueError:
            return None
        if not isinstance(obj, dict):
            return None
        name = obj.get("name", obj.get("tool_name"))
        if isinstance(name, str):
            arguments = obj.get("arguments", obj.get("parameters", {}))
        elif len(obj) == 1:
            name, arguments = next(iter(obj.items()))
        else:
            return None
        if isinstance(arguments, str):
            return name, arguments
        return name, json.dumps(arguments, ensure_ascii=False)


class MiniCpmToolCallParser(_XmlParamsParser):
    """MiniCPM 5: ``<function name="NAME"><param name="K">V</param>...</function>``."""

    STARTS = ('<function name="',)
    END = "</function>"
    INVOKE = r'^([^"]*)">'
    INVOKE_END = "\x00"
    PARAM = r'<param name="([^"]*)">'
    PARAM_END = "</param>"


def _python_value(source: str) -> Any:
    """A call argument's source: JSON when it is (templates write ``tojson``), else a literal."""
    try:
        return json.loads(source)
    except ValueError:
        return ast.literal_eval(source)


class PythonicToolCallParser(_BlockParser):
    """LFM2: ``<|tool_call_start|>[NAME(key=value, ...), ...]<|tool_call_end|>``, Python calls
    with literal (or JSON) arguments."""

    STARTS = ("<|tool_call_start|>",)
    END = "<|tool_call_end|>"

    def _calls(self, body: str) -> list[_Call]:
        try:
            tree = ast.parse(body.strip(), mode="eval").body
        except SyntaxError:
            return []
        nodes = tree.elts if isinstance(tree, ast.List) else [tree]
        calls = []
        for node in nodes:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name | ast.Attribute):
                continue
            name = ast.unparse(node.func)
            try:
                arguments = {
                    kw.arg: _python_value(ast.get_source_segment(body.strip(), kw.value) or "")
                    for kw in node.keywords if kw.arg is not None
                }
            except (ValueError, SyntaxError):
                continue
            calls.append((name, _dumps(arguments)))
        return calls


_GEMMA_WORDS = {"None": "null", "True": "true", "False": "false", "null": "null", "true": "true", "false": "false"}


def _gemma_value(text: str) -> Any:
    """Gemma 4's argument object (``{key:<|"|>text<|"|>,n:1}``) as Python values; JSON too."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text.startswith('<|"|>', i):
            j = text.find('<|"|>', i + 5)
            if j < 0:
                raise ValueError("unterminated string")
            out.append(json.dumps(text[i + 5 : j]))
            i = j + 5
        elif text[i] == '"':
            value, i = json.decoder.scanstring(text, i + 1)  # type: ignore[attr-defined]
            out.append(json.dumps(value))
        elif text[i].isalpha() or text[i] == "_":
            match = re.match(r"[A-Za-z_][\w.-]*", text[i:])
            assert match is not None
            word = match.group(0)
            i += len(word)
            is_key = text[i:].lstrip().startswith(":")
            out.append(json.dumps(word) if is_key else _GEMMA_WORDS.get(word, json.dumps(word)))
        else:
            out.append(text[i])
            i += 1
    return json.loads("".join(out))


class GemmaToolCallParser(_SectionParser):
    """Gemma 4: ``<|tool_call>call:NAME{key:<|"|>text<|"|>,...}<tool_call|>``, repeated."""

    STARTS = ("<|tool_call>",)
    END = "<tool_call|>"

    def _step(self, buf: str, final: bool) -> tuple[int, _Call | None, bool] | None:
        until = _until(buf, (self.END,), final)
        if until is None:
            return None
        end, after = until
        body = buf[:end].strip().removeprefix("call:")
        brace = body.find("{")
        if brace < 0:
            return after, (body.strip(), "{}") if body.strip() else None, True
        try:
            arguments = _gemma_value(body[brace:])
        except ValueError:
            return after, None, True
        if not isinstance(arguments, dict):
            return after, None, True
        return after, (body[:brace].strip(), _dumps(arguments)), True


class KimiK3ToolCallParser(_BlockParser):
    """Kimi K3: tagged blocks ``<|open|>TAG ATTRS<|sep|> ... <|close|>TAG<|sep|>``. The answer's
    ``response`` block is content (its tags dropped), the ``tools`` block holds ``call
    tool="NAME"`` blocks of ``argument key="K" type="T"`` blocks (a ``string`` value as is,
    others JSON)."""

    RESPONSE = ("<|open|>response<|sep|>", "<|close|>response<|sep|>")
    TOOLS = ("<|open|>tools<|sep|>", "<|close|>tools<|sep|>")
    DROPPED = (*RESPONSE, "<|close|>message<|sep|>")
    STARTS = (*DROPPED, TOOLS[0])
    _CALL = re.compile(r'<\|open\|>call tool="([^"]*)"[^<]*<\|sep\|>(.*?)<\|close\|>call<\|sep\|>', re.S)
    _ARG = re.compile(r'<\|open\|>argument key="([^"]*)"(?: type="([^"]*)")?[^<]*<\|sep\|>(.*?)<\|close\|>argument<\|sep\|>',
                      re.S)

    END = TOOLS[1]

    def _calls(self, block: str) -> list[_Call]:
        calls = []
        for call in self._CALL.finditer(block):
            arguments = {
                key: value if kind == "string" else _decode_value(value)
                for key, kind, value in self._ARG.findall(call.group(2))
            }
            calls.append((call.group(1), _dumps(arguments)))
        return calls

    def _step(self, buf: str, final: bool) -> tuple[int, _Call | None, bool] | None:
        if self._section in self.DROPPED:
            return 0, None, True
        return super()._step(buf, final)


class MuseToolCallParser(InvokeXmlToolCallParser):
    """muse (ATEM): messages ``<|start|>assistant to=RECIPIENT<|message|>BODY<|eom|>``; a call's
    body is ``<atem:function_calls>`` of ``<atem:invoke>`` (the MiniMax layout). The message
    headers and ``<|eom|>`` are dropped; the first header comes right after the prompt's
    ``<|start|>assistant`` (reasoning, ``to=self``, is split off before this parser)."""

    HEADER = "<|start|>assistant"
    STARTS = ("<atem:function_calls>", HEADER, "<|eom|>")

    def __init__(self, make_id: Callable[[], str] = new_tool_call_id) -> None:
        super().__init__(make_id)
        self._at_start = True

    def _run(self, out: ParsedDelta, final: bool) -> None:
        if self._at_start:
            stripped = self._buffer.lstrip()
            if not stripped or (not final and "to=".startswith(stripped[:3]) and len(stripped) < 3):
                return
            self._at_start = False
            if stripped.startswith("to="):
                self._buffer, self._section, self._state = stripped, self.HEADER, "section"
        super()._run(out, final)

    def _step(self, buf: str, final: bool) -> tuple[int, _Call | None, bool] | None:
        if self._section == "<|eom|>":
            return 0, None, True
        if self._section == self.HEADER:
            index = buf.find("<|message|>")
            if index < 0:
                return (len(buf), None, True) if final else None
            return index + len("<|message|>"), None, True
        return super()._step(buf, final)


_M3_SEP = "]<]minimax[>["
_M3_TAG = re.compile(r"<(/?)([^<>\s/]+)((?:\s[^<>]*)?)>")


def _m3_elements(text: str) -> Any:
    """MiniMax M3's nested argument XML (``<k>v</k>``, ``<item>`` for list items) as values."""
    root: list[tuple[str, list[tuple[str, Any]]]] = [("", [])]
    texts: list[str] = [""]
    pos = 0
    for match in _M3_TAG.finditer(text):
        texts[-1] += text[pos : match.start()]
        pos = match.end()
        closing, tag = match.group(1), match.group(2)
        if not closing:
            root.append((tag, []))
            texts.append("")
            continue
        if len(root) < 2 or root[-1][0] != tag:
            raise ValueError(f"unbalanced </{tag}>")
        _, children = root.pop()
        leaf = texts.pop()
        if not children:
            value: Any = _decode_value(leaf)
        elif all(k == "item" for k, _ in children):
            value = [v for _, v in children]
        else:
            value = dict(children)
        root[-1][1].append((tag, value))
    return dict(root[0][1])


class MiniMaxM3ToolCallParser(_BlockParser):
    """MiniMax M3: ``<tool_call>`` of ``<invoke name="NAME">`` whose arguments are nested XML
    (``<city>Paris</city>``, ``<days><item>1</item></days>``), the tags separated by
    ``]<]minimax[>[``; a leaf value is JSON when it parses (``1``, ``true``), else text."""

    STARTS = (_M3_SEP + "<tool_call>", "<tool_call>")
    END = "</tool_call>"
    _INVOKE = re.compile(r'<invoke name="([^"]*)">(.*?)</invoke>', re.S)

    def _calls(self, block: str) -> list[_Call]:
        calls = []
        for invoke in self._INVOKE.finditer(block.replace(_M3_SEP, "")):
            try:
                arguments = _m3_elements(invoke.group(2).strip())
            except ValueError:
                continue
            calls.append((invoke.group(1), _dumps(arguments)))
        return calls


class HarmonyToolCallParser(ToolCallParser):
    """gpt-oss (harmony): messages ``[<|start|>assistant][ to=functions.NAME]<|channel|>CHANNEL
    [ to=functions.NAME][ <|constrain|>json| json]<|message|>BODY`` ending in ``<|end|>``,
    ``<|call|>`` or ``<|return|>``. A message to ``functions.NAME`` is a call (BODY its JSON
    arguments); ``final`` (and ``commentary`` without recipient) is content; ``analysis`` is
    reasoning, split off before this parser by the reasoning parser (markers
    ``<|channel|>analysis<|message|>`` / ``<|end|>``) and dropped here when it comes later."""

    HEADERS = ("<|start|>", "<|channel|>", " to=", "to=")
    ENDS = ("<|end|>", "<|call|>", "<|return|>")

    def __init__(self, make_id: Callable[[], str] = new_tool_call_id) -> None:
        super().__init__(make_id)
        self._state = "header"
        self._recipient: str | None = None
        self._channel = ""

    def _header(self, out: ParsedDelta, final: bool) -> bool:
        stripped = self._buffer.lstrip()
        if not stripped:
            return False
        if not any(stripped.startswith(h) for h in self.HEADERS):
            if not final and any(h.startswith(stripped) for h in self.HEADERS):
                return False
            self._state, self._recipient, self._channel = "text", None, "final"
            return True
        index = stripped.find("<|message|>")
        if index < 0:
            if final:
                self._buffer = ""
            return False
        header = stripped[:index]
        match = re.search(r"to=functions\.([^\s<]+)", header)
        self._recipient = match.group(1) if match else None
        channel = re.search(r"<\|channel\|>(\w+)", header)
        self._channel = channel.group(1) if channel else "final"
        self._buffer = stripped[index + len("<|message|>"):]
        self._state = "call" if self._recipient else "text"
        if self._recipient:
            self._drop_space()
        return True

    def _body(self, out: ParsedDelta, final: bool) -> bool:
        until = _until(self._buffer, self.ENDS + ("<|start|>",), final)
        if until is None:
            if self._state == "text" and self._channel != "analysis":
                keep = max(held_back(self._buffer, e) for e in self.ENDS + ("<|start|>",))
                self._content(out, self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        end, after = until
        body = self._buffer[:end]
        if self._buffer[end:].startswith("<|start|>"):
            after = end
        self._buffer = self._buffer[after:]
        if self._state == "call":
            assert self._recipient is not None
            index = self.num_calls
            out.tool_calls.append(ToolCallDelta(index=index, id=self._make_id(), name=self._recipient))
            out.tool_calls.append(ToolCallDelta(index=index, arguments=_json_args(body)))
            self.num_calls += 1
        elif self._channel != "analysis":
            self._content(out, body)
        self._state = "header"
        return True

    def _run(self, out: ParsedDelta, final: bool) -> None:
        while self._buffer:
            progressed = self._header(out, final) if self._state == "header" else self._body(out, final)
            if not progressed:
                return

    def feed(self, delta: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buffer += delta
        self._run(out, final=False)
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        self._run(out, final=True)
        if self._state == "text" and self._channel != "analysis":
            self._content(out, self._buffer)
        out.content += self._space if not self.num_calls else ""
        self._buffer, self._space = "", ""
        return out


_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesToolCallParser,
    "llama3_json": Llama3JsonToolCallParser,
    "mistral": MistralToolCallParser,
    "deepseek": DeepSeekToolCallParser,
    "kimi_k2": KimiK2ToolCallParser,
    "solar": SolarToolCallParser,
    "functionary_v3_1": FunctionaryV31ToolCallParser,
    "functionary_v3_2": FunctionaryV32ToolCallParser,
    "glm": GlmToolCallParser,
    "hunyuan": HunyuanToolCallParser,
    "qwen_xml": QwenXmlToolCallParser,
    "minimax_xml": InvokeXmlToolCallParser,
    "dsml": InvokeXmlToolCallParser,
    "json_list": JsonListToolCallParser,
    "command_r": JsonListToolCallParser,
    "harmony": HarmonyToolCallParser,
    "gigachat": JsonListToolCallParser,
    "minicpm": MiniCpmToolCallParser,
    "pythonic": PythonicToolCallParser,
    "gemma4": GemmaToolCallParser,
    "kimi_k3": KimiK3ToolCallParser,
    "muse": MuseToolCallParser,
    "minimax_m3": MiniMaxM3ToolCallParser,
}


def make_tool_call_parser(fmt: str, make_id: Callable[[], str] = new_tool_call_id) -> ToolCallParser:
    """The streaming parser of tool-call format ``fmt`` (:data:`~core_engine.chat.formats.TOOL_CALL_FORMATS`)."""
    return _PARSERS[fmt](make_id)
