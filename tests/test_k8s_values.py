"""What each chart value changes, in the style of helm-unittest: replicas, autoscalers
and their signals, probes and drain times, GPU resources, NetworkPolicy peers, Services,
modes, the model volume, the ConfigMap, and the values refused."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.k8s_manifests import (
    CHART,
    JIT_CACHES,
    K8S,
    KUSTOMIZE,
    containers,
    named,
    of_kind,
    render,
    render_notes,
)


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
                "metric": {
                    "name": "baton_queued_prompt_tokens",
                    "selector": {"matchLabels": {"role": "prefill"}},
                },
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
        'sum(baton_queued_prompt_tokens{namespace="llm",pod=~"baton-prefill-.*",role="prefill"})'
    )


def test_colocated_pods_scale_on_their_decode_workers_series_not_the_sum() -> None:
    """Both workers of a co-located pod export baton_kv_cache_usage_ratio (role prefill
    and decode): the autoscaler reads the decode worker's alone."""
    colocated = {
        "mode": "colocated",
        "transfer": {"transport": "shm"},
        "decode": {"autoscaling": {"enabled": True}},
    }
    (hpa,) = of_kind(render(colocated), "HorizontalPodAutoscaler")
    assert hpa["spec"]["metrics"][0]["pods"]["metric"] == {
        "name": "baton_kv_cache_usage_ratio",
        "selector": {"matchLabels": {"role": "decode"}},
    }
    (so,) = of_kind(render({**colocated, "autoscaling": {"provider": "keda"}}), "ScaledObject")
    assert so["spec"]["triggers"][0]["metadata"]["query"] == (
        'sum(baton_kv_cache_usage_ratio{namespace="llm",pod=~"baton-colocated-.*",role="decode"})'
    )
    single = render({"mode": "single", "decode": {"autoscaling": {"enabled": True}}})
    (hpa,) = of_kind(single, "HorizontalPodAutoscaler")
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["selector"] == {
        "matchLabels": {"role": "both"}  # what a single-process worker labels its series
    }
    gateway = render({"gateway": {"autoscaling": {"enabled": True}}})
    (hpa,) = of_kind(gateway, "HorizontalPodAutoscaler")
    assert "selector" not in hpa["spec"]["metrics"][0]["pods"]["metric"]


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


def test_the_gateway_starts_without_the_fleet_and_probes_ride_out_a_slow_answer() -> None:
    d = deployments({})
    gateway = container_of(d["baton-gateway"], "gateway")
    # Startup and liveness ask whether the server listens; readiness whether it serves.
    assert gateway["startupProbe"]["grpc"] == {"port": 50051, "service": "baton.alive"}
    assert gateway["livenessProbe"]["grpc"] == {"port": 50051, "service": "baton.alive"}
    assert gateway["readinessProbe"]["grpc"] == {"port": 50051}
    for name in ("baton-gateway", "baton-prefill", "baton-decode"):
        role = name.removeprefix("baton-")
        c = container_of(d[name], role)
        readiness = c["readinessProbe"]
        # One slow or missed answer on a loaded pod does not take it out of rotation.
        assert readiness["failureThreshold"] >= 3 and readiness["timeoutSeconds"] >= 5
        assert all(c[k]["timeoutSeconds"] >= 5 for k in ("startupProbe", "livenessProbe"))
    tls = deployments(
        {
            "http": {"enabled": False},
            "security": {"gatewayTls": {"secretName": "pub", "serverName": "llm.example.com"}},
        }
    )
    gateway = container_of(tls["baton-gateway"], "gateway")
    assert gateway["startupProbe"]["exec"]["command"][-4:-2] == ["--service", "baton.alive"]
    assert "--service" not in gateway["readinessProbe"]["exec"]["command"]
    https = container_of(deployments(SECURED)["baton-gateway"], "gateway")
    assert https["startupProbe"]["httpGet"]["path"] == "/alive"
    assert https["readinessProbe"]["httpGet"]["path"] == "/health"


