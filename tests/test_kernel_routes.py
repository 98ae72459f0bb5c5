"""Kernel routes chosen by measurement: the pick, the cache, each route's numerics, a
capped oneDNN ISA, and ``--cpu-kernels default``."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.kernels import ops, route_cache
from engine.kernels.cpu import cpu_kernels
from engine.kernels.route_bench import RouteRequest, choose_routes
from engine.kernels.route_table import (
    DECODE_ROWS,
    FLASH,
    GEMV_ROWS,
    LINEAR_ROUTES,
    PREFILL_ATTENTION,
    PREFILL_ROWS,
    ROUTES,
    ROW_CLASSES,
    RouteTable,
    default_routes,
    measure_table,
    pick,
)
from rpc.worker_config import WorkerConfig
from tests.engine_helpers import make_core

REPO = Path(__file__).resolve().parent.parent


def test_pick_takes_the_fastest_beyond_the_margin() -> None:
    assert pick({"gemv": 1.0, "onednn": 0.5, "torch": 0.7}, "gemv") == "onednn"
    # 5% faster than the default is within the 10% margin: the default stays.
    assert pick({"gemv": 1.0, "onednn": 0.95}, "gemv", margin=0.10) == "gemv"
    assert pick({"gemv": 1.0, "onednn": 0.85}, "gemv", margin=0.10) == "onednn"
    # An untimed default leaves the fastest.
    assert pick({"onednn": 2.0, "torch": 1.0}, "panels") == "torch"
    with pytest.raises(ValueError):
        pick({}, "gemv")


def test_measure_table_routes_each_class_to_its_fastest_injected_timing() -> None:
    fastest = {GEMV_ROWS: "panels", DECODE_ROWS: "onednn", PREFILL_ROWS: "torch"}
    calls: list[tuple[str, str, int]] = []

    def timer(row_class: str, route: str, rows: int) -> float:
        calls.append((row_class, route, rows))
        return 1.0 if fastest.get(row_class) == route else 3.0

    plan = {GEMV_ROWS: (1, 4), DECODE_ROWS: (16,), PREFILL_ROWS: (256,)}
    cands = {c: ("gemv", "panels", "onednn", "torch") for c in ROW_CLASSES}
    defaults = default_routes("bfloat16", kernels=True, panels=True, onednn=True)
    table = measure_table(plan, cands, defaults, timer)
    assert {c: table.routes[c] for c in fastest} == fastest
    # Classes with no rows to time (the LM head here) keep their defaults, untimed.
    assert table.routes["lm_head"] == defaults["lm_head"]
    assert not any(c.startswith("lm_head") for c, _, _ in calls)
    assert table.timings[GEMV_ROWS]["panels"] == 2.0  # summed over both sample sizes
    partial = measure_table(plan, cands, defaults, timer, out_of_time=lambda: True)
    assert partial.source == "partial" and partial.routes == {**defaults}
    # Time runs out inside the decode class: gemv is routed, decode and later keep defaults.
    calls.clear()
    partial = measure_table(
        plan,
        cands,
        defaults,
        timer,
        out_of_time=lambda: len(calls) >= len(cands[GEMV_ROWS]) * 2 + 1,
    )
    assert partial.source == "partial"
    assert partial.routes[GEMV_ROWS] == "panels"
    assert (
        partial.routes[DECODE_ROWS] == defaults[DECODE_ROWS] and DECODE_ROWS not in partial.timings
    )


def test_rounds_interleave_the_candidates_and_keep_each_ones_fastest() -> None:
    # A burst of other work while the first candidate is timed: back to back, the burst
    # chooses the other one; in interleaved rounds each keeps its fastest round.
    calls: list[str] = []

    def timer(row_class: str, route: str, rows: int) -> float:
        calls.append(route)
        if route == "panels":
            return 2.0 if len(calls) == 1 else 1.0  # the burst hits the very first call
        return 1.5

    plan = {DECODE_ROWS: (16,)}
    cands = {c: ("panels", "onednn") for c in ROW_CLASSES}
    defaults = default_routes("bfloat16", kernels=True, panels=True, onednn=True)
    once = measure_table(plan, cands, defaults, timer)
    assert once.routes[DECODE_ROWS] == "onednn"
    calls.clear()
    interleaved = measure_table(plan, cands, defaults, timer, rounds=3)
    assert calls == ["panels", "onednn"] * 3
    assert interleaved.timings[DECODE_ROWS] == {"panels": 1.0, "onednn": 1.5}
    assert interleaved.routes[DECODE_ROWS] == "panels"
    # Time running out after a full round still routes the class on that round.
    calls.clear()
    cut = measure_table(plan, cands, defaults, timer, rounds=3, out_of_time=lambda: len(calls) >= 3)
    assert cut.source == "measured" and cut.timings[DECODE_ROWS] == {"panels": 1.0, "onednn": 1.5}
    with pytest.raises(ValueError, match="rounds"):
        measure_table(plan, cands, defaults, timer, rounds=0)


@dataclass
class _Copies:
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    packed: torch.Tensor | None = None
    packed_wide: torch.Tensor | None = None
    panels: torch.Tensor | None = None


def _layers(dtype: torch.dtype, n: int = 2) -> tuple[list[list[_Copies]], _Copies]:
    g = torch.Generator().manual_seed(0)

    def lin(out_f: int, in_f: int) -> _Copies:
        w = (torch.randn(out_f, in_f, generator=g) / in_f**0.5).to(dtype)
        return _Copies(
            w, None, ops.pack_linear_weight(w), ops.pack_linear_weight(w, wide=True),
            ops.pack_panels(w),
        )  # fmt: skip

    return [[lin(96, 64), lin(64, 128)] for _ in range(n)], lin(512, 64)


def _request(tmp_path: Path, mode: str = "auto", dtype: str = "bfloat16") -> RouteRequest:
    return RouteRequest(
        mode=mode, dtype=dtype, max_num_seqs=32, max_num_batched_tokens=256, panels=True,
        cache_dir=tmp_path, budget_s=0.2, busy=lambda: False,
    )  # fmt: skip


def test_routes_are_cached_reused_and_keyed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    layers, head = _layers(torch.bfloat16)
    calls = []

    def timer(row_class: str, route: str, rows: int) -> float:
        calls.append(row_class)
        return {"torch": 1.0}.get(route, 2.0)

    first = choose_routes(_request(tmp_path), layers, head, timer)
    assert first.source == "measured" and calls
    assert set(first.routes.values()) == {"torch"}
    assert len(list(tmp_path.glob("*.json"))) == 1
    calls.clear()
    again = choose_routes(_request(tmp_path), layers, head, timer)
    assert again.source == "cached" and again.routes == first.routes
    assert calls == [], "a cached table takes no timings"
    # measure: always measures.
    choose_routes(_request(tmp_path, mode="measure"), layers, head, timer)
    assert calls
    # Another key (threads, oneDNN's ISA cap, shapes) measures again, into its own file.
    for change in ("threads", "isa", "shapes"):
        calls.clear()
        old_threads = torch.get_num_threads()
        if change == "threads":
            torch.set_num_threads(old_threads + 1)
        if change == "isa":
            monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
        use_layers = _layers(torch.bfloat16, n=2)[0][:1] if change == "shapes" else layers
        if change == "shapes":
            use_layers = [[use_layers[0][0]]]
        try:
            table = choose_routes(_request(tmp_path), use_layers, head, timer)
        finally:
            torch.set_num_threads(old_threads)
        assert table.source == "measured" and calls, change
    assert len(list(tmp_path.glob("*.json"))) == 4


def test_a_table_measured_on_a_busy_host_is_measured_again_once_quiet(tmp_path: Path) -> None:
    layers, head = _layers(torch.float32)
    calls = []

    def timer(row_class: str, route: str, rows: int) -> float:
        calls.append(route)
        return {"torch": 1.0}.get(route, 2.0)

    busy = dataclasses.replace(_request(tmp_path, dtype="float32"), busy=lambda: True)
    table = choose_routes(busy, layers, head, timer)
    assert table.source == "measured" and set(table.routes.values()) == {"torch"}
    calls.clear()
    assert choose_routes(busy, layers, head, timer).source == route_cache.BUSY_SOURCE
    assert calls == [], "a busy host reuses a busy measurement"
    quiet = _request(tmp_path, dtype="float32")
    assert choose_routes(quiet, layers, head, timer).source == "measured" and calls
    calls.clear()
    assert choose_routes(quiet, layers, head, timer).source == "cached" and not calls


def test_a_corrupt_cache_file_is_measured_again(tmp_path: Path) -> None:
    layers, head = _layers(torch.float32)
    calls = []

    def timer(row_class: str, route: str, rows: int) -> float:
        calls.append(route)
        return 1.0

    choose_routes(_request(tmp_path, dtype="float32"), layers, head, timer)
    (path,) = tmp_path.glob("*.json")
    path.write_text('{"key": ')  # a torn write
    calls.clear()
    table = choose_routes(_request(tmp_path, dtype="float32"), layers, head, timer)
    assert table.source == "measured" and calls
    json.loads(path.read_text())  # rewritten whole
    assert not list(tmp_path.glob(".*.tmp")), "no temporary file is left behind"


def test_the_real_timer_stays_within_its_budget_and_covers_every_class(tmp_path: Path) -> None:
    layers, head = _layers(torch.bfloat16)
    table = choose_routes(_request(tmp_path, mode="measure"), layers, head)
    assert table.source in ("measured", "partial")
    assert set(table.routes) == set(ROW_CLASSES)
    for timed in table.timings.values():
        assert all(t > 0 for t in timed.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 4, 16, 64, 200])
def test_every_route_agrees_with_the_fp32_reference(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(192, 128, generator=g) / 128**0.5).to(dtype)
    b = torch.randn(192, generator=g).to(dtype)
    x = torch.randn(rows, 128, generator=g).to(dtype)
    copies = (ops.pack_linear_weight(w), ops.pack_linear_weight(w, wide=True), ops.pack_panels(w))
    ref = F.linear(x.double(), w.double(), b.double())
    ran = []
    for route in LINEAR_ROUTES:
        got = ops.run_route(route, x, w, b, *copies)
        if got is None:
            continue
        ran.append(route)
        assert got.dtype == dtype and got.shape == ref.shape
        # The bound of test_attention_kernels' linear tests: one bf16 rounding of an
        # fp32 result (bf16), summation order (fp32).
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol, msg=route)
    assert "torch" in ran
    if ops.onednn_serves(dtype):  # bf16 needs a CPU with AVX512-BF16 or AMX
        assert "onednn" in ran
    if cpu_kernels() is not None:
        assert "panels" in ran
        if dtype == torch.bfloat16 and cpu_kernels().bf16_dot:
            assert "gemv" in ran


_CAPPED = """
import json, sys, torch, torch.nn.functional as F
from pathlib import Path
from engine.kernels import ops
from engine.kernels.route_bench import RouteRequest, choose_routes
from tests.test_kernel_routes import _layers
layers, head = _layers(torch.bfloat16)
req = RouteRequest(mode="measure", dtype="bfloat16", max_num_seqs=32, max_num_batched_tokens=256,
                   panels=True, cache_dir=Path(sys.argv[1]), budget_s=0.3, busy=lambda: False)
