"""Small builders for engine tests: an EngineCore on a given checkpoint, HF references."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.engine_core import EngineCore


def make_core(model: Path | str, **overrides: Any) -> EngineCore:
    fields: dict[str, Any] = {
        "model": str(model),
        "dtype": "float32",
        "num_blocks": 256,
        "max_num_seqs": 32,
        "max_num_batched_tokens": 256,
    }
    fields.update(overrides)
    return EngineCore(EngineConfig(**fields), show_progress=False)


def hf_model(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """HF greedy continuation of one prompt and its per-step logits.

    A plain argmax loop over HF's own forward and KV cache: unlike ``generate`` with
    ``min_new_tokens`` it never masks EOS, which matches ``ignore_eos`` semantics (EOS may
    be produced; it just doesn't stop the request).
    """
    ids = torch.tensor([prompt])
    past = None
    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    for _ in range(max_new_tokens):
        out = model(input_ids=ids, cache=past, use_cache=True)
        past = out.cache
        step = out.logits[0, -1].float()
        logits.append(step)
        nxt = int(step.argmax())
        tokens.append(nxt)
        ids = torch.tensor([[nxt]])
    return tokens, torch.stack(logits)


def compare_greedy(ours: list[int], ref: list[int], ref_logits: torch.Tensor) -> str:
    """'equal', 'tie' (first divergence is within HF's top-5 there), or 'mismatch'."""
    for i, (a, b) in enumerate(zip(ours, ref, strict=False)):
        if a != b:
            top5 = ref_logits[i].topk(5).indices.tolist()
            return "tie" if a in top5 else "mismatch"
    return "equal" if len(ours) == len(ref) else "mismatch"
