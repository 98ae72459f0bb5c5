"""Serving benchmark: W1 through the gateway, single-process against disaggregated.

Owns the serving harness. In one run, on one model, dtype and engine settings, it measures:

- offline: the W1 requests all submitted at t = 0 through the gateway, per configuration;
- online: Poisson arrivals at one offered rate, the same for every configuration: TTFT
  and TPOT percentiles and throughput;
- gateway overhead: single-process W1 through the gateway against the in-process
  ``AsyncEngine`` (a `benchmarks.baton_w1` child with the same settings);
- KV transfer rate of each CPU transport against a memcpy of the same bytes
  (`engine.transfer.bandwidth`), with SmolLM2's KV layout.

Configurations (every worker kind is pinned, and gets one compute thread per core):

- a: single-process, one worker doing prefill and decode on all cores;
- b: disaggregated over shm, prefill and decode each on all cores (they share them);
- c: disaggregated over shm, prefill on the first core, decode on the second;
- d: disaggregated over gloo, sharing all cores (optional).

It prints markdown tables with pass/fail lines against the targets, and writes them, the
raw JSON and then PNG plots (`benchmarks.serving_plots`, where matplotlib, the ``bench``
extra, is installed) to ``benchmarks/results/``.

    python -m benchmarks.serving [--limit N] [--rate R] [--configs a,b,c] [--skip-offline]
        [--skip-online] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import os
import random
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import RunResult, RunSpec, W1Request
from benchmarks.plotting import draw_or_explain

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
# SmolLM2-135M's KV layout, for the transfer measurement: 30 layers, 3 KV heads of 64.
SMOLLM2_KV = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64}
OVERHEAD_TARGET = 0.05
TPOT_P99_TARGET = 0.5
THROUGHPUT_TARGET = 0.9
TRANSFER_TARGET = 0.5


@dataclass(frozen=True, slots=True)
class ServingConfig:
    """One deployment shape: how many processes, which transport, which cores."""

    key: str
    label: str
    mode: str  # single | disaggregated
    transport: str
    cpus: dict[str, frozenset[int]]


def serving_configs(cpus: list[int]) -> dict[str, ServingConfig]:
    """The configurations on these cores (``c`` needs two)."""
    every = frozenset(cpus)
    shared = {"prefill": every, "decode": every}
    out = {
        "a": ServingConfig("a", "single-process", "single", "shm", {"decode": every}),
        "b": ServingConfig("b", "disagg shm, shared cores", "disaggregated", "shm", shared),
        "d": ServingConfig("d", "disagg gloo, shared cores", "disaggregated", "gloo", shared),
    }
    if len(cpus) >= 2:
        pinned = {"prefill": frozenset({cpus[0]}), "decode": frozenset({cpus[1]})}
        out["c"] = ServingConfig("c", "disagg shm, pinned cores", "disaggregated", "shm", pinned)
    return out


# -- one request, one phase -----------------------------------------------------------


@dataclass(slots=True)
class Timing:
    """One request's life as the client saw it; times in seconds from the phase start."""

    request_id: str
    prompt_len: int
    output_len: int
    arrival_s: float
    first_s: float = 0.0
    last_s: float = 0.0
    token_ids: list[int] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        return self.first_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        n = len(self.token_ids)
        return (self.last_s - self.first_s) / (n - 1) if n > 1 else None


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated ``q``-th percentile (numpy's default); None when empty."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(slots=True)
class Phase:
    """One timed pass of requests through the gateway."""

    name: str  # offline | online
    rate_req_s: float | None  # None: all submitted at t = 0
    wall_s: float  # phase start to the last token of the last request
    timings: list[Timing]

    def summary(self) -> dict[str, Any]:
        ttft = [t.ttft_s for t in self.timings]
        tpot = [t.tpot_s for t in self.timings if t.tpot_s is not None]
        prompt = sum(t.prompt_len for t in self.timings)
        output = sum(t.output_len for t in self.timings)
        out: dict[str, Any] = {
            "phase": self.name,
            "rate_req_s": self.rate_req_s,
            "num_requests": len(self.timings),
            "prompt_tokens": prompt,
            "output_tokens": output,
            "wall_s": self.wall_s,
            "output_tok_s": output / self.wall_s,
            "total_tok_s": (prompt + output) / self.wall_s,
            "outputs_digest": common.outputs_digest(
                {t.request_id: t.token_ids for t in self.timings}
            ),
        }
        for name, values in (("ttft", ttft), ("tpot", tpot)):
            for q in (50, 90, 99):
                out[f"{name}_p{q}_s"] = percentile(values, q)
        out["ttft_s"] = ttft
        out["tpot_s"] = tpot
        return out


async def _request(
    client: Any, r: W1Request, arrival_s: float, t0: float, timeout_s: float, tag: str
) -> Timing:
    from protos.client import SamplingParams

    delay = t0 + arrival_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    timing = Timing(r.request_id, len(r.prompt_token_ids), r.output_len, arrival_s)
    sampling = SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True)
    async for resp in client.generate(
        token_ids=r.prompt_token_ids,
        sampling=sampling,
        request_id=f"{tag}-{r.request_id}",
        timeout=timeout_s,
    ):
        if resp.token_ids:
            now = time.perf_counter() - t0
            if not timing.token_ids:
                timing.first_s = now
            timing.last_s = now
            timing.token_ids.extend(resp.token_ids)
    return timing


