"""The built-in backend kinds, registered through ``infermux_register_backend_kinds``.

Each kind's module is imported only when a backend of that kind is created, so a missing
optional library (llama-cpp-python, torch, mlx) costs nothing until it is used, and then
fails with :class:`~backends.errors.BackendUnavailableError` carrying an install hint.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from backends.base import Backend, BackendConfig
from backends.errors import BackendUnavailableError
from plugins.hookspecs import hookimpl

__all__ = ["BUILTIN_KINDS", "LazyBackendFactory", "infermux_register_backend_kinds"]

#: kind -> (module exposing ``create_backend``, install hint for when it cannot be imported).
BUILTIN_KINDS: dict[str, tuple[str, str]] = {
    "mock": ("backends.mock", 'pip install -e "."'),
    "llamacpp": ("backends.llamacpp", 'pip install -e ".[llamacpp]"'),
    "openai": ("backends.openai_compat", 'pip install -e "."'),
    "core_engine": ("backends.core_engine", 'pip install -e ".[core]"'),
    "mlx": ("backends.mlx", 'pip install -e ".[mlx]"'),
    "disaggregated": ("backends.disaggregated", 'pip install -e ".[core]"'),
}


class LazyBackendFactory:
    """Imports the kind's module on first use and calls its ``create_backend(config)``."""

    def __init__(self, kind: str, module_name: str, install_hint: str) -> None:
        self.kind = kind
        self.module_name = module_name
        self.install_hint = install_hint

    def __call__(self, config: BackendConfig) -> Backend:
        try:
            module = importlib.import_module(self.module_name)
        except ImportError as exc:
            raise BackendUnavailableError(
                f"backend {config.name!r}: kind {self.kind!r} is unavailable ({exc}); "
                f"install it with `{self.install_hint}`"
            ) from exc
        create_backend: Callable[[BackendConfig], Backend] = module.create_backend
        return create_backend(config)

    def resolve(self) -> Callable[[BackendConfig], Backend]:
        """The kind's own ``create_backend`` (what a worker process imports by name)."""
        create_backend: Callable[[BackendConfig], Backend] = importlib.import_module(
            self.module_name
        ).create_backend
        return create_backend

    def __repr__(self) -> str:
        return f"LazyBackendFactory({self.kind!r}, {self.module_name!r})"


@hookimpl(trylast=True)
def infermux_register_backend_kinds(
    register: Callable[[str, Callable[..., Backend]], None],
) -> None:
    """Register every built-in kind (lazily imported)."""
    for kind, (module_name, hint) in BUILTIN_KINDS.items():
        register(kind, LazyBackendFactory(kind, module_name, hint))
