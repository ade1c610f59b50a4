"""``infermux plugin new NAME``: the skeleton installs, is discovered and passes its tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(*args: str, cwd: Path = REPO, pythonpath: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, str(REPO)) if p)
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_generated_package_passes_its_own_tests_once_installed(tmp_path: Path) -> None:
    made = run("-m", "gateway.cli", "plugin", "new", "acme-tagger", "--dir", str(tmp_path))
    assert made.returncode == 0, made.stderr
    package = tmp_path / "acme-tagger"
    assert "pip install -e" in made.stdout
    assert {str(p.relative_to(package)) for p in package.rglob("*") if p.is_file()} == {
        "pyproject.toml",
        "README.md",
        "acme_tagger/__init__.py",
        "tests/conftest.py",
        "tests/test_acme_tagger.py",
    }
    assert 'acme-tagger = "acme_tagger"' in (package / "pyproject.toml").read_text()

    # Installed into a directory of its own (not the shared virtualenv): the entry point is
    # found through the dist-info there, exactly as from site-packages.
    site = tmp_path / "site"
    installed = run(
        "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
        "--target", str(site), str(package),
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    assert any(site.glob("acme_tagger-0.1.0.dist-info"))

    tested = run(
        "-m", "pytest", "-q", "-p", "no:cacheprovider", str(package / "tests"),
        cwd=tmp_path, pythonpath=str(site),
    )  # fmt: skip
    assert tested.returncode == 0, tested.stdout[-3000:] + tested.stderr[-3000:]
    assert "2 passed" in tested.stdout

    listed = run("-m", "gateway.cli", "plugins", pythonpath=str(site))
    row = next(line for line in listed.stdout.splitlines() if line.startswith("acme-tagger"))
    assert row.split()[1] == "0.1.0" and "transform_request" in row


def test_bad_names_and_existing_directories_are_refused(tmp_path: Path) -> None:
    for name in ("Bad Name", "9lives", "plugins"):
        result = run("-m", "gateway.cli", "plugin", "new", name, "--dir", str(tmp_path))
        assert result.returncode == 2, name
        assert "NAME:" in result.stderr
    assert (
        run("-m", "gateway.cli", "plugin", "new", "twice", "--dir", str(tmp_path)).returncode == 0
    )
    again = run("-m", "gateway.cli", "plugin", "new", "twice", "--dir", str(tmp_path))
    assert again.returncode == 2
    assert "already exists" in again.stderr
