"""Render the infermux Helm chart without ``helm`` (not installable here): the subset of
Go's template language that deploy/helm/infermux/templates uses, and nothing more.

Supported: ``{{ .Values.a.b }}``, ``.Release.Name`` / ``.Release.Namespace``, ``.Chart.*``,
string and integer literals, pipelines into ``quote``, ``toYaml``, ``nindent N``,
``indent N``, the functions ``add``, ``not``, ``lower`` and ``contains SUBSTR S``, ``fail MESSAGE``
(raises :class:`TemplateFailure`, as ``helm template`` stops with the message),
``{{- if X }} ... {{- else }} ... {{- end }}``, ``{{/* comments */}}``, and ``{{-`` / ``-}}``
whitespace trimming. Anything else raises, so a template that outgrows this renderer fails
its test instead of rendering wrongly.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

__all__ = ["TemplateFailure", "render_chart"]


class TemplateFailure(Exception):
    """A template called ``fail``: Helm refuses to render the chart with these values."""


def _fail(message: str) -> str:
    raise TemplateFailure(message)

_ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)
_WORD = re.compile(r'"(?:[^"\\]|\\.)*"|\S+')


def _lookup(path: str, context: dict[str, Any]) -> Any:
    value: Any = context
    for part in path.strip(".").split("."):
        if not part:
            continue
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _atom(word: str, context: dict[str, Any]) -> Any:
    if word.startswith('"'):
        return json.loads(word)
    if re.fullmatch(r"-?\d+", word):
        return int(word)
    if word.startswith("."):
        return _lookup(word, context)
    raise ValueError(f"unsupported template word {word!r}")


def _indent(width: int, text: Any) -> str:
    pad = " " * width
    return "\n".join(pad + line if line else line for line in str(text).split("\n"))


_FUNCTIONS: dict[str, Any] = {
    "quote": lambda value: json.dumps("" if value is None else str(value)),
    "toYaml": lambda value: yaml.safe_dump(value, sort_keys=False).rstrip("\n"),
    "nindent": lambda width, text: "\n" + _indent(width, text),
    "indent": _indent,
    "add": lambda *numbers: sum(int(n) for n in numbers),
    "not": lambda value: not value,
    "contains": lambda substring, text: str(substring) in ("" if text is None else str(text)),
    "lower": lambda text: ("" if text is None else str(text)).lower(),
    "fail": _fail,
}


def _evaluate(expression: str, context: dict[str, Any]) -> Any:
    value: Any = None
    for index, command in enumerate(expression.split("|")):
        words = _WORD.findall(command.strip())
        if not words:
            raise ValueError(f"empty command in {expression!r}")
        if words[0] in _FUNCTIONS:
            args = [_atom(w, context) for w in words[1:]]
            if index:
                args.append(value)
            value = _FUNCTIONS[words[0]](*args)
        elif index == 0 and len(words) == 1:
            value = _atom(words[0], context)
        else:
            raise ValueError(f"unsupported template command {command!r}")
    return value


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def render(template: str, context: dict[str, Any]) -> str:
    """``template`` rendered with ``context`` (``{"Values": ..., "Release": ...}``)."""
    # Tokens, with the whitespace trimming applied.
    tokens: list[tuple[str, str]] = []
    position = 0
    trim_next = False
    for match in _ACTION.finditer(template):
        text = template[position : match.start()]
        if trim_next:
            text = text.lstrip()
        if match.group(1):
            text = text.rstrip()
        tokens.append(("text", text))
        tokens.append(("action", match.group(2)))
        trim_next = bool(match.group(3))
        position = match.end()
    tail = template[position:]
    tokens.append(("text", tail.lstrip() if trim_next else tail))

    out: list[str] = []
    # One entry per open if: (this branch is taken, any branch was taken, the parent emits).
    stack: list[tuple[bool, bool, bool]] = []

    def emitting() -> bool:
        return not stack or (stack[-1][0] and stack[-1][2])

    for kind, content in tokens:
        if kind == "text":
            if emitting():
                out.append(content)
        elif content.startswith("/*") and content.endswith("*/"):
            continue
        elif content.startswith("if "):
            parent = emitting()
            taken = bool(_evaluate(content[3:], context)) if parent else False
            stack.append((taken, taken, parent))
        elif content == "else":
            _, any_taken, parent = stack.pop()
            stack.append((not any_taken, True, parent))
        elif content == "end":
            stack.pop()
        elif emitting():
            out.append(_text(_evaluate(content, context)))
    if stack:
        raise ValueError("an {{ if }} without {{ end }}")
    return "".join(out)


def render_chart(
    chart: Path, *, release: str = "infermux", overrides: dict[str, Any] | None = None
) -> dict[str, list[dict[str, Any]]]:
    """Each template's rendered documents (empty ones dropped), by file name."""
    values = yaml.safe_load((chart / "values.yaml").read_text())
    for dotted, value in (overrides or {}).items():
        *parents, last = dotted.split(".")
        table = values
        for part in parents:
            table = table.setdefault(part, {})
        table[last] = value
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    context = {
        "Values": values,
        "Release": {"Name": release, "Namespace": "default"},
        "Chart": {
            "Name": meta["name"],
            "Version": meta["version"],
            "AppVersion": meta["appVersion"],
        },
    }
    rendered = {}
    for template in sorted((chart / "templates").glob("*.yaml")):
        text = render(template.read_text(), context)
        rendered[template.name] = [doc for doc in yaml.safe_load_all(text) if doc]
    return rendered
