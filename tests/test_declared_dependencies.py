"""Every backend runs on what its extra declares: each module imports, and so does every import
its functions make at run time, in an environment holding only the distributions that
``pip install "infermux[EXTRA]"`` would bring.

Real per-extra installs would take minutes (torch alone is about 1 GB), so each environment is
built from this virtualenv's installed distributions: the dependency closure of the extra is
computed from pyproject.toml and the installed metadata (``Requires-Dist``, environment
markers and extras evaluated with ``packaging``), a fresh ``venv --without-pip`` gets symlinks
to exactly those distributions' files (found through their RECORD: top-level packages, modules,
``.libs`` directories, ``.dist-info``), a ``.pth`` puts the repository on ``sys.path``, and a
probe runs there in a subprocess. A module that imports something outside the closure fails
the test with its ImportError.

The probe imports every module the environment owns (plus the gateway's own, which every
environment has), then walks their functions' bodies (``ast``) and imports each module a
function imports lazily, except imports guarded by ``except ImportError`` (optional by design)
and ``if TYPE_CHECKING:``. A lazy import may fail only when the missing module belongs to a
distribution another extra declares directly (an optional feature: ``redis`` behind
``[state] backend = "redis"`` in the base gateway, ``triton`` behind CUDA in the core engine).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from functools import cache
from importlib.metadata import Distribution, distributions, packages_distributions
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("gateway", "backends", "plugins", "core_engine")

#: Which extra a module needs (first matching prefix wins); every other module is the base's.
#: ``dev``'s modules (pytest helpers for plugin authors) are not probed.
OWNERS: tuple[tuple[str, str], ...] = (
    ("core_engine.kernels.triton_ops", "gpu"),
    ("core_engine", "core"),
    ("backends.core_engine", "core"),
    ("backends.llamacpp", "llamacpp"),
    ("backends._llamacpp_", "llamacpp"),
    ("backends.mlx.", "mlx"),
    ("plugins.testing", "dev"),
    ("gateway.testing", "dev"),
)
#: Modules that are not imported (``python -m`` entry points run on import).
NOT_IMPORTED = ("gateway.bench.__main__",)

#: The environments probed: the extras installed together (the base is always there).
ENVIRONMENTS: dict[str, tuple[str, ...]] = {
    "base": (),
    "core": ("core",),
    "core+gpu": ("core", "gpu"),
    "llamacpp": ("llamacpp",),
    "mlx": ("mlx",),
    "scaleout": ("scaleout",),
    "bench": ("bench",),
}


def owner(module: str) -> str:
    for prefix, extra in OWNERS:
        if module == prefix.rstrip(".") or module.startswith(
            prefix if prefix.endswith(("_", ".")) else prefix + "."
        ):
            return extra
    return "base"


def all_modules() -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join(parts)
            if name not in NOT_IMPORTED:
                found.append(name)
    return found


# -- what pyproject.toml declares, and its closure over the installed distributions ----------


@cache
def declared() -> dict[str, list[str]]:
    """``{"": [project.dependencies], extra: [its requirements], ...}``."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {"": list(project["dependencies"]), **project["optional-dependencies"]}


@cache
def installed() -> dict[str, Distribution]:
    """The distributions of this virtualenv's site-packages, by canonical name."""
    site = {Path(p).resolve() for p in sys.path if p.endswith("site-packages")}
    found: dict[str, Distribution] = {}
    for dist in distributions():
        if Path(str(dist.locate_file(""))).resolve() in site:
            found.setdefault(canonicalize_name(dist.metadata["Name"]), dist)
    return found


def _wanted(requirement: Requirement, extras: Iterable[str]) -> bool:
    marker = requirement.marker
    return marker is None or any(marker.evaluate({"extra": e}) for e in {"", *extras})


