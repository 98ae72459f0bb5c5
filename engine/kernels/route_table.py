"""Which kernel each class of CPU linear layer (and prompt-chunk attention) runs on: the
classes, the candidates, and picking the fastest of measured candidates. Torch-free;
the timings come from a timer that the caller injects (``engine.kernels.route_bench``
times the real weights).

A linear layer's rows decide its class: a few rows (batch-1 and small decode steps),
decode batches, prefill chunks; the LM head has its own two classes, since its weight
(vocabulary x hidden) is the largest and it only sees the sampled rows. Prompt chunks'
attention is a class too: the compiled flash-style kernel or torch's SDPA, whose bf16
path runs on AMX tiles where the CPU has them. Each class runs on one route.
``default_routes`` is what the hand-tuned constants of ``engine.kernels.ops`` pick; a
measured route replaces a class's default only when it is faster by more than
``margin``, so timing noise cannot flip a choice away from it.

Deterministic mode (``deterministic_table``) gives up the per-class choice: every linear
class runs on one kernel whose reduction order for a row does not depend on how many rows
share the call, so a token's bits do not depend on its batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

# Routes, by name (labels in logs, Stats and metrics):
GEMV = "gemv"  # the AVX512-BF16 GEMV kernel (bf16 only)
# the panel kernel on panel-packed weights (bf16 pairs on the bf16 dot product, else the
# weight's own dtype, computed in fp32)
PANELS = "panels"
# oneDNN's matmul on the prepacked weight in the layer's dtype (AMX for bf16 where the CPU
# has it and oneDNN's ISA cap allows it)
ONEDNN = "onednn"
WIDE = "wide"  # bf16 widened to an fp32 oneDNN GEMM on a prepacked fp32 copy
TORCH = "torch"  # F.linear; for prefill attention, torch's SDPA
FLASH = "flash"  # prefill attention: the compiled kernel (csrc/prefill_attention.h)
LINEAR_ROUTES = (GEMV, PANELS, ONEDNN, WIDE, TORCH)
ROUTES = LINEAR_ROUTES + (FLASH,)

# --cpu-kernels: auto = cached table or measure; measure = always measure; default = the
# constants; onednn / torch = every class on that route.
MODES = ("auto", "measure", "default", "onednn", "torch")  # engine.config.CPU_KERNEL_MODES

# Row classes of the decoder's linear layers and of the LM head.
GEMV_ROWS = "gemv"
DECODE_ROWS = "decode"
PREFILL_ROWS = "prefill"
LM_HEAD_GEMV_ROWS = "lm_head_gemv"
LM_HEAD_ROWS = "lm_head"
PREFILL_ATTENTION = "prefill_attention"
LAYER_CLASSES = (GEMV_ROWS, DECODE_ROWS, PREFILL_ROWS)
LM_HEAD_CLASSES = (LM_HEAD_GEMV_ROWS, LM_HEAD_ROWS)
LINEAR_CLASSES = LAYER_CLASSES + LM_HEAD_CLASSES
ROW_CLASSES = LINEAR_CLASSES + (PREFILL_ATTENTION,)

# Class bounds, in rows (the constants of engine.kernels.ops: GEMV_MAX_ROWS,
# PANEL_MAX_ROWS): up to 4 rows, up to 64, above.
GEMV_MAX_ROWS = 4
DECODE_MAX_ROWS = 64

# A candidate displaces the class's default only if it takes less than (1 - margin) of
# the default's time: 10% is above the run-to-run spread of these timings on a quiet host.
DEFAULT_MARGIN = 0.10


def layer_class(rows: int) -> str:
    """The row class of a decoder linear layer run on ``rows`` rows."""
    if rows <= GEMV_MAX_ROWS:
        return GEMV_ROWS
    return DECODE_ROWS if rows <= DECODE_MAX_ROWS else PREFILL_ROWS


def lm_head_class(rows: int) -> str:
    """The row class of the LM head run on ``rows`` rows."""
    return LM_HEAD_GEMV_ROWS if rows <= GEMV_MAX_ROWS else LM_HEAD_ROWS


def sample_rows(row_class: str, max_num_seqs: int, max_num_batched_tokens: int) -> tuple[int, ...]:
    """The batch sizes a class is timed at: its ends, clipped to what the engine runs."""
    seqs = max(1, min(max_num_seqs, max_num_batched_tokens))
    if row_class in (GEMV_ROWS, LM_HEAD_GEMV_ROWS):
        return tuple(sorted({1, min(GEMV_MAX_ROWS, seqs)}))
    if row_class == DECODE_ROWS:
        hi = min(DECODE_MAX_ROWS, seqs)
        return (
            tuple(sorted({max(GEMV_MAX_ROWS + 1, min(16, hi)), hi})) if hi > GEMV_MAX_ROWS else ()
        )
    if row_class == LM_HEAD_ROWS:
        return (min(seqs, DECODE_MAX_ROWS),) if seqs > GEMV_MAX_ROWS else ()
    if row_class == PREFILL_ATTENTION:  # a chunk after cached context (the timer's shape)
        return (min(max_num_batched_tokens, 256),) if max_num_batched_tokens > 1 else ()
    # Prefill chunks: the size the budget allows, capped where the GEMM is compute-bound
    # already (a larger chunk only makes the measurement longer).
    chunk = min(max_num_batched_tokens, 256)
    return (chunk,) if chunk > DECODE_MAX_ROWS else ()


def candidates(
    row_class: str,
    dtype: str,
    kernels: bool,
    panels: bool,
    onednn: bool,
    bf16_dot: bool = True,
    wide: bool | None = None,
) -> tuple[str, ...]:
    """The routes that can run a class here: ``kernels`` (the compiled kernels load),
    ``panels`` (panel copies are allowed), ``onednn`` (torch's oneDNN linear takes a
    prepacked weight of this dtype), ``bf16_dot`` (the build has the AVX512-BF16 dot
    product: the bf16 GEMV needs it; without it the panels widen bf16 weights to fp32),
    ``wide`` (oneDNN takes a prepacked fp32 weight, for bf16 prefill widened to fp32;
    default: ``onednn``). A CPU with AVX2 but neither AVX512-BF16 nor AMX has no bf16
    oneDNN GEMM worth the name (torch's ran 8x slower than its fp32 one on SmolLM2's
    layers), so there a bf16 model computes on widened weights."""
    wide = onednn if wide is None else wide
    if row_class == PREFILL_ATTENTION:
        return (FLASH, TORCH) if kernels else (TORCH,)
    out: list[str] = []
    small = row_class in (GEMV_ROWS, LM_HEAD_GEMV_ROWS)
    if small and kernels and bf16_dot and dtype == "bfloat16":
        out.append(GEMV)
    if row_class != PREFILL_ROWS and kernels and panels:
        out.append(PANELS)
    if onednn:
        out.append(ONEDNN)
    if row_class == PREFILL_ROWS and wide and dtype == "bfloat16":
        out.append(WIDE)
    if row_class in LM_HEAD_CLASSES and _head_wide(dtype, onednn, wide):
        out.append(WIDE)
    out.append(TORCH)
    return tuple(out)


def _head_wide(dtype: str, onednn: bool, wide: bool) -> bool:
    """Whether the LM head is offered the widened fp32 GEMM: only for bf16 where oneDNN
    has no bf16 GEMM (a worker without panels, a prefill worker, would otherwise run
    torch's bf16 linear over the whole vocabulary for every prompt)."""
    return dtype == "bfloat16" and wide and not onednn


def default_routes(
    dtype: str,
    kernels: bool,
    panels: bool,
    onednn: bool,
    bf16_dot: bool = True,
    wide: bool | None = None,
) -> dict[str, str]:
    """What ``engine.kernels.ops``'s constants pick for each class (at the class's upper
    rows), given what is available (``candidates``' flags)."""
    wide = onednn if wide is None else wide
    bf16 = dtype == "bfloat16"
    big = ONEDNN if onednn else TORCH
    mid = PANELS if kernels and panels else big
    # The panels before the bf16 GEMV where there are panels: per layer they were ahead
    # of it or level on AVX512-BF16 (the start-up timings of 6 processes on one host), and
    # only on panels does a decode step run its whole stack in one OpenMP team
    # (csrc/decode_team.h), which a per-layer timing cannot see.
    small = mid if mid == PANELS or not (bf16 and kernels and bf16_dot) else GEMV
    prefill = WIDE if bf16 and wide else big
    head_mid = mid if mid != TORCH or not _head_wide(dtype, onednn, wide) else WIDE
    head_small = small if small != TORCH else head_mid
    return {
        GEMV_ROWS: small,
        DECODE_ROWS: mid,
        PREFILL_ROWS: prefill,
        LM_HEAD_GEMV_ROWS: head_small,
        LM_HEAD_ROWS: head_mid,
        PREFILL_ATTENTION: FLASH if kernels else TORCH,
    }


# The routes whose result for a row is the same bits at any row count (each row's dot
# products run over K in one fixed order; tests/test_deterministic.py checks it): the
# bf16 GEMV kernel (rows in tiles of up to 4, columns in tiles of 64) and the fp32 panel
# kernel (rows in tiles of up to 6). oneDNN and torch pick their blocking by the shape.
BATCH_INVARIANT_ROUTES = (GEMV, PANELS)
DETERMINISTIC_SOURCE = "deterministic"


def deterministic_route(dtype: str, bf16_dot: bool, gemv_fits: bool) -> str:
    """The one route of deterministic mode: the bf16 GEMV kernel for a bf16 model where
    the build has the bf16 dot product and every layer's input width is a multiple of 32
    (``gemv_fits``; on AVX512-BF16 it measured at or above the fp32 panels from 1 to 512
    rows; the bf16 pair panels that came later are faster and batch-invariant too, but
    moving the mode to them would change its documented bits), else the panel kernel."""
    return GEMV if dtype == "bfloat16" and bf16_dot and gemv_fits else PANELS


def deterministic_table(route: str) -> RouteTable:
    """Every row class on ``route`` (one of ``BATCH_INVARIANT_ROUTES``)."""
    if route not in BATCH_INVARIANT_ROUTES:
        raise ValueError(
            f"deterministic mode needs a batch-invariant route {BATCH_INVARIANT_ROUTES}, "
            f"got {route!r}"
        )
    # No prompt-chunk attention route: deterministic mode runs every token through the
    # single-query kernel (``PagedAttention.split``).
    return RouteTable(routes=dict.fromkeys(LINEAR_CLASSES, route), source=DETERMINISTIC_SOURCE)


def pick(timings: Mapping[str, float], default: str, margin: float = DEFAULT_MARGIN) -> str:
    """The fastest route of ``timings`` (seconds), unless it is not faster than
    ``default`` by more than ``margin`` (then ``default``, when it was timed)."""
    if not timings:
        raise ValueError("pick needs at least one timed route")
    best = min(timings, key=lambda route: (timings[route], route != default))
    if default in timings and timings[best] >= (1.0 - margin) * timings[default]:
        return default
    return best


@dataclass(frozen=True, slots=True)
class RouteTable:
    """The route of every row class, and how it was chosen (``source``: measured, cached,
    default, or a forced mode), with the timings that chose it."""

    routes: dict[str, str]
    source: str
    timings: dict[str, dict[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for row_class, route in self.routes.items():
            if row_class not in ROW_CLASSES or route not in ROUTES:
                raise ValueError(f"route table entry {row_class!r}: {route!r} is not valid")

    @property
    def constants(self) -> bool:
        """The table only reports the defaults: ``ops.linear``'s constants decide per
        call, as before measurement existed (they split the prefill class at
        ``WIDE_MIN_ROWS``), and every copy they may use stays."""
        return self.source == "default"

    def layer_route(self, rows: int) -> str:
        return self.routes[layer_class(rows)]

    def lm_head_route(self, rows: int) -> str:
        return self.routes[lm_head_class(rows)]

    def uses(self, route: str, classes: Sequence[str] = ROW_CLASSES) -> bool:
        """Whether any of ``classes`` runs on ``route``."""
        return any(self.routes.get(c) == route for c in classes)

    def describe(self) -> str:
        """One line for the log: ``gemv=gemv decode=panels ... (measured)``."""
        body = " ".join(f"{c}={self.routes[c]}" for c in ROW_CLASSES if c in self.routes)
        return f"{body} ({self.source})"


def measure_table(
    plan: Mapping[str, Sequence[int]],
    cands: Mapping[str, Sequence[str]],
    defaults: Mapping[str, str],
    timer: Callable[[str, str, int], float],
    margin: float = DEFAULT_MARGIN,
    out_of_time: Callable[[], bool] = lambda: False,
    rounds: int = 1,
) -> RouteTable:
    """Time every candidate of every class at the class's sample rows (``plan``) with
    ``timer(row_class, route, rows)`` -> seconds, and pick each class's route. With
    ``rounds`` > 1 a class's candidates are timed in turn that many times and each keeps
    its fastest round: a burst of other work on the host then slows one round of every
    candidate, not every round of one (timed back to back, a noisy host's burst chose
    the slower decode kernel). A class without sample rows (the engine never runs it)
    keeps its default, and so does every class not fully timed before ``out_of_time()``
    (a host too busy to time in the budget; the table's source then says ``partial``)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    routes: dict[str, str] = {}
    timings: dict[str, dict[str, float]] = {}
    partial = False
    for row_class in ROW_CLASSES:
        default = defaults[row_class]
        rows_list = plan.get(row_class, ())
        options = list(cands.get(row_class, ()))
        if not rows_list or not options:
            routes[row_class] = default
            continue
        timed: dict[str, float] = {}
        stopped = False
        for _ in range(rounds):
            for route in options:
                stopped = out_of_time()
                if stopped:
                    break
                took = sum(timer(row_class, route, rows) for rows in rows_list)
                timed[route] = min(took, timed.get(route, math.inf))
            if stopped:
                break
        if len(timed) == len(options):  # every candidate timed in one round at least
            timings[row_class] = timed
        if row_class not in timings:  # cut short: a half-timed class keeps its default
            routes[row_class] = default
            partial = True
            continue
        routes[row_class] = pick(
            timed, default if default in timed else min(timed, key=timed.__getitem__), margin
        )
    return RouteTable(routes=routes, source="partial" if partial else "measured", timings=timings)


def forced_table(
    mode: str, defaults: Mapping[str, str], available: Mapping[str, Sequence[str]]
) -> RouteTable:
    """Every class on ``mode``'s route (``onednn`` or ``torch``) where it can run there,
    else on its default; ``default``: the defaults."""
    if mode == "default":
        return RouteTable(routes=dict(defaults), source="default")
    if mode not in (ONEDNN, TORCH):
        raise ValueError(f"cannot force cpu kernels {mode!r}; forced modes: onednn, torch, default")
    routes = {c: mode if mode in available.get(c, ()) else defaults[c] for c in ROW_CLASSES}
    return RouteTable(routes=routes, source=f"forced {mode}")
