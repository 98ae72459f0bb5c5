"""Sliding-window attention (Mistral ``sliding_window``, Qwen2 ``use_sliding_window``)
against HF transformers on tiny random checkpoints whose window is shorter than the
prompts, through both attention backends (compiled CPU kernel and plain torch)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import ModelConfig
from engine.engine_core import EngineCore
from engine.kernels.cpu import cpu_kernels
from engine.layers.attention import PagedAttention
from engine.sampling_params import SamplingParams
from engine.scheduler import SampledToken
from tests.engine_helpers import hf_model, make_core
from tests.factories import make_tiny_model_dir

WINDOW = 8  # tokens; shorter than every prompt below and than one of two blocks

BACKENDS = ["torch"] + (["cpu-kernel"] if cpu_kernels() is not None else [])


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(20, 70))] for _ in range(n)]


def _use_backend(core: EngineCore, backend: str) -> None:
    for module in core.runner.model.modules():
        if isinstance(module, PagedAttention):
            module.use_kernel = backend == "cpu-kernel"


def _windowed(tmp_path: Path, arch: str) -> Path:
    overrides: dict[str, Any] = {"sliding_window": WINDOW}
    if arch == "qwen2":
        # Layer 0 full, layer 1 windowed: HF's max_window_layers rule.
        overrides.update(use_sliding_window=True, max_window_layers=1)
    return make_tiny_model_dir(tmp_path / arch, arch=arch, seed=5, **overrides)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
@torch.inference_mode()
def test_windowed_logits_match_hf_in_prefill_chunks_and_decode(
    tmp_path: Path, arch: str, backend: str
) -> None:
    path = _windowed(tmp_path, arch)
    # A 24-token budget splits the prompts into chunks that follow cached context.
    core = make_core(path, max_num_batched_tokens=24, block_size=8)
    expected = (WINDOW, WINDOW) if arch == "mistral" else (0, WINDOW)
    assert core.model_config.sliding_windows == expected
    _use_backend(core, backend)
    hf = hf_model(path)
    prompts = _prompts(3, seed=7)
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        core.add_request(core.make_request(f"r{i}", p, params))
    checked = 0
    while core.has_work():
        sched = core.scheduler.schedule()
        logits = core.runner.forward_logits(sched)
        rows = iter(range(logits.shape[0]))
        sampled: list[SampledToken | None] = []
        for seq in sched.seqs:
            if not seq.sample:
                sampled.append(None)
                continue
            row = next(rows)
            ids = seq.request.all_token_ids[: seq.start + seq.num_new]
            ref = hf(torch.tensor([ids])).logits[0, -1].float()
            rel = (logits[row] - ref).abs().max() / ref.abs().max()
            assert rel < 1e-4, f"{seq.request.request_id} at {len(ids)} tokens: rel {rel:.2e}"
            checked += 1
            sampled.append(SampledToken(int(ref.argmax())))
        core.update(sched, sampled)
    assert checked == 3 * 10


@torch.inference_mode()
def test_window_changes_the_output(tmp_path: Path) -> None:
    """The window is really applied: full attention on the same weights differs."""
    windowed = make_core(_windowed(tmp_path, "mistral"))
    full = make_core(
        make_tiny_model_dir(tmp_path / "full", arch="mistral", seed=5, sliding_window=None)
    )
    prompt = _prompts(1, seed=9)
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=0)
    windowed.add_request(windowed.make_request("a", prompt[0], params))
    full.add_request(full.make_request("a", prompt[0], params))
    a = windowed.runner.forward_logits(windowed.scheduler.schedule())
    b = full.runner.forward_logits(full.scheduler.schedule())
    assert (a - b).abs().max() > 1e-3


def _hf(**extra: Any) -> dict[str, Any]:
    base = {
        "model_type": "mistral",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
    }
    base.update(extra)
    return base


def test_config_reads_windows_per_layer() -> None:
    assert ModelConfig.from_hf(_hf(sliding_window=4)).sliding_windows == (4, 4, 4)
    assert ModelConfig.from_hf(_hf(sliding_window=None)).sliding_windows == ()
    qwen = _hf(model_type="qwen2", sliding_window=4, max_window_layers=2)
    assert ModelConfig.from_hf(qwen).sliding_windows == ()  # use_sliding_window is off
    qwen["use_sliding_window"] = True
    assert ModelConfig.from_hf(qwen).sliding_windows == (0, 0, 4)
    typed = _hf(
        sliding_window=6, layer_types=["sliding_attention", "full_attention", "sliding_attention"]
    )
    assert ModelConfig.from_hf(typed).sliding_windows == (6, 0, 6)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"sliding_window": 0}, "sliding_window must be a positive integer"),
        ({"sliding_window": "4"}, "sliding_window must be a positive integer"),
        ({"sliding_window": None, "layer_types": ["sliding_attention"] * 3}, "is not set"),
        ({"sliding_window": 4, "layer_types": ["chunked_attention"] * 3}, "layer_types[0]"),
        ({"sliding_window": 4, "layer_types": ["full_attention"]}, "one type per layer"),
    ],
)
def test_config_refuses_windows_it_cannot_run(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ModelConfig.from_hf(_hf(**extra))