async def run_phase(
    client: Any,
    name: str,
    requests: list[W1Request],
    rate_req_s: float | None,
    seed: int,
    timeout_s: float,
    tag: str,
) -> Phase:
    """All requests at t = 0 (rate None), or at Poisson arrivals of ``rate_req_s``."""
    arrivals = [0.0] * len(requests)
    if rate_req_s is not None:
        rng, at = random.Random(seed), 0.0
        for i in range(1, len(requests)):
            at += rng.expovariate(rate_req_s)
            arrivals[i] = at
    t0 = time.perf_counter()
    timings = await asyncio.gather(
        *(
            _request(client, r, a, t0, timeout_s, f"{tag}-{name}")
            for r, a in zip(requests, arrivals, strict=True)
        )
    )
    common.check_output_lengths(requests, {t.request_id: t.token_ids for t in timings})
    return Phase(name, rate_req_s, max(t.last_s for t in timings), list(timings))


# -- the harness ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Options:
    """Everything a run needs, built once from the command line."""

    model_dir: Path
    workload: Path
    limit: int | None
    online_limit: int
    rate_req_s: float | None  # None: load_fraction of single-process offline throughput
    load_fraction: float
    configs: tuple[str, ...]
    skip_offline: bool
    skip_online: bool
    skip_baseline: bool
    dtype: str
    cpus: tuple[int, ...]
    kv_cache_bytes: int
    max_model_len: int
    bw_kinds: tuple[str, ...]
    bw_blocks_per_job: int
    bw_repeats: int
    bw_rounds: int
    bw_threads: int
    seed: int
    request_timeout_s: float
    results_dir: Path
    plots: bool


def _cluster_spec(opts: Options, cfg: ServingConfig) -> Any:
    from gateway.launcher import ClusterSpec

    args = [
        "--kv-cache-bytes",
        str(opts.kv_cache_bytes),
        "--max-model-len",
        str(opts.max_model_len),
    ]
    if cfg.mode == "disaggregated" and cfg.transport == "shm":
        # The default segment name is shared by every shm decode worker on the host.
        args += ["--transport-address", f"baton-serving-{uuid.uuid4().hex[:16]}"]
    return ClusterSpec(
        model=str(opts.model_dir),
        mode=cfg.mode,
        transport=cfg.transport,
        dtype=opts.dtype,
        worker_args=tuple(args),
        cpus=cfg.cpus,
        start_timeout_s=600.0,
    )


