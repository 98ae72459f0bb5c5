"""The decode worker's side of the KV hand-off protocol, against a prefill worker that lies.

A real ``DecodeServicer`` (tiny model, shm transport, 64 blocks, 1 s transfer timeout)
runs in this process behind a real ``RpcServer``, and so does a fake ``PrefillWorker``
that answers each ``Prefill`` stream as a test tells it: a correct hand-off (the control),
a wrong checksum, a wrong epoch, no TransferComplete, no first token, a stream closed
early. Every bad hand-off must end the ``Decode`` stream with its typed status within the
transfer timeout (DESIGN "KV ownership"), with no token beyond the one prefill sampled,
and leave every decode block free. A real prefill worker process with another block
size is refused by the layout handshake; the same process, writing into a receiver of
this test, frees the source blocks it holds when the ack never comes.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import grpc.aio
import pytest
import pytest_asyncio

from decode_service.servicer import SERVICE_NAME as DECODE_SERVICE
from decode_service.servicer import DecodeServicer
from engine.config import EngineConfig
from engine.errors import UnavailableError
from engine.kv_layout import KVLayout
from engine.transfer.block_copy import Staging, checksum_blocks
from engine.transfer.factory import make_receiver
from gateway.launcher import wait_serving
from protos.baton.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from rpc.convert import kv_descriptor_to_proto
from rpc.server import RpcServer, ServerSpec
from rpc.worker_config import WorkerConfig
from tests.e2e_helpers import SETTLE_S, describe, prompt_ids, settled

pytestmark = pytest.mark.asyncio(loop_scope="module")

PREFILL_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name
NUM_BLOCKS = 64
TRANSFER_TIMEOUT_S = 1.0
FIRST_TOKEN = 42
CALL_TIMEOUT_S = 20.0


# --- the fake prefill worker ---------------------------------------------------------------


class FakePrefill(worker_pb2_grpc.PrefillWorkerServicer):
    """Plays ``behaviour`` on every Prefill stream and records what decode sent.

    Behaviours: ``ok`` (first token, then a TransferComplete whose checksum matches the
    blocks as they are), ``bad_checksum``, ``bad_epoch``, ``no_transfer_complete`` (first
    token, then silence), ``no_first_token`` (silence), ``close_after_first_token``,
    ``unavailable`` (fails before the first token), ``slow_with_progress`` (progress
    beats for 3x the stall bound, then ok), ``progress_then_silence``.
    """

    def __init__(self, decode: DecodeServicer) -> None:
        self.decode = decode
        self.other_decodes: list[DecodeServicer] = []  # more decode workers it serves
        self.behaviour = "ok"
        self.requests: list[worker_pb2.PrefillRequest] = []
        self.acks: list[worker_pb2.TransferAck] = []
        self.cancelled: list[str] = []

    async def Stats(self, request, context):  # noqa: N802 (gRPC method name)
        return worker_pb2.WorkerStats(role=worker_pb2.WORKER_ROLE_PREFILL, incarnation_id="fake")

    async def Prefill(self, request_iterator, context):  # noqa: N802
        incoming = aiter(request_iterator)
        first = await anext(incoming)
        req = first.request
        self.requests.append(req)
        behaviour = self.behaviour
        try:
            if behaviour == "unavailable":
                raise UnavailableError("fake prefill is going away")
            if behaviour == "no_first_token":
                await asyncio.sleep(3600)
            if behaviour == "slow_with_progress":
                # A long prefill: silent apart from progress beats, 3x the stall bound.
                for _ in range(10):
                    await asyncio.sleep(TRANSFER_TIMEOUT_S * 0.3)
                    yield worker_pb2.PrefillServerMessage(
                        progress=worker_pb2.PrefillProgress(
                            phase=worker_pb2.PREFILL_PHASE_PREFILLING, num_computed_tokens=16
                        )
                    )
            if behaviour == "progress_then_silence":
                yield worker_pb2.PrefillServerMessage(
                    progress=worker_pb2.PrefillProgress(phase=worker_pb2.PREFILL_PHASE_QUEUED)
                )
                await asyncio.sleep(3600)
            yield worker_pb2.PrefillServerMessage(
                first_token=worker_pb2.FirstToken(token_id=FIRST_TOKEN)
            )
            if behaviour == "close_after_first_token":
                return
            if behaviour == "no_transfer_complete":
                await asyncio.sleep(3600)
            checksum, epoch = self._checksum(req), req.kv.block_epoch
            if behaviour == "bad_checksum":
                checksum ^= 0x5A5A5A5A
            elif behaviour == "bad_epoch":
                epoch += 1000
            yield worker_pb2.PrefillServerMessage(
                transfer_complete=worker_pb2.TransferComplete(
                    request_id=req.request_id,
                    checksum=checksum,
                    epoch=epoch,
                    num_bytes=1,
                )
            )
            ack = await anext(incoming, None)
            if ack is not None:
                self.acks.append(ack.ack)
        except asyncio.CancelledError:
            self.cancelled.append(req.request_id)
            raise

    def _checksum(self, req: worker_pb2.PrefillRequest) -> int:
        """What a real sender would report for the blocks as they are now."""
        receivers = [d.inbox.receiver for d in (self.decode, *self.other_decodes)]  # type: ignore[union-attr]
        receiver = next(
            r for r in receivers if r is not None and r.endpoint.address == req.kv.endpoint
        )
        return checksum_blocks(
            receiver.kv_cache, receiver.layout, tuple(req.kv.block_ids), 16 << 20, Staging("cpu")
        )


# --- fixtures ----------------------------------------------------------------------------


@dataclass(slots=True)
class Rig:
    decode: DecodeServicer
    decode_address: str
    prefill: FakePrefill
    prefill_address: str
    stub: worker_pb2_grpc.DecodeWorkerStub
    servers: list[RpcServer] = field(default_factory=list)


def _decode_config(model: Path, **overrides: object) -> WorkerConfig:
    values: dict[str, object] = {
        "transport": "shm",
        # Its own segment name: see test_default_shm_segment_names_do_not_collide.
        "transport_address": f"baton-it-{uuid.uuid4().hex[:16]}",
        "transfer_timeout_s": TRANSFER_TIMEOUT_S,
        "grace_s": 0.0,
    }
    values.update(overrides)
    engine = EngineConfig(model=str(model), dtype="float32", num_blocks=NUM_BLOCKS, num_threads=1)
    return WorkerConfig(role="decode", engine=engine, **values)  # type: ignore[arg-type]


async def _serve(name: str, service: str, register, ready=None) -> RpcServer:  # noqa: ANN001
    server = RpcServer(
        ServerSpec(name=name, register=register, service_names=(service,), ready=ready, grace_s=0.0)
    )
    await server.start()
    await server.wait_ready()
    return server


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(tiny_llama: Path) -> AsyncIterator[Rig]:
    decode = DecodeServicer(_decode_config(tiny_llama))
    fake = FakePrefill(decode)
    servers: list[RpcServer] = []
    try:
        servers.append(
            await _serve(
                "decode",
                DECODE_SERVICE,
                lambda s: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(decode, s),
                ready=decode.start,
            )
        )
        servers.append(
            await _serve(
                "fake-prefill",
                PREFILL_SERVICE,
                lambda s: worker_pb2_grpc.add_PrefillWorkerServicer_to_server(fake, s),
            )
        )
        decode_address = f"127.0.0.1:{servers[0].port}"
        async with grpc.aio.insecure_channel(decode_address) as channel:
            yield Rig(
                decode,
                decode_address,
                fake,
                f"127.0.0.1:{servers[1].port}",
                worker_pb2_grpc.DecodeWorkerStub(channel),
                servers,
            )
    finally:
        for server in reversed(servers):
            await server.stop()
        await decode.close()


@pytest.fixture(scope="module")
def small_block_prefill(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A real prefill worker process whose KV blocks hold 32 tokens (decode's hold 16)."""
    workdir = tmp_path_factory.mktemp("prefill-32")
    port_file, log = workdir / "port", workdir / "prefill.log"
    cmd = [
        sys.executable,
        "-m",
        "prefill_service",
        "--model",
        str(tiny_llama),
        "--dtype",
        "float32",
        "--block-size",
        "32",
        "--num-blocks",
        "64",
        "--num-threads",
        "1",
        "--grace-s",
        "0",
        "--log-level",
        "INFO",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--port-file",
        str(port_file),
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (port_file.exists() and port_file.read_text().strip()):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        address = f"127.0.0.1:{int(port_file.read_text())}"
        wait_serving(address, deadline - time.monotonic())
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --- helpers -------------------------------------------------------------------------------


@dataclass(slots=True)
class Ending:
    token_ids: list[int]
    code: grpc.StatusCode
    details: str
    elapsed_s: float

    def __str__(self) -> str:
        return (
            f"{self.code.name} after {self.elapsed_s:.2f}s, tokens {self.token_ids}: {self.details}"
        )


def _decode_request(
    rid: str, prefill: str, n: int = 40, max_tokens: int = 8
) -> worker_pb2.DecodeRequest:
    return worker_pb2.DecodeRequest(
        request_id=rid,
        prompt_token_ids=prompt_ids(n, rid),
        sampling_params=common_pb2.SamplingParameters(
            max_tokens=max_tokens, temperature=0, ignore_eos=True
        ),
        prefill_address=prefill,
    )


async def _decode(rig: Rig, request: worker_pb2.DecodeRequest) -> Ending:
    began = time.monotonic()
    tokens: list[int] = []
    call = rig.stub.Decode(request, timeout=CALL_TIMEOUT_S)
    try:
        async for response in call:
            tokens.extend(response.token_ids)
    except grpc.aio.AioRpcError as err:
        return Ending(tokens, err.code(), err.details() or "", time.monotonic() - began)
    return Ending(tokens, grpc.StatusCode.OK, "", time.monotonic() - began)


async def _decode_settles(rig: Rig) -> None:
    deadline = time.monotonic() + SETTLE_S
    while True:
        stats = await rig.stub.Stats(worker_pb2.StatsRequest(), timeout=2)
        if settled(stats):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"decode did not free its KV within {SETTLE_S:.0f}s: {describe(stats)}")
        await asyncio.sleep(0.02)


