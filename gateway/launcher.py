"""Starts a whole baton deployment on this machine: workers and a gateway, each its own
process on 127.0.0.1 with a port chosen by the OS.

Used by ``baton run`` / ``baton serve``, the end-to-end tests and the serving benchmark.
It talks to the processes it starts only through their command lines, port files and
the standard health service, so it imports no service code.

The gateway finds the workers the way it does in a cluster: through ``dns:///`` names
(``dns:///baton-decode:50053``, ``dns:///baton-prefill:50052``, as the chart's headless
Services are called) that it looks up again every second. The launcher answers them
from a file (the gateway's ``--resolve-file``) that lists every worker once it serves,
as a headless Service lists every ready pod. So a worker started later
(:meth:`LocalCluster.add_worker`) is routed to from the gateway's next lookup, and one
that is stopped (:meth:`LocalCluster.terminate`) leaves the answer and drains.

Workers run niced (``ClusterSpec.worker_nice``, 10): on one host their compute threads
would otherwise take the CPU time the gateway needs to answer calls, refusals included.

Workers start as forks of one process that has already imported torch
(``gateway.fork_server``, shared by every cluster of the launcher's process;
``ClusterSpec.fork_workers``): importing torch is most of a worker's start. The gateway,
which never imports torch, and commands another host runs (``placed``) start as fresh
processes.

The workers share the host's cores by a plan (``gateway.core_plan``, on by default:
``ClusterSpec.core_plan``): each gets a disjoint set of CPUs and a compute team as wide
as it (with more workers than cores and core lending on: a core it owns with others, one
thread), passed on its command line (``--cpus``, ``--num-threads``, ``--core-seat``); the
worker pins itself in its ``__main__`` (``rpc.worker_cpus``). A worker added later
(:meth:`LocalCluster.add_worker`) gets its share of a plan made again over every running
worker and itself; the running ones keep theirs until they restart.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.core_lending import close_shares, create_share, seat_path
from engine.cpu_budget import format_cpu_list, physical_cores, read_cpu_budget
from gateway.core_plan import WorkerCores, plan_cores
from gateway.fork_server import ForkedProcess, shared_fork_server

logger = logging.getLogger(__name__)

# The name:port the gateway looks each worker fleet up by (the chart's Service names).
FLEET_NAMES = {"prefill": "baton-prefill:50052", "decode": "baton-decode:50053"}
# How often the gateway reads the fleets' answer again (a local file: cheap).
RESOLVE_INTERVAL_S = 1.0
WORKER_KINDS = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    model: str = "smollm2-135m"
    # disaggregated: prefill and decode workers; single: one worker runs both.
    mode: str = "disaggregated"
    transport: str = "shm"
    num_prefill: int = 1
    num_decode: int = 1
    dtype: str = "bfloat16"
    # Every worker in deterministic mode (--deterministic): bits independent of the batch.
    deterministic: bool = False
    # Extra flags for every worker (e.g. ("--num-blocks", "512")).
    worker_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    # CPU sets per worker kind, e.g. {"prefill": {0}, "decode": {1}}: the workers of a
    # kind share its set (by the core plan, or each with a team as wide as the set when
    # the plan is off). Kinds not named here share the launcher's other CPUs.
    cpus: dict[str, frozenset[int]] = field(default_factory=dict)
    # Plan the cores between the workers (gateway.core_plan): disjoint CPU sets, and
    # never more compute threads in all than cores. Off: every worker sizes its team
    # from the whole host (what several teams on one host fight over).
    core_plan: bool = True
    # With the plan, workers lend their share while they have no work and borrow idle
    # neighbours' (engine.core_lending): a decode worker beside an idle prefill worker
    # computes on both shares; more workers than cores own the cores in turn. Off: each
    # worker keeps to its share (with more workers than cores: all of them, one thread).
    core_lending: bool = True
    gateway_port: int = 0  # 0: any free port
    http_port: int | None = None  # the gateway's OpenAI-compatible HTTP; None: off, 0: any
    start_timeout_s: float = 600.0
    log_level: str = "WARNING"
    # Serve every process's Prometheus metrics, each on a free port of 127.0.0.1
    # (LocalProcess.metrics_address).
    metrics: bool = False
    # How the launcher's readiness probes dial TLS ports (a CA bundle, and a client
    # certificate for mTLS workers); the TLS flags themselves go in worker_args and
    # gateway_args. None: plaintext.
    probe_credentials: grpc.ChannelCredentials | None = None
    # Workers run at this niceness (the gateway at the launcher's). On one host the
    # workers' compute teams would hold every core, and the gateway, which answers every
    # call (a refusal included) and uses little CPU, would wait behind them: 1,024 calls
    # at once on 2 cores saw refusals after 1.6-2.5 s at niceness 0, 0.5-0.9 s at 10.
    worker_nice: int = 10
    # Start workers as forks of a process that has already imported torch
    # (gateway.fork_server), sparing each worker that import. Off, or where that server
    # cannot start, each worker is a fresh ``python -m``.
    fork_workers: bool = True

    def __post_init__(self) -> None:
        if self.mode not in ("disaggregated", "single"):
            raise ValueError(f"mode must be 'disaggregated' or 'single', got {self.mode!r}")
        if self.num_decode < 1 or (self.mode == "disaggregated" and self.num_prefill < 1):
            raise ValueError("a deployment needs at least one decode and one prefill worker")
        if not 0 <= self.worker_nice <= 19:
            raise ValueError(f"worker_nice must be in [0, 19], got {self.worker_nice}")


@dataclass(slots=True)
class LocalProcess:
    """One process the launcher started."""

    kind: str  # gateway, prefill or decode
    popen: subprocess.Popen | ForkedProcess
    port_file: Path
    log: Path
    address: str = ""  # HOST:PORT once it reported its port
    host: str = "127.0.0.1"  # the address it serves on
    listed: bool = False  # in its fleet's answer (serving, not stopped)
    metrics_address: str = ""  # 127.0.0.1:PORT of /metrics, with ClusterSpec.metrics
    cores: WorkerCores | None = None  # its share of the core plan; None: not planned


class LocalCluster:
    """``with LocalCluster(spec) as c: ... c.gateway_address ...``; stops everything it
    started on exit, even after a failed start."""

    def __init__(self, spec: ClusterSpec, workdir: Path | None = None):
        self.spec = spec
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="baton-")
        self.workdir = workdir or Path(self._tmp.name)  # type: ignore[union-attr]
        self.procs: list[LocalProcess] = []
        self.gateway_address = ""
        self.http_address = ""  # host:port of the OpenAI-compatible HTTP API, if on
        # The fleets' answer the gateway reads (its --resolve-file): the local DNS.
        self.resolve_file = self.workdir / "fleets.json"
        self._spawned: dict[str, int] = {}  # kind -> processes started (index of the next)
        # The workers' core shares (engine.core_lending) when they lend each other cores.
        self.core_shares: Path | None = None

    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- addresses --------------------------------------------------------------------

    def addresses(self, kind: str) -> list[str]:
        return [p.address for p in self.procs if p.kind == kind]

    def process(self, kind: str, index: int = 0) -> subprocess.Popen | ForkedProcess:
        return [p.popen for p in self.procs if p.kind == kind][index]

    # -- lifecycle --------------------------------------------------------------------

    def worker_argv(self, kind: str) -> list[str]:
        """The command line (after ``python -m``) of a ``kind`` worker of this spec."""
        s = self.spec
        common = ["--model", s.model, "--dtype", s.dtype, "--log-level", s.log_level]
        if s.deterministic:
            common += ["--deterministic", "true"]
        if s.mode == "single":
            return ["decode_service", "--single-process", *common, *s.worker_args]
        module = {"prefill": "prefill_service", "decode": "decode_service"}[kind]
        return [module, "--transport", s.transport, *common, *s.worker_args]

    def start(self) -> None:
        """Start the workers and the gateway side by side; return once every worker and
        the gateway serve (the gateway has found the workers by then: it serves once a
        decode worker it resolved answers)."""
        s = self.spec
        kinds = ["decode"] * s.num_decode
        if s.mode == "disaggregated":
            kinds = ["prefill"] * s.num_prefill + kinds
        shares = self.plan(kinds)
        seats = self._lending_seats(shares)
        self.core_shares = self._shares_dir if any(seats) else None
        self.publish()  # no worker listed yet: the gateway's first lookups find none
        # The gateway first: it loads its tokenizer while the fork server (on a first
        # start) imports torch.
        gateway = self._spawn_gateway()
        workers = [
            self._spawn(k, self._next_index(k), self.worker_argv(k), cores=c, lending=seat)
            for k, c, seat in zip(kinds, shares, seats, strict=True)
        ]
        deadline = time.monotonic() + s.start_timeout_s
        for proc in [*workers, gateway]:
            self._await_port(proc, deadline)
        for proc in workers:
            wait_serving(proc.address, deadline - time.monotonic(), proc, s.probe_credentials)
            proc.listed = True
        self.publish()
        wait_serving(gateway.address, deadline - time.monotonic(), gateway, s.probe_credentials)
        self.gateway_address = gateway.address
        if s.http_port is not None:
            # Bound before the gateway reports SERVING, so the file is there by now.
            http_port_file = self.workdir / "gateway-0.http.port"
            self.http_address = f"127.0.0.1:{int(http_port_file.read_text())}"

    def _spawn_gateway(self) -> LocalProcess:
        s = self.spec
        gw_args = [
            "gateway",
            "--model",
            s.model,
            "--log-level",
            s.log_level,
            "--resolve-file",
            str(self.resolve_file),
            "--resolve-interval-s",
            str(RESOLVE_INTERVAL_S),
            "--decode",
            f"dns:///{FLEET_NAMES['decode']}",
        ]
        if s.mode == "disaggregated":
            gw_args += ["--prefill", f"dns:///{FLEET_NAMES['prefill']}"]
        gw_args += s.gateway_args
        if s.http_port is not None:
            http_port_file = self.workdir / "gateway-0.http.port"
            gw_args += ["--http-port", str(s.http_port), "--http-port-file", str(http_port_file)]
        return self._spawn("gateway", 0, gw_args, port=s.gateway_port)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM everything (gateway first, so it stops taking work), then SIGKILL."""
        for proc in sorted(self.procs, key=lambda p: p.kind != "gateway"):
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        end = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.popen.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in %.0fs; killing it", proc.kind, timeout_s)
                proc.popen.kill()
                proc.popen.wait()
        self.procs.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def publish(self) -> None:
        """Write the fleets' answer: every listed worker, by kind (atomically, so the
        gateway reads the old answer or the new one)."""
        answer = {
            FLEET_NAMES[kind]: [p.address for p in self.procs if p.kind == kind and p.listed]
            for kind in WORKER_KINDS
        }
        tmp = self.resolve_file.with_name(f".{self.resolve_file.name}.tmp")
        tmp.write_text(json.dumps(answer, indent=1))
        os.replace(tmp, self.resolve_file)

    def add_worker(
        self,
        kind: str,
        *,
        argv: list[str] | None = None,
        port: int = 0,
        timeout_s: float | None = None,
    ) -> LocalProcess:
        """Start one more ``kind`` worker (``argv``: its command line after ``python -m``,
        default :meth:`worker_argv`) and list it in its fleet once it serves, as a pod
        that became ready: the gateway routes to it from its next lookup."""
        (proc,) = self.add_workers([kind], argv=argv, port=port, timeout_s=timeout_s)
        return proc

    def add_workers(
        self,
        kinds: Sequence[str],
        *,
        argv: list[str] | None = None,
        port: int = 0,
        timeout_s: float | None = None,
    ) -> list[LocalProcess]:
        """Start one more worker of each of ``kinds`` at once, as pods scaled up together
        start side by side; each is listed as soon as it serves. ``argv`` and ``port``
        only for a single worker."""
        allowed = WORKER_KINDS if self.spec.mode == "disaggregated" else ("decode",)
        for kind in kinds:
            if kind not in allowed:
                raise ValueError(
                    f"kind must be one of {allowed} in {self.spec.mode} mode, got {kind!r}"
                )
        if len(kinds) != 1 and (argv is not None or port):
            raise ValueError("argv and port name one worker's command line and port")
        running = [p.kind for p in self.procs if p.kind in WORKER_KINDS and p.popen.poll() is None]
        cores = self.plan([*running, *kinds])[len(running) :]
        if self.core_shares is not None:
            # Their shares overlap those planned at start: lending them would put more
            # threads to work than cores.
            close_shares(self.core_shares)
            self.core_shares = None
        procs = [
            self._spawn(k, self._next_index(k), argv or self.worker_argv(k), port, cores=c)
            for k, c in zip(kinds, cores, strict=True)
        ]
        deadline = time.monotonic() + (timeout_s or self.spec.start_timeout_s)
        for proc in procs:
            self._await_port(proc, deadline)
        credentials = self.spec.probe_credentials
        for proc in procs:
            wait_serving(proc.address, deadline - time.monotonic(), proc, credentials)
            proc.listed = True
            self.publish()
        return procs

    def terminate(self, proc: LocalProcess) -> None:
        """Take ``proc`` out of its fleet's answer and send it SIGTERM, as Kubernetes does
        to a pod it deletes: it drains (refusing new work, finishing its streams) and
        exits; wait for that with ``proc.popen.wait``."""
        if proc.listed:
            proc.listed = False
            self.publish()
        if proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGTERM)

    def kill(self, kind: str, index: int = 0) -> None:
        """SIGKILL one process (failure tests)."""
        popen = self.process(kind, index)
        popen.kill()
        popen.wait()

    def logs(self) -> str:
        return "\n".join(
            f"== {p.kind} ({p.log})\n{p.log.read_text(errors='replace')[-4000:]}"
            for p in self.procs
            if p.log.exists()
        )

    # -- internals --------------------------------------------------------------------

    def plan(self, kinds: list[str]) -> list[WorkerCores | None]:
        """Each worker's share of the cores, for workers of ``kinds`` in this order
        (``gateway.core_plan``). Kinds with a set in ``spec.cpus`` share that set; the
        others share the rest of the launcher's CPUs (all of them if none is left), within
        its cgroup quota. None for a worker the plan leaves alone (plan off, no set)."""
        s = self.spec
        role = "both" if s.mode == "single" else None
        out: list[WorkerCores | None] = [None] * len(kinds)
        budget = read_cpu_budget()
        named = frozenset().union(*s.cpus.values()) if s.cpus else frozenset()
        rest = budget.cpus - named or budget.cpus
        groups: dict[frozenset[int], list[int]] = {}
        for i, kind in enumerate(kinds):
            if kind in s.cpus:
                groups.setdefault(frozenset(s.cpus[kind]), []).append(i)
            elif s.core_plan:
                groups.setdefault(rest, []).append(i)
        for cpus, members in groups.items():
            if not s.core_plan:  # a named set, unplanned: each worker sizes from it
                for i in members:
                    out[i] = WorkerCores(cpus, len(cpus))
                continue
            cores = budget.cores if cpus == rest else None
            members_kinds = [role or kinds[i] for i in members]
            planned = plan_cores(
                cpus, members_kinds, cores, physical_cores(cpus), co_own=s.core_lending
            )
            for i, share in zip(members, planned, strict=True):
                out[i] = share
        return out

    @property
    def _shares_dir(self) -> Path:
        return self.workdir / "core-shares"

    def _lending_seats(self, shares: list[WorkerCores | None]) -> list[Path | None]:
        """Each worker's seat in the core shares it owns (``engine.core_lending``), made
        for the workers to lend each other idle cores; None for all where nothing can be
        lent (one worker, one left unplanned, shares that overlap in part)."""
        none: list[Path | None] = [None] * len(shares)
        if not self.spec.core_lending or len(shares) < 2 or None in shares:
            return none
        owners: dict[frozenset[int], list[int]] = {}
        for i, c in enumerate(shares):
            assert c is not None
            owners.setdefault(c.cpus, []).append(i)
        if len(owners) < 2 or sum(map(len, owners)) != len(frozenset().union(*owners)):
            return none  # every worker on all the cores: nothing to lend
        self._shares_dir.mkdir(exist_ok=True)
        seats = list(none)
        for cpus, members in owners.items():
            threads = shares[members[0]].threads  # type: ignore[union-attr]
            create_share(self._shares_dir, cpus, threads, owners=len(members))
            for seat, i in enumerate(members):
                seats[i] = seat_path(self._shares_dir, cpus, seat)
        return seats

    def host_of(self, kind: str) -> str:
        """The address a ``kind`` process serves on: loopback here; a test that puts
        processes on hosts of its own (network namespaces) gives theirs."""
        return "127.0.0.1"

    def placed(
        self, kind: str, cmd: list[str], env: dict[str, str]
    ) -> tuple[list[str], dict[str, str]]:
        """The command line and environment that start a ``kind`` process where it runs:
        as they are here (a test with hosts of its own wraps them, e.g. in ``ip netns
        exec``)."""
        return cmd, env

    def _next_index(self, kind: str) -> int:
        """Every process gets a fresh index, so no stale port file is taken for its own."""
        index = self._spawned.get(kind, 0)
        self._spawned[kind] = index + 1
        return index

    def _spawn(
        self,
        kind: str,
        index: int,
        argv: list[str],
        port: int = 0,
        cores: WorkerCores | None = None,
        lending: Path | None = None,
    ) -> LocalProcess:
        port_file = self.workdir / f"{kind}-{index}.port"
        log = self.workdir / f"{kind}-{index}.log"
        env = dict(os.environ)
        if cores is not None:
            # Right after the module name, so that a --num-threads of the caller's (later
            # on the line) wins. The worker pins itself (rpc.worker_cpus); OpenMP also
            # reads the team size from the environment when torch loads.
            argv = [
                argv[0],
                "--cpus",
                format_cpu_list(cores.cpus),
                "--num-threads",
                str(cores.threads),
                *(["--core-seat", str(lending)] if lending is not None else []),
                *argv[1:],
            ]
            env["OMP_NUM_THREADS"] = str(cores.threads)
        host = self.host_of(kind)
        cmd = [
            sys.executable,
            "-m",
            *argv,
            "--host",
            host,
            "--port",
            str(port),
            "--port-file",
            str(port_file),
        ]
        metrics_address = ""
        if self.spec.metrics:
            metrics_address = f"127.0.0.1:{_free_port()}"
            cmd += ["--metrics-port", metrics_address.rpartition(":")[2]]

        nice = self.spec.worker_nice if kind in WORKER_KINDS else 0
        log.write_bytes(b"")
        popen: subprocess.Popen | ForkedProcess | None = self._forked(kind, cmd[2:], env, log, nice)
        if popen is None:
            if nice and (nice_binary := shutil.which("nice")):
                # Through nice(1), which execs the worker: a preexec_fn would make
                # subprocess fork and run Python in the child, which crashes (SIGSEGV) a
                # launcher whose other threads are inside gRPC, as a test's or a server's are.
                cmd = [nice_binary, "-n", str(nice), *cmd]
            cmd, env = self.placed(kind, cmd, env)
            with open(log, "ab") as out:
                popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        proc = LocalProcess(
            kind, popen, port_file, log, host=host, metrics_address=metrics_address, cores=cores
        )
        self.procs.append(proc)
        return proc

    def _forked(
        self, kind: str, argv: list[str], env: dict[str, str], log: Path, nice: int
    ) -> ForkedProcess | None:
        """A worker started by this process's fork server, or None where it cannot be:
        not a worker, forks off (``ClusterSpec.fork_workers``), a subclass that places
        processes elsewhere, or an environment that the server's process would not honour."""
        placed_here = type(self).placed is LocalCluster.placed
        if kind not in WORKER_KINDS or not self.spec.fork_workers or not placed_here:
            return None
        server = shared_fork_server()
        if server is None or not server.honours(env):
            return None
        return server.spawn(argv, env, log, nice)

    def _await_port(self, proc: LocalProcess, deadline: float) -> None:
        while time.monotonic() < deadline:
            if proc.port_file.exists() and proc.port_file.read_text().strip():
                proc.address = f"{proc.host}:{int(proc.port_file.read_text())}"
                return
            if proc.popen.poll() is not None:
                raise RuntimeError(
                    f"{proc.kind} exited with {proc.popen.returncode} while "
                    f"starting:\n{proc.log.read_text(errors='replace')[-3000:]}"
                )
            time.sleep(0.05)
        raise TimeoutError(f"{proc.kind} did not report its port in time; log: {proc.log}")


