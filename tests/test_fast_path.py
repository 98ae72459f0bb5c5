"""The model's CPU fast path (prepacked linear, GEMV, fused decoder layer) against its twin.

The engine runs the fast path by default, so the parity tests against HF
(``test_parity_*``) exercise it; these tests check that it really is what runs, that it
agrees with the plain-torch twin, and how far bf16 lands from the fp32 reference.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.kernels import ops
from engine.kernels.cpu import cpu_kernels
from engine.kernels.route_table import LAYER_CLASSES, LM_HEAD_CLASSES
from engine.models.llama import DecoderLayer, Linear
from engine.sampling_params import SamplingParams
from engine.scheduler import SampledToken
from tests.engine_helpers import make_core

# Max |bf16 - fp32| of a step's logits, relative to the largest fp32 logit, on the tiny
# random Llama (2 layers): measured 3-4e-3 on both paths. bf16 keeps 8 mantissa bits, and the
# errors of a few roundings add up; the fast path must stay as close as the twin does.
BF16_REL_TOL = 1e-2
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(5, 70))] for _ in range(n)]


def _step_logits(
    model_dir: Path, dtype: str, fast: bool, steps: int = 6, stack: bool = True
) -> list[torch.Tensor]:
    """Logits of the first ``steps`` steps of four prompts (a mixed prefill step, then
    decode-only steps), with the greedy tokens of an fp32 fast-path run fed back in, so
    every configuration sees the same inputs. ``stack=False``: decode steps call the fused
    kernel layer by layer instead of once for the whole stack."""
    core = make_core(model_dir, dtype=dtype, max_num_batched_tokens=512)
    core.runner.model.set_fast_path(fast)
    if not stack:
        core.runner.model.model.decode_stack = None
    for i, p in enumerate(_prompts(4, seed=3)):
        core.add_request(core.make_request(f"r{i}", p, GREEDY))
    out = []
    for _ in range(steps):
        sched = core.scheduler.schedule()
        logits = core.runner.forward_logits(sched)
        out.append(logits)
        # Deterministic stand-in tokens (not argmax), so bf16 and fp32 stay on one path.
        toks = [
            SampledToken(int(3 + (7919 * (k + 1) * sched.step_id) % 40000))
            for k in range(len(sched.seqs))
        ]
        core.runner._last_sampled = {
            s.request.request_id: t.token_id for s, t in zip(sched.seqs, toks, strict=True)
        }
        core.scheduler.update(sched, toks)
    return out


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_runs_the_fast_path_by_default(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    """In either dtype and on any ISA the kernels build for (bf16 decode steps ran on the
    Python path on a CPU without AVX512-BF16 until the stack served them too)."""
    core = make_core(tiny_llama, dtype=dtype)
    model = core.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.use_kernel for m in linears)
    table = core.runner.kernel_routes
    assert table is not None and all(m.routes is table for m in linears)
    # Every copy a route of the measured table runs on is there, and only those.
    for m in linears:
        classes = LM_HEAD_CLASSES if m.is_lm_head else LAYER_CLASSES
        if torch.backends.mkldnn.is_available():
            assert (m.packed is not None) == table.uses("onednn", classes)
        assert (m.panels is not None) == table.uses("panels", classes)
    assert (model.model.decode_stack is not None) == (cpu_kernels() is not None)
    if cpu_kernels() is not None and table.routes["decode"] == "panels":
        assert all(p is not None for panels in model.model.decode_stack.packed[4:] for p in panels)
    calls = {"stack": 0}
    real = ops.decode_stack

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        calls["stack"] += out is not None
        return out

    monkeypatch.setattr(ops, "decode_stack", counting)
    core.generate(_prompts(3, seed=1), GREEDY)
    if cpu_kernels() is not None:
        # Five decode-only steps per prompt batch, each one call for every layer.
        assert calls["stack"] >= 5
    else:
        assert calls["stack"] == 0


@pytest.mark.skipif(cpu_kernels() is None, reason="needs the compiled CPU kernels")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fused_stack_equals_the_fused_layers_bit_for_bit(tiny_llama: Path, dtype: str) -> None:
    kernels = cpu_kernels()
    assert kernels is not None
    stacked = _step_logits(tiny_llama, dtype, fast=True)
    layered = _step_logits(tiny_llama, dtype, fast=True, stack=False)
    for step, (a, b) in enumerate(zip(stacked, layered, strict=True)):
        assert torch.equal(a, b), f"step {step}"


def test_fast_path_matches_the_twin_in_fp32(tiny_llama: Path) -> None:
    fast = _step_logits(tiny_llama, "float32", fast=True)
    twin = _step_logits(tiny_llama, "float32", fast=False)
    for step, (a, b) in enumerate(zip(fast, twin, strict=True)):
        assert _rel(a, b) < 1e-5, f"step {step}: fast vs twin {_rel(a, b):.2e}"


def test_fast_path_greedy_tokens_equal_the_twin_in_fp32(tiny_llama: Path) -> None:
    prompts = _prompts(5, seed=2)
    fast = make_core(tiny_llama)
    twin = make_core(tiny_llama)
    twin.runner.model.set_fast_path(False)
    assert not any(getattr(m, "use_kernel", False) for m in twin.runner.model.modules()), (
        "set_fast_path(False) leaves every module on its twin"
    )
    assert fast.generate(prompts, GREEDY) == twin.generate(prompts, GREEDY)


def test_bf16_logits_stay_within_tolerance_of_fp32(tiny_llama: Path) -> None:
    ref = _step_logits(tiny_llama, "float32", fast=True)
    for fast in (True, False):
        got = _step_logits(tiny_llama, "bfloat16", fast=fast)
        for step, (a, r) in enumerate(zip(got, ref, strict=True)):
            err = _rel(a, r)
            assert err < BF16_REL_TOL, f"bf16 fast={fast} step {step}: {err:.3g} of max logit"


def test_an_engine_without_panels_keeps_none_and_decodes_the_same(tiny_llama: Path) -> None:
    prompts = _prompts(3, seed=4)
    with_panels = make_core(tiny_llama)
    without = make_core(tiny_llama, linear_panels=False)
    linears = [m for m in without.runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.panels is None for m in linears)
    stack = without.runner.model.model.decode_stack
    assert stack is None or all(p is None for panels in stack.packed[4:] for p in panels)
    assert with_panels.generate(prompts, GREEDY) == without.generate(prompts, GREEDY)


def test_set_fast_path_round_trips(tiny_llama: Path) -> None:
    core = make_core(tiny_llama)
    model = core.runner.model
    before = {n: m.use_kernel for n, m in model.named_modules() if hasattr(m, "use_kernel")}
    # Which copies a layer keeps follows its route (measured on this host: a table that
    # routes no class to the panels drops them), so the round trip restores what was.
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    copies = [(m.packed is not None, m.panels is not None) for m in linears]
    model.set_fast_path(False)
    assert all(not m.use_kernel for m in model.modules() if hasattr(m, "use_kernel"))
    assert all(m.packed is None for m in model.modules() if isinstance(m, Linear))
    assert all(m.panels is None for m in model.modules() if isinstance(m, Linear))
    model.set_fast_path(True)
    assert [(m.packed is not None, m.panels is not None) for m in linears] == copies
    after = {n: m.use_kernel for n, m in model.named_modules() if hasattr(m, "use_kernel")}
    assert after == before
    assert any(isinstance(m, DecoderLayer) for m in model.modules())
