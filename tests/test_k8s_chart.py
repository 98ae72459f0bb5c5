"""k8s/: the Helm chart and the kustomize overlays, rendered and checked offline.

Every mode and several value sets render with the Helm v4 SDK and every object validates
strictly against a recent Kubernetes schema (the two CRDs the chart may render,
ServiceMonitor and KEDA's ScaledObject, against schemas of the fields the chart uses);
the overlays build with ``kubectl kustomize`` and validate the same way; the YAML lints;
golden renders of the example values and the kustomize base do not drift; every rendered
container command and environment passes its service's real configuration parser, and
the ports of probes, Services and NetworkPolicies are the ones the containers listen on.
The tests in the style of helm-unittest assert what each value changes.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from yamllint import linter
from yamllint.config import YamlLintConfig

from tests.k8s_manifests import (
    CHART,
    K8S,
    KUSTOMIZE,
    ROLE_MODULES,
    Container,
    check_config,
    containers,
    example_values,
    golden_files,
    kustomize,
    named,
    of_kind,
    render,
    render_notes,
    render_text,
)

KUBE_VERSION = kubernetes_validate.utils.latest_version()

# Value sets rendered by every test that loops over "all renders": each mode, each example,
# and the switches that change which objects exist.
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "single": {"mode": "single"},
    "colocated": {"mode": "colocated", "transfer": {"transport": "shm"}},
    "colocated-cuda-ipc": {
        "mode": "colocated",
        "transfer": {"transport": "cuda_ipc"},
        "engine": {"device": "cuda"},
        "prefill": {"gpus": 1},
        "decode": {"gpus": 1},
    },
    "nccl-pvc": {
        "transfer": {"transport": "nccl"},
        "engine": {"device": "cuda"},
        "model": {"source": "pvc", "claimName": "weights", "name": "llama"},
    },
    "all-autoscaled-keda": {
        "autoscaling": {"provider": "keda"},
        "gateway": {"autoscaling": {"enabled": True, "metric": "cpu", "target": 70}},
        "prefill": {"autoscaling": {"enabled": True}},
        "decode": {"autoscaling": {"enabled": True}},
        "metrics": {"serviceMonitor": {"enabled": True}},
    },
    "no-policies-no-metrics": {
        "networkPolicy": {"enabled": False},
        "gateway": {"metricsPort": 0, "pdb": {"enabled": False}},
        "prefill": {"metricsPort": 0, "pdb": {"enabled": False}},
        "decode": {"metricsPort": 0, "pdb": {"enabled": False}},
    },
    **{
        f"example-{p.stem}": example_values(p.stem)
        for p in sorted((K8S / "examples").glob("*.yaml"))
    },
}
OVERLAYS = {
    "base": KUSTOMIZE / "base",
    "cpu-small": KUSTOMIZE / "overlays" / "cpu-small",
    "gpu": KUSTOMIZE / "overlays" / "gpu",
}

# The fields of the two CRDs the chart renders, strictly (what the chart writes must be
# spelled as the operators read it).
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_META = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string"}, "labels": _STR_MAP},
}
_POLICY = {
    "type": "object",
    "additionalProperties": False,
    "required": ["type", "value", "periodSeconds"],
    "properties": {
        "type": {"enum": ["Pods", "Percent"]},
        "value": {"type": "integer", "minimum": 1},
        "periodSeconds": {"type": "integer", "minimum": 1, "maximum": 1800},
    },
}
CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": "ServiceMonitor"},
            "metadata": _META,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["selector", "endpoints"],
                "properties": {
                    "selector": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {"matchLabels": _STR_MAP},
                    },
                    "endpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["port"],
                            "properties": {
                                "port": {"type": "string"},
                                "path": {"type": "string"},
                                "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            },
                        },
                    },
                },
            },
        },
    },
    ("keda.sh/v1alpha1", "ScaledObject"): {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "keda.sh/v1alpha1"},
            "kind": {"const": "ScaledObject"},
            "metadata": _META,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["scaleTargetRef", "triggers"],
                "properties": {
                    "scaleTargetRef": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name"],
                        "properties": {
                            "apiVersion": {"type": "string"},
                            "kind": {"type": "string"},
                            "name": {"type": "string"},
                        },
                    },
                    "minReplicaCount": {"type": "integer", "minimum": 0},
                    "maxReplicaCount": {"type": "integer", "minimum": 1},
                    "advanced": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "horizontalPodAutoscalerConfig": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {
                                    "behavior": {
                                        "type": "object",
                                        "additionalProperties": False,
                                        "properties": {
                                            "scaleDown": {
                                                "type": "object",
                                                "additionalProperties": False,
                                                "properties": {
                                                    "stabilizationWindowSeconds": {
                                                        "type": "integer",
                                                        "minimum": 0,
                                                        "maximum": 3600,
                                                    },
                                                    "policies": {"type": "array", "items": _POLICY},
                                                },
                                            }
                                        },
                                    }
                                },
                            }
                        },
                    },
                    "triggers": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["type", "metadata"],
                            "properties": {
                                "type": {"enum": ["prometheus", "cpu"]},
                                "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                                "metadata": _STR_MAP,
                            },
                        },
                    },
                },
            },
        },
    },
}

YAMLLINT = YamlLintConfig(
    "extends: default\n"
    "rules:\n"
    "  line-length: {max: 200}\n"
    "  document-start: disable\n"
    "  comments: {min-spaces-from-content: 1}\n"
    "  comments-indentation: disable\n"
    "  indentation: {spaces: consistent, indent-sequences: whatever}\n"
    "  truthy: {check-keys: false}\n"
)


def validate(obj: dict[str, Any]) -> None:
    """Strict schema validation of one object (unknown fields are errors)."""
    crd = CRD_SCHEMAS.get((obj.get("apiVersion", ""), obj.get("kind", "")))
    if crd is not None:
        jsonschema.validate(obj, crd)
        return
    kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def lint(text: str, what: str) -> None:
    problems = [
        p for p in linter.run(text, YAMLLINT) if p.level == "error" or p.rule == "key-duplicates"
    ]
    assert not problems, f"{what}: " + "; ".join(f"line {p.line}: {p.desc}" for p in problems)


def merged(*layers: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for layer in layers:
        out = _merge(out, layer)
    return out


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(a)
    for key, value in b.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


@pytest.fixture(scope="module")
def renders() -> dict[str, tuple[str, list[dict[str, Any]]]]:
    """Every value set's render, once: name -> (YAML text, objects)."""
    out = {}
    for name, values in VALUE_SETS.items():
        text = render_text(values)
        out[name] = (text, yaml_objects(text))
    return out


