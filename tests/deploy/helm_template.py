"""Render the infermux Helm chart in-process: the subset of Go's template language (and of
Helm's and Sprig's functions) that deploy/helm/infermux/templates uses, and nothing more.

Real ``helm`` is not a Python package; where it is installed (scripts/install_test_services.sh
puts one in from npm) tests/deploy renders the chart with both and requires the same
manifests, so this renderer is checked against Helm itself, and the tests that only need
rendered manifests run everywhere.

Supported:

- fields ``.Values.a.b``, ``.Release.*``, ``.Chart.*``, ``.Template.BasePath``, the root
  ``$`` / ``$.Values...``, ``.`` (the current ``with`` value), and ``.Files.Get "path"``
  (a file of the chart, "" when missing, as Helm does);
- string and integer literals, parenthesised sub-expressions, pipelines (``a | f x``: the
  piped value is the last argument);
- the functions ``quote``, ``toYaml``, ``nindent N``, ``add``, ``not``, ``and``, ``or``,
  ``lower``, ``contains SUBSTR S``, ``print``, ``sha256sum``, ``include NAME DATA`` (a
  template by its path, ``<chart>/templates/<file>``) and ``fail MESSAGE`` (raises
  :class:`TemplateFailure`, as ``helm template`` stops with the message);
- ``{{ if }}`` / ``{{ else if }}`` / ``{{ else }}`` / ``{{ end }}``, ``{{ with X }}`` (``.``
  becomes X, the body is skipped when X is empty), ``{{/* comments */}}`` and ``{{-`` /
  ``-}}`` whitespace trimming.

Anything else (an unknown function, ``range``, ``define``, variables) raises
:class:`UnsupportedTemplate`, so a template that outgrows this renderer fails its test
instead of rendering wrongly.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = ["TemplateFailure", "UnsupportedTemplate", "render_chart"]


class TemplateFailure(Exception):
    """A template called ``fail``: Helm refuses to render the chart with these values."""


class UnsupportedTemplate(ValueError):
    """The template uses something this renderer does not implement."""


# -- parsing ----------------------------------------------------------------------------------

_ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)
_UNSUPPORTED_ACTIONS = {"range", "define", "template", "block", "break", "continue"}


@dataclass
class _If:
    #: (condition, body) in order; a None condition is the final ``else``.
    branches: list[tuple[str | None, list[Any]]] = field(default_factory=list)


@dataclass
class _With:
    expression: str
    body: list[Any]


@dataclass
class _Output:
    expression: str


def _tokens(template: str) -> list[tuple[str, str]]:
    """("text" | "action", content), with Go's ``{{-`` / ``-}}`` trimming applied."""
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
    return tokens


def _parse(tokens: list[tuple[str, str]], start: int) -> tuple[list[Any], int, str | None]:
    """The nodes from ``start`` to the next ``else``/``end`` (returned with its index)."""
    nodes: list[Any] = []
    index = start
    while index < len(tokens):
        kind, content = tokens[index]
        index += 1
        if kind == "text":
            nodes.append(content)
        elif content.startswith("/*") and content.endswith("*/"):
            continue
        elif content == "end" or content == "else" or content.startswith("else if "):
            return nodes, index, content
        elif content.startswith("if "):
            node = _If()
            condition: str | None = content[3:]
            while True:
                body, index, closer = _parse(tokens, index)
                node.branches.append((condition, body))
                if closer == "end":
                    break
                if closer is None or condition is None:
                    raise UnsupportedTemplate(f"malformed {{{{ {content} }}}} block")
                condition = None if closer == "else" else closer[len("else if ") :]
            nodes.append(node)
        elif content.partition(" ")[0] in _UNSUPPORTED_ACTIONS:
            raise UnsupportedTemplate(f"unsupported action {{{{ {content} }}}}")
        elif content.startswith("with "):
            body, index, closer = _parse(tokens, index)
            if closer != "end":
                raise UnsupportedTemplate(f"{{{{ {content} }}}}: only a body and an end")
            nodes.append(_With(content[5:], body))
        else:
            nodes.append(_Output(content))
    return nodes, index, None