def _rid(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


# --- the hand-off ----------------------------------------------------------------------------


def _attempted(rid: str, engine_ids: list[str]) -> bool:
    """Decode runs each attempt under the client's id plus ``#<attempt>``."""
    return any(e.startswith(f"{rid}#") for e in engine_ids)


async def test_a_correct_hand_off_decodes(rig: Rig) -> None:
    """The control: the fake speaks the protocol well enough to be believed."""
    rig.prefill.behaviour = "ok"
    rid = _rid("ok")
    ending = await _decode(rig, _decode_request(rid, rig.prefill_address, max_tokens=8))
    assert ending.code is grpc.StatusCode.OK, str(ending)
    assert len(ending.token_ids) == 8 and ending.token_ids[0] == FIRST_TOKEN, str(ending)
    req = rig.prefill.requests[-1]
    # Each Decode attempt runs under its own engine id: the client's id plus "#<attempt>".
    assert req.request_id.startswith(f"{rid}#") and req.kv.request_id == req.request_id
    assert len(req.kv.block_ids) == 3  # 40 tokens in blocks of 16
    assert rig.prefill.acks[-1].ok and rig.prefill.acks[-1].request_id == req.request_id
    await _decode_settles(rig)


@pytest.mark.parametrize(
    ("behaviour", "reason"),
    [("bad_checksum", "checksum"), ("bad_epoch", "epoch")],
)
async def test_a_transfer_that_does_not_verify_is_aborted(
    rig: Rig, behaviour: str, reason: str
) -> None:
    rig.prefill.behaviour = behaviour
    rid = _rid(behaviour)
    ending = await _decode(rig, _decode_request(rid, rig.prefill_address))
    assert ending.code is grpc.StatusCode.ABORTED, str(ending)
    assert reason in ending.details, str(ending)
    assert ending.token_ids in ([], [FIRST_TOKEN]), str(ending)
    assert ending.elapsed_s < TRANSFER_TIMEOUT_S + 2, str(ending)
    ack = rig.prefill.acks[-1]
    assert ack.request_id.startswith(f"{rid}#") and not ack.ok and reason in ack.reason, ack
    await _decode_settles(rig)


async def test_no_transfer_complete_ends_at_the_transfer_timeout(rig: Rig) -> None:
    rig.prefill.behaviour = "no_transfer_complete"
    rid = _rid("silent")
    ending = await _decode(rig, _decode_request(rid, rig.prefill_address))
    # A stalled peer, while the client's deadline is far away: retryable ABORTED.
    assert ending.code is grpc.StatusCode.ABORTED, str(ending)
    assert "no progress" in ending.details, str(ending)
    assert ending.token_ids in ([], [FIRST_TOKEN]), str(ending)
    assert TRANSFER_TIMEOUT_S - 0.1 < ending.elapsed_s < TRANSFER_TIMEOUT_S + 2, str(ending)
    await _decode_settles(rig)
    assert _attempted(rid, rig.prefill.cancelled), "decode left the Prefill stream open"


async def test_no_first_token_ends_at_the_transfer_timeout(rig: Rig) -> None:
    rig.prefill.behaviour = "no_first_token"
    rid = _rid("mute")
    ending = await _decode(rig, _decode_request(rid, rig.prefill_address))
    assert ending.code is grpc.StatusCode.ABORTED, str(ending)
    assert ending.token_ids == [], str(ending)
    assert ending.elapsed_s < TRANSFER_TIMEOUT_S + 2, str(ending)
    await _decode_settles(rig)
    assert _attempted(rid, rig.prefill.cancelled), "decode left the Prefill stream open"


async def test_progress_beats_keep_a_long_prefill_alive(rig: Rig) -> None:
    """The hand-off bound is on progress, not on prompt length: a prefill that takes 3x
    the stall bound but keeps reporting progress completes."""
    rig.prefill.behaviour = "slow_with_progress"
    ending = await _decode(rig, _decode_request(_rid("slow"), rig.prefill_address))
    assert ending.code is grpc.StatusCode.OK, str(ending)
    assert ending.elapsed_s > 2.5 * TRANSFER_TIMEOUT_S, str(ending)
    await _decode_settles(rig)


async def test_silence_after_a_beat_ends_at_the_stall_bound(rig: Rig) -> None:
    rig.prefill.behaviour = "progress_then_silence"
    ending = await _decode(rig, _decode_request(_rid("beat-then-mute"), rig.prefill_address))
    assert ending.code is grpc.StatusCode.ABORTED, str(ending)
    assert ending.elapsed_s < TRANSFER_TIMEOUT_S + 2, str(ending)
    await _decode_settles(rig)


async def test_two_decode_workers_sharing_a_prefill_worker_never_collide(
    rig: Rig, tiny_llama: Path
) -> None:
    """The same client request id (a gateway retry, or two gateways) on two fresh decode
    workers reaches the shared prefill worker as two distinct ids."""
    decodes = [DecodeServicer(_decode_config(tiny_llama)) for _ in range(2)]
    servers = [
        await _serve(
            f"decode-{i}",
            DECODE_SERVICE,
            lambda s, d=d: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(d, s),
            ready=d.start,
        )
        for i, d in enumerate(decodes)
    ]
    rig.prefill.other_decodes.extend(decodes)
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") for s in servers]
    try:
        rig.prefill.behaviour = "ok"
        rid = _rid("shared")
        rigs = [
            Rig(d, "", rig.prefill, rig.prefill_address, worker_pb2_grpc.DecodeWorkerStub(c))
            for d, c in zip(decodes, channels, strict=True)
        ]
        endings = await asyncio.gather(
            *(_decode(r, _decode_request(rid, rig.prefill_address)) for r in rigs)
        )
        assert all(e.code is grpc.StatusCode.OK for e in endings), [str(e) for e in endings]
        seen = [r.request_id for r in rig.prefill.requests if r.request_id.startswith(rid)]
        assert len(seen) == 2 and len(set(seen)) == 2, seen
        for r in rigs:
            await _decode_settles(r)
    finally:
        for d in decodes:
            rig.prefill.other_decodes.remove(d)
        for c in channels:
            await c.close()
        for server in servers:
            await server.stop()
        for d in decodes:
            await d.close()


@pytest.mark.parametrize(
    ("behaviour", "code"),
    [
        ("close_after_first_token", grpc.StatusCode.ABORTED),
        ("unavailable", grpc.StatusCode.UNAVAILABLE),
    ],
)
async def test_a_prefill_that_goes_away_fails_fast(
    rig: Rig, behaviour: str, code: grpc.StatusCode
) -> None:
    rig.prefill.behaviour = behaviour
    ending = await _decode(rig, _decode_request(_rid(behaviour), rig.prefill_address))
    assert ending.code is code, str(ending)
    assert ending.token_ids in ([], [FIRST_TOKEN]), str(ending)
    assert ending.elapsed_s < TRANSFER_TIMEOUT_S, str(ending)
    await _decode_settles(rig)


async def test_client_cancel_while_waiting_for_the_transfer(rig: Rig) -> None:
    """The hand-off held open after the first token; the caller goes away."""
    rig.prefill.behaviour = "no_transfer_complete"
    rid = _rid("cancel-in-transfer")
    call = rig.stub.Decode(_decode_request(rid, rig.prefill_address), timeout=CALL_TIMEOUT_S)
    # Decode holds the first token back until the KV is verified; wait for the fake to
    # have sent it, then check the lease is still open.
    deadline = time.monotonic() + 5
    while not _attempted(rid, [r.request_id for r in rig.prefill.requests]):
        assert time.monotonic() < deadline, "prefill never saw the request"
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.1)
    stats = await rig.stub.Stats(worker_pb2.StatsRequest(), timeout=2)
    assert stats.num_waiting_for_kv == 1 and stats.free_kv_blocks == NUM_BLOCKS - 3, describe(stats)
    call.cancel()
    await _decode_settles(rig)
    deadline = time.monotonic() + 5
    while not _attempted(rid, rig.prefill.cancelled):
        assert time.monotonic() < deadline, "decode left the Prefill stream open"
        await asyncio.sleep(0.02)


