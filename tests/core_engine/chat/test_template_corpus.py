"""Every real chat template of llama.cpp's corpus renders as transformers renders it.

transformers' ``render_jinja_template`` is the reference (it is what ``apply_chat_template``
and vLLM use): for each template and each conversation below, where transformers renders,
:class:`ChatTemplate` must give the identical text; where transformers raises, ChatTemplate
must raise :class:`ChatTemplateError`. Both get the same ``bos_token`` / ``eos_token`` strings
and the same clock. ``test_corpus_summary`` prints identical / total over the corpus.
"""

from __future__ import annotations

import copy
import datetime
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core_engine.chat import template as template_module
from core_engine.chat.template import ChatTemplate, ChatTemplateError
from tests.real_artifacts import templates_dir

transformers_templates = pytest.importorskip("transformers.utils.chat_template_utils")

BOS, EOS = "<s>", "</s>"
_NOW = datetime.datetime(2026, 3, 14, 15, 9, 26)

_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. \"Paris\""},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
_TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone (é, ü and 日本 stay unescaped).",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string"}},
            "required": ["zone"],
        },
    },
}
TOOLS = [_WEATHER, _TIME]

_USER = {"role": "user", "content": "What is the capital of France?"}
_SYSTEM = {"role": "system", "content": "You are a concise assistant."}
_CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
        }
    ],
}
_RESULT = {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"temp\": 21}"}

