"""deploy/: the image's command line runs outside Docker and answers /ready; the compose file
validates, and every config, metric and port in it is one the gateway really has (the Helm
chart: test_helm_chart.py)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.config.load import load_config
from gateway.config.types import ConfigError
from gateway.http.auth import check_exposure

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
#: The Grafana dashboard, one file for the compose stack and the Helm chart.
DASHBOARD = DEPLOY / "helm" / "infermux" / "dashboards" / "infermux.json"


# -- the image ------------------------------------------------------------------------------


class Dockerfile:
    """The last stage of deploy/Dockerfile: its ENV, COPY, USER, WORKDIR, HEALTHCHECK, CMD."""

    def __init__(self, path: Path) -> None:
        text = re.sub(r"\\\n", " ", path.read_text())  # join continued lines
        lines = [line.strip() for line in text.splitlines()]
        instructions = [line.split(None, 1) for line in lines if line and not line.startswith("#")]
        last_from = max(i for i, (op, *_) in enumerate(instructions) if op == "FROM")
        #: What every stage copies from the build context (what .dockerignore must let in).
        self.context_sources = [
            part
            for op, rest in instructions
            if op == "COPY" and not rest.startswith("--from")
            for part in rest.split()[:-1]
        ]
        self.env: dict[str, str] = {}
        self.copies: dict[str, str] = {}  # container path -> repository path
        self.user = self.workdir = ""
        self.cmd: list[str] = []
        self.healthcheck: list[str] = []
        for op, rest in instructions[last_from + 1 :]:
            if op == "ENV":
                self.env.update(item.split("=", 1) for item in shlex.split(rest))
            elif op == "COPY" and not rest.startswith("--from"):
                source, target = rest.split()
                self.copies[target] = source
            elif op == "USER":
                self.user = rest
            elif op == "WORKDIR":
                self.workdir = rest
            elif op == "CMD":
                self.cmd = json.loads(rest)
            elif op == "HEALTHCHECK":
                self.healthcheck = json.loads(rest.split(" CMD ", 1)[1])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def image_command(dockerfile: Dockerfile, workdir: Path) -> tuple[list[str], dict[str, str]]:
    """The image's CMD and ENV on this machine: container paths mapped to the files COPY put
    there (or into ``workdir`` for the image's WORKDIR), the port a free one."""
    env = {}
    for name, value in dockerfile.env.items():
        if name == "PATH":
            continue
        if value in dockerfile.copies:
            value = str(REPO / dockerfile.copies[value])
        elif value.startswith(dockerfile.workdir + "/"):
            value = str(workdir / value[len(dockerfile.workdir) + 1 :])
        env[name] = value
    env["INFERMUX_PORT"] = str(free_port())  # 8000 may be taken on this machine
    program, *args = dockerfile.cmd
    installed = Path(sys.executable).parent / program
    command = [str(installed)] if installed.exists() else [sys.executable, "-m", "gateway.cli"]
    return command + args, env


def wait_ready(process: subprocess.Popen[Any], port: str | int, output: Callable[[], str]) -> None:
    """Until ``/ready`` answers 200 (fails with ``output()`` if the process exits first)."""
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert process.poll() is None, output()[-3000:]
        assert time.monotonic() < deadline, "not ready within 300 s"
        time.sleep(0.2)


def test_the_image_runs_as_a_user_and_checks_ready() -> None:
    dockerfile = Dockerfile(DEPLOY / "Dockerfile")
    assert dockerfile.user and dockerfile.user != "root"
    assert dockerfile.cmd == ["infermux", "serve"]
    assert "/ready" in " ".join(dockerfile.healthcheck)
    # Every file the image copies is one .dockerignore lets into the build context.
    ignore = {line.rstrip("/") for line in (REPO / ".dockerignore").read_text().split()}
    assert "*" in ignore  # everything else stays out of the build context
    assert dockerfile.context_sources
    for source in dockerfile.context_sources:
        assert f"!{source.rstrip('/')}" in ignore, source
        assert (REPO / source).exists(), source


@pytest.mark.slow
def test_the_image_command_serves_the_default_model_and_answers_ready(tmp_path: Path) -> None:
    """The image's command line, run here: the embedded default model on loopback."""
    dockerfile = Dockerfile(DEPLOY / "Dockerfile")
    command, env = image_command(dockerfile, tmp_path)
    port = env["INFERMUX_PORT"]
    process = subprocess.Popen(
        command,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_ready(process, port, lambda: process.communicate()[0])
        answer = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}],
                  "max_tokens": 4},
            timeout=120,
        )  # fmt: skip
        assert answer.status_code == 200, answer.text
        # The image's HEALTHCHECK command, pointed at this port.
        check = [part.replace(":8000/", f":{port}/") for part in dockerfile.healthcheck]
        check[0] = sys.executable if check[0] == "python" else check[0]
        assert subprocess.run(check, timeout=30).returncode == 0
        assert (tmp_path / "ledger.sqlite3").exists()  # INFERMUX_LEDGER_PATH, in WORKDIR
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
    assert process.returncode == 0


