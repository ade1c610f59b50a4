"""Chat templates from model metadata, rendered in a sandboxed Jinja environment.

Templates come from model files (``tokenizer.chat_template`` in GGUF metadata, the chat
template of a Hugging Face checkpoint, or the operator's ``chat.template`` file), which are
untrusted input: they are rendered in an immutable sandbox with no access to the filesystem,
attributes starting with ``_`` or mutation of the passed objects. Request-supplied templates are
never accepted (the gateway refuses them); a request may only add plain JSON variables
(``chat_template_kwargs``).

The environment is the one Hugging Face's ``apply_chat_template`` renders with (and so vLLM),
so that a model's template gives the prompt it was trained on:

- undefined variables are Jinja's default ``Undefined`` (falsy, empty when printed; an error
  only when used further), so templates may test ``tools``, ``enable_thinking``,
  ``custom_instructions``... without the caller passing them;
- ``{% break %}`` / ``{% continue %}`` (the ``loopcontrols`` extension) and the
  ``{% generation %}...{% endgeneration %}`` block (it marks the assistant's text for training
  masks; here it renders its body);
- ``tojson`` is ``json.dumps`` (no HTML escaping; ``ensure_ascii`` false unless asked, and
  ``indent``, ``separators`` and ``sort_keys``);
- globals ``raise_exception(message)``, ``strftime_now(format)``, a ``namespace`` that refuses
  names starting with ``_`` and a ``dict`` that only builds dicts;
- variables ``messages``, ``tools`` (None when none are offered), ``documents`` (None),
  ``add_generation_prompt``, ``bos_token``, ``eos_token`` and any extra keyword arguments;
- a message's reasoning under any of ``reasoning_content``, ``thinking`` or ``reasoning``
  is passed under ``reasoning_content`` and ``thinking`` too (templates read one or the other).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from core_engine.chat.content_text import ControlTexts

__all__ = ["RESERVED_TEMPLATE_VARIABLES", "ChatTemplate", "ChatTemplateError", "FALLBACK_CHATML_TEMPLATE"]

#: Used only when a model ships no template (plain ChatML, as most instruct models use).
FALLBACK_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: Variables the renderer itself sets, and the globals templates call: extra variables
#: (``render(**extra)``, a request's ``chat_template_kwargs``) may not replace them.
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "bos_token",
        "eos_token",
        "raise_exception",
        "strftime_now",
        "namespace",
        "dict",
    }
)

#: Names a message's reasoning comes under; templates read ``reasoning_content`` (most) or
#: ``thinking`` (gpt-oss).
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The template failed to compile or render (message says why)."""


def _raise_exception(message: str) -> None:
    # Templates call raise_exception() to reject conversations they cannot format.
    raise ChatTemplateError(message)


def _now() -> datetime.datetime:
    return datetime.datetime.now()


def _strftime_now(fmt: str) -> str:
    return _now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own filter HTML-escapes <, >, &, ' and "; the models were trained on plain JSON.
    # Lazy sequences (``tools | map(attribute='function')`` is a generator) become lists, as
    # llama.cpp's renderer does; transformers' json.dumps refuses them.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys, default=_listed
    )


def _listed(value: Any) -> list[Any]:
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping)):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


class _Namespace(Namespace):
    """``namespace(...)`` whose attributes cannot start with ``_`` (no dunder tricks)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - ``self`` may be a keyword of namespace()
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a chat template cannot set the namespace attribute {name!r}")


class _DictBuilder:
    """``dict(...)`` and ``dict.fromkeys(...)`` without handing the ``dict`` type itself to templates."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, keys: Any, value: Any = None) -> dict[Any, Any]:
        return dict.fromkeys(keys, value)


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}``: marks the assistant's text (for training
    masks); rendering it gives its body."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Macro) -> str:
        return str(caller())


def _plain(value: Any) -> Any:
    """``value`` rebuilt from plain JSON-like types (templates see no other objects)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _with_reasoning_aliases(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    aliased = {"thinking": reasoning}
    aliased.update(message)
    aliased["reasoning_content"] = reasoning
    return aliased


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, autoescape=False, extensions=[_GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace, dict=_DictBuilder()
    )
    return env


class ChatTemplate:
    """A compiled chat template with the model's special tokens.

    >>> ChatTemplate(FALLBACK_CHATML_TEMPLATE).render([{"role": "user", "content": "hi"}])
    '<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n'
    """

    def __init__(
        self, source: str, *, bos_token: str = "", eos_token: str = "", control_texts: ControlTexts | None = None
    ) -> None:
        try:
            self._template = _environment().from_string(source)
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        #: The vocabulary's control-token texts, kept as text in a request's content
        #: (:func:`~core_engine.chat.prompt.render_chat` marks them, the backend's tokenizer
        #: reads the marks through :meth:`ControlTexts.encode`).
        self.control_texts = control_texts if control_texts is not None else ControlTexts()

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """Render ``messages`` (dicts with ``role`` and ``content``) into the prompt text.

        ``tools``: OpenAI tool objects offered (None: none); ``extra``: more template
        variables (``enable_thinking``...), which may not be one of
        :data:`RESERVED_TEMPLATE_VARIABLES`. Any failure is a :class:`ChatTemplateError`.
        """
        reserved = RESERVED_TEMPLATE_VARIABLES.intersection(extra)
        if reserved:
            raise ChatTemplateError(f"template variables {sorted(reserved)} are set by the server")
        try:
            return self._template.render(
                messages=[_with_reasoning_aliases(_plain(m)) for m in messages],
                tools=_plain(list(tools)) if tools is not None else None,
                documents=_plain(list(documents)) if documents is not None else None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **_plain(extra),
            )
        except ChatTemplateError:
            raise
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed to render: {exc}") from exc
        except (ArithmeticError, AttributeError, LookupError, RecursionError, TypeError, ValueError) as exc:
            # Templates are code: a bad operand (None + str, json of an Undefined...) fails
            # inside Jinja with a plain Python error.
            raise ChatTemplateError(f"chat template failed to render: {type(exc).__name__}: {exc}") from exc
