"""Every attention backend and compiled CPU kernel against a simple reference.

The reference is dense per-sequence attention in float64 over the un-paged K/V. Batches
mix context lengths (inside a block, on block edges, several blocks), use GQA and block
tables with shuffled, non-contiguous block ids, and mix decode rows with prefill chunks.
Kernel cases run only where the compiled kernels load; the plain-torch cases always run,
so the suite also passes where the kernels fall back.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.forward_context import AttentionMetadata, ForwardContext, PrefillSeq, forward_context
from engine.kernels import cpu as kernels_cpu
from engine.kernels import ops
from engine.layers.attention import PagedAttention, decode_attention_backend
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.llama import DecoderLayer

KERNELS = kernels_cpu.cpu_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="compiled CPU kernels unavailable")
BACKENDS = ["torch", pytest.param("cpu-kernel", marks=needs_kernels)]
DTYPES = [torch.float32, torch.bfloat16]
# Max abs error against the float64 reference, for outputs of magnitude ~1. The torch path
# rounds bf16 scores and probabilities; the decode and prefill kernels round their
# probabilities (bf16 dot product for P.V, as flash attention does) and their output.
TOL = {
    ("torch", torch.float32): 1e-5,
    ("cpu-kernel", torch.float32): 1e-5,
    ("torch", torch.bfloat16): 3e-2,
    ("cpu-kernel", torch.bfloat16): 1e-2,
}


@dataclass
class Seq:
    context: int  # tokens in the cache before this step
    q_len: int  # new tokens this step (1: a decode row)


def _attention(
    heads: int, kv_heads: int, head_dim: int, backend: str, window: int = 0
) -> PagedAttention:
    attn = PagedAttention(0, heads, kv_heads, head_dim, sliding_window=window)
    attn.use_kernel = backend == "cpu-kernel"
    return attn


def _run(
    seqs: list[Seq],
    *,
    heads: int = 6,
    kv_heads: int = 2,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    backend: str = "torch",
    seed: int = 0,
    runner_lens: bool = False,
    block: int = 16,
    window: int = 0,
) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Max abs error of one step against the reference, and the cache before/after."""
    n_dec = sum(s.q_len == 1 for s in seqs)
    assert all(s.q_len == 1 for s in seqs[:n_dec]), "decode rows come first"
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    totals = [s.context + s.q_len for s in seqs]
    nblocks = [(t + block - 1) // block for t in totals]
    num_blocks = sum(nblocks) + 5
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    it = iter(ids)
    tables = [[next(it) for _ in range(n)] for n in nblocks]
    cache = torch.randn((1, 2, kv_heads, num_blocks, block, head_dim), generator=gen).to(dtype)
    full_k = [torch.randn((t, kv_heads, head_dim), generator=gen).to(dtype) for t in totals]
    full_v = [torch.randn((t, kv_heads, head_dim), generator=gen).to(dtype) for t in totals]
    qs = [torch.randn((s.q_len, heads, head_dim), generator=gen).to(dtype) for s in seqs]
    for s, tab, k, v in zip(seqs, tables, full_k, full_v, strict=True):
        for p in range(s.context):
            cache[0, 0, :, tab[p // block], p % block] = k[p]
            cache[0, 1, :, tab[p // block], p % block] = v[p]
    before = cache.clone()

    decode = [i for i, s in enumerate(seqs) if s.q_len == 1]
    slots, q_rows, k_rows, v_rows, prefills = [], [], [], [], []
    for i, s in enumerate(seqs):
        q_start = len(slots)
        for p in range(s.context, s.context + s.q_len):
            slots.append(tables[i][p // block] * block + p % block)
        q_rows.append(qs[i])
        k_rows.append(full_k[i][s.context :])
        v_rows.append(full_v[i][s.context :])
        if s.q_len > 1:
            prefills.append(PrefillSeq(q_start, s.q_len, s.context, torch.tensor(tables[i])))
    tables_t = mask = lens = None
    if decode:
        width = max(nblocks[i] for i in decode)
        tables_t = torch.tensor([tables[i] + [0] * (width - len(tables[i])) for i in decode])
        lens = torch.tensor([totals[i] for i in decode])
        mask = torch.zeros(len(decode), width * block)
        mask.masked_fill_(torch.arange(width * block)[None] >= lens[:, None], float("-inf"))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        num_decode=len(decode),
        decode_block_tables=tables_t,
        decode_mask=mask,
        prefills=prefills,
        decode_context_lens=lens if runner_lens else None,
    )
    attn = _attention(heads, kv_heads, head_dim, backend, window)
    # Project-like inputs: q, k, v are column slices of one packed row, as in the model.
    q = torch.cat(q_rows)
    k = torch.cat(k_rows)
    v = torch.cat(v_rows)
    packed = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    qn, kn = heads * head_dim, kv_heads * head_dim
    q = packed[:, :qn].view(-1, heads, head_dim)
    k = packed[:, qn : qn + kn].view(-1, kv_heads, head_dim)
    v = packed[:, qn + kn :].view(-1, kv_heads, head_dim)
    with torch.inference_mode(), forward_context(ForwardContext(meta, cache)):
        out = attn(q, k, v)
    assert out.shape == (len(slots), heads * head_dim) and out.dtype == dtype

    group = heads // kv_heads
    err = 0.0
    row = 0
    for i, s in enumerate(seqs):
        kk = full_k[i].double().repeat_interleave(group, dim=1)  # [L, H, D]
        vv = full_v[i].double().repeat_interleave(group, dim=1)
        qq = qs[i].double()  # [n, H, D]
        scores = torch.einsum("nhd,lhd->hnl", qq, kk) * head_dim**-0.5
        qpos = torch.arange(s.context, s.context + s.q_len)[:, None]
        kpos = torch.arange(totals[i])[None]
        outside = (kpos > qpos) | ((kpos <= qpos - window) if window else False)
        scores = scores.masked_fill(outside, float("-inf"))
        ref = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), vv).reshape(s.q_len, -1)
        got = out[row : row + s.q_len].double()
        err = max(err, (got - ref).abs().max().item())
        row += s.q_len
    # Every new token's K/V landed in its slot.
    for i, s in enumerate(seqs):
        for p in range(s.context, totals[i]):
            blk, off = tables[i][p // block], p % block
            assert torch.equal(cache[0, 0, :, blk, off], full_k[i][p])
            assert torch.equal(cache[0, 1, :, blk, off], full_v[i][p])
    return err, before, cache


MIXED_CONTEXTS = [0, 14, 15, 16, 31, 47, 100, 250]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_batch_mixed_lengths_gqa(backend: str, dtype: torch.dtype) -> None:
    seqs = [Seq(c, 1) for c in MIXED_CONTEXTS]
    err, _, _ = _run(seqs, dtype=dtype, backend=backend)
    assert err < TOL[(backend, dtype)], err


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_batch_of_one(backend: str, dtype: torch.dtype) -> None:
    for context in (0, 17, 300):
        err, _, _ = _run([Seq(context, 1)], dtype=dtype, backend=backend, seed=context)
        assert err < TOL[(backend, dtype)], (context, err)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_prefill_and_decode_batch(backend: str, dtype: torch.dtype) -> None:
    # Decode rows first, then a prompt from scratch and a chunk after cached context.
    seqs = [Seq(40, 1), Seq(5, 1), Seq(129, 1), Seq(0, 23), Seq(37, 19)]
    err, _, _ = _run(seqs, dtype=dtype, backend=backend, seed=1)
    assert err < TOL[(backend, dtype)], err


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 32), (8, 1, 128), (9, 3, 48)])
def test_head_shapes(backend: str, heads: int, kv_heads: int, head_dim: int) -> None:
    seqs = [Seq(c, 1) for c in (3, 16, 70)] + [Seq(20, 9)]
    err, _, _ = _run(seqs, heads=heads, kv_heads=kv_heads, head_dim=head_dim, backend=backend)
    assert err < 1e-5, err


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 1, 128), (9, 3, 64), (4, 4, 32)])
@pytest.mark.parametrize("block", [8, 16, 32])
@needs_kernels
def test_bf16_decode_kernel_head_dims_and_blocks(
    heads: int, kv_heads: int, head_dim: int, block: int
) -> None:
    # The one-pass kernel (head dims 64, 128) reads a block of 8 as a partial 16-token
    # group and one of 32 as two; head dim 32 takes the two-pass form. Contexts end at
    # many offsets in a block, and a window starts mid-block.
    seqs = [Seq(c, 1) for c in (0, 1, 6, 15, 16, 17, 40, 95, 200)]
    for window in (0, 37):
        err, _, _ = _run(
            seqs, dtype=torch.bfloat16, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
            backend="cpu-kernel", block=block, seed=block + head_dim, window=window,
        )  # fmt: skip
        assert err < TOL[("cpu-kernel", torch.bfloat16)], (window, err)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block", [8, 32])
