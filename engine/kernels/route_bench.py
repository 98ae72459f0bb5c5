"""Times the CPU linear-layer kernels on a model's own weights, and chooses the route
table at start-up (``choose_routes``): from the cache, by measuring, or as forced.

The timer runs each candidate route (``ops.run_route``) over the weights of a class:
for the decode classes the weights of enough layers in turn (``SWEEP_BYTES``) that they
are read from memory as a decode step reads them, not from a warm cache; for prefill
chunks, one layer (compute-bound already, and each call is long). Prompt chunks'
attention is timed through a probe the model builds (``AttentionProbe``): one layer's
attention of a chunk after cached context, on each route. Each timing is the
fastest of a few sweeps after one untimed warm-up, within a share of a total budget, and
a class's candidates take ``ROUNDS`` turns each, interleaved, keeping their fastest.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from engine.kernels import ops, route_cache
from engine.kernels.cpu import cpu_kernels
from engine.kernels.route_table import (
    LM_HEAD_CLASSES,
    PREFILL_ATTENTION,
    PREFILL_ROWS,
    ROW_CLASSES,
    RouteTable,
    candidates,
    default_routes,
    forced_table,
    measure_table,
    sample_rows,
)

logger = logging.getLogger(__name__)

# Weight bytes a decode-class timing sweeps (whole layers, at least one, at most
# MEMORY_LAYERS): more than a server CPU's last-level cache slice, so they stream from
# DRAM as in a decode step; 8 layers of SmolLM2-135M in bf16 are ~50 MB.
SWEEP_BYTES = 64 << 20
MEMORY_LAYERS = 8
# Total wall time the timings may take (they stop early on fast shapes).
BUDGET_S = 1.5
MAX_REPS = 20
# Past this multiple of the budget (a busy host), the classes not yet timed keep their
# defaults.
OVERRUN = 2.0
# A candidate whose first (warm-up) run takes this many times the fastest steady time of
# a route timed before it at the same rows is not timed further: a warm-up is never that
# much slower here, and on a CPU without a bf16 GEMM torch's bf16 linear took 8x the
# panels', so timing it in full spent the whole budget (the classes after it then kept
# their defaults, and the table was never cached).
GIVE_UP = 3.0
# Rounds in which a class's candidates are timed in turn (route_table.measure_table):
# the budget is shared among them, so each call gets a third of its share.
ROUNDS = 3


class LinearCopies(Protocol):
    """A linear layer's weight and the copies ``ops.run_route`` may use."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    packed: torch.Tensor | None
    packed_wide: torch.Tensor | None
    panels: torch.Tensor | None


