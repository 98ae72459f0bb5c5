"""A small typed Python client for a baton gateway: sync and asyncio, no torch.

    from protos.client import Client, SamplingParams

    with Client("127.0.0.1:50051", timeout=60) as client:
        for chunk in client.generate(text="Hello", sampling=SamplingParams(max_tokens=16)):
            print(chunk.text, end="", flush=True)

:class:`Client` (blocking) and :class:`AsyncClient` (asyncio) stream :class:`Chunk` deltas
(text and token ids), join them into a :class:`Completion`, take per-call deadlines
(``timeout=`` seconds) and cancel on the server when a stream is left early or
cancelled. Failed calls raise one :class:`BatonError` subclass per family of status codes
(:mod:`protos.client.errors`), each carrying ``code`` and ``message``.
``python -m protos.client`` is a command-line client (``baton generate`` runs it).

Why it lives here: a client needs the generated ``baton.v1`` modules and nothing else of
baton. In this repository those are importable as ``protos.baton.v1``; the client sits
beside them as ``protos.client``, importing only grpcio, protobuf and ``protos.baton.v1``
(tests/test_architecture.py holds it to that). ``protos/pyproject.toml`` makes exactly
this directory the ``baton-client`` distribution (packages ``protos``,
``protos.baton.v1``, ``protos.client``; depends on grpcio and protobuf only), so
``pip install ./protos`` gives a user the client and the stubs without torch or
transformers, and the server's own distribution carries the very same modules: one copy,
one import path, in and out of the repository. The two distributions overlap, so install
one of them per environment (the server's includes the client).
"""

from __future__ import annotations

from protos.client.async_client import AsyncClient, AsyncStream
from protos.client.channel import DEFAULT_TIMEOUT
from protos.client.errors import (
    AbortedError,
    AuthError,
    BatonError,
    CancelledError,
    DeadlineExceededError,
    InvalidRequestError,
    ResourceExhaustedError,
    ServerError,
    UnavailableError,
    UnsupportedError,
)
from protos.client.messages import (
    ChatTurn,
    Chunk,
    Completion,
    FinishReason,
    ModelInfo,
    SamplingParams,
    TokenLogprob,
    Usage,
)
from protos.client.sync_client import Client, Stream
from protos.client.tools import Tool, ToolCall

__all__ = [
    "DEFAULT_TIMEOUT",
    "AbortedError",
    "AsyncClient",
    "AsyncStream",
    "AuthError",
    "BatonError",
    "CancelledError",
    "ChatTurn",
    "Chunk",
    "Client",
    "Completion",
    "DeadlineExceededError",
    "FinishReason",
    "InvalidRequestError",
    "ModelInfo",
    "ResourceExhaustedError",
    "SamplingParams",
    "ServerError",
    "Stream",
    "TokenLogprob",
    "Tool",
    "ToolCall",
    "UnavailableError",
    "UnsupportedError",
    "Usage",
]
