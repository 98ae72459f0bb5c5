"""The measured half of the GPU check: greedy parity with HF on the device, a decode step
against the memory-bandwidth floor, and W1 offline throughput against HF ``generate``.

``benchmarks/gpu_check.sh`` runs it after the gpu-marked tests and puts its markdown in
the report; on its own:

    python -m benchmarks.gpu_check --model smollm2-135m [--device cuda:0]
        [--sections parity,decode,w1] [--out part.md] [--json raw.json]

Each section is timed and fails on its own (its error goes in the report, the others
still run). ``--device cpu`` runs the same code on the CPU, which is how CI smoke-tests
it on a tiny model; figures from such a run say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks import common

# A divergence from HF is a tie only where HF's two best logits are this close: fp32 as
# tests/engine_helpers.TIE_MARGIN (summation order), bf16 as tests/test_bf16_logits'
# CLEAR_MARGIN (closer calls may go either way in bf16).
TIE_MARGINS = {"float32": 1e-3, "bfloat16": 1.0, "float16": 1.0}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
W1_SEED = 0  # benchmarks/common.DEFAULT_WORKLOAD's generator, for machines without the file


def w1_requests(limit: int | None = None) -> list[common.W1Request]:
    """W1 from its file, or regenerated from its stated generator where the file is absent
    (the GPU machine has no shared/ folder); tests/test_gpu_check_smoke checks both agree."""
    if common.DEFAULT_WORKLOAD.is_file():
        return common.load_workload(common.DEFAULT_WORKLOAD, limit)
    rng = random.Random(W1_SEED)
    out = []
    for i in range(64):
        p = rng.randint(32, 512)
        o = rng.randint(16, 256)
        ids = [rng.randrange(1000, 40000) for _ in range(p)]
        out.append(common.W1Request(f"w1-{i}", ids, o))
    return out[:limit] if limit else out


def _engine(model_dir: Path, device: str, dtype: str, **overrides: Any):  # noqa: ANN202
    from engine.config import EngineConfig
    from engine.engine_core import EngineCore

    return EngineCore(EngineConfig(model=str(model_dir), dtype=dtype, device=device,
                                   **overrides), show_progress=False)  # fmt: skip


def _greedy(n: int):  # noqa: ANN202
    from engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _hf(model_dir: Path, device: str, dtype: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).to(device).eval()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _release(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


@torch.inference_mode()
def _hf_generate(
    model: Any, prompts: list[list[int]], new_tokens: int, want_logits: bool = False
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy, left-padded, no stop token; new ids per prompt (and each step's raw
    logits when asked)."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    pad = model.config.pad_token_id
    config = GenerationConfig(
        do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        eos_token_id=None, pad_token_id=0 if pad is None else pad,
        output_logits=want_logits, return_dict_in_generate=True,
    )  # fmt: skip
    out = model.generate(
        input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config
    )
    new = out.sequences[:, width:].tolist()
    logits = []
    if want_logits:
        steps = torch.stack([s.float().cpu() for s in out.logits], dim=1)  # [B, T, V]
        logits = list(steps)
    return new, logits


def compare_greedy(
    ours: list[int], ref: list[int], ref_logits: torch.Tensor, margin: float
) -> tuple[str, int | None]:
    """('equal' | 'tie' | 'mismatch', first divergence or None); the tests' rule."""
    for i, (a, b) in enumerate(zip(ours, ref, strict=False)):
        if a != b:
            top2 = ref_logits[i].topk(2).values
            tie = float(top2[0] - top2[1]) <= margin and float(top2[0] - ref_logits[i][a]) <= margin
            return ("tie" if tie else "mismatch"), i
    return ("equal" if len(ours) == len(ref) else "mismatch"), None


# -- sections ------------------------------------------------------------------------------


@dataclass
class Section:
    name: str
    markdown: str = ""
    raw: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None


def parity(
    model_dir: Path,
    device: str,
    dtypes: tuple[str, ...],
    num_prompts: int = 16,
    new_tokens: int = 32,
) -> Section:
    """Each prompt alone through HF on the device vs all of them batched through baton."""
    prompts = [common.fixed_prompt(100 + i, 8 + (i * 37) % 200) for i in range(num_prompts)]
    rows, raw = [], {}
    for dtype in dtypes:
        hf = _hf(model_dir, device, dtype)
        ref = [_hf_generate(hf, [p], new_tokens, want_logits=True) for p in prompts]
        del hf
        _release(device)
        core = _engine(model_dir, device, dtype, num_blocks=1024, max_num_seqs=num_prompts)
        ours = core.generate(prompts, _greedy(new_tokens))
        del core
        _release(device)
        margin = TIE_MARGINS[dtype]
        verdicts = [
            compare_greedy(o, r[0][0], r[1][0], margin) for o, r in zip(ours, ref, strict=True)
        ]
        counts = {v: sum(1 for k, _ in verdicts if k == v) for v in ("equal", "tie", "mismatch")}
        firsts = [i for _, i in verdicts if i is not None]
        rows.append(
            [
                dtype,
                str(num_prompts),
                str(new_tokens),
                str(counts["equal"]),
                str(counts["tie"]),
                str(counts["mismatch"]),
                str(min(firsts)) if firsts else "-",
                f"{margin:g}",
            ]
        )
        raw[dtype] = {"verdicts": verdicts, "ours": ours, "hf": [r[0][0] for r in ref]}
    table = common.markdown_table(
        (
            "dtype",
            "prompts",
            "new tokens",
            "equal",
            "tie",
            "mismatch",
            "first divergence",
            "tie margin (logits)",
        ),
        rows,
    )
    note = (
        "HF `generate` one prompt at a time on the device (no padding); baton all of "
        "them at once (continuous batching; on a GPU, decode steps replay CUDA graphs). "
        "A divergence is a tie only where HF's top two logits are within the margin and "
        "baton's token is within it of HF's best."
    )
    return Section("parity", f"{table}\n\n{note}\n", raw)


