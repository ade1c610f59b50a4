"""tests/deploy/helm_template.py refuses what it does not implement, so a chart template that
outgrows it fails the chart's tests instead of rendering wrongly."""

from __future__ import annotations

from pathlib import Path

import pytest
from helm_template import UnsupportedTemplate, render_chart


def _chart(tmp_path: Path, template: str) -> Path:
    (tmp_path / "templates").mkdir()
    (tmp_path / "Chart.yaml").write_text("name: c\nversion: 0.1.0\nappVersion: '1'\n")
    (tmp_path / "values.yaml").write_text("name: x\nitems: [a, b]\n")
    (tmp_path / "templates" / "t.yaml").write_text(template)
    return tmp_path


@pytest.mark.parametrize(
    ("template", "error"),
    [
        ("a: {{ .Values.name | upper }}\n", "unknown template function 'upper'"),
        ("a: {{ b64enc .Values.name }}\n", "unknown template function 'b64enc'"),
        ("{{- range .Values.items }}\n- {{ . }}\n{{- end }}\n", "unsupported action"),
        ("{{- $n := .Values.name }}\na: {{ $n }}\n", "unsupported syntax"),
        ('a: {{ include "c/templates/other.yaml" . }}\n', "unknown template 'c/templates/other"),
        ("a: {{ .Values.items }}\n", "use toYaml"),
    ],
)
def test_what_the_renderer_does_not_implement_fails_loudly(
    tmp_path: Path, template: str, error: str
) -> None:
    with pytest.raises(UnsupportedTemplate, match=error):
        render_chart(_chart(tmp_path, template))


def test_the_renderer_renders_what_it_implements(tmp_path: Path) -> None:
    template = (
        "{{- with .Values.items }}\nitems:\n  {{- toYaml . | nindent 2 }}\n{{- end }}\n"
        '{{- if not .Values.name }}\nname: none\n{{- else if (contains "x" .Values.name) }}\n'
        'name: {{ print $.Values.name "-" .Chart.Name | quote }}\n{{- else }}\nname: other\n'
        "{{- end }}\n"
    )
    assert render_chart(_chart(tmp_path, template)) == {
        "t.yaml": [{"items": ["a", "b"], "name": "x-c"}]
    }