table = choose_routes(req, layers, head)
errs = {}
for route in ("gemv", "panels", "onednn", "wide", "torch"):
    m = layers[0][0]
    x = torch.randn(64, m.weight.shape[1]).bfloat16()
    got = ops.run_route(route, x, m.weight, None, m.packed, m.packed_wide, m.panels)
    if got is not None:
        ref = F.linear(x.double(), m.weight.double())
        errs[route] = float((got.double() - ref).abs().max() / ref.abs().max())
print(json.dumps({"routes": table.routes, "source": table.source, "errs": errs}))
"""


@pytest.mark.parametrize("isa", ["AVX2", "AVX512_CORE"])
def test_a_capped_onednn_isa_falls_back_cleanly_and_is_recorded(tmp_path: Path, isa: str) -> None:
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": isa, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", _CAPPED, str(tmp_path)], env=env, cwd=REPO,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(out["routes"]) == set(ROW_CLASSES)
    assert all(r in ROUTES for r in out["routes"].values())
    assert out["errs"] and all(e < 2e-2 for e in out["errs"].values()), out["errs"]
    if out["source"] == "measured":
        (cached,) = tmp_path.glob("*.json")
        assert json.loads(cached.read_text())["key"]["onednn_max_cpu_isa"] == isa


def test_cpu_kernels_flag_and_validation() -> None:
    cfg = WorkerConfig.from_args("decode", ["--cpu-kernels", "default"], {})
    assert cfg.engine.cpu_kernels == "default"
    env = {"BATON_PREFILL_CPU_KERNELS": "onednn"}
    assert WorkerConfig.from_args("prefill", [], env).engine.cpu_kernels == "onednn"
    assert WorkerConfig.from_args("decode", [], {}).engine.cpu_kernels == "auto"
    with pytest.raises(ValueError, match="cpu_kernels"):
        EngineConfig(cpu_kernels="amx")


def test_default_mode_keeps_todays_constants_and_copies(tiny_llama: Path) -> None:
    core = make_core(tiny_llama, dtype="bfloat16", cpu_kernels="default")
    table = core.runner.kernel_routes
    assert table is not None and table.constants and table.source == "default"
    model = core.runner.model
    layers, head = model.linear_layers()
    for mod in [m for layer in layers for m in layer]:
        assert mod.routes is table
        # bf16 oneDNN needs a CPU with AVX512-BF16 or AMX; the widened copy is fp32.
        assert (mod.packed is not None) == ops.onednn_serves(torch.bfloat16)
        assert mod.packed_wide is not None
        if cpu_kernels() is not None:
            assert mod.panels is not None
    assert all(layer.route_codes == () for layer in model.model.layers)
    if model.model.decode_stack is not None:
        assert model.model.decode_stack.routes == ()
    x = torch.randn(3, layers[0][0].weight.shape[1]).bfloat16()
    mod = layers[0][0]
    # No route given: ops.linear's constants, exactly as before routes existed.
    want = ops.linear(x, mod.weight, mod.bias, mod.packed, mod.packed_wide, mod.panels)
    assert torch.equal(mod(x), want)


def test_a_forced_route_never_packs_the_copies_it_does_not_use(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    packed = []
    real_panels, real_pack = ops.pack_panels, ops.pack_linear_weight
    monkeypatch.setattr(ops, "pack_panels", lambda w: packed.append("panels") or real_panels(w))
    monkeypatch.setattr(
        ops, "pack_linear_weight",
        lambda w, wide=False: packed.append("wide" if wide else "onednn") or real_pack(w, wide),
    )  # fmt: skip
    core = make_core(tiny_llama, dtype="bfloat16", cpu_kernels="torch")
    assert packed == [], "a table known before packing packs nothing it does not use"
    table = core.runner.kernel_routes
    assert table is not None and table.source == "forced torch"
    assert set(table.routes.values()) == {"torch"}
    layers, head = core.runner.model.linear_layers()
    for mod in [m for layer in layers for m in layer] + [head]:
        assert mod.packed is None and mod.packed_wide is None and mod.panels is None
    onednn = make_core(tiny_llama, dtype="bfloat16", cpu_kernels="onednn")
    # Forced oneDNN: every class it serves; a class it does not (bf16 on a CPU without
    # AVX512-BF16 or AMX) keeps its default, and only those routes' copies are made.
    used = set(onednn.runner.kernel_routes.routes.values())
    assert set(packed) <= used
    layers, head = onednn.runner.model.linear_layers()
    if ops.onednn_serves(torch.bfloat16):
        assert used <= {"onednn", "flash"}
        assert all(m.packed is not None for layer in layers for m in layer)
    mods = [m for layer in layers for m in layer]
    assert all((m.panels is not None) == ("panels" in used) for m in mods)
    assert all((m.packed_wide is not None) == ("wide" in used) for m in mods)


@pytest.mark.parametrize("mode", ["torch", "onednn", "measure"])
def test_routed_engine_matches_the_torch_twins(tiny_llama: Path, mode: str) -> None:
    """Decode steps (compiled stack, routed) and prefill (Python, routed) stay within the
    bf16 bound of the plain-torch twins."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7, 8] * 20, [9, 10, 11], [12] * 7]
    routed = make_core(tiny_llama, dtype="float32", cpu_kernels=mode)
    twin = make_core(tiny_llama, dtype="float32", cpu_kernels="default")
    twin.runner.model.set_fast_path(False)
    assert routed.generate(prompts, params) == twin.generate(prompts, params)


