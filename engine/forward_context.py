"""The attention metadata of one forward pass, visible to every attention layer.

Set by the model runner with ``forward_context(...)`` around a forward and always reset,
so layer signatures stay ``(positions, hidden)``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class PrefillSeq:
    """A query run of ``q_len`` tokens at positions [start, start + q_len)."""

    q_start: int  # row of its first token in the flat batch
    q_len: int
    start: int  # tokens of context already in the cache before this chunk
    block_ids: torch.Tensor  # [ceil((start + q_len) / block_size)] long


@dataclass(slots=True)
class PackedPrefills:
    """The prefill chunks of a step as tensors, for kernels that take all of them at once."""

    q_start: torch.Tensor  # [P] int32: row of each chunk's first token in the flat batch
    q_len: torch.Tensor  # [P] int32
    ctx_start: torch.Tensor  # [P] int32: tokens cached before the chunk
    block_tables: torch.Tensor  # [P, max blocks] int32, 0-padded
    max_q_len: int


@dataclass(slots=True)
class AttentionMetadata:
    # Flat cache slot (block * block_size + offset) of every token of the batch.
    slot_mapping: torch.Tensor
    # The first ``num_decode`` rows are single-token queries, one per sequence.
    num_decode: int
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks] long, 0-padded
    # Additive mask [num_decode, max_blocks * block_size]: 0 for context, -inf for padding;
    # None: built from the tables and lengths by the attention that reads it, if any
    # (engine.layers.attention.decode_mask).
    decode_mask: torch.Tensor | None
    prefills: list[PrefillSeq]
    # [num_decode] int64: tokens of context of each decode row, its query included. The
    # runner may fill it; otherwise attention derives it from ``decode_mask`` once a step.
    decode_context_lens: torch.Tensor | None = None
    # ``decode_mask`` narrowed to a sliding window, per window size; filled lazily by the
    # first windowed layer of a step (plain-torch path only).
    decode_window_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    # GPU steps: the prefills packed once for the Triton kernel (derived from ``prefills``
    # when absent), and how many pieces each decode row's context is split into.
    packed_prefills: PackedPrefills | None = None
    decode_splits: int = 1
    # Deterministic mode: every row of the step (decode rows, then each prefill chunk's
    # tokens) as a single-token query, its block table [T, max blocks] long (0-padded)
    # and its context length [T] int64 (its own token included); built lazily by the
    # first attention layer of the step.
    row_block_tables: torch.Tensor | None = None
    row_context_lens: torch.Tensor | None = None


@dataclass(slots=True)
class ForwardContext:
    attn: AttentionMetadata
    kv_cache: torch.Tensor  # [layers, 2, kv_heads, blocks, block_size, head_dim]


_current: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar(
    "baton_forward_context", default=None
)


def get_forward_context() -> ForwardContext:
    ctx = _current.get()
    assert ctx is not None, "attention called outside forward_context()"
    return ctx


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[None]:
    token = _current.set(ctx)
    try:
        yield
    finally:
        _current.reset(token)
