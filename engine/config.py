"""Engine configuration: the model's architecture and the engine's limits.

Built once (by a service's ``__main__`` or a test) and passed down; frozen afterwards.
Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture of a Llama-family decoder, read from an HF ``config.json``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: tuple[tuple[str, Any], ...] | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
            )
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        eos = hf.get("eos_token_ids", hf.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
        scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
        if isinstance(scaling, dict):
            rope_type = scaling.get("rope_type", scaling.get("type"))
            if rope_type in (None, "default"):
                scaling = None
            elif rope_type not in ("llama3", "linear"):
                raise ValueError(f"rope_scaling type {rope_type!r} is not supported")
        theta = hf.get("rope_theta")
        if theta is None and isinstance(hf.get("rope_parameters"), dict):
            theta = hf["rope_parameters"].get("rope_theta")
        return cls(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta if theta is not None else 10000.0),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            rope_scaling=tuple(sorted(scaling.items())) if isinstance(scaling, dict) else None,
            eos_token_ids=tuple(int(e) for e in eos_ids),
            bos_token_id=hf.get("bos_token_id"),
        )


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Limits and placement of one engine instance."""

    model: str = "smollm2-135m"
    dtype: str = "bfloat16"
    device: str = "cpu"
    block_size: int = 16
    # KV pool size: num_gpu_blocks wins if set, otherwise kv_cache_bytes decides.
    num_blocks: int | None = None
    kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # 0 means the model's max_position_embeddings.
    max_model_len: int = 0
    enable_prefix_caching: bool = True
    seed: int = 0
    num_threads: int = 0  # 0: leave torch's default
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2, got {self.num_blocks}")
        if self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {self.max_model_len}")
