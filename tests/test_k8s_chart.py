"""k8s/: the Helm chart and the kustomize overlays, rendered and checked offline.

Every mode and several value sets render with the Helm v4 SDK and every object validates
strictly against a recent Kubernetes schema (the two CRDs the chart may render,
ServiceMonitor and KEDA's ScaledObject, against schemas of the fields the chart uses);
the overlays build with ``kubectl kustomize`` (the kubectl pinned in the dev extra, not
the host's) and validate the same way; the YAML lints; golden renders of the example
values and the kustomize base do not drift; every rendered container command and
environment passes its service's real configuration parser, and the ports of probes,
Services and NetworkPolicies are the ones the containers listen on. What each value
changes is asserted in tests/test_k8s_values.py.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import k8s_manifests
from tests.k8s_manifests import (
    CHART,
    K8S,
    KUSTOMIZE,
    ROLE_MODULES,
    Container,
    check_config,
    containers,
    cpu_cores,
    example_values,
    golden_files,
    kustomize,
    named,
    of_kind,
    render_notes,
    render_text,
)
from tests.k8s_schemas import lint, validate

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
        "decode": {"gpus": 1},
        "security": {"fleetTls": {"secretName": "fleet"}, "fleetSecret": {"secretName": "s"}},
    },
    "nccl-pvc": {
        "transfer": {"transport": "nccl"},
        "engine": {"device": "cuda"},
        "model": {"source": "pvc", "claimName": "weights", "name": "llama"},
    },
    "nixl-cpu": {"transfer": {"transport": "nixl"}},
    "nixl-gpu-rdma": {
        "transfer": {
            "transport": "nixl",
            "ucx": {"TLS": "rc,cuda_copy", "NET_DEVICES": "mlx5_0:1"},
        },
        "engine": {"device": "cuda"},
        "prefill": {"gpus": 1},
        "decode": {"gpus": 1},
    },
    "hf-pvc-cache-colocated": {
        "mode": "colocated",
        "transfer": {"transport": "shm"},
        "model": {
            "source": "hf",
            "name": "HuggingFaceTB/SmolLM2-135M-Instruct",
            "revision": "12fd25f77366fa6b3b4b768ec3050bf629380bac",
            "hf": {"tokenSecret": "hf-token", "cache": "pvc", "cacheClaimName": "models"},
        },
    },
    "hf-gguf-hostpath-cache": {
        "model": {
            "source": "hf",
            "name": "bartowski/SmolLM2-135M-Instruct-GGUF",
            "ggufFile": "SmolLM2-135M-Instruct-Q8_0.gguf",
            "hf": {"endpoint": "https://hf-mirror.example.com", "cache": "hostPath"},
        },
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
    "secured": {
        "security": {
            "gatewayTls": {"secretName": "baton-gateway-tls"},
            "fleetTls": {"secretName": "baton-fleet-tls"},
            "apiKeys": {"secretName": "baton-api-keys"},
            "fleetSecret": {"secretName": "baton-fleet-secret"},
        },
        "tracing": {"otlpEndpoint": "http://otel-collector.monitoring:4317"},
    },
    "secured-no-http-colocated": {
        "mode": "colocated",
        "transfer": {"transport": "shm"},
        "http": {"enabled": False},
        "security": {
            "gatewayTls": {"secretName": "gw", "serverName": "baton.example.com"},
            "fleetTls": {"secretName": "fleet"},
            "fleetSecret": {"secretName": "shared", "key": "secret"},
        },
    },
    "secured-single": {
        "mode": "single",
        "security": {"fleetTls": {"secretName": "fleet"}, "fleetSecret": {"secretName": "s"}},
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


def test_kustomize_configmap_is_the_charts_and_a_patched_setting_rolls_the_pods(overlays) -> None:  # noqa: ANN001
    """The base generates the chart's ConfigMap (data and labels) with a content hash in
    its name; an overlay that patches a setting gets another name, and every Deployment
    loads that one, so a config-only change rolls the pods."""
    chart = k8s_manifests.kustomize_base_config()

    def config_of(objects: list[dict[str, Any]]) -> dict[str, Any]:
        (config,) = of_kind(objects, "ConfigMap")
        return config

    base = config_of(overlays["base"])
    assert base["data"] == chart["data"]
    want_labels = {**chart["metadata"]["labels"], "app.kubernetes.io/managed-by": "kustomize"}
    assert base["metadata"]["labels"] == want_labels
    assert re.fullmatch(r"baton-config-[a-z0-9]{10}", base["metadata"]["name"])
    names = {name: config_of(objects)["metadata"]["name"] for name, objects in overlays.items()}
    assert len(set(names.values())) == len(names), names  # each overlay patches settings
    for name, objects in overlays.items():
        for deploy in of_kind(objects, "Deployment"):
            refs = {
                source["configMapRef"]["name"]
                for c in deploy["spec"]["template"]["spec"]["containers"]
                for source in c["envFrom"]
            }
            assert refs == {names[name]}, f"{name}: {deploy['metadata']['name']} loads {refs}"
            annotations = deploy["spec"]["template"]["metadata"].get("annotations", {})
            assert "checksum/config" not in annotations  # the name does the rolling


def test_the_gpu_overlay_serves_a_checkpoint_from_a_claim_with_shared_memory(overlays) -> None:  # noqa: ANN001
    objects = overlays["gpu"]
    (config,) = of_kind(objects, "ConfigMap")
    for role in ("GATEWAY", "PREFILL", "DECODE"):
        assert config["data"][f"BATON_{role}_MODEL"] == "/models/Meta-Llama-3-8B-Instruct"
    for c in containers(objects):
        volumes = {v["name"]: v for v in c.pod["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"]["readOnly"] is True
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in c.spec["volumeMounts"]
        if c.role != "gateway":
            assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
            assert {"name": "dshm", "mountPath": "/dev/shm"} in c.spec["volumeMounts"]


def test_helm_lint_is_clean() -> None:
    import helm_python as helm

    report = helm.lint(str(CHART), strict=True)
    errors = [m for m in report["messages"] if m["severity"] >= 2] + report.get("errors", [])
    assert not errors, errors


def test_notes_name_every_workload() -> None:
    notes = render_notes({"mode": "colocated", "transfer": {"transport": "shm"}})
    assert "baton-colocated" in notes and "baton-gateway" in notes and "as colocated" in notes
    assert "grpcurl -plaintext" in notes and "http://127.0.0.1:8000/v1/completions" in notes
    secured = render_notes(
        {"security": {"gatewayTls": {"secretName": "pub"}, "apiKeys": {"secretName": "keys"}}}
    )
    assert "-plaintext" not in secured and "https://127.0.0.1:8000" in secured
    assert secured.count("authorization: Bearer <key>") == 2


# --- what runs: commands, environment, ports ---------------------------------------------


def all_containers(renders, overlays) -> list[tuple[str, Container, list[dict[str, Any]]]]:  # noqa: ANN001
    found = [(f"chart {n}", c, objs) for n, (_, objs) in renders.items() for c in containers(objs)]
    found += [(f"overlay {n}", c, objs) for n, objs in overlays.items() for c in containers(objs)]
    return found


def test_every_container_passes_its_services_config_parser(renders, overlays) -> None:  # noqa: ANN001
    """The flags and env twins of every rendered container parse (a renamed flag or env
    key fails here), and what they resolve to is what the manifest means."""
    for where, c, objects in all_containers(renders, overlays):
        env = c.env(objects, pod_ip="10.0.0.7")
        for role, flags in c.processes:
            assert role in ROLE_MODULES, f"{where}: {c.name} runs unknown role {role!r}"
            try:
                cfg = check_config(role, flags, env)
            except (ValueError, SystemExit) as exc:
                raise AssertionError(f"{where}: {c.deployment}/{c.name} {c.args}: {exc}") from exc
            assert cfg["host"] == "0.0.0.0", where
            _assert_files_are_mounted_secrets(where, c, cfg)
            if role == "gateway":
                for target in [*cfg["decode"], *cfg["prefill"]]:
                    assert target.startswith("dns:///"), f"{where}: {target}"
            else:
                assert cfg["advertise_host"] == "10.0.0.7", f"{where}: {c.name} advertises {cfg}"
                # numThreads 0 sizes the team by the pod's CPU request, not the node's cores.
                request = c.spec.get("resources", {}).get("requests", {}).get("cpu")
                if request is not None:
                    assert cfg["cpu_limit"] == math.ceil(cpu_cores(request)), f"{where}: {cfg}"
                assert cfg["transport"] in ("gloo", "nccl", "nixl", "shm", "cuda_ipc")
                if cfg["transport"] in ("gloo", "nccl") and role == "decode":
                    assert cfg["transport_address"] == f"10.0.0.7:{c.ports['kv-store']}", where


# Config fields that name a file the chart mounts from a Secret.
_SECRET_FILE_FIELDS = (
    "tls_cert",
    "tls_key",
    "tls_ca",
    "worker_tls_cert",
    "worker_tls_key",
    "worker_tls_ca",
    "api_keys_file",
    "fleet_secret_file",
)


def _assert_files_are_mounted_secrets(where: str, c: Container, cfg: dict[str, Any]) -> None:
    """Every file a service is pointed at lies in a Secret volume mounted in its container
    (as a key the Secret is expected to hold), so it exists when the pod starts."""
    volumes = {v["name"]: v for v in c.pod["volumes"]}
    secret_dirs = {
        m["mountPath"]: volumes[m["name"]]
        for m in c.spec["volumeMounts"]
        if "secret" in volumes[m["name"]]
    }
    for field in _SECRET_FILE_FIELDS:
        value = cfg.get(field)
        if value is None:
            continue
        directory, _, key = str(value).rpartition("/")
        assert directory in secret_dirs, f"{where}: {c.name} {field}={value} is not mounted"
        assert key and "/" not in key, f"{where}: {c.name} {field}={value}"
    for mount in secret_dirs:
        # Mounted read-only, and only what the container reads.
        spec = next(m for m in c.spec["volumeMounts"] if m["mountPath"] == mount)
        assert spec["readOnly"] is True, f"{where}: {c.name} mounts {mount} writable"
        used = [f for f in _SECRET_FILE_FIELDS if str(cfg.get(f) or "").startswith(mount + "/")]
        assert used, f"{where}: {c.name} mounts {mount} but reads nothing from it"


def _probe_port(c: Container, probe: dict[str, Any]) -> int:
    """The container port a rendered probe checks: gRPC, an exec'd rpc.probe's
    --address, or an httpGet's named port."""
    if "grpc" in probe:
        return probe["grpc"]["port"]
    if "exec" in probe:
        command = probe["exec"]["command"]
        assert command[:3] == ["python", "-m", "rpc.probe"], command
        host, _, port = command[command.index("--address") + 1].rpartition(":")
        assert host == "127.0.0.1", command  # the pod's own loopback
        return int(port)
    port = probe["httpGet"]["port"]
    return c.ports[port] if isinstance(port, str) else port


