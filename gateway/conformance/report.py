"""The results as a text table, a JSON document and one self-contained HTML page."""

from __future__ import annotations

import dataclasses
import html
from collections import Counter
from typing import Any

from gateway.conformance.runner import CheckResult, Target

__all__ = ["as_html", "as_json", "as_table", "summary"]


def summary(results: list[CheckResult]) -> dict[str, int]:
    """Counts per verdict, and how many of the applicable checks passed."""
    counts = Counter(result.verdict for result in results)
    return {"pass": counts["pass"], "fail": counts["fail"], "n/a": counts["n/a"], "applicable": counts["pass"] + counts["fail"]}


def as_table(results: list[CheckResult]) -> str:
    """One row per check; each failure's evidence below the table."""
    width = max([len(r.name) for r in results] + [5])
    lines = [f"{'check':<{width}}  verdict  note", f"{'-' * width}  -------  ----"]
    for result in results:
        note = result.evidence.splitlines()[0][:100] if result.evidence else ""
        lines.append(f"{result.name:<{width}}  {result.verdict:<7}  {note}")
    counts = summary(results)
    lines.append(f"\n{counts['pass']}/{counts['applicable']} applicable checks pass ({counts['n/a']} n/a)")
    failures = [r for r in results if r.verdict == "fail"]
    for result in failures:
        lines.append(f"\n--- FAIL {result.name} ({result.reference})\n{result.evidence}")
    return "\n".join(lines)


def as_json(target: Target, results: list[CheckResult]) -> dict[str, Any]:
    return {
        "target": {"url": target.url, "model": target.model},
        "summary": summary(results),
        "checks": [dataclasses.asdict(result) for result in results],
    }


_STYLE = (
    "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
    "td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top;text-align:left}"
    ".pass{background:#e6f4e6}.fail{background:#fbe3e3}.na{background:#eee}"
    "pre{white-space:pre-wrap;max-width:70em;margin:0}"
)


def as_html(target: Target, results: list[CheckResult]) -> str:
    """A page with no external resources: the table, the evidence folded under each failure."""
    counts = summary(results)
    rows = []
    for result in results:
        css = "na" if result.verdict == "n/a" else result.verdict
        evidence = ""
        if result.evidence:
            evidence = f"<details><summary>{html.escape(result.evidence.splitlines()[0][:120])}</summary><pre>{html.escape(result.evidence)}</pre></details>"
        rows.append(
            f"<tr class={css}><td>{html.escape(result.name)}</td><td>{html.escape(result.api)}</td>"
            f"<td>{result.verdict}</td><td>{html.escape(result.reference)}</td><td>{evidence}</td></tr>"
        )
    title = f"Conformance of {html.escape(target.url)} ({html.escape(target.model)})"
    return (
        f"<!doctype html><html><head><meta charset=utf-8><title>{title}</title><style>{_STYLE}</style></head>"
        f"<body><h1>{title}</h1><p>{counts['pass']}/{counts['applicable']} applicable checks pass, "
        f"{counts['fail']} fail, {counts['n/a']} n/a.</p><table><tr><th>check</th><th>api</th><th>verdict</th>"
        f"<th>reference</th><th>evidence</th></tr>{''.join(rows)}</table></body></html>\n"
    )

