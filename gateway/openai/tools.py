"""The checks every API's ``tools`` and ``tool_choice`` get, whatever their wire shape
(OpenAI's chat completions, Anthropic's messages): the count within ``[limits] max_tools``,
unique names, parameter schemas within the JSON limits, a named choice among the tools."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from backends.errors import InvalidRequestError
from gateway.config.types import LimitsConfig
from gateway.openai.structured_outputs import bounded_json

__all__ = ["OfferedTool", "check_named_choice", "check_tools"]


class OfferedTool(NamedTuple):
    """One tool of a request, with the request fields its errors name."""

    name: str
    #: Its parameters' JSON schema (None: none given).
    parameters: Any
    #: e.g. ``tools[1].function.name`` / ``tools[1].name``.
    name_param: str
    #: e.g. ``tools[1].function.parameters`` / ``tools[1].input_schema``.
    parameters_param: str


def check_tools(tools: Sequence[OfferedTool], limits: LimitsConfig) -> set[str]:
    """The tools' names; a 400 naming the field for too many tools, a repeated name or a
    parameters schema beyond the limits."""
    if len(tools) > limits.max_tools:
        raise InvalidRequestError(f"at most {limits.max_tools} tools are allowed per request", param="tools")
    names: set[str] = set()
    for tool in tools:
        if tool.name in names:
            raise InvalidRequestError(f"two tools are named {tool.name!r}", param=tool.name_param)
        names.add(tool.name)
        if tool.parameters is not None:
            bounded_json(tool.parameters, tool.parameters_param, limits)
    return names


def check_named_choice(name: str | None, names: set[str], param: str) -> None:
    """A ``tool_choice`` naming one function must name one of the tools."""
    if name not in names:
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not one of the tools", param=param)
