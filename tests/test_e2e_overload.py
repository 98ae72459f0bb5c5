"""Load and overload through real processes on the tiny model.

- 256 concurrent streams through one gateway: all complete, with greedy tokens equal to
  HF's (a divergence counts only at a near tie), although decode seats only 64 at once:
  the rest wait in its reservation FIFO, served as blocks free up.
- 4x over a gateway's capacity (256 streams at a cap of 64), burst after burst: the
  excess gets RESOURCE_EXHAUSTED without waiting for a slot (within a second, median
  over the bursts), nothing else fails, every worker's free KV blocks return to their
  initial value, and no process's RSS keeps growing once warm.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway.launcher import wait_serving
from tests.e2e_helpers import (
    E2ECluster,
    Outcome,
    assert_completed,
    collect,
    gateway_stub,
    generate,
    ids_request,
    prompt_ids,
    tiny_cluster,
    wait_settled,
    worker_stats,
)
from tests.engine_helpers import compare_greedy, hf_greedy, hf_model

MAX_TOKENS = 12
# Bursts use longer streams, so the admitted ones hold their slots for the whole burst.
BURST_TOKENS = 64
PROMPT_LEN = 24
LABELS = [f"load-{i}" for i in range(16)]  # 16 distinct prompts, each sent many times
STREAMS = 256
SMALL_CAP = 64
# How fast refusals must come. A refusal that waited for a slot would take as long as the
# stream holding it, so in every burst no refusal may outlast the longest admitted stream
# (both scale with a stall of the shared cores, which stretches the whole burst), and over
# all bursts together the median must stay under REFUSAL_P50_S. A per-burst median is not
# asserted: on 2 shared cores one burst's refusals can queue behind its own admissions
# (a CI run had one burst stall to a 1.8 s median, the other eleven at 0.14-0.2 s).
REFUSAL_P50_S = 1.0
# A worker's RSS climbs over its first bursts (the native allocator's arenas and caches
# warming to the batch shapes: Python's own heap stays flat, measured with tracemalloc)
# and then stays level, though it swings by 20-30 MiB from one burst to the next as the
# allocator trims and regrows. A leak grows with the requests served instead: the highest
# RSS of the last TAIL_BURSTS bursts (256 streams each) may pass the highest of the
# TAIL_BURSTS before them by less than RSS_GROWTH_BYTES, so a leak of ~32 KiB per stream
# fails. Maxima of windows, not two single readings: one trimmed reading is not a leak.
BURSTS = 12
TAIL_BURSTS = 4
RSS_GROWTH_BYTES = 32 << 20


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path) -> Iterator[E2ECluster]:
    with tiny_cluster(
        tiny_llama,
        worker_args=("--max-queued-requests", "512", "--num-blocks", "1024"),
        decode_args=("--max-num-seqs", "64"),
        gateway_args=("--max-concurrent-streams", str(STREAMS)),
    ) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> dict[str, tuple[list[int], Any]]:
    """HF's greedy continuation (BURST_TOKENS long; shorter requests check its prefix)."""
    hf = hf_model(tiny_llama)
    return {label: hf_greedy(hf, prompt_ids(PROMPT_LEN, label), BURST_TOKENS) for label in LABELS}


def _check_tokens(
    outcomes: list[Outcome], labels: list[str], reference: dict, max_tokens: int = MAX_TOKENS
) -> list[str]:
    verdicts = []
    for outcome, label in zip(outcomes, labels, strict=True):
        assert_completed(outcome, max_tokens)
        tokens = [t for r in outcome.responses for t in r.token_ids]
        ref, logits = reference[label]
        verdicts.append(compare_greedy(tokens, ref[:max_tokens], logits))
    assert "mismatch" not in verdicts, verdicts
    return verdicts


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _workers(cluster: E2ECluster) -> list[tuple[str, str]]:
    return [(k, a) for k in ("prefill", "decode") for a in cluster.addresses(k)]


async def _free_blocks(cluster: E2ECluster) -> dict[str, int]:
    return {a: (await worker_stats(a, k)).free_kv_blocks for k, a in _workers(cluster)}


def test_256_concurrent_streams_all_complete_and_are_correct(
    cluster: E2ECluster, reference: dict
) -> None:
    labels = [LABELS[i % len(LABELS)] for i in range(STREAMS)]

    async def run() -> list[Outcome]:
        initial = await _free_blocks(cluster)
        async with gateway_stub(cluster.gateway_address) as stub:
            began = time.monotonic()
            outcomes = await asyncio.gather(
                *(
                    generate(stub, ids_request(PROMPT_LEN, label, max_tokens=MAX_TOKENS), 180)
                    for label in labels
                )
            )
            print(f"{STREAMS} concurrent streams in {time.monotonic() - began:.1f} s")
        await wait_settled(_workers(cluster), logs=cluster.logs)
        assert await _free_blocks(cluster) == initial
        return outcomes

    outcomes = asyncio.run(run())
    failed = [str(o) for o in outcomes if o.code is not grpc.StatusCode.OK]
    assert not failed, f"{len(failed)} failed, e.g. {failed[:3]}\n{cluster.logs()}"
    verdicts = _check_tokens(outcomes, labels, reference)
    print(f"equal={verdicts.count('equal')} ties={verdicts.count('tie')}")
    assert verdicts.count("tie") <= STREAMS // 8


