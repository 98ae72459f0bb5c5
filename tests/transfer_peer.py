"""One side of a cross-process KV transfer, plus the small factories the transfer tests share.

Run as a script it is an independently started receiver or sender process that knows
its peer only through the descriptor passed as a JSON line:

    transfer_peer.py receive --kind shm ...   # prints {"descriptor": ...}, reads
                                              # {"checksum": C, "epoch": E}, prints result
    transfer_peer.py send --kind shm --descriptor JSON ...   # prints the send result

Both regenerate the same source pool from ``--seed``, so the receiver checks the bytes
it got without ever seeing the sender's memory.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import os
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest
import torch

from engine.kv_layout import BLOCK_DIM, KVLayout
from engine.transfer.base import KVDescriptor, KVEndpoint, SendJob, TransferConfig
from engine.transfer.block_copy import torch_dtype
from engine.transfer.factory import make_receiver, make_sender
from engine.transfer.fleet_auth import FleetKey
from engine.transfer.nixl_agent import INSTALL_HINT, nixl_available

T = TypeVar("T")
REPO = Path(__file__).resolve().parent.parent

# The nixl transport, run where its library is installed (the "nixl" extra).
NIXL = pytest.param(
    "nixl",
    marks=pytest.mark.skipif(
        not nixl_available(), reason=f"nixl_cu12 is not importable: {INSTALL_HINT}"
    ),
)

# One layer per message, so every transfer is cut into several layer groups.
SMALL_GROUPS = TransferConfig(group_bytes=1, connect_timeout_s=10.0, stall_timeout_s=2.0)


def small_layout(dtype: str = "float32", num_layers: int = 4, head_dim: int = 8) -> KVLayout:
    return KVLayout(
        num_layers=num_layers, block_size=4, num_kv_heads=2, head_dim=head_dim, dtype=dtype
    )


def random_pool(layout: KVLayout, num_blocks: int, seed: int, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    pool = torch.randn(layout.pool_shape(num_blocks), generator=generator)
    return pool.to(torch_dtype(layout)).to(device)


def blocks(pool: torch.Tensor, ids: tuple[int, ...] | list[int]) -> torch.Tensor:
    return pool.index_select(BLOCK_DIM, torch.tensor(list(ids), device=pool.device))


def wait_for(poll: Callable[[], list[T]], timeout: float = 10.0) -> T:
    """The one item ``poll`` yields within ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        items = poll()
        if items:
            assert len(items) == 1, items
            return items[0]
        time.sleep(0.002)
    raise AssertionError(f"nothing completed within {timeout} s")


def shm_segments() -> set[str]:
    return {path.name for path in Path("/dev/shm").glob("baton_kv_*")}


def transfer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("baton-transfer")]


def assert_nothing_left_behind(segments_before: set[str]) -> None:
    """No transport thread outlives its closed owner; no segment outlives its receiver."""
    end = time.monotonic() + 5
    while transfer_threads() and time.monotonic() < end:
        time.sleep(0.01)
    assert transfer_threads() == []
    assert shm_segments() - segments_before == set()


def spawn_peer(*args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), *args],
        cwd=REPO,
        env=env,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )


