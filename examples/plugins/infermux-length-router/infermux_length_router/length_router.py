"""``length-router``: send long prompts to one backend and short ones to another.

Configured in the routing config; without ``long_backend`` and ``short_backend`` it stays
out of the way (the model's strategy decides)::

    [plugins.settings.length-router]
    threshold_chars = 2000        # prompts this long or longer are "long"
    long_backend = "big"          # a backend of the model alias, e.g. a larger context
    short_backend = "small"
    models = ["chat"]             # aliases it applies to (default: all)

The choice is a preference: when the chosen backend does not serve the requested alias or
its circuit is open, the plugin abstains and the strategy orders the candidates; when it
fails before the first token, the router still falls back to the other candidates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import msgspec

from plugins import GenerationRequest, hookimpl

__all__ = ["LengthRouter", "LengthRouterSettings", "create_plugin", "prompt_length"]

PLUGIN_NAME = "length-router"
#: A token-id prompt has no text; count each token as this many characters.
CHARS_PER_TOKEN = 4


class LengthRouterSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[plugins.settings.length-router]``."""

    threshold_chars: Annotated[int, msgspec.Meta(ge=1)] = 2000
    long_backend: str | None = None
    short_backend: str | None = None
    #: Model aliases the plugin routes; empty: every alias.
    models: list[str] = []


def prompt_length(request: GenerationRequest) -> int:
    """The prompt's size in characters (all chat messages, or the completion prompt)."""
    if request.messages is not None:
        return sum(len(message.content) for message in request.messages)
    if isinstance(request.prompt, str):
        return len(request.prompt)
    if request.prompt is not None:
        return len(request.prompt) * CHARS_PER_TOKEN
    return 0


class LengthRouter:
    """Answers ``infermux_select_backend`` by prompt length."""

    def __init__(self, settings: LengthRouterSettings) -> None:
        self.settings = settings

    @hookimpl
    def infermux_select_backend(
        self, request: GenerationRequest, candidates: Sequence[str]
    ) -> str | None:
        settings = self.settings
        if settings.models and request.model not in settings.models:
            return None
        is_long = prompt_length(request) >= settings.threshold_chars
        choice = settings.long_backend if is_long else settings.short_backend
        if choice is None or choice not in candidates:
            return None
        return choice


def create_plugin(settings: Mapping[str, Any] | None = None) -> LengthRouter:
    """Called by infermux once per gateway with ``[plugins.settings.length-router]``."""
    try:
        decoded = msgspec.convert(dict(settings or {}), LengthRouterSettings)
    except msgspec.ValidationError as exc:
        raise ValueError(f"plugins.settings.{PLUGIN_NAME}: {exc}") from exc
    return LengthRouter(decoded)