def test_kube_version_rollout_deadline_and_pre_stop_agree() -> None:
    """Chart.yaml admits exactly the versions the objects are validated against (the
    oldest, tests/k8s_schemas.py), where the preStop sleep action is on by default
    (1.30); a zero sleep (1.33) is never rendered; a rollout is not declared stalled
    before its pods' startup probes could have passed."""
    import yaml

    from tests.k8s_schemas import OLDEST_KUBE_VERSION

    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == f">={OLDEST_KUBE_VERSION}-0"
    assert tuple(int(x) for x in OLDEST_KUBE_VERSION.split(".")[:2]) >= (1, 30)
    d = deployments({"decode": {"preStopSleepS": 0}, "prefill": {"preStopSleepS": 3}})
    assert "lifecycle" not in container_of(d["baton-decode"], "decode")
    assert container_of(d["baton-prefill"], "prefill")["lifecycle"]["preStop"] == {
        "sleep": {"seconds": 3}
    }
    slow = deployments(
        {"decode": {"probes": {"startup": {"periodSeconds": 10, "failureThreshold": 180}}}}
    )
    for deploy in (*d.values(), *slow.values()):
        spec = deploy["spec"]
        c = spec["template"]["spec"]["containers"][0]
        bound = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
        assert spec["progressDeadlineSeconds"] > bound, deploy["metadata"]["name"]
    assert slow["baton-decode"]["spec"]["progressDeadlineSeconds"] == 1800 + 600


def test_gpu_pods_get_shared_memory_runtime_and_priority_classes_and_nccl_settings() -> None:
    objects = render(
        {
            "engine": {"device": "cuda"},
            "transfer": {
                "transport": "nccl",
                "shmSizeLimit": "8Gi",
                "nccl": {"SOCKET_IFNAME": "eth0", "IB_DISABLE": 1},
            },
            "prefill": {"gpus": 1, "runtimeClassName": "nvidia"},
            "decode": {"gpus": 1, "runtimeClassName": "nvidia", "priorityClassName": "llm"},
        }
    )
    for name in ("baton-prefill", "baton-decode"):
        pod = named(objects, "Deployment", name)["spec"]["template"]["spec"]
        (dshm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
        assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
        assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]
        assert pod["runtimeClassName"] == "nvidia"
    decode = named(objects, "Deployment", "baton-decode")["spec"]["template"]["spec"]
    assert decode["priorityClassName"] == "llm"
    gateway = named(objects, "Deployment", "baton-gateway")["spec"]["template"]["spec"]
    assert "dshm" not in str(gateway) and "runtimeClassName" not in gateway
    data = named(objects, "ConfigMap", "baton-config")["data"]
    assert {k: v for k, v in data.items() if k.startswith("NCCL_")} == {
        "NCCL_SOCKET_IFNAME": "eth0",
        "NCCL_IB_DISABLE": "1",
    }
    # CPU pods get none of it; NCCL settings only reach an nccl fleet.
    cpu = render({"transfer": {"nccl": {"DEBUG": "WARN"}}})
    assert "dshm" not in str(of_kind(cpu, "Deployment"))
    assert not [k for k in named(cpu, "ConfigMap", "baton-config")["data"] if "NCCL" in k]
    with pytest.raises(Exception, match="SOCKET-IFNAME|does not match"):
        render({"transfer": {"transport": "nccl", "nccl": {"SOCKET-IFNAME": "eth0"}}})


def test_gpus_become_nvidia_resources_only_where_asked() -> None:
    d = deployments({"decode": {"gpus": 1}})
    res = container_of(d["baton-decode"], "decode")["resources"]
    assert res["limits"]["nvidia.com/gpu"] == 1 and res["requests"]["nvidia.com/gpu"] == 1
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


COLOCATED_CUDA_IPC = {
    "mode": "colocated",
    "transfer": {"transport": "cuda_ipc"},
    "engine": {"device": "cuda"},
    "decode": {"gpus": 1, "resources": {"requests": {"cpu": "8", "memory": "64Gi"}}},
}


