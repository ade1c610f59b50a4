"""What a request constrains its output to (vLLM's ``structured_outputs`` names)."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from core_engine.errors import InvalidParamError

__all__ = ["StructuredOutput"]


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Exactly one of the fields. ``param`` names the request field it came from, for errors
    (``response_format``, ``guided_regex``...)."""

    #: A JSON Schema (an object), or a JSON Schema as text.
    json: dict[str, Any] | str | None = None
    #: Any JSON object (``response_format = {"type": "json_object"}``).
    json_object: bool = False
    #: A regular expression the whole output matches.
    regex: str | None = None
    #: One of these strings, exactly.
    choice: tuple[str, ...] | None = None
    #: A Lark grammar (llguidance's dialect), or GBNF (llama.cpp's) when it has ``::=``.
    grammar: str | None = None
    #: JSON without whitespace outside strings (vLLM's ``disable_any_whitespace``): a sampled
    #: output cannot spend its tokens on newlines between the items. JSON constraints only.
    disable_any_whitespace: bool = False
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidParamError(
                f"{self.param}: give exactly one of json, json_object, regex, choice, grammar (got "
                f"{', '.join(given) or 'none'})", param=self.param,
            )
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) for c in self.choice)):
            raise InvalidParamError(f"{self.param}: choice must be a non-empty list of strings", param=self.param)

    @classmethod
    def from_request(cls, structured: dict[str, Any]) -> StructuredOutput:
        """From ``GenerationRequest.structured_outputs`` (the gateway's normalised dict)."""
        fields = {k: v for k, v in structured.items() if k != "param"}
        if "choice" in fields:
            fields["choice"] = tuple(fields["choice"])
        return cls(**fields, param=structured["param"])

    def key(self) -> str:
        """A canonical text of the constraint (the compile cache's key)."""
        value: Any = {
            n: getattr(self, n) for n in ("json", "json_object", "regex", "choice", "grammar", "disable_any_whitespace")
        }
        if isinstance(value["json"], str):
            try:
                value["json"] = json.loads(value["json"])
            except ValueError:
                pass  # reported when compiling
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
