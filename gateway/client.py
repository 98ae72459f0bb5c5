"""A small async client of the public Baton service, and a CLI for humans.

    python -m gateway.client --address 127.0.0.1:50051 "Once upon a time"
    python -m gateway.client --address 127.0.0.1:50051 --chat --max-tokens 64 "Hi!"
    echo "prompt" | python -m gateway.client --address 127.0.0.1:50051 -

Text streams to stdout as it arrives; finish reason, usage and speed go to stderr. Failed
calls raise the typed errors of engine.errors (ValueError for INVALID_ARGUMENT, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import AsyncIterator, Sequence

from engine.errors import BatonError
from protos.baton.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from rpc.channels import make_channel
from rpc.errors import PeerRpcError, typed_rpc_errors


class BatonClient:
    """Calls one gateway. ``async with BatonClient(address) as client: ...``."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = make_channel(address)
        self._stub = generate_pb2_grpc.BatonStub(self._channel)

    async def __aenter__(self) -> BatonClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def model_info(self, *, timeout: float = 10.0) -> generate_pb2.ModelInfoResponse:
        with typed_rpc_errors(self.address):
            return await self._stub.ModelInfo(generate_pb2.ModelInfoRequest(), timeout=timeout)

    async def generate(
        self,
        *,
        text: str | None = None,
        chat: Sequence[tuple[str, str]] | None = None,
        token_ids: Sequence[int] | None = None,
        sampling: common_pb2.SamplingParameters | None = None,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool | None = None,
        skip_special_tokens: bool | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """Stream one completion. Give exactly one of ``text``, ``chat`` ((role, content)
        pairs) or ``token_ids``. Leaving the iteration early cancels the request."""
        request = generate_pb2.GenerateRequest(sampling_params=sampling, stop=stop)
        if text is not None:
            request.text = text
        if chat is not None:
            request.chat.messages.extend(
                generate_pb2.ChatMessage(role=role, content=content) for role, content in chat
            )
        if token_ids is not None:
            request.token_ids.ids.extend(token_ids)
        if request_id is not None:
            request.request_id = request_id
        if include_stop_str_in_output is not None:
            request.include_stop_str_in_output = include_stop_str_in_output
        if skip_special_tokens is not None:
            request.skip_special_tokens = skip_special_tokens
        call = self._stub.Generate(request, timeout=timeout)
        try:
            with typed_rpc_errors(self.address):
                async for response in call:
                    yield response
        finally:
            call.cancel()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gateway.client", description="Stream a completion from a baton gateway."
    )
    p.add_argument("prompt", nargs="?", default="-", help="the prompt; '-' (default): stdin")
    p.add_argument("--address", default="127.0.0.1:50051", help="gateway host:port")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    p.add_argument("--system", help="with --chat: a system message first")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, help="0 is greedy (server default 1.0)")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--timeout", type=float, help="deadline in seconds")
    p.add_argument("--info", action="store_true", help="print the model's description and exit")
    return p


async def _run(args: argparse.Namespace) -> int:
    async with BatonClient(args.address) as client:
        if args.info:
            print(await client.model_info())
            return 0
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
        sampling = common_pb2.SamplingParameters(max_tokens=args.max_tokens)
        for name in ("temperature", "top_p", "top_k", "seed"):
            if getattr(args, name) is not None:
                setattr(sampling, name, getattr(args, name))
        chat = None
        if args.chat:
            chat = ([("system", args.system)] if args.system else []) + [("user", prompt)]
        began, first, last = time.monotonic(), None, None
        async for response in client.generate(
            text=None if args.chat else prompt,
            chat=chat,
            sampling=sampling,
            stop=args.stop,
            timeout=args.timeout,
        ):
            first = first or time.monotonic()
            sys.stdout.write(response.text)
            sys.stdout.flush()
            last = response
        elapsed = time.monotonic() - began
        if last is not None:
            usage = last.usage
            reason = common_pb2.FinishReason.Name(last.finish_reason)
            ttft = (first - began) if first is not None else 0.0
            rate = usage.completion_tokens / elapsed if elapsed > 0 else 0.0
            print(
                f"\n[{reason}; prompt {usage.prompt_tokens} tokens, completion "
                f"{usage.completion_tokens}, cached {usage.cached_tokens}; first token "
                f"{ttft:.2f}s, total {elapsed:.2f}s, {rate:.1f} tok/s]",
                file=sys.stderr,
            )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return asyncio.run(_run(args))
    except KeyboardInterrupt:
        return 130
    except (BatonError, ValueError, PeerRpcError) as err:  # typed failures of the call
        print(f"\nerror: {type(err).__name__}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
