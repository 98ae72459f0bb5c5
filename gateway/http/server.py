"""The gateway's HTTP listener: uvicorn serving an ASGI app on the gateway's own event loop.

The same lifecycle as the gRPC server (rpc.server), for the same reasons::

    start:  bind (port 0: any free one) -> port file -> serve; /v1 refused with 503
    open:   once the gateway is ready (tokenizer loaded, a decode worker up)
    stop:   /v1 refused with 503 -> in-flight requests drain for up to grace_s ->
            uvicorn stops, cancelling what is left (which cancels their decode calls)

``GET /health`` is always answered: 200 while open, 503 while starting or draining (no
key needed). ``GET /alive`` is 200 from the moment the listener serves until it starts
draining, ready or not: the startup and liveness probe of a gateway still waiting for
its decode workers (the HTTP twin of ``rpc.server.ALIVE_SERVICE``). With TLS files the
listener speaks HTTPS only.
uvicorn's own signal handling is turned off: the gateway's ``__main__`` owns SIGTERM and
stops both listeners together.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from rpc.auth import REFUSAL, ApiKeys
from rpc.drain_gate import DrainGate
from rpc.server import write_port_file
from rpc.tls import TlsFiles

logger = logging.getLogger(__name__)

# How long uvicorn lets requests still running after the drain finish before cancelling.
_FINAL_GRACE_S = 1


class HttpGate(DrainGate):
    """Admits ``/v1`` requests only while open and, with API keys, only with a valid
    ``Authorization: Bearer <key>`` (401 otherwise); counts the ones in flight (streams
    included, until their last byte). An ASGI middleware around the app."""

    def __init__(self, app: ASGIApp, api_keys: ApiKeys | None = None) -> None:
        super().__init__("the gateway is starting")
        self.stopping = False  # set once the listener drains: /alive turns 503
        self._app = app
        self._api_keys = api_keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self._app(scope, receive, send)
        if scope["path"] == "/health":
            return await _json(send, 200 if self.open else 503, {"status": self._status()})
        if scope["path"] == "/alive":
            alive = not self.stopping
            return await _json(
                send, 200 if alive else 503, {"status": "alive" if alive else "stopping"}
            )
        if not scope["path"].startswith("/v1/"):
            return await self._app(scope, receive, send)
        if self._api_keys is not None and not self._authorized(scope):
            error = {"message": REFUSAL, "type": "authentication_error", "param": None}
            return await _json(
                send,
                401,
                {"error": {**error, "code": "invalid_api_key"}},
                [(b"www-authenticate", b"Bearer")],
            )
        if not self.open:
            error = {"message": self.reason, "type": "service_unavailable", "param": None}
            return await _json(send, 503, {"error": {**error, "code": "unavailable"}})
        with self._counted():
            await self._app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        assert self._api_keys is not None
        values = [v for k, v in scope["headers"] if k == b"authorization"]
        if len(values) != 1:
            return False
        return self._api_keys.check_header(values[0].decode("latin-1"))

    def _status(self) -> str:
        return "serving" if self.open else self.reason


async def _json(
    send: Send, status: int, body: object, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    headers += extra or []
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


class _Embedded(uvicorn.Server):
    """uvicorn without its signal handlers (they would replace the gateway's)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """One HTTP listener: ``start``, ``open`` once ready, ``stop`` (safe to call twice)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        host: str,
        port: int,
        grace_s: float,
        port_file: Path | None = None,
        tls: TlsFiles | None = None,
        api_keys: ApiKeys | None = None,
    ) -> None:
        self.gate = HttpGate(app, api_keys)
        self._tls = tls
        self.host = host
        self.port = port  # the bound port, once started
        self._grace_s = grace_s
        self._port_file = port_file
        self._server: _Embedded | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Bind and begin serving (``/v1`` refused until :meth:`open`); the bound port."""
        if self._server is not None:
            raise RuntimeError("http server already started")
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as err:
            sock.close()
            raise OSError(f"http: could not bind {self.host}:{self.port}: {err}") from err
        sock.listen(1024)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.gate,
            lifespan="off",
            http="h11",
            ws="none",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=_FINAL_GRACE_S,
            ssl_certfile=str(self._tls.cert) if self._tls and self._tls.cert else None,
            ssl_keyfile=str(self._tls.key) if self._tls and self._tls.key else None,
        )
        server = _Embedded(config)
        self._server = server
        self._task = asyncio.create_task(server.serve(sockets=[sock]), name="http-server")
        while not server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("http server stopped while starting")
            await asyncio.sleep(0.01)
        logger.info("gateway HTTP (OpenAI-compatible) listening on %s:%d", self.host, self.port)
        if self._port_file is not None:
            write_port_file(self._port_file, self.port)
        return self.port

    def open(self) -> None:
        self.gate.open = True

    async def stop(self) -> None:
        """Refuse new requests, drain for up to grace_s, then stop serving."""
        if self._server is None:
            return
        if self._stopping is None:
            self._stopping = asyncio.create_task(self._stop())
        await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        assert self._server is not None and self._task is not None
        self.gate.stopping = True
        self.gate.close("the gateway is shutting down")
        if self.gate.in_flight:
            logger.info(
                "http draining: %d request(s) in flight, grace %.1fs",
                self.gate.in_flight,
                self._grace_s,
            )
        if not await self.gate.wait_idle(self._grace_s):
            logger.warning(
                "http: %d request(s) still in flight after %.1fs; cancelling them",
                self.gate.in_flight,
                self._grace_s,
            )
        self._server.should_exit = True
        await self._task
        logger.info("gateway HTTP stopped")
