"""Local against remote prefill: where a prompt of a given uncached length is cheaper to
prefill, on the decode worker itself or on a prefill worker (conditional
disaggregation's ``--local-prefill-tokens``), and what local prefill costs the streams the
decode worker is running.

Two deployments of the same shape (one prefill and one decode worker over shm, the
launcher's core plan, the bundled model at its default dtype), started in turn and
interleaved over ``--rounds``: the gateway with ``--local-prefill-tokens 0`` (every prompt
on the prefill worker) and with every prompt kept on the decode worker. In each, while
one background stream decodes, prompts of each length (fresh token ids, so nothing is
cached) are sent one at a time; the table gives the median TTFT of each length in each
deployment, their ratio, and the background stream's inter-token latency (p50, p99, max)
over the whole run. The crossover is where local stops being faster.

    python -m benchmarks.local_prefill [--lengths 16,64,128,256,512,1024] [--repeats 5]
        [--rounds 2] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.provenance import header_lines
from benchmarks.serving import percentile

REPO = Path(__file__).resolve().parent.parent
MODES = {"remote": ("--local-prefill-tokens", "0"), "local": (
    "--local-prefill-tokens", "1000000", "--local-prefill-cached-fraction", "1.0")}  # fmt: skip
BACKGROUND_TOKENS = 100_000  # the background stream runs until the measurement ends


async def _ttft(client: Any, ids: list[int]) -> float:
    from protos.client import SamplingParams

    began = time.perf_counter()
    async for chunk in client.generate(
        token_ids=ids, sampling=SamplingParams(max_tokens=1, temperature=0), timeout=300
    ):
        if chunk.token_ids:
            return time.perf_counter() - began
    raise RuntimeError("the stream ended without a token")


async def _background(client: Any, stop: asyncio.Event, gaps: list[float]) -> None:
    from protos.client import SamplingParams

    last = None
    stream = client.generate(
        token_ids=common.fixed_prompt(4242, 32),
        sampling=SamplingParams(max_tokens=BACKGROUND_TOKENS, temperature=0, ignore_eos=True),
        timeout=3600,
    )
    async with stream:
        async for _chunk in stream:
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            if stop.is_set():
                return


async def _measure(address: str, lengths: list[int], repeats: int, seed: int) -> dict[str, Any]:
    from protos.client import AsyncClient

    async with AsyncClient(address) as client:
        await _ttft(client, common.warmup_prompt())
        stop, gaps = asyncio.Event(), []
        background = asyncio.create_task(_background(client, stop, gaps))
        await asyncio.sleep(1.0)  # it is decoding
        ttft: dict[str, list[float]] = {}
        for n in lengths:
            ttft[str(n)] = [
                await _ttft(client, common.fixed_prompt(seed + 1000 * n + r, n))
                for r in range(repeats)
            ]
        stop.set()
        await background
    return {"ttft_s": ttft, "itl_s": gaps}


def run(opts: argparse.Namespace) -> dict[str, Any]:
    from gateway.launcher import ClusterSpec, LocalCluster

    raw: dict[str, Any] = {m: {"ttft_s": {}, "itl_s": []} for m in MODES}
    for r in range(opts.rounds):
        for mode, flags in MODES.items():
            spec = ClusterSpec(
                model=opts.model,
                mode="disaggregated",
                transport="shm",
                dtype=opts.dtype,
                gateway_args=flags,
                start_timeout_s=600.0,
            )
            with LocalCluster(spec) as cluster:
                got = asyncio.run(
                    _measure(cluster.gateway_address, opts.lengths, opts.repeats, 100 * r)
                )
            for n, values in got["ttft_s"].items():
                raw[mode]["ttft_s"].setdefault(n, []).extend(values)
            raw[mode]["itl_s"].extend(got["itl_s"])
    return raw


def render(raw: dict[str, Any], header: list[str]) -> str:
    rows = []
    for n in raw["remote"]["ttft_s"]:
        remote = statistics.median(raw["remote"]["ttft_s"][n])
        local = statistics.median(raw["local"]["ttft_s"][n])
        rows.append([n, f"{remote * 1e3:.0f}", f"{local * 1e3:.0f}", common.ratio(local, remote)])
    table = common.markdown_table(
        ["uncached prompt tokens", "remote TTFT ms (median)", "local TTFT ms", "local / remote"],
        rows,
    )
    itl_rows = []
    for mode in MODES:
        gaps = raw[mode]["itl_s"]
        itl_rows.append(
            [mode]
            + [common.fmt((percentile(gaps, q) or 0) * 1e3, 0) for q in (50, 99)]
            + [common.fmt(max(gaps, default=0) * 1e3, 0)]
        )
    itl = common.markdown_table(["prefill", "background ITL p50 ms", "p99 ms", "max ms"], itl_rows)
    faster = [n for n in raw["remote"]["ttft_s"] if
              statistics.median(raw["local"]["ttft_s"][n])
              < statistics.median(raw["remote"]["ttft_s"][n])]  # fmt: skip
    return "\n".join(
        [
            *header,
            "",
            table,
            "",
            "The background stream, decoding while the prompts above were prefilled:",
            "",
            itl,
            "",
            f"Local prefill was faster at: {', '.join(faster) or 'no length'} tokens.",
            "",
        ]
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.local_prefill")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lengths", default="16,64,128,256,512,1024")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--results-dir", type=Path, default=REPO / "benchmarks" / "results")
    return p


def main(argv: list[str] | None = None) -> Path:
    opts = _parser().parse_args(argv)
    opts.lengths = [int(x) for x in opts.lengths.split(",") if x]
    if not opts.lengths or min(opts.lengths) < 1:
        raise SystemExit(f"--lengths must be positive integers, got {opts.lengths}")
    load_before = os.getloadavg()
    raw = run(opts)
    load_after, now = os.getloadavg(), dt.datetime.now()
    args = sys.argv[1:] if argv is None else argv
    command = " ".join(["python -m benchmarks.local_prefill", *args])
    header = [
        f"# Local against remote prefill, {now:%Y-%m-%d %H:%M}",
        "",
        *header_lines(command.strip(), None, load_before, load_after, now),
        "",
        f"Model {opts.model}, {opts.dtype}; 1 prefill + 1 decode worker over shm, the "
        f"launcher's core plan; {opts.repeats} prompts per length per round, "
        f"{opts.rounds} round(s), deployments interleaved.",
    ]
    text = render(raw, header)
    raw_out = {"date": now.isoformat(timespec="seconds"), "command": command, **raw}
    opts.results_dir.mkdir(parents=True, exist_ok=True)
    stem = opts.results_dir / f"local_prefill_{now:%Y-%m-%d}_{opts.dtype}"
    stem.with_suffix(".json").write_text(json.dumps(raw_out, indent=1) + "\n")
    stem.with_suffix(".md").write_text(text)
    print(text, flush=True)
    return stem.with_suffix(".md")


if __name__ == "__main__":
    common.stop_on_sigterm()
    main()
