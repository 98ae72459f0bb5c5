"""The gateway's HTTP surface: the OpenAI-compatible API (``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``) and its listener.

It owns the mapping both ways: JSON bodies (with their constraint and tool fields) onto
the one request path's :class:`~gateway.validation.GenerateInput`, deltas back onto
OpenAI objects and SSE chunks, tool calls read out of the text, and typed errors onto HTTP
statuses. It knows nothing of routing or of the gRPC surface.
"""