def test_four_times_over_capacity_the_excess_is_refused_at_once(
    cluster: E2ECluster, reference: dict
) -> None:
    # A second gateway in front of the same workers, with a quarter of the capacity.
    gw_args = ["gateway", "--model", cluster.spec.model, "--log-level", "INFO"]
    gw_args += ["--max-concurrent-streams", str(SMALL_CAP), "--stats-interval-s", "0.1"]
    for kind in ("decode", "prefill"):
        for address in cluster.addresses(kind):
            gw_args += [f"--{kind}", address]
    t0 = time.monotonic()
    small = cluster._spawn("gateway", 1, gw_args)
    cluster._await_port(small, time.monotonic() + 120)
    wait_serving(small.address, 120, small)
    print(f"second gateway up in {time.monotonic() - t0:.1f} s")
    pids = {p.kind + p.address: p.popen.pid for p in cluster.procs}
    labels = [LABELS[i % len(LABELS)] for i in range(4 * SMALL_CAP)]

    async def burst() -> tuple[list[Outcome], bool]:
        """SMALL_CAP streams take every slot; then three times as many arrive at once.
        Also whether every slot stayed taken until the excess had its answers (an admitted
        stream that ended sooner, when this client stalls, frees a slot for the excess)."""
        async with gateway_stub(small.address) as stub:
            admitted = [
                stub.Generate(ids_request(PROMPT_LEN, label, max_tokens=BURST_TOKENS), timeout=180)
                for label in labels[:SMALL_CAP]
            ]
            began = time.monotonic()
            firsts = await asyncio.gather(*(call.read() for call in admitted))
            ended: list[float] = []

            async def hold(call) -> Outcome:  # noqa: ANN001 - a grpc.aio stream call
                outcome = await collect(call, began)
                ended.append(time.monotonic())
                return outcome

            holders = [asyncio.create_task(hold(call)) for call in admitted]
            excess = await asyncio.gather(
                *(
                    generate(stub, ids_request(PROMPT_LEN, label, max_tokens=BURST_TOKENS), 180)
                    for label in labels[SMALL_CAP:]
                )
            )
            answered = time.monotonic()
            rest = await asyncio.gather(*holders)
        for first, outcome in zip(firsts, rest, strict=True):
            outcome.responses.insert(0, first)
        return rest + excess, all(t > answered for t in ended)

    async def run() -> list[list[Outcome]]:
        initial = await _free_blocks(cluster)
        rounds = []
        for _ in range(BURSTS):
            t0 = time.monotonic()
            rounds.append(await burst())
            print(f"burst took {time.monotonic() - t0:.1f} s")
            await wait_settled(_workers(cluster), logs=cluster.logs)
            assert await _free_blocks(cluster) == initial
            rss.append({name: _rss(pid) for name, pid in pids.items()})
        return rounds

    rss: list[dict[str, int]] = []
    rounds = asyncio.run(run())
    full = sum(held for _, held in rounds)
    pooled: list[float] = []
    assert full >= BURSTS // 2, f"only {full} of {BURSTS} bursts kept every slot taken"
    for outcomes, held in rounds:
        served = [
            (o, label) for o, label in zip(outcomes, labels, strict=True) if o.code.name == "OK"
        ]
        refused = [o for o in outcomes if o.code is grpc.StatusCode.RESOURCE_EXHAUSTED]
        others = [str(o) for o in outcomes if o.code.name not in ("OK", "RESOURCE_EXHAUSTED")]
        assert not others, f"{len(others)} failed otherwise, e.g. {others[:3]}"
        assert len(served) >= SMALL_CAP, len(served)
        if held:  # else the excess rightly took the slots that freed up
            assert len(refused) >= 2 * SMALL_CAP, (len(served), len(refused))
        times = sorted(o.elapsed_s for o in refused) or [0.0]
        streams = sorted(o.elapsed_s for o in outcomes[:SMALL_CAP])
        slowest = times[-1]
        median = times[len(times) // 2]
        assert slowest < streams[-1], f"a refusal took {slowest:.2f} s, past every stream"
        pooled += times
        assert all(f"limit of {SMALL_CAP} concurrent streams" in o.details for o in refused)
        _check_tokens(
            [o for o, _ in served], [label for _, label in served], reference, BURST_TOKENS
        )
        print(
            f"4x burst: {len(served)} served, {len(refused)} refused in "
            f"{median * 1000:.0f} ms (p50) / {slowest * 1000:.0f} ms (max); streams held "
            f"their slots {streams[len(streams) // 2]:.1f} s (p50)"
        )
    pooled.sort()
    assert pooled[len(pooled) // 2] < REFUSAL_P50_S, (
        f"refusals took {pooled[len(pooled) // 2]:.2f} s (median over {BURSTS} bursts)"
    )
    # RSS: level once warm.
    for name in pids:
        readings = [r[name] for r in rss]
        growth = max(readings[-TAIL_BURSTS:]) - max(readings[-2 * TAIL_BURSTS : -TAIL_BURSTS])
        print(f"RSS {name}: " + " / ".join(f"{r >> 20}" for r in readings) + " MiB")
        assert growth < RSS_GROWTH_BYTES, (
            f"{name}'s highest RSS grew {growth >> 20} MiB over the last {TAIL_BURSTS} bursts"
        )
