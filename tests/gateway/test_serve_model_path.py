"""``infermux serve PATH``: a GGUF file or a Hugging Face checkpoint directory served under its
name, as peers do (``vllm serve MODEL``, ``llama-server -m FILE``), with ``--api-key``; run as
a real subprocess on a free loopback port. Bad paths exit 2 with a message naming the path."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from backends.default_model import default_model_path
from gateway.config.load import (
    CLI_KEY_ID,
    ModelPathError,
    default_config,
    load_config,
    model_alias,
    model_path_config,
    with_api_key,
)
from gateway.config.types import ConfigError
from gateway.http.auth import hash_key
from tests.gateway.test_gateway_cli import infermux
from tests.telemetry.served_process import free_port

KEY = "imx-test-key-0123456789"


@pytest.fixture(autouse=True)
def private_ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The servers started here keep their usage ledger under tmp_path (never ./var)."""
    monkeypatch.setenv("INFERMUX_LEDGER_PATH", str(tmp_path / "ledger.sqlite3"))
    monkeypatch.delenv("INFERMUX_CONFIG", raising=False)
    monkeypatch.delenv("INFERMUX_API_KEY", raising=False)


@pytest.fixture()
def tiny_gguf(tmp_path: Path) -> Path:
    """The embedded SmolLM2 GGUF under another name."""
    path = tmp_path / "models" / "tiny-model.gguf"
    path.parent.mkdir()
    path.symlink_to(default_model_path())
    return path


@contextmanager
def serving(*args: str, ready: bool = True, timeout_s: float = 120) -> Iterator[str]:
    """``infermux serve ARGS`` on a free port; yields its base URL once it answers (``ready``:
    once /ready is 200, i.e. every backend loaded); SIGTERM on the way out."""
    port = free_port()
    process = infermux(
        "serve", *args, "--host", "127.0.0.1", "--port", str(port), "--no-access-log"
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                status = httpx.get(f"{base}/ready").status_code
                if status == 200 or not ready:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.1)
        yield base
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 0, stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


# -- the config a path makes -----------------------------------------------------------------


def test_a_gguf_gets_the_default_models_backends_under_its_stem(tiny_gguf: Path) -> None:
    config = model_path_config(tiny_gguf)
    (model,) = config.models
    assert model.alias == "tiny-model"
    defaults = default_config()
    assert [b.name for b in config.backends] == [b.name for b in defaults.backends]
    assert model.backends == defaults.models[0].backends
    for ours, theirs in zip(config.backends, defaults.backends, strict=True):
        assert ours.options == {**theirs.options, "model_path": str(tiny_gguf)}
    assert config.auth.keys == []


def test_a_checkpoint_directory_skips_llamacpp(tmp_path: Path) -> None:
    directory = tmp_path / "My-Model-1B"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    (directory / "model.safetensors").write_bytes(b"")
    config = model_path_config(directory)
    assert config.models[0].alias == "My-Model-1B"
    names = [b.name for b in config.backends]
    assert "llamacpp" not in names and names[0] == "core_engine"
    assert names == [b.name for b in default_config().backends if b.name != "llamacpp"]


def test_aliases() -> None:
    assert model_alias(Path("/m/Qwen3-8B-Q4_K_M.gguf")) == "Qwen3-8B-Q4_K_M"
    assert model_alias(Path("/m/big-00001-of-00003.gguf")) == "big"


def test_the_api_key_is_kept_as_its_hash(tiny_gguf: Path) -> None:
    config = with_api_key(load_config(None, model_path=tiny_gguf, env={}), KEY)
    (entry,) = config.auth.keys
    assert (entry.id, entry.key_sha256) == (CLI_KEY_ID, hash_key(KEY))
    with pytest.raises(ConfigError, match="--api-key"):
        with_api_key(config, "bad\nkey")


def test_a_path_and_a_config_exclude_each_other(tiny_gguf: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="exclude each other"):
        load_config(tmp_path / "c.toml", model_path=tiny_gguf, env={})
    # $INFERMUX_CONFIG is the default config: PATH replaces it.
    config = load_config(None, model_path=tiny_gguf, env={"INFERMUX_CONFIG": "/nonexistent.toml"})
    assert config.models[0].alias == "tiny-model"


