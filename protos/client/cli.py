"""``python -m protos.client`` (and ``baton generate``): stream a completion to a terminal.

    python -m protos.client --address 127.0.0.1:50051 "Once upon a time"
    python -m protos.client --address 127.0.0.1:50051 --chat --max-tokens 64 "Hi!"
    echo "prompt" | python -m protos.client --address 127.0.0.1:50051 -

Text streams to stdout as it arrives; finish reason, usage and speed go to stderr. A
failed call prints its typed error and exits 1; Ctrl-C cancels the request and exits 130.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from protos.client.errors import BatonError
from protos.client.messages import Chunk, SamplingParams
from protos.client.sync_client import Client


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Stream a completion from a baton gateway.")
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


def _run(args: argparse.Namespace) -> int:
    with Client(args.address, timeout=args.timeout) as client:
        if args.info:
            print(client.model_info())
            return 0
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
        sampling = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        )
        chat = None
        if args.chat:
            chat = ([("system", args.system)] if args.system else []) + [("user", prompt)]
        began, first, last = time.monotonic(), None, None
        with client.generate(
            text=None if args.chat else prompt, chat=chat, sampling=sampling, stop=args.stop
        ) as stream:
            for chunk in stream:
                first = first or time.monotonic()
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                last = chunk
        _report(last, began, first)
    return 0


def _report(last: Chunk | None, began: float, first: float | None) -> None:
    if last is None or last.usage is None:
        return
    elapsed = time.monotonic() - began
    usage = last.usage
    ttft = (first - began) if first is not None else 0.0
    rate = usage.completion_tokens / elapsed if elapsed > 0 else 0.0
    print(
        f"\n[{last.finish_reason}; prompt {usage.prompt_tokens} tokens, completion "
        f"{usage.completion_tokens}, cached {usage.cached_tokens}; first token "
        f"{ttft:.2f}s, total {elapsed:.2f}s, {rate:.1f} tok/s]",
        file=sys.stderr,
    )


def main(argv: Sequence[str] | None = None, prog: str = "python -m protos.client") -> int:
    args = _parser(prog).parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt:  # leaving the stream's `with` block cancelled the request
        return 130
    except BatonError as err:
        print(f"\nerror: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
