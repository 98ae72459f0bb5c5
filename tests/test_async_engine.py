"""The asyncio face: concurrency, abort, seeds, the KV hand-off hooks, bad input."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine.async_engine import AsyncEngine
from engine.errors import ResourceExhaustedError
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from tests.engine_helpers import make_core

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


async def _collect(
    engine: AsyncEngine,
    rid: str,
    prompt: list[int],
    params: SamplingParams,
    log: list[str] | None = None,
) -> list[int]:
    out: list[int] = []
    async for o in engine.generate(rid, prompt, params):
        out.extend(o.new_token_ids)
        if log is not None:
            log.append(rid)
    return out


async def _wait_all_free(engine: AsyncEngine) -> None:
    for _ in range(100):
        st = engine.stats()
        if st.num_free_blocks == st.num_total_blocks and st.num_running == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"blocks not freed: {st}")


@pytest.fixture
async def engine(tiny_llama: Path):
    eng = AsyncEngine(make_core(tiny_llama, num_blocks=128))
    await eng.start()
    yield eng
    await eng.shutdown()


async def test_32_concurrent_requests_interleave_and_match_sync(
    tiny_llama: Path, engine: AsyncEngine
) -> None:
    prompts = [[100 + i] * (5 + 3 * i) for i in range(32)]
    ref = make_core(tiny_llama).generate(prompts, GREEDY)
    log: list[str] = []
    results = await asyncio.gather(
        *[_collect(engine, f"r{i}", p, GREEDY, log) for i, p in enumerate(prompts)]
    )
    assert results == ref
    # Interleaved: some request got a token before another one's first token arrived and
    # after it too, i.e. streams progressed together rather than one after another.
    first = {rid: log.index(rid) for rid in set(log)}
    last = {rid: len(log) - 1 - log[::-1].index(rid) for rid in set(log)}
    overlapping = sum(1 for r in first if first[r] < last["r0"]) - 1
    assert overlapping >= 16, f"only {overlapping} streams overlapped r0"
    await _wait_all_free(engine)


async def test_abort_mid_generation_frees_all_blocks(engine: AsyncEngine) -> None:
    seen = 0
    async for out in engine.generate(
        "a", list(range(200, 260)), SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
    ):
        seen += len(out.new_token_ids)
        if seen >= 3:
            break
    assert seen == 3
    await _wait_all_free(engine)


async def test_explicit_abort_ends_stream_with_abort_reason(engine: AsyncEngine) -> None:
    reasons = []

    async def consume() -> None:
        async for out in engine.generate(
            "b", [5, 6, 7], SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
        ):
            if out.finish_reason is not None:
                reasons.append(out.finish_reason)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.2)
    engine.abort("b")
    await asyncio.wait_for(task, 10)
    assert reasons == [FinishReason.ABORT]
    await _wait_all_free(engine)


async def test_seeded_sampling_is_reproducible_regardless_of_company(engine: AsyncEngine) -> None:
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    alone = await _collect(engine, "s1", [11, 12, 13], params)
    crowd = await asyncio.gather(
        _collect(engine, "s2", [11, 12, 13], params),
        *[
            _collect(engine, f"n{i}", [20 + i] * 9, SamplingParams(max_tokens=16, temperature=1.0))
            for i in range(5)
        ],
    )
    assert alone == crowd[0]
    other = await _collect(
        engine,
        "s3",
        [11, 12, 13],
        SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99),
    )
    assert other != alone


@pytest.mark.parametrize(
    ("prompt", "params", "needle"),
    [
        ([], GREEDY, "prompt_token_ids"),
        ([1, 2, 10**9], GREEDY, "1000000000"),
        ([1] * 2000, GREEDY, "max_model_len"),
    ],
)
async def test_invalid_requests_raise_value_error_and_allocate_nothing(
    engine: AsyncEngine, prompt: list[int], params: SamplingParams, needle: str
) -> None:
    with pytest.raises(ValueError, match=needle):
        async for _ in engine.generate("bad", prompt, params):
            pass
    await _wait_all_free(engine)


async def test_reserve_then_kv_ready_continues_from_the_first_token(
    tiny_llama: Path, engine: AsyncEngine
) -> None:
    prompt = list(range(300, 340))
    ref = make_core(tiny_llama).generate([prompt], GREEDY)[0]
    # Pretend a prefill worker filled the blocks: compute the prompt's KV with a hold_kv
    # request on the same engine, then copy its blocks into the lease.
    held = None
    async for out in engine.generate(
        "p", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), hold_kv=True
    ):
        held = out
    assert held is not None and held.held_block_ids
    lease, stream = await engine.reserve("d", prompt, GREEDY)
    # The engine's prefix cache holds the prompt's two full blocks (the held request
    # computed them): the lease shares them and covers only the last, partial one, as a
    # prefill worker would then send only its blocks from first_block on.
    assert lease.first_block == 2 and len(lease.block_ids) == 1
    kv = engine.core.runner.kv_cache
    src = held.held_block_ids[lease.first_block :]
    kv[:, :, :, lease.block_ids] = kv[:, :, :, src]
    engine.release_held("p")
    engine.kv_ready("d", held.new_token_ids[0])
    rest: list[int] = []
    async for out in stream:
        rest.extend(out.new_token_ids)
    assert [held.new_token_ids[0], *rest] == ref
    await _wait_all_free(engine)


async def test_reserve_when_pool_is_full_raises_resource_exhausted(engine: AsyncEngine) -> None:
    prompt = list(range(1000, 1900))  # 57 blocks of the 128
    leases = [await engine.reserve(f"big{i}", prompt, GREEDY) for i in range(2)]
    assert all(len(lease.block_ids) == 57 for lease, _ in leases)
    with pytest.raises(ResourceExhaustedError):
        await engine.reserve("big2", prompt, GREEDY)
    # Stats are the engine thread's per-step snapshot, which may still predate the second
    # lease: wait for one that shows both, and nothing more taken by the refused one.
    expected = 128 - 2 * 57
    for _ in range(100):
        st = engine.stats()
        if st.num_waiting_for_kv == 2 and st.num_free_blocks <= expected:
            break
        await asyncio.sleep(0.02)
    assert (st.num_waiting_for_kv, st.num_free_blocks) == (2, expected)
    for i in range(2):
        engine.abort(f"big{i}")
    await _wait_all_free(engine)


async def test_serial_mode_runs_the_loop_on_the_compute_thread_and_matches_sync(
    tiny_llama: Path,
) -> None:
    core = make_core(tiny_llama, num_blocks=128)
    eng = AsyncEngine(core, overlap=False)
    seen: set[bool] = set()
    schedule = core.scheduler.schedule

    def recording_schedule():  # type: ignore[no-untyped-def]
        seen.add(core.runner.compute.on_thread())
        return schedule()

    core.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    await eng.start()
    try:
        prompts = [[200 + i] * (4 + 5 * i) for i in range(8)]
        ref = make_core(tiny_llama).generate(prompts, GREEDY)
        log: list[str] = []
        results = await asyncio.gather(
            *[_collect(eng, f"s{i}", p, GREEDY, log) for i, p in enumerate(prompts)]
        )
        assert results == ref
        assert seen == {True}, "serial mode schedules on the compute thread"
        await _wait_all_free(eng)
    finally:
        await eng.shutdown()