def test_colocated_cuda_ipc_runs_both_workers_in_one_container_on_one_gpu() -> None:
    """The device plugin gives each container that requests nvidia.com/gpu its own
    devices, so the pair runs as two processes of one container that requests the GPU."""
    objects = render(COLOCATED_CUDA_IPC)
    pod = named(objects, "Deployment", "baton-colocated")["spec"]["template"]["spec"]
    (pair,) = pod["containers"]
    assert pair["args"][0] == "pair"
    flags = pair["args"][1:]
    cut = flags.index("--")
    assert flags[flags.index("--port") + 1] == "50052"  # the prefill worker's
    assert flags[cut + 1 :][flags[cut + 1 :].index("--port") + 1] == "50053"  # decode's
    gpus = [c["resources"].get("limits", {}).get("nvidia.com/gpu", 0) for c in pod["containers"]]
    assert gpus == [1]
    assert pair["resources"]["requests"] == {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": 1}
    env = {e["name"] for e in pair["env"]}
    assert {"BATON_PREFILL_ADVERTISE_HOST", "BATON_DECODE_ADVERTISE_HOST"} <= env
    ports = {p["name"] for p in pair["ports"]}
    assert ports == {"grpc-prefill", "grpc-decode", "metrics-prefill", "metrics-decode"}
    assert pair["readinessProbe"]["grpc"] == {"port": 50053}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in pair["volumeMounts"]
    # The pod drains for the longer of the two workers.
    assert pod["terminationGracePeriodSeconds"] == 5 + 60 + 10
    # Each worker still has its named port on the Service the gateway resolves.
    service = {p["name"] for p in named(objects, "Service", "baton-colocated")["spec"]["ports"]}
    assert {"grpc-prefill", "grpc-decode"} <= service
    data = named(objects, "ConfigMap", "baton-config")["data"]
    assert data["BATON_PREFILL_TRANSPORT"] == data["BATON_DECODE_TRANSPORT"] == "cuda_ipc"
    # shm keeps its two containers (no GPU to share).
    shm = render({"mode": "colocated", "transfer": {"transport": "shm"}})
    containers_shm = named(shm, "Deployment", "baton-colocated")["spec"]["template"]["spec"]
    assert [c["name"] for c in containers_shm["containers"]] == ["prefill", "decode"]


def test_colocated_cuda_ipc_refuses_a_gpu_for_prefill() -> None:
    values = {**COLOCATED_CUDA_IPC, "prefill": {"gpus": 1}}
    with pytest.raises(Exception, match=r"set prefill.gpus to 0, got 1"):
        render(values)


def test_model_from_a_volume_is_mounted_read_only_everywhere() -> None:
    objects = render({"model": {"source": "hostPath", "hostPath": "/srv/m", "name": "llama/"}})
    data = named(objects, "ConfigMap", "baton-config")["data"]
    assert data["BATON_GATEWAY_MODEL"] == data["BATON_DECODE_MODEL"] == "/models/llama/"
    for c in containers(objects):
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in c.spec["volumeMounts"]
        volume = next(v for v in c.pod["volumes"] if v["name"] == "model")
        assert volume["hostPath"] == {"path": "/srv/m", "type": "Directory"}


@pytest.mark.parametrize(
    "values",
    [
        {"engine": {"device": "cuda"}, "transfer": {"transport": "nccl"}},
        {"mode": "single"},
        {"mode": "colocated", "transfer": {"transport": "shm"}},
    ],
)
def test_every_jit_cache_is_on_a_writable_empty_dir_under_a_read_only_root(
    values: dict[str, Any],
) -> None:
    objects = render(values)
    for c in containers(objects):
        assert c.spec["securityContext"]["readOnlyRootFilesystem"] is True
        env = c.env(objects)
        volumes = {v["name"]: v for v in c.pod["volumes"]}
        writable = {
            m["mountPath"]: volumes[m["name"]]
            for m in c.spec["volumeMounts"]
            if not m.get("readOnly")
        }
        for name, path in JIT_CACHES.items():
            assert env[name] == path, f"{c.name}: {name}"
            mount = max((m for m in writable if (path + "/").startswith(m + "/")), key=len)
            assert "emptyDir" in writable[mount], f"{c.name}: {name} on {mount}"


def test_attention_fallback_reaches_both_workers() -> None:
    data = named(render({}), "ConfigMap", "baton-config")["data"]
    assert data["BATON_PREFILL_ATTENTION_FALLBACK"] == data["BATON_DECODE_ATTENTION_FALLBACK"]
    assert data["BATON_DECODE_ATTENTION_FALLBACK"] == "none"  # the default fails the start
    data = named(
        render({"decode": {"settings": {"attentionFallback": "torch"}}}),
        "ConfigMap",
        "baton-config",
    )["data"]
    assert data["BATON_DECODE_ATTENTION_FALLBACK"] == "torch"
    assert data["BATON_PREFILL_ATTENTION_FALLBACK"] == "none"


def test_engine_settings_reach_both_workers_as_env_twins() -> None:
    data = named(
        render({"engine": {"maxNumSeqs": 7, "kvCacheBytes": 8589934592}}),
        "ConfigMap",
        "baton-config",
    )["data"]
    for prefix in ("BATON_PREFILL_", "BATON_DECODE_"):
        assert data[prefix + "MAX_NUM_SEQS"] == "7"
        assert data[prefix + "KV_CACHE_BYTES"] == "8589934592"  # no 8.589934592e+09


def test_http_port_reaches_the_container_service_and_policy() -> None:
    objects = render({"http": {"port": 8443}})
    gateway = container_of(named(objects, "Deployment", "baton-gateway"), "gateway")
    assert gateway["args"][gateway["args"].index("--http-port") + 1] == "8443"
    assert {"name": "http", "containerPort": 8443, "protocol": "TCP"} in gateway["ports"]
    service = named(objects, "Service", "baton-gateway")["spec"]["ports"]
    assert {p["name"]: (p["port"], p["appProtocol"]) for p in service}["http"] == (8443, "http")
    (public,) = [
        r
        for r in named(objects, "NetworkPolicy", "baton-gateway")["spec"]["ingress"]
        if {"port": "grpc", "protocol": "TCP"} in r["ports"]
    ]
    assert {"port": "http", "protocol": "TCP"} in public["ports"]
    assert "from" not in public  # gatewayFrom empty: from anywhere, like gRPC
    off = render({"http": {"enabled": False}})
    gateway = container_of(named(off, "Deployment", "baton-gateway"), "gateway")
    assert "--http-port" not in gateway["args"] and "http" not in str(gateway["ports"])
    assert "http" not in [
        p["name"] for p in named(off, "Service", "baton-gateway")["spec"]["ports"]
    ]


SECURED = {
    "security": {
        "gatewayTls": {"secretName": "pub-tls"},
        "fleetTls": {"secretName": "fleet-tls", "serverName": "baton-fleet.llm.svc"},
        "apiKeys": {"secretName": "keys", "key": "keys.txt"},
        "fleetSecret": {"secretName": "shared", "key": "token"},
    }
}


def test_security_secrets_are_mounted_and_their_files_set_as_env_twins() -> None:
    objects = render(SECURED)
    data = named(objects, "ConfigMap", "baton-config")["data"]
    assert {k: v for k, v in data.items() if "TLS" in k or "_FILE" in k} == {
        "BATON_GATEWAY_TLS_CERT": "/etc/baton/gateway-tls/tls.crt",
        "BATON_GATEWAY_TLS_KEY": "/etc/baton/gateway-tls/tls.key",
        "BATON_GATEWAY_API_KEYS_FILE": "/etc/baton/api-keys/keys.txt",
        "BATON_GATEWAY_WORKER_TLS_CERT": "/etc/baton/fleet-tls/tls.crt",
        "BATON_GATEWAY_WORKER_TLS_KEY": "/etc/baton/fleet-tls/tls.key",
        "BATON_GATEWAY_WORKER_TLS_CA": "/etc/baton/fleet-tls/ca.crt",
        "BATON_GATEWAY_WORKER_TLS_SERVER_NAME": "baton-fleet.llm.svc",
        "BATON_PREFILL_TLS_CERT": "/etc/baton/fleet-tls/tls.crt",
        "BATON_PREFILL_TLS_KEY": "/etc/baton/fleet-tls/tls.key",
        "BATON_PREFILL_TLS_CA": "/etc/baton/fleet-tls/ca.crt",
        "BATON_DECODE_TLS_CERT": "/etc/baton/fleet-tls/tls.crt",
        "BATON_DECODE_TLS_KEY": "/etc/baton/fleet-tls/tls.key",
        "BATON_DECODE_TLS_CA": "/etc/baton/fleet-tls/ca.crt",
        "BATON_DECODE_TLS_SERVER_NAME": "baton-fleet.llm.svc",
        "BATON_PREFILL_FLEET_SECRET_FILE": "/etc/baton/fleet-secret/token",
        "BATON_DECODE_FLEET_SECRET_FILE": "/etc/baton/fleet-secret/token",
    }
    mounted = {
        c.name: {m["name"]: m["mountPath"] for m in c.spec["volumeMounts"] if m.get("readOnly")}
        for c in containers(objects)
    }
    assert mounted["gateway"] == {
        "gateway-tls": "/etc/baton/gateway-tls",
        "api-keys": "/etc/baton/api-keys",
        "fleet-tls": "/etc/baton/fleet-tls",
    }
    for role in ("prefill", "decode"):
        assert mounted[role] == {
            "fleet-tls": "/etc/baton/fleet-tls",
            "fleet-secret": "/etc/baton/fleet-secret",
        }
    volumes = {
        v["name"]: v["secret"]
        for v in named(objects, "Deployment", "baton-decode")["spec"]["template"]["spec"]["volumes"]
        if "secret" in v
    }
    assert volumes == {
        "fleet-tls": {"secretName": "fleet-tls", "defaultMode": 0o440},
        "fleet-secret": {"secretName": "shared", "defaultMode": 0o440},
    }
    plain = named(render({}), "ConfigMap", "baton-config")["data"]
    assert not [k for k in plain if "TLS" in k or "_FILE" in k]


def test_mtls_workers_get_exec_probes_and_a_tls_gateway_https_or_exec_probes() -> None:
    d = deployments(SECURED)
    decode = container_of(d["baton-decode"], "decode")
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert decode[kind]["exec"]["command"] == [
            "python",
            "-m",
            "rpc.probe",
            "--address",
            "127.0.0.1:50053",
            "--tls-cert",
            "/etc/baton/fleet-tls/tls.crt",
            "--tls-key",
            "/etc/baton/fleet-tls/tls.key",
            "--tls-ca",
            "/etc/baton/fleet-tls/ca.crt",
            "--tls-server-name",
            "baton-fleet.llm.svc",
            "--timeout-s",
            "5",
        ]
        assert decode[kind]["timeoutSeconds"] == 10 and "grpc" not in decode[kind]
    gateway = container_of(d["baton-gateway"], "gateway")
    assert gateway["readinessProbe"]["httpGet"] == {
        "path": "/health",
        "port": "http",
        "scheme": "HTTPS",
    }
    no_http = deployments(
        {
            "http": {"enabled": False},
            "security": {"gatewayTls": {"secretName": "pub", "serverName": "llm.example.com"}},
        }
    )
    gateway = container_of(no_http["baton-gateway"], "gateway")
    command = gateway["livenessProbe"]["exec"]["command"]
    assert command[3:9] == [
        "--address",
        "127.0.0.1:50051",
        "--tls-ca",
        "/etc/baton/gateway-tls/ca.crt",
        "--tls-server-name",
        "llm.example.com",
    ]
    assert "--tls-cert" not in command  # the public port asks clients for no certificate
    # The workers of a plaintext fleet keep the native gRPC probes.
    assert container_of(no_http["baton-decode"], "decode")["readinessProbe"]["grpc"] == {
        "port": 50053
    }


def test_single_process_workers_take_the_fleet_certificate_but_no_kv_settings() -> None:
    objects = render({"mode": "single", **SECURED})
    data = named(objects, "ConfigMap", "baton-config")["data"]
    single = container_of(named(objects, "Deployment", "baton-single"), "single")
    assert "exec" in single["readinessProbe"]
    assert data["BATON_DECODE_TLS_CA"] == "/etc/baton/fleet-tls/ca.crt"
    for key in ("BATON_DECODE_FLEET_SECRET_FILE", "BATON_DECODE_PREFILL_ALLOW"):
        assert key not in data  # it moves no KV and dials no prefill worker
    assert "fleet-secret" not in str(single["volumeMounts"])


def test_decode_dials_only_this_releases_prefill_pods() -> None:
    def allow(values: dict[str, Any]) -> str | None:
        return named(render(values), "ConfigMap", "baton-config")["data"].get(
            "BATON_DECODE_PREFILL_ALLOW"
        )

    assert allow({}) == "dns:///baton-prefill:50052"
    assert allow({"prefill": {"port": 7000}}) == "dns:///baton-prefill:7000"
    colocated = {"mode": "colocated", "transfer": {"transport": "shm"}}
    assert allow(colocated) == "dns:///baton-colocated:50052"
    assert allow({"security": {"prefillAllowList": False}}) is None


def test_otlp_endpoint_reaches_all_three_services() -> None:
    data = named(
        render({"tracing": {"otlpEndpoint": "http://otel.monitoring:4317"}}),
        "ConfigMap",
        "baton-config",
    )["data"]
    plain = named(render({}), "ConfigMap", "baton-config")["data"]
    for role in ("GATEWAY", "PREFILL", "DECODE"):
        assert data[f"BATON_{role}_OTLP_ENDPOINT"] == "http://otel.monitoring:4317"
        assert f"BATON_{role}_OTLP_ENDPOINT" not in plain


@pytest.mark.parametrize(
    ("values", "error"),
    [
        ({"image": {"tag": "latest"}}, "tag"),
        ({"mode": "colocated"}, "transport must be shm or cuda_ipc"),
        ({"transfer": {"transport": "shm"}}, "transport must be gloo, nccl or nixl"),
        ({"mode": "sideways"}, "mode"),
        ({"model": {"source": "pvc"}}, "model.claimName is required"),
        ({"gateway": {"replicaz": 2}}, "replicaz"),
        ({"decode": {"autoscaling": {"metric": "vllm:num_requests_running"}}}, "metric"),
        ({"prefill": {"port": 0}}, "port"),
        ({"security": {"fleetTls": {"secretName": "Not_A_Name"}}}, "secretName"),
        ({"security": {"fleetTls": {"secretName": "s", "serverName": ""}}}, "serverName"),
        ({"tracing": {"otlpEndpoint": "otel:4317"}}, "otlpEndpoint"),
        (
            {"http": {"enabled": False}, "security": {"gatewayTls": {"secretName": "pub"}}},
            "security.gatewayTls.serverName is required",
        ),
        (
            {"decode": {"gpus": 2}},
            "decode.gpus is 2: a baton worker runs on one GPU, as the engine has no tensor "
            "parallelism yet; set 0 or 1",
        ),
        ({"prefill": {"gpus": 8}}, "prefill.gpus is 8: .* no tensor parallelism"),
    ],
)
def test_bad_values_are_refused(values: dict[str, Any], error: str) -> None:
    with pytest.raises(Exception, match=error):
        render(values)


def test_notes_say_how_to_publish_the_image_when_it_is_the_default() -> None:
    notes = render_notes({})
    assert notes.startswith("WARNING: image.repository is the chart's default")
    assert "docker build -f k8s/Dockerfile -t <registry>/baton:0.1.0-cpu ." in notes
    assert "docker push <registry>/baton:0.1.0-cpu" in notes
    assert "--set image.repository=<registry>/baton" in notes
    cuda = render_notes({"image": {"tag": "0.1.0-cuda"}})
    assert "--build-arg VARIANT=cuda -t <registry>/baton:0.1.0-cuda" in cuda
    own = render_notes({"image": {"repository": "registry.example.com/me/baton"}})
    assert "WARNING" not in own and own.startswith("baton 0.1.0 is deploying")
    # A CUDA fleet on the CPU image is said too.
    gpu = {"engine": {"device": "cuda"}, "transfer": {"transport": "nccl"}}
    wrong = render_notes({**gpu, "image": {"repository": "r.example/baton"}})
    assert wrong.startswith("WARNING: the workers compute on CUDA but image.tag 0.1.0-cpu")
    right = render_notes({**gpu, "image": {"repository": "r.example/baton", "tag": "0.1.0-cuda"}})
    assert "WARNING" not in right
    # Every role must load the same model: the NOTES say so and name it.
    assert "Every worker loads the same model (smollm2-135m)" in own


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