def test_a_gguf_without_the_magic_is_refused(tmp_path: Path) -> None:
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf")
    with pytest.raises(ModelPathError, match="not a GGUF file"):
        model_path_config(fake)


# -- as a subprocess --------------------------------------------------------------------------


def test_bad_paths_exit_2_naming_the_path(tmp_path: Path, tiny_gguf: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "empty-dir").mkdir()
    cases = {
        str(tmp_path / "missing.gguf"): "no such file or directory",
        str(tmp_path / "notes.txt"): "neither a .gguf file nor a Hugging Face checkpoint directory",
        str(tmp_path / "empty-dir"): "a directory without config.json",
    }
    # Started together: most of each run is the interpreter's imports.
    processes = {path: infermux("serve", path) for path in cases}
    both = infermux("serve", str(tiny_gguf), "--config", str(tmp_path / "c.toml"))
    for path, process in processes.items():
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 2, stderr
        assert f"model path {path!r}: {cases[path]}" in stderr
        assert "Traceback" not in stderr
    _, stderr = both.communicate(timeout=120)
    assert both.returncode == 2, stderr
    assert "not both" in stderr and str(tiny_gguf) in stderr and "Traceback" not in stderr


def test_serve_a_gguf_with_an_api_key(tiny_gguf: Path) -> None:
    # One backend keeps the test short: the default set is checked above (config) and below
    # (/v1/models while loading).
    with serving(str(tiny_gguf), "--api-key", KEY, "--backend", "llamacpp") as base:
        assert httpx.get(f"{base}/v1/models").status_code == 401
        assert (
            httpx.get(f"{base}/v1/models", headers={"authorization": "Bearer nope"}).status_code
            == 401
        )
        models = httpx.get(f"{base}/v1/models", headers={"authorization": f"Bearer {KEY}"})
        assert models.status_code == 200
        assert [m["id"] for m in models.json()["data"]] == ["tiny-model"]

        client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
        answer = client.chat.completions.create(
            model="tiny-model", messages=[{"role": "user", "content": "Say hi."}], max_tokens=8
        )
        assert answer.choices[0].message.content
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(
                base_url=f"{base}/v1", api_key="wrong", max_retries=0
            ).chat.completions.create(
                model="tiny-model", messages=[{"role": "user", "content": "hi"}], max_tokens=8
            )
        no_key = httpx.post(
            f"{base}/v1/chat/completions",
            json={
                "model": "tiny-model",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
            },
        )
        assert no_key.status_code == 401


def test_serve_a_gguf_lists_it_on_the_default_backends(tiny_gguf: Path) -> None:
    # /v1/models answers from the config while the backends load: no need to wait for them.
    with serving(str(tiny_gguf), ready=False) as base:
        deadline = time.monotonic() + 60
        while (models := httpx.get(f"{base}/v1/models")).status_code != 200:
            assert time.monotonic() < deadline, models.text
            time.sleep(0.1)
    (entry,) = models.json()["data"]
    assert entry["id"] == "tiny-model"
    assert entry["backends"] == [b.name for b in default_config().backends]


def test_serve_a_checkpoint_directory(tmp_path: Path) -> None:
    hf_factory = pytest.importorskip("tests.core_engine.hf_factory")
    directory = hf_factory.save_checkpoint(
        hf_factory.tiny_hf_model("llama"), tmp_path / "tiny-llama"
    )
    with serving(str(directory), "--api-key", KEY) as base:
        headers = {"authorization": f"Bearer {KEY}"}
        (entry,) = httpx.get(f"{base}/v1/models", headers=headers).json()["data"]
        assert entry["id"] == "tiny-llama"
        assert entry["backends"] == [
            b.name for b in default_config().backends if b.name != "llamacpp"
        ]
        # Random weights: the text is noise, the plumbing is what is checked (on each backend).
        for backend in entry["backends"]:
            answer = httpx.post(
                f"{base}/v1/chat/completions",
                headers={**headers, "x-infermux-backend": backend},
                json={
                    "model": "tiny-llama",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4,
                },
                timeout=60,
            )
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]["role"] == "assistant"