def package_install(path: Path) -> tuple[dict[str, str], list[str]]:
    """The build stage's install of the package with its kernels: the environment it sets
    and pip's arguments (the line that sets INFERMUX_BUILD_KERNELS)."""
    text = re.sub(r"\\\n", " ", path.read_text())
    (line,) = (line for line in text.splitlines() if line.startswith("RUN ") and "INFERMUX_BUILD_KERNELS" in line)
    (command,) = (part for part in line[4:].split("&&") if "INFERMUX_BUILD_KERNELS" in part)
    words = shlex.split(command)
    assignments = [word for word in words if "=" in word and not word.startswith("-") and word[0].isupper()]
    assert words[len(assignments) : len(assignments) + 2] == ["pip", "install"], command
    return dict(word.split("=", 1) for word in assignments), words[len(assignments) + 2 :]


@pytest.mark.slow
def test_the_image_install_compiles_the_kernels_for_a_runtime_without_a_compiler(tmp_path: Path) -> None:
    """The build stage's install line, run here into a fresh venv: the C++ kernels are built
    at install, and a runtime with no compiler (the image's runtime stage has none) serves
    the default model on core_engine with weight_format = "auto" from them: no compile, no
    fallback to the slower torch paths."""
    env, pip_args = package_install(DEPLOY / "Dockerfile")
    assert env.get("INFERMUX_BUILD_KERNELS") == "1" and "--no-build-isolation" in pip_args
    # What the build stage COPYs, in a folder of its own (pip builds in place).
    source = tmp_path / "src"
    for name in Dockerfile(DEPLOY / "Dockerfile").context_sources:
        if name.startswith("deploy/"):
            continue
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "prebuilt"))
        else:
            source.mkdir(exist_ok=True)
            shutil.copyfile(REPO / name, source / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    # The dependencies (the stage's line before: torch, pip, setuptools...) from this checkout's
    # venv, after the new venv's own packages: a test cannot download them.
    (purelib / "zz-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    args = [str(source) if arg == "." else arg for arg in pip_args]
    build = subprocess.run(
        [str(python), "-m", "pip", "install", "--no-index", *args],
        cwd=source, env={**os.environ, **env, "INFERMUX_CACHE_DIR": str(tmp_path / "build-user-cache")},
        capture_output=True, text=True, timeout=600,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    built = sorted(p.name.split("-")[0] for p in (purelib / "core_engine/kernels/cpu/prebuilt").glob("*.so"))
    assert built == ["infermux_paged_decode", "infermux_quant_linear"], built
    assert not (tmp_path / "build-user-cache" / "kernels").exists()

    # The runtime: this venv's programs only on PATH, an empty kernel cache.
    assert shutil.which("g++", path=str(venv / "bin")) is None and shutil.which("c++", path=str(venv / "bin")) is None
    config = tmp_path / "core_engine.toml"
    config.write_text(
        '[[backends]]\nname = "native"\nkind = "core_engine"\n[backends.options]\nweight_format = "auto"\n'
        'num_threads = 2\nkv_cache_memory_mb = 64\n\n[[models]]\nalias = "smollm2"\nbackends = ["native"]\n'
    )
    port = free_port()
    runtime_env = {
        "PATH": str(venv / "bin"), "HOME": str(tmp_path), "CXX": "", "INFERMUX_CACHE_DIR": str(tmp_path / "cache"),
        "INFERMUX_LEDGER_PATH": str(tmp_path / "ledger.sqlite3"),
    }
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(venv / "bin" / "infermux"), "serve", "--config", str(config), "--port", str(port)],
            cwd=tmp_path, env=runtime_env, stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        wait_ready(process, port, log.read_text)
        answer = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"]
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    served = log.read_text()
    # Both kernels came from the install, the 4-bit products run on them, nothing compiled.
    for kernel in ("quant_linear", "paged_decode"):
        assert f"the {kernel} CPU kernel built at install: {purelib}" in served, served[-3000:]
    assert "matmul weights: int4" in served
    assert "compiling" not in served and "did not build" not in served
    assert not (tmp_path / "cache" / "kernels").exists()


def test_the_image_config_refuses_all_interfaces_without_keys() -> None:
    """Why the image listens on loopback: the same config on 0.0.0.0 is refused."""
    config = load_config(DEPLOY / "infermux.toml", env={"INFERMUX_HOST": "0.0.0.0"})
    with pytest.raises(ConfigError) as caught:
        check_exposure(config)
    assert caught.value.key == "server.host"
    check_exposure(load_config(DEPLOY / "infermux.toml", env={"INFERMUX_HOST": "127.0.0.1"}))


# -- metric names ---------------------------------------------------------------------------


def _metric_names(expression: str) -> set[str]:
    names = set(re.findall(r"\binfermux_[a-z_]+", expression))
    return {re.sub(r"_(bucket|sum|count)$", "", name) for name in names}


# -- compose --------------------------------------------------------------------------------


def _compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_compose_file_validates() -> None:
    """Validated against the Compose schema by docker-compose itself (no daemon needed)."""
    done = subprocess.run(
        ["docker-compose", "-f", str(DEPLOY / "compose.yaml"), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "POSTGRES_PASSWORD": "x"},
    )
    assert done.returncode == 0, done.stderr


def test_compose_stack_has_every_part_and_publishes_loopback_only() -> None:
    services = _compose()["services"]
    assert set(services) == {
        "gateway-1", "gateway-2", "proxy", "redis", "postgres", "otel-collector", "jaeger",
        "prometheus", "grafana",
    }  # fmt: skip
    for name, service in services.items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), (name, source)
    nginx = (DEPLOY / "compose" / "nginx.conf").read_text()
    assert "server gateway-1:8000" in nginx and "server gateway-2:8000" in nginx
    scrape = yaml.safe_load((DEPLOY / "compose" / "prometheus.yml").read_text())
    targets = scrape["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == ["gateway-1:8000", "gateway-2:8000"]


def test_compose_gateway_config_loads_and_may_listen_on_all_interfaces() -> None:
    gateway = _compose()["services"]["gateway-1"]
    env = {key: str(value) for key, value in gateway["environment"].items()}
    config = load_config(DEPLOY / "compose" / "infermux.toml", env=env)
    check_exposure(config)  # INFERMUX_HOST=0.0.0.0 with [[auth.keys]]
    assert config.state.backend == "redis" and config.state.url_env in env
    assert config.cost.database is not None and config.cost.database.startswith("postgresql://")
    stop = gateway["stop_grace_period"]
    assert int(stop.rstrip("s")) > config.server.drain_timeout_s
    # The dashboard sums the cost by tenant: the label is off unless the config turns it on.
    assert config.telemetry.metrics.tenant_labels


def test_dashboard_panels_use_metrics_the_gateway_exports(exported_metrics: set[str]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    titles = " ".join(panel["title"] for panel in dashboard["panels"]).lower()
    for topic in ("first token", "inter-token", "goodput", "cache hit", "cost"):
        assert topic in titles
    used = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            used |= _metric_names(target["expr"])
    assert used and used <= exported_metrics, used - exported_metrics
