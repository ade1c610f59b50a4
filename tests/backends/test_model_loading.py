"""The in-process backends find their model by one rule (backends/model_loading.py): a
configured path that is missing or of the wrong kind is a config error naming the option, and
each backend accepts only what it can load."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import pytest

from backends import core_engine, llamacpp, mlx, model_loading
from backends.base import BackendConfig
from backends.errors import BackendConfigError
from backends.model_loading import load_with_progress, resolve_model_path


@pytest.mark.parametrize("module", [core_engine, llamacpp, mlx], ids=["core_engine", "llamacpp", "mlx"])
async def test_a_missing_model_path_is_a_config_error_naming_the_option(module: object, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.gguf"
    backend = module.create_backend(  # type: ignore[attr-defined]
        BackendConfig(name="b", kind=module.__name__.split(".")[-1], options={"model_path": str(missing)})
    )
    with pytest.raises(BackendConfigError, match=r"model file not found: .*nowhere\.gguf.*backends\.b\.options\.model_path"):
        await backend.start()


@pytest.mark.parametrize(("module", "kind"), [(llamacpp, "a GGUF file"), (core_engine, "config.json")])
async def test_a_directory_the_backend_cannot_load_is_refused(module: object, kind: str, tmp_path: Path) -> None:
    backend = module.create_backend(  # type: ignore[attr-defined]
        BackendConfig(name="b", kind=module.__name__.split(".")[-1], options={"model_path": str(tmp_path)})
    )
    with pytest.raises(BackendConfigError, match=f"is not .*{kind}"):
        await backend.start()


def test_the_path_is_expanded_and_never_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert resolve_model_path("b", "~/m.gguf", accepts=Path.is_file, expected="a file") == tmp_path / "m.gguf"
    with pytest.raises(BackendConfigError, match="not found"):
        resolve_model_path("b", "HuggingFaceTB/SmolLM2-135M", accepts=Path.is_file, expected="a file")


async def test_a_slow_load_logs_its_progress(tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_loading, "PROGRESS_EVERY_S", 0.01)
    release = threading.Event()
    path = tmp_path / "m.gguf"
    path.write_bytes(b"x" * 1024)

    def load() -> str:
        release.wait(5)
        return "model"

    caplog.set_level(logging.INFO, logger="backends.model_loading")
    task = asyncio.ensure_future(load_with_progress("b", path, load))
    for _ in range(400):  # the load is held until a progress line has been logged
        if any("still loading" in r.getMessage() for r in caplog.records):
            break
        await asyncio.sleep(0.01)
    release.set()
    result, took = await task
    assert result == "model" and took > 0
    assert any("still loading m.gguf" in r.getMessage() for r in caplog.records)
    assert "backend b: loading m.gguf" in caplog.records[0].getMessage()
