"""A stand-in for ``vllm bench serve --backend openai`` where vLLM is not installed.

``benchmarks.serving_openai`` drives every server with vLLM's own load generator, which
neither project tuned for the other. Where vLLM's environment is absent (CI), this
module takes its place so that the harness and baton's leg still run for real: the same
flags (the subset the harness passes), the same Poisson arrivals of a custom JSONL
dataset (``{"prompt", "output_tokens"}`` per line, in order), streaming
``/v1/completions`` through the official ``openai`` client, and a result file with the
keys and definitions of vLLM's ``--save-result --save-detailed`` JSON:

- TTFT: request sent to the first chunk with a choice; ITL: the gaps between later
  chunks; TPOT per request: (latency - TTFT) / (output tokens - 1);
- throughput: completed requests, output tokens (from the usage chunk), and input plus
  output tokens, each over the benchmark's duration;
- ``p50_ttft_ms``, ``p99_itl_ms``, ... : linear-interpolated percentiles in milliseconds.

Figures from it are labelled as such in the harness's report, never compared with a
vLLM-client run.

    python -m benchmarks.openai_load --base-url URL --model NAME --dataset-path X.jsonl
        --num-prompts N --request-rate R --seed S --result-dir D --result-filename F
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLIENT_NAME = "benchmarks.openai_load (baton's stand-in for vllm bench serve)"
PERCENTILES = (50, 99)


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it."""

    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""

    @property
    def success(self) -> bool:
        return not self.error and self.ttft > 0


def percentile(values: list[float], q: float) -> float:
    """numpy's default (linear) percentile; 0 for no values, as vLLM reports it."""
    if not values:
        return 0.0
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Poisson arrival times (seconds from the start) of ``n`` requests; all at 0 for an
    infinite rate."""
    if rate == float("inf"):
        return [0.0] * n
    rng, at, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(at)
        at += rng.expovariate(rate)
    return out


async def _one(
    client: Any, model: str, row: dict[str, Any], args: argparse.Namespace, rid: str
) -> Outcome:
    out = Outcome()
    extra: dict[str, Any] = {"ignore_eos": True} if args.ignore_eos else {}
    started = time.perf_counter()
    last = started
    try:
        stream = await client.completions.create(
            model=model,
            prompt=row["prompt"],
            max_tokens=int(row["output_tokens"]),
            temperature=args.temperature,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
            extra_headers={"x-request-id": rid},
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices:
                if out.ttft == 0.0:
                    out.ttft = now - started
                else:
                    out.itl.append(now - last)
                last = now
            elif chunk.usage is not None:
                out.output_tokens = chunk.usage.completion_tokens
                out.prompt_len = chunk.usage.prompt_tokens
        out.latency = last - started
    except Exception as exc:  # counted as a failed request, as vLLM's client does
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import openai

    rows = [json.loads(line) for line in Path(args.dataset_path).read_text().splitlines() if line]
    rows = rows[: args.num_prompts]
    client = openai.AsyncOpenAI(
        base_url=args.base_url.rstrip("/") + "/v1", api_key="-", max_retries=0, timeout=3600
    )
    async with client:
        for i in range(args.num_warmups):
            await _one(client, args.model, rows[i % len(rows)], args, f"warmup-{i}")
        times = arrivals(len(rows), args.request_rate, args.seed)
        t0 = time.perf_counter()

        async def scheduled(i: int, row: dict[str, Any]) -> Outcome:
            await asyncio.sleep(max(0.0, t0 + times[i] - time.perf_counter()))
            return await _one(client, args.model, row, args, f"{args.request_id_prefix}{i}")

        outcomes = await asyncio.gather(*(scheduled(i, r) for i, r in enumerate(rows)))
        duration = time.perf_counter() - t0
    return summarize(list(outcomes), duration, args)


def summarize(outcomes: list[Outcome], duration: float, args: argparse.Namespace) -> dict:
    ok = [o for o in outcomes if o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    metrics = {
        "ttft": [o.ttft for o in ok],
        "tpot": [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1],
        "itl": [x for o in ok for x in o.itl],
        "e2el": [o.latency for o in ok],
    }
    result: dict[str, Any] = {
        "client": CLIENT_NAME,
        "backend": "openai",
        "model_id": args.model,
        "num_prompts": len(outcomes),
        "request_rate": args.request_rate,
        "burstiness": 1.0,
        "duration": duration,
        "completed": len(ok),
        "failed": len(outcomes) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "input_lens": [o.prompt_len for o in outcomes],
        "output_lens": [o.output_tokens for o in outcomes],
        "ttfts": [o.ttft for o in outcomes],
        "itls": [o.itl for o in outcomes],
        "errors": [o.error for o in outcomes],
    }
    for name, values in metrics.items():
        ms = [1e3 * v for v in values]
        result[f"mean_{name}_ms"] = sum(ms) / len(ms) if ms else 0.0
        result[f"median_{name}_ms"] = percentile(ms, 50)
        for q in PERCENTILES:
            result[f"p{q}_{name}_ms"] = percentile(ms, q)
    return result


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.openai_load",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--base-url", required=True, help="http://host:port (no /v1)")
    p.add_argument("--model", required=True, help="the served model's name")
    p.add_argument("--dataset-path", required=True, type=Path, help="JSONL: prompt, output_tokens")
    p.add_argument("--num-prompts", type=int, required=True)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="req/s; inf: all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-warmups", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--request-id-prefix", default="bench-")
    p.add_argument("--result-dir", type=Path, required=True)
    p.add_argument("--result-filename", required=True)
    return p


def main(argv: list[str] | None = None) -> Path:
    args = _parser().parse_args(argv)
    if args.num_prompts < 1 or args.request_rate <= 0:
        raise SystemExit("--num-prompts must be >= 1 and --request-rate > 0")
    result = asyncio.run(run(args))
    args.result_dir.mkdir(parents=True, exist_ok=True)
    path = args.result_dir / args.result_filename
    path.write_text(json.dumps(result))
    print(
        f"{result['completed']}/{result['num_prompts']} completed in {result['duration']:.1f} s;"
        f" {result['output_throughput']:.1f} output tok/s; wrote {path}"
    )
    return path


if __name__ == "__main__":
    main()
