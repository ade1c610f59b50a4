"""deploy/helm/infermux: rendered with the default values and with every option on, by
tests/deploy/helm_template.py and, where installed, by Helm itself (which must render the
same manifests); every manifest validates against the Kubernetes schemas, and what the pods
run is what the gateway accepts."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import msgspec
import pytest
import yaml
from helm_template import TemplateFailure, render_chart

from gateway.config.load import config_from_dict
from gateway.http.auth import check_exposure, generate_key, hash_key

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CHART = DEPLOY / "helm" / "infermux"
#: The Kubernetes release whose schemas the chart is checked against.
KUBERNETES = "1.30.0"
#: The published demo key of deploy/compose, which the chart's default values carry.
DEMO_KEY = "sk-infermux-compose-demo"

Rendered = dict[str, list[dict[str, Any]]]


def _own_key_config() -> str:
    """The chart's default ``config`` with a fresh key in place of the demo one."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    config: str = values["config"]
    assert hash_key(DEMO_KEY) in config
    return config.replace(hash_key(DEMO_KEY), hash_key(generate_key()))


#: A local model read from the models volume (its default mount path).
MODEL_BACKEND = """
[[backends]]
name = "local"
kind = "llamacpp"
[backends.options]
model_path = "/models/my-model.Q4_K_M.gguf"
"""

#: Every option of the chart on.
EVERYTHING: dict[str, Any] = {
    "autoscaling.enabled": True,
    "serviceMonitor.enabled": True,
    "serviceMonitor.labels": {"release": "kube-prometheus-stack"},
    "grafana.dashboard.enabled": True,
    "models.existingClaim": "infermux-models",
    "resources": {
        "requests": {"cpu": "4", "memory": "8Gi"},
        "limits": {"memory": "8Gi", "nvidia.com/gpu": 1},
    },
    "nodeSelector": {"nvidia.com/gpu.present": "true"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "podAffinityTerm": {
                        "topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "infermux"}},
                    },
                }
            ]
        }
    },
}

#: The ServiceMonitor is a custom resource (the Prometheus Operator's CRD), which
#: kubernetes-validate has no schema for: its shape is checked against the fields the chart
#: uses, as the CRD (monitoring.coreos.com/v1) defines them, unknown fields refused.
SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "additionalProperties": False,
            "properties": {
                "name": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "additionalProperties": {"type": "string"},
                        }
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            # The CRD's Duration pattern.
                            "interval": {
                                "type": "string",
                                "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?"
                                "(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
                            },
                        },
                    },
                },
            },
        },
    },
}


def _everything() -> dict[str, Any]:
    return {**EVERYTHING, "config": _own_key_config() + MODEL_BACKEND}


def _documents(rendered: Rendered) -> list[dict[str, Any]]:
    return [doc for docs in rendered.values() for doc in docs]


def _pod(rendered: Rendered) -> dict[str, Any]:
    pod: dict[str, Any] = rendered["deployment.yaml"][0]["spec"]["template"]["spec"]
    return pod


def _validate(document: dict[str, Any]) -> None:
    if document["kind"] == "ServiceMonitor":
        jsonschema.validate(document, SERVICE_MONITOR_SCHEMA)
    else:
        kubernetes_validate.validate(document, KUBERNETES, strict=True)


def test_helm_chart_refuses_the_published_demo_key_unless_the_release_is_a_demo() -> None:
    with pytest.raises(TemplateFailure, match="DEMO key"):
        render_chart(CHART)  # the default values, as `helm install` without --set
    # Upper-case hex is the same digest to the gateway.
    upper = (
        _own_key_config()
        + f'[[auth.keys]]\nid = "d"\nkey_sha256 = "{hash_key(DEMO_KEY).upper()}"\n'
    )
    with pytest.raises(TemplateFailure, match="demo=true"):
        render_chart(CHART, overrides={"config": upper})
    own = render_chart(CHART, overrides={"config": _own_key_config()})
    assert hash_key(DEMO_KEY) not in own["configmap.yaml"][0]["data"]["infermux.toml"]
    demo = render_chart(CHART, overrides={"demo": True})
    assert hash_key(DEMO_KEY) in demo["configmap.yaml"][0]["data"]["infermux.toml"]


