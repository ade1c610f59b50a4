"""Chat templates from model metadata, rendered in a sandboxed Jinja environment.

Templates come from model files (``tokenizer.chat_template`` in GGUF metadata), which are
untrusted input: they are rendered in an immutable sandbox with no access to the filesystem,
attributes starting with ``_`` or mutation of the passed objects. Request-supplied templates are
never accepted (the gateway refuses them).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from jinja2 import StrictUndefined, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "ChatTemplateError", "FALLBACK_CHATML_TEMPLATE"]

#: Used only when a model ships no template (plain ChatML, as most instruct models use).
FALLBACK_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template failed to compile or render (message says why)."""


def _raise_exception(message: str) -> None:
    # Templates call raise_exception() to reject conversations they cannot format.
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template with the model's special tokens.

    >>> ChatTemplate(FALLBACK_CHATML_TEMPLATE).render([{"role": "user", "content": "hi"}])
    '<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n'
    """

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, undefined=StrictUndefined, autoescape=False
        )
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """Render ``messages`` (dicts with ``role`` and ``content``) into the prompt text."""
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except ChatTemplateError:
            raise
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed to render: {exc}") from exc