def test_ports_of_probes_services_and_policies_are_the_listening_ports(renders, overlays) -> None:  # noqa: ANN001
    everything = [(f"chart {n}", o) for n, (_, o) in renders.items()]
    everything += [(f"overlay {n}", o) for n, o in overlays.items()]
    for where, objects in everything:
        listening: dict[str, dict[str, int]] = {}  # deployment -> port name -> number
        for c in containers(objects):
            probed = []  # the gRPC ports of its processes (a pair's probes check decode's)
            for role, flags in c.processes:
                cfg = check_config(role, flags, c.env(objects))
                assert c.ports[_grpc_name(role)] == cfg["port"], f"{where}: {c.name} gRPC"
                if cfg["metrics_port"]:
                    assert c.ports[_metrics_name(role)] == cfg["metrics_port"], where
                else:
                    assert _metrics_name(role) not in c.ports, where
                if cfg.get("http_port") is not None:
                    assert c.ports["http"] == cfg["http_port"], f"{where}: {c.name} HTTP"
                else:
                    assert "http" not in c.ports, where
                probed.append(
                    c.ports["http"] if "httpGet" in c.spec["readinessProbe"] else cfg["port"]
                )
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert _probe_port(c, c.spec[kind]) == probed[-1], f"{where}: {c.name} {kind}"
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


