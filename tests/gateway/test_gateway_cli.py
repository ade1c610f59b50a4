"""The ``infermux`` command line, run as a real subprocess."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import openai
import pytest

REPO = Path(__file__).resolve().parents[2]


def infermux(
    *args: str, env: dict[str, str] | None = None, **kwargs: object
) -> subprocess.Popen[str]:
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), full_env.get("PYTHONPATH", "")) if p
    )
    return subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", *args],
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,  # type: ignore[arg-type]
    )


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    process = infermux(*args, env=env)
    stdout, stderr = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.fixture(autouse=True)
def private_ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The commands run here keep their usage ledger under the test's tmp_path (never ./var)."""
    monkeypatch.setenv("INFERMUX_LEDGER_PATH", str(tmp_path / "ledger.sqlite3"))


@pytest.fixture()
def plugin_dist(tmp_path: Path) -> Path:
    """An installed distribution (dist-info on sys.path) with a good and a broken plugin."""
    (tmp_path / "good_plugin.py").write_text(
        textwrap.dedent(
            """
            from plugins.hookspecs import hookimpl

            @hookimpl
            def infermux_register_backend_kinds(register):
                register("echo2", lambda config: None)

            @hookimpl
            async def infermux_on_response(request, usage):
                pass
            """
        )
    )
    (tmp_path / "broken_plugin.py").write_text("import a_module_that_is_not_there\n")
    dist_info = tmp_path / "fakeplugins-1.2.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakeplugins\nVersion: 1.2\n")
    (dist_info / "entry_points.txt").write_text(
        "[infermux]\ngood = good_plugin\nbroken = broken_plugin\n"
    )
    return tmp_path


def test_plugins_lists_builtins_with_their_hooks() -> None:
    result = run("plugins")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["PLUGIN", "VERSION", "SOURCE", "STATUS", "HOOKS"]
    kinds_row = next(line for line in lines if line.startswith("builtin.backend_kinds"))
    assert "builtin" in kinds_row and "loaded" in kinds_row
    assert "register_backend_kinds" in kinds_row
    assert "register_routing_strategies" in next(
        line for line in lines if line.startswith("builtin.routing")
    )
    assert "backend kinds:" in result.stdout and "llamacpp" in result.stdout
    assert "routing strategies:" in result.stdout and "round_robin" in result.stdout


def test_plugins_lists_entry_point_plugins_and_reports_broken_ones(plugin_dist: Path) -> None:
    result = run("plugins", env={"PYTHONPATH": str(plugin_dist)})
    assert result.returncode == 0  # a failed plugin is reported and skipped (--strict: 1)
    good = next(line for line in result.stdout.splitlines() if line.startswith("good"))
    assert "entry point (fakeplugins 1.2)" in good
    assert "loaded" in good
    assert "on_response" in good and "register_backend_kinds" in good
    broken = next(line for line in result.stdout.splitlines() if line.startswith("broken"))
    assert "failed" in broken and "ModuleNotFoundError" in broken
    assert "echo2" in result.stdout  # the plugin's backend kind is registered

    as_json = json.loads(run("plugins", "--json", env={"PYTHONPATH": str(plugin_dist)}).stdout)
    names = {p["name"]: p for p in as_json["plugins"]}
    assert names["good"]["hooks"] == ["infermux_on_response", "infermux_register_backend_kinds"]
    assert names["broken"]["status"] == "failed"


def test_plugins_honours_the_config_disable_list(plugin_dist: Path, tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[plugins]\ndisable = ["broken"]\n')
    result = run("plugins", "--config", str(config), env={"PYTHONPATH": str(plugin_dist)})
    assert result.returncode == 0, result.stdout
    broken = next(line for line in result.stdout.splitlines() if line.startswith("broken"))
    assert "disabled" in broken


def test_serve_with_a_bad_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(
        '[[backends]]\nname = "a"\nkind = "foo"\n[[models]]\nalias = "m"\nbackends = ["a"]\n'
    )
    result = run("serve", "--config", str(config))
    assert result.returncode == 2
    assert "backends[0].kind: unknown backend kind 'foo'" in result.stderr
    assert str(config) in result.stderr


def test_help_lists_the_subcommands() -> None:
    result = run("--help")
    assert result.returncode == 0
    for command in ("serve", "plugins"):
        assert command in result.stdout


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_answers_and_exits_0_on_sigterm(tmp_path: Path) -> None:
    config = tmp_path / "mock.toml"
    config.write_text(
        '[[backends]]\nname = "mock"\nkind = "mock"\n[[models]]\nalias = "echo"\nbackends = ["mock"]\n'
    )
    port = free_port()
    process = infermux(
        "serve",
        "--config",
        str(config),
        "--port",
        str(port),
        "--no-access-log",
        env={"INFERMUX_HOST": "127.0.0.1"},
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.05)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        answer = client.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "hi there"}]
        )
        assert answer.choices[0].message.content == "hi there"
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 0, stderr
        assert "backend 1/1 'mock' (mock): starting" in stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
