"""infermux on each backend kind, as the conformance tests and the scoreboard run it.

One gateway serves an alias per kind (``mock``, ``core_engine``, ``mlx``, ``openai``), the
real ones on the default model; a second gateway serves ``llamacpp`` and is the upstream of
the ``openai`` backend (a remote that is another infermux, over loopback HTTP). Each model
loads once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

from backends.base import BackendConfig
from gateway.conformance.runner import Target
from gateway.testing import gateway_config, mock_backend

__all__ = ["BACKEND_KINDS", "infermux_targets"]

BACKEND_KINDS: tuple[str, ...] = ("mock", "core_engine", "llamacpp", "mlx", "openai")

#: Starts a gateway for a config and yields its base URL (``gateway.testing.run_gateway``,
#: or the tests' ``live_gateway`` factory).
GatewayStarter = Callable[..., AbstractContextManager[str]]


def _native(kind: str, **options: Any) -> BackendConfig:
    # A busy 2-core CPU (MLX on the CPU above all) may take longer than the default
    # first-byte timeout before the first token.
    return BackendConfig(name=kind, kind=kind, options=options, first_byte_timeout=300.0, idle_timeout=120.0)


@contextmanager
def infermux_targets(start: GatewayStarter, kinds: Sequence[str] = BACKEND_KINDS) -> Iterator[dict[str, Target]]:
    """A :class:`Target` per kind in ``kinds``, served until the block ends."""
    unknown = set(kinds) - set(BACKEND_KINDS)
    if unknown:
        raise ValueError(f"unknown backend kinds {sorted(unknown)}; known: {BACKEND_KINDS}")
    targets: dict[str, Target] = {}
    with ExitStack() as stack:
        if "llamacpp" in kinds or "openai" in kinds:
            upstream = stack.enter_context(
                start(gateway_config(_native("llamacpp", n_ctx=2048, parallel=2), models={"llamacpp": ["llamacpp"]}))
            )
            if "llamacpp" in kinds:
                targets["llamacpp"] = Target(str(upstream), "llamacpp")
        backends: list[BackendConfig] = []
        if "mock" in kinds:
            backends.append(mock_backend("mock", tokenize=True))
        if "core_engine" in kinds:
            backends.append(_native("core_engine", kv_cache_memory_mb=128))
        if "mlx" in kinds:
            backends.append(_native("mlx", n_ctx=2048))
        if "openai" in kinds:
            remote = {"base_url": f"{upstream}/v1", "model": "llamacpp"}
            backends.append(BackendConfig(name="openai", kind="openai", options=remote, first_byte_timeout=300.0))
        if backends:
            gateway = stack.enter_context(start(gateway_config(*backends, models={b.name: [b.name] for b in backends})))
            for backend in backends:
                targets[backend.name] = Target(str(gateway), backend.name)
        yield {kind: targets[kind] for kind in kinds}
