"""Interleaved A/B: a local deployment whose workers are forks of the fork server
(``gateway.fork_server``) against one whose workers are fresh processes.

Forking must cost nothing once the workers run. Each leg starts ``LocalCluster`` on the
bundled model at its defaults (bf16, one prefill and one decode worker, the core plan),
with ``ClusterSpec.fork_workers`` on or off, then through the gateway times one long
prompt (``--long`` tokens, 2 output tokens: the prefill) and ``--streams`` concurrent
streams of 64 tokens after it (output tok/s). Legs alternate ``--runs`` times; medians
and ratios are the result. Writes ``benchmarks/results/fork_workers_ab_<date>_<host kind>.md``.

    python -m benchmarks.fork_workers_ab [--runs 2] [--long 7000] [--streams 8] [--model M]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import statistics
import sys
import time
from pathlib import Path

import grpc.aio

from benchmarks import common, provenance
from gateway.launcher import ClusterSpec, LocalCluster
from protos.baton.v1 import common_pb2, generate_pb2, generate_pb2_grpc

STREAM_TOKENS = 64


def _request(ids: list[int], max_tokens: int) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=ids),
        sampling_params=common_pb2.SamplingParameters(
            max_tokens=max_tokens, temperature=0, ignore_eos=True
        ),
    )


def _ids(n: int, seed: int) -> list[int]:
    # Ordinary vocabulary, distinct per leg so no prefix cache answers.
    return [1000 + (seed * 7919 + i * 104729) % 30000 for i in range(n)]


async def _tokens(stub: generate_pb2_grpc.BatonStub, request: generate_pb2.GenerateRequest) -> int:
    count = 0
    async for reply in stub.Generate(request, timeout=900):
        count += len(reply.token_ids)
    return count


async def _leg(address: str, long: int, streams: int, seed: int) -> tuple[float, float]:
    """(seconds for the long prompt, output tok/s of the concurrent streams)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.BatonStub(channel)
        began = time.perf_counter()
        await _tokens(stub, _request(_ids(long, seed), 2))
        long_s = time.perf_counter() - began
        began = time.perf_counter()
        done = await asyncio.gather(
            *[
                _tokens(stub, _request(_ids(64, seed * 100 + i), STREAM_TOKENS))
                for i in range(streams)
            ]
        )
        return long_s, sum(done) / (time.perf_counter() - began)


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fork_workers_ab", description=__doc__)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--long", type=int, default=7000, help="tokens of the long prompt")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--model", help="checkpoint (default: the bundled one)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, help="results file (default: benchmarks/results/)")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.long < 1 or args.streams < 1:
        raise ValueError("--runs, --long and --streams must be at least 1")
    from engine.model_files import resolve_model

    model = args.model or str(resolve_model("smollm2-135m").path)
    now = dt.datetime.now()
    load0 = os.getloadavg()
    rows: list[list[str]] = []
    legs: dict[str, list[tuple[float, float]]] = {"forked": [], "fresh": []}
    for rep in range(args.runs):
        for name, fork in (("forked", True), ("fresh", False)):
            spec = ClusterSpec(model=model, dtype=args.dtype, fork_workers=fork)
            with LocalCluster(spec) as cluster:
                kinds = sorted(
                    {type(p.popen).__name__ for p in cluster.procs if p.kind != "gateway"}
                )
                seed = rep * 2 + fork
                long_s, tok_s = asyncio.run(
                    _leg(cluster.gateway_address, args.long, args.streams, seed)
                )
            legs[name].append((long_s, tok_s))
            rows.append([name, str(rep + 1), ", ".join(kinds), f"{long_s:.2f}", f"{tok_s:.1f}"])
            print(
                f"{name} run {rep + 1}: long prompt {long_s:.2f} s, {tok_s:.1f} tok/s", flush=True
            )
    med = {
        n: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v))
        for n, v in legs.items()
    }
    command = "python -m benchmarks.fork_workers_ab " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    lines = [
        f"# Forked against fresh workers, {now:%Y-%m-%d %H:%M}",
        "",
        *provenance.header_lines(
            command, len(os.sched_getaffinity(0)), load0, os.getloadavg(), now
        ),
        "",
        common.markdown_table(
            ("workers", "run", "worker processes", f"{args.long}-token prompt s", "output tok/s"),
            rows,
        ),
        "",
        "Medians and forked / fresh:",
        "",
        common.markdown_table(
            ("what", "forked", "fresh", "forked / fresh"),
            [
                [
                    f"{args.long}-token prompt, s",
                    f"{med['forked'][0]:.2f}",
                    f"{med['fresh'][0]:.2f}",
                    f"{med['forked'][0] / med['fresh'][0]:.2f}",
                ],
                [
                    f"{args.streams} streams x {STREAM_TOKENS} tokens, output tok/s",
                    f"{med['forked'][1]:.1f}",
                    f"{med['fresh'][1]:.1f}",
                    f"{med['forked'][1] / med['fresh'][1]:.2f}",
                ],
            ],  # fmt: skip
        ),
        "",
        f"- Each leg: `LocalCluster(ClusterSpec(model={Path(model).name}, dtype={args.dtype},"
        " fork_workers=...))` at its other defaults, then through the gateway one prompt of"
        f" {args.long} tokens (2 output tokens), then {args.streams} concurrent streams of"
        f" {STREAM_TOKENS} tokens; greedy, prompts unique per leg.",
    ]
    return provenance.publish("\n".join(lines) + "\n", "fork_workers_ab", out=args.out)


if __name__ == "__main__":
    common.stop_on_sigterm()
    main()
