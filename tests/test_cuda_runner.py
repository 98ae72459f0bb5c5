"""The GPU model runner without a GPU: Triton attention under the interpreter and a fake
graph capture that replays its closure eagerly, against the plain-torch ModelRunner.

What this checks is the runner's own logic: bucket choice and padding of decode-only
steps, the static input layout, the one-buffer upload, packed prefill chunks mixed with
decode rows, and the eager fallback past the largest bucket.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.cuda_graphs import DecodeGraphs, default_buckets
from engine.cuda_runner import CudaModelRunner
from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from tests.engine_helpers import make_core
from tests.factories import make_tiny_model_dir


class FakeGraph:
    def __init__(self, run: Callable[[], torch.Tensor]) -> None:
        self._run = run
        self.output = run()

    def replay(self) -> None:
        self.output.copy_(self._run())


class FakeCapture:
    """Records closures; a replay re-runs the closure and writes into the first output."""

    def __init__(self) -> None:
        self.captured = 0

    def capture(self, run: Callable[[], torch.Tensor]) -> FakeGraph:
        self.captured += 1
        return FakeGraph(run)


def gpu_core(model: Path, buckets: tuple[int, ...], **overrides: object) -> EngineCore:
    """An EngineCore whose runner is the GPU runner, on the CPU."""
    core = make_core(model, **overrides)
    capture = FakeCapture()
    core.runner = CudaModelRunner(
        core.cfg,
        core.model_config,
        core.files.path,
        num_blocks=core.pool.num_blocks,
        show_progress=False,
        capture=capture,
        buckets=buckets,
    )
    assert capture.captured == (0 if core.cfg.enforce_eager else len(buckets))
    return core


# Three short prompts fill most of the first step; the long one is chunked behind them,
# alongside their decodes; then decode-only steps of 4, 2 and 1 rows.
PROMPTS = [list(range(3, 3 + n)) for n in (5, 6, 3, 19)]
MAX_TOKENS = [6, 7, 5, 3]


def _step_logits(
    core: EngineCore, prompts: list[list[int]], max_tokens: list[int]
) -> list[torch.Tensor]:
    """The fp32 logits of every step of running ``prompts`` greedily to their lengths."""
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        core.add_request(core.make_request(f"r{i}", prompt, params))
    logits = []
    while core.has_work():
        sched = core.scheduler.schedule()
        logits.append(core.runner.forward_logits(sched))
        core.update(sched, core.runner.execute(sched))
    return logits


def assert_same_steps(got: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    assert len(got) == len(ref)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_default_buckets() -> None:
    assert default_buckets(1) == (1,)
    assert default_buckets(6) == (1, 2, 4, 6)
    assert default_buckets(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert default_buckets(40) == (1, 2, 4, 8, 16, 32, 40)


def test_bucket_for_picks_the_smallest_bucket_that_fits() -> None:
    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs.buckets = (1, 2, 4, 8)
    assert [graphs.bucket_for(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]


def test_graph_decode_and_packed_prefill_match_the_torch_runner(tiny_llama: Path) -> None:
    # A small token budget chunks the prompts, so steps mix prefill chunks (some after
    # cached context) with decode rows; the shrinking batch walks down the buckets.
    ref = _step_logits(make_core(tiny_llama, max_num_batched_tokens=16), PROMPTS, MAX_TOKENS)
    core = gpu_core(tiny_llama, (1, 2, 4), max_num_batched_tokens=16)
    assert_same_steps(_step_logits(core, PROMPTS, MAX_TOKENS), ref)
    runner = core.runner
    assert isinstance(runner, CudaModelRunner) and runner.graphs is not None
    # Decode-only steps of 4, 2 and 1 rows replayed buckets 4, 2 and 1.
    assert all(runner.graphs.replays[b] > 0 for b in (1, 2, 4)), runner.graphs.replays


def test_logits_of_padded_replays_equal_eager_ones(tiny_llama: Path) -> None:
    eager = gpu_core(tiny_llama, (4,), enforce_eager=True)
    graphed = gpu_core(tiny_llama, (4,))
    assert eager.runner.graphs is None  # type: ignore[attr-defined]
    steps = [_step_logits(core, PROMPTS[:2], [3, 3]) for core in (eager, graphed)]
    assert graphed.runner.graphs.replays[4] > 0  # type: ignore[attr-defined]
    assert_same_steps(*steps)


def test_batches_past_the_largest_bucket_run_eagerly(tiny_llama: Path) -> None:
    ref = _step_logits(make_core(tiny_llama), PROMPTS, MAX_TOKENS)
    core = gpu_core(tiny_llama, (1,))
    assert_same_steps(_step_logits(core, PROMPTS, MAX_TOKENS), ref)
    graphs = core.runner.graphs  # type: ignore[attr-defined]
    assert graphs.replays[1] > 0


def test_runner_without_triton_is_refused(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import engine.cuda_runner as cuda_runner

    monkeypatch.setattr(cuda_runner, "triton_attention_backend", lambda: None)
    core = make_core(tiny_llama)
    with pytest.raises(ValueError, match="needs Triton"):
        CudaModelRunner(core.cfg, core.model_config, core.files.path, num_blocks=8)


def test_sliding_window_layers_match_the_torch_runner(tmp_path: Path) -> None:
    # Qwen2 with HF's max_window_layers rule: layer 0 full, layer 1 sees 8 tokens, so
    # prompts and decodes outgrow the window in both the prefill and decode kernels.
    path = make_tiny_model_dir(
        tmp_path / "qwen2", arch="qwen2", seed=5, sliding_window=8, use_sliding_window=True,
        max_window_layers=1,
    )  # fmt: skip
    prompts = [list(range(3, 3 + n)) for n in (5, 19, 12)]
    lengths = [6, 6, 6]
    ref = _step_logits(make_core(path, max_num_batched_tokens=16, block_size=8), prompts, lengths)
    core = gpu_core(path, (1, 2, 4), max_num_batched_tokens=16, block_size=8)
    assert core.model_config.sliding_windows == (0, 8)
    assert_same_steps(_step_logits(core, prompts, lengths), ref)