def _online_rate(
    opts: Options, offline_a: dict[str, Any] | None, online: list[W1Request]
) -> tuple[float, str]:
    if opts.rate_req_s is not None:
        return opts.rate_req_s, "given with --rate"
    assert offline_a is not None, "validated in _options"
    mean_tokens = sum(len(r.prompt_token_ids) + r.output_len for r in online) / len(online)
    rate = opts.load_fraction * offline_a["total_tok_s"] / mean_tokens
    return rate, (
        f"{opts.load_fraction:.2f} x single-process offline total tok/s"
        f" ({offline_a['total_tok_s']:.1f}) / mean prompt+output tokens of the"
        f" online requests ({mean_tokens:.0f})"
    )


def run_config(
    opts: Options,
    cfg: ServingConfig,
    requests: list[W1Request],
    online: list[W1Request],
    state: dict[str, Any],
) -> dict[str, Any]:
    """Start one deployment, warm it up, run its phases, stop it."""
    from gateway.launcher import LocalCluster
    from protos.client import AsyncClient

    result: dict[str, Any] = {**asdict(cfg), "cpus": {k: sorted(v) for k, v in cfg.cpus.items()}}
    started = time.monotonic()
    with LocalCluster(_cluster_spec(opts, cfg)) as cluster:
        result["startup_s"] = round(time.monotonic() - started, 1)

        async def drive() -> None:
            async with AsyncClient(cluster.gateway_address) as client:
                warm = W1Request("warmup", common.warmup_prompt(), common.WARMUP_NEW_TOKENS)
                await run_phase(client, "warmup", [warm], None, 0, opts.request_timeout_s, cfg.key)
                if not opts.skip_offline:
                    phase = await run_phase(
                        client, "offline", requests, None, 0, opts.request_timeout_s, cfg.key
                    )
                    result["offline"] = phase.summary()
                    logger.info(
                        "%s offline: %.1f output tok/s in %.1f s",
                        cfg.key,
                        result["offline"]["output_tok_s"],
                        phase.wall_s,
                    )
                if not opts.skip_online:
                    if "rate_req_s" not in state:
                        state["rate_req_s"], state["rate_source"] = _online_rate(
                            opts, result.get("offline"), online
                        )
                    phase = await run_phase(
                        client,
                        "online",
                        online,
                        state["rate_req_s"],
                        opts.seed,
                        opts.request_timeout_s,
                        cfg.key,
                    )
                    result["online"] = phase.summary()
                    logger.info(
                        "%s online: TPOT p99 %.1f ms",
                        cfg.key,
                        1e3 * (result["online"]["tpot_p99_s"] or 0),
                    )

        asyncio.run(drive())
    return result


def online_requests(requests: list[W1Request], limit: int) -> list[W1Request]:
    """The first ``limit`` requests, first prompt id changed so that no block of the
    offline pass's prefix cache matches (the chained hash starts at block 0)."""
    out = []
    for r in requests[:limit]:
        ids = list(r.prompt_token_ids)
        lo, hi = common.PROMPT_ID_RANGE
        ids[0] = ids[0] + 1 if ids[0] + 1 < hi else lo
        out.append(W1Request(r.request_id, ids, r.output_len))
    return out


def run_baseline(opts: Options, tmp: Path) -> RunResult:
    """W1 through the in-process ``AsyncEngine``, same settings, in its own child."""
    spec = RunSpec(
        engine="baton",
        mode="async",
        dtype=opts.dtype,
        model_dir=str(opts.model_dir),
        workload=str(opts.workload),
        limit=opts.limit,
        threads=len(opts.cpus),
        kv_cache_gib=opts.kv_cache_bytes / 2**30,
        max_model_len=opts.max_model_len,
        single_new_tokens=0,
    )
    out = tmp / "in-process.json"
    argv = [
        sys.executable,
        "-m",
        "benchmarks.baton_w1",
        "--spec",
        spec.to_json(),
        "--out",
        str(out),
    ]
    return common.run_child(argv, out, cwd=REPO, timeout_s=3600.0)


