"""Engine configuration: the model's architecture and the engine's limits.

Built once (by a service's ``__main__`` or a test) and passed down; frozen afterwards.
Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
# How CPU linear layers pick their kernels (engine.kernels.route_table.MODES).
CPU_KERNEL_MODES = ("auto", "measure", "default", "onednn", "torch")


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
    # Per layer: how many of the most recent tokens (the query's own included) a query
    # attends to; 0 for full causal attention. HF's ``sliding_window`` semantics.
    sliding_windows: tuple[int, ...] = ()

    def sliding_window(self, layer: int) -> int:
        """The sliding window of ``layer`` in tokens, 0 for full attention."""
        return self.sliding_windows[layer] if self.sliding_windows else 0

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
        num_layers = int(hf["num_hidden_layers"])
        windows = _sliding_windows(hf, model_type, num_layers)
        theta = hf.get("rope_theta")
        if theta is None and isinstance(hf.get("rope_parameters"), dict):
            theta = hf["rope_parameters"].get("rope_theta")
        return cls(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=num_layers,
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
            sliding_windows=windows,
        )


def _sliding_windows(hf: dict[str, Any], model_type: str, num_layers: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention) as HF runs the checkpoint.

    Mistral applies ``sliding_window`` to every layer; Qwen2 only with
    ``use_sliding_window``, to layers from ``max_window_layers`` on; an explicit
    ``layer_types`` list wins for both. Llama has no windows. A checkpoint whose window
    we cannot read is refused rather than run with full attention.
    """
    if model_type == "llama":
        return ()
    window = hf.get("sliding_window")
    if model_type == "qwen2" and not hf.get("use_sliding_window", False):
        window = None
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ValueError(f"sliding_window must be a positive integer or null, got {window!r}")
    layer_types = hf.get("layer_types")
    if layer_types is None:
        if window is None:
            return ()
        first = int(hf.get("max_window_layers", 0)) if model_type == "qwen2" else 0
        return tuple(window if i >= first else 0 for i in range(num_layers))
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise ValueError(
            f"layer_types must list one type per layer ({num_layers}), got {layer_types!r}"
        )
    windows = []
    for i, kind in enumerate(layer_types):
        if kind == "full_attention":
            windows.append(0)
        elif kind == "sliding_attention":
            if window is None:
                raise ValueError(
                    f"layer_types[{i}] is sliding_attention but sliding_window is not set"
                )
            windows.append(window)
        else:
            raise ValueError(
                f"layer_types[{i}] is {kind!r}; supported: full_attention, sliding_attention"
            )
    return tuple(windows) if any(windows) else ()


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
    num_threads: int = 0  # 0: from the CPU budget (engine.cpu_budget)
    cache_dir: str | None = None
    # GPU: run every step eagerly instead of replaying CUDA graphs for decode steps.
    enforce_eager: bool = False
    # Bound of each engine queue: new requests waiting for a seat (prefill, single
    # process) and reservations waiting for KV blocks (decode). Past it: RESOURCE_EXHAUSTED.
    max_queued_requests: int = 256
    # The free-block watermark: a reservation (decode) is granted only if it leaves free
    # the blocks each admitted request needs for its next kv_growth_tokens tokens (capped
    # by its max_tokens), so new arrivals do not push admitted requests into recompute.
    kv_growth_tokens: int = 128
    # CPU: decode-sized batches (5-64 rows) may run their linear layers on panels of the
    # weights (engine.kernels.ops.pack_panels), a further copy of them of the weights'
    # size (~0.27 GB for SmolLM2-135M in bf16), kept only where the routes use it.
    # Workers that only prefill leave it off (rpc.worker_config).
    linear_panels: bool = True
    # CPU: the kernel of each class of linear layer (batch-1, decode batches, prefill
    # chunks, LM head). auto: measured on the model's weights at start-up, cached per
    # host (engine.kernels.route_cache); measure: always measured; default: the constants
    # of engine.kernels.ops; onednn / torch: every class on that one.
    cpu_kernels: str = "auto"
    # GPU: when the Triton attention kernels do not build at start, "none" fails the
    # start; "torch" serves on the plain-torch runner (slower, logged, metric-visible).
    attention_fallback: str = "none"
    # Most prompt tokens a step that also decodes may carry (0: no bound beyond
    # max_num_batched_tokens). Bounds what a prompt prefilled on a decode worker adds to
    # the inter-token latency of the streams it runs; decode workers default to 128
    # (rpc.worker_config).
    max_prefill_tokens_while_decoding: int = 0
    # Every kernel reduces in an order that does not depend on the batch's size or
    # members, nor on how a prompt is chunked: a request's tokens and logprobs are the
    # same bits alone or in any batch, in one process or split (CPU only; one linear
    # kernel for every batch size, attention over the KV in fixed parts). Peers must agree.
    deterministic: bool = False
    # CPU: this worker's seat in the core shares the launcher made for the workers it
    # planned on one host (engine.core_lending): it lends its share while it has no work
    # and borrows its neighbours' idle shares; "": its team stays as it started.
    core_seat: str = ""

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
        if self.num_threads < 0:
            raise ValueError(
                f"num_threads must be >= 0 (0: from the CPU budget), got {self.num_threads}"
            )
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.cpu_kernels not in CPU_KERNEL_MODES:
            raise ValueError(
                f"cpu_kernels must be one of {CPU_KERNEL_MODES}, got {self.cpu_kernels!r}"
            )
        if self.kv_growth_tokens < 0:
            raise ValueError(f"kv_growth_tokens must be >= 0, got {self.kv_growth_tokens}")
        if self.attention_fallback not in ("none", "torch"):
            raise ValueError(
                f"attention_fallback must be 'none' or 'torch', got {self.attention_fallback!r}"
            )
        if self.deterministic and self.device != "cpu":
            raise ValueError(f"deterministic mode runs on the CPU only, got device {self.device!r}")
        if self.deterministic and self.dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"deterministic mode needs dtype float32 or bfloat16, got {self.dtype!r}"
            )
        if self.max_prefill_tokens_while_decoding < 0:
            raise ValueError(
                "max_prefill_tokens_while_decoding must be >= 0, got "
                f"{self.max_prefill_tokens_while_decoding}"
            )