def test_helm_chart_defaults_render_manifests_kubernetes_accepts() -> None:
    rendered = render_chart(CHART, overrides={"config": _own_key_config()})
    documents = _documents(rendered)
    assert sorted(doc["kind"] for doc in documents) == [
        "ConfigMap", "Deployment", "PodDisruptionBudget", "Secret", "Service",
    ]  # fmt: skip
    for document in documents:
        _validate(document)
    assert "replicas" in rendered["deployment.yaml"][0]["spec"]
    # No models volume: the image's default model; no scheduling constraints.
    pod = _pod(rendered)
    assert {volume["name"] for volume in pod["volumes"]} == {"config", "data", "tmp"}
    assert not {"nodeSelector", "tolerations", "affinity"} & set(pod)


def test_helm_chart_with_every_option_renders_manifests_kubernetes_accepts() -> None:
    rendered = render_chart(CHART, overrides=_everything())
    documents = _documents(rendered)
    assert sorted(doc["kind"] for doc in documents) == [
        "ConfigMap", "ConfigMap", "Deployment", "HorizontalPodAutoscaler",
        "PodDisruptionBudget", "Secret", "Service", "ServiceMonitor",
    ]  # fmt: skip
    for document in documents:
        _validate(document)
    assert "replicas" not in rendered["deployment.yaml"][0]["spec"]  # the HPA sets it
    pod = _pod(rendered)
    assert pod["containers"][0]["resources"] == EVERYTHING["resources"]
    assert pod["nodeSelector"] == EVERYTHING["nodeSelector"]
    assert pod["tolerations"] == EVERYTHING["tolerations"]
    assert pod["affinity"] == EVERYTHING["affinity"]


def test_the_service_monitor_rejects_a_field_the_crd_does_not_have() -> None:
    """The small schema refuses what the Prometheus Operator would (it is not a no-op)."""
    monitor = render_chart(CHART, overrides=_everything())["servicemonitor.yaml"][0]
    monitor["spec"]["endpoints"][0]["scrapeEvery"] = "30s"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(monitor, SERVICE_MONITOR_SCHEMA)


def test_helm_config_or_secret_change_rolls_the_pods() -> None:
    """The pod template carries the digests of the ConfigMap and the Secret, so a `helm
    upgrade` that changes either replaces the pods (which read both only at start)."""

    def annotations(**overrides: Any) -> dict[str, str]:
        rendered = render_chart(CHART, overrides={"demo": True, **overrides})
        result: dict[str, str] = rendered["deployment.yaml"][0]["spec"]["template"]["metadata"][
            "annotations"
        ]
        return result

    base = annotations()
    assert annotations(replicaCount=5) == base  # nothing the pods read: no roll
    drain = annotations(drainTimeoutSeconds=60)
    assert drain["checksum/config"] != base["checksum/config"]
    assert drain["checksum/secret"] == base["checksum/secret"]
    secret = annotations(**{"secret.redisUrl": "redis://other:6379/0"})
    assert secret["checksum/secret"] != base["checksum/secret"]
    assert secret["checksum/config"] == base["checksum/config"]


@pytest.mark.parametrize(
    ("source", "value", "volume_field", "read_only"),
    [
        ("existingClaim", "infermux-models", "persistentVolumeClaim", True),
        ("hostPath", "/srv/models", "hostPath", True),
        ("emptyDir", True, "emptyDir", False),
    ],
)
def test_helm_models_volume_is_mounted_where_the_config_reads_models(
    source: str, value: Any, volume_field: str, read_only: bool
) -> None:
    rendered = render_chart(
        CHART, overrides={f"models.{source}": value, "config": _own_key_config() + MODEL_BACKEND}
    )
    for document in _documents(rendered):
        _validate(document)
    pod = _pod(rendered)
    volume = next(v for v in pod["volumes"] if v["name"] == "models")
    assert volume_field in volume
    if source != "emptyDir":
        assert value in volume[volume_field].values()
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "models")
    assert mount["readOnly"] is read_only
    # The config the pods load reads its model from under the mount.
    toml = rendered["configmap.yaml"][0]["data"]["infermux.toml"]
    config = config_from_dict(msgspec.toml.decode(toml.encode()))
    model_path = Path(config.backends[0].options["model_path"])
    assert model_path.is_relative_to(mount["mountPath"])