def test_route_table_rejects_unknown_entries() -> None:
    with pytest.raises(ValueError):
        RouteTable(routes={"gemv": "amx"}, source="measured")
    with pytest.raises(ValueError):
        RouteTable(routes={"batch": "torch"}, source="measured")


def test_cache_dir_follows_xdg() -> None:
    assert route_cache.default_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/baton/kernel_routes")
    name, flags = route_cache.cpu_identity(
        "model name\t: Some CPU\nflags\t\t: fpu avx2 avx512f amx_tile amx_bf16 avx512_bf16\n"
    )
    assert name == "Some CPU" and flags == (
        "avx2",
        "avx512f",
        "avx512_bf16",
        "amx_bf16",
        "amx_tile",
    )


_CAPPED_ENGINE = """
import json, sys
from engine.sampling_params import SamplingParams
from tests.engine_helpers import make_core
core = make_core(sys.argv[1], dtype="float32", cpu_kernels="measure")
params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
out = core.generate([[5, 6, 7, 8] * 20, [9, 10, 11], [12] * 7], params)
print(json.dumps({"tokens": out, "routes": dict(core.stats().cpu_kernel_routes)}))
"""


def test_an_engine_under_a_capped_onednn_isa_serves_the_same_tokens(tiny_llama: Path) -> None:
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", _CAPPED_ENGINE, str(tiny_llama)], env=env, cwd=REPO,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(out["routes"]) == set(ROW_CLASSES)
    twin = make_core(tiny_llama, dtype="float32", cpu_kernels="default")
    twin.runner.model.set_fast_path(False)
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert out["tokens"] == twin.generate([[5, 6, 7, 8] * 20, [9, 10, 11], [12] * 7], params)


