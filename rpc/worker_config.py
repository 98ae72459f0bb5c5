"""Configuration of a prefill or decode worker: built once in ``__main__`` from flags and
``BATON_PREFILL_*`` / ``BATON_DECODE_*`` environment variables.

Every flag has an environment twin (``--max-num-seqs`` <-> ``BATON_DECODE_MAX_NUM_SEQS``
for a decode worker); a flag given on the command line wins. Torch-free.

Addresses: a worker listens on ``--host`` (``0.0.0.0``: every interface) and is reached
at ``--advertise-host`` (in Kubernetes the pod IP, from the downward API through
``BATON_<ROLE>_ADVERTISE_HOST``), which defaults to ``--host`` when that is one address.
A gloo/nccl decode worker's rendezvous store listens on every interface at the port of
``--transport-address`` and is advertised to prefill workers at that address, whose host
part defaults to the advertise host (``0.0.0.0:29500`` -> ``<advertise host>:29500``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from engine.config import EngineConfig
from engine.cpu_budget import format_cpu_list, parse_cpu_list
from engine.transfer.base import check_transport_device
from engine.transfer.fleet_auth import FleetKey
from rpc.tls import TlsFiles, TlsMaterial

ROLES = ("prefill", "decode", "both")
TRANSPORTS = ("shm", "gloo", "cuda_ipc", "nccl", "nixl")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
RENDEZVOUS_TRANSPORTS = ("gloo", "nccl")  # the ones whose peers dial an address
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything a worker needs to start. Frozen: nothing changes it after start-up."""

    role: str  # prefill | decode | both (prefill + decode in one engine, no transfer)
    engine: EngineConfig
    host: str = "127.0.0.1"  # where to listen; 0.0.0.0: every interface
    port: int = 0  # 0: any free port
    # The address peers reach this worker at (gRPC and KV rendezvous); "": host itself.
    advertise_host: str = ""
    port_file: Path | None = None  # the bound port is written here
    grace_s: float = 30.0  # drain time for in-flight requests on SIGTERM
    # Decode: how long its streams may go on finishing after SIGTERM before the worker
    # hands the rest back to the gateway to move (ABORTED + rpc.errors.DRAINING_KEY).
    drain_finish_s: float = 5.0
    transport: str = "shm"  # KV transport: shm | gloo (CPU), cuda_ipc | nccl (GPU), nixl (both)
    # shm: segment name (empty: random). gloo/nccl: host:port prefill workers reach the
    # decode worker's rendezvous store at (it listens on every interface; port 0: any).
    transport_address: str = "127.0.0.1:0"
    # Longest a KV hand-off may take from reservation to verified arrival.
    transfer_timeout_s: float = 30.0
    # Health is NOT_SERVING while the engine has not finished a step for this long (it is
    # wedged, not dead), SERVING again once it steps; 0: never. See _HELP for the bound.
    engine_stall_timeout_s: float = 60.0
    metrics_port: int = 0  # Prometheus metrics over HTTP on this port; 0: off
    log_level: str = "INFO"
    # --- security (rpc.tls, decode_service.prefill_fleet, engine.transfer.fleet_auth) ---
    # This worker's certificate and key, and the fleet's CA: with all three the port is
    # mTLS (clients must present a certificate the CA signed) and decode dials prefill
    # workers with the same certificate as its client identity.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    # Decode: the name prefill workers' certificates are checked against (they are
    # dialled by IP); None: the dialled host.
    tls_server_name: str | None = None
    # Serve gRPC reflection (off: only the fleet calls a worker).
    enable_reflection: bool = False
    # A file holding the fleet's shared secret: the KV hand-off and the gloo/nccl
    # rendezvous refuse a peer that cannot prove it holds it.
    fleet_secret_file: Path | None = None
    # Decode: the prefill workers it may dial (host, host:port or dns:///name:port);
    # empty: any.
    prefill_allow: tuple[str, ...] = ()
    # --- observability (rpc.tracing, engine.timeline) ---
    # Export the request spans over OTLP/gRPC to this URL (http://host:4317); None: the
    # trace context still propagates, nothing is exported.
    otlp_endpoint: str | None = None
    # Write a Chrome/Perfetto trace of the engine loop and the transfer worker here on
    # shutdown; None: nothing is recorded.
    timeline_file: Path | None = None
    # --- CPUs (rpc.worker_cpus, engine.cpu_budget) ---
    # Pin the process to these CPUs at start (the launcher's core plan); None: as started.
    cpus: frozenset[int] | None = None
    # Cores the deployment grants (Kubernetes: the container's limits.cpu); bounds the
    # compute team of --num-threads 0 with the affinity mask and cgroup quota. None: no bound.
    cpu_limit: float | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        for name in ("port", "metrics_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be in [0, 65536), got {getattr(self, name)}")
        if self.metrics_port and self.metrics_port == self.port:
            raise ValueError(f"metrics_port and port must differ, both are {self.port}")
        if self.advertise_host in WILDCARD_HOSTS[1:]:
            raise ValueError(
                f"advertise_host must be an address peers can dial, got {self.advertise_host!r}"
            )
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.transport in RENDEZVOUS_TRANSPORTS and self.role == "decode":
            host, sep, port = self.transport_address.rpartition(":")
            if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
                raise ValueError(
                    f"transport_address must be HOST:PORT for {self.transport}, "
                    f"got {self.transport_address!r}"
                )
            if host in WILDCARD_HOSTS:
                raise ValueError(
                    f"transport_address {self.transport_address!r} is not an address prefill "
                    "workers can dial: give --advertise-host (or a host in --transport-address)"
                )
        for name in (
            "grace_s",
            "drain_finish_s",
            "transfer_timeout_s",
            "engine_stall_timeout_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if self.role != "both":  # a single-process worker moves no KV
            check_transport_device(self.transport, self.engine.device)
        if self.tls_cert is not None or self.tls_key is not None or self.tls_ca is not None:
            if None in (self.tls_cert, self.tls_key, self.tls_ca):
                raise ValueError("tls_cert, tls_key and tls_ca must be given together (mTLS)")
        if self.cpu_limit is not None and not self.cpu_limit > 0:
            raise ValueError(f"cpu_limit must be > 0, got {self.cpu_limit}")
        if self.prefill_allow and self.role == "prefill":
            raise ValueError("prefill_allow applies to decode workers only")

    @property
    def tls(self) -> TlsFiles:
        """The worker's PEM files, named by their flags in errors."""
        return TlsFiles(self.tls_cert, self.tls_key, self.tls_ca, flag="--tls")

    @property
    def reachable_host(self) -> str:
        """The host peers dial: the advertise host, else the listening host."""
        return self.advertise_host or self.host

    def describe(self) -> str:
        """The resolved configuration as one JSON object (what ``--check-config`` prints)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["engine"] = dataclasses.asdict(self.engine)
        fields["cpus"] = format_cpu_list(self.cpus) if self.cpus else None
        service = "prefill_service" if self.role == "prefill" else "decode_service"
        return json.dumps({"service": service, "config": fields}, default=str, sort_keys=True)

    @classmethod
    def from_args(cls, role: str, argv: Sequence[str], env: Mapping[str, str]) -> WorkerConfig:
        """Parse ``argv`` over ``env`` for a worker of ``role``; ValueError for bad values."""
        return cls.parse(role, argv, env)[0]

    @classmethod
    def parse(
        cls, role: str, argv: Sequence[str], env: Mapping[str, str]
    ) -> tuple[WorkerConfig, bool]:
        """As :meth:`from_args`; also whether ``--check-config`` was given (print the
        resolved config and exit, without starting anything)."""
        prefix = env_prefix(role)
        args = _parser(role, prefix).parse_args(list(argv))
        worker: dict[str, Any] = {}
        engine: dict[str, Any] = {}
        for name, (convert, target) in _FIELDS.items():
            raw = getattr(args, name, None)
            if isinstance(raw, list):  # a repeated flag: join, then split on commas
                raw = ",".join(raw)
            source = "--" + name.replace("_", "-")
            if raw is None:
                source = prefix + name.upper()
                raw = env.get(source)
                if raw is None or not raw.strip():
                    continue
            try:
                value = convert(raw.strip())
            except ValueError as err:
                raise ValueError(f"{source}={raw!r} is not valid: {err}") from err
            (engine if target == "engine" else worker)[name] = value
        _resolve_addresses(role, worker)
        # A prefill worker's batches are prompt chunks: panels would rarely serve them.
        engine.setdefault("linear_panels", role != "prefill")
        # A decode worker prefills a prompt only when the gateway keeps a short or mostly
        # cached one local (conditional disaggregation): bound its cost to running streams.
        engine.setdefault("max_prefill_tokens_while_decoding", 128 if role == "decode" else 0)
        return cls(role=role, engine=EngineConfig(**engine), **worker), bool(args.check_config)


def _resolve_addresses(role: str, worker: dict[str, Any]) -> None:
    """Fill in what the address flags leave to their defaults (see the module doc)."""
    host = worker.get("host", "127.0.0.1")
    advertise = worker.get("advertise_host", "")
    if not advertise and host not in WILDCARD_HOSTS:
        advertise = host
    if advertise:
        worker["advertise_host"] = advertise
    if worker.get("transport", "shm") not in RENDEZVOUS_TRANSPORTS:
        return
    store_host, sep, store_port = worker.get("transport_address", "").rpartition(":")
    if not sep:  # none given: the advertise host, any free port
        store_host, store_port = "", "0"
    if store_host not in WILDCARD_HOSTS:
        return
    if advertise:
        worker["transport_address"] = f"{advertise}:{store_port}"
    elif role == "decode":
        raise ValueError(
            f"--host {host} with --transport {worker['transport']} needs --advertise-host: the "
            "address prefill workers reach this decode worker's KV rendezvous store at"
        )


def env_prefix(role: str) -> str:
    """Decode workers read ``BATON_DECODE_*`` whether or not they run single-process."""
    return "BATON_PREFILL_" if role == "prefill" else "BATON_DECODE_"


def _bool(raw: str) -> bool:
    low = raw.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true/false")


def _list(raw: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in raw.split(",") if a.strip())


def _optional_int(raw: str) -> int | None:
    return None if raw.lower() in ("", "none", "auto") else int(raw)


def _optional_float(raw: str) -> float | None:
    return None if raw.lower() in ("", "none", "0") else float(raw)


# Flags that may repeat (their values are joined with commas).
_REPEATED = frozenset({"prefill_allow"})
# Boolean flags that may stand alone (``--deterministic`` means ``--deterministic true``).
_SWITCHES = frozenset({"deterministic"})

# Field -> (conversion from text, which record it belongs to).
_FIELDS: dict[str, tuple[Callable[[str], Any], str]] = {
    "model": (str, "engine"),
    "dtype": (str, "engine"),
    "device": (str, "engine"),
    "block_size": (int, "engine"),
    "num_blocks": (_optional_int, "engine"),
    "kv_cache_bytes": (int, "engine"),
    "max_num_seqs": (int, "engine"),
    "max_num_batched_tokens": (int, "engine"),
    "max_model_len": (int, "engine"),
    "enable_prefix_caching": (_bool, "engine"),
    "seed": (int, "engine"),
    "num_threads": (int, "engine"),
    "cache_dir": (str, "engine"),
    "enforce_eager": (_bool, "engine"),
    "attention_fallback": (str.lower, "engine"),
    "host": (str, "worker"),
    "port": (int, "worker"),
    "port_file": (Path, "worker"),
    "grace_s": (float, "worker"),
    "drain_finish_s": (float, "worker"),
    "transport": (str, "worker"),
    "transport_address": (str, "worker"),
    "transfer_timeout_s": (float, "worker"),
    "engine_stall_timeout_s": (float, "worker"),
    "advertise_host": (str, "worker"),
    "metrics_port": (int, "worker"),
    "log_level": (str.upper, "worker"),
    "max_queued_requests": (int, "engine"),
    "kv_growth_tokens": (int, "engine"),
    "linear_panels": (_bool, "engine"),
    "cpu_kernels": (str.lower, "engine"),
    "max_prefill_tokens_while_decoding": (int, "engine"),
    "deterministic": (_bool, "engine"),
    "tls_cert": (Path, "worker"),
    "tls_key": (Path, "worker"),
    "tls_ca": (Path, "worker"),
    "tls_server_name": (str, "worker"),
    "enable_reflection": (_bool, "worker"),
    "fleet_secret_file": (Path, "worker"),
    "prefill_allow": (_list, "worker"),
    "otlp_endpoint": (str, "worker"),
    "timeline_file": (Path, "worker"),
    "cpus": (parse_cpu_list, "worker"),
    "cpu_limit": (_optional_float, "worker"),
    "core_seat": (str, "engine"),
}

_HELP = {
    "model": "bundled model name, .gguf file or HF checkpoint directory",
    "dtype": "float32 | bfloat16 | float16",
    "device": "cpu | cuda[:N]",
    "block_size": "tokens per KV block",
    "num_blocks": "KV blocks in the pool (default: from --kv-cache-bytes)",
    "kv_cache_bytes": "bytes of KV pool when --num-blocks is not given",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "token budget of one step",
    "max_model_len": "prompt + output limit; 0: the model's own",
    "enable_prefix_caching": "reuse KV of shared prompt prefixes (true/false)",
    "seed": "seed of unseeded sampling",
    "num_threads": "torch compute threads; 0: the CPUs this process may use (its affinity "
    "mask, --cpus), bounded by its cgroup CPU quota and --cpu-limit",
    "cache_dir": "where converted GGUF checkpoints are cached",
    "enforce_eager": "GPU: no CUDA graphs, every step runs eagerly (true/false)",
    "attention_fallback": "GPU: when the Triton attention kernels do not build at start "
    "(no C compiler, an unwritable TRITON_CACHE_DIR): none fails the start with the cause; "
    "torch serves on the plain-torch path (slower: no Triton kernels, no CUDA graphs), "
    "logged as an error and shown by baton_attention_fallback (default none)",
    "host": "interface to listen on; 0.0.0.0: every interface",
    "advertise_host": "address peers reach this worker at, for gRPC and the KV rendezvous "
    "(default: --host, unless that is 0.0.0.0)",
    "port": "port to listen on; 0 picks a free one",
    "port_file": "write the bound port to this file",
    "grace_s": "seconds in-flight requests may drain on SIGTERM",
    "drain_finish_s": "decode: seconds streams may go on finishing after SIGTERM before the "
    "rest are handed back to the gateway, which moves them to another decode worker "
    "(within --grace-s)",
    "transport": "KV transport: shm | gloo | cuda_ipc | nccl | nixl",
    "transport_address": "gloo/nccl: HOST:PORT prefill workers reach the decode worker's "
    "rendezvous store at; it listens on every interface; HOST 0.0.0.0: the advertise host; "
    "shm: segment name",
    "metrics_port": "serve Prometheus metrics on this port; 0: off",
    "transfer_timeout_s": "longest a KV hand-off may take",
    "engine_stall_timeout_s": "health turns NOT_SERVING (and new calls UNAVAILABLE) while "
    "the engine has not finished a step for this many seconds, SERVING again once it steps; "
    "0: never. The engine publishes its stats after every step (every 0.5 s when idle), and "
    "a step is bounded by --max-num-batched-tokens, so a long prompt only makes more steps, "
    "never a longer one: a healthy engine stays under the bound unless one step of that many "
    "tokens takes longer (raise it for a large model on a slow CPU)",
    "log_level": f"one of {', '.join(LOG_LEVELS)}",
    "max_queued_requests": "bound of the engine queue (prefill) and the KV reservation queue "
    "(decode); past it RESOURCE_EXHAUSTED at once; a request inside it waits until it is "
    "served, its deadline passes or it is cancelled",
    "kv_growth_tokens": "decode: a reservation must leave free the blocks each admitted "
    "request needs for this many more tokens",
    "linear_panels": "CPU: decode-sized batches run on fp32 panels of the weights, a further "
    "copy of them (true/false; default true, false for prefill workers)",
    "cpu_kernels": "CPU: the kernel of each class of linear layer: auto (measured on the "
    "model at start-up, cached per host under ~/.cache/baton/kernel_routes), measure (always "
    "measured), default (the built-in constants), onednn or torch (every class on that one)",
    "max_prefill_tokens_while_decoding": "most prompt tokens a step that also decodes may "
    "carry (a prompt prefilled on a decode worker); 0: only --max-num-batched-tokens "
    "(default 128 for decode workers, 0 otherwise)",
    "deterministic": "bf16/fp32 on CPU: every kernel reduces in an order independent of the "
    "batch and of prompt chunking, so a request's tokens and logprobs are the same bits alone "
    "or in any batch, single-process or disaggregated; prefill and decode workers must both "
    "set it (the KV layout handshake refuses a mix) (true/false; alone: true; default false)",
    "tls_cert": "this worker's certificate (PEM); with --tls-key and --tls-ca: mTLS",
    "tls_key": "this worker's private key (PEM)",
    "tls_ca": "the fleet's CA bundle (PEM): clients and prefill peers must be signed by it",
    "tls_server_name": "decode: the name prefill certificates are checked against",
    "enable_reflection": "serve gRPC reflection (true/false; default false)",
    "fleet_secret_file": "file with the fleet's shared secret for the KV hand-off",
    "prefill_allow": "decode: prefill workers it may dial (host, host:port, dns:///name:port; "
    "comma-separated or repeated); default any",
    "otlp_endpoint": "export trace spans over OTLP/gRPC to this URL (http://host:4317)",
    "timeline_file": "write a Chrome/Perfetto trace JSON of the engine loop and the transfer "
    "worker to this file on shutdown",
    "cpus": "pin this process to these CPUs at start (a cpu list: 0-3,8); default: as started",
    "core_seat": "CPU: this worker's seat file among the core shares the launcher makes "
    "for the workers it plans on one host: lend this worker's cores while it has no work, "
    "borrow idle neighbours' while it has (never while --deterministic); default: none",
    "cpu_limit": "cores this worker is granted (the chart passes the container's CPU "
    "request); --num-threads 0 then uses at most this many; 0: no bound beyond the affinity "
    "mask and cgroup quota",
}


def defaults(role: str) -> dict[str, Any]:
    """Every flag's default for ``role`` (for the README's configuration table)."""
    cfg = WorkerConfig(
        role=role,
        engine=EngineConfig(
            linear_panels=role != "prefill",
            max_prefill_tokens_while_decoding=128 if role == "decode" else 0,
        ),
    )
    out = {f.name: getattr(cfg.engine, f.name) for f in dataclasses.fields(cfg.engine)}
    out.update(
        {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "engine"}
    )
    return out


def _parser(role: str, prefix: str) -> argparse.ArgumentParser:
    module = {"prefill": "prefill_service", "decode": "decode_service", "both": "decode_service"}
    p = argparse.ArgumentParser(
        prog=f"python -m {module[role]}",
        description=f"baton {role} worker. Every flag can also be set as {prefix}<FLAG>; "
        "a flag on the command line wins.",
    )
    if role != "prefill":
        p.add_argument(
            "--single-process",
            action="store_true",
            dest="_single",
            help="run prefill and decode in this one engine (role=both)",
        )
    for name in _FIELDS:
        if name == "prefill_allow" and role == "prefill":
            continue
        flag = "--" + name.replace("_", "-")
        if name in _REPEATED:
            p.add_argument(flag, dest=name, help=_HELP[name], action="append")
        elif name in _SWITCHES:
            p.add_argument(flag, dest=name, help=_HELP[name], nargs="?", const="true")
        else:
            p.add_argument(flag, dest=name, help=_HELP[name])
    p.add_argument(
        "--check-config",
        action="store_true",
        help="print the resolved configuration as JSON and exit (2 on an error)",
    )
    return p


@dataclass(frozen=True, slots=True)
class WorkerSecurity:
    """What a worker's security flags point at, read once at start-up (``load``)."""

    tls: TlsMaterial | None = None
    fleet_key: FleetKey | None = None

    @classmethod
    def load(cls, cfg: WorkerConfig) -> WorkerSecurity:
        """Read the PEM files and the fleet secret; ValueError names a bad flag."""
        key = FleetKey.from_file(cfg.fleet_secret_file) if cfg.fleet_secret_file else None
        return cls(tls=cfg.tls.load(), fleet_key=key)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """mTLS for the worker's port: clients must present a certificate of the fleet."""
        if self.tls is None:
            return None
        return self.tls.server_credentials(require_client_cert=True)