def run_bandwidth(opts: Options) -> list[dict[str, Any]]:
    """Best of ``bw_rounds`` rounds per transport, with a memcpy of the same bytes."""
    import torch

    from engine.kv_layout import KVLayout
    from engine.transfer.bandwidth import measure

    torch.set_num_threads(opts.bw_threads)
    layout = KVLayout(block_size=16, dtype=opts.dtype, **SMOLLM2_KV)
    num_blocks = max(4 * opts.bw_blocks_per_job, 64)
    rows = []
    for kind in opts.bw_kinds:
        rounds = [
            measure(kind, layout, num_blocks, opts.bw_blocks_per_job, opts.bw_repeats)
            for _ in range(opts.bw_rounds)
        ]
        best = dict(rounds[0])
        for key in ("transport_gbps", "verified_gbps", "memcpy_gbps"):
            best[key] = max(r[key] for r in rounds)
        best["ratio"] = best["transport_gbps"] / best["memcpy_gbps"]
        best["tokens_per_job"] = opts.bw_blocks_per_job * layout.block_size
        rows.append(best)
        logger.info(
            "%s: %.2f GB/s, memcpy %.2f GB/s", kind, best["transport_gbps"], best["memcpy_gbps"]
        )
    return rows


def output_agreement(raw: dict[str, Any]) -> str:
    """Whether every offline pass (and the in-process one) gave the same output ids."""
    digests = {c["key"]: c["offline"]["outputs_digest"] for c in raw["configs"] if "offline" in c}
    if raw.get("in_process"):
        digests["in-process"] = raw["in_process"]["outputs_digest"]
    if len(digests) < 2:
        return ""
    if len(set(digests.values())) == 1:
        return f"Offline output ids are identical in {', '.join(digests)}."
    groups: dict[str, list[str]] = {}
    for name, d in digests.items():
        groups.setdefault(d, []).append(name)
    return (
        "Offline output ids differ (greedy ties broken differently by batch composition"
        " are possible in reduced precision): "
        + "; ".join("=".join(names) for names in groups.values())
        + "."
    )


def run_all(opts: Options) -> dict[str, Any]:
    requests = common.load_workload(opts.workload, opts.limit)
    online = online_requests(requests, opts.online_limit)
    raw: dict[str, Any] = {"configs": [], "in_process": None, "bandwidth": []}
    state: dict[str, Any] = {}
    if not opts.skip_offline and not opts.skip_baseline and "a" in opts.configs:
        with tempfile.TemporaryDirectory(prefix="serving-") as tmp:
            raw["in_process"] = run_baseline(opts, Path(tmp)).to_dict()
    table = serving_configs(list(opts.cpus))
    for key in opts.configs:
        raw["configs"].append(run_config(opts, table[key], requests, online, state))
    raw.update(state)
    if opts.bw_kinds:
        raw["bandwidth"] = run_bandwidth(opts)
        raw["bw_threads"] = opts.bw_threads
        # A buffer far beyond the caches: the copy rate from and to memory.
        raw["memcpy_large_gbps"] = common.memcpy_bytes_per_s(256, opts.bw_threads) / 1e9
    raw["output_agreement"] = output_agreement(raw)
    raw["targets"] = targets(raw)
    return raw


# -- targets and report ---------------------------------------------------------------


