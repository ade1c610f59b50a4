"""Every hookspec is documented, in its docstring and in docs/plugins.md (datasette's habit).

Adding a hook to ``plugins/hookspecs.py`` without a section in the plugin author's guide
fails here, with the hook's name; so does a section left behind for a hook that was removed.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import plugins.hookspecs as hookspecs

DOC = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"
SPEC_MARKER = f"{hookspecs.PROJECT_NAME}_spec"  # set by pluggy.HookspecMarker("infermux")


def hook_names() -> list[str]:
    return sorted(
        name
        for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
        if hasattr(fn, SPEC_MARKER)
    )


def hook_sections() -> dict[str, str]:
    """``### infermux_x`` heading -> the text up to the next heading of level 2 or 3."""
    text = DOC.read_text(encoding="utf-8")
    sections: dict[str, str] = {}
    parts = re.split(r"^(#{2,3} .*)$", text, flags=re.MULTILINE)
    for heading, body in zip(parts[1::2], parts[2::2], strict=True):
        match = re.fullmatch(r"### `?(infermux_\w+)`?", heading.strip())
        if match:
            sections[match.group(1)] = body
    return sections


def test_the_hookspec_module_has_hooks() -> None:
    # Guards the marker-based discovery itself: a broken lookup must not pass vacuously.
    assert len(hook_names()) >= 12


@pytest.mark.parametrize("name", hook_names())
def test_hook_has_a_docstring(name: str) -> None:
    doc = inspect.getdoc(getattr(hookspecs, name)) or ""
    assert len(doc) > 80, f"{name} needs a docstring: when it is called, arguments, return value"


@pytest.mark.parametrize("name", hook_names())
def test_hook_is_documented_in_the_guide(name: str) -> None:
    section = hook_sections().get(name)
    assert section is not None, f"docs/plugins.md has no '### {name}' section"
    missing = [
        label
        for label in ("**When:**", "**Arguments:**", "**Returns:**", "**Built-in:**")
        if label not in section
    ]
    assert not missing, f"docs/plugins.md '### {name}' lacks {', '.join(missing)}"
    assert "```python" in section, f"docs/plugins.md '### {name}' needs a short example"
    for argument in inspect.signature(getattr(hookspecs, name)).parameters:
        assert f"`{argument}" in section, (
            f"docs/plugins.md '### {name}' does not describe the argument {argument!r}"
        )


def test_the_guide_documents_no_hook_that_does_not_exist() -> None:
    stale = sorted(set(hook_sections()) - set(hook_names()))
    assert not stale, f"docs/plugins.md documents hooks that are not in hookspecs.py: {stale}"