def test_nixl_between_pods_gets_ucx_settings_and_the_data_ports(renders) -> None:  # noqa: ANN001
    """transport nixl: no KV store (NIXL's agents meet inside the hand-off), UCX's own
    settings as UCX_* env (TCP on CPU pods, which share no memory; the values' choice on
    GPU ones), and UCX's ephemeral TCP ports pinned and admitted between workers only."""
    for name, tls, devices in (
        ("nixl-cpu", "tcp", None),
        ("nixl-gpu-rdma", "rc,cuda_copy", "mlx5_0:1"),
    ):
        _, objects = renders[name]
        data = named(objects, "ConfigMap", "baton-config")["data"]
        assert data["BATON_DECODE_TRANSPORT"] == "nixl", name
        assert data.get("UCX_TLS") == tls and data.get("UCX_NET_DEVICES") == devices, data
        assert "BATON_DECODE_TRANSPORT_ADDRESS" not in data, name
        for role, peer in (("prefill", "decode"), ("decode", "prefill")):
            deploy = named(objects, "Deployment", f"baton-{role}")
            pod = deploy["spec"]["template"]["spec"]
            ports = {p["name"] for c in pod["containers"] for p in c.get("ports", [])}
            assert "kv-store" not in ports, f"{name}: {role} has no store to open"
            sysctls = {s["name"]: s["value"] for s in pod["securityContext"]["sysctls"]}
            assert sysctls["net.ipv4.ip_local_port_range"] == "40000 40999", name
            policy = named(objects, "NetworkPolicy", f"baton-{role}")
            ranges = [
                (rule, port)
                for rule in policy["spec"]["ingress"]
                for port in rule["ports"]
                if port.get("endPort")
            ]
            assert len(ranges) == 1, f"{name}: {role} {policy['spec']['ingress']}"
            rule, port = ranges[0]
            assert (port["port"], port["endPort"]) == (40000, 40999), name
            froms = [f["podSelector"]["matchLabels"] for f in rule["from"]]
            assert [m["app.kubernetes.io/component"] for m in froms] == [peer], name
            assert all(
                p["port"] != "kv-store" for r in policy["spec"]["ingress"] for p in r["ports"]
            )


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


