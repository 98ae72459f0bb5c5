"""Native forward vs HF transformers on tiny random checkpoints (fp32)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.sampling_params import SamplingParams
from tests.engine_helpers import compare_greedy, hf_greedy, hf_greedy_many, hf_model, make_core
from tests.factories import make_tiny_model_dir


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(1, 90))] for _ in range(n)]


@torch.inference_mode()
def test_prefill_logits_match_hf_within_1e4(tiny_llama: Path) -> None:
    core = make_core(tiny_llama, max_num_batched_tokens=1024)
    hf = hf_model(tiny_llama)
    prompts = _prompts(6)
    for i, p in enumerate(prompts):
        core.add_request(core.make_request(f"r{i}", p, SamplingParams(max_tokens=1, temperature=0)))
    sched = core.scheduler.schedule()
    assert len(sched.seqs) == len(prompts), "all prompts in one mixed batch"
    ours = core.runner.forward_logits(sched)
    for i, p in enumerate(prompts):
        ref = hf(torch.tensor([p])).logits[0, -1].float()
        rel = (ours[i] - ref).abs().max() / ref.abs().max()
        assert rel < 1e-4, f"prompt {i} (len {len(p)}): relative error {rel:.2e}"


@torch.inference_mode()
def test_decode_logits_match_hf_within_1e4(tiny_llama: Path) -> None:
    """Logits of a mixed step (decodes and a chunk with cached context) match HF."""
    core = make_core(tiny_llama, max_num_batched_tokens=40)
    hf = hf_model(tiny_llama)
    prompts = _prompts(4, seed=1)
    for i, p in enumerate(prompts):
        core.add_request(core.make_request(f"r{i}", p, SamplingParams(max_tokens=8, temperature=0)))
    for _ in range(12):
        sched = core.scheduler.schedule()
        if sched.empty:
            break
        logits = core.runner.forward_logits(sched)
        row = 0
        for seq in sched.seqs:
            if not seq.sample:
                continue
            req = seq.request
            ids = req.all_token_ids[: seq.start + seq.num_new]
            ref = hf(torch.tensor([ids])).logits[0, -1].float()
            rel = (logits[row] - ref).abs().max() / ref.abs().max()
            assert rel < 1e-4, f"{req.request_id} at {len(ids)} tokens: relative error {rel:.2e}"
            row += 1
        from engine.scheduler import SampledToken

        toks = logits.argmax(-1).tolist()
        it = iter(toks)
        core.update(sched, [SampledToken(next(it)) if s.sample else None for s in sched.seqs])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_greedy_tokens_match_hf_for_each_arch(tmp_path: Path, arch: str) -> None:
    path = make_tiny_model_dir(tmp_path / arch, arch=arch, seed=3)
    core = make_core(path, max_num_batched_tokens=64)
    hf = hf_model(path)
    prompts = _prompts(5, seed=2)
    ours = core.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, ours, strict=True):
        ref, _ = hf_greedy(hf, p, 12)
        assert o == ref


@torch.inference_mode()
def test_batched_hf_reference_equals_each_prompt_run_alone(tiny_llama: Path) -> None:
    """The e2e tests' batched HF reference (left padding, a mask, explicit positions) gives
    what HF gives each prompt alone: the same tokens, logits within fp32 rounding."""
    hf = hf_model(tiny_llama)
    prompts = _prompts(11, seed=4)  # two batches, each padded to its longest prompt
    assert len({len(p) for p in prompts}) > 5
    many = hf_greedy_many(hf, prompts, 6)
    assert len(many) == len(prompts)
    for p, (tokens, logits) in zip(prompts, many, strict=True):
        ref, ref_logits = hf_greedy(hf, p, 6)
        assert compare_greedy(tokens, ref, ref_logits) == "equal"
        rel = (logits - ref_logits).abs().max() / ref_logits.abs().max()
        assert rel < 1e-4, f"prompt of {len(p)}: relative error {rel:.2e}"
