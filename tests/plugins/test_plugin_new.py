"""``infermux plugin new NAME``: the skeleton installs, is discovered and passes its tests.

Nothing is pip-installed: the generated package is put in place the way an installer
leaves it, its module on ``PYTHONPATH`` and a ``.dist-info`` directory (``METADATA`` and
``entry_points.txt``, written from its own ``pyproject.toml``) under the test's directory,
which ``importlib.metadata`` finds exactly as in site-packages.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(*args: str, cwd: Path = REPO, pythonpath: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, str(REPO)) if p)
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def install_metadata(package: Path, site: Path) -> Path:
    """The ``.dist-info`` an installer writes for ``package``'s ``[project]``: its name, its
    version and its entry points, from its pyproject.toml."""
    project = tomllib.loads((package / "pyproject.toml").read_text())["project"]
    name, version = project["name"], project["version"]
    dist_info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    groups = project.get("entry-points", {})
    (dist_info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{key} = {value}\n" for key, value in entries.items()) + "\n"
        for group, entries in groups.items()
    ))
    return dist_info


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

    # "Installed" into a directory of its own (not the shared virtualenv): the entry point
    # its pyproject declares is found through the dist-info there, as from site-packages.
    site = tmp_path / "site"
    dist_info = install_metadata(package, site)
    assert dist_info.name == "acme_tagger-0.1.0.dist-info"
    assert "acme-tagger = acme_tagger" in (dist_info / "entry_points.txt").read_text()
    path = os.pathsep.join((str(site), str(package)))

    tested = run(
        "-m", "pytest", "-q", "-p", "no:cacheprovider", str(package / "tests"),
        cwd=tmp_path, pythonpath=path,
    )  # fmt: skip
    assert tested.returncode == 0, tested.stdout[-3000:] + tested.stderr[-3000:]
    assert "2 passed" in tested.stdout

    listed = run("-m", "gateway.cli", "plugins", pythonpath=path)
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
