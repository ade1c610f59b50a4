"""Runs the Triton kernel tests (``test_triton_*.py``) under the Triton CPU interpreter.

They run in a child pytest because ``TRITON_INTERPRET=1`` has to be set before triton is
imported and changes what every ``@triton.jit`` builds: set in this process it would leak
into the rest of the suite. See this folder's conftest.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def test_triton_kernels_match_references_under_the_interpreter() -> None:
    pytest.importorskip("triton", reason="the dev extra installs triton; the kernels need it")
    modules = sorted(str(p.relative_to(ROOT)) for p in HERE.glob("test_triton_*.py"))
    assert len(modules) >= 5, f"kernel test modules went missing: {modules}"
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "INFERMUX_TEST_DEVICE": "cpu",
        "INFERMUX_KERNELS": "auto",
    }
    command = [
        sys.executable,
        "-m",
        "pytest",
        *modules,
        "-q",
        "-p",
        "no:cacheprovider",
        # Only this folder's conftest: the child needs none of the gateway fixtures.
        f"--confcutdir={HERE.relative_to(ROOT)}",
    ]
    child = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    report = child.stdout[-12000:] + child.stderr[-4000:]
    assert child.returncode == 0, f"Triton kernel tests failed under the interpreter:\n{report}"
    last_line = child.stdout.strip().splitlines()[-1]
    assert (
        " passed" in last_line and "skipped" not in last_line and "deselected" not in last_line
    ), report
