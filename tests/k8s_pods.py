"""Run rendered pods as local processes: what the kubelet would do, mapped onto loopback.

A pod gets its own loopback IP (127.0.0.2, 127.0.0.3, ...) as its "pod IP"; each
container runs its rendered arguments and environment (ConfigMap envFrom, the downward
API's ``status.podIP``) with these mappings, and nothing else changed:

- ``--host 0.0.0.0`` listens on the pod IP only (this machine's other interfaces stay
  closed), and the pod's own ``127.0.0.1`` (in probes) is its pod IP;
- each ``containerPort`` is replaced by a free port of the pod IP, chosen now, wherever
  it appears as a whole value or as the port of ``HOST:PORT``;
- each ``emptyDir`` mount path is a fresh directory of the test, each ``hostPath`` one
  the node directory it names, and each ``secret`` one holding the files the test gave
  for that Secret (``LocalPods(secrets=...)``: Secret name -> key -> file).

The image's entrypoint (``ROLE`` as first argument) is ``python -m`` of the role's module
(tests.k8s_manifests.ROLE_MODULES; ``fetch-model``: engine.model_fetch). A pod's init
containers run first, to completion, on the same volumes. The gateway's ``dns:///``
names resolve through a file the test writes, the cluster DNS answer
(``BATON_GATEWAY_RESOLVE_FILE``, the gateway's ``--resolve-file``): each headless Service
name -> its ready pods.

Readiness is what the rendered readiness probe says, run the way the kubelet runs it: a
gRPC probe is a grpc.health.v1 Check, an exec probe runs its command (``python`` is this
interpreter), an httpGet probe is a GET (HTTPS without verifying the certificate, as the
kubelet does) that must answer 200.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.k8s_manifests import ROLE_MODULES, Container

# What the image's entrypoint runs for the init containers' roles.
INIT_MODULES = {"fetch-model": ("engine.model_fetch",)}

REPO = Path(__file__).resolve().parent.parent


def free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def mapped(value: str, ip: str, ports: dict[int, int], mounts: dict[str, Path]) -> str:
    """A manifest value as the pod at ``ip`` sees it here (see the module doc)."""
    if value == "0.0.0.0":
        return ip
    if value.startswith("127.0.0.1:"):
        value = f"{ip}:{value.removeprefix('127.0.0.1:')}"
    for manifest, local in ports.items():
        if value == str(manifest):
            return str(local)
        if value.endswith(f":{manifest}"):
            return f"{value[: -len(str(manifest))]}{local}"
    for path in sorted(mounts, key=len, reverse=True):
        if value == path or value.startswith(path + "/"):
            return str(mounts[path]) + value[len(path) :]
    return value


@dataclass(slots=True)
class Pod:
    """One running container of a rendered pod."""

    name: str
    ip: str
    container: Container
    ports: dict[int, int]  # manifest containerPort -> local port
    mounts: dict[str, Path]  # mount path in the manifest -> local directory
    popen: subprocess.Popen
    log: Path

    def port(self, name: str) -> int:
        return self.ports[self.container.ports[name]]

    def address(self, port_name: str) -> str:
        return f"{self.ip}:{self.port(port_name)}"

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def mapped(self, value: str) -> str:
        return mapped(value, self.ip, self.ports, self.mounts)

    def ready(self) -> bool:
        """One run of the rendered readiness probe: True when it passes."""
        return self.probe("readinessProbe")

    def probe(self, kind: str) -> bool:
        """One run of the rendered ``kind`` probe (``startupProbe``, ``readinessProbe``,
        ``livenessProbe``): True when it passes within its timeoutSeconds."""
        probe = self.container.spec[kind]
        timeout = float(probe.get("timeoutSeconds", 1))
        if "grpc" in probe:
            address = f"{self.ip}:{self.ports[probe['grpc']['port']]}"
            service = probe["grpc"].get("service", "")
            with grpc.insecure_channel(address) as channel:
                try:
                    reply = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service=service), timeout=timeout
                    )
                except grpc.RpcError:
                    return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        if "exec" in probe:
            command = [self.mapped(a) for a in probe["exec"]["command"]]
            assert command[0] == "python", f"{self.name}: exec probe runs {command[0]}"
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            out = subprocess.run(
                [sys.executable, *command[1:]],
                env=env,
                capture_output=True,
                timeout=probe.get("timeoutSeconds", 1) + 20,
            )
            return out.returncode == 0
        get = probe["httpGet"]
        scheme = get.get("scheme", "HTTP").lower()
        url = f"{scheme}://{self.ip}:{self.port(get['port'])}{get['path']}"
        unverified = ssl._create_unverified_context()  # the kubelet does not verify either
        try:
            with urllib.request.urlopen(url, timeout=timeout, context=unverified) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False


@dataclass
class LocalPods:
    """Starts pods; ``stop`` (or leaving the ``with``) SIGTERMs every one, then SIGKILLs.

    ``secrets``: Secret name -> key -> the file the Secret's key holds."""

    workdir: Path
    secrets: dict[str, dict[str, Path]] = field(default_factory=dict)
    dns_file: Path = field(init=False)
    pods: list[Pod] = field(default_factory=list)
    _next_ip: int = 2

    def __post_init__(self) -> None:
        self.dns_file = self.workdir / "cluster-dns.json"

    def __enter__(self) -> LocalPods:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, name: str, container: Container, objects: list[dict[str, Any]]) -> Pod:
        """Start ``container`` as pod ``name``, after running the pod's init containers to
        completion (in order, like the kubelet) on the same volumes."""
        ip = f"127.0.0.{self._next_ip}"
        self._next_ip += 1
        root = self.workdir / name
        root.mkdir(parents=True)
        ports = {p: free_port(ip) for p in container.ports.values()}
        for spec in container.pod.get("initContainers", []):
            init = Container(container.deployment, spec, container.pod)
            self._run_init(name, root, ip, ports, init, objects)
        mounts = self._mounts(name, root, container)
        log = root / "log.txt"
        popen = self._popen(root, ip, ports, mounts, container, objects, log)
        pod = Pod(name, ip, container, ports, mounts, popen, log)
        self.pods.append(pod)
        return pod

    def _mounts(self, name: str, root: Path, container: Container) -> dict[str, Path]:
        """Mount path -> local directory; one directory per volume of the pod, so its init
        and main containers share what they write."""
        volumes = {v["name"]: v for v in container.pod.get("volumes", [])}
        mounts: dict[str, Path] = {}
        for mount in container.spec.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            if "hostPath" in volume:  # the node's directory itself
                mounts[mount["mountPath"]] = Path(volume["hostPath"]["path"])
                continue
            local = root / mount["name"]
            mounts[mount["mountPath"]] = local
            if local.exists():
                continue
            local.mkdir()
            if "secret" in volume:
                secret = volume["secret"]["secretName"]
                assert secret in self.secrets, f"{name}: the test gave no Secret {secret}"
                for key, path in self.secrets[secret].items():
                    shutil.copyfile(path, local / key)
            else:
                assert "emptyDir" in volume, f"{name}: cannot map volume {volume}"
        return mounts

    def _popen(
        self,
        root: Path,
        ip: str,
        ports: dict[int, int],
        mounts: dict[str, Path],
        container: Container,
        objects: list[dict[str, Any]],
        log: Path,
    ) -> subprocess.Popen:
        args = [mapped(a, ip, ports, mounts) for a in container.args]
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
        rendered = container.env(objects, pod_ip=ip)
        env.update({k: mapped(v, ip, ports, mounts) for k, v in rendered.items()})
        env["PYTHONPATH"] = str(REPO)
        role, flags = args[0], args[1:]
        if role == "gateway":
            env["BATON_GATEWAY_RESOLVE_FILE"] = str(self.dns_file)
        command = [sys.executable, "-m", *{**ROLE_MODULES, **INIT_MODULES}[role]]
        with open(log, "wb") as out:
            return subprocess.Popen(
                [*command, *flags], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=root
            )

    def _run_init(
        self,
        name: str,
        root: Path,
        ip: str,
        ports: dict[int, int],
        init: Container,
        objects: list[dict[str, Any]],
    ) -> None:
        mounts = self._mounts(name, root, init)
        log = root / f"init-{init.name}.txt"
        popen = self._popen(root, ip, ports, mounts, init, objects, log)
        code = popen.wait(timeout=300)
        text = log.read_text(errors="replace")[-4000:]
        assert code == 0, f"{name}: init container {init.name} exited {code}:\n{text}"

    def publish_dns(self, answers: dict[str, list[str]]) -> None:
        """Write the cluster DNS answer: ``"NAME:PORT"`` -> ready pods' addresses."""
        tmp = self.dns_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(answers))
        tmp.replace(self.dns_file)

    def wait_ready(self, pod: Pod, timeout_s: float) -> None:
        """Until the pod's rendered readiness probe passes (fail the test after timeout)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if pod.popen.poll() is not None:
                raise AssertionError(f"{pod.name} exited {pod.popen.returncode}:\n{pod.log_tail()}")
            if pod.ready():
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{pod.name} not ready in {timeout_s}s:\n{pod.log_tail()}")
            # An exec probe is a Python process: run it less often than the kubelet's
            # period would allow here, so it does not slow the start it waits for.
            time.sleep(0.5 if "exec" in pod.container.spec["readinessProbe"] else 0.1)

    def logs(self) -> str:
        return "\n".join(f"== {p.name} ({p.ip})\n{p.log_tail()}" for p in self.pods)

    def stop(self, timeout_s: float = 20.0) -> None:
        for pod in self.pods:
            if pod.popen.poll() is None:
                pod.popen.send_signal(signal.SIGTERM)
        end = time.monotonic() + timeout_s
        for pod in self.pods:
            try:
                pod.popen.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pod.popen.kill()
                pod.popen.wait()
