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

Whitespace next to a tool call is dropped (templates put newlines around the tags); text that
is not a well-formed call stays content when nothing of the call was streamed yet.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

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
                    ToolCallDelta(index=self.num_calls, id=self._make_id(), name=self._name.strip())
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


_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesToolCallParser,
    "llama3_json": Llama3JsonToolCallParser,
    "mistral": MistralToolCallParser,
}


def make_tool_call_parser(fmt: str, make_id: Callable[[], str] = new_tool_call_id) -> ToolCallParser:
    """The streaming parser of tool-call format ``fmt`` (:data:`~core_engine.chat.formats.TOOL_CALL_FORMATS`)."""
    return _PARSERS[fmt](make_id)
