"""The shape of a worker's paged KV cache, as exchanged in the transport handshake.

Torch-free so that rpc/ and the schedulers can use it. The cache itself is one tensor
of shape ``[num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]`` (index 0 of
dim 1 is K, 1 is V). Blocks are indexed on dim 3 (``BLOCK_DIM``). Heads sit outside
blocks so that gathering a batch's blocks yields ``[heads, seqs, tokens, head_dim]``
ready for a batched matmul, with no transpose copy on the decode hot path.
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_DIM = 3
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Everything two peers must agree on before KV blocks can move between them."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # one of DTYPE_SIZES
    # Written by a worker in deterministic mode (--deterministic): KV bits that do not
    # depend on the batch. A peer that is not would hand over or read other bits for the
    # same tokens, so the two must agree like on the shape.
    deterministic: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(
                f"KVLayout.dtype must be one of {sorted(DTYPE_SIZES)}, got {self.dtype!r}"
            )

    @property
    def block_numel_per_layer_kv(self) -> int:
        """Elements of one block for one layer and one of K or V."""
        return self.block_size * self.num_kv_heads * self.head_dim

    @property
    def block_bytes(self) -> int:
        """Bytes one block occupies across all layers, K and V."""
        return 2 * self.num_layers * self.block_numel_per_layer_kv * DTYPE_SIZES[self.dtype]

    def pool_shape(self, num_blocks: int) -> tuple[int, int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, num_blocks, self.block_size, self.head_dim)

    def mismatch(self, other: KVLayout) -> str | None:
        """A human-readable description of how ``other`` differs, or None if identical."""
        diffs = [
            f"{name}: {getattr(self, name)!r} != {getattr(other, name)!r}"
            for name in (
                "num_layers",
                "block_size",
                "num_kv_heads",
                "head_dim",
                "dtype",
                "deterministic",
            )
            if getattr(self, name) != getattr(other, name)
        ]
        return "; ".join(diffs) if diffs else None