# ``probe(route, rows)``: a call that runs one layer's attention of a ``rows``-token prompt
# chunk on ``route``, or None where the route does not serve the model.
AttentionProbe = Callable[[str, int], Callable[[], object] | None]


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What ``choose_routes`` needs besides the weights."""

    mode: str  # auto | measure | default | onednn | torch (route_table.MODES)
    dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int
    panels: bool  # panel copies are allowed (EngineConfig.linear_panels)
    cache_dir: Path | None = None  # None: route_cache.default_cache_dir()
    budget_s: float = BUDGET_S
    # Whether other work shares the CPUs now (default: ``host_busy``): a table measured
    # then is cached as such, and measured again by the first start on a quiet host, so
    # the noise of a busy measurement does not outlive the busy spell.
    busy: Callable[[], bool] | None = None


def host_busy() -> bool:
    """More runnable threads (1-minute load average) than the CPUs this process may use."""
    try:
        return os.getloadavg()[0] > len(os.sched_getaffinity(0))
    except (OSError, AttributeError):
        return False


def make_timer(
    layers: Sequence[Sequence[LinearCopies]],
    lm_head: LinearCopies,
    budget_s: float,
    num_measurements: int,
    attention: AttentionProbe | None = None,
) -> Callable[[str, str, int], float]:
    """``timer(row_class, route, rows)``: seconds of one sweep of the class's weights on
    ``rows`` rows through ``route`` (of ``attention``'s probe for prompt chunks'
    attention); ``inf`` where the route does not serve them."""
    share = budget_s / max(1, num_measurements)
    layer_bytes = (
        sum(m.weight.numel() * m.weight.element_size() for m in layers[0]) if layers else 1
    )
    memory_depth = max(1, min(MEMORY_LAYERS, SWEEP_BYTES // max(1, layer_bytes)))
    generator = torch.Generator().manual_seed(0)
    inputs: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
    # The fastest steady time so far of each (row class, rows): GIVE_UP's reference.
    fastest: dict[tuple[str, int], float] = {}

    def x_for(rows: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        key = (rows, k, dtype)
        if key not in inputs:
            inputs[key] = torch.randn(rows, k, generator=generator).to(dtype)
        return inputs[key]

    def sweep(mods: Sequence[LinearCopies], route: str, rows: int) -> bool:
        for m in mods:
            x = x_for(rows, m.weight.shape[1], m.weight.dtype)
            if ops.run_route(route, x, m.weight, m.bias, m.packed, m.packed_wide, m.panels) is None:
                return False
        return True

    def best_of(run: Callable[[], object], warm_s: float, key: tuple[str, int]) -> float:
        """Steady time of ``run``, whose warm-up run (already done) took ``warm_s``."""
        if warm_s > GIVE_UP * fastest.get(key, math.inf):
            return warm_s
        best = math.inf
        began = time.perf_counter()
        for _ in range(MAX_REPS):
            t0 = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - t0)
            if time.perf_counter() - began >= share:
                break
        fastest[key] = min(best, fastest.get(key, math.inf))
        return best

    @torch.inference_mode()
    def timer(row_class: str, route: str, rows: int) -> float:
        if row_class == PREFILL_ATTENTION:
            call = attention(route, rows) if attention is not None else None
            if call is None:
                return math.inf
            t0 = time.perf_counter()
            call()  # warm-up
            return best_of(call, time.perf_counter() - t0, (row_class, rows))
        if row_class in LM_HEAD_CLASSES:
            mods: list[LinearCopies] = [lm_head]
        else:
            depth = 1 if row_class == PREFILL_ROWS else memory_depth
            mods = [m for layer in layers[:depth] for m in layer]
        t0 = time.perf_counter()
        if not sweep(mods, route, rows):  # does the route serve them (and warm-up)
            return math.inf
        warm_s = time.perf_counter() - t0
        return best_of(lambda: sweep(mods, route, rows), warm_s, (row_class, rows))

    return timer


@dataclass(frozen=True, slots=True)
class _Setting:
    """What a table is chosen among, and the cache key of a measured one."""

    defaults: dict[str, str]
    candidates: dict[str, tuple[str, ...]]
    plan: dict[str, tuple[int, ...]]
    key: dict[str, Any]
    cache_dir: Path


def choose_routes(
    request: RouteRequest,
    layers: Sequence[Sequence[LinearCopies]],
    lm_head: LinearCopies,
    timer: Callable[[str, str, int], float] | None = None,
    attention: AttentionProbe | None = None,
) -> RouteTable:
    """The route table for this model on this host, as ``request.mode`` says: ``auto``
    reuses a cached measurement for the same key or measures and caches; ``measure``
    always measures (and caches); ``default`` / ``onednn`` / ``torch`` force. Measuring
    needs every copy packed (``Linear.prepack`` without routes); the caller drops the
    ones the table leaves unused."""
    known = known_routes(request, layers, lm_head)
    if known is not None:
        return known
    return measure_routes(request, layers, lm_head, timer, attention)


def known_routes(
    request: RouteRequest, layers: Sequence[Sequence[LinearCopies]], lm_head: LinearCopies
) -> RouteTable | None:
    """The table without measuring: forced, or cached (``auto``); None when it must be
    measured. Needs only the weights, not their copies."""
    setting = _setting(request, layers, lm_head)
    if request.mode not in ("auto", "measure"):
        return forced_table(request.mode, setting.defaults, setting.candidates)
    if request.mode == "auto":
        cached = route_cache.load(setting.cache_dir, setting.key)
        if cached is not None and cached.source == route_cache.BUSY_SOURCE:
            return cached if (request.busy or host_busy)() else None
        return cached
    return None


def measure_routes(
    request: RouteRequest,
    layers: Sequence[Sequence[LinearCopies]],
    lm_head: LinearCopies,
    timer: Callable[[str, str, int], float] | None = None,
    attention: AttentionProbe | None = None,
) -> RouteTable:
    """Time the candidates on the weights' copies (all packed) and on ``attention``'s
    probe, and cache the table."""
    setting = _setting(request, layers, lm_head)
    plan, cands, defaults = setting.plan, setting.candidates, setting.defaults
    if timer is None:
        count = ROUNDS * sum(len(plan[c]) * len(cands[c]) for c in ROW_CLASSES)
        timer = make_timer(layers, lm_head, request.budget_s, count, attention)
    busy = (request.busy or host_busy)()
    t0 = time.perf_counter()
    deadline = t0 + OVERRUN * request.budget_s
    table = measure_table(
        plan, cands, defaults, timer, out_of_time=lambda: time.perf_counter() > deadline,
        rounds=ROUNDS,
    )  # fmt: skip
    spent = time.perf_counter() - t0
    if table.source == "partial":
        # Not cached: the next start measures again, on a quieter host perhaps.
        logger.warning(
            "timing CPU kernel routes took %.1f s (budget %.1f s): the classes left over "
            "keep their defaults, and nothing is cached", spent, request.budget_s,
        )  # fmt: skip
        return table
    busy = busy or (request.busy or host_busy)()
    if busy:
        logger.warning(
            "measured CPU kernel routes in %.2f s while other work shared the CPUs (load "
            "average above the CPU count): cached until a start on a quiet host measures "
            "again", spent,
        )  # fmt: skip
    else:
        logger.info("measured CPU kernel routes in %.2f s", spent)
    route_cache.store(setting.cache_dir, setting.key, table, busy=busy)
    return table


def _setting(
    request: RouteRequest, layers: Sequence[Sequence[LinearCopies]], lm_head: LinearCopies
) -> _Setting:
    kernels = cpu_kernels()
    bf16 = request.dtype == "bfloat16"
    has_kernels = kernels is not None and request.dtype in ("float32", "bfloat16")
    bf16_dot = kernels is not None and kernels.bf16_dot
    onednn = ops.onednn_serves(layers[0][0].weight.dtype) if layers else False
    wide = bf16 and bool(layers) and ops.onednn_serves(torch.float32)
    flags = (request.dtype, has_kernels, request.panels, onednn, bf16_dot, wide)
    defaults = default_routes(*flags)
    cands = {c: candidates(c, *flags) for c in ROW_CLASSES}
    plan = {
        c: sample_rows(c, request.max_num_seqs, request.max_num_batched_tokens) for c in ROW_CLASSES
    }
    shapes = sorted({tuple(m.weight.shape) for layer in layers for m in layer})
    shapes.append(tuple(lm_head.weight.shape))
    key = route_cache.cache_key(
        dtype=request.dtype,
        threads=torch.get_num_threads(),
        shapes=[(int(a), int(b)) for a, b in shapes],
        plan=plan,
        candidates=cands,
        torch_version=torch.__version__,
        kernel_build=kernels.build_id if kernels is not None else "none",
    )
    cache_dir = request.cache_dir or route_cache.default_cache_dir()
    return _Setting(defaults, cands, plan, key, cache_dir)