def test_other_block_sizes(backend: str, block: int) -> None:
    seqs = [Seq(c, 1) for c in (0, 7, 8, 9, 33, 95)] + [Seq(12, 21)]
    err, _, _ = _run(seqs, backend=backend, block=block, seed=block)
    assert err < 1e-5, err


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 5, 16, 37, 100])
def test_sliding_window(backend: str, dtype: torch.dtype, window: int) -> None:
    # Windows inside a block, on a block edge and across blocks; contexts shorter and
    # longer than the window; a chunk after cached context; a long lone sequence whose
    # context the kernel splits into parts, some wholly before the window.
    seqs = [Seq(c, 1) for c in (0, 3, 15, 16, 40, 130)] + [Seq(0, 30), Seq(45, 20)]
    err, _, _ = _run(seqs, dtype=dtype, backend=backend, seed=window, window=window)
    assert err < TOL[(backend, dtype)], err
    err, _, _ = _run([Seq(700, 1)], dtype=dtype, backend=backend, seed=window, window=window)
    assert err < TOL[(backend, dtype)], err


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_splits_long_contexts_of_small_batches(dtype: torch.dtype) -> None:
    # Fewer (sequence, kv head) pairs than two per thread: contexts split into parts,
    # one of which is empty for the short sequence.
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        for seqs in ([Seq(999, 1)], [Seq(19, 1), Seq(700, 1)]):
            err, _, _ = _run(seqs, heads=4, kv_heads=1, dtype=dtype, backend="cpu-kernel")
            assert err < TOL[("cpu-kernel", dtype)], (seqs, err)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [8, 16, 128])