def device_bandwidth(device: str, mib: int = 1024, repeats: int = 10) -> float:
    """Bytes read plus written per second by a large device-to-device copy (best of N)."""
    if not device.startswith("cuda"):
        return 2 * common.memcpy_bytes_per_s(min(mib, 256), torch.get_num_threads())
    src = torch.ones(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / best


def decode_step(
    model_dir: Path,
    device: str,
    dtype: str,
    batches: tuple[int, ...] = (1, 16, 64),
    context: int = 512,
    steps: int = 24,
    bandwidth_mib: int = 1024,
) -> Section:
    """Host wall time of decode-only steps of B rows at about ``context`` tokens each,
    against the time to read every weight and every row's KV once at the measured rate."""
    bandwidth = device_bandwidth(device, bandwidth_mib)
    core = _engine(model_dir, device, dtype, max_num_seqs=max(batches),
                   max_model_len=context + steps + 8, num_blocks=max(batches) * (
                       (context + steps + 8) // 16 + 2))  # fmt: skip
    core.generate([common.fixed_prompt(common.WARMUP_SEED, min(context, 64))], _greedy(4))
    mc = core.model_config
    weight_bytes = sum(p.numel() * p.element_size() for p in core.runner.model.parameters())
    kv_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * DTYPES[dtype].itemsize
    rows, raw = [], {"bandwidth_bytes_per_s": bandwidth, "weight_bytes": weight_bytes}
    for b in batches:
        for i in range(b):
            prompt = common.fixed_prompt(1000 * b + i, context)
            core.add_request(core.make_request(f"d{b}-{i}", prompt, _greedy(steps)))
        times, contexts = [], []
        while core.has_work():
            sched = core.scheduler.schedule()
            decode_only = len(sched.seqs) == b and all(s.num_new == 1 for s in sched.seqs)
            _sync(device)
            t0 = time.perf_counter()
            sampled = core.runner.execute(sched)
            elapsed = time.perf_counter() - t0
            if decode_only:
                times.append(elapsed)
                contexts.append(statistics.mean(s.start + 1 for s in sched.seqs))
            core.update(sched, sampled)
        step_s = statistics.median(times)
        floor_s = (weight_bytes + b * statistics.mean(contexts) * kv_per_token) / bandwidth
        rows.append(
            [
                str(b),
                f"{statistics.mean(contexts):.0f}",
                f"{step_s * 1e3:.3f}",
                f"{floor_s * 1e3:.3f}",
                f"{100 * floor_s / step_s:.0f}%",
                f"{b / step_s:.0f}",
            ]
        )
        raw[f"batch_{b}"] = {"step_s": times, "floor_s": floor_s}
    graphs = getattr(core.runner, "graphs", None)
    table = common.markdown_table(
        ("batch", "context", "ms/step (median)", "floor ms", "floor / step", "decode tok/s"), rows
    )
    note = (
        f"{dtype}; floor = (weight bytes {weight_bytes / 2**20:.0f} MiB + batch x context x "
        f"{kv_per_token} B of KV) / {bandwidth / 1e9:.0f} GB/s, the copy rate measured here "
        "(bytes read + written; device to device on a GPU). ms/step: host wall clock of "
        "`ModelRunner.execute` on decode-only steps (upload, "
        f"{'CUDA-graph replay' if graphs is not None else 'eager forward'}, sampling, "
        f"token read-back), median of {steps - 1} steps or fewer."
    )
    return Section("decode", f"{table}\n\n{note}\n", raw)


def w1(
    model_dir: Path,
    device: str,
    dtypes: tuple[str, ...],
    hf_batches: tuple[int, ...] = (16, 64),
    limit: int | None = None,
    max_output: int | None = None,
) -> Section:
    """W1 offline (greedy, ignore EOS): baton's engine loop against HF static batches."""
    requests = w1_requests(limit)
    if max_output:
        requests = [
            common.W1Request(r.request_id, r.prompt_token_ids, min(r.output_len, max_output))
            for r in requests
        ]
    prompt_toks = sum(len(r.prompt_token_ids) for r in requests)
    output_toks = sum(r.output_len for r in requests)
    rows, raw = [], {}
    for dtype in dtypes:
        core = _engine(
            model_dir,
            device,
            dtype,
            kv_cache_bytes=4 << 30,
            max_model_len=1024,
            max_num_seqs=len(requests),
        )
        core.generate([common.warmup_prompt()], _greedy(common.WARMUP_NEW_TOKENS))
        _sync(device)
        outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
        t0 = time.perf_counter()
        for r in requests:
            core.add_request(
                core.make_request(r.request_id, r.prompt_token_ids, _greedy(r.output_len))
            )
        while core.has_work():
            for out in core.step():
                outputs[out.request_id].extend(out.new_token_ids)
        _sync(device)
        baton_s = time.perf_counter() - t0
        common.check_output_lengths(requests, outputs)
        del core
        _release(device)
        rows.append(
            [
                "baton",
                dtype,
                f"{output_toks / baton_s:.0f}",
                f"{(prompt_toks + output_toks) / baton_s:.0f}",
                f"{baton_s:.2f}",
                "1.00",
            ]
        )
        raw[f"baton-{dtype}"] = {"wall_s": baton_s, "digest": common.outputs_digest(outputs)}
        hf = _hf(model_dir, device, dtype)
        _hf_generate(hf, [common.warmup_prompt()], common.WARMUP_NEW_TOKENS)
        for bs in hf_batches:
            _sync(device)
            t0 = time.perf_counter()
            same = 0
            for start in range(0, len(requests), bs):
                batch = requests[start : start + bs]
                new, _ = _hf_generate(
                    hf, [r.prompt_token_ids for r in batch], max(r.output_len for r in batch)
                )
                same += sum(
                    n[: r.output_len] == outputs[r.request_id]
                    for n, r in zip(new, batch, strict=True)
                )
            _sync(device)
            hf_s = time.perf_counter() - t0
            rows.append(
                [
                    f"HF generate, static batches of {bs}",
                    dtype,
                    f"{output_toks / hf_s:.0f}",
                    f"{(prompt_toks + output_toks) / hf_s:.0f}",
                    f"{hf_s:.2f}",
                    f"{hf_s / baton_s:.2f}",
                ]
            )
            raw[f"hf{bs}-{dtype}"] = {"wall_s": hf_s, "same_as_baton": same}
        del hf
        _release(device)
    table = common.markdown_table(
        ("engine", "dtype", "output tok/s", "total tok/s", "wall s", "baton speed-up"), rows
    )
    note = (
        f"{len(requests)} requests, {prompt_toks} prompt and {output_toks} output tokens; "
        "wall excludes model load and one warm-up request. HF batches generate their "
        "longest output_len; only each request's own output counts. Requests whose "
        "HF output equals baton's: "
        + ", ".join(f"{k}: {v['same_as_baton']}" for k, v in raw.items() if k.startswith("hf"))
    )
    return Section("w1", f"{table}\n\n{note}\n", raw)


# -- the command ---------------------------------------------------------------------------


def run_sections(
    names: list[str], model_dir: Path, device: str, dtypes: tuple[str, ...]
) -> list[Section]:
    plan: dict[str, Callable[[], Section]] = {
        "parity": lambda: parity(model_dir, device, dtypes),
        "decode": lambda: decode_step(
            model_dir, device, "bfloat16" if "bfloat16" in dtypes else dtypes[0]
        ),
        "w1": lambda: w1(model_dir, device, dtypes),
    }
    done = []
    for name in names:
        t0 = time.perf_counter()
        try:
            section = plan[name]()
        except Exception as exc:  # noqa: BLE001 - reported, and the next section runs
            section = Section(name, error=f"{exc!r}\n{traceback.format_exc(limit=8)}")
        section.seconds = time.perf_counter() - t0
        done.append(section)
        _release(device)
    return done


def render(sections: list[Section], device: str) -> str:
    titles = {
        "parity": "Greedy parity with HF on the device",
        "decode": "Decode step against the memory-bandwidth floor",
        "w1": "W1 offline throughput against HF `generate`",
    }
    parts = []
    for s in sections:
        body = s.markdown if s.error is None else f"FAILED:\n\n```\n{s.error}\n```\n"
        parts.append(f"### {titles[s.name]} ({device}, {s.seconds:.0f} s)\n\n{body}")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__)
    p.add_argument("--model", default="smollm2-135m", help="bundled name, .gguf or HF dir")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--sections", default="parity,decode,w1")
    p.add_argument("--out", type=Path, help="write the markdown here too")
    p.add_argument("--json", type=Path, help="write the raw figures here")
    args = p.parse_args(argv)
    from engine.model_files import resolve_model

    names = [n.strip() for n in args.sections.split(",") if n.strip()]
    unknown = set(names) - {"parity", "decode", "w1"}
    if unknown:
        raise ValueError(f"--sections has {sorted(unknown)}; allowed: parity, decode, w1")
    dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
    model_dir = resolve_model(args.model).path
    sections = run_sections(names, model_dir, args.device, dtypes)
    text = render(sections, args.device)
    print(text, flush=True)
    if args.out:
        args.out.write_text(text)
    if args.json:
        args.json.write_text(json.dumps([asdict(s) for s in sections], indent=1, default=str))
    return 0 if all(s.error is None for s in sections) else 1


if __name__ == "__main__":
    sys.exit(main())
