"""Native Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) over a flat ragged batch.

Parameter names follow HF, except that q/k/v and gate/up projections are packed into one
matmul each; ``packed_modules`` maps HF names onto the packed parameters and each packed
parameter's ``weight_loader`` writes its shard.

On CPU the model runs the fast paths of ``engine.kernels.ops`` (measured in
``benchmarks/decode_step.py``): linear layers through the bf16 GEMV kernel for a few rows
and oneDNN-prepacked weights above (``prepare_fast_path`` packs them once the weights are
final), SiLU-and-multiply in one op, and, for decode-only steps, the whole decoder stack as one
compiled call (``ops.decode_stack``; each layer alone, ``ops.decode_layer``, when a layer
is off its fused path). Every module keeps its plain-torch twin behind a
``use_kernel`` attribute: ``set_fast_path(False)`` runs the model on the twins alone,
which is what parity tests compare the fast path against.

``set_deterministic`` puts the model in deterministic mode (``--deterministic``): one
linear kernel for every batch size (``engine.kernels.route_table.deterministic_table``,
enforced: a layer it does not serve raises rather than falling back to a kernel chosen by
the rows) and the attention's fixed KV split for prefill and decode rows alike, so each
row's bits depend on its own tokens alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.forward_context import get_forward_context
from engine.huge_pages import HugePageArena, on_an_arena
from engine.kernels import ops
from engine.kernels.route_table import (
    DETERMINISTIC_SOURCE,
    FLASH,
    LAYER_CLASSES,
    LM_HEAD_CLASSES,
    ONEDNN,
    PANELS,
    PREFILL_ATTENTION,
    WIDE,
    RouteTable,
)
from engine.layers.attention import PagedAttention, decode_context_lens, prefill_probe
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding


def _sharded_loader(offsets: dict[str, tuple[int, int]]) -> Callable:
    def load(param: torch.Tensor, loaded: torch.Tensor, shard: str) -> None:
        start, size = offsets[shard]
        if loaded.shape[0] != size:
            raise ValueError(f"shard {shard!r} has {loaded.shape[0]} rows, expected {size}")
        param.data[start : start + size].copy_(loaded)

    return load


def _onto_huge_pages(slots: list[tuple[Any, str]]) -> None:
    """Move each CPU tensor ``getattr(owner, name)`` of ``slots`` that is not in a
    huge-page arena yet into one new arena, one at a time, so that each original is
    freed before the next is copied (the peak is the largest one, not all of them)."""
    moving = [
        (owner, name)
        for owner, name in slots
        if getattr(owner, name).device.type == "cpu" and not on_an_arena(getattr(owner, name))
    ]
    arena = HugePageArena.for_tensors([getattr(owner, name) for owner, name in moving])
    if arena is None:
        return
    for owner, name in moving:
        setattr(owner, name, arena.place(getattr(owner, name).contiguous()))


class Linear(nn.Linear):
    """``nn.Linear`` that takes ``ops.linear``'s fast path on CPU (``use_kernel``).

    ``prepack`` keeps a oneDNN-prepacked copy of the weight (a second copy in memory), its
    panels for decode-sized batches (``ops.pack_panels``: bf16 pairs or fp32) and, for a
    bf16 layer that sees large batches (``wide``: prefill chunks), an fp32 oneDNN copy
    too; call it again whenever the weight's values or dtype change. A stale or missing
    copy is never used for another dtype: ``ops.linear`` then runs ``F.linear``.
    ``routes`` (a measured ``RouteTable``, or None for the constants of ``ops.linear``)
    names the kernel for each batch size; ``drop_unrouted`` frees the copies it never uses.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__(in_features, out_features, bias=bias)
        self.use_kernel = True
        # False for layers that only ever see a few rows (the LM head: sampled rows).
        self.wide = True
        # The LM head's batches have row classes of their own (route_table.LM_HEAD_CLASSES).
        self.is_lm_head = False
        self.routes: RouteTable | None = None
        # Deterministic mode: the route must serve every call (``ops.linear``'s strict).
        self.strict = False
        self.packed: torch.Tensor | None = None
        self.packed_wide: torch.Tensor | None = None
        self.panels: torch.Tensor | None = None

    def _routed(self, route: str) -> bool:
        """Whether ``routes`` may run this layer on ``route`` (every route without a
        measured table)."""
        if self.routes is None or self.routes.constants:
            return True
        return self.routes.uses(route, LM_HEAD_CLASSES if self.is_lm_head else LAYER_CLASSES)

    def drop_unrouted(self) -> None:
        """Free the copies no row class of ``routes`` runs on (they can be half again to
        twice the model's size); a later ``prepack`` makes them again."""
        if not self._routed(PANELS):
            self.panels = None
        if not self._routed(ONEDNN):
            self.packed = None
        if not self._routed(WIDE):
            self.packed_wide = None

    def prepack(self, panels: bool = True) -> None:
        """Make the copies: only those ``routes`` runs on when it is set (so a start whose
        routes are cached or forced never holds the others, not even at its peak)."""
        fast = self.use_kernel
        self.packed = ops.pack_linear_weight(self.weight) if fast and self._routed(ONEDNN) else None
        panels = fast and panels and self._routed(PANELS)
        self.panels = ops.pack_panels(self.weight) if panels else None
        wide = fast and self.wide and self.weight.dtype == torch.bfloat16 and self._routed(WIDE)
        self.packed_wide = ops.pack_linear_weight(self.weight, wide=True) if wide else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernel:
            route = None
            routes = self.routes
            if routes is not None and not routes.constants and x.dim() == 2:
                rows = x.shape[0]
                route = routes.lm_head_route(rows) if self.is_lm_head else routes.layer_route(rows)
            return ops.linear(
                x, self.weight, self.bias, self.packed, self.packed_wide, self.panels, route,
                strict=self.strict,
            )  # fmt: skip
        if self.strict:
            raise RuntimeError("deterministic mode needs the compiled linear kernels")
        return F.linear(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rope: RotaryEmbedding):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        offsets = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}
        self.qkv_proj.weight.weight_loader = _sharded_loader(offsets)  # type: ignore[attr-defined]
        if cfg.attention_bias:
            self.qkv_proj.bias.weight_loader = _sharded_loader(offsets)  # type: ignore[attr-defined]
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=False)
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
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, bias=False)
        self.gate_up_proj.weight.weight_loader = _sharded_loader(  # type: ignore[attr-defined]
            {"gate": (0, inter), "up": (inter, inter)}
        )
        self.down_proj = Linear(inter, cfg.hidden_size, bias=False)
        self.use_kernel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.use_kernel:
            return self.down_proj(ops.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rope: RotaryEmbedding):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, rope)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.use_kernel = True
        # ``ops.route_codes`` of the model's route table for the compiled layer; (): constants.
        self.route_codes: tuple[int, ...] = ()

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        if self.use_kernel:
            fused = self._fused_decode(positions, hidden)
            if fused is not None:
                return fused
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def _fused_decode(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor | None:
        """The whole layer as one compiled call for a decode-only step, else None."""
        attn = self.self_attn
        ctx = get_forward_context()
        meta = ctx.attn
        if meta.prefills or meta.num_decode != hidden.shape[0] or not attn.attn.use_kernel:
            return None
        w = self.fused_weights()
        return ops.decode_layer(
            hidden, positions, ctx.kv_cache, attn.attn.layer_idx, meta.slot_mapping,
            meta.decode_block_tables, decode_context_lens(meta), attn.rope.cos, attn.rope.sin,
            w["in_norm"], w["qkv"], w["qkv_bias"], w["o"], w["post_norm"], w["gate_up"],
            w["down"], attn.num_heads, w["eps"], w["scale"], packed=w["packed"],
            window=w["window"], routes=self.route_codes, split=attn.attn.split,
        )  # fmt: skip

    def fused_weights(self) -> dict[str, Any]:
        """What the fused kernels take of this layer (``ops.decode_layer``'s weights, and
        one entry of ``ops.make_decode_stack``)."""
        attn, mlp = self.self_attn, self.mlp
        return {
            "in_norm": self.input_layernorm.weight, "qkv": attn.qkv_proj.weight,
            "qkv_bias": attn.qkv_proj.bias, "o": attn.o_proj.weight,
            "post_norm": self.post_attention_layernorm.weight,
            "gate_up": mlp.gate_up_proj.weight, "down": mlp.down_proj.weight,
            "packed": (attn.qkv_proj.packed, attn.o_proj.packed, mlp.gate_up_proj.packed,
                       mlp.down_proj.packed, attn.qkv_proj.panels, attn.o_proj.panels,
                       mlp.gate_up_proj.panels, mlp.down_proj.panels),
            "window": attn.attn.sliding_window, "eps": self.input_layernorm.eps,
            "scale": attn.attn.scale,
        }  # fmt: skip


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        # Every layer's weights for one fused call per decode-only step; set by
        # ``prepare_fast_path`` when every layer is on its fused path, else None. Used
        # while every layer still is.
        self.decode_stack: ops.DecodeStack | None = None
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
        stacked = self._fused_decode_stack(positions, hidden)
        if stacked is not None:
            return self.norm(stacked)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)

    def _fused_decode_stack(
        self, positions: torch.Tensor, hidden: torch.Tensor
    ) -> torch.Tensor | None:
        """Every layer in one compiled call for a decode-only step, else None."""
        stack = self.decode_stack
        if stack is None or not all(
            layer.use_kernel and attn.use_kernel for layer, attn in self._kernel_modules()
        ):  # a module switched to its twin since the stack was made
            return None
        ctx = get_forward_context()
        meta = ctx.attn
        if meta.prefills or meta.num_decode != hidden.shape[0]:
            return None
        rope = self.layers[0].self_attn.rope
        return ops.decode_stack(
            stack, hidden, positions, ctx.kv_cache, meta.slot_mapping, meta.decode_block_tables,
            decode_context_lens(meta), rope.cos, rope.sin,
        )  # fmt: skip

    def _kernel_modules(self) -> list[tuple[DecoderLayer, nn.Module]]:
        """Each layer with its attention kernel module, looked up once: reading them
        through nn.Module's attribute lookup every step cost ~60 us at batch 1."""
        pairs = self.__dict__.get("_kernel_pairs")
        if pairs is None or len(pairs) != len(self.layers):
            pairs = [(layer, layer.self_attn.attn) for layer in self.layers]
            self.__dict__["_kernel_pairs"] = pairs
        return pairs

    def make_decode_stack(self) -> ops.DecodeStack | None:
        """The fused stack of every layer, or None unless each layer would take its own
        fused path (``use_kernel`` on the layer and its attention)."""
        if not all(layer.use_kernel and layer.self_attn.attn.use_kernel for layer in self.layers):
            return None
        layers = [layer.fused_weights() for layer in self.layers]
        cfg = self.config
        routes = self.layers[0].route_codes if self.layers else ()
        split = self.layers[0].self_attn.attn.split if self.layers else 0
        return ops.make_decode_stack(
            layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, routes, split
        )


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
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # It only sees the sampled rows of a step: a widened copy pays only where oneDNN
        # has no bf16 GEMM (route_table.candidates offers it there), and routes decide.
        self.lm_head.wide = not ops.onednn_serves(torch.bfloat16)
        self.lm_head.is_lm_head = True
        # The kernel of each row class (``set_kernel_routes``); None: ops' constants.
        self.kernel_routes: RouteTable | None = None
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Whether ``prepare_fast_path`` packs panels (EngineConfig.linear_panels).
        self.linear_panels = True
        # What each module chose for itself (kernel availability, shapes it serves).
        self._fast_defaults = {
            name: mod.use_kernel for name, mod in self.named_modules() if hasattr(mod, "use_kernel")
        }

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Final hidden states [T, hidden] of every token of the flat batch."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def set_fast_path(self, enabled: bool) -> None:
        """Run every module on its fast path where one applies (True) or on the plain-torch
        twins alone (False); packs or drops the prepacked weights to match."""
        for name, mod in self.named_modules():
            if name in self._fast_defaults:
                mod.use_kernel = enabled and self._fast_defaults[name]
        self.prepare_fast_path()

    def prepare_fast_path(self) -> None:
        """(Re)pack the linear weights for oneDNN (and as panels, unless
        ``linear_panels`` is False) and gather the fused decode stack. Call after the
        weights are loaded and cast to their final dtype and device; a no-op for layers on
        their torch twin."""
        self._weights_on_huge_pages()
        for mod in self.modules():
            if isinstance(mod, Linear):
                mod.prepack(panels=self.linear_panels)
        self._apply_routes()

    def _weights_on_huge_pages(self) -> None:
        """Move the linear layers' weights (the LM head's, and so a tied embedding's,
        included) into a huge-page arena on CPU: batch-1 decode streams them all every
        step, and on small pages the GEMV kernel read them 1.2x slower (``python -m
        benchmarks.gemv_read``)."""
        weights: dict[int, nn.Parameter] = {}
        for mod in self.modules():
            if isinstance(mod, Linear) and mod.use_kernel and mod.weight.device.type == "cpu":
                weights.setdefault(id(mod.weight), mod.weight)
        _onto_huge_pages([(w, "data") for w in weights.values()])

    def _panels_on_huge_pages(self) -> None:
        """Move the panels the routes run on into a huge-page arena, as the weights.
        Only once the routes are set: a measurement's copies are dropped after it, and a
        dropped copy cannot give its part of an arena back."""
        if self.kernel_routes is None or self.kernel_routes.constants:
            return
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        _onto_huge_pages([(m, "panels") for m in linears if m.panels is not None])

    def set_deterministic(self, split: int) -> None:
        """Deterministic mode with the attention's KV split of ``split`` tokens (0: off).
        Set the deterministic route table first (``set_kernel_routes``). Raises
        ValueError where a module cannot run it (its compiled kernel does not serve it)."""
        on = split > 0
        table = self.kernel_routes
        if on and (table is None or table.source != DETERMINISTIC_SOURCE):
            raise ValueError("deterministic mode needs the deterministic kernel route table")
        for mod in self.modules():
            if isinstance(mod, Linear):
                mod.strict = on
            elif isinstance(mod, PagedAttention):
                if on and not mod.use_kernel:
                    raise ValueError(
                        "deterministic mode needs the compiled CPU attention kernel: head_dim "
                        f"{mod.head_dim} (a multiple of 16, at most 256), {mod.group} query "
                        "heads per KV head (at most 16), and the kernels built "
                        "(BATON_CPU_KERNELS not 0)"
                    )
                mod.split = split
            elif isinstance(mod, (RMSNorm, RotaryEmbedding, MLP)) and on and not mod.use_kernel:
                raise ValueError(
                    f"deterministic mode needs the compiled CPU kernels ({type(mod).__name__})"
                )
        self.model.decode_stack = self.model.make_decode_stack()

    def linear_layers(self) -> tuple[list[list[Linear]], Linear]:
        """Each decoder layer's linear layers (qkv, o, gate_up, down), and the LM head:
        what ``engine.kernels.route_bench`` times."""
        layers = [
            [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
             layer.mlp.down_proj]
            for layer in self.model.layers
        ]  # fmt: skip
        return layers, self.lm_head

    def prefill_attention_probe(
        self, route: str, rows: int, block_size: int
    ) -> Callable[[], object] | None:
        """One call of the first layer's prompt-chunk attention on ``route``, for the
        kernel route timer (``engine.layers.attention.prefill_probe``)."""
        attn = self.model.layers[0].self_attn.attn
        return prefill_probe(attn, route, rows, block_size, self.lm_head.weight.dtype)

    def set_kernel_routes(self, table: RouteTable | None) -> None:
        """Run each linear layer on ``table``'s route for its row class (None: the
        constants of ``ops.linear``) and free the weight copies no route uses. Set before
        ``prepare_fast_path`` (a cached or forced table), only the copies it uses are
        ever made; to measure a table, ``prepare_fast_path`` without one first packs
        every copy the routes are chosen among."""
        self.kernel_routes = table
        self._apply_routes()

    def _apply_routes(self) -> None:
        self._route_linear_layers()
        self._panels_on_huge_pages()
        self.model.decode_stack = self.model.make_decode_stack()

    def _route_linear_layers(self) -> None:
        table = self.kernel_routes
        codes: tuple[int, ...] = ()
        prefill_route = FLASH
        if table is not None and not table.constants:
            codes = ops.route_codes(*(table.routes[c] for c in LAYER_CLASSES))
            prefill_route = table.routes.get(PREFILL_ATTENTION, FLASH)
        for mod in self.modules():
            if isinstance(mod, Linear):
                mod.routes = table
                mod.drop_unrouted()
            elif isinstance(mod, DecoderLayer):
                mod.route_codes = codes
            elif isinstance(mod, PagedAttention):
                mod.prefill_route = prefill_route

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
