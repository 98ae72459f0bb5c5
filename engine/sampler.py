"""Batched token sampling on the device: greedy, temperature, top-k, top-p, min-p, seeds,
logit bias, penalties, min_tokens, logprobs.

Sampling uses the exponential race (argmax of p / Exp(1) noise), which equals drawing
from p. A seeded request draws the noise of each output position from a generator
seeded by (seed, position) alone (``position_generator``), so its tokens depend neither
on which other requests share the batch nor on which process samples which position: a
prefill worker drawing position 0 and a decode worker drawing the rest give the tokens a
single process would.

A constrained row (``engine.guided``) has every token its grammar does not allow masked
to -inf before anything else; the other rows' logits are not touched, so they draw what
they would alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.kernels.ops import argmax_rows
from engine.request import TokenLogprob
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.guided import GrammarMasks

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed for output ``position`` of a request seeded with ``seed``.

    splitmix64 over both values, so neighbouring seeds and positions give unrelated
    streams (``seed + position`` would make seed 1 at position 0 repeat seed 0 at 1).
    """
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def position_generator(device: torch.device, seed: int, position: int) -> torch.Generator:
    """The generator that draws output ``position`` of a request seeded with ``seed``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(position_seed(seed, position))
    return gen


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one row of logits."""

    params: SamplingParams
    num_outputs: int  # tokens already produced before this one
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None
    # Prompt + output ids so far; only filled when the request uses penalties.
    token_ids: list[int] | None = None
    num_prompt_tokens: int = 0


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self._gen = torch.Generator(device=device)
        self._gen.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow], masks: GrammarMasks | None = None
    ) -> list[tuple[int, TokenLogprob | None]]:
        """logits: [S, V] float32 or the model's dtype, one row per entry of ``rows``;
        ``masks``: the tokens the constrained rows may take. Log-probabilities are the
        model's, before masks."""
        if logits.dtype != torch.float32:
            if masks is None and all(_plain_greedy(r) for r in rows):
                # Widening is exact and keeps the order: the argmax of the model's own
                # logits, without an fp32 copy of them (a step's whole vocabulary per row).
                return [(token, None) for token in argmax_rows(logits).tolist()]
            logits = logits.float()
        raw = logits
        edit = masks is not None or any(_needs_edit(r) for r in rows)
        logits = logits.clone() if edit else logits
        if masks is not None:
            index = torch.tensor(masks.rows, device=logits.device)
            logits[index] = logits[index].masked_fill(~masks.allowed, float("-inf"))
        for i, row in enumerate(rows):
            p = row.params
            if p.logit_bias:
                _apply_logit_bias(logits[i], p.logit_bias)
            if p.has_penalties and row.token_ids is not None:
                _apply_penalties(logits[i], row)
            if row.num_outputs < p.min_tokens:
                banned = set(p.stop_token_ids)
                if not p.ignore_eos:
                    banned |= row.eos_token_ids
                if banned:
                    logits[i, list(banned)] = float("-inf")
        if all(r.params.greedy for r in rows):
            chosen = argmax_rows(logits)
        else:
            chosen = self._sample(logits, rows)
        chosen_list = chosen.tolist()
        logprobs = self._logprobs(raw, chosen, rows)
        return list(zip(chosen_list, logprobs, strict=True))

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        greedy = torch.tensor([r.params.greedy for r in rows], device=logits.device)
        temps = torch.tensor(
            [r.params.temperature if not r.params.greedy else 1.0 for r in rows],
            device=logits.device,
            dtype=logits.dtype,
        )
        scaled = logits / temps.unsqueeze(1)
        top_k = [r.params.top_k for r in rows]
        if any(k > 0 for k in top_k):
            vocab = scaled.shape[1]
            ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=logits.device)
            kmax = int(ks.max())
            top_vals = scaled.topk(kmax, dim=-1).values
            thresh = top_vals.gather(1, (ks - 1).unsqueeze(1))
            scaled = scaled.masked_fill(scaled < thresh, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        top_p = [r.params.top_p for r in rows]
        if any(p < 1.0 for p in top_p):
            ps = torch.tensor(top_p, device=logits.device, dtype=probs.dtype).unsqueeze(1)
            sorted_p, order = probs.sort(dim=-1, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
            drop_sorted = (sorted_p.cumsum(dim=-1) - sorted_p) >= ps
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        min_p = [r.params.min_p for r in rows]
        if any(m > 0.0 for m in min_p):
            ms = torch.tensor(min_p, device=logits.device, dtype=probs.dtype).unsqueeze(1)
            probs = probs.masked_fill(probs < ms * probs.max(dim=-1, keepdim=True).values, 0.0)
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(
                (len(unseeded), probs.shape[1]), device=probs.device
            ).exponential_(generator=self._gen)
        for i, r in enumerate(rows):
            if r.generator is not None:
                noise[i].exponential_(generator=r.generator)
        sampled = argmax_rows(probs / noise)
        return torch.where(greedy, argmax_rows(logits), sampled)

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, chosen: torch.Tensor, rows: list[SamplingRow]
    ) -> list[TokenLogprob | None]:
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        out: list[TokenLogprob | None] = [None] * len(rows)
        if not wanted:
            return out
        lp = torch.log_softmax(raw[wanted], dim=-1)
        picked = chosen[wanted]
        chosen_lp = lp.gather(1, picked.unsqueeze(1)).squeeze(1)
        ranks = (lp > chosen_lp.unsqueeze(1)).sum(dim=1) + 1
        n_top = max(rows[i].params.logprobs or 0 for i in wanted)
        top_vals, top_ids = lp.topk(max(n_top, 1), dim=-1)
        for j, i in enumerate(wanted):
            n = rows[i].params.logprobs or 0
            out[i] = TokenLogprob(
                token_id=int(picked[j]),
                logprob=float(chosen_lp[j]),
                rank=int(ranks[j]),
                top=list(zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist(), strict=True)),
            )
        return out


def _plain_greedy(row: SamplingRow) -> bool:
    """Greedy, with no edit of its logits and no logprobs: its token is the argmax alone."""
    return row.params.greedy and row.params.logprobs is None and not _needs_edit(row)


def _needs_edit(row: SamplingRow) -> bool:
    p = row.params
    return bool(p.logit_bias) or p.has_penalties or row.num_outputs < p.min_tokens


def _apply_logit_bias(logits: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> None:
    """OpenAI's logit_bias, in place on one row: only the named tokens move, so a row
    without it (and every other row of the batch) samples exactly as it would alone."""
    ids = torch.tensor([t for t, _ in bias], device=logits.device, dtype=torch.long)
    values = torch.tensor([b for _, b in bias], device=logits.device, dtype=logits.dtype)
    logits.index_add_(0, ids, values)


def _apply_penalties(logits: torch.Tensor, row: SamplingRow) -> None:
    """Repetition (HF semantics over prompt + output), presence and frequency (OpenAI
    semantics over output only) penalties, in place on one row."""
    p = row.params
    assert row.token_ids is not None
    ids = torch.tensor(row.token_ids, device=logits.device, dtype=torch.long)
    if p.repetition_penalty != 1.0:
        seen = ids.unique()
        vals = logits[seen]
        logits[seen] = torch.where(
            vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
        )
    out_ids = ids[row.num_prompt_tokens :]
    if out_ids.numel() and (p.presence_penalty or p.frequency_penalty):
        counts = torch.bincount(out_ids, minlength=logits.shape[0]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
