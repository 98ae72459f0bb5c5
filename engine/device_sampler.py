"""Sampling for accelerators: the common rows with one host round trip a step.

``Sampler`` builds small tensors from Python lists and reads a maximum back from the
device; on a GPU each of those waits for the whole queued forward pass. Here rows that
ask only for greedy, temperature, top-k, top-p, min-p or a seed, without logprobs,
logit bias, penalties or min_tokens, take one path whose parameters travel in one pinned buffer
with one non-blocking copy; the only synchronisation left is reading the chosen tokens
back. Any other batch (a constrained row's too) goes to ``Sampler`` unchanged.

For such rows the result equals ``Sampler``'s: the same exponential race over the same
noise, drawn from the same generators in the same shapes and order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.request import TokenLogprob
from engine.sampler import Sampler, SamplingRow

if TYPE_CHECKING:
    from engine.guided import GrammarMasks

# Rows of the packed parameter buffer; _UNSEEDED lists the unseeded rows' indices.
_GREEDY, _TEMP, _TOP_K, _TOP_P, _MIN_P, _UNSEEDED = range(6)


def _plain(row: SamplingRow) -> bool:
    p = row.params
    return (
        p.logprobs is None
        and not p.logit_bias
        and not p.has_penalties
        and row.num_outputs >= p.min_tokens
    )


class DeviceSampler(Sampler):
    def __init__(self, device: torch.device, seed: int):
        super().__init__(device, seed)
        self.device = device
        self._pin = device.type == "cuda"
        self._host = torch.empty((6, 0), dtype=torch.float32)

    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow], masks: GrammarMasks | None = None
    ) -> list[tuple[int, TokenLogprob | None]]:
        if masks is not None or not all(_plain(r) for r in rows):
            return super().__call__(logits, rows, masks)
        if all(r.params.greedy for r in rows):
            chosen = logits.argmax(dim=-1)
        else:
            chosen = self._sample_plain(logits, rows)
        return [(token, None) for token in chosen.tolist()]

    def _params(self, rows: list[SamplingRow], unseeded: list[int]) -> torch.Tensor:
        """[6, rows] float32 on the device: greedy flag, temperature, top-k, top-p, min-p,
        then the unseeded rows' indices (exact in fp32 for any batch we run)."""
        n = len(rows)
        if self._host.shape[1] < n:
            self._host = torch.empty((6, max(n, 64)), dtype=torch.float32, pin_memory=self._pin)
        host = self._host[:, :n]
        host.numpy()[:] = [
            [float(r.params.greedy) for r in rows],
            [1.0 if r.params.greedy else r.params.temperature for r in rows],
            [float(r.params.top_k) for r in rows],
            [r.params.top_p for r in rows],
            [r.params.min_p for r in rows],
            [float(i) for i in unseeded] + [0.0] * (n - len(unseeded)),
        ]
        # The next step refills the host buffer only after this step's tokens were read
        # back, which orders it after this copy.
        return host.to(self.device, non_blocking=True)

    def _sample_plain(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        params = self._params(rows, unseeded)
        vocab = logits.shape[1]
        scaled = logits / params[_TEMP].unsqueeze(1)
        top_k = [r.params.top_k for r in rows]
        if any(0 < k < vocab for k in top_k):
            kmax = max(k for k in top_k if 0 < k < vocab)  # from the host: no read-back
            ks = params[_TOP_K].long()
            limited = (ks > 0) & (ks < vocab)
            index = torch.where(limited, ks, kmax).clamp(max=kmax) - 1
            thresh = scaled.topk(kmax, dim=-1).values.gather(1, index.unsqueeze(1))
            thresh = thresh.masked_fill(~limited.unsqueeze(1), float("-inf"))
            scaled = scaled.masked_fill(scaled < thresh, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if any(r.params.top_p < 1.0 for r in rows):
            ps = params[_TOP_P].unsqueeze(1)
            sorted_p, order = probs.sort(dim=-1, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
            drop_sorted = (sorted_p.cumsum(dim=-1) - sorted_p) >= ps
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        if any(r.params.min_p > 0.0 for r in rows):
            ms = params[_MIN_P].unsqueeze(1)
            probs = probs.masked_fill(probs < ms * probs.max(dim=-1, keepdim=True).values, 0.0)
        if len(unseeded) == len(rows):
            noise = torch.empty_like(probs).exponential_(generator=self._gen)
        else:
            noise = torch.empty_like(probs)
            if unseeded:
                index = params[_UNSEEDED, : len(unseeded)].long()
                drawn = torch.empty((len(unseeded), probs.shape[1]), device=probs.device)
                noise.index_copy_(0, index, drawn.exponential_(generator=self._gen))
            for i, r in enumerate(rows):
                if r.generator is not None:
                    noise[i].exponential_(generator=r.generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(params[_GREEDY] > 0, logits.argmax(dim=-1), sampled)
