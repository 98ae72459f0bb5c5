"""``echo`` with ``max_tokens: 0`` on /v1/completions (what evaluation harnesses send for
log-likelihood: the prompt back with its logprobs, and nothing generated).

The request runs as an ordinary one with ``max_tokens`` 1: the prefill worker computes
the prompt's logprobs in its prompt pass and samples the one token every prefill samples
(from logits it computed anyway), the first token finishes the request on the decode
worker, which runs no decode step for it. What this module does is keep that token from
the client: every delta loses its token ids, text and logprobs, the finish reason is
``length`` (max_tokens 0 reached), and usage counts no completion token. The prompt's
logprobs, which come with the first delta, are all that is left.
"""

from __future__ import annotations

import dataclasses

from engine.request import FinishReason
from gateway.text.output_processor import GenerateDelta

# What the request asks downstream for: the fewest tokens a request can generate.
DOWNSTREAM_MAX_TOKENS = 1


def prompt_only(delta: GenerateDelta) -> GenerateDelta:
    """``delta`` with the generated token taken out."""
    usage = delta.usage
    if usage is not None:
        usage = dataclasses.replace(usage, completion_tokens=0)
    return dataclasses.replace(
        delta,
        token_ids=[],
        text="",
        logprobs=[],
        finish_reason=FinishReason.LENGTH if delta.finished else None,
        stop_string=None,
        usage=usage,
    )
