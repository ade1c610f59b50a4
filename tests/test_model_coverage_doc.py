"""docs/models.md's coverage tables are what ``scripts/model_coverage.py`` generates from the
corpus now: a change to the chat-template handling, the tool-call / reasoning format detection
or the tokenizers that changes a row fails here until ``--write`` is run (the doc says what the
code does, not what someone once wrote)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "model_coverage.py"


def _script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("model_coverage", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_coverage_tables_of_docs_models_md_are_up_to_date() -> None:
    problem = _script().check()
    assert problem is None, problem
