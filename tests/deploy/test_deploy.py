"""deploy/: the image's command line runs outside Docker and answers /ready; the compose file
and the rendered Helm chart validate, and every config, metric and port in them is one the
gateway really has."""

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
import time
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import msgspec
import pytest
import yaml
from helm_template import TemplateFailure, render_chart

from gateway.config.load import config_from_dict, load_config
from gateway.config.types import ConfigError
from gateway.http.auth import check_exposure, generate_key, hash_key
from gateway.testing import gateway_config, mock_backend

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CHART = DEPLOY / "helm" / "infermux"
#: The Kubernetes release whose schemas the chart is checked against.
KUBERNETES = "1.30.0"


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
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None, process.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "not ready within 300 s"
            time.sleep(0.2)
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


def test_the_image_config_refuses_all_interfaces_without_keys() -> None:
    """Why the image listens on loopback: the same config on 0.0.0.0 is refused."""
    config = load_config(DEPLOY / "infermux.toml", env={"INFERMUX_HOST": "0.0.0.0"})
    with pytest.raises(ConfigError) as caught:
        check_exposure(config)
    assert caught.value.key == "server.host"
    check_exposure(load_config(DEPLOY / "infermux.toml", env={"INFERMUX_HOST": "127.0.0.1"}))


# -- metric names ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported_metrics(live_gateway: Any) -> set[str]:
    """The metric families a real gateway's ``GET /metrics`` declares."""
    with live_gateway(gateway_config(mock_backend("mock"))) as gw:
        text = httpx.get(f"{gw}/metrics", timeout=30).text
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}


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
    dashboard = json.loads(
        (DEPLOY / "compose" / "grafana" / "dashboards" / "infermux.json").read_text()
    )
    titles = " ".join(panel["title"] for panel in dashboard["panels"]).lower()
    for topic in ("first token", "inter-token", "goodput", "cache hit", "cost"):
        assert topic in titles
    used = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            used |= _metric_names(target["expr"])
    assert used and used <= exported_metrics, used - exported_metrics


# -- Helm -----------------------------------------------------------------------------------


#: The published demo key of deploy/compose, which the chart's default values carry.
DEMO_KEY = "sk-infermux-compose-demo"


def _own_key_config() -> str:
    """The chart's default ``config`` with a fresh key in place of the demo one."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    config: str = values["config"]
    assert hash_key(DEMO_KEY) in config
    return config.replace(hash_key(DEMO_KEY), hash_key(generate_key()))


def test_helm_chart_refuses_the_published_demo_key_unless_the_release_is_a_demo() -> None:
    with pytest.raises(TemplateFailure, match="DEMO key"):
        render_chart(CHART)  # the default values, as `helm install` without --set
    # Upper-case hex is the same digest to the gateway.
    upper = _own_key_config() + f'[[auth.keys]]\nid = "d"\nkey_sha256 = "{hash_key(DEMO_KEY).upper()}"\n'
    with pytest.raises(TemplateFailure, match="demo=true"):
        render_chart(CHART, overrides={"config": upper})
    own = render_chart(CHART, overrides={"config": _own_key_config()})
    assert hash_key(DEMO_KEY) not in own["configmap.yaml"][0]["data"]["infermux.toml"]
    demo = render_chart(CHART, overrides={"demo": True})
    assert hash_key(DEMO_KEY) in demo["configmap.yaml"][0]["data"]["infermux.toml"]


@pytest.mark.parametrize("autoscaling", [False, True])
def test_helm_chart_renders_manifests_kubernetes_accepts(autoscaling: bool) -> None:
    rendered = render_chart(
        CHART, overrides={"autoscaling.enabled": autoscaling, "config": _own_key_config()}
    )
    documents = [doc for docs in rendered.values() for doc in docs]
    kinds = sorted(doc["kind"] for doc in documents)
    expected = ["ConfigMap", "Deployment", "PodDisruptionBudget", "Secret", "Service"]
    assert kinds == sorted(expected + (["HorizontalPodAutoscaler"] if autoscaling else []))
    for document in documents:
        kubernetes_validate.validate(document, KUBERNETES, strict=True)
    deployment = rendered["deployment.yaml"][0]
    assert ("replicas" in deployment["spec"]) is not autoscaling


def test_helm_pods_serve_the_configmap_and_drain_within_the_grace_period(
    exported_metrics: set[str],
) -> None:
    rendered = render_chart(CHART, overrides={"autoscaling.enabled": True, "demo": True})
    toml = rendered["configmap.yaml"][0]["data"]["infermux.toml"]
    pod = rendered["deployment.yaml"][0]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {item["name"]: item["value"] for item in container["env"]}
    env.update(rendered["secret.yaml"][0]["stringData"])
    # The ConfigMap is a valid infermux config that may listen on 0.0.0.0.
    config = config_from_dict(msgspec.toml.decode(toml.encode()))
    check_exposure(msgspec.structs.replace(
        config, server=msgspec.structs.replace(config.server, host=env["INFERMUX_HOST"])
    ))  # fmt: skip
    assert config.state.url_env in env
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    assert env["INFERMUX_CONFIG"] == f"{mount['mountPath']}/infermux.toml"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] > config.server.drain_timeout_s + pre_stop
    assert pod["securityContext"]["runAsNonRoot"] is True
    hpa = rendered["hpa.yaml"][0]
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] in exported_metrics