def _parse_template(text: str) -> list[Any]:
    nodes, _, closer = _parse(_tokens(text), 0)
    if closer is not None:
        raise UnsupportedTemplate(f"{{{{ {closer} }}}} without an opening block")
    return nodes


# -- expressions --------------------------------------------------------------------------------

_EXPRESSION_TOKEN = re.compile(
    r'\s*(?:(?P<string>"(?:[^"\\]|\\.)*")|(?P<number>-?\d+)(?![\w.])|(?P<paren>[()])'
    r"|(?P<pipe>\|)|(?P<field>\$?(?:\.[A-Za-z_]\w*)+|\$|\.)|(?P<name>[A-Za-z_]\w*))"
)


def _lex(expression: str) -> list[tuple[str, str]]:
    tokens = []
    position = 0
    while position < len(expression.rstrip()):
        match = _EXPRESSION_TOKEN.match(expression, position)
        if not match or match.end() == position:
            raise UnsupportedTemplate(f"unsupported syntax at {expression[position:]!r}")
        kind = match.lastgroup
        assert kind is not None
        tokens.append((kind, match.group(kind)))
        position = match.end()
    return tokens


def _truth(value: Any) -> bool:
    """Go templates' truth: false, 0, "", nil and empty maps and lists are false."""
    return bool(value)


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict | list):
        raise UnsupportedTemplate(f"printing a map or list ({value!r}): use toYaml")
    return str(value)


def _nindent(width: int, text: Any) -> str:
    # Sprig: every line indented, empty ones included.
    pad = " " * width
    return "\n" + pad + _text(text).replace("\n", "\n" + pad)


def _to_yaml(value: Any) -> str:
    return yaml.safe_dump(value, sort_keys=False).removesuffix("\n")


def _print(*values: Any) -> str:
    if not all(isinstance(value, str) for value in values):
        raise UnsupportedTemplate(f"print of non-strings {values!r} (Go spaces them)")
    return "".join(values)


def _fail(message: str) -> str:
    raise TemplateFailure(message)


def _and(*values: Any) -> Any:
    for value in values[:-1]:
        if not _truth(value):
            return value
    return values[-1]


def _or(*values: Any) -> Any:
    for value in values[:-1]:
        if _truth(value):
            return value
    return values[-1]