def test_helm_models_volume_takes_one_source() -> None:
    with pytest.raises(TemplateFailure, match="at most one"):
        render_chart(
            CHART,
            overrides={"demo": True, "models.hostPath": "/srv/models", "models.emptyDir": True},
        )


def test_helm_service_monitor_scrapes_the_pods_metrics_port() -> None:
    rendered = render_chart(CHART, overrides=_everything())
    monitor = rendered["servicemonitor.yaml"][0]
    service = rendered["service.yaml"][0]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    port = next(p for p in service["spec"]["ports"] if p["name"] == endpoint["port"])
    container = _pod(rendered)["containers"][0]
    assert port["targetPort"] in {p["name"] for p in container["ports"]}
    # Off by default, as is the dashboard: both need software the cluster may not run.
    defaults = render_chart(CHART, overrides={"demo": True})
    assert not defaults["servicemonitor.yaml"] and not defaults["dashboard.yaml"]


def test_the_grafana_dashboard_is_one_file_for_compose_and_the_chart() -> None:
    grafana = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["grafana"]
    mounts = dict(reversed(volume.split(":")[:2]) for volume in grafana["volumes"])
    provider = yaml.safe_load(
        (
            DEPLOY / "compose" / "grafana" / "provisioning" / "dashboards" / "infermux.yaml"
        ).read_text()
    )["providers"][0]
    compose_dir = (DEPLOY / mounts[provider["options"]["path"]]).resolve()
    dashboard = CHART / "dashboards" / "infermux.json"
    assert sorted(compose_dir.iterdir()) == [dashboard.resolve()]
    configmap = render_chart(CHART, overrides=_everything())["dashboard.yaml"][0]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["data"] == {"infermux.json": dashboard.read_text()}


def test_helm_pods_serve_the_configmap_and_drain_within_the_grace_period(
    exported_metrics: set[str],
) -> None:
    rendered = render_chart(CHART, overrides={"autoscaling.enabled": True, "demo": True})
    toml = rendered["configmap.yaml"][0]["data"]["infermux.toml"]
    pod = _pod(rendered)
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


# -- Helm itself ------------------------------------------------------------------------------


def _values_file(overrides: dict[str, Any], path: Path) -> Path:
    """``overrides`` (dotted paths) as a values file for ``helm -f``."""
    values: dict[str, Any] = {}
    for dotted, value in overrides.items():
        *parents, last = dotted.split(".")
        table = values
        for part in parents:
            table = table.setdefault(part, {})
        table[last] = value
    path.write_text(yaml.safe_dump(values))
    return path


def _by_name(documents: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in documents}


@pytest.mark.skipif(shutil.which("helm") is None, reason="helm not installed")
@pytest.mark.parametrize("options", ["defaults", "everything"])
def test_helm_itself_lints_the_chart_and_renders_what_the_tests_check(
    options: str, tmp_path: Path
) -> None:
    """``helm lint --strict`` passes and ``helm template`` gives the very manifests (the
    config digests included) that helm_template.py gives the tests above."""
    overrides = {"config": _own_key_config()} if options == "defaults" else _everything()
    values = _values_file(overrides, tmp_path / "values.yaml")
    lint = subprocess.run(
        ["helm", "lint", "--strict", str(CHART), "-f", str(values)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert lint.returncode == 0, lint.stdout + lint.stderr
    helm = subprocess.run(
        ["helm", "template", "infermux", str(CHART), "-f", str(values)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert helm.returncode == 0, helm.stderr
    by_helm = _by_name([doc for doc in yaml.safe_load_all(helm.stdout) if doc])
    assert by_helm == _by_name(_documents(render_chart(CHART, overrides=overrides)))


@pytest.mark.skipif(shutil.which("helm") is None, reason="helm not installed")
def test_helm_itself_refuses_the_demo_key() -> None:
    helm = subprocess.run(
        ["helm", "template", "infermux", str(CHART)], capture_output=True, text=True, timeout=120
    )
    assert helm.returncode != 0 and "DEMO key" in helm.stderr