def test_prefill_kernel_chunks_over_long_contexts(dtype: torch.dtype, block: int) -> None:
    # The compiled prefill kernel reads every key from the pool: chunks of 1 to 300 tokens
    # after 0 to 700 cached ones, query-row groups straddling tokens (9 heads on 3 KV
    # heads), a chunk ending mid-block, and several chunks in one step.
    if KERNELS is None:
        pytest.skip("compiled CPU kernels unavailable")
    seqs = [Seq(0, 300), Seq(700, 45), Seq(33, 2), Seq(129, 127)]
    err, _, _ = _run(seqs, heads=9, kv_heads=3, dtype=dtype, backend="cpu-kernel", block=block)
    assert err < TOL[("cpu-kernel", dtype)], err


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_kernel_result_does_not_depend_on_the_threads(dtype: torch.dtype) -> None:
    # Each (KV head, row group) is one thread's whole job, whatever the team: bit-equal.
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            gen = torch.Generator().manual_seed(5)
            kv = torch.randn((2, 2, 3, 40, 16, 64), generator=gen).to(dtype)
            q = torch.randn((70, 9, 64), generator=gen).to(dtype)
            out = torch.empty_like(q)
            ids = torch.randperm(39, generator=gen)[:30] + 1
            KERNELS.ops.prefill_attention(out, q, kv, 1, ids, 400, 0.125, 0)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