def closure(extras: Iterable[str]) -> tuple[set[str], list[str]]:
    """The distributions ``pip install ".[EXTRAS]"`` brings (canonical names), and the
    requirements in that closure that this virtualenv does not have."""
    roots = [Requirement(r) for key in ("", *extras) for r in declared()[key]]
    todo = [(r, "pyproject.toml") for r in roots if _wanted(r, ())]
    seen: dict[str, set[str]] = {}  # name -> the extras of it already followed
    missing: list[str] = []
    while todo:
        requirement, wanted_by = todo.pop()
        name = canonicalize_name(requirement.name)
        if name in seen and set(requirement.extras) <= seen[name]:
            continue
        dist = installed().get(name)
        if dist is None:
            missing.append(f"{requirement} (wanted by {wanted_by})")
            continue
        seen.setdefault(name, set()).update(requirement.extras)
        for text in dist.requires or []:
            child = Requirement(text)
            if _wanted(child, seen[name]):
                todo.append((child, name))
    return set(seen), missing


# -- the environment --------------------------------------------------------------------------


@cache
def _file_tree() -> dict[str, Any]:
    """Every installed file (relative to site-packages) as a tree; each node's ``None`` key
    holds the distributions that own something under it."""
    root: dict[Any, Any] = {None: set()}
    for name, dist in installed().items():
        for file in dist.files or []:
            parts = file.parts
            if not parts or parts[0] == ".." or "__pycache__" in parts:
                continue
            node = root
            node[None].add(name)
            for part in parts:
                node = node.setdefault(part, {None: set()})
                node[None].add(name)
    return root


def _link(node: dict[Any, Any], source: Path, target: Path, wanted: set[str]) -> None:
    """Symlink the largest subtrees that belong to ``wanted`` distributions only (a namespace
    package shared with others, such as ``opentelemetry/``, is made a directory and recursed)."""
    for part, child in node.items():
        if part is None:
            continue
        owners = child[None]
        if not owners & wanted:
            continue
        if owners <= wanted or len(child) == 1:  # only theirs, or a file
            (target / part).symlink_to(source / part)
        else:
            (target / part).mkdir()
            _link(child, source / part, target / part, wanted)


def make_environment(directory: Path, dists: set[str]) -> Path:
    """A venv at ``directory`` with only ``dists`` and the repository; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(directory)], check=True)
    (site,) = (directory / "lib").glob("python3*/site-packages")
    source = Path(str(next(iter(installed().values())).locate_file("")))
    _link(_file_tree(), source, site, dists)
    (site / "infermux-repository.pth").write_text(f"{REPO}\n")
    return directory / "bin" / "python"


# -- the probe, run inside the environment ----------------------------------------------------

_PROBE = r'''
import ast, importlib, json, sys, traceback
from pathlib import Path

spec = json.loads(sys.argv[1])
optional = set(spec["optional"])  # top-level modules other extras provide
failures, skipped = [], []

def missing_top(exc):
    name = getattr(exc, "name", None) or ""
    return name.split(".")[0]

def guarded(node, parents):
    """Inside ``try: ... except ImportError`` or ``if TYPE_CHECKING:``."""
    for parent in parents:
        if isinstance(parent, ast.Try):
            for handler in parent.handlers:
                names = [handler.type] if not isinstance(handler.type, ast.Tuple) else handler.type.elts
                if any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError", "Exception") for n in names):
                    if any(node is n or node in ast.walk(n) for n in parent.body):
                        return True
        if isinstance(parent, ast.If) and "TYPE_CHECKING" in ast.unparse(parent.test):
            return True
    return False

def lazy_imports(module_name, path):
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    package = module_name if path.endswith("__init__.py") else module_name.rpartition(".")[0]
    out = []
    def visit(node, parents, in_function):
        for child in ast.iter_child_nodes(node):
            chain = [*parents, node]
            inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if inside and isinstance(child, (ast.Import, ast.ImportFrom)) and not guarded(child, chain):
                if isinstance(child, ast.Import):
                    out.extend((a.name, None, child.lineno) for a in child.names)
                else:
                    base = child.module or ""
                    if child.level:
                        anchor = package.split(".")
                        anchor = anchor[: len(anchor) - (child.level - 1)]
                        base = ".".join([*anchor, *( [base] if base else [])])
                    out.extend((base, a.name, child.lineno) for a in child.names)
            visit(child, chain, inside)
    visit(tree, [], False)
    return out

# The gateway's entry point first: importing some submodules on their own meets an import
# cycle that the app's import order resolves.
for name in ["gateway.app", *spec["modules"]]:
    try:
        importlib.import_module(name)
    except BaseException as exc:
        failures.append(f"import {name}: {type(exc).__name__}: {exc}")
for name in spec["modules"]:
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    if module is None or not path:
        continue
    for target, attr, line in lazy_imports(name, path):
        where = f"{name} (line {line}): import {target}" + (f".{attr}" if attr else "")
        try:
            imported = importlib.import_module(target)
            if attr and attr != "*" and not hasattr(imported, attr):
                importlib.import_module(f"{target}.{attr}")
        except BaseException as exc:
            if isinstance(exc, ImportError) and missing_top(exc) in optional:
                skipped.append(f"{where}: {missing_top(exc)} (another extra's)")
            else:
                failures.append(f"{where}: {type(exc).__name__}: {exc}")
for snippet in spec["run"]:
    try:
        exec(snippet, {})
    except BaseException:
        failures.append(f"{snippet!r}: {traceback.format_exc(limit=3)}")
print(json.dumps({"failures": failures, "skipped": skipped}))
'''

#: The base must also build the gateway with the mock backend.
_BASE_RUN = [
    "from gateway.app import create_app\n"
    "from gateway.config.load import config_from_dict\n"
    "create_app(config_from_dict({'backends': [{'name': 'mock', 'kind': 'mock'}],"
    " 'models': [{'alias': 'echo', 'backends': ['mock']}]}))",
]


def _top_level_names(dist_names: Iterable[str]) -> set[str]:
    wanted = {canonicalize_name(n) for n in dist_names}
    return {
        top
        for top, dists in packages_distributions().items()
        if any(canonicalize_name(d) in wanted for d in dists)
    }


def _optional_for(extras: tuple[str, ...], dists: set[str]) -> set[str]:
    """Top-level modules of the distributions other extras declare directly, less those of
    the environment's own distributions ``dists``."""
    others = [
        Requirement(r).name
        for extra, requirements in declared().items()
        if extra and extra not in extras
        for r in requirements
    ]
    return _top_level_names(others) - _top_level_names(dists)