@pytest.fixture(scope="module")
def overlays() -> dict[str, list[dict[str, Any]]]:
    return {name: kustomize(path) for name, path in OVERLAYS.items()}


def yaml_objects(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


# --- render, build, validate, lint -----------------------------------------------------


def test_every_value_set_renders_valid_lint_clean_objects(renders) -> None:  # noqa: ANN001
    for name, (text, objects) in renders.items():
        lint(text, name)
        kinds = {o["kind"] for o in objects}
        assert {"ConfigMap", "Deployment", "Service"} <= kinds, name
        for obj in objects:
            try:
                validate(obj)
            except Exception as exc:  # name the object in the failure
                raise AssertionError(
                    f"{name}: {obj['kind']} {obj['metadata']['name']}: {exc}"
                ) from exc


def test_overlays_build_into_valid_objects(overlays) -> None:  # noqa: ANN001
    for name, objects in overlays.items():
        assert {o["kind"] for o in objects} >= {"ConfigMap", "Deployment", "Service"}, name
        lint(yaml.safe_dump_all(objects, sort_keys=False), name)
        for obj in objects:
            try:
                validate(obj)
            except Exception as exc:
                what = f"overlay {name}: {obj['kind']} {obj['metadata']['name']}"
                raise AssertionError(f"{what}: {exc}") from exc


def test_golden_renders_and_kustomize_base_have_not_drifted() -> None:
    update = os.environ.get("BATON_UPDATE_GOLDEN") == "1"
    stale = []
    for path, want in golden_files().items():
        if update:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(want)
        elif not path.exists() or path.read_text() != want:
            stale.append(str(path.relative_to(K8S.parent)))
    assert not stale, (
        f"generated files differ from the chart: {stale}; review the change, then "
        "regenerate with BATON_UPDATE_GOLDEN=1 pytest tests/test_k8s_chart.py -k golden"
    )


def test_helm_lint_is_clean() -> None:
    import helm_python as helm

    report = helm.lint(str(CHART), strict=True)
    errors = [m for m in report["messages"] if m["severity"] >= 2] + report.get("errors", [])
    assert not errors, errors


def test_notes_name_every_workload() -> None:
    notes = render_notes({"mode": "colocated", "transfer": {"transport": "shm"}})
    assert "baton-colocated" in notes and "baton-gateway" in notes and "as colocated" in notes


# --- what runs: commands, environment, ports ---------------------------------------------


def all_containers(renders, overlays) -> list[tuple[str, Container, list[dict[str, Any]]]]:  # noqa: ANN001
    found = [(f"chart {n}", c, objs) for n, (_, objs) in renders.items() for c in containers(objs)]
    found += [(f"overlay {n}", c, objs) for n, objs in overlays.items() for c in containers(objs)]
    return found


def test_every_container_passes_its_services_config_parser(renders, overlays) -> None:  # noqa: ANN001
    """The flags and env twins of every rendered container parse (a renamed flag or env
    key fails here), and what they resolve to is what the manifest means."""
    for where, c, objects in all_containers(renders, overlays):
        assert c.role in ROLE_MODULES, f"{where}: {c.name} runs unknown role {c.role!r}"
        env = c.env(objects, pod_ip="10.0.0.7")
        try:
            cfg = check_config(c.role, c.args[1:], env)
        except (ValueError, SystemExit) as exc:
            raise AssertionError(f"{where}: {c.deployment}/{c.name} {c.args}: {exc}") from exc
        assert cfg["host"] == "0.0.0.0", where
        if c.role == "gateway":
            for target in [*cfg["decode"], *cfg["prefill"]]:
                assert target.startswith("dns:///"), f"{where}: {target}"
        else:
            assert cfg["advertise_host"] == "10.0.0.7", f"{where}: {c.name} advertises {cfg}"
            assert cfg["transport"] in ("gloo", "nccl", "shm", "cuda_ipc")
            if cfg["transport"] in ("gloo", "nccl") and c.role == "decode":
                assert cfg["transport_address"] == f"10.0.0.7:{c.ports['kv-store']}", where


def test_ports_of_probes_services_and_policies_are_the_listening_ports(renders, overlays) -> None:  # noqa: ANN001
    everything = [(f"chart {n}", o) for n, (_, o) in renders.items()]
    everything += [(f"overlay {n}", o) for n, o in overlays.items()]
    for where, objects in everything:
        listening: dict[str, dict[str, int]] = {}  # deployment -> port name -> number
        for c in containers(objects):
            cfg = check_config(c.role, c.args[1:], c.env(objects))
            assert c.ports[_grpc_name(c.role)] == cfg["port"], f"{where}: {c.name} gRPC"
            if cfg["metrics_port"]:
                assert c.ports[_metrics_name(c.role)] == cfg["metrics_port"], where
            else:
                assert _metrics_name(c.role) not in c.ports, where
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert c.spec[kind]["grpc"]["port"] == cfg["port"], f"{where}: {c.name} {kind}"
            listening.setdefault(c.deployment, {}).update(c.ports)
        for deploy in of_kind(objects, "Deployment"):
            name = deploy["metadata"]["name"]
            service = named(objects, "Service", name)
            for port in service["spec"]["ports"]:
                assert listening[name][port["targetPort"]] == port["port"], f"{where}: {name}"
        for policy in of_kind(objects, "NetworkPolicy"):
            ports = listening[policy["metadata"]["name"]]
            for rule in policy["spec"]["ingress"]:
                for port in rule["ports"]:
                    if isinstance(port["port"], str):
                        assert port["port"] in ports, f"{where}: policy names {port['port']}"


def _grpc_name(role: str) -> str:
    return {"gateway": "grpc", "prefill": "grpc-prefill"}.get(role, "grpc-decode")


def _metrics_name(role: str) -> str:
    return {"gateway": "metrics", "prefill": "metrics-prefill"}.get(role, "metrics-decode")


@pytest.mark.parametrize("role", sorted(ROLE_MODULES))
def test_image_entrypoint_runs_each_roles_check_config(role: str, tmp_path: Path) -> None:
    """k8s/entrypoint.sh maps each role onto its service: --check-config through it exits
    0 and prints that service's resolved config."""
    env = {
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(K8S.parent),
        "BATON_GATEWAY_DECODE": "dns:///baton-decode:50053",
        "BATON_DECODE_ADVERTISE_HOST": "10.0.0.7",
    }
    out = subprocess.run(
        ["sh", str(K8S / "entrypoint.sh"), role, "--check-config", "--metrics-port", "9123"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout)
    assert printed["service"] == {"gateway": "gateway", "prefill": "prefill_service"}.get(
        role, "decode_service"
    )
    assert printed["config"]["metrics_port"] == 9123
    if role == "single":
        assert printed["config"]["role"] == "both"
    bad = subprocess.run(
        ["sh", str(K8S / "entrypoint.sh"), role, "--check-config", "--no-such-flag"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )
    assert bad.returncode == 2 and "--no-such-flag" in bad.stderr


def test_entrypoint_refuses_an_unknown_role() -> None:
    out = subprocess.run(
        ["sh", str(K8S / "entrypoint.sh"), "trainer"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "gateway|prefill|decode|single" in out.stderr


def test_dockerfile_is_hadolint_clean() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    binary = str(hadolint) if hadolint.exists() else "hadolint"
    out = subprocess.run([binary, str(K8S / "Dockerfile")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# --- what each value changes (helm-unittest style) ---------------------------------------


def deployments(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in of_kind(render(values), "Deployment")}


def container_of(deploy: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in deploy["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def test_each_role_has_its_own_replicas_and_autoscaler() -> None:
    d = deployments(
        {"gateway": {"replicas": 2}, "prefill": {"replicas": 3}, "decode": {"replicas": 5}}
    )
    assert [d[f"baton-{r}"]["spec"]["replicas"] for r in ("gateway", "prefill", "decode")] == [
        2,
        3,
        5,
    ]
    objects = render(
        {"prefill": {"autoscaling": {"enabled": True, "maxReplicas": 9, "target": 1000}}}
    )
    assert (
        "replicas" not in named(objects, "Deployment", "baton-prefill")["spec"]
    )  # the HPA owns it
    assert named(objects, "Deployment", "baton-decode")["spec"]["replicas"] == 1
    (hpa,) = of_kind(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "baton-prefill"
    assert hpa["spec"]["maxReplicas"] == 9
    assert hpa["spec"]["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "baton_queued_prompt_tokens"},
                "target": {"type": "AverageValue", "averageValue": "1000"},
            },
        }
    ]


def test_default_scaling_signals_fit_each_role() -> None:
    on = {"autoscaling": {"enabled": True}}
    hpas = {
        h["metadata"]["name"]: h["spec"]["metrics"][0]["pods"]["metric"]["name"]
        for h in of_kind(
            render({"gateway": on, "prefill": on, "decode": on}), "HorizontalPodAutoscaler"
        )
    }
    assert hpas == {
        "baton-gateway": "baton_streams_in_flight",
        "baton-prefill": "baton_queued_prompt_tokens",
        "baton-decode": "baton_kv_cache_usage_ratio",
    }


def test_cpu_signal_and_keda_switch() -> None:
    objects = render({"gateway": {"autoscaling": {"enabled": True, "metric": "cpu", "target": 60}}})
    (hpa,) = of_kind(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["metrics"][0]["resource"] == {
        "name": "cpu",
        "target": {"type": "Utilization", "averageUtilization": 60},
    }
    keda = render(
        {"autoscaling": {"provider": "keda"}, "prefill": {"autoscaling": {"enabled": True}}}
    )
    assert not of_kind(keda, "HorizontalPodAutoscaler")
    (so,) = of_kind(keda, "ScaledObject")
    trigger = so["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus" and trigger["metadata"]["threshold"] == "4096"
    assert trigger["metadata"]["query"] == (
        'sum(baton_queued_prompt_tokens{namespace="llm",pod=~"baton-prefill-.*"})'
    )


def test_probes_use_grpc_health_and_outlast_the_drain() -> None:
    d = deployments({"decode": {"port": 6000, "graceS": 120, "preStopSleepS": 7}})
    pod = d["baton-decode"]["spec"]["template"]["spec"]
    c = container_of(d["baton-decode"], "decode")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": 6000}
    assert c["lifecycle"]["preStop"] == {"sleep": {"seconds": 7}}
    assert pod["terminationGracePeriodSeconds"] == 7 + 120 + 10
    liveness = c["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > 7 + 120
    assert "--grace-s" in c["args"] and c["args"][c["args"].index("--grace-s") + 1] == "120"


def test_gpus_become_nvidia_resources_only_where_asked() -> None:
    d = deployments({"decode": {"gpus": 2}})
    res = container_of(d["baton-decode"], "decode")["resources"]
    assert res["limits"]["nvidia.com/gpu"] == 2 and res["requests"]["nvidia.com/gpu"] == 2
    assert res["limits"]["memory"] == "4Gi"  # the block's own resources stay
    for role in ("gateway", "prefill"):
        assert "nvidia.com/gpu" not in str(container_of(d[f"baton-{role}"], role)["resources"])


def test_network_policy_peers() -> None:
    objects = render({})
    rules = {p["metadata"]["name"]: p["spec"]["ingress"] for p in of_kind(objects, "NetworkPolicy")}

    def peers(policy: str, port: str | int) -> list[str]:
        found = []
        for rule in rules[policy]:
            if any(p["port"] == port for p in rule["ports"]):
                for peer in rule.get("from", [{"anywhere": True}]):
                    labels = peer.get("podSelector", {}).get("matchLabels", {})
                    found.append(labels.get("app.kubernetes.io/component", str(peer)))
        return sorted(found)

    assert peers("baton-gateway", "grpc") == ["{'anywhere': True}"]
    assert peers("baton-decode", "grpc-decode") == ["gateway"]
    assert peers("baton-prefill", "grpc-prefill") == ["decode", "gateway"]
    assert peers("baton-decode", "kv-store") == ["prefill"]
    assert peers("baton-decode", 40000) == ["prefill"]
    assert peers("baton-prefill", 40000) == ["decode"]
    for policy in rules.values():
        assert all(p["port"] != 29500 for r in policy for p in r["ports"])  # named, not numbered
    data = next(p for r in rules["baton-decode"] for p in r["ports"] if p["port"] == 40000)
    assert data["endPort"] == 40999
    sysctls = named(objects, "Deployment", "baton-decode")["spec"]["template"]["spec"][
        "securityContext"
    ]["sysctls"]
    assert sysctls == [{"name": "net.ipv4.ip_local_port_range", "value": "40000 40999"}]
    single = render({"mode": "single"})
    assert not any("kv-store" in str(p) for p in of_kind(single, "NetworkPolicy"))
    assert not render({"networkPolicy": {"enabled": False}}) or not of_kind(
        render({"networkPolicy": {"enabled": False}}), "NetworkPolicy"
    )


def test_worker_services_are_headless_and_the_gateway_finds_them_by_dns() -> None:
    objects = render({})
    for role in ("prefill", "decode"):
        svc = named(objects, "Service", f"baton-{role}")
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["publishNotReadyAddresses"] is False
    assert named(objects, "Service", "baton-gateway")["spec"]["type"] == "ClusterIP"
    data = named(objects, "ConfigMap", "baton-config")["data"]
    assert data["BATON_GATEWAY_DECODE"] == "dns:///baton-decode:50053"
    assert data["BATON_GATEWAY_PREFILL"] == "dns:///baton-prefill:50052"
    assert data["BATON_DECODE_TRANSPORT_ADDRESS"] == "0.0.0.0:29500"


def test_colocated_pods_share_memory_backed_shm_and_pair_by_host() -> None:
    objects = render({"mode": "colocated", "transfer": {"transport": "shm", "shmSizeLimit": "3Gi"}})
    names = {d["metadata"]["name"] for d in of_kind(objects, "Deployment")}
    assert names == {"baton-gateway", "baton-colocated"}
    pod = named(objects, "Deployment", "baton-colocated")["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["prefill", "decode"]
    dshm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": "3Gi"}
    for c in pod["containers"]:
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    data = named(objects, "ConfigMap", "baton-config")["data"]
    assert data["BATON_GATEWAY_SAME_HOST_PREFILL"] == "true"
    assert data["BATON_DECODE_TRANSPORT"] == "shm"
    assert "BATON_DECODE_TRANSPORT_ADDRESS" not in data
    assert "sysctls" not in pod["securityContext"]


def test_model_from_a_volume_is_mounted_read_only_everywhere() -> None:
    objects = render({"model": {"source": "hostPath", "hostPath": "/srv/m", "name": "llama/"}})
    data = named(objects, "ConfigMap", "baton-config")["data"]
    assert data["BATON_GATEWAY_MODEL"] == data["BATON_DECODE_MODEL"] == "/models/llama/"
    for c in containers(objects):
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in c.spec["volumeMounts"]
        volume = next(v for v in c.pod["volumes"] if v["name"] == "model")
        assert volume["hostPath"] == {"path": "/srv/m", "type": "Directory"}


def test_engine_settings_reach_both_workers_as_env_twins() -> None:
    data = named(
        render({"engine": {"maxNumSeqs": 7, "kvCacheBytes": 8589934592}}),
        "ConfigMap",
        "baton-config",
    )["data"]
    for prefix in ("BATON_PREFILL_", "BATON_DECODE_"):
        assert data[prefix + "MAX_NUM_SEQS"] == "7"
        assert data[prefix + "KV_CACHE_BYTES"] == "8589934592"  # no 8.589934592e+09


@pytest.mark.parametrize(
    ("values", "error"),
    [
        ({"image": {"tag": "latest"}}, "tag"),
        ({"mode": "colocated"}, "transport must be shm or cuda_ipc"),
        ({"transfer": {"transport": "shm"}}, "transport must be gloo or nccl"),
        ({"mode": "sideways"}, "mode"),
        ({"model": {"source": "pvc"}}, "model.claimName is required"),
        ({"gateway": {"replicaz": 2}}, "replicaz"),
        ({"decode": {"autoscaling": {"metric": "vllm:num_requests_running"}}}, "metric"),
        ({"prefill": {"port": 0}}, "port"),
    ],
)
def test_bad_values_are_refused(values: dict[str, Any], error: str) -> None:
    with pytest.raises(Exception, match=error):
        render(values)


def test_every_value_key_is_commented_and_no_tag_is_latest() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        key = re.match(r"^(\s*)([A-Za-z][\w.-]*):", line)
        if key is None or "#" in line:
            continue
        above = lines[i - 1].strip() if i else ""
        assert above.startswith("#"), f"values.yaml line {i + 1}: {line.strip()!r} has no comment"
    for path in [
        CHART / "values.yaml",
        *(K8S / "examples").glob("*.yaml"),
        *KUSTOMIZE.rglob("*.yaml"),
    ]:
        assert not re.search(r"(tag|newTag):\s*\"?latest", path.read_text()), path


def test_every_template_is_used_by_some_value_set(renders) -> None:  # noqa: ANN001
    sources = set()
    for text, _ in renders.values():
        sources |= set(re.findall(r"# Source: baton/templates/(\S+)", text))
    templates = {p.name for p in (CHART / "templates").glob("*.yaml")}
    assert templates <= sources, templates - sources


def test_schema_allows_exactly_the_flags_the_chart_leaves_to_values() -> None:
    """The keys values.schema.json allows in engine / settings are real flags of the
    services, and every flag is either allowed there or set by the chart itself, so a
    renamed flag breaks this test rather than a deployment."""
    import json

    from gateway.config import _FIELDS as gateway_flags
    from rpc.worker_config import _FIELDS as worker_flags

    def camel(name: str) -> str:
        return re.sub(r"_([a-z])", lambda m: m.group(1).upper(), name)

    schema = json.loads((CHART / "values.schema.json").read_text())
    props = schema["properties"]
    engine = set(props["engine"]["propertyNames"]["enum"])
    allowed = {
        role: set(props[role]["allOf"][1]["properties"]["settings"]["propertyNames"]["enum"])
        for role in ("gateway", "prefill", "decode")
    }
    by_chart = {"host", "port", "portFile", "metricsPort", "graceS", "model"}
    gateway_by_chart = by_chart | {"decode", "prefill", "modelCacheDir", "sameHostPrefill"}
    worker_by_chart = by_chart | {"cacheDir", "transport", "transportAddress", "advertiseHost"}
    assert allowed["gateway"] | gateway_by_chart == {camel(n) for n in gateway_flags}
    assert not allowed["gateway"] & gateway_by_chart
    for role in ("prefill", "decode"):
        assert engine <= allowed[role]
        assert allowed[role] | worker_by_chart == {camel(n) for n in worker_flags}
        assert not allowed[role] & worker_by_chart