def targets(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target: what was measured, the bound, and whether it held."""
    out = []
    by_key = {c["key"]: c for c in raw["configs"]}
    a = by_key.get("a", {})
    base = raw.get("in_process")
    if base and "offline" in a:
        overhead = 1 - a["offline"]["output_tok_s"] / base["output_tok_s"]
        out.append(
            {
                "name": "gateway overhead (single-process offline vs in-process)",
                "value": f"{100 * overhead:.1f}%",
                "bound": f"<= {100 * OVERHEAD_TARGET:.0f}%",
                "passed": overhead <= OVERHEAD_TARGET,
            }
        )
    for c in raw["configs"]:
        if (
            c["mode"] != "disaggregated"
            or "online" not in c
            or "online" not in a
            or not c["online"]["tpot_p99_s"]
            or not a["online"]["tpot_p99_s"]
        ):
            continue
        tpot = c["online"]["tpot_p99_s"] / a["online"]["tpot_p99_s"]
        thr = c["online"]["output_tok_s"] / a["online"]["output_tok_s"]
        out.append(
            {
                "name": f"{c['key']} ({c['label']}) TPOT p99 / single-process at"
                " throughput / single-process",
                "value": f"{tpot:.2f} at {thr:.2f}",
                "bound": f"<= {TPOT_P99_TARGET} at >= {THROUGHPUT_TARGET}",
                "passed": tpot <= TPOT_P99_TARGET and thr >= THROUGHPUT_TARGET,
            }
        )
    for bw in raw["bandwidth"]:
        if bw["kind"] == "shm":
            out.append(
                {
                    "name": "shm transfer / memcpy of the same bytes",
                    "value": f"{bw['ratio']:.2f}",
                    "bound": f">= {TRANSFER_TARGET}",
                    "passed": bw["ratio"] >= TRANSFER_TARGET,
                }
            )
    return out


def _ms(v: float | None) -> str:
    return common.fmt(None if v is None else 1e3 * v)


def render(raw: dict[str, Any], header: list[str]) -> str:
    f, md = common.fmt, common.markdown_table
    parts = [*header, ""]
    base = raw.get("in_process")
    rows = []
    for c in raw["configs"]:
        if "offline" in c:
            o = c["offline"]
            vs = common.ratio(o["output_tok_s"], base["output_tok_s"]) if base else "-"
            rows.append(
                [
                    c["key"],
                    c["label"],
                    str(o["num_requests"]),
                    f(o["output_tok_s"]),
                    f(o["total_tok_s"]),
                    f(o["wall_s"], 2),
                    vs,
                ]
            )
    if base:
        rows.append(
            [
                "-",
                "in-process AsyncEngine (no gateway)",
                str(base["num_requests"]),
                f(base["output_tok_s"]),
                f(base["total_tok_s"]),
                f(base["wall_s"], 2),
                "1.00",
            ]
        )
    if rows:
        parts += [
            "Offline W1 (all requests at t = 0):",
            "",
            md(
                [
                    "config",
                    "deployment",
                    "requests",
                    "output tok/s",
                    "total tok/s",
                    "wall s",
                    "vs in-process",
                ],
                rows,
            ),
            "",
        ]
    a = next((c["online"] for c in raw["configs"] if c["key"] == "a" and "online" in c), None)
    rows = []
    for c in raw["configs"]:
        if "online" in c:
            o = c["online"]
            rows.append(
                [
                    c["key"],
                    c["label"],
                    f(o["rate_req_s"], 2),
                    str(o["num_requests"]),
                    f(o["output_tok_s"]),
                    _ms(o["ttft_p50_s"]),
                    _ms(o["ttft_p99_s"]),
                    _ms(o["tpot_p50_s"]),
                    _ms(o["tpot_p99_s"]),
                    common.ratio(o["output_tok_s"], a["output_tok_s"]) if a else "-",
                    common.ratio(o["tpot_p99_s"], a["tpot_p99_s"]) if a else "-",
                ]
            )
    if rows:
        parts += [
            f"Online (Poisson arrivals, {raw['rate_req_s']:.2f} req/s: {raw['rate_source']}):",
            "",
            md(
                [
                    "config",
                    "deployment",
                    "rate req/s",
                    "requests",
                    "output tok/s",
                    "TTFT p50 ms",
                    "TTFT p99 ms",
                    "TPOT p50 ms",
                    "TPOT p99 ms",
                    "tok/s vs a",
                    "TPOT p99 vs a",
                ],
                rows,
            ),
            "",
        ]
    if raw["bandwidth"]:
        rows = [
            [
                b["kind"],
                str(b["tokens_per_job"]),
                f(b["bytes_per_job"] / 1e6, 2),
                str(b["jobs"]),
                f(b["transport_gbps"], 2),
                f(b["verified_gbps"], 2),
                f(b["memcpy_gbps"], 2),
                f(b["ratio"], 2),
            ]
            for b in raw["bandwidth"]
        ]
        parts += [
            f"KV transfer (SmolLM2 KV layout, random block ids, {raw['bw_threads']}"
            " torch thread(s), best of rounds; memcpy: the same bytes, same run):",
            "",
            md(
                [
                    "transport",
                    "tokens/job",
                    "MB/job",
                    "jobs",
                    "transport GB/s",
                    "verified GB/s",
                    "memcpy GB/s",
                    "transport/memcpy",
                ],
                rows,
            ),
            "",
            f"A 256 MiB memcpy (beyond the caches) ran at {raw['memcpy_large_gbps']:.2f} GB/s.",
            "",
        ]
    if raw["output_agreement"]:
        parts += [raw["output_agreement"], ""]
    parts += ["Targets:", ""]
    parts += [
        f"- {'PASS' if t['passed'] else 'FAIL'} {t['name']}: {t['value']} (target {t['bound']})"
        for t in raw["targets"]
    ]
    return "\n".join(parts) + "\n"


def settings_notes(opts: Options) -> list[str]:
    return [
        f"Engine settings everywhere: dtype {opts.dtype}, kv_cache_bytes {opts.kv_cache_bytes},"
        f" max_model_len {opts.max_model_len}, other EngineConfig defaults; one compute thread"
        " per pinned core. The gateway and this client are not pinned.",
        "Timed: generation only; cluster start-up, model load and one warm-up request are not.",
        "TTFT = first token - scheduled arrival; TPOT = (last - first token) / (n - 1) per"
        " request; online tok/s = output tokens / (first arrival to last token).",
        f"Online requests: the first {opts.online_limit} W1 requests, with the first prompt id"
        " changed so that the offline pass's prefix cache cannot match them.",
        "In-process: `benchmarks.baton_w1` child, AsyncEngine with the same settings and all"
        " requests submitted at once.",
    ]


# -- command line ---------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.serving",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m", help="bundled name, .gguf or HF dir")
    p.add_argument("--workload", type=Path, default=common.DEFAULT_WORKLOAD)
    p.add_argument("--limit", type=int, default=None, help="only the first N W1 requests")
    p.add_argument("--online-limit", type=int, default=32, help="requests in the online phase")
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        help="online arrivals per second (default: --load-fraction of config a's"
        " offline throughput in this run)",
    )
    p.add_argument("--load-fraction", type=float, default=0.75)
    p.add_argument("--configs", default="a,b,c", help="any of a,b,c,d, in run order")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--skip-online", action="store_true")
    p.add_argument("--skip-baseline", action="store_true", help="no in-process run")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--bw-kinds", default="shm,gloo", help="transports to measure; '' skips")
    p.add_argument("--bw-blocks-per-job", type=int, default=16, help="16 blocks: 256 tokens")
    p.add_argument("--bw-repeats", type=int, default=20)
    p.add_argument("--bw-rounds", type=int, default=3)
    p.add_argument(
        "--bw-threads",
        type=int,
        default=1,
        help="torch threads of transport and memcpy alike (a transfer thread is one)",
    )
    p.add_argument("--seed", type=int, default=0, help="of the Poisson arrivals")
    p.add_argument("--request-timeout", type=float, default=900.0)
    p.add_argument("--results-dir", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--no-plots", action="store_true")
    return p


def _options(a: argparse.Namespace) -> Options:
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    known = serving_configs(list(cpus))
    configs = tuple(k.strip() for k in a.configs.split(",") if k.strip())
    for k in configs:
        if k not in known:
            raise ValueError(
                f"--configs entry {k!r} is not one of {sorted(known)} on {len(cpus)} CPU(s)"
            )
    if not configs or len(set(configs)) != len(configs):
        raise ValueError(f"--configs must name distinct configurations, got {a.configs!r}")
    if "a" in configs and configs[0] != "a":
        configs = ("a", *(k for k in configs if k != "a"))  # a sets the rate and the baseline
    for name in ("limit", "online_limit"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.rate is not None and a.rate <= 0:
        raise ValueError(f"--rate must be > 0, got {a.rate}")
    if not 0 < a.load_fraction <= 1:
        raise ValueError(f"--load-fraction must be in (0, 1], got {a.load_fraction}")
    if not a.skip_online and a.rate is None and (a.skip_offline or "a" not in configs):
        raise ValueError(
            "the online rate comes from config a's offline run; give --rate"
            " when a is not run or --skip-offline is set"
        )
    kinds = tuple(k.strip() for k in a.bw_kinds.split(",") if k.strip())
    for k in kinds:
        if k not in ("shm", "gloo"):
            raise ValueError(f"--bw-kinds entry {k!r} is not one of shm, gloo")
    if min(a.bw_blocks_per_job, a.bw_repeats, a.bw_rounds, a.bw_threads) < 1:
        raise ValueError(
            "--bw-blocks-per-job, --bw-repeats, --bw-rounds and --bw-threads must be >= 1"
        )
    from engine.model_files import resolve_model

    online_limit = min(a.online_limit, a.limit) if a.limit else a.online_limit
    return Options(
        model_dir=resolve_model(a.model).path,
        workload=a.workload,
        limit=a.limit,
        online_limit=online_limit,
        rate_req_s=a.rate,
        load_fraction=a.load_fraction,
        configs=configs,
        skip_offline=a.skip_offline,
        skip_online=a.skip_online,
        skip_baseline=a.skip_baseline,
        dtype=a.dtype,
        cpus=cpus,
        kv_cache_bytes=a.kv_cache_bytes,
        max_model_len=a.max_model_len,
        bw_kinds=kinds,
        bw_blocks_per_job=a.bw_blocks_per_job,
        bw_repeats=a.bw_repeats,
        bw_rounds=a.bw_rounds,
        bw_threads=a.bw_threads,
        seed=a.seed,
        request_timeout_s=a.request_timeout,
        results_dir=a.results_dir,
        plots=not a.no_plots,
    )


def main(argv: list[str] | None = None) -> Path:
    """Run the benchmark; return the markdown file written."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    opts = _options(_parser().parse_args(argv))
    load_before, started = os.getloadavg(), time.monotonic()
    raw = run_all(opts)
    load_after, now = os.getloadavg(), dt.datetime.now()
    command = " ".join(sys.argv[1:] if argv is None else argv)
    header = [
        f"# Serving benchmark, {now:%Y-%m-%d %H:%M}",
        "",
        f"Command: `python -m benchmarks.serving {command}`  ",
        f"Model: {opts.model_dir.name}, {opts.dtype}; {len(opts.cpus)} CPUs {list(opts.cpus)};"
        f" load average {load_before[0]:.2f} before, {load_after[0]:.2f} after;"
        f" {time.monotonic() - started:.0f} s in all.",
        "",
        *[f"- {n}" for n in settings_notes(opts)],
    ]
    text = render(raw, header)
    raw.update(
        date=now.isoformat(timespec="seconds"),
        command=command,
        load_average=[load_before[0], load_after[0]],
        options={k: str(v) for k, v in asdict(opts).items()},
    )
    opts.results_dir.mkdir(parents=True, exist_ok=True)
    # Quick runs get their own names so they never overwrite a full run's files.
    stem = f"serving_{now:%Y-%m-%d}" + (f"_limit{opts.limit}" if opts.limit else "")
    md = opts.results_dir / f"{stem}.md"
    # The tables first: a plot that fails (no matplotlib) must not cost the run's figures.
    (opts.results_dir / f"{stem}.json").write_text(json.dumps(raw, indent=2) + "\n")
    md.write_text(text)
    if opts.plots:
        from benchmarks.serving_plots import write_plots

        drawn = draw_or_explain(
            lambda: write_plots(raw, opts.results_dir / stem), f"the tables are in {md}"
        )
        if drawn:
            text += "\nPlots: " + ", ".join(f"`{p.name}`" for p in drawn) + "\n"
            md.write_text(text)
    print(text, flush=True)
    print(f"wrote {md} and {md.with_suffix('.json')}")
    return md


if __name__ == "__main__":
    common.stop_on_sigterm()
    main()