@needs_kernels
def test_prefill_kernel_refuses_a_short_block_table() -> None:
    kv = torch.zeros((1, 2, 2, 8, 16, 32))
    q = torch.zeros((20, 4, 32))
    with pytest.raises(RuntimeError, match="block_ids cover 16 tokens, the chunk ends at 30"):
        KERNELS.ops.prefill_attention(torch.empty_like(q), q, kv, 0, torch.tensor([1]), 10, 0.1, 0)
    with pytest.raises(RuntimeError, match="block id out of range"):
        KERNELS.ops.prefill_attention(torch.empty_like(q), q, kv, 0, torch.tensor([1, 9]), 10, 0.1)


@needs_kernels
def test_runner_filled_context_lens_give_the_same_result() -> None:
    seqs = [Seq(c, 1) for c in MIXED_CONTEXTS]
    a = _run(seqs, backend="cpu-kernel", runner_lens=True)
    b = _run(seqs, backend="cpu-kernel", runner_lens=False)
    assert a[0] < 1e-5 and torch.equal(a[2], b[2])


@needs_kernels
def test_kernel_leaves_other_slots_alone() -> None:
    seqs = [Seq(c, 1) for c in (3, 40)] + [Seq(0, 5)]
    _, before, after = _run(seqs, backend="cpu-kernel")
    _, before_t, after_t = _run(seqs, backend="torch")
    assert torch.equal(before, before_t) and torch.equal(after, after_t)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_kernel_matches_torch(dtype: torch.dtype) -> None:
    if KERNELS is None:
        pytest.skip("compiled CPU kernels unavailable")
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, 1e-5).to(dtype)
    norm.weight.data = torch.randn(576, generator=gen).to(dtype)
    x = (3 * torch.randn((33, 576), generator=gen)).to(dtype)
    with torch.inference_mode():
        norm.use_kernel = True
        got = norm(x)
        norm.use_kernel = False
        ref = norm(x)
    # Only the fp32 sum of squares may round differently.
    assert got.dtype == dtype
    torch.testing.assert_close(got, ref, rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_kernel_is_bit_exact(dtype: torch.dtype) -> None:
    if KERNELS is None:
        pytest.skip("compiled CPU kernels unavailable")
    gen = torch.Generator().manual_seed(0)
    rope = RotaryEmbedding(
        64,
        4096,
        10000.0,
        {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 1024},
    )
    rope = rope.to(dtype)
    qkv = torch.randn((29, 15 * 64), generator=gen).to(dtype)
    q = qkv[:, : 9 * 64].view(29, 9, 64)
    k = qkv[:, 9 * 64 : 12 * 64].view(29, 3, 64)
    pos = torch.randint(0, 4096, (29,), generator=gen)
    with torch.inference_mode():
        rope.use_kernel = True
        got = rope(pos, q, k)
        rope.use_kernel = False
        ref = rope(pos, q, k)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@pytest.mark.skipif(KERNELS is None or not KERNELS.bf16_dot, reason="needs AVX512-BF16 build")
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_bf16_matches_fp32_reference(m: int, bias: bool) -> None:
    assert KERNELS is not None
    gen = torch.Generator().manual_seed(m)
    w = (0.05 * torch.randn((130, 576), generator=gen)).bfloat16()
    x = torch.randn((m, 576), generator=gen).bfloat16()
    b = torch.randn(130, generator=gen).bfloat16() if bias else None
    got = KERNELS.ops.linear_bf16(x, w, b)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    # One bf16 rounding of the fp32 result, as torch's bf16 linear does.
    torch.testing.assert_close(got.float(), ref, rtol=4e-3, atol=1e-3)


def test_backend_name_and_fallback(monkeypatch: pytest.MonkeyPatch, caplog, tmp_path) -> None:
    assert decode_attention_backend() in ("cpu-kernel", "torch")
    monkeypatch.setenv("BATON_CPU_KERNELS", "0")
    assert kernels_cpu.cpu_kernels.__wrapped__() is None
    monkeypatch.setenv("BATON_CPU_KERNELS", "1")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="engine.kernels.cpu"):
        assert kernels_cpu.cpu_kernels.__wrapped__() is None
    assert "using plain torch" in caplog.text


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (4 * torch.randn((9, 2 * 200), generator=gen)).to(dtype)
    ref = F.silu(x[:, :200]) * x[:, 200:]
    got = ops.silu_and_mul(x)
    # bf16 rounds like torch after each op; fp32 may differ in exp's last bit.
    torch.testing.assert_close(got, ref, rtol=1e-6 if dtype == torch.float32 else 0, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_linear_with_packed_weight_matches_f_linear(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = (0.05 * torch.randn((96, 64), generator=gen)).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn((rows, 64), generator=gen).to(dtype)
    packed = ops.pack_linear_weight(w)
    ref = F.linear(x.float(), w.float(), b.float())
    got = ops.linear(x, w, b, packed)
    assert got.dtype == dtype and got.shape == (rows, 96)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol)


@needs_kernels
def test_panels_hold_the_weight_by_64_column_panels() -> None:
    w = torch.randn((130, 48))
    panels = ops.pack_panels(w)
    assert panels is not None and panels.shape == (3, 48, 64) and panels.dtype == torch.float32
    for n in (0, 63, 64, 129):
        assert torch.equal(panels[n // 64, :, n % 64], w[n])
    assert not panels[2, :, 130 - 128 :].any()  # the padding columns


@pytest.mark.skipif(KERNELS is None or not KERNELS.bf16_dot, reason="needs AVX512-BF16 build")
def test_bf16_panels_pair_consecutive_k_for_the_dot_product() -> None:
    w = torch.randn((130, 48)).bfloat16()
    panels = ops.pack_panels(w)
    assert panels is not None and panels.shape == (3, 24, 64, 2) and panels.dtype == torch.bfloat16
    for n in (0, 63, 64, 129):
        for k in (0, 1, 46, 47):
            assert panels[n // 64, k // 2, n % 64, k % 2] == w[n, k]
    assert not panels[2, :, 130 - 128 :].any()  # the padding columns
    # An odd K has no pairs: plain panels, kept in bf16.
    odd = torch.randn((70, 47)).bfloat16()
    assert torch.equal(ops.pack_panels(odd).float(), ops.pack_panels(odd.float()))


@pytest.mark.skipif(KERNELS is None or KERNELS.bf16_dot, reason="needs a build without AVX512-BF16")
def test_bf16_panels_without_the_dot_product_stay_bf16_and_match_the_fp32_ones() -> None:
    """No bf16 dot product (an AVX2 CPU): a bf16 weight's panels hold it as it is, half
    the bytes of widened fp32 panels, and the kernel widens them as it loads them, so
    the result is the fp32 panels' bits."""
    w = torch.randn((130, 96)).bfloat16()
    panels = ops.pack_panels(w)
    assert panels is not None and panels.shape == (3, 96, 64) and panels.dtype == torch.bfloat16
    wide = ops.pack_panels(w.float())
    # The same values (within each 16 columns in the order the ISA widens fastest).
    groups = panels.float().view(3, 96, 4, 16).sort(-1).values
    assert torch.equal(groups, wide.view(3, 96, 4, 16).sort(-1).values)
    for rows in (1, 2, 3, 6, 26):
        x = torch.randn(rows, 96).bfloat16()
        got = KERNELS.ops.linear_panels(x, panels, 130, None)
        assert torch.equal(got, KERNELS.ops.linear_panels(x, wide, 130, None)), rows


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 26, 64])
def test_linear_on_panels_matches_f_linear(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = (0.05 * torch.randn((130, 96), generator=gen)).to(dtype)
    b = torch.randn(130, generator=gen).to(dtype)
    x = torch.randn((rows, 96), generator=gen).to(dtype)
    got = ops.linear(x, w, b, None, None, ops.pack_panels(w))
    ref = F.linear(x.double(), w.double(), b.double())
    assert got.dtype == dtype and got.shape == (rows, 130)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    else:  # fp32 sums of exact products, rounded to bf16 once
        torch.testing.assert_close(got, ref.to(dtype), rtol=8e-3, atol=1e-5)


@needs_kernels
def test_panels_serve_decode_sized_batches_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert KERNELS is not None
    w = torch.randn((64, 32))
    panels = ops.pack_panels(w)
    rows_seen = []

    class Counting:
        def __getattr__(self, name: str):  # noqa: ANN204 - delegates to torch.ops.baton_cpu
            return getattr(KERNELS.ops, name)

        def linear_panels(self, x, *args):  # noqa: ANN001, ANN202
            rows_seen.append(x.shape[0])
            return KERNELS.ops.linear_panels(x, *args)

    monkeypatch.setattr(
        ops, "cpu_kernels", lambda: kernels_cpu.CpuKernels(Counting(), KERNELS.bf16_dot)
    )
    for rows in (1, ops.PANEL_MAX_ROWS, ops.PANEL_MAX_ROWS + 1):
        x = torch.randn((rows, 32))
        torch.testing.assert_close(ops.linear(x, w, None, None, None, panels), F.linear(x, w))
    assert rows_seen == [1, ops.PANEL_MAX_ROWS]


def _tiny_layer(dtype: torch.dtype) -> tuple[DecoderLayer, ModelConfig]:
    cfg = ModelConfig(
        model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=512, tie_word_embeddings=False, attention_bias=False,
        rope_scaling=None, eos_token_ids=(0,), bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
    layer = DecoderLayer(cfg, 1, rope).to(dtype).eval()
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        norm.weight.data.uniform_(0.5, 1.5)
    return layer, cfg


@needs_kernels
@pytest.mark.parametrize(
    ("dtype", "rows", "packs"),
    [
        (torch.bfloat16, 1, False),
        (torch.bfloat16, 3, False),
        (torch.float32, 1, False),
        (torch.float32, 3, True),  # panels from the first row in fp32
        (torch.bfloat16, 7, True),  # bf16: the GEMV up to 4 rows, panels past it
    ],
)
def test_fused_decode_layer_equals_its_kernels(dtype: torch.dtype, rows: int, packs: bool) -> None:
    assert KERNELS is not None
    layer, cfg = _tiny_layer(dtype)
    block = 16
    gen = torch.Generator().manual_seed(rows)
    # Each row's new token lands in a slot of its own.
    lens = [37, 5, 70, 12, 20, 50, 3][:rows]
    tables = [[3, 1, 6], [4, 0, 0], [2, 7, 5, 8, 9], [5], [6, 9], [8, 1, 3, 4], [0]][:rows]
    width = max(len(t) for t in tables)
    cache = torch.randn((2, 2, cfg.num_kv_heads, 10, block, cfg.head_dim), generator=gen).to(dtype)
    hidden = torch.randn((rows, cfg.hidden_size), generator=gen).to(dtype)
    positions = torch.tensor(lens) - 1
    lens_t = torch.tensor(lens)
    mask = torch.zeros(rows, width * block)
    mask.masked_fill_(torch.arange(width * block)[None] >= lens_t[:, None], float("-inf"))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([t[(n - 1) // block] * block + (n - 1) % block
                                   for t, n in zip(tables, lens, strict=True)]),
        num_decode=rows,
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        decode_mask=mask,
        prefills=[],
    )  # fmt: skip
    attn = layer.self_attn
    mods = (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    onednn = [ops.pack_linear_weight(m.weight) if packs else None for m in mods]
    panels = [ops.pack_panels(m.weight) if packs else None for m in mods]
    if packs:
        assert all(p is not None for p in panels)

    def lin(x: torch.Tensor, i: int) -> torch.Tensor:
        return ops.linear(x, mods[i].weight, None, onednn[i], None, panels[i])

    with torch.inference_mode():
        ref_cache = cache.clone()
        with forward_context(ForwardContext(meta, ref_cache)):
            x = layer.input_layernorm(hidden)
            qkv = lin(x, 0)
            q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
            q, k = attn.rope(positions, q.view(rows, -1, 16), k.view(rows, -1, 16))
            o = attn.attn(q, k, v.view(rows, -1, 16))
            h1 = hidden + lin(o, 1)
            gate_up = lin(layer.post_attention_layernorm(h1), 2)
            ref = h1 + lin(ops.silu_and_mul(gate_up), 3)
        got = ops.decode_layer(
            hidden, positions, cache, 1, meta.slot_mapping, meta.decode_block_tables, lens_t,
            attn.rope.cos, attn.rope.sin, layer.input_layernorm.weight, attn.qkv_proj.weight,
            None, attn.o_proj.weight, layer.post_attention_layernorm.weight,
            layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight, cfg.num_heads,
            cfg.rms_norm_eps, attn.attn.scale, packed=(*onednn, *panels),
        )  # fmt: skip
        # And the plain-torch modules, within rounding.
        torch_cache = cache.clone()
        for mod in layer.modules():
            if hasattr(mod, "use_kernel"):
                mod.use_kernel = False
        with forward_context(ForwardContext(meta, torch_cache)):
            hidden_torch = layer(positions, hidden)
    assert got is not None
    assert torch.equal(got, ref) and torch.equal(cache, ref_cache)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), hidden_torch.float(), rtol=tol, atol=tol)


def test_fused_decode_layer_declines_what_it_does_not_serve() -> None:
    layer, cfg = _tiny_layer(torch.float32)
    attn = layer.self_attn
    cache = torch.zeros((2, 2, cfg.num_kv_heads, 4, 16, cfg.head_dim))
    half_rows = torch.zeros((2, cfg.hidden_size), dtype=torch.float16)  # no fp16 kernels
    got = ops.decode_layer(
        half_rows, torch.zeros(2, dtype=torch.long), cache, 0, torch.zeros(2, dtype=torch.long),
        torch.zeros((2, 1), dtype=torch.long), torch.ones(2, dtype=torch.long), attn.rope.cos,
        attn.rope.sin, layer.input_layernorm.weight, attn.qkv_proj.weight, None,
        attn.o_proj.weight, layer.post_attention_layernorm.weight,
        layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight, cfg.num_heads,
        cfg.rms_norm_eps, attn.attn.scale,
    )  # fmt: skip
    assert got is None


@needs_kernels
@pytest.mark.parametrize(
    ("dtype", "rows"),
    [(torch.bfloat16, 2), (torch.bfloat16, 9), (torch.float32, 1), (torch.float32, 9)],
)
def test_decoder_layer_fused_and_module_paths_are_bit_identical(
    dtype: torch.dtype, rows: int
) -> None:
    """A decode-only step through ``DecoderLayer`` (one fused call, prepacked weights above
    the GEMV rows) equals the same layer run module by module on the same fast ops."""
    assert KERNELS is not None
    layer, cfg = _tiny_layer(dtype)
    for mod in layer.modules():
        if hasattr(mod, "prepack"):
            mod.prepack()
    block = 16
    gen = torch.Generator().manual_seed(rows)
    lens = [random.Random(rows * 7 + i).randint(1, 60) for i in range(rows)]
    nblocks = [(n + block - 1) // block for n in lens]
    ids = list(range(1, sum(nblocks) + 1))
    random.Random(rows).shuffle(ids)
    it = iter(ids)
    tables = [[next(it) for _ in range(n)] for n in nblocks]
    width = max(nblocks)
    cache = torch.randn(
        (2, 2, cfg.num_kv_heads, len(ids) + 1, block, cfg.head_dim), generator=gen
    ).to(dtype)
    hidden = torch.randn((rows, cfg.hidden_size), generator=gen).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([t[(n - 1) // block] * block + (n - 1) % block
                                   for t, n in zip(tables, lens, strict=True)]),
        num_decode=rows,
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        decode_mask=None,
        prefills=[],
        decode_context_lens=torch.tensor(lens),
    )  # fmt: skip
    positions = torch.tensor(lens) - 1
    with torch.inference_mode():
        fused_cache = cache.clone()
        with forward_context(ForwardContext(meta, fused_cache)):
            fused = layer(positions, hidden)
        layer.use_kernel = False  # module by module, same ops
        module_cache = cache.clone()
        with forward_context(ForwardContext(meta, module_cache)):
            modules = layer(positions, hidden)
    assert torch.equal(fused, modules)
    assert torch.equal(fused_cache, module_cache)