def read_json_line(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        if not selector.select(timeout):
            raise AssertionError(f"peer printed nothing within {timeout} s")
    line = proc.stdout.readline()
    assert line, f"peer exited with {proc.wait(5)}"
    return json.loads(line)


def cross_process_transfer(
    kind: str,
    dtype: str,
    receiver_device: str = "cpu",
    sender_device: str = "cpu",
    timeout: float = 25.0,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Start a receiver process, then a sender process given only its descriptor; relay
    the sender's report to the receiver. Returns (sent, received) as the peers print them."""
    common = ["--kind", kind, "--dtype", dtype, "--seed", "11", "--src", "3,0,7,12"]
    receiver = spawn_peer(
        "receive", *common, "--dst", "30,1,17,8", "--epoch", "5", "--device", receiver_device
    )
    sender: subprocess.Popen[str] | None = None
    try:
        descriptor = read_json_line(receiver, timeout)["descriptor"]
        sender = spawn_peer("send", *common, "--descriptor", descriptor, "--device", sender_device)
        sent = read_json_line(sender, timeout)
        assert receiver.stdin is not None
        receiver.stdin.write(json.dumps({"checksum": sent["checksum"], "epoch": 5}) + "\n")
        receiver.stdin.flush()
        received = read_json_line(receiver, timeout)
        assert receiver.wait(10) == 0
        assert sender.wait(10) == 0
        return sent, received
    finally:
        for proc in (receiver, sender):
            if proc is None:
                continue
            if proc.poll() is None:
                proc.kill()
            proc.wait(5)
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()


def descriptor_to_json(desc: KVDescriptor) -> str:
    """The test processes' stand-in for the proto that carries a descriptor in production."""
    ep = desc.endpoint
    return json.dumps(
        {
            "kind": ep.kind,
            "address": ep.address,
            "incarnation": ep.incarnation,
            "layout": [
                ep.layout.num_layers,
                ep.layout.block_size,
                ep.layout.num_kv_heads,
                ep.layout.head_dim,
                ep.layout.dtype,
            ],
            "num_blocks": ep.num_blocks,
            "handle": base64.b64encode(ep.handle).decode(),
            "request_id": desc.request_id,
            "block_ids": list(desc.block_ids),
            "epoch": desc.epoch,
            "lease_token": desc.lease_token,
        }
    )


def descriptor_from_json(text: str) -> KVDescriptor:
    d = json.loads(text)
    layers, block_size, heads, head_dim, dtype = d["layout"]
    endpoint = KVEndpoint(
        d["kind"],
        d["address"],
        d["incarnation"],
        KVLayout(layers, block_size, heads, head_dim, dtype),
        d["num_blocks"],
        base64.b64decode(d["handle"]),
    )
    return KVDescriptor(
        endpoint, d["request_id"], tuple(d["block_ids"]), d["epoch"], d["lease_token"]
    )


def _ids(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def _emit(payload: dict[str, Any]) -> None:
    print(json.dumps(payload), flush=True)


def _receive(args: argparse.Namespace) -> None:
    layout = small_layout(args.dtype)
    receiver = make_receiver(
        args.kind, layout, args.num_blocks, config=SMALL_GROUPS, device=args.device
    )
    try:
        desc = receiver.expect(
            "req-x", _ids(args.dst), args.epoch, time.monotonic() + args.deadline
        )
        _emit({"descriptor": descriptor_to_json(desc)})
        report = json.loads(sys.stdin.readline())
        receiver.verify("req-x", report["checksum"], report["epoch"])
        done = wait_for(receiver.poll, args.deadline)
        source = random_pool(layout, args.src_pool_blocks, args.seed)
        got = blocks(receiver.kv_cache, _ids(args.dst)).cpu()
        _emit(
            {
                "ok": done.ok,
                "error": repr(done.error),
                "data_ok": bool(torch.equal(got, blocks(source, _ids(args.src)))),
            }
        )
    finally:
        receiver.close()


def _send(args: argparse.Namespace) -> None:
    layout = small_layout(args.dtype)
    source = random_pool(layout, args.src_pool_blocks, args.seed, args.device)
    config = SMALL_GROUPS
    if args.fleet_secret_file:
        key = FleetKey.from_file(Path(args.fleet_secret_file))
        config = dataclasses.replace(SMALL_GROUPS, fleet_key=key)
    sender = make_sender(args.kind, source, layout, config)
    if args.stall_at_group >= 0:

        def stall(request_id: str, group: int) -> None:
            if group == args.stall_at_group:
                _emit({"stalled_at": group})
                time.sleep(3600)  # a sender frozen mid-write, its claim standing

        sender._on_group = stall  # type: ignore[attr-defined]
    try:
        desc = descriptor_from_json(args.descriptor)
        sender.submit(
            SendJob(desc.request_id, _ids(args.src), desc, time.monotonic() + args.deadline)
        )
        done = wait_for(sender.poll, args.deadline)
        _emit(
            {
                "ok": done.ok,
                "error": repr(done.error),
                "checksum": done.checksum,
                "epoch": done.epoch,
                "num_bytes": done.num_bytes,
            }
        )
    finally:
        sender.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("role", choices=["receive", "send"])
    parser.add_argument("--kind", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--src", required=True, help="source block ids, comma-separated")
    parser.add_argument("--dst", default="", help="destination block ids (receiver)")
    parser.add_argument("--src-pool-blocks", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=32)
    parser.add_argument("--epoch", type=int, default=1)
    parser.add_argument("--deadline", type=float, default=20.0)
    parser.add_argument("--descriptor", default="")
    parser.add_argument(
        "--stall-at-group",
        type=int,
        default=-1,
        help="sender: freeze before this layer group, claim held",
    )
    parser.add_argument("--fleet-secret-file", default="", help="sender: the fleet's secret")
    args = parser.parse_args(argv)
    if args.role == "receive":
        _receive(args)
    else:
        _send(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