def test_prompt_attention_is_a_class_routed_to_its_fastest_injected_timing() -> None:
    from engine.kernels.route_table import candidates

    assert candidates(PREFILL_ATTENTION, "bfloat16", True, True, True) == (FLASH, "torch")
    assert candidates(PREFILL_ATTENTION, "bfloat16", False, True, True) == ("torch",)
    defaults = default_routes("bfloat16", kernels=True, panels=True, onednn=True)
    assert defaults[PREFILL_ATTENTION] == FLASH
    plan = {PREFILL_ATTENTION: (256,)}
    cands = {PREFILL_ATTENTION: (FLASH, "torch")}
    # SDPA faster by more than the margin (an AMX host's bf16 SDPA): it takes the class.
    faster_sdpa = measure_table(plan, cands, defaults, lambda c, r, n: 1.0 if r == "torch" else 2.0)
    assert faster_sdpa.routes[PREFILL_ATTENTION] == "torch"
    assert faster_sdpa.timings[PREFILL_ATTENTION] == {FLASH: 2.0, "torch": 1.0}
    within_margin = measure_table(
        plan, cands, defaults, lambda c, r, n: 0.95 if r == "torch" else 1.0
    )
    assert within_margin.routes[PREFILL_ATTENTION] == FLASH


@pytest.mark.skipif(cpu_kernels() is None, reason="compiled CPU kernels unavailable")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_prompt_attention_probe_runs_both_routes_alike(dtype: torch.dtype) -> None:
    from engine.layers.attention import PagedAttention, prefill_probe

    attn = PagedAttention(3, 9, 3, 64)
    assert prefill_probe(attn, "gemv", 40, 16, dtype) is None
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    # After cached context (the timer's shape) and as a first chunk, where SDPA takes the
    # chunk's own K/V and the kernel reads them from the pool.
    for cached in (None, 0):
        flash = prefill_probe(attn, FLASH, 40, 16, dtype, cached=cached)
        sdpa = prefill_probe(attn, "torch", 40, 16, dtype, cached=cached)
        assert flash is not None and sdpa is not None
        torch.testing.assert_close(flash().float(), sdpa().float(), rtol=tol, atol=tol)


