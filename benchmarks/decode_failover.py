"""Decode fail-over under load: what clients see when a decode worker dies or drains.

One disaggregated deployment (one prefill, two decode workers, the bundled model at its
default dtype), the same Poisson load three times, side by side:

- undisturbed: nothing happens to the workers;
- kill -9: the busier decode worker is killed once ``--at`` of the requests have arrived;
- SIGTERM: the busier decode worker is sent SIGTERM at the same point (it drains: its
  streams get ``--drain-finish-s`` to finish, then the gateway moves the rest).

A replacement decode worker is started after each disturbed phase, as a Deployment
replaces a pod. For each phase: requests completed and failed (by status), moves
(``usage.migrations``), TTFT and inter-token latency (p50, p99, max) and the longest
pause of any stream, with the disturbed phases' ratios to the undisturbed one. Every
completed request must have all its tokens; outputs are greedy, so the undisturbed
phase's tokens are the reference for the others (agreement is reported, bf16 near ties
aside).

    python -m benchmarks.decode_failover [--requests 32] [--rate 1.0] [--at 0.5]
        [--at-s S] [--prefill-workers 1] [--tag T] [--dtype bfloat16]
        [--results-dir benchmarks/results]

A burst (``--rate 1000 --at-s 8``: every request at once, the kill 8 s in, mid-stream)
is the harder case: the surviving decode worker takes every moved request while it runs
its own, on the cores it shares with the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import random
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.provenance import header_lines
from benchmarks.serving import percentile

REPO = Path(__file__).resolve().parent.parent
PHASES = ("undisturbed", "kill -9", "SIGTERM")


@dataclass(slots=True)
class Stream:
    """One request as its client saw it; times in seconds from the phase start."""

    request_id: str
    arrival_s: float
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    status: str = "OK"
    migrations: int = 0

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.arrival_s if self.token_times else None

    def gaps_s(self) -> list[float]:
        """Time between consecutive tokens (tokens of one message count as 0 apart)."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


async def _stream(client: Any, r: common.W1Request, arrival_s: float, t0: float) -> Stream:
    from protos.client import SamplingParams
    from protos.client.errors import BatonError

    delay = t0 + arrival_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    out = Stream(r.request_id, arrival_s)
    sampling = SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True)
    try:
        async for chunk in client.generate(
            token_ids=r.prompt_token_ids,
            sampling=sampling,
            request_id=f"{r.request_id}-{uuid.uuid4().hex[:8]}",
            timeout=900.0,
        ):
            now = time.perf_counter() - t0
            out.token_times += [now] * len(chunk.token_ids)
            out.token_ids += chunk.token_ids
            if chunk.usage is not None:
                out.migrations = chunk.usage.migrations
    except BatonError as exc:
        out.status = type(exc).__name__
    return out


async def _phase(
    address: str,
    requests: list[common.W1Request],
    arrivals: list[float],
    disturb: Any,
) -> tuple[list[Stream], float]:
    """Run the load; ``disturb`` (a callable, or None) runs once the ``at`` share arrived."""
    from protos.client import AsyncClient

    async with AsyncClient(address) as client:
        t0 = time.perf_counter()
        tasks = [
            asyncio.create_task(_stream(client, r, a, t0))
            for r, a in zip(requests, arrivals, strict=True)
        ]
        if disturb is not None:
            at, act = disturb
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            await act()
        streams = await asyncio.gather(*tasks)
        return list(streams), time.perf_counter() - t0


async def _running(address: str) -> int:
    """Requests a decode worker is running now (its Stats)."""
    import grpc.aio

    from protos.baton.v1 import worker_pb2, worker_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        stats = await stub.Stats(worker_pb2.StatsRequest(), timeout=5.0)
    return stats.num_running


def summarize(streams: list[Stream], expected: dict[str, int]) -> dict[str, Any]:
    done = [s for s in streams if s.status == "OK"]
    short = [s.request_id for s in done if len(s.token_ids) != expected[s.request_id]]
    assert not short, f"completed requests with missing tokens: {short}"
    failed: dict[str, int] = {}
    for s in streams:
        if s.status != "OK":
            failed[s.status] = failed.get(s.status, 0) + 1
    ttft = [s.ttft_s for s in done if s.ttft_s is not None]
    gaps = [g for s in done for g in s.gaps_s()]
    pauses = [max(s.gaps_s(), default=0.0) for s in done]
    return {
        "requests": len(streams),
        "completed": len(done),
        "failed": failed,
        "moved_requests": sum(1 for s in streams if s.migrations),
        "moves": sum(s.migrations for s in streams),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(gaps, 50),
        "itl_p99_s": percentile(gaps, 99),
        "itl_max_s": max(gaps, default=None),
        "longest_pause_p50_s": percentile(pauses, 50),
        "output_tokens": sum(len(s.token_ids) for s in done),
    }


def _agreement(streams: list[Stream], reference: dict[str, list[int]]) -> str:
    same = sum(1 for s in streams if s.status == "OK" and s.token_ids == reference[s.request_id])
    return f"{same}/{sum(1 for s in streams if s.status == 'OK')}"