@pytest.mark.parametrize("environment", list(ENVIRONMENTS))
def test_each_extra_brings_what_its_modules_import(environment: str, tmp_path: Path) -> None:
    extras = ENVIRONMENTS[environment]
    unknown = set(extras) - set(declared())
    assert not unknown, f"pyproject.toml has no extra {unknown}"
    dists, missing = closure(extras)
    assert not missing, f"declared but not installed here (run `make install`): {missing}"
    python = make_environment(tmp_path / "venv", dists)
    owned = {"base", *extras}
    modules = [m for m in all_modules() if owner(m) in owned]
    spec = {
        "modules": modules,
        "optional": sorted(_optional_for(extras, dists)),
        "run": _BASE_RUN if environment == "base" else [],
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["HF_HUB_OFFLINE"] = "1"
    result = subprocess.run(
        [str(python), "-c", _PROBE, json.dumps(spec)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert not report["failures"], (
        f"the {environment!r} environment ({', '.join(sorted(dists))}) lacks what these need:\n"
        + "\n".join(report["failures"])
    )
    if environment == "base":
        cli = subprocess.run(
            [str(python), "-m", "gateway.cli", "--help"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert cli.returncode == 0, cli.stderr
        assert "serve" in cli.stdout and "skipping" not in cli.stderr, cli.stderr


def test_the_probe_notices_an_undeclared_import(tmp_path: Path) -> None:
    # The base environment has no torch: a module importing it must fail there.
    dists, _ = closure(())
    assert "torch" not in dists and "litestar" in dists
    python = make_environment(tmp_path / "venv", dists)
    result = subprocess.run(
        [str(python), "-c", "import gateway.config.load\nimport torch"],
        cwd=tmp_path,
        env={"PATH": os.environ.get("PATH", "")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "No module named 'torch'" in result.stderr


def test_the_dockerfile_installs_declared_extras() -> None:
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    (extras,) = re.findall(r'pip install [^\n]*"\.\[([a-z,]+)\]"', dockerfile)
    assert set(extras.split(",")) <= set(declared())
    assert "core" in extras.split(",")  # the image serves the core engine
