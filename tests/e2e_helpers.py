"""Helpers for the end-to-end tests over real processes on loopback.

A cluster of the tiny model (:func:`tiny_cluster`), raw stubs to assert exact status codes,
prompts that never hit a prefix cache, worker ``Stats``, and the check every failure test
ends with: all KV blocks free again on every live worker (:func:`wait_settled`).

Plain functions and one context manager, not fixtures, so each test module says which
cluster it runs (one per module, to keep the 2-core CI fast).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc
import grpc.aio
import pytest

from gateway.core_plan import WorkerCores
from gateway.launcher import ClusterSpec, LocalCluster, LocalProcess
from protos.baton.v1 import common_pb2, generate_pb2, generate_pb2_grpc, worker_pb2, worker_pb2_grpc

T = TypeVar("T")

# How long a cluster may take to let go of every block after a request ended.
SETTLE_S = 10.0
# Token ids drawn for prompts: ordinary vocabulary, clear of the special tokens at the start.
_PROMPT_IDS = (1000, 20000)


class E2ECluster(LocalCluster):
    """A :class:`LocalCluster` that can give prefill and decode workers their own flags.

    It also gives every shm decode worker its own segment name. Without one, every shm
    decode worker takes the default ``--transport-address`` (``127.0.0.1:0``) as its
    segment name, so a second one on the host cannot start (see
    ``test_service_integrity.test_default_shm_segment_names_do_not_collide``).
    Flags added here come last on the command line, so they win over ``worker_args``.
    """

    def __init__(
        self,
        spec: ClusterSpec,
        *,
        prefill_args: Sequence[str] = (),
        decode_args: Sequence[str] = (),
    ) -> None:
        super().__init__(spec)
        self._extra = {"prefill": tuple(prefill_args), "decode": tuple(decode_args)}
        self._argv: dict[int, tuple[int, list[str]]] = {}

    def _spawn(
        self,
        kind: str,
        index: int,
        argv: list[str],
        port: int = 0,
        cores: WorkerCores | None = None,
        lending: Path | None = None,
    ) -> LocalProcess:
        extra = list(self._extra.get(kind, ()))
        if kind == "decode" and self.spec.mode == "disaggregated" and self._uses_shm(argv):
            extra += ["--transport-address", f"baton-e2e-{uuid.uuid4().hex[:16]}"]
        proc = super()._spawn(kind, index, [*argv, *extra], port, cores=cores, lending=lending)
        self._argv[id(proc)] = (index, list(argv))
        return proc

    def _uses_shm(self, argv: list[str]) -> bool:
        # The last --transport on the command line wins, as argparse has it.
        flags = [*argv, *self.spec.worker_args]
        picked = [flags[i + 1] for i, f in enumerate(flags[:-1]) if f == "--transport"]
        return (picked[-1] if picked else self.spec.transport) == "shm"

    def argv_of(self, proc) -> list[str]:  # noqa: ANN001
        """The command line ``proc`` was started with (before per-process extras)."""
        return list(self._argv[id(proc)][1])

    def respawn(self, kind: str, argv: list[str], port: int, timeout_s: float = 120.0):  # noqa: ANN201
        """Start a worker again on ``port`` (a restarted pod), wait until it serves and
        list it in its fleet (its own port and log file, as every start has)."""
        return self.add_worker(kind, argv=argv, port=port, timeout_s=timeout_s)

    def live_workers(self) -> list[tuple[str, str]]:
        """(kind, address) of every worker process still running."""
        return [
            (p.kind, p.address)
            for p in self.procs
            if p.kind != "gateway" and p.popen.poll() is None
        ]

    def kill_address(self, address: str) -> None:
        """SIGKILL the worker serving ``address``."""
        for p in self.procs:
            if p.address == address:
                p.popen.kill()
                p.popen.wait()
                return
        raise KeyError(address)


@contextlib.contextmanager
def tiny_cluster(
    model_dir: Path,
    *,
    mode: str = "disaggregated",
    num_prefill: int = 1,
    num_decode: int = 1,
    worker_args: Sequence[str] = (),
    prefill_args: Sequence[str] = (),
    decode_args: Sequence[str] = (),
    gateway_args: Sequence[str] = (),
    http_port: int | None = None,
    probe_credentials: grpc.ChannelCredentials | None = None,
    metrics: bool = False,
) -> Iterator[E2ECluster]:
    """Start a cluster of the tiny model (float32, one compute thread per worker); stop
    it on the way out, whatever happened. ``http_port`` (0: any) turns on the gateway's
    OpenAI-compatible HTTP API (``cluster.http_address``); ``metrics`` every process's
    Prometheus metrics (``proc.metrics_address``)."""
    spec = ClusterSpec(
        model=str(model_dir),
        mode=mode,
        transport="shm",
        num_prefill=num_prefill,
        num_decode=num_decode,
        dtype="float32",
        worker_args=("--num-threads", "1", *worker_args),
        # Every prompt goes through the prefill worker unless a test asks otherwise: these
        # clusters exist to exercise the hand-off (test_e2e_conditional_prefill turns the
        # gateway's local prefill back on).
        gateway_args=("--stats-interval-s", "0.1", "--local-prefill-tokens", "0", *gateway_args),
        start_timeout_s=180.0,
        log_level="INFO",
        http_port=http_port,
        probe_credentials=probe_credentials,
        metrics=metrics,
    )
    with E2ECluster(spec, prefill_args=prefill_args, decode_args=decode_args) as cluster:
        yield cluster


# --- requests --------------------------------------------------------------------------


def prompt_ids(n: int, label: str) -> list[int]:
    """``n`` token ids, the same for the same ``label``; distinct labels share no prefix
    block, so no prefix cache makes their prefill instant."""
    rng = random.Random(label)
    return [rng.randrange(*_PROMPT_IDS) for _ in range(n)]


def ids_request(
    n: int, label: str, *, max_tokens: int, request_id: str | None = None, **sampling: object
) -> generate_pb2.GenerateRequest:
    """A greedy token-id request that ignores EOS, so it runs ``max_tokens`` steps."""
    params = common_pb2.SamplingParameters(
        max_tokens=max_tokens, temperature=0, ignore_eos=True, **sampling
    )
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt_ids(n, label)), sampling_params=params
    )
    if request_id is not None:
        request.request_id = request_id
    return request


@contextlib.asynccontextmanager
async def gateway_stub(address: str) -> AsyncIterator[generate_pb2_grpc.BatonStub]:
    async with grpc.aio.insecure_channel(address) as channel:
        yield generate_pb2_grpc.BatonStub(channel)


@dataclass(slots=True)
class Outcome:
    """How one Generate call ended."""

    responses: list[generate_pb2.GenerateResponse] = field(default_factory=list)
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""
    elapsed_s: float = 0.0

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.responses)

    @property
    def finish_reason(self) -> int:
        return self.responses[-1].finish_reason if self.responses else 0

    def __str__(self) -> str:
        return (
            f"{self.code.name} after {self.elapsed_s:.2f}s and {self.num_tokens} tokens: "
            f"{self.details}"
        )


async def collect(call: grpc.aio.UnaryStreamCall, began: float | None = None) -> Outcome:
    """Read ``call`` to its end (with ``read``, so a test may have read some of it
    already); never raises for a failed status."""
    began = time.monotonic() if began is None else began
    out = Outcome()
    try:
        while (response := await call.read()) is not grpc.aio.EOF:
            out.responses.append(response)
    except grpc.aio.AioRpcError as err:
        out.code, out.details = err.code(), err.details() or ""
    out.elapsed_s = time.monotonic() - began
    return out


async def generate(
    stub: generate_pb2_grpc.BatonStub,
    request: generate_pb2.GenerateRequest,
    timeout: float | None = 60.0,
) -> Outcome:
    return await collect(stub.Generate(request, timeout=timeout))


def assert_completed(outcome: Outcome, max_tokens: int, logs: str = "") -> None:
    """The call finished normally with ``max_tokens`` tokens (requests here ignore EOS)."""
    assert outcome.code is grpc.StatusCode.OK, f"{outcome}\n{logs}"
    assert outcome.finish_reason == common_pb2.FINISH_REASON_LENGTH, f"{outcome}\n{logs}"
    assert outcome.num_tokens == max_tokens, f"{outcome}\n{logs}"


# --- workers ----------------------------------------------------------------------------


def _channel(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
    if credentials is None:
        return grpc.aio.insecure_channel(address)
    return grpc.aio.secure_channel(address, credentials)


async def worker_stats(
    address: str,
    kind: str,
    timeout: float = 2.0,
    credentials: grpc.ChannelCredentials | None = None,
) -> worker_pb2.WorkerStats:
    """One ``Stats`` call to a ``kind`` ("prefill" or "decode") worker."""
    async with _channel(address, credentials) as channel:
        stub_class = (
            worker_pb2_grpc.PrefillWorkerStub
            if kind == "prefill"
            else worker_pb2_grpc.DecodeWorkerStub
        )
        return await stub_class(channel).Stats(worker_pb2.StatsRequest(), timeout=timeout)


def settled(stats: worker_pb2.WorkerStats) -> bool:
    """Every block free, nothing held for a transfer, no request anywhere in the engine."""
    return (
        stats.total_kv_blocks > 0
        and stats.free_kv_blocks == stats.total_kv_blocks
        and stats.held_kv_blocks == 0
        and stats.num_running == 0
        and stats.num_waiting == 0
        and stats.num_waiting_for_kv == 0
    )


def describe(stats: worker_pb2.WorkerStats) -> str:
    return (
        f"free {stats.free_kv_blocks}/{stats.total_kv_blocks}, held {stats.held_kv_blocks}, "
        f"running {stats.num_running}, waiting {stats.num_waiting}, waiting for KV "
        f"{stats.num_waiting_for_kv}, queued prompt tokens {stats.queued_prompt_tokens}"
    )


async def wait_settled(
    workers: Sequence[tuple[str, str]],
    *,
    timeout: float = SETTLE_S,
    logs: Callable[[], str] = lambda: "",
    credentials: grpc.ChannelCredentials | None = None,
) -> None:
    """Poll every (kind, address) worker until each is :func:`settled`; fail the test with
    their last stats (and the cluster's logs) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: dict[str, str] = {}
    while True:
        pending = []
        for kind, address in workers:
            try:
                stats = await worker_stats(address, kind, credentials=credentials)
            except grpc.aio.AioRpcError as err:
                last[address] = f"Stats failed: {err.code().name}: {err.details()}"
                pending.append(address)
                continue
            last[address] = describe(stats)
            if not settled(stats):
                pending.append(address)
        if not pending:
            return
        if time.monotonic() > deadline:
            lines = "\n".join(f"  {kind} {addr}: {last[addr]}" for kind, addr in workers)
            pytest.fail(f"workers did not free their KV within {timeout:.0f}s:\n{lines}\n{logs()}")
        await asyncio.sleep(0.05)


async def wait_for(
    check: Callable[[], Awaitable[T]], what: str, timeout: float = 10.0, interval: float = 0.01
) -> T:
    """Await ``check()`` (an async callable) until it returns something truthy; return it.
    Fails the test naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(interval)
