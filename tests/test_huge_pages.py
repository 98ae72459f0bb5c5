"""The CPU KV pool and the weights sit on transparent huge pages where the kernel allows them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.huge_pages import (
    HUGE_PAGE_BYTES,
    HugePageArena,
    huge_page_bytes,
    on_an_arena,
    thp_mode,
    zeros_on_huge_pages,
)
from engine.kernels.route_table import LINEAR_CLASSES, PANELS, RouteTable
from engine.models.llama import Linear
from tests.engine_helpers import make_core

THP = thp_mode() in ("always", "madvise")


@pytest.mark.skipif(not THP, reason=f"transparent huge pages are {thp_mode()} here")
def test_the_pool_is_zeroed_on_huge_pages() -> None:
    shape = (16, 2, 3, 128, 16, 64)  # 24 MiB of bf16, 12 huge pages
    pool = zeros_on_huge_pages(shape, torch.bfloat16)
    assert pool.shape == shape and pool.dtype == torch.bfloat16 and pool.is_contiguous()
    assert pool.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not pool.any()
    assert huge_page_bytes(pool) == 12 * HUGE_PAGE_BYTES


def test_switched_off_or_small_it_is_an_ordinary_zeroed_tensor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    small = zeros_on_huge_pages((1000,), torch.float32)
    assert small.shape == (1000,) and not small.any()
    monkeypatch.setenv("BATON_HUGE_PAGES", "0")
    pool = zeros_on_huge_pages(((64 << 20) // 4,), torch.float32)
    assert not pool.any()
    if thp_mode() != "always":
        assert huge_page_bytes(pool) == 0


def test_the_arena_holds_exact_aligned_copies() -> None:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn((1000, 1536), generator=gen).bfloat16()  # 3 MB
    b = torch.randn((3, 33), generator=gen)  # odd size: the next one must still align
    c = torch.randn((700, 64), generator=gen).bfloat16()
    arena = HugePageArena(sum(t.numel() * t.element_size() for t in (a, b, c)) + 2 * 64)
    placed = [arena.place(t) for t in (a, b, c)]
    for got, want in zip(placed, (a, b, c), strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
        assert torch.equal(got, want)
        assert got.data_ptr() % 64 == 0
        assert got.data_ptr() != want.data_ptr()
    with pytest.raises(ValueError, match="full"):
        arena.place(a)


@pytest.mark.skipif(not THP, reason=f"transparent huge pages are {thp_mode()} here")
def test_the_arena_is_on_huge_pages() -> None:
    weights = [torch.ones((1024, 1024), dtype=torch.bfloat16) for _ in range(4)]  # 8 MiB
    arena = HugePageArena.for_tensors(weights)
    assert arena is not None
    placed = [arena.place(w) for w in weights]
    assert huge_page_bytes(placed[0]) >= 4 * HUGE_PAGE_BYTES


def test_no_arena_when_switched_off_or_small(monkeypatch: pytest.MonkeyPatch) -> None:
    assert HugePageArena.for_tensors([torch.ones(1000)]) is None
    monkeypatch.setenv("BATON_HUGE_PAGES", "0")
    assert HugePageArena.for_tensors([torch.ones(4 << 20)]) is None


def test_on_an_arena_holds_while_the_arena_lives() -> None:
    weights = [torch.ones((1024, 1024), dtype=torch.bfloat16) for _ in range(2)]
    arena = HugePageArena(sum(w.numel() * w.element_size() for w in weights))
    placed = [arena.place(w) for w in weights]
    assert all(on_an_arena(p) for p in placed)
    assert not any(on_an_arena(w) for w in weights)
    del arena
    assert on_an_arena(placed[1][3:])  # a view keeps the mapping, and so the arena, alive


@pytest.mark.skipif(not THP, reason=f"transparent huge pages are {thp_mode()} here")
def test_the_models_weights_and_routed_panels_move_to_huge_pages_once(tiny_llama: Path) -> None:
    model = make_core(tiny_llama).runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    # The tied embedding is the LM head's weight: moved once, still shared.
    assert model.model.embed_tokens.weight is model.lm_head.weight
    assert all(on_an_arena(m.weight) and huge_page_bytes(m.weight) > 0 for m in linears)
    assert all(on_an_arena(m.panels) for m in linears if m.panels is not None)
    where = [m.weight.data_ptr() for m in linears]
    model.prepare_fast_path()
    assert [m.weight.data_ptr() for m in linears] == where
    # Forced onto the panels, every layer's panels land on huge pages too.
    model.set_kernel_routes(RouteTable(dict.fromkeys(LINEAR_CLASSES, PANELS), "measured"))
    model.prepare_fast_path()
    assert all(m.panels is not None and on_an_arena(m.panels) for m in linears)
