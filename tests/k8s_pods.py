"""Run rendered pods as local processes: what the kubelet would do, mapped onto loopback.

A pod gets its own loopback IP (127.0.0.2, 127.0.0.3, ...) as its "pod IP"; each
container runs its rendered arguments and environment (ConfigMap envFrom, the downward
API's ``status.podIP``) with three mappings, and nothing else changed:

- ``--host 0.0.0.0`` listens on the pod IP only (this machine's other interfaces stay
  closed);
- each ``containerPort`` is replaced by a free port of the pod IP, chosen now, wherever
  it appears as a whole value or as the port of ``HOST:PORT``;
- each ``emptyDir`` mount path is a fresh directory of the test, each ``hostPath`` one
  the node directory it names.

The image's entrypoint (``ROLE`` as first argument) is ``python -m`` of the role's module
(tests.k8s_manifests.ROLE_MODULES); the gateway runs under tests.k8s_dns_gateway, so
its ``dns:///`` names resolve through a file the test writes: the cluster DNS answer.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.k8s_manifests import ROLE_MODULES, Container


def free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class Pod:
    """One running container of a rendered pod."""

    name: str
    ip: str
    container: Container
    ports: dict[int, int]  # manifest containerPort -> local port
    popen: subprocess.Popen
    log: Path

    def port(self, name: str) -> int:
        return self.ports[self.container.ports[name]]

    def address(self, port_name: str) -> str:
        return f"{self.ip}:{self.port(port_name)}"

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


@dataclass
class LocalPods:
    """Starts pods; ``stop`` (or leaving the ``with``) SIGTERMs every one, then SIGKILLs."""

    workdir: Path
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
        ip = f"127.0.0.{self._next_ip}"
        self._next_ip += 1
        root = self.workdir / name
        root.mkdir(parents=True)
        ports = {p: free_port(ip) for p in container.ports.values()}
        volumes = {v["name"]: v for v in container.pod.get("volumes", [])}
        mounts: dict[str, Path] = {}
        for mount in container.spec.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            if "hostPath" in volume:  # the node's directory itself
                mounts[mount["mountPath"]] = Path(volume["hostPath"]["path"])
            else:
                assert "emptyDir" in volume, f"{name}: cannot map volume {volume}"
                mounts[mount["mountPath"]] = root / mount["name"]
                mounts[mount["mountPath"]].mkdir(exist_ok=True)

        def mapped(value: str) -> str:
            if value == "0.0.0.0":
                return ip
            for manifest, local in ports.items():
                if value == str(manifest):
                    return str(local)
                if value.endswith(f":{manifest}"):
                    return f"{value[: -len(str(manifest))]}{local}"
            for path in sorted(mounts, key=len, reverse=True):
                if value == path or value.startswith(path + "/"):
                    return str(mounts[path]) + value[len(path) :]
            return value

        args = [mapped(a) for a in container.args]
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
        env.update({k: mapped(v) for k, v in container.env(objects, pod_ip=ip).items()})
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent.parent)])
        role, flags = args[0], args[1:]
        if role == "gateway":
            command = [sys.executable, "-m", "tests.k8s_dns_gateway", str(self.dns_file), "--"]
        else:
            command = [sys.executable, "-m", *ROLE_MODULES[role]]
        log = root / "log.txt"
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                [*command, *flags], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=root
            )
        pod = Pod(name, ip, container, ports, popen, log)
        self.pods.append(pod)
        return pod

    def publish_dns(self, answers: dict[str, list[str]]) -> None:
        """Write the cluster DNS answer: ``"NAME:PORT"`` -> ready pods' addresses."""
        tmp = self.dns_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(answers))
        tmp.replace(self.dns_file)

    def wait_serving(self, pod: Pod, port_name: str, timeout_s: float) -> None:
        """What the readiness probe checks: grpc.health.v1 says SERVING."""
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(pod.address(port_name)) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if pod.popen.poll() is not None:
                    raise AssertionError(
                        f"{pod.name} exited {pod.popen.returncode}:\n{pod.log_tail()}"
                    )
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"{pod.name} not SERVING in {timeout_s}s:\n{pod.log_tail()}"
                    )
                time.sleep(0.1)

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
