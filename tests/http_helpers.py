"""Helpers for tests of the gateway's OpenAI-compatible HTTP API: a gateway with HTTP on
port 0 in front of fake workers (:func:`running_http`), an ``openai`` client for it, and
plain HTTP requests for what that client cannot send."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import openai

from gateway.app import Gateway
from gateway.config import GatewayConfig
from gateway.served_model import ServedModel
from rpc.server import RpcServer
from tests.fake_workers import FakeServer, eventually

TIMEOUT = 10.0
MODEL = "smollm2-135m"


@dataclass(slots=True)
class Running:
    server: RpcServer
    gateway: Gateway
    client: openai.AsyncOpenAI
    port: int  # HTTP


@contextlib.asynccontextmanager
async def running_http(
    model: ServedModel,
    decode: Sequence[FakeServer],
    *,
    request_timeout_s: float = 0.0,
    wait_ready: bool = True,
    tracer_provider: Any = None,
    max_migrations: int = 3,
) -> AsyncIterator[Running]:
    config = GatewayConfig(
        decode=tuple(d.address for d in decode),
        port=0,
        http_port=0,
        http_request_timeout_s=request_timeout_s,
        max_retries=0,
        max_migrations=max_migrations,
        grace_s=1.0,
        stats_interval_s=0.05,
        stats_timeout_s=0.5,
    )
    gateway = Gateway(config, model=model, tracer_provider=tracer_provider)
    server = RpcServer(gateway.spec())
    await server.start()
    try:
        await eventually(lambda: gateway.http is not None and gateway.http.port != 0)
        assert gateway.http is not None
        port = gateway.http.port
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT
        )
        if wait_ready:
            await server.wait_ready()
            await eventually(lambda: all(w.up for w in gateway.router.workers))
        try:
            yield Running(server, gateway, client, port)
        finally:
            await client.close()
    finally:
        await server.stop()
        await gateway.aclose()


def ids_of(model: ServedModel, text: str) -> list[int]:
    return model.tokenizer._encode(text, False)


def raw_request(
    port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One plain HTTP request (blocking: run it in a thread)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    try:
        conn.request(
            method, path, body=body, headers={"Content-Type": "application/json"} | (headers or {})
        )
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


async def post(port: int, path: str, body: object, **headers: str) -> tuple[int, dict, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, got_headers, raw = await asyncio.to_thread(
        raw_request, port, "POST", path, data, {k.replace("_", "-"): v for k, v in headers.items()}
    )
    return status, got_headers, json.loads(raw) if raw and not raw.startswith(b"data:") else raw
