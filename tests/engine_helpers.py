"""Small builders for engine tests: an EngineCore on a given checkpoint, HF references."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.engine_core import EngineCore


def make_core(model: Path | str, *, kv_pool_factory: Any = None, **overrides: Any) -> EngineCore:
    fields: dict[str, Any] = {
        "model": str(model),
        "dtype": "float32",
        "num_blocks": 256,
        "max_num_seqs": 32,
        "max_num_batched_tokens": 256,
    }
    fields.update(overrides)
    return EngineCore(EngineConfig(**fields), kv_pool_factory=kv_pool_factory, show_progress=False)


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
        out = model(input_ids=ids, cache=past, use_cache=True, logits_to_keep=1)
        past = out.cache
        step = out.logits[0, -1].float()
        logits.append(step)
        nxt = int(step.argmax())
        tokens.append(nxt)
        ids = torch.tensor([[nxt]])
    return tokens, torch.stack(logits)


# Prompts per batch of hf_greedy_many: a batch-1 HF decode step on CPU reads every weight
# for one token, so up to here a batch costs about what one prompt does.
HF_BATCH = 8


@torch.inference_mode()
def hf_greedy_many(
    model: Any, prompts: list[list[int]], max_new_tokens: int
) -> list[tuple[list[int], torch.Tensor]]:
    """``hf_greedy`` of each prompt, in order, run as left-padded batches of prompts of
    similar length (HF_BATCH at a time) with an attention mask and explicit positions.

    A padded row's logits equal its own unpadded forward's up to fp32 summation order
    (the masked keys add exact zeros), which ``compare_greedy``'s tie margin covers.
    """
    results: list[tuple[list[int], torch.Tensor] | None] = [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for start in range(0, len(order), HF_BATCH):
        rows = order[start : start + HF_BATCH]
        width = max(len(prompts[i]) for i in rows)
        ids = torch.tensor([[0] * (width - len(prompts[i])) + prompts[i] for i in rows])
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in rows])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        past = None
        steps: list[torch.Tensor] = []
        for _ in range(max_new_tokens):
            out = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                cache=past,
                use_cache=True,
                logits_to_keep=1,
            )
            past = out.cache
            step = out.logits[:, -1].float()
            steps.append(step)
            ids = step.argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
            positions = positions[:, -1:] + 1
        logits = torch.stack(steps, dim=1)  # [rows, steps, vocab]
        for r, i in enumerate(rows):
            results[i] = ([int(t) for t in logits[r].argmax(-1)], logits[r])
    return [r for r in results if r is not None]


# A divergence from HF counts as a tie only where HF's two best logits are this close:
# fp32 forwards that sum in another order differ by ~1e-5 relative (logits of ~20 move by
# ~2e-4), so 1e-3 covers summation order and nothing a real bug would produce.
TIE_MARGIN = 1e-3


def compare_greedy(
    ours: list[int], ref: list[int], ref_logits: torch.Tensor, margin: float = TIE_MARGIN
) -> str:
    """'equal', 'tie' or 'mismatch' for a greedy continuation against HF's.

    At the first divergence, 'tie' needs HF's top two logits within ``margin`` of each
    other and our token to be within ``margin`` of HF's best; any other divergence (and
    a length difference) is a 'mismatch'. Nothing after a tie is compared: from there
    the two continuations condition on different tokens.
    """
    for i, (a, b) in enumerate(zip(ours, ref, strict=False)):
        if a != b:
            step = ref_logits[i]
            top2 = step.topk(2).values
            near_tie = float(top2[0] - top2[1]) <= margin
            ours_close = float(top2[0] - step[a]) <= margin
            return "tie" if near_tie and ours_close else "mismatch"
    return "equal" if len(ours) == len(ref) else "mismatch"
