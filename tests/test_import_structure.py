"""The import structure: no module imports itself back through others, the layers import
downwards only (core_engine <- backends <- plugins <- gateway), and inside the gateway a
request's stages do too (gateway.http -> gateway.openai -> gateway.serving -> gateway.config).

For cycles every ``import`` statement counts, wherever it stands (module level, inside a
function, under ``TYPE_CHECKING``): a cycle through a lazy import is still two modules that
cannot be understood one without the other. For the layers, imports under ``TYPE_CHECKING``
do not count: the hook specifications name the gateway's config type in their signatures
(a plugin receives it) without running a line of the gateway.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core_engine", "backends", "plugins", "gateway")
#: The plugin author's pytest fixtures start a live gateway: the one plugins module above it.
STARTS_A_GATEWAY = {"plugins.testing"}
#: What each layer may import of the project (besides itself).
ALLOWED = {
    "core_engine": set(),
    "backends": {"core_engine"},
    "plugins": {"core_engine", "backends"},
    "gateway": {"core_engine", "backends", "plugins"},
}


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the statements under ``if TYPE_CHECKING:``."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for statement in node.body:
                inside.update(id(n) for n in ast.walk(statement))
    return inside


def _imports(name: str, path: Path, modules: dict[str, Path], *, runtime_only: bool = False) -> set[str]:
    """The project modules ``name`` imports (a package's ``__init__`` is not counted for
    ``from package import module``: that names the module)."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    skipped = _type_checking_nodes(tree) if runtime_only else set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def _graph(*, runtime_only: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules, runtime_only=runtime_only) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_itself_back() -> None:
    graph = _graph()
    cycles = _cycles(graph)
    described = [
        " <-> ".join(c) + ": " + "; ".join(f"{a} -> {b}" for a in c for b in sorted(graph[a]) if b in c)
        for c in cycles
    ]
    assert not cycles, "import cycles:\n" + "\n".join(described)


@pytest.mark.parametrize("package", PACKAGES)
def test_layers_import_downwards_only(package: str) -> None:
    wrong = sorted(
        f"{name} -> {target}"
        for name, targets in _graph(runtime_only=True).items()
        if name.split(".")[0] == package and name not in STARTS_A_GATEWAY
        for target in targets
        if target.split(".")[0] != package and target.split(".")[0] not in ALLOWED[package]
    )
    assert not wrong, "\n".join(wrong)


#: What each of the gateway's stages must not import (every import counts, ``TYPE_CHECKING``
#: ones too): a name covers its submodules; the third-party names are the web framework and
#: the ASGI server, which only the HTTP edge knows.
_WEB = ("litestar", "starlette", "uvicorn")
_ABOVE_SERVING = ("gateway.http", "gateway.openai", "gateway.anthropic", "gateway.controllers")
GATEWAY_STAGES_MUST_NOT_IMPORT = {
    "gateway.config": (
        *_ABOVE_SERVING, "gateway.serving", "gateway.app", "gateway.state", "gateway.commands", *_WEB,
    ),
    "gateway.serving": (*_ABOVE_SERVING, "gateway.app", "gateway.state", "gateway.commands", *_WEB),
    "gateway.openai": (
        "gateway.http", "gateway.anthropic", "gateway.controllers", "gateway.app", "gateway.state",
        "gateway.commands", *_WEB,
    ),
    "gateway.http": ("gateway.controllers", "gateway.app", "gateway.commands"),
}


def _imported_names(path: Path, name: str) -> set[str]:
    """Every module name an ``import`` statement of ``path`` names, project or not."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.add(module)
            out.update(f"{module}.{alias.name}" for alias in node.names)
    return out


def _covers(prefix: str, module: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


@pytest.mark.parametrize("stage", sorted(GATEWAY_STAGES_MUST_NOT_IMPORT))
def test_gateway_stages_import_downwards_only(stage: str) -> None:
    forbidden = GATEWAY_STAGES_MUST_NOT_IMPORT[stage]
    wrong = sorted(
        f"{name} -> {imported}"
        for name, path in _modules().items()
        if _covers(stage, name)
        for imported in _imported_names(path, name)
        if any(_covers(prefix, imported) for prefix in forbidden)
    )
    assert not wrong, "\n".join(wrong)


def test_the_graph_sees_the_imports_it_judges() -> None:
    graph, runtime = _graph(), _graph(runtime_only=True)
    # module level (backends/core_engine.py), inside a function (plugins/builtin/cost/plugin.py's
    # lazy Postgres ledger), under TYPE_CHECKING (plugins/hookspecs.py names InfermuxConfig)
    assert "backends.base" in graph["backends.core_engine"]
    assert "plugins.builtin.cost.pg_ledger" in graph["plugins.builtin.cost.plugin"]
    assert "gateway.config.types" in graph["plugins.hookspecs"]
    assert "gateway.config.types" not in runtime["plugins.hookspecs"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    # the stage rule sees third-party and relative imports, and imports of a name
    modules = _modules()
    assert "litestar" in _imported_names(modules["gateway.http.errors"], "gateway.http.errors")
    assert "gateway.serving.choices" in _imported_names(
        modules["gateway.http.respond"], "gateway.http.respond"
    )
    assert not _covers("gateway.http", "gateway.httpx")
