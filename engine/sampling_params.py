"""Per-request sampling parameters and their validation (the one place user values are checked).

Torch-free: the gateway and rpc/ build these from the wire and the engine consumes them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from engine.constraint import Constraint

MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 64
# OpenAI's own bounds on logit_bias: at most 300 entries, each bias in [-100, 100].
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_LIMIT = 100.0
# Most choices one request may ask for (``n``): each is a decode sequence of its own.
MAX_N = 16


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each new token and when to stop.

    ``temperature == 0`` means greedy. ``top_k == 0`` and ``top_p == 1`` disable those
    filters. ``seed`` makes a sampled request reproducible regardless of batch company.

    ``output_offset`` is set only on a request that moved between decode workers
    (``gateway.routing.migration``): its prompt ends with the ``output_offset`` tokens it had
    already produced, and ``max_tokens``/``min_tokens`` are what was left of them. Seeded
    draws, the output-only penalties and the ``constraint``'s state count from the original
    output's start, so the moved request samples as it would have where it was.

    ``constraint`` (``engine.constraint``): the output must match it; every other token is
    masked before sampling.

    ``logit_bias`` holds (token id, bias) pairs, added to those tokens' logits before
    penalties, temperature and the filters; it is kept sorted by token id, so equal biases
    give equal records (and equal hand-off tags) however the client ordered them.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; n >= 0: chosen token + top-n
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    output_offset: int = 0
    constraint: Constraint | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    # None: none; k >= 0: the log-probability of every prompt token after the first (the
    # model's own, as vLLM's ``prompt_logprobs``) and its top-k alternatives.
    prompt_logprobs: int | None = None
    # Choices to generate from the one prompt (OpenAI's ``n``). The engine runs one
    # sequence per request: the decode worker fans a request out into ``choice(i)``s.
    n: int = 1

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_float("temperature", self.temperature, low=0.0)
        _check_int("top_k", self.top_k, low=0)
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, low=0)
            if self.seed >= 2**63:
                raise ValueError(f"seed must be < 2**63, got {self.seed!r}")
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids has {len(self.stop_token_ids)} entries; at most "
                f"{MAX_STOP_TOKEN_IDS} allowed"
            )
        for tok in self.stop_token_ids:
            _check_int("stop_token_ids[]", tok, low=0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0)
            if self.logprobs > MAX_LOGPROBS:
                raise ValueError(f"logprobs must be <= {MAX_LOGPROBS}, got {self.logprobs!r}")
        _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        _check_float("presence_penalty", self.presence_penalty)
        _check_float("frequency_penalty", self.frequency_penalty)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        _check_int("output_offset", self.output_offset, low=0)
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise ValueError(f"constraint must be a Constraint, got {self.constraint!r}")
        self._check_logit_bias()
        _check_int("n", self.n, low=1)
        if self.n > MAX_N:
            raise ValueError(f"n must be <= {MAX_N}, got {self.n!r}")
        if self.seed is not None and self.seed + self.n - 1 >= 2**63:
            raise ValueError(
                f"seed + n - 1 must be < 2**63 (choice i draws with seed + i), got {self.seed!r}"
            )
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0)
            if self.prompt_logprobs > MAX_LOGPROBS:
                raise ValueError(
                    f"prompt_logprobs must be <= {MAX_LOGPROBS}, got {self.prompt_logprobs!r}"
                )

    def _check_logit_bias(self) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS} allowed"
            )
        pairs = []
        for pair in self.logit_bias:
            if not isinstance(pair, tuple | list) or len(pair) != 2:
                raise ValueError(f"logit_bias entries must be (token id, bias) pairs, got {pair!r}")
            token, bias = pair
            _check_int("logit_bias token id", token, low=0)
            _check_float(f"logit_bias[{token}]", bias)
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(
                    f"logit_bias[{token}] must be in [-{LOGIT_BIAS_LIMIT:g}, "
                    f"{LOGIT_BIAS_LIMIT:g}], got {bias!r}"
                )
            pairs.append((token, float(bias)))
        pairs.sort()
        for (a, _), (b, _) in zip(pairs, pairs[1:], strict=False):
            if a == b:
                raise ValueError(f"logit_bias names token {a} more than once")
        # Frozen: the canonical (sorted, float) form is set once, here.
        object.__setattr__(self, "logit_bias", tuple(pairs))

    def choice(self, index: int) -> SamplingParams:
        """The parameters of choice ``index`` of ``n``: one sequence, seeded ``seed +
        index`` (as vLLM seeds its parallel samples), so a seeded choice draws what a
        single request with that seed would. Only choice 0 gets the prompt logprobs."""
        assert 0 <= index < self.n, (index, self.n)
        return dataclasses.replace(
            self,
            n=1,
            seed=None if self.seed is None else self.seed + index,
            prompt_logprobs=self.prompt_logprobs if index == 0 else None,
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate_vocab(self, vocab_size: int) -> None:
        """Token ids named by the request must exist in the model's vocabulary."""
        for tok in self.stop_token_ids:
            if tok >= vocab_size:
                raise ValueError(
                    f"stop_token_ids contains {tok}, outside the vocabulary [0, {vocab_size})"
                )
        for tok, _ in self.logit_bias:
            if tok >= vocab_size:
                raise ValueError(
                    f"logit_bias names token {tok}, outside the vocabulary [0, {vocab_size})"
                )


def _check_int(name: str, value: object, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")


def _check_float(name: str, value: object, *, low: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")
