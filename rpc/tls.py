"""TLS for baton's gRPC ports and channels: PEM files in, gRPC credentials out.

Three PEM files describe one side of a connection: its certificate chain, its private
key, and the CA bundle it trusts for the *other* side. Inside a fleet (gateway <->
workers, decode -> prefill) both sides present certificates signed by the fleet's CA
(mTLS): a worker refuses a client without one, and a client refuses a server whose
certificate the CA did not sign. On the gateway's public port clients need no
certificate (they authenticate with API keys, ``rpc.auth``).

Files are read once at start-up (``TlsFiles.load``); a missing or unreadable file is a
ValueError naming the flag. Keys are never logged. Standard grpc ``ssl_*_credentials``
only: no crypto of our own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """Paths of one side's PEM files, as flags give them; ``flag`` names the flag prefix
    for error messages (``--tls`` -> ``--tls-cert``, ``--tls-key``, ``--tls-ca``)."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None
    flag: str = "--tls"

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError(f"{self.flag}-cert and {self.flag}-key must be given together")

    @property
    def enabled(self) -> bool:
        return self.cert is not None or self.ca is not None

    def load(self) -> TlsMaterial | None:
        """Read the files (None when none is set). ValueError names an unreadable one."""
        if not self.enabled:
            return None
        return TlsMaterial(
            cert=_read(self.cert, f"{self.flag}-cert"),
            key=_read(self.key, f"{self.flag}-key"),
            ca=_read(self.ca, f"{self.flag}-ca"),
        )


@dataclass(frozen=True, slots=True)
class TlsMaterial:
    """The PEM bytes of one side. ``repr`` shows which parts are present, never a key."""

    cert: bytes | None
    key: bytes | None
    ca: bytes | None

    def __repr__(self) -> str:
        parts = [name for name in ("cert", "key", "ca") if getattr(self, name) is not None]
        return f"TlsMaterial({', '.join(parts)})"

    def server_credentials(self, *, require_client_cert: bool) -> grpc.ServerCredentials:
        """Serve TLS with our certificate; with ``require_client_cert`` (mTLS) a client
        must present a certificate signed by our CA, or the handshake fails."""
        if self.cert is None or self.key is None:
            raise ValueError("serving TLS needs a certificate and a key")
        if require_client_cert and self.ca is None:
            raise ValueError("requiring client certificates needs a CA bundle")
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.ca if require_client_cert else None,
            require_client_auth=require_client_cert,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Dial TLS, trusting our CA (the system's roots without one) and presenting our
        certificate as the client's when we have one."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


def server_name_option(name: str | None) -> tuple[tuple[str, str], ...]:
    """Channel options that check the server's certificate against ``name`` instead of
    the dialled host: pods are dialled by IP, their certificate names the fleet."""
    return (("grpc.ssl_target_name_override", name),) if name else ()


def _read(path: Path | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"{flag}={str(path)!r} cannot be read: {err.strerror}") from err
    if b"-----BEGIN" not in data:
        raise ValueError(f"{flag}={str(path)!r} is not a PEM file")
    return data