class _Chart:
    """The chart's templates by name, and the functions that can reach them."""

    def __init__(self, chart: Path, context: dict[str, Any]) -> None:
        self.root = context
        self.base_path = f"{context['Chart']['Name']}/templates"
        self.templates = {
            f"{self.base_path}/{path.name}": _parse_template(path.read_text())
            for path in sorted((chart / "templates").glob("*.yaml"))
        }
        self.functions: dict[str, Callable[..., Any]] = {
            # Sprig's quote drops a nil argument.
            "quote": lambda value: "" if value is None else json.dumps(_text(value)),
            "toYaml": _to_yaml,
            "nindent": _nindent,
            "add": lambda *numbers: sum(int(n) for n in numbers),
            "not": lambda value: not _truth(value),
            "and": _and,
            "or": _or,
            "contains": lambda substring, text: str(substring) in _text(text),
            "lower": lambda text: _text(text).lower(),
            "print": _print,
            "sha256sum": lambda text: hashlib.sha256(_text(text).encode()).hexdigest(),
            "include": self.include,
            "fail": _fail,
        }

    def include(self, name: str, data: Any) -> str:
        if name not in self.templates:
            raise UnsupportedTemplate(f"include of unknown template {name!r}")
        return self.render_nodes(self.templates[name], data)

    def render_nodes(self, nodes: list[Any], dot: Any) -> str:
        out: list[str] = []
        for node in nodes:
            if isinstance(node, str):
                out.append(node)
            elif isinstance(node, _Output):
                out.append(_text(self.evaluate(node.expression, dot)))
            elif isinstance(node, _With):
                value = self.evaluate(node.expression, dot)
                if _truth(value):
                    out.append(self.render_nodes(node.body, value))
            else:
                for condition, body in node.branches:
                    if condition is None or _truth(self.evaluate(condition, dot)):
                        out.append(self.render_nodes(body, dot))
                        break
        return "".join(out)

    def evaluate(self, expression: str, dot: Any) -> Any:
        tokens = _lex(expression)
        value, end = self._pipeline(tokens, 0, dot)
        if end != len(tokens):
            raise UnsupportedTemplate(f"unexpected {tokens[end][1]!r} in {expression!r}")
        return value

    def _pipeline(self, tokens: list[tuple[str, str]], index: int, dot: Any) -> tuple[Any, int]:
        value: Any = None
        first = True
        while True:
            value, index = self._command(tokens, index, dot, None if first else (value,))
            first = False
            if index < len(tokens) and tokens[index][0] == "pipe":
                index += 1
                continue
            return value, index

    def _command(
        self, tokens: list[tuple[str, str]], index: int, dot: Any, piped: tuple[Any] | None
    ) -> tuple[Any, int]:
        function: Callable[..., Any] | None = None
        if index < len(tokens) and tokens[index][0] == "name":
            name = tokens[index][1]
            if name not in self.functions:
                raise UnsupportedTemplate(f"unknown template function {name!r}")
            function = self.functions[name]
            index += 1
        operands: list[Any] = []
        while index < len(tokens) and tokens[index][0] not in ("pipe",) and tokens[index][1] != ")":
            kind, text = tokens[index]
            index += 1
            if kind == "string":
                operands.append(json.loads(text))
            elif kind == "number":
                operands.append(int(text))
            elif kind == "field":
                operands.append(self._field(text, dot))
            elif text == "(":
                value, index = self._pipeline(tokens, index, dot)
                if index >= len(tokens) or tokens[index][1] != ")":
                    raise UnsupportedTemplate("unclosed parenthesis")
                index += 1
                operands.append(value)
            else:
                raise UnsupportedTemplate(f"function {text!r} as an argument: parenthesise it")
        arguments = operands + list(piped or ())
        if function is None and operands and callable(operands[0]):  # .Files.Get "path"
            function, arguments = operands[0], arguments[1:]
        if function is not None:
            return function(*arguments), index
        if len(operands) != 1 or piped is not None:
            raise UnsupportedTemplate(f"not a function: {operands!r}")
        return operands[0], index

    def _field(self, path: str, dot: Any) -> Any:
        value = self.root if path.startswith("$") else dot
        for part in path.lstrip("$").split("."):
            if not part:
                continue
            # A missing key renders as nothing, as Helm's templates do.
            if not isinstance(value, dict) or part not in value:
                return None
            value = value[part]
        return value


def render_chart(
    chart: Path, *, release: str = "infermux", overrides: dict[str, Any] | None = None
) -> dict[str, list[dict[str, Any]]]:
    """Each template's rendered documents (empty ones dropped), by file name.

    ``overrides`` maps dotted value paths to values, as ``helm --set`` does."""
    values = yaml.safe_load((chart / "values.yaml").read_text())
    for dotted, value in (overrides or {}).items():
        *parents, last = dotted.split(".")
        table = values
        for part in parents:
            table = table.setdefault(part, {})
        table[last] = value
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())

    def get_file(name: str) -> str:
        path = chart / name
        return path.read_text() if path.is_file() else ""

    context: dict[str, Any] = {
        "Values": values,
        "Release": {"Name": release, "Namespace": "default"},
        "Chart": {
            "Name": meta["name"],
            "Version": meta["version"],
            "AppVersion": meta["appVersion"],
        },
        "Files": {"Get": get_file},
    }
    renderer = _Chart(chart, context)
    context["Template"] = {"BasePath": renderer.base_path}
    rendered = {}
    for name, nodes in renderer.templates.items():
        text = renderer.render_nodes(nodes, context)
        rendered[name.rsplit("/", 1)[1]] = [doc for doc in yaml.safe_load_all(text) if doc]
    return rendered
