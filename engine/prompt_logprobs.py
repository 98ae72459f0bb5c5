"""Log-probabilities of the prompt's own tokens (vLLM's ``prompt_logprobs``, OpenAI's
``echo`` with ``logprobs``): what the model assigned to each prompt token given the ones
before it, from the hidden states a prefill step computes anyway.

The model's distribution, untouched by temperature, penalties or logit bias, as vLLM
reports it. Rows go through the LM head a slice at a time, so a long prompt never holds
a [prompt length, vocabulary] logits tensor at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.request import TokenLogprob

if TYPE_CHECKING:
    from engine.scheduler import ScheduledSeq

# Rows per LM-head slice: 256 x a 128k vocabulary in fp32 is 128 MiB.
SLICE_ROWS = 256


@dataclass(frozen=True, slots=True)
class PromptRows:
    """Rows of a step's flat batch whose next token is a prompt token of a request that
    asked for prompt logprobs: ``count`` rows from ``row``, positions from ``seq.start``."""

    seq: ScheduledSeq
    row: int
    count: int


def prompt_logprob_rows(seqs: Sequence[ScheduledSeq]) -> list[PromptRows]:
    """The runners' flat layout (single-token seqs first, then each prompt chunk, each in
    ``seqs`` order) read for the seqs that want prompt logprobs. A position p predicts
    token p + 1, so the last prompt position (it predicts the first output) is left out."""
    decode = [s for s in seqs if s.num_new == 1]
    prefill = [s for s in seqs if s.num_new > 1]
    out: list[PromptRows] = []
    row = 0
    for seq in (*decode, *prefill):
        req = seq.request
        if req.params.prompt_logprobs is not None:
            count = min(seq.start + seq.num_new, req.num_prompt_tokens - 1) - seq.start
            if count > 0:
                out.append(PromptRows(seq, row, count))
        row += seq.num_new
    return out


def fill_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    wanted: Sequence[PromptRows],
    hidden: torch.Tensor,
) -> None:
    """Write each wanted seq's prompt logprobs into its request (``Request.prompt_logprobs``,
    entry j for prompt token j + 1), from the step's ``hidden`` states. On the thread that
    runs the step; the scheduler reads them once the step that completes the prompt is
    done."""
    for w in wanted:
        req = w.seq.request
        start = w.seq.start
        # A recomputed prompt (after a preemption) overwrites what an earlier pass wrote.
        del req.prompt_logprobs[start:]
        targets = req.prompt_token_ids[start + 1 : start + 1 + w.count]
        req.prompt_logprobs.extend(
            prompt_logprobs(
                compute_logits,
                hidden[w.row : w.row + w.count],
                targets,
                req.params.prompt_logprobs or 0,
            )
        )


def prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: Sequence[int],
    num_top: int,
) -> list[TokenLogprob]:
    """``hidden[j]`` is the state at a prompt position whose next token is ``targets[j]``;
    one TokenLogprob per row: that token's logprob and rank, and the ``num_top`` best."""
    assert hidden.shape[0] == len(targets), (hidden.shape, len(targets))
    out: list[TokenLogprob] = []
    for lo in range(0, len(targets), SLICE_ROWS):
        hi = min(lo + SLICE_ROWS, len(targets))
        lp = torch.log_softmax(compute_logits(hidden[lo:hi]).float(), dim=-1)
        picked = torch.tensor(targets[lo:hi], dtype=torch.long, device=lp.device)
        chosen = lp.gather(1, picked.unsqueeze(1)).squeeze(1)
        ranks = (lp > chosen.unsqueeze(1)).sum(dim=1) + 1
        top_vals, top_ids = lp.topk(max(num_top, 1), dim=-1)
        top_vals, top_ids = top_vals[:, :num_top].tolist(), top_ids[:, :num_top].tolist()
        for j, (tok, value, rank) in enumerate(
            zip(picked.tolist(), chosen.tolist(), ranks.tolist(), strict=True)
        ):
            out.append(
                TokenLogprob(tok, value, rank, list(zip(top_ids[j], top_vals[j], strict=True)))
            )
    return out