@pytest.mark.parametrize(("mode", "route"), [("torch", "torch"), ("onednn", FLASH)])
def test_an_engine_runs_prompt_attention_on_its_tables_route(
    tiny_llama: Path, mode: str, route: str
) -> None:
    core = make_core(tiny_llama, dtype="float32", cpu_kernels=mode)
    from engine.layers.attention import PagedAttention

    routes = {m.prefill_route for m in core.runner.model.modules() if isinstance(m, PagedAttention)}
    expected = route if cpu_kernels() is not None else "torch"
    assert routes == {expected}
    assert (PREFILL_ATTENTION, expected) in core.stats().cpu_kernel_routes


def test_a_bf16_model_without_bf16_gemms_computes_on_widened_weights() -> None:
    """An AVX2 CPU (no AVX512-BF16, no AMX): oneDNN has no bf16 GEMM and the build no
    bf16 dot product, so bf16 layers are offered the fp32 panels (widened bf16 weights)
    and the widened fp32 oneDNN GEMM, never the bf16 GEMV; the default follows."""
    from engine.kernels.route_table import candidates

    avx2 = {"kernels": True, "panels": True, "onednn": False, "bf16_dot": False, "wide": True}
    assert candidates(GEMV_ROWS, "bfloat16", **avx2) == ("panels", "torch")
    assert candidates(DECODE_ROWS, "bfloat16", **avx2) == ("panels", "torch")
    assert candidates(PREFILL_ROWS, "bfloat16", **avx2) == ("wide", "torch")
    assert candidates(PREFILL_ATTENTION, "bfloat16", **avx2) == (FLASH, "torch")
    defaults = default_routes("bfloat16", **avx2)
    assert defaults[GEMV_ROWS] == defaults[DECODE_ROWS] == "panels"
    assert defaults[PREFILL_ROWS] == "wide" and defaults[PREFILL_ATTENTION] == FLASH
    # The LM head may take the widened GEMM too: a prefill worker (no panels) would
    # otherwise run torch's bf16 linear over the vocabulary for every prompt.
    assert candidates("lm_head_gemv", "bfloat16", **avx2) == ("panels", "wide", "torch")
    no_panels = {**avx2, "panels": False}
    assert default_routes("bfloat16", **no_panels)["lm_head_gemv"] == "wide"
    assert default_routes("bfloat16", **no_panels)["lm_head"] == "wide"
    assert default_routes("bfloat16", **no_panels)[GEMV_ROWS] == "torch"
    # Where oneDNN has a bf16 GEMM the head is not offered the widened copy.
    amx = {**avx2, "onednn": True, "bf16_dot": True}
    assert "wide" not in candidates("lm_head", "bfloat16", **amx)
    # Without the kernels: oneDNN's fp32 GEMM on the widened copy is still there for prefill.
    bare = {**avx2, "kernels": False}
    assert candidates(GEMV_ROWS, "bfloat16", **bare) == ("torch",)
    assert default_routes("bfloat16", **bare)[PREFILL_ROWS] == "wide"
    # fp32 is unchanged: wide is a bf16 route.
    assert "wide" not in candidates(PREFILL_ROWS, "float32", **avx2)