#: name -> (messages, template kwargs).
CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {
    "plain": ([_USER], {}),
    "system": ([_SYSTEM, _USER], {}),
    "three_turns": (
        [_USER, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?"}],
        {},
    ),
    "tools_offered": ([_SYSTEM, {"role": "user", "content": "Weather in Paris?"}], {"tools": TOOLS}),
    "tool_call_and_result": (
        [
            {"role": "user", "content": "Weather in Paris?"},
            _CALL,
            _RESULT,
            {"role": "user", "content": "Thanks. And in Rome?"},
        ],
        {"tools": TOOLS},
    ),
    "reasoning_in_history": (
        [
            _USER,
            {"role": "assistant", "content": "Paris.", "reasoning_content": "France's capital is Paris."},
            {"role": "user", "content": "And of Italy?"},
        ],
        {},
    ),
}
#: Rendered only for templates that read ``enable_thinking``.
THINKING = {
    "thinking_on": ([_USER], {"enable_thinking": True}),
    "thinking_off": ([_USER], {"enable_thinking": False}),
    "thinking_off_history": (CONVERSATIONS["reasoning_in_history"][0], {"enable_thinking": False}),
}

def _template_files() -> list[Path]:
    return sorted(templates_dir().glob("*.jinja"))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "template_path" in metafunc.fixturenames:
        paths = _template_files()
        metafunc.parametrize("template_path", paths, ids=[p.stem for p in paths])


class _FrozenClock:
    @staticmethod
    def now() -> datetime.datetime:
        return _NOW


@pytest.fixture(autouse=True)
def _frozen_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both renderers see the same time (templates print today's date)."""
    monkeypatch.setattr(transformers_templates, "datetime", _FrozenClock)
    monkeypatch.setattr(template_module, "_now", _FrozenClock.now)


def _reference(source: str, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
    kwargs = dict(kwargs)
    tools = kwargs.pop("tools", None)
    rendered, _ = transformers_templates.render_jinja_template(
        conversations=[copy.deepcopy(messages)],
        tools=copy.deepcopy(tools),
        chat_template=source,
        add_generation_prompt=True,
        bos_token=BOS,
        eos_token=EOS,
        **kwargs,
    )
    return str(rendered[0])


def _cases(source: str) -> Iterator[tuple[str, list[dict[str, Any]], dict[str, Any]]]:
    for name, (messages, kwargs) in CONVERSATIONS.items():
        yield name, messages, kwargs
    if "enable_thinking" in source:
        for name, (messages, kwargs) in THINKING.items():
            yield name, messages, kwargs


#: What transformers raises where a template pipes a Jinja generator into ``tojson``.
GENERATOR_JSON = "Object of type generator is not JSON serializable"


def _compare(source: str) -> tuple[int, int, int, list[str]]:
    """(identical renderings, renderings both refuse, renderings only ours makes (a
    generator given to ``tojson``), mismatches) of one template."""
    ours = ChatTemplate(source, bos_token=BOS, eos_token=EOS)
    identical = both_raise = 0
    mismatches: list[str] = []
    ours_only: list[str] = []
    for name, messages, kwargs in _cases(source):
        before = copy.deepcopy(messages)
        try:
            expected = _reference(source, messages, kwargs)
        except Exception as exc:  # noqa: BLE001 - whatever transformers raises, we must refuse too
            try:
                ours.render(messages, add_generation_prompt=True, **kwargs)
            except ChatTemplateError:
                both_raise += 1
                continue
            if GENERATOR_JSON in str(exc):
                # transformers' tojson cannot list a Jinja generator (``tools | map(...)``);
                # llama.cpp's renderer can, and so can ours (a superset, on purpose).
                ours_only.append(name)
                continue
            mismatches.append(f"{name}: transformers raised {type(exc).__name__}: {exc}; ours rendered")
            continue
        try:
            got = ours.render(messages, add_generation_prompt=True, **kwargs)
        except ChatTemplateError as exc:
            mismatches.append(f"{name}: ours raised {exc}")
            continue
        assert messages == before, "rendering must not change the caller's messages"
        if got == expected:
            identical += 1
        else:
            mismatches.append(f"{name}: differs\n--- transformers\n{expected!r}\n--- ours\n{got!r}")
    return identical, both_raise, len(ours_only), mismatches


def test_renders_as_transformers(template_path: Path) -> None:
    _, _, _, mismatches = _compare(template_path.read_text(encoding="utf-8"))
    assert not mismatches, "\n".join(mismatches)


def test_corpus_summary(capsys: pytest.CaptureFixture[str]) -> None:
    """identical / total over the whole corpus, printed (``-s`` not needed)."""
    identical = both_raise = only_ours = total = 0
    for path in _template_files():
        source = path.read_text(encoding="utf-8")
        same, refused, extra, _ = _compare(source)
        identical, both_raise, only_ours = identical + same, both_raise + refused, only_ours + extra
        total += len(list(_cases(source)))
    with capsys.disabled():
        print(
            f"\nchat template corpus: {identical} identical, {both_raise} refused by both "
            f"(transformers raises), {only_ours} rendered by ours only (a generator to tojson), "
            f"of {total} renderings over {len(_template_files())} templates"
        )
    assert identical + both_raise + only_ours == total


# -- the environment's pieces, on small templates ---------------------------------------------


def _render(source: str, messages: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
    return ChatTemplate(source, bos_token=BOS, eos_token=EOS).render(messages or [], **kwargs)


def test_undefined_variables_are_falsy_and_empty_but_fail_when_used_further() -> None:
    assert _render("{% if tools %}T{% endif %}{% if not enable_thinking %}N{% endif %}[{{ missing }}]") == "N[]"
    assert _render("{{ tools is none }}|{{ documents is none }}") == "True|True"
    with pytest.raises(ChatTemplateError, match="undefined"):
        _render("{{ missing.attribute }}")


def test_tojson_writes_plain_json_with_its_options() -> None:
    value = {"b": "é \"<&>\"", "a": [1, 2]}
    assert _render("{{ v | tojson }}", v=value) == '{"b": "é \\"<&>\\"", "a": [1, 2]}'
    assert _render("{{ v | tojson(ensure_ascii=True, sort_keys=True) }}", v=value) == (
        '{"a": [1, 2], "b": "\\u00e9 \\"<&>\\""}'
    )
    assert _render("{{ v | tojson(indent=2, separators=(',', ': ')) }}", v={"a": 1}) == '{\n  "a": 1\n}'


def test_loop_controls_generation_blocks_and_globals() -> None:
    source = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
        "|{{ strftime_now('%Y') | length }}|{{ dict(a=1) }}"
    )
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "user", "content": "x"}]
    assert _render(source, messages) == "u|4|{'a': 1}"
    with pytest.raises(ChatTemplateError, match="^no tools here$"):
        _render("{{ raise_exception('no tools here') }}")


def test_reasoning_is_passed_under_every_name_templates_read() -> None:
    source = "{% for m in messages %}{{ m.reasoning_content }}/{{ m.thinking }};{% endfor %}"
    messages = [{"role": "assistant", "content": "a", "reasoning": "r"}, {"role": "user", "content": "u"}]
    assert _render(source, messages) == "r/r;/;"


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.append(1) }}",
        "{% set ns = namespace(_x=1) %}",
        "{% set ns = namespace() %}{% set ns._x = 1 %}",
        "{{ ''.__class__.__mro__ }}",
        "{{ dict.__class__ }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ none + 'text' }}",
    ],
)
def test_the_sandbox_refuses_mutation_and_internals(source: str) -> None:
    try:
        rendered = _render(source, [{"role": "user", "content": "u"}])
    except ChatTemplateError:
        return
    assert "class" not in rendered and "globals" not in rendered and rendered == ""


@pytest.mark.parametrize("name", ["bos_token", "eos_token", "raise_exception", "strftime_now", "namespace", "dict"])
def test_extra_variables_cannot_replace_what_the_renderer_sets(name: str) -> None:
    # (messages, tools, documents and add_generation_prompt are render()'s own parameters)
    with pytest.raises(ChatTemplateError, match="set by the server"):
        extra: dict[str, Any] = {name: "x"}
        ChatTemplate("{{ bos_token }}").render([], **extra)
