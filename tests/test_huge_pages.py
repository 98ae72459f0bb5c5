"""The CPU KV pool sits on transparent huge pages where the kernel allows them."""

from __future__ import annotations

import pytest
import torch

from engine.huge_pages import HUGE_PAGE_BYTES, huge_page_bytes, thp_mode, zeros_on_huge_pages

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