def test_kustomize_runs_the_pinned_kubectl_not_the_hosts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host, venv = tmp_path / "usr-bin", tmp_path / "venv" / "bin"
    for where in (host, venv):
        where.mkdir(parents=True)
        (where / "kubectl").write_text("#!/bin/sh\n")
        (where / "kubectl").chmod(0o755)
    monkeypatch.setenv("PATH", str(host))
    monkeypatch.setattr(sys, "executable", str(venv / "python"))
    assert k8s_manifests.kubectl.__wrapped__() == str(venv / "kubectl")


def test_dockerfile_is_hadolint_clean() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    binary = str(hadolint) if hadolint.exists() else "hadolint"
    out = subprocess.run([binary, str(K8S / "Dockerfile")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_template_is_used_by_some_value_set(renders) -> None:  # noqa: ANN001
    sources = set()
    for text, _ in renders.values():
        sources |= set(re.findall(r"# Source: baton/templates/(\S+)", text))
    templates = {p.name for p in (CHART / "templates").glob("*.yaml")}
    assert templates <= sources, templates - sources


def _flags(parser: Any) -> set[str]:
    """The camelCase names of a service parser's value flags (not --help, --check-config)."""
    names = set()
    for action in parser._actions:
        if action.option_strings and action.dest not in ("help", "check_config", "_single"):
            names.add(re.sub(r"_([a-z])", lambda m: m.group(1).upper(), action.dest))
    return names


def test_schema_allows_exactly_the_flags_the_chart_leaves_to_values() -> None:
    """The keys values.schema.json allows in engine / settings are real flags of the
    services, and every flag is either allowed there or owned by the chart (set from its
    own values, or deliberately left unset), so a new or renamed flag breaks this test
    rather than a deployment."""
    import json

    from gateway.config import _parser as gateway_parser
    from rpc.worker_config import _parser as worker_parser
    from rpc.worker_config import env_prefix

    schema = json.loads((CHART / "values.schema.json").read_text())
    props = schema["properties"]
    engine = set(props["engine"]["propertyNames"]["enum"])
    allowed = {
        role: set(props[role]["allOf"][1]["properties"]["settings"]["propertyNames"]["enum"])
        for role in ("gateway", "prefill", "decode")
    }
    # Where the process listens and how long it drains: arguments.
    by_chart = {"host", "port", "portFile", "metricsPort", "graceS", "model"}
    gateway_by_chart = by_chart | {
        "decode",
        "prefill",
        "modelCacheDir",
        "sameHostPrefill",
        "resolveFile",  # the local launcher's stand-in for DNS; the cluster has DNS
        "httpPort",  # http.*
        "httpPortFile",
        "otlpEndpoint",  # tracing.*
        # security.*: files of mounted Secrets
        "tlsCert",
        "tlsKey",
        "workerTlsCert",
        "workerTlsKey",
        "workerTlsCa",
        "workerTlsServerName",
        "apiKeysFile",
    }
    worker_by_chart = by_chart | {
        "cacheDir",
        "transport",
        "transportAddress",
        "advertiseHost",
        "tlsCert",
        "tlsKey",
        "tlsCa",
        "tlsServerName",
        "fleetSecretFile",
        "otlpEndpoint",  # tracing.*
        # A local debugging aid: the trace is written at exit, which a pod's filesystem
        # does not outlive; the chart leaves it unset.
        "timelineFile",
        "cpuLimit",  # the container's CPU request, through the downward API
        "cpus",  # the local launcher's core plan; a pod's CPUs are the kubelet's to set
        "coreSeat",  # the local launcher's core lending, between processes of one host
    }
    assert allowed["gateway"] | gateway_by_chart == _flags(gateway_parser())
    assert not allowed["gateway"] & gateway_by_chart
    for role, chart_owned in (
        ("prefill", worker_by_chart),
        ("decode", worker_by_chart | {"prefillAllow"}),  # security.prefillAllowList
    ):
        assert engine <= allowed[role]
        assert allowed[role] | chart_owned == _flags(worker_parser(role, env_prefix(role)))
        assert not allowed[role] & chart_owned
