"""The engine on a real GPU: Triton attention, real CUDA graphs, the device sampler.
Marked ``gpu``; skipped without CUDA (``benchmarks/gpu_check.sh`` runs them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.cuda_runner import CudaModelRunner
from engine.device_sampler import DeviceSampler
from engine.sampler import Sampler, SamplingRow
from engine.sampling_params import SamplingParams
from tests.engine_helpers import compare_greedy, hf_greedy, hf_model, make_core

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PROMPTS = [list(range(5, 5 + n)) for n in (3, 17, 40, 9, 66)]
NEW = 10


def _greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_gpu_engine_is_greedy_equal_to_hf(tiny_llama: Path) -> None:
    core = make_core(tiny_llama, device="cuda:0", dtype="float32", max_num_batched_tokens=32)
    runner = core.runner
    assert isinstance(runner, CudaModelRunner) and runner.graphs is not None
    assert runner.kv_cache.device == torch.device("cuda", 0)
    outs = core.generate(PROMPTS, _greedy())
    hf = hf_model(tiny_llama)
    verdicts = [
        compare_greedy(o, *hf_greedy(hf, p, NEW)) for p, o in zip(PROMPTS, outs, strict=True)
    ]
    assert "mismatch" not in verdicts, verdicts
    assert sum(runner.graphs.replays.values()) > 0  # decode steps ran from graphs


def test_gpu_graph_replays_equal_eager_steps(tiny_llama: Path) -> None:
    logits = []
    for eager in (True, False):
        core = make_core(tiny_llama, device="cuda:0", enforce_eager=eager)
        for i, p in enumerate(PROMPTS[:3]):
            core.add_request(core.make_request(f"r{i}", p, _greedy(6)))
        steps = []
        while core.has_work():
            sched = core.scheduler.schedule()
            steps.append(core.runner.forward_logits(sched).cpu())
            core.update(sched, core.runner.execute(sched))
        logits.append(steps)
    for a, b in zip(*logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_half_precision_runs_graphs_and_builds_weights_in_dtype(
    tiny_llama: Path, dtype: str
) -> None:
    core = make_core(tiny_llama, device="cuda:0", dtype=dtype)
    params = list(core.runner.model.parameters())
    assert {p.dtype for p in params} == {getattr(torch, dtype)}
    assert {p.device for p in params} == {torch.device("cuda", 0)}
    outs = core.generate(PROMPTS, _greedy())
    assert [len(o) for o in outs] == [NEW] * len(PROMPTS)


def test_gpu_runner_on_the_second_gpu(tiny_llama: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    core = make_core(tiny_llama, device="cuda:1")
    assert core.runner.kv_cache.device == torch.device("cuda", 1)
    ref = make_core(tiny_llama, device="cuda:0").generate(PROMPTS, _greedy())
    assert core.generate(PROMPTS, _greedy()) == ref


def test_device_sampler_on_gpu_draws_what_sampler_draws() -> None:
    dev = torch.device("cuda", 0)
    logits = torch.randn((32, 1000), device=dev, generator=torch.Generator(dev).manual_seed(0))
    rows = [
        SamplingRow(SamplingParams(temperature=t, top_k=k, top_p=p), 0, frozenset({2}), None)
        for t, k, p in [(0.0, 0, 1.0), (0.7, 20, 1.0), (1.0, 0, 0.9), (1.2, 50, 0.8)] * 8
    ]
    assert DeviceSampler(dev, 3)(logits, rows) == Sampler(dev, 3)(logits, rows)