def test_this_hosts_bf16_candidates_follow_its_build(tmp_path: Path) -> None:
    """On the host at hand: with the compiled kernels a bf16 model is always offered the
    panels and the flash attention, whatever the ISA; the GEMV only with the bf16 dot."""
    from engine.kernels.route_bench import _setting

    layers, head = _layers(torch.bfloat16)
    setting = _setting(_request(tmp_path), layers, head)
    kernels = cpu_kernels()
    if kernels is None:
        assert all("panels" not in c for c in setting.candidates.values())
        return
    assert "panels" in setting.candidates[DECODE_ROWS]
    assert FLASH in setting.candidates[PREFILL_ATTENTION]
    assert ("gemv" in setting.candidates[GEMV_ROWS]) == kernels.bf16_dot
    assert ("wide" in setting.candidates[PREFILL_ROWS]) == ops.onednn_serves(torch.float32)


def test_a_candidate_far_slower_than_one_timed_before_it_is_not_timed_further(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One warm-up run of a route GIVE_UP times slower than the fastest steady time at the
    same rows settles it: torch's bf16 linear on a CPU without a bf16 GEMM (8x the
    panels') no longer eats the budget that the classes after it need."""
    import time as _time

    from engine.kernels import route_bench

    runs: dict[str, int] = {}
    cost = {"panels": 0.002, "onednn": 0.0025, "torch": 0.02}

    def fake_run_route(route, x, *copies):  # noqa: ANN001, ANN202 - ops.run_route's shape
        runs[route] = runs.get(route, 0) + 1
        _time.sleep(cost[route])
        return x

    monkeypatch.setattr(route_bench.ops, "run_route", fake_run_route)
    layers, head = _layers(torch.bfloat16, n=1)
    timer = route_bench.make_timer(layers, head, budget_s=0.5, num_measurements=3)
    fast = timer(DECODE_ROWS, "panels", 16)
    near = timer(DECODE_ROWS, "onednn", 16)  # within GIVE_UP: timed in full
    slow = timer(DECODE_ROWS, "torch", 16)
    sweep = len(layers[0])  # run_route calls in one sweep of the class's weights
    assert runs["panels"] > 2 * sweep and runs["onednn"] > 2 * sweep
    assert runs["torch"] == sweep, "the warm-up alone settles a route far slower than panels"
    assert fast < near < slow and slow >= 0.02
    # At other rows nothing was timed yet: torch is timed in full there.
    runs.clear()
    timer(DECODE_ROWS, "torch", 32)
    assert runs["torch"] > 2 * sweep


def test_small_batches_default_to_the_panels_where_there_are_panels() -> None:
    """Only on panels does a decode step run its whole stack in one OpenMP team, which a
    per-layer timing cannot see: the bf16 GEMV must beat the panels by the margin, not
    merely match them, to take batches of up to four rows (on one host the start-up
    timings put it within 10% of the panels in 3 of 6 processes, which then lost the team)."""
    avx512 = {"kernels": True, "panels": True, "onednn": True, "bf16_dot": True}
    defaults = default_routes("bfloat16", **avx512)
    assert defaults[GEMV_ROWS] == defaults[DECODE_ROWS] == defaults["lm_head_gemv"] == "panels"
    plan = {GEMV_ROWS: (1, 4)}
    close = {"gemv": 0.95, "panels": 1.0, "onednn": 2.0, "torch": 3.0}
    table = measure_table(plan, {GEMV_ROWS: tuple(close)}, defaults, lambda c, r, n: close[r])
    assert table.routes[GEMV_ROWS] == "panels"
    # Without panels (a prefill worker's layers) the GEMV is the default, as before.
    no_panels = default_routes("bfloat16", **{**avx512, "panels": False})
    assert no_panels[GEMV_ROWS] == "gemv"


@pytest.mark.skipif(cpu_kernels() is None, reason="needs the compiled CPU kernels")
def test_the_constants_run_a_stream_on_the_team_stack(tiny_llama: Path) -> None:
    """``--cpu-kernels default``: with panels, a batch of one runs on them (the bf16 GEMV
    took it before, and the stack then ran layer by layer), so the team serves it."""
    from engine.sampling_params import SamplingParams

    kernels = cpu_kernels()
    assert kernels is not None
    dtype = "bfloat16" if kernels.bf16_dot else "float32"  # the team's panel kinds
    core = make_core(tiny_llama, dtype=dtype, cpu_kernels="default")
    assert core.runner.kernel_routes is not None and core.runner.kernel_routes.constants
    before = kernels.ops.decode_team_runs()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    core.generate([[5, 6, 7, 8]], params)
    assert kernels.ops.decode_team_runs() - before == 5  # every decode step
