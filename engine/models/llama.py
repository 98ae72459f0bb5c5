"""Native Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) over a flat ragged batch.

Parameter names follow HF, except that q/k/v and gate/up projections are packed into one
matmul each; ``packed_modules`` maps HF names onto the packed parameters and each packed
parameter's ``weight_loader`` writes its shard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.layers.attention import PagedAttention
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding


def _sharded_loader(offsets: dict[str, tuple[int, int]]) -> Callable:
    def load(param: torch.Tensor, loaded: torch.Tensor, shard: str) -> None:
        start, size = offsets[shard]
        if loaded.shape[0] != size:
            raise ValueError(f"shard {shard!r} has {loaded.shape[0]} rows, expected {size}")
        param.data[start : start + size].copy_(loaded)

    return load


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rope: RotaryEmbedding):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        offsets = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}
        self.qkv_proj.weight.weight_loader = _sharded_loader(offsets)  # type: ignore[attr-defined]
        if cfg.attention_bias:
            self.qkv_proj.bias.weight_loader = _sharded_loader(offsets)  # type: ignore[attr-defined]
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.rope = rope
        self.attn = PagedAttention(
            layer_idx,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            sliding_window=cfg.sliding_window(layer_idx),
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = hidden.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = self.rope(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=False)
        self.gate_up_proj.weight.weight_loader = _sharded_loader(  # type: ignore[attr-defined]
            {"gate": (0, inter), "up": (inter, inter)}
        )
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rope: RotaryEmbedding):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, rope)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        rope = RotaryEmbedding(
            cfg.head_dim,
            cfg.max_position_embeddings,
            cfg.rope_theta,
            dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        )
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rope) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    # HF name fragment -> (packed parameter fragment, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Final hidden states [T, hidden] of every token of the flat batch."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the parameters; returns the HF names consumed.

        Raises ValueError if a parameter of the model received nothing.
        """
        params = dict(self.named_parameters())
        filled: set[str] = set()
        seen: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue
            for frag, (packed, shard) in self.packed_modules.items():
                if f".{frag}." in name:
                    target = name.replace(f".{frag}.", f".{packed}.")
                    param = params.get(target)
                    if param is None:
                        raise ValueError(f"checkpoint tensor {name!r} has no home in the model")
                    param.weight_loader(param, tensor, shard)  # type: ignore[attr-defined]
                    filled.add(f"{target}:{shard}")
                    break
            else:
                param = params.get(name)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} has no home in the model")
                if param.shape != tensor.shape:
                    raise ValueError(
                        f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                        f"model expects {tuple(param.shape)}"
                    )
                param.data.copy_(tensor)
                filled.add(name)
            seen.add(name)
        missing = [
            n for n in params if n not in filled and not any(f.startswith(f"{n}:") for f in filled)
        ]
        if missing:
            raise ValueError(f"checkpoint is missing weights for {missing[:5]}")
        return seen
