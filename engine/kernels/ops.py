"""Per-call choice between a compiled or prepacked CPU path and its plain-torch twin.

For model code. Each function returns what its torch twin returns (up to fp32 summation
order; the prepacked oneDNN matmul is bit-identical in bf16) and takes the fast path
only where it is available, the tensors are on the CPU and it measured faster
(``benchmarks/decode_step.py``); anything else runs the twin.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.kernels.cpu import cpu_kernels

logger = logging.getLogger(__name__)

# Rows up to which the bf16 GEMV kernel beats oneDNN's matmul (measured on AVX512-BF16:
# 1.9x at one row, 1.6x at four, even at eight, behind from twelve); where a layer has
# panels, the panel kernel serves these rows (``linear``).
GEMV_MAX_ROWS = 4
# Rows from which a bf16 linear layer runs faster as an fp32 GEMM on widened operands:
# this CPU's bf16 GEMM (AVX512-BF16, no AMX) computes slower than its fp32 one, which
# wins once the GEMM is compute-bound (1.34x CPU time on a 512-token prefill chunk of
# SmolLM2-135M) but loses while reading the twice-as-large weight dominates (even at 64
# rows, behind below; ``benchmarks/decode_step.py``-style runs, one thread).
WIDE_MIN_ROWS = 128
# Rows up to which a linear layer with panel-packed weights (``pack_panels``) runs the
# panel kernel (csrc/panel_linear.h): the decode batches. Against oneDNN's prepacked
# matmul on SmolLM2-135M's 120 layer weights read from DRAM (fp32, 2 threads): 1.5x at
# 26 rows, 1.3x at 64 (``benchmarks/panel_linear.py``).
PANEL_MAX_ROWS = 64
_ACT_DTYPES = (torch.float32, torch.bfloat16)
# Route name -> code of the compiled decode_layer's ``routes`` (cpu_ops.cpp enum Route);
# 0: what the constants pick (the compiled layer has no widened route).
ROUTE_CODES = {"torch": 1, "gemv": 2, "panels": 3, "onednn": 4}


def route_codes(gemv: str, decode: str, prefill: str) -> tuple[int, int, int]:
    """The compiled layer's ``routes`` for the routes of its three row classes (up to
    ``GEMV_MAX_ROWS`` rows, up to ``PANEL_MAX_ROWS``, above)."""
    return tuple(ROUTE_CODES.get(r, 0) for r in (gemv, decode, prefill))  # type: ignore[return-value]


def pack_linear_weight(weight: torch.Tensor, wide: bool = False) -> torch.Tensor | None:
    """A oneDNN-prepacked copy of a CPU linear weight [N, K], or None where unsupported.

    The packed copy spares oneDNN reordering the weight on every call: 1.4-1.6x on
    bf16 matmuls of 4 to 256 rows, bit-identical results. It costs a second copy of
    the weight in memory. ``wide`` packs a bf16 weight widened to fp32 instead (twice
    its size), for ``linear`` to run bf16 batches of ``WIDE_MIN_ROWS`` rows or more as
    fp32 GEMMs.
    """
    if weight.device.type != "cpu" or weight.dtype not in _ACT_DTYPES or weight.dim() != 2:
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    if wide and weight.dtype == torch.bfloat16:
        weight = weight.float()
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
    except (RuntimeError, AttributeError) as exc:
        logger.warning("cannot prepack a %s linear weight for oneDNN: %s", weight.dtype, exc)
        return None


def onednn_serves(dtype: torch.dtype) -> bool:
    """Whether ``pack_linear_weight`` can prepack a weight of ``dtype`` on this host."""
    if dtype not in _ACT_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_panels(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight [N, K] as panels of 64 output columns for ``linear``'s decode-sized
    batches (a further copy in memory), or None where the compiled kernels don't serve
    it: for a bf16 weight on a build with the bf16 dot product, bf16 pair panels [N / 64,
    K / 2, 64, 2]; otherwise plain panels [N / 64, K, 64] in the weight's dtype (a bf16
    one is widened to fp32 as the kernel loads it). Either is the weight's size.
    ``csrc/panel_linear.h`` has both."""
    if weight.device.type != "cpu" or weight.dtype not in _ACT_DTYPES or weight.dim() != 2:
        return None
    kernels = cpu_kernels()
    if kernels is None:
        return None
    return kernels.ops.pack_panels(weight.detach())


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
    packed_wide: torch.Tensor | None = None,
    panels: torch.Tensor | None = None,
    route: str | None = None,
    strict: bool = False,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; ``packed`` is ``pack_linear_weight(weight)`` or None,
    ``packed_wide`` is ``pack_linear_weight(weight, wide=True)`` or None, ``panels`` is
    ``pack_panels(weight)`` or None. ``route`` (``engine.kernels.route_table``: the one
    measured fastest for this many rows) runs that kernel where it serves these operands;
    without one, or where it does not serve them, the constants below decide.

    Batches of up to ``PANEL_MAX_ROWS`` rows run the panel kernel when there are panels;
    without panels, bf16 CPU batches of up to ``GEMV_MAX_ROWS`` rows run the AVX512-BF16
    GEMV kernel, which streams the weight at nearly the memory bandwidth (oneDNN: about
    half of it). bf16 batches of
    ``WIDE_MIN_ROWS`` rows or more run on the widened weight as fp32 GEMMs. Other batches
    (and fp32 from two rows) use the prepacked weight when there is one.

    ``strict`` (deterministic mode): ``route`` must serve, else ``RuntimeError``; falling
    back to the constants would pick a kernel by the batch's rows.
    """
    if route is not None:
        out = run_route(route, x, weight, bias, packed, packed_wide, panels)
        if out is not None:
            return out
        if strict:
            raise RuntimeError(
                f"deterministic mode: the {route!r} linear kernel does not serve a "
                f"{tuple(x.shape)} {x.dtype} input on a {tuple(weight.shape)} weight"
            )
    if x.dim() == 2 and x.is_cpu:
        rows = x.shape[0]
        if (
            panels is None
            and rows <= GEMV_MAX_ROWS
            and x.dtype == torch.bfloat16
            and weight.dtype == torch.bfloat16
            and x.shape[1] % 32 == 0
            and x.stride(1) == 1
            and weight.is_contiguous()
            and (bias is None or bias.dtype == torch.bfloat16)
        ):
            kernels = cpu_kernels()
            if kernels is not None and kernels.bf16_dot:
                return kernels.ops.linear_bf16(x, weight, bias)
        if (
            panels is not None
            and rows <= PANEL_MAX_ROWS
            and x.dtype in _ACT_DTYPES
            and x.dtype == weight.dtype
            and x.stride(1) == 1
            and (bias is None or bias.dtype == x.dtype)
        ):
            return cpu_kernels().ops.linear_panels(x, panels, weight.shape[0], bias)
        if (
            packed_wide is not None
            and rows >= WIDE_MIN_ROWS
            and x.dtype == torch.bfloat16
            and packed_wide.dtype == torch.float32
        ):
            # Widening bf16 is exact, so the fp32 GEMM forms the same products as a bf16
            # one and sums them in fp32 too; only the summation order differs.
            b = None if bias is None else bias.float()
            wide = torch.ops.mkldnn._linear_pointwise(x.float(), packed_wide, b, "none", [], "")
            return wide.to(torch.bfloat16)
        # fp32 single rows: MKL's GEMV is already at the memory bandwidth.
        single_fp32 = rows == 1 and x.dtype == torch.float32
        if packed is not None and x.dtype == packed.dtype and not single_fp32:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def run_route(
    route: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | None,
    packed_wide: torch.Tensor | None,
    panels: torch.Tensor | None,
) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` on the kernel named ``route`` (``route_table.ROUTES``),
    or None where that kernel does not serve these operands (another dtype, a missing
    copy, strides it does not take)."""
    if route == "torch":
        return F.linear(x, weight, bias)
    if not (x.dim() == 2 and x.is_cpu and x.dtype in _ACT_DTYPES and x.stride(1) == 1):
        return None
    if bias is not None and bias.dtype != x.dtype:
        return None
    if route == "gemv":
        if (
            x.dtype == torch.bfloat16
            and weight.dtype == torch.bfloat16
            and x.shape[1] % 32 == 0
            and weight.is_contiguous()
        ):
            kernels = cpu_kernels()
            if kernels is not None and kernels.bf16_dot:
                return kernels.ops.linear_bf16(x, weight, bias)
        return None
    if route == "panels":
        if panels is not None and x.dtype == weight.dtype:
            return cpu_kernels().ops.linear_panels(x, panels, weight.shape[0], bias)
        return None
    if route == "onednn":
        if packed is not None and x.dtype == packed.dtype:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return None
    if route == "wide":
        if (
            packed_wide is not None
            and x.dtype == torch.bfloat16
            and packed_wide.dtype == torch.float32
        ):
            b = None if bias is None else bias.float()
            wide = torch.ops.mkldnn._linear_pointwise(x.float(), packed_wide, b, "none", [], "")
            return wide.to(torch.bfloat16)
        return None
    raise ValueError(f"unknown linear route {route!r}")


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` for ``x = [gate | up]`` along the last dim, in one pass on CPU."""
    if x.is_cpu and x.dim() == 2 and x.dtype in _ACT_DTYPES and x.stride(1) == 1:
        kernels = cpu_kernels()
        if kernels is not None:
            return kernels.ops.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of 2-D logits; on CPU fp32 and bf16 the compiled kernel (a
    vector pass where torch's reduction takes one element at a time), with torch's answer:
    the first index of the maximum, or of the first NaN."""
    if (
        x.is_cpu
        and x.dim() == 2
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.shape[1]
        and x.stride(1) == 1
    ):
        kernels = cpu_kernels()
        if kernels is not None:
            return kernels.ops.argmax_rows(x)
    return x.argmax(dim=-1)


def decode_layer(
    hidden: torch.Tensor,
    positions: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    in_norm_w: torch.Tensor,
    qkv_w: torch.Tensor,
    qkv_b: torch.Tensor | None,
    o_w: torch.Tensor,
    post_norm_w: torch.Tensor,
    gate_up_w: torch.Tensor,
    down_w: torch.Tensor,
    num_heads: int,
    eps: float,
    scale: float,
    packed: tuple[torch.Tensor | None, ...] = (None,) * 8,
    window: int = 0,
    routes: tuple[int, ...] = (),
    split: int = 0,
) -> torch.Tensor | None:
    """A whole Llama decoder layer over the decode rows of a step in one call, or None.

    Computes ``h = hidden + o(attn(rope(qkv(norm(hidden))))); h + down(silu_mul(gate_up(
    norm2(h))))`` with the same kernels the modules run (bit-identical to them; ``window``:
    the layer's sliding window, 0 for full attention), writing the rows' K/V like the
    attention layer. ``packed`` holds the prepacked copies of (qkv, o, gate_up, down) from
    ``pack_linear_weight``, then their ``pack_panels`` (or None each); each linear layer
    picks what ``linear`` would pick for that many rows (``routes``: ``route_codes`` of the
    route table; empty: the constants; ``split``: the attention's, see
    ``PagedAttention.split``). For decode-only batches, where
    per-op dispatch from Python costs as much as the attention at small batches and the
    whole layer runs without the GIL. Returns None where it does not apply (not CPU,
    another dtype, shapes the kernels don't serve), and the caller runs its modules.
    """
    kernels = _decode_kernels(hidden, kv_cache, cos, positions)
    if kernels is None:
        return None
    head_dim = kv_cache.shape[-1]
    if not _layer_weights_ok(
        hidden.dtype, (in_norm_w, qkv_w, o_w, post_norm_w, gate_up_w, down_w), qkv_b, packed,
        head_dim, num_heads, kv_cache.shape[2],
    ):  # fmt: skip
        return None
    return kernels.decode_layer(
        hidden, positions, kv_cache, layer, slot_mapping, block_tables, context_lens,
        cos, sin, in_norm_w, qkv_w, qkv_b, o_w, post_norm_w, gate_up_w, down_w, *packed,
        num_heads, eps, scale, window, list(routes), split,
    )  # fmt: skip


def _decode_kernels(
    hidden: torch.Tensor, kv_cache: torch.Tensor, cos: torch.Tensor, positions: torch.Tensor
) -> Any:
    """The kernels' ops if a fused decode call serves these step inputs, else None."""
    if not (hidden.is_cpu and hidden.dim() == 2 and hidden.is_contiguous()):
        return None
    if hidden.dtype not in _ACT_DTYPES or hidden.shape[0] == 0:
        return None
    kernels = cpu_kernels()
    if kernels is None:
        return None
    if (
        kv_cache.dtype != hidden.dtype
        or not kv_cache.is_contiguous()
        or cos.dtype not in (hidden.dtype, torch.float32)
        or positions.dtype != torch.long
    ):
        return None
    return kernels.ops


def _layer_weights_ok(
    dtype: torch.dtype,
    weights: tuple[torch.Tensor, ...],
    qkv_b: torch.Tensor | None,
    packed: tuple[torch.Tensor | None, ...],
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
) -> bool:
    """Whether the fused kernels serve a layer's weights (in_norm, qkv, o, post_norm,
    gate_up, down) at activation dtype ``dtype``."""
    _, qkv_w, o_w, _, gate_up_w, down_w = weights
    return not (
        any(w.dtype != dtype or not w.is_contiguous() or not w.is_cpu for w in weights)
        or (qkv_b is not None and qkv_b.dtype != dtype)
        or head_dim % 16 != 0
        or head_dim > 256
        or num_heads // num_kv_heads > 16
        or any(w.shape[1] % 32 for w in (qkv_w, o_w, gate_up_w, down_w))
        or len(packed) != 8
    )


@dataclass(frozen=True, slots=True, weakref_slot=True)
class DecodeStack:
    """Every layer's weights for ``decode_stack``, layer ``l`` at index ``l``; made by
    ``make_decode_stack``, which checks them once. ``packed`` holds the prepacked copies
    (qkv, o, gate_up, down) and then their panels per layer, ``windows`` each layer's
    sliding window (0: none). The lists reference the parameters: remake the stack when
    they change."""

    dtype: torch.dtype
    in_norm: list[torch.Tensor]
    qkv: list[torch.Tensor]
    qkv_bias: list[torch.Tensor | None]
    o: list[torch.Tensor]
    post_norm: list[torch.Tensor]
    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    packed: tuple[list[torch.Tensor | None], ...]
    windows: list[int]
    num_heads: int
    eps: float
    scale: float
    # ``route_codes`` of the route table; empty: the constants.
    routes: tuple[int, ...] = ()
    # The attention's fixed KV split in tokens (deterministic mode); 0: chosen per batch.
    split: int = 0
    # The compiled kernels' copy of the lists above (``decode_stack_prepare``), released
    # with the stack; 0: none, the lists go with every call.
    handle: int = 0


def make_decode_stack(
    layers: list[dict[str, Any]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    routes: tuple[int, ...] = (),
    split: int = 0,
) -> DecodeStack | None:
    """A ``DecodeStack`` from per-layer dicts (keys: in_norm, qkv, qkv_bias, o, post_norm,
    gate_up, down, packed, window, eps, scale), or None where the kernels don't serve
    every layer the same way (then each layer takes its own path)."""
    if not layers or cpu_kernels() is None:
        return None
    dtype = layers[0]["qkv"].dtype
    keys = ("in_norm", "qkv", "o", "post_norm", "gate_up", "down")
    for layer in layers:
        weights = tuple(layer[k] for k in keys)
        if not _layer_weights_ok(
            dtype, weights, layer["qkv_bias"], layer["packed"], head_dim, num_heads, num_kv_heads
        ):
            return None
    if len({(layer["eps"], layer["scale"]) for layer in layers}) != 1:
        return None
    lists = {k: [layer[k] for layer in layers] for k in (*keys, "qkv_bias")}
    packed = tuple([layer["packed"][i] for layer in layers] for i in range(8))
    windows = [layer["window"] for layer in layers]
    eps, scale = layers[0]["eps"], layers[0]["scale"]
    ops = cpu_kernels().ops
    handle = ops.decode_stack_prepare(
        lists["in_norm"], lists["qkv"], lists["qkv_bias"], lists["o"], lists["post_norm"],
        lists["gate_up"], lists["down"], *packed, num_heads, eps, scale, windows, list(routes),
        split,
    )  # fmt: skip
    stack = DecodeStack(
        dtype=dtype, **lists, packed=packed, windows=windows, num_heads=num_heads, eps=eps,
        scale=scale, routes=routes, split=split, handle=handle,
    )  # fmt: skip
    weakref.finalize(stack, ops.decode_stack_release, handle)
    return stack


def decode_stack(
    stack: DecodeStack,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor | None:
    """Every layer of ``stack`` over the decode rows of a decode-only step in one call
    (what ``decode_layer`` gives layer after layer, bit for bit), or None where it does
    not apply. At batch 1 the Python around thirty ``decode_layer`` calls is a tenth of
    the forward."""
    if hidden.dtype != stack.dtype:
        return None
    kernels = _decode_kernels(hidden, kv_cache, cos, positions)
    if kernels is None:
        return None
    if stack.handle:
        return kernels.decode_stack_run(
            hidden, positions, kv_cache, slot_mapping, block_tables, context_lens, cos, sin,
            stack.handle,
        )  # fmt: skip
    return kernels.decode_stack(
        hidden, positions, kv_cache, slot_mapping, block_tables, context_lens, cos, sin,
        stack.in_norm, stack.qkv, stack.qkv_bias, stack.o, stack.post_norm, stack.gate_up,
        stack.down, *stack.packed, stack.num_heads, stack.eps, stack.scale, stack.windows,
        list(stack.routes), stack.split,
    )  # fmt: skip
