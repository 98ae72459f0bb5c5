"""Peer: HF transformers ``generate`` over static batches, run as one child process.

Owns the HF side of W1: batches of ``hf_batch_size`` requests in workload order, left
padded, greedy. ``generate`` cannot give each row its own length, so a batch generates the
longest ``output_len`` of its members; only each request's own ``output_len`` counts as
useful output. EOS is not a stop token here, matching the others' ``ignore_eos``.

Run by the harness as ``python -m benchmarks.peers.hf_static --spec JSON --out PATH``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.streamers import BaseStreamer

from benchmarks.common import (
    SINGLE_STREAM_SEED,
    WARMUP_NEW_TOKENS,
    RunResult,
    RunSpec,
    W1Request,
    fixed_prompt,
    load_workload,
    outputs_digest,
    self_peak_rss_bytes,
    warmup_prompt,
    write_result,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class _TokenClock(BaseStreamer):
    """Timestamps each token ``generate`` emits; the first ``put`` is the prompt."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value: Any) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _greedy_config(model: Any, new_tokens: int) -> GenerationConfig:
    # eos_token_id=None: no stop token, so every row runs its full length without the
    # logit masking that min_new_tokens would add.
    pad = model.config.pad_token_id
    if pad is None:
        pad = model.generation_config.pad_token_id or 0
    return GenerationConfig(
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=pad,
    )


def _generate_batch(
    model: Any, prompts: list[list[int]], new_tokens: int, streamer: BaseStreamer | None = None
) -> torch.Tensor:
    """Left-padded greedy generation; returns the new ids, [len(prompts), new_tokens]."""
    width = max(len(p) for p in prompts)
    pad = 0
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        generation_config=_greedy_config(model, new_tokens),
        streamer=streamer,
    )
    return out[:, width:]


def run_w1(model: Any, requests: list[W1Request], batch_size: int) -> tuple[float, int, dict]:
    """Wall seconds, generated tokens and each request's useful output ids."""
    outputs: dict[str, list[int]] = {}
    generated = 0
    t0 = time.perf_counter()
    for start in range(0, len(requests), batch_size):
        batch = requests[start : start + batch_size]
        new = max(r.output_len for r in batch)
        ids = _generate_batch(model, [r.prompt_token_ids for r in batch], new)
        if ids.shape[1] != new:
            raise RuntimeError(f"HF generated {ids.shape[1]} tokens per row, asked for {new}")
        generated += ids.numel()
        for row, r in enumerate(batch):
            outputs[r.request_id] = ids[row, : r.output_len].tolist()
    return time.perf_counter() - t0, generated, outputs


def single_stream_decode_tok_s(model: Any, prompt_len: int, new_tokens: int) -> float:
    """Decode tokens/s of one sequence, first token to last (the prefill is excluded)."""
    clock = _TokenClock()
    _generate_batch(model, [fixed_prompt(SINGLE_STREAM_SEED, prompt_len)], new_tokens, clock)
    if len(clock.times) != new_tokens:
        raise RuntimeError(f"streamer saw {len(clock.times)} tokens, expected {new_tokens}")
    return (new_tokens - 1) / (clock.times[-1] - clock.times[0])


def run(spec: RunSpec) -> RunResult:
    torch.set_num_threads(spec.threads)
    requests = load_workload(Path(spec.workload), spec.limit)
    model = AutoModelForCausalLM.from_pretrained(spec.model_dir, dtype=DTYPES[spec.dtype]).eval()
    with torch.inference_mode():
        _generate_batch(model, [warmup_prompt()], WARMUP_NEW_TOKENS)
        wall, generated, outputs = run_w1(model, requests, spec.hf_batch_size)
        single = None
        if spec.single_new_tokens > 1:
            single = single_stream_decode_tok_s(
                model, spec.single_prompt_len, spec.single_new_tokens
            )
    return RunResult(
        engine="hf",
        mode=f"static batch {spec.hf_batch_size}",
        dtype=spec.dtype,
        num_requests=len(requests),
        prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
        output_tokens=sum(r.output_len for r in requests),
        wall_s=wall,
        generated_tokens=generated,
        single_decode_tok_s=single,
        self_peak_rss_bytes=self_peak_rss_bytes(),
        outputs_digest=outputs_digest(outputs),
        extra={"attn_implementation": getattr(model.config, "_attn_implementation", None)},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="a RunSpec as JSON")
    parser.add_argument("--out", required=True, help="where to write the RunResult JSON")
    args = parser.parse_args()
    write_result(args.out, run(RunSpec.from_json(args.spec)))


if __name__ == "__main__":
    main()
