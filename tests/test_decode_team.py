"""The decode stack in one OpenMP team (csrc/decode_team.h) equals the same layers run
one ``decode_layer`` call at a time, bit for bit: the output, and the KV rows written.

Weights are random, three layers with per-layer sliding windows, SmolLM2's group of three
query heads per KV head, contexts that span several blocks, and rows that fill more than
one panel row tile. The routes name the panels for every row class, so the team serves the
stack; where a layer has no panels it declines and the stack runs layer by layer.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from engine.kernels import ops
from engine.kernels.cpu import cpu_kernels
from tests.engine_helpers import make_core

KERNELS = cpu_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="needs the compiled CPU kernels")

C, H, HKV, D, INTER, LAYERS, BLOCK, NB = 128, 6, 2, 64, 160, 3, 16, 40
PANELS = (ops.ROUTE_CODES["panels"],) * 3
WINDOWS = [0, 20, 0]


def _team_dtypes() -> list[torch.dtype]:
    # bf16 runs in the team only on pair panels (the bf16 dot product); fp32 everywhere.
    return [torch.float32] + ([torch.bfloat16] if KERNELS is not None and KERNELS.bf16_dot else [])


def _stack(dtype: torch.dtype, bias: bool, gen: torch.Generator) -> dict[str, list]:
    def w(n: int, k: int) -> torch.Tensor:
        return (torch.randn((n, k), generator=gen) / k**0.5).to(dtype)

    def norm() -> torch.Tensor:
        return (0.5 + torch.rand(C, generator=gen)).to(dtype)

    qkv_n = (H + 2 * HKV) * D
    layers: dict[str, list] = {k: [] for k in ("in", "qkv", "b", "o", "post", "gu", "down")}
    for _ in range(LAYERS):
        layers["in"].append(norm())
        layers["qkv"].append(w(qkv_n, C))
        layers["b"].append(torch.randn(qkv_n, generator=gen).to(dtype) if bias else None)
        layers["o"].append(w(C, H * D))
        layers["post"].append(norm())
        layers["gu"].append(w(2 * INTER, C))
        layers["down"].append(w(C, INTER))
    layers["panels"] = [[ops.pack_panels(t) for t in layers[k]] for k in ("qkv", "o", "gu", "down")]
    return layers


def _step(rows: int, dtype: torch.dtype, gen: torch.Generator) -> dict[str, torch.Tensor]:
    lens = [(37 + 29 * r) % 150 + 1 for r in range(rows)]
    width = (max(lens) + BLOCK - 1) // BLOCK
    tables = torch.randint(0, NB, (rows, width), generator=gen)
    # Each row's new token lands in a slot of its own: its last block is its own (other
    # rows may read it, after the team's barrier, as after write_kv layer by layer).
    for r in range(rows):
        tables[r, (lens[r] - 1) // BLOCK] = r
    slots = torch.tensor(
        [int(tables[r, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK for r, n in enumerate(lens)]
    )
    theta = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    freqs = torch.outer(torch.arange(512).float(), theta)
    emb = torch.cat([freqs, freqs], dim=-1)
    return {
        "hidden": torch.randn((rows, C), generator=gen).to(dtype),
        "positions": torch.tensor(lens) - 1,
        "cache": torch.randn((LAYERS, 2, HKV, NB, BLOCK, D), generator=gen).to(dtype),
        "slots": slots,
        "tables": tables,
        "lens": torch.tensor(lens),
        "cos": emb.cos(),
        "sin": emb.sin(),
    }


def _run_stack(layers: dict, step: dict, cache: torch.Tensor, split: int) -> torch.Tensor:
    assert KERNELS is not None
    none = [None] * LAYERS
    return KERNELS.ops.decode_stack(
        step["hidden"], step["positions"], cache, step["slots"], step["tables"], step["lens"],
        step["cos"], step["sin"], layers["in"], layers["qkv"], layers["b"], layers["o"],
        layers["post"], layers["gu"], layers["down"], none, none, none, none, *layers["panels"],
        H, 1e-5, D**-0.5, WINDOWS, list(PANELS), split,
    )  # fmt: skip


def _run_layers(layers: dict, step: dict, cache: torch.Tensor, split: int) -> torch.Tensor:
    assert KERNELS is not None
    h = step["hidden"]
    for i in range(LAYERS):
        h = KERNELS.ops.decode_layer(
            h, step["positions"], cache, i, step["slots"], step["tables"], step["lens"],
            step["cos"], step["sin"], layers["in"][i], layers["qkv"][i], layers["b"][i],
            layers["o"][i], layers["post"][i], layers["gu"][i], layers["down"][i],
            None, None, None, None, *(p[i] for p in layers["panels"]),
            H, 1e-5, D**-0.5, WINDOWS[i], list(PANELS), split,
        )  # fmt: skip
    return h


@needs_kernels
@pytest.mark.parametrize("dtype", _team_dtypes())
@pytest.mark.parametrize(
    ("rows", "split", "bias", "threads"),
    # Three threads: panel shares of 2, 2 and 1 (gate_up), the attention's items uneven.
    # One and two rows: every thread computes the row-wise phases of all rows itself.
    [
        (1, 0, False, 2),
        (2, 32, True, 3),
        (3, 32, True, 2),
        (26, 0, True, 2),
        (7, 0, False, 3),
    ],
)
def test_the_team_stack_equals_the_layers_bit_for_bit(
    dtype: torch.dtype, rows: int, split: int, bias: bool, threads: int
) -> None:
    assert KERNELS is not None
    gen = torch.Generator().manual_seed(rows)
    layers, step = _stack(dtype, bias, gen), _step(rows, dtype, gen)
    team_cache, layer_cache = step["cache"].clone(), step["cache"].clone()
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            before = KERNELS.ops.decode_team_runs()
            got = _run_stack(layers, step, team_cache, split)
            assert KERNELS.ops.decode_team_runs() == before + 1, "the team served the stack"
            ref = _run_layers(layers, step, layer_cache, split)
            assert KERNELS.ops.decode_team_runs() == before + 1, "decode_layer never uses it"
    finally:
        torch.set_num_threads(saved)
    assert got.dtype == dtype and got.shape == (rows, C)
    assert torch.equal(got, ref)
    assert torch.equal(team_cache, layer_cache)
    assert not torch.equal(team_cache, step["cache"])  # the rows' K/V were written


@needs_kernels
def test_a_layer_without_panels_sends_the_stack_layer_by_layer() -> None:
    assert KERNELS is not None
    gen = torch.Generator().manual_seed(5)
    layers, step = _stack(torch.float32, False, gen), _step(2, torch.float32, gen)
    layers["panels"][1][2] = None  # layer 2's o: no panels, so torch's linear there
    team_cache, layer_cache = step["cache"].clone(), step["cache"].clone()
    with torch.inference_mode():
        before = KERNELS.ops.decode_team_runs()
        got = _run_stack(layers, step, team_cache, 0)
        assert KERNELS.ops.decode_team_runs() == before
        ref = _run_layers(layers, step, layer_cache, 0)
    assert torch.equal(got, ref) and torch.equal(team_cache, layer_cache)


@needs_kernels
def test_the_team_refuses_a_slot_outside_the_pool_before_it_writes() -> None:
    assert KERNELS is not None
    gen = torch.Generator().manual_seed(6)
    layers, step = _stack(torch.float32, False, gen), _step(2, torch.float32, gen)
    step["slots"] = step["slots"].clone()
    step["slots"][1] = NB * BLOCK
    cache = step["cache"].clone()
    with torch.inference_mode(), pytest.raises(RuntimeError, match="write_kv: slot .* out of"):
        _run_stack(layers, step, cache, 0)
    assert torch.equal(cache, step["cache"])


@needs_kernels
def test_a_prepared_stack_runs_as_its_lists_do_and_is_released() -> None:
    """``decode_stack_prepare`` keeps the per-layer lists in the kernels (converting them
    every step cost ~50 us at batch 1); ``decode_stack_run`` over its handle gives the
    list call's output and KV bit for bit, and the handle goes with its release."""
    assert KERNELS is not None
    ops = KERNELS.ops
    dtype = _team_dtypes()[0]
    gen = torch.Generator().manual_seed(5)
    layers, step = _stack(dtype, True, gen), _step(3, dtype, gen)
    none = [None] * LAYERS
    handle = ops.decode_stack_prepare(
        layers["in"], layers["qkv"], layers["b"], layers["o"], layers["post"], layers["gu"],
        layers["down"], none, none, none, none, *layers["panels"], H, 1e-5, D**-0.5, WINDOWS,
        list(PANELS), 0,
    )  # fmt: skip
    by_handle, by_lists = step["cache"].clone(), step["cache"].clone()
    with torch.inference_mode():
        got = ops.decode_stack_run(
            step["hidden"], step["positions"], by_handle, step["slots"], step["tables"],
            step["lens"], step["cos"], step["sin"], handle,
        )  # fmt: skip
        want = _run_stack(layers, step, by_lists, 0)
    assert torch.equal(got, want) and torch.equal(by_handle, by_lists)
    ops.decode_stack_release(handle)
    with pytest.raises(RuntimeError, match="no prepared stack"):
        ops.decode_stack_run(
            step["hidden"], step["positions"], by_handle, step["slots"], step["tables"],
            step["lens"], step["cos"], step["sin"], handle,
        )  # fmt: skip


@needs_kernels
def test_a_model_stack_releases_its_handle_when_remade(tiny_llama: Path) -> None:
    assert KERNELS is not None
    core = make_core(tiny_llama, dtype="float32")
    model = core.runner.model.model
    assert model.decode_stack is not None and model.decode_stack.handle
    old = model.decode_stack.handle
    model.decode_stack = model.make_decode_stack()  # the old stack is dropped
    gc.collect()
    assert model.decode_stack is not None and model.decode_stack.handle != old
    x = torch.zeros(1)  # the handle is looked up before any tensor is read
    with pytest.raises(RuntimeError, match="no prepared stack"):
        KERNELS.ops.decode_stack_run(x, x, x, x, x, x, x, x, old)