def run(opts: argparse.Namespace) -> dict[str, Any]:
    from gateway.launcher import ClusterSpec, LocalCluster

    requests = common.load_workload(opts.workload, opts.requests)
    expected = {r.request_id: r.output_len for r in requests}
    rng, at, arrivals = random.Random(opts.seed), 0.0, [0.0]
    for _ in requests[1:]:
        at += rng.expovariate(opts.rate)
        arrivals.append(at)
    disturb_at = (
        opts.at_s if opts.at_s is not None else arrivals[int(opts.at * (len(arrivals) - 1))]
    )
    spec = ClusterSpec(
        model=opts.model,
        mode="disaggregated",
        transport="shm",
        num_prefill=opts.prefill_workers,
        num_decode=2,
        dtype=opts.dtype,
        # The phases send the same prompts: without the prefix cache each phase computes
        # them afresh, so the phases compare like with like.
        worker_args=(
            "--max-model-len",
            str(opts.max_model_len),
            "--enable-prefix-caching",
            "false",
        ),
        start_timeout_s=600.0,
    )
    phases: dict[str, Any] = {}
    reference: dict[str, list[int]] = {}
    with LocalCluster(spec) as cluster:
        decoders = lambda: [  # noqa: E731
            p for p in cluster.procs if p.kind == "decode" and p.popen.poll() is None
        ]

        async def busiest() -> Any:
            load = {p.address: await _running(p.address) for p in decoders()}
            return next(p for p in decoders() if p.address == max(load, key=load.get))

        async def kill() -> None:
            victim = await busiest()
            victim.popen.send_signal(signal.SIGKILL)

        async def term() -> None:
            cluster.terminate(await busiest())

        warm = common.W1Request("warmup", common.warmup_prompt(), common.WARMUP_NEW_TOKENS)
        asyncio.run(_phase(cluster.gateway_address, [warm], [0.0], None))
        for name, act in zip(PHASES, (None, kill, term), strict=True):
            streams, wall = asyncio.run(
                _phase(
                    cluster.gateway_address,
                    requests,
                    arrivals,
                    None if act is None else (disturb_at, act),
                )
            )
            summary = summarize(streams, expected)
            summary["wall_s"] = wall
            if act is None:
                reference = {s.request_id: s.token_ids for s in streams}
            summary["same_tokens_as_undisturbed"] = _agreement(streams, reference)
            phases[name] = summary
            while len(decoders()) < 2:
                cluster.add_worker("decode")
    return {
        "phases": phases,
        "disturbed_at_s": disturb_at,
        "arrivals_span_s": arrivals[-1],
    }


def render(raw: dict[str, Any], header: list[str]) -> str:
    base = raw["phases"]["undisturbed"]
    rows = []
    for name, p in raw["phases"].items():
        failed = ", ".join(f"{k} {v}" for k, v in sorted(p["failed"].items())) or "0"
        rows.append(
            [
                name,
                f"{p['completed']}/{p['requests']}",
                failed,
                f"{p['moved_requests']} ({p['moves']})",
                f"{common.fmt(p['ttft_p50_s'] * 1e3, 0)} / {common.fmt(p['ttft_p99_s'] * 1e3, 0)}",
                f"{common.fmt(p['itl_p50_s'] * 1e3, 0)} / {common.fmt(p['itl_p99_s'] * 1e3, 0)}"
                f" / {common.fmt(p['itl_max_s'] * 1e3, 0)}",
                f"{common.ratio(p['ttft_p99_s'], base['ttft_p99_s'])} / "
                f"{common.ratio(p['itl_p99_s'], base['itl_p99_s'])}",
                p["same_tokens_as_undisturbed"],
            ]
        )
    table = common.markdown_table(
        [
            "phase",
            "completed",
            "failed",
            "moved (moves)",
            "TTFT p50 / p99 ms",
            "ITL p50 / p99 / max ms",
            "TTFT p99 / ITL p99 vs undisturbed",
            "same tokens",
        ],
        rows,
    )
    return "\n".join(
        [
            *header,
            "",
            f"Disturbed at {raw['disturbed_at_s']:.1f} s of {raw['arrivals_span_s']:.1f} s of "
            "arrivals (the busier decode worker); a new decode worker is started after each "
            "disturbed phase.",
            "",
            table,
            "",
        ]
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode_failover")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--workload", type=Path, default=common.DEFAULT_WORKLOAD)
    p.add_argument("--requests", type=int, default=32, help="the first N W1 requests")
    p.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals, requests/s")
    p.add_argument("--at", type=float, default=0.5, help="disturb once this share arrived")
    p.add_argument("--at-s", type=float, default=None, help="disturb this long after the start")
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--tag", default="", help="appended to the results file's name")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results-dir", type=Path, default=REPO / "benchmarks" / "results")
    return p


def main(argv: list[str] | None = None) -> Path:
    opts = _parser().parse_args(argv)
    if not 0.0 <= opts.at <= 1.0:
        raise SystemExit(f"--at must be in [0, 1], got {opts.at}")
    load_before = os.getloadavg()
    raw = run(opts)
    load_after, now = os.getloadavg(), dt.datetime.now()
    command = "python -m benchmarks.decode_failover " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    header = [
        f"# Decode fail-over under load, {now:%Y-%m-%d %H:%M}",
        "",
        *header_lines(command.strip(), None, load_before, load_after, now),
        "",
        f"Model {opts.model}, {opts.dtype}; {opts.requests} W1 requests at {opts.rate} req/s "
        f"(Poisson); {opts.prefill_workers} prefill + 2 decode workers over shm, default flags "
        "but the prefix "
        "cache off (every phase sends the same prompts).",
    ]
    text = render(raw, header)
    raw.update(date=now.isoformat(timespec="seconds"), command=command.strip())
    opts.results_dir.mkdir(parents=True, exist_ok=True)
    tag = f"_{opts.tag}" if opts.tag else ""
    stem = opts.results_dir / f"decode_failover_{now:%Y-%m-%d}_{opts.dtype}{tag}"
    stem.with_suffix(".json").write_text(json.dumps(raw, indent=2) + "\n")
    stem.with_suffix(".md").write_text(text)
    print(text, flush=True)
    return stem.with_suffix(".md")


if __name__ == "__main__":
    common.stop_on_sigterm()
    main()
