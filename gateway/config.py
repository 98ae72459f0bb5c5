"""The gateway's configuration: built once in ``__main__`` from flags and ``BATON_GATEWAY_*``.

Every flag has an environment twin (``--max-retries`` <-> ``BATON_GATEWAY_MAX_RETRIES``);
a flag given on the command line wins. Lists (``--decode``, ``--prefill``) repeat the flag
or, in the environment, separate targets with commas. A target is ``HOST:PORT`` or
``dns:///NAME:PORT`` (every address NAME resolves to; see gateway.routing.discovery).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.routing.discovery import parse_target
from rpc.tls import TlsFiles

ENV_PREFIX = "BATON_GATEWAY_"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
ROUTINGS = ("kv", "load")


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Everything the gateway needs to start. Frozen: nothing changes it after start-up."""

    decode: tuple[str, ...]  # decode worker targets: HOST:PORT or dns:///NAME:PORT
    prefill: tuple[str, ...] = ()  # prefill worker targets; empty: single-process mode
    model: str = "smollm2-135m"  # bundled name, .gguf path or checkpoint directory
    model_cache_dir: Path | None = None  # where workers cache converted GGUFs
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    host: str = "127.0.0.1"
    port: int = 50051  # 0: any free port
    port_file: Path | None = None  # the bound port is written here
    max_retries: int = 2  # extra attempts for a request that failed before its first token
    # Moves of a request to another decode worker after its first token (gateway.routing.migration).
    max_migrations: int = 3
    grace_s: float = 30.0  # drain time for in-flight requests on SIGTERM
    stats_interval_s: float = 0.25  # how often every worker's Stats is polled
    stats_timeout_s: float = 1.0  # deadline of one Stats call
    # A worker is taken out of rotation after this long without a serving answer.
    worker_down_after_s: float = 3.0
    # How long a request that finds no worker of a kind up waits for one (within its deadline).
    wait_for_worker_s: float = 3.0
    resolve_interval_s: float = 5.0  # how often dns:/// targets are looked up again
    # Answer dns:/// lookups from this JSON file ({"NAME:PORT": ["HOST:PORT", ...]}),
    # read again at every lookup, instead of DNS: the local launcher's fleets.
    resolve_file: Path | None = None
    # Pair each decode worker with a prefill worker on its own host (co-located pods,
    # whose KV moves over shm / cuda_ipc and cannot cross hosts).
    same_host_prefill: bool = False
    # kv: route a prompt where its prefix is cached (the workers' KV events) against the
    # work queued there; load: by load only.
    routing: str = "kv"
    # How much one cached prompt token counts against one queued token (kv routing).
    kv_cache_weight: float = 2.0
    # Conditional disaggregation (kv routing): prefill on the decode worker a prompt of
    # which it lacks at most this many tokens (0: never), or holds this fraction. Measured
    # (benchmarks/results/local_prefill_*): on one host, local prefill was faster only at
    # 16 tokens (0.77x remote TTFT; 0.98-1.06x from 64 to 1024) and tripled the ITL of
    # the decode worker's running streams, so only the shortest prompts stay local.
    local_prefill_tokens: int = 16
    local_prefill_cached_fraction: float = 1.0
    metrics_port: int = 0  # Prometheus metrics over HTTP on this port; 0: off
    log_level: str = "INFO"
    # --- OpenAI-compatible HTTP and traces (gateway.http.server, rpc.tracing) ---
    http_port: int | None = None  # None: no HTTP; 0: any free port
    http_port_file: Path | None = None  # the bound HTTP port is written here
    http_request_timeout_s: float = 0.0  # deadline of an HTTP request without a header; 0: none
    otlp_endpoint: str | None = None  # export spans over OTLP/gRPC here; None: no export
    # --- limits and security (gateway.admission, rpc.tls, rpc.auth) ---
    # Streams (gRPC and HTTP together) in flight at once; past it RESOURCE_EXHAUSTED / 429.
    max_concurrent_streams: int = 1024
    # TLS on the public ports (gRPC and HTTP): certificate and key (PEM); None: plaintext.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # mTLS to the workers: the gateway's client certificate and key, the fleet's CA.
    worker_tls_cert: Path | None = None
    worker_tls_key: Path | None = None
    worker_tls_ca: Path | None = None
    # The name worker certificates are checked against (workers are dialled by IP).
    worker_tls_server_name: str | None = None
    # API keys, one per line; None: no authentication.
    api_keys_file: Path | None = None

    def __post_init__(self) -> None:
        if not self.decode:
            raise ValueError(
                "decode must list at least one decode worker target (HOST:PORT or dns:///NAME:PORT)"
            )
        for name in ("decode", "prefill"):
            targets = getattr(self, name)
            for target in targets:
                try:
                    parse_target(target)
                except ValueError as err:
                    raise ValueError(f"{name}: {err}") from err
            if len(set(targets)) != len(targets):
                raise ValueError(f"{name} lists a target twice: {list(targets)}")
        if not self.model:
            raise ValueError("model must name a model")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {self.max_model_len}")
        for name in ("port", "metrics_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be in [0, 65536), got {getattr(self, name)}")
        if self.metrics_port and self.metrics_port == self.port:
            raise ValueError(f"metrics_port and port must differ, both are {self.port}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        if not self.kv_cache_weight >= 0:
            raise ValueError(f"kv_cache_weight must be >= 0, got {self.kv_cache_weight}")
        if self.local_prefill_tokens < 0:
            raise ValueError(f"local_prefill_tokens must be >= 0, got {self.local_prefill_tokens}")
        if not 0.0 < self.local_prefill_cached_fraction <= 1.0:
            raise ValueError(
                "local_prefill_cached_fraction must be in (0, 1], got "
                f"{self.local_prefill_cached_fraction}"
            )
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        for name in (
            "stats_interval_s",
            "stats_timeout_s",
            "worker_down_after_s",
            "resolve_interval_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.wait_for_worker_s < 0:
            raise ValueError(f"wait_for_worker_s must be >= 0, got {self.wait_for_worker_s}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if self.http_port is not None:
            if not 0 <= self.http_port < 65536:
                raise ValueError(f"http_port must be in [0, 65536), got {self.http_port}")
            if self.http_port == self.port != 0:
                raise ValueError(f"http_port and port must differ, both are {self.port}")
        if self.http_request_timeout_s < 0:
            raise ValueError(
                f"http_request_timeout_s must be >= 0, got {self.http_request_timeout_s}"
            )
        if self.max_concurrent_streams < 1:
            raise ValueError(
                f"max_concurrent_streams must be >= 1, got {self.max_concurrent_streams}"
            )
        # Raises if a certificate comes without its key (or the other way round).
        _ = self.tls, self.worker_tls

    @property
    def tls(self) -> TlsFiles:
        """The public ports' PEM files (no CA: clients authenticate with API keys)."""
        return TlsFiles(self.tls_cert, self.tls_key, None, flag="--tls")

    @property
    def worker_tls(self) -> TlsFiles:
        """The gateway's identity towards the workers, and the CA it trusts them by."""
        return TlsFiles(
            self.worker_tls_cert, self.worker_tls_key, self.worker_tls_ca, flag="--worker-tls"
        )

    @classmethod
    def from_args(cls, argv: Sequence[str], env: Mapping[str, str]) -> GatewayConfig:
        """Parse ``argv`` (without the program name) over ``env``; ValueError for bad values
        (``SystemExit`` from argparse for malformed flags)."""
        return cls.parse(argv, env)[0]

    @classmethod
    def parse(cls, argv: Sequence[str], env: Mapping[str, str]) -> tuple[GatewayConfig, bool]:
        """As :meth:`from_args`; also whether ``--check-config`` was given (print the
        resolved config and exit, without starting anything)."""
        args = _parser().parse_args(list(argv))
        values: dict[str, Any] = {}
        for name, convert in _FIELDS.items():
            flag_value = getattr(args, name)
            if isinstance(flag_value, list):  # a repeated flag: join, then split on commas
                flag_value = ",".join(flag_value)
            if flag_value is not None:
                source, raw = "--" + name.replace("_", "-"), flag_value
            else:
                source, raw = ENV_PREFIX + name.upper(), env.get(ENV_PREFIX + name.upper())
                if raw is None or not raw.strip():
                    continue
            try:
                values[name] = convert(raw.strip())
            except ValueError as err:
                raise ValueError(f"{source}={raw!r} is not valid: {err}") from err
        if not values.get("decode"):
            raise ValueError(
                "decode worker targets are required: --decode HOST:PORT (or dns:///NAME:PORT) "
                f"or {ENV_PREFIX}DECODE"
            )
        return cls(**values), bool(args.check_config)

    def describe(self) -> str:
        """The resolved configuration as one JSON object (what ``--check-config`` prints)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return json.dumps({"service": "gateway", "config": fields}, default=str, sort_keys=True)


def _addresses(raw: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in raw.split(",") if a.strip())


def _bool(raw: str) -> bool:
    low = raw.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true/false")


# Field -> how to convert its text form (env values, and flags argparse leaves as text).
_FIELDS: dict[str, Callable[[str], Any]] = {
    "decode": _addresses,
    "prefill": _addresses,
    "model": str,
    "model_cache_dir": Path,
    "max_model_len": int,
    "host": str,
    "port": int,
    "port_file": Path,
    "max_retries": int,
    "max_migrations": int,
    "grace_s": float,
    "stats_interval_s": float,
    "stats_timeout_s": float,
    "worker_down_after_s": float,
    "wait_for_worker_s": float,
    "resolve_interval_s": float,
    "resolve_file": Path,
    "same_host_prefill": _bool,
    "routing": str,
    "kv_cache_weight": float,
    "local_prefill_tokens": int,
    "local_prefill_cached_fraction": float,
    "metrics_port": int,
    "log_level": str.upper,
    "http_port": int,
    "http_port_file": Path,
    "http_request_timeout_s": float,
    "otlp_endpoint": str,
    "max_concurrent_streams": int,
    "tls_cert": Path,
    "tls_key": Path,
    "worker_tls_cert": Path,
    "worker_tls_key": Path,
    "worker_tls_ca": Path,
    "worker_tls_server_name": str,
    "api_keys_file": Path,
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gateway",
        description="baton gateway: the public Baton gRPC service in front of decode and "
        f"prefill workers. Every flag can also be set as {ENV_PREFIX}<FLAG> (e.g. "
        f"{ENV_PREFIX}MAX_RETRIES); a flag on the command line wins.",
    )
    p.add_argument("--host", help="interface to listen on (default 127.0.0.1)")
    p.add_argument("--port", help="port to listen on; 0 picks a free one (default 50051)")
    p.add_argument("--port-file", help="write the bound port to this file")
    p.add_argument("--model", help="bundled model name, .gguf file or checkpoint directory")
    p.add_argument("--model-cache-dir", help="where workers keep converted GGUF checkpoints")
    p.add_argument("--max-model-len", help="prompt + output token limit; 0: the model's own")
    p.add_argument(
        "--decode",
        action="append",
        help="decode workers: HOST:PORT or dns:///NAME:PORT (every address NAME resolves to); "
        "repeat for several",
    )
    p.add_argument(
        "--prefill",
        action="append",
        help="prefill workers, as --decode; none: decode workers run prompts themselves",
    )
    p.add_argument("--max-retries", help="retries before the first token (default 2)")
    p.add_argument(
        "--max-migrations",
        help="moves of a request to another decode worker after its first token, when its "
        "worker dies or drains (default 3; 0: off, such a stream fails UNAVAILABLE)",
    )
    p.add_argument("--grace-s", help="seconds in-flight requests may drain on SIGTERM")
    p.add_argument("--stats-interval-s", help="seconds between worker Stats polls (0.25)")
    p.add_argument("--stats-timeout-s", help="deadline of one Stats call, seconds (1.0)")
    p.add_argument(
        "--worker-down-after-s",
        help="seconds without a serving Stats answer before a worker is out of rotation (3.0)",
    )
    p.add_argument(
        "--wait-for-worker-s",
        help="how long a request that finds no worker up waits for one, seconds (3.0)",
    )
    p.add_argument(
        "--resolve-interval-s", help="seconds between DNS lookups of dns:/// targets (5)"
    )
    p.add_argument(
        "--resolve-file",
        help='answer dns:/// lookups from this JSON file, {"NAME:PORT": ["HOST:PORT", ...]}, '
        "read again at every lookup, instead of DNS (the local launcher uses it)",
    )
    p.add_argument(
        "--same-host-prefill",
        help="true: pair each decode worker with a prefill worker on its own host "
        "(co-located pods sharing shm); default false",
    )
    p.add_argument(
        "--routing",
        help="kv: send a prompt where its prefix is cached, weighed against the work queued "
        "there (the workers' KV events); load: by load only (default kv)",
    )
    p.add_argument(
        "--kv-cache-weight",
        help="kv routing: how much a cached prompt token counts against a queued one; above 1 "
        "a worker's cache also stands for the compute the fleet saves (2.0)",
    )
    p.add_argument(
        "--local-prefill-tokens",
        help="kv routing, disaggregated: prefill a prompt on the decode worker itself when "
        "it lacks at most this many of its tokens and has no more than that queued (16; "
        "0: always on a prefill worker)",
    )
    p.add_argument(
        "--local-prefill-cached-fraction",
        help="... or when the decode worker holds at least this fraction of the prompt (1.0)",
    )
    p.add_argument("--metrics-port", help="serve Prometheus metrics on this port; 0: off (0)")
    p.add_argument(
        "--check-config",
        action="store_true",
        help="print the resolved configuration as JSON and exit (2 on an error)",
    )
    p.add_argument("--log-level", help=f"one of {', '.join(LOG_LEVELS)} (default INFO)")
    p.add_argument(
        "--http-port", help="serve the OpenAI-compatible HTTP API here; 0 picks a free one"
    )
    p.add_argument("--http-port-file", help="write the bound HTTP port to this file")
    p.add_argument(
        "--http-request-timeout-s",
        help="deadline of an HTTP request that sends no X-Request-Timeout header; 0: none",
    )
    p.add_argument("--otlp-endpoint", help="export trace spans over OTLP/gRPC to this URL")
    p.add_argument(
        "--max-concurrent-streams",
        help="streams in flight at once, gRPC and HTTP together (1024); past it "
        "RESOURCE_EXHAUSTED / HTTP 429",
    )
    p.add_argument("--tls-cert", help="certificate (PEM) of the public ports; with --tls-key: TLS")
    p.add_argument("--tls-key", help="private key (PEM) of the public ports")
    p.add_argument("--worker-tls-cert", help="client certificate (PEM) towards the workers (mTLS)")
    p.add_argument("--worker-tls-key", help="private key (PEM) of --worker-tls-cert")
    p.add_argument("--worker-tls-ca", help="CA bundle (PEM) that signed the workers' certificates")
    p.add_argument(
        "--worker-tls-server-name", help="name the workers' certificates are checked against"
    )
    p.add_argument(
        "--api-keys-file",
        help="file of API keys, one per line; calls must send 'authorization: Bearer <key>'",
    )
    return p