# --- the layout handshake ----------------------------------------------------------------------


async def test_a_prefill_worker_with_another_block_size_is_refused(
    rig: Rig, small_block_prefill: str
) -> None:
    rid = _rid("layout")
    ending = await _decode(rig, _decode_request(rid, small_block_prefill))
    assert ending.code is grpc.StatusCode.FAILED_PRECONDITION, str(ending)
    assert "block_size" in ending.details, str(ending)
    assert "16" in ending.details and "32" in ending.details, str(ending)
    assert ending.token_ids == [], str(ending)
    await _decode_settles(rig)
    async with grpc.aio.insecure_channel(small_block_prefill) as channel:
        stats = await worker_pb2_grpc.PrefillWorkerStub(channel).Stats(
            worker_pb2.StatsRequest(), timeout=2
        )
    assert settled(stats), describe(stats)
    assert stats.kv_layout.block_size == 32


async def test_prefill_frees_its_blocks_when_decode_leaves_before_the_ack(
    small_block_prefill: str,
) -> None:
    """The other side of the hand-off: a real prefill worker writes into a receiver of
    this process, reports TransferComplete and holds its source blocks for the ack; the
    decode side goes away instead of acknowledging, and prefill frees them."""
    layout = KVLayout(num_layers=2, block_size=32, num_kv_heads=2, head_dim=16, dtype="float32")
    receiver = make_receiver("shm", layout, 16, address=f"baton-it-{uuid.uuid4().hex[:16]}")
    rid = _rid("no-ack")
    try:
        desc = receiver.expect(rid, (3, 4), 7, time.monotonic() + 10)
        async with grpc.aio.insecure_channel(small_block_prefill) as channel:
            stub = worker_pb2_grpc.PrefillWorkerStub(channel)
            call = stub.Prefill(timeout=CALL_TIMEOUT_S)
            await call.write(
                worker_pb2.PrefillClientMessage(
                    request=worker_pb2.PrefillRequest(
                        request_id=rid,
                        prompt_token_ids=prompt_ids(40, rid),
                        sampling_params=common_pb2.SamplingParameters(max_tokens=4, temperature=0),
                        kv=kv_descriptor_to_proto(desc),
                    )
                )
            )
            first = await call.read()
            assert first.WhichOneof("message") == "first_token", first
            done = await call.read()
            assert done.WhichOneof("message") == "transfer_complete", done
            assert (done.transfer_complete.request_id, done.transfer_complete.epoch) == (rid, 7)
            held = await stub.Stats(worker_pb2.StatsRequest(), timeout=2)
            assert held.held_kv_blocks == 2, describe(held)  # 40 tokens in blocks of 32
            call.cancel()
            deadline = time.monotonic() + SETTLE_S
            while not settled(stats := await stub.Stats(worker_pb2.StatsRequest(), timeout=2)):
                assert time.monotonic() < deadline, describe(stats)
                await asyncio.sleep(0.02)
        # What prefill wrote verifies on this side.
        receiver.verify(rid, done.transfer_complete.checksum, done.transfer_complete.epoch)
        deadline = time.monotonic() + 5
        while not (completions := receiver.poll()):
            assert time.monotonic() < deadline, "the lease did not end"
            await asyncio.sleep(0.01)
        assert [(c.request_id, c.ok) for c in completions] == [(rid, True)], completions
    finally:
        await asyncio.to_thread(receiver.close)