# Where the kernel's ephemeral ports start when /proc does not say (Linux's default).
EPHEMERAL_LOW = 32768
# How far below the ephemeral range _free_port looks.
BELOW_EPHEMERAL = 12000


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (net.ipv4.ip_local_port_range)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return EPHEMERAL_LOW


def _free_port() -> int:
    """A port free on 127.0.0.1 now, for a process that binds it seconds later.

    Picked below the kernel's ephemeral range: a port from bind(0) is one the kernel hands
    out again to the next outgoing connection or bind(0) of any process in those seconds
    (a worker then exited with 'Address already in use' on its metrics port), where a port
    below the range is taken only by a process that names it."""
    low = ephemeral_low()
    if low - 1024 >= 1000:
        rng = random.SystemRandom()
        for _ in range(100):
            port = rng.randrange(max(1024, low - BELOW_EPHEMERAL), low)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(
    address: str,
    timeout_s: float,
    proc: LocalProcess | None = None,
    credentials: grpc.ChannelCredentials | None = None,
) -> None:
    """Block until ``address`` reports SERVING on the standard health service (over TLS
    with ``credentials``)."""
    deadline = time.monotonic() + max(timeout_s, 0.0)
    channel = (
        grpc.insecure_channel(address)
        if credentials is None
        else grpc.secure_channel(address, credentials)
    )
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if proc is not None and proc.popen.poll() is not None:
                raise RuntimeError(
                    f"{proc.kind} exited with {proc.popen.returncode}:\n"
                    f"{proc.log.read_text(errors='replace')[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} did not become SERVING in time")
            time.sleep(0.1)
