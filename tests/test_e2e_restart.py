"""A decode worker restarted on the same address while requests flow: the prefill
worker drops every trace of the old incarnation (its pool mapping, its connections), no
block stays held anywhere, and the new incarnation serves."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest

from tests.e2e_helpers import (
    E2ECluster,
    gateway_stub,
    generate,
    ids_request,
    tiny_cluster,
    wait_for,
    wait_settled,
    worker_stats,
)


def _restart(cluster: E2ECluster, address: str) -> None:
    """SIGKILL the worker at ``address`` and start it again on the same port."""
    (proc,) = [p for p in cluster.procs if p.address == address]
    argv = cluster.argv_of(proc)
    proc.popen.kill()
    proc.popen.wait()
    cluster.procs.remove(proc)
    port = int(address.rsplit(":", 1)[1])
    new = cluster.respawn(proc.kind, argv, port)
    assert new.address == address


def _segments_mapped(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as maps:
        return {line.split("/dev/shm/")[1].strip() for line in maps if "/dev/shm/baton_kv" in line}


def _thread_names(pid: int) -> list[str]:
    """The process's OS thread names, sorted."""
    names = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            names.append((task / "comm").read_text().strip())
    return sorted(names)


# The threads a gloo process group runs (its device's TCP loop, its work loops), as
# gloo names them. gRPC's event-engine pool grows and shrinks with load, so a count of
# all threads said nothing about connections.
_GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")


def _gloo_threads(pid: int) -> int:
    return sum(1 for name in _thread_names(pid) if name in _GLOO_THREADS)


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_decode_restart_on_the_same_address_under_traffic(tiny_llama: Path, transport: str) -> None:
    with tiny_cluster(
        tiny_llama,
        worker_args=("--transport", transport),
        gateway_args=("--max-retries", "3"),
    ) as cluster:
        (decode,) = cluster.addresses("decode")
        prefill_pid = cluster.process("prefill").pid

        async def run() -> None:
            async with gateway_stub(cluster.gateway_address) as stub:
                before = await worker_stats(decode, "decode")
                stop = asyncio.Event()
                outcomes = []

                async def traffic() -> None:
                    i = 0
                    while not stop.is_set():
                        i += 1
                        outcomes.append(
                            await generate(stub, ids_request(40, f"t{i}", max_tokens=6), 30)
                        )

                flows = [asyncio.create_task(traffic()) for _ in range(4)]
                await asyncio.sleep(1.0)

                async def served() -> bool:  # the link to the old incarnation is built
                    return any(o.code.name == "OK" for o in outcomes)

                await wait_for(served, "a request served by the first incarnation", timeout=30)
                old_segments = _segments_mapped(prefill_pid)
                threads_before = _gloo_threads(prefill_pid)
                names_before = _thread_names(prefill_pid)
                await asyncio.to_thread(_restart, cluster, decode)
                after = await wait_for(
                    lambda: _stats_if_new(decode, before.incarnation_id),
                    "the new decode incarnation",
                    timeout=30,
                )
                await asyncio.sleep(2.0)  # traffic on the new incarnation
                stop.set()
                await asyncio.gather(*flows)
                served_after = [o for o in outcomes[-8:] if o.code.name == "OK"]
                assert served_after, [str(o) for o in outcomes[-8:]]
                assert after.incarnation_id != before.incarnation_id

                # The old incarnation's pool is no longer mapped by prefill (shm), and
                # its connection threads are gone (gloo).
                def clean() -> bool:
                    if transport == "shm":
                        return not (old_segments & _segments_mapped(prefill_pid))
                    return _gloo_threads(prefill_pid) <= threads_before

                deadline = time.monotonic() + 10
                while not clean() and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                if transport == "shm":
                    assert old_segments and not (old_segments & _segments_mapped(prefill_pid))
                else:
                    names_after = _thread_names(prefill_pid)
                    assert threads_before and _gloo_threads(prefill_pid) <= threads_before, (
                        f"threads before: {names_before}; after: {names_after}"
                    )
                await wait_settled(cluster.live_workers(), logs=cluster.logs)

        asyncio.run(run())


async def _stats_if_new(address: str, old: str):  # noqa: ANN202
    with contextlib.suppress(Exception):
        stats = await worker_stats(address, "decode")
        if stats.incarnation_id != old:
            return stats
    return None