# --- known bugs: these fail until the services are fixed ----------------------------------------


async def test_a_retry_with_the_same_request_id_is_accepted(rig: Rig) -> None:
    """The gateway retries a request that failed before its first token with the same
    DecodeRequest (same request_id), often on the same decode worker
    (gateway/routing/dispatcher.py).
    Decode keeps the failed attempt's engine request until its lease has ended
    (``_discard_after``), so a quick retry is refused as INVALID_ARGUMENT "request_id ...
    is already in use", which the gateway does not retry: a transient prefill failure
    reaches the client as a bad-request error."""
    refused = []
    for _ in range(50):
        rid = _rid("retry")
        rig.prefill.behaviour = "unavailable"
        failed = await _decode(rig, _decode_request(rid, rig.prefill_address))
        assert failed.code is grpc.StatusCode.UNAVAILABLE, str(failed)
        rig.prefill.behaviour = "ok"
        retried = await _decode(rig, _decode_request(rid, rig.prefill_address))
        if retried.code is not grpc.StatusCode.OK:
            refused.append(str(retried))
    await _decode_settles(rig)
    assert not refused, f"{len(refused)} of 50 retries refused, e.g. {refused[0]}"


async def test_default_shm_segment_names_do_not_collide(tiny_llama: Path) -> None:
    """Two shm decode workers on one host, both configured by default. The default
    --transport-address (127.0.0.1:0, meant for gloo/nccl) becomes the shm segment's name,
    so the second worker (or any while another test or deployment runs one) fails with
    "shm segment '127.0.0.1:0' already exists" (STYLE: no fixed shared-memory names)."""
    args = ["--model", str(tiny_llama), "--dtype", "float32", "--num-blocks", "8"]
    cfg = WorkerConfig.from_args("decode", [*args, "--transport", "shm"], {})
    first, second = DecodeServicer(cfg), DecodeServicer(cfg)
    try:
        await first.start()
        await second.start()
        assert first.inbox is not None and second.inbox is not None
        assert first.inbox.receiver is not None and second.inbox.receiver is not None
        names = {first.inbox.receiver.endpoint.address, second.inbox.receiver.endpoint.address}
        assert len(names) == 2, names
    finally:
        await second.close()
        await first.close()
