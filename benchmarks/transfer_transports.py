"""The CPU KV transports side by side on the same leases: shm, gloo and nixl.

For each lease size (64 KiB, 1 MiB and 32 MiB by default) every transport moves the
same leases: the same source blocks into the same destination blocks, drawn once at
random from the whole pool (scattered, as a long-running decode pool hands them out: the
worst case for nixl's coalescing, which then needs one descriptor per block). Sender and
receiver run in this process on their own threads, each with its own pool (for nixl its
own NIXL agent, talking over UCX as two processes would), so the numbers are the
transport's own cost: gather or descriptors, checksum, wire, verify.

Per transport and size: GB/s of the send (submit to the sender's completion) and of
the whole lease (lease granted to verified), and the lease latency (granted to
verified) at p50 and max, best of ``--rounds``. A transport that cannot run here (nixl
without its library) is reported as such, not dropped silently.

    python -m benchmarks.transfer_transports [--sizes 65536,1048576,33554432]
        [--leases 20] [--rounds 3] [--kinds shm,gloo,nixl] [--results-dir DIR]

``UCX_TLS`` (e.g. ``shm`` or ``tcp``) picks the UCX transports nixl may use, as on a
cluster. Results measured on a shared, loaded machine are not worth committing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from benchmarks.provenance import header_lines, isa_line, machine

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SIZES = (64 << 10, 1 << 20, 32 << 20)
KINDS = ("shm", "gloo", "nixl")
_WAIT_S = 60.0
T = TypeVar("T")


def _layout(block_bytes: int):  # noqa: ANN202 - engine types imported lazily
    from engine.kv_layout import KVLayout

    # 4 layers x K/V x 2 heads x 16 tokens x 64 dims x fp32 = 64 KiB a block.
    layout = KVLayout(num_layers=4, block_size=16, num_kv_heads=2, head_dim=64, dtype="float32")
    if block_bytes % layout.block_bytes and layout.block_bytes % block_bytes:
        raise ValueError(f"sizes must be multiples or divisors of {layout.block_bytes} bytes")
    if block_bytes < layout.block_bytes:  # smaller blocks for tiny (smoke) sizes
        factor = layout.block_bytes // block_bytes
        if 64 % factor:
            raise ValueError(f"size {block_bytes} cannot be one block of this layout")
        layout = KVLayout(4, 16, 2, 64 // factor, "float32")
    return layout


def leases(
    num_blocks: int, per_lease: int, count: int, seed: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``count`` (source, destination) block lists of ``per_lease`` blocks each."""
    rng = random.Random(seed)
    return [
        (
            tuple(rng.sample(range(num_blocks), per_lease)),
            tuple(rng.sample(range(num_blocks), per_lease)),
        )
        for _ in range(count)
    ]


def _next(poll: Callable[[], list[T]], wake: threading.Event) -> T:
    end = time.monotonic() + _WAIT_S
    while time.monotonic() < end:
        items = poll()
        if items:
            return items[0]
        wake.wait(0.0005)
        wake.clear()
    raise TimeoutError(f"no completion within {_WAIT_S} s")


def measure(
    kind: str,
    lease_bytes: int,
    plan: list[tuple[tuple[int, ...], tuple[int, ...]]],
    num_blocks: int,
) -> dict[str, Any]:
    """Move every lease of ``plan`` once (after one warm-up lease); times in seconds."""
    import torch

    from engine.transfer.base import SendJob, TransferConfig
    from engine.transfer.block_copy import torch_dtype
    from engine.transfer.factory import make_receiver, make_sender

    per_lease = len(plan[0][0])
    layout = _layout(lease_bytes // per_lease)
    config = TransferConfig(stall_timeout_s=30.0)
    wake = threading.Event()
    receiver = make_receiver(kind, layout, num_blocks, config=config, notify=wake.set)
    source = torch.randn(layout.pool_shape(num_blocks)).to(torch_dtype(layout))
    sender = make_sender(kind, source, layout, config, notify=wake.set)
    send_s: list[float] = []
    lease_s: list[float] = []
    try:
        for i, (src, dst) in enumerate([plan[0], *plan]):
            rid = f"bench-{i}"
            deadline = time.monotonic() + _WAIT_S
            start = time.perf_counter()
            desc = receiver.expect(rid, dst, i, deadline)
            sender.submit(SendJob(rid, src, desc, deadline))
            sent = _next(sender.poll, wake)
            sent_at = time.perf_counter()
            if not sent.ok:
                raise RuntimeError(f"{kind} lease {i} failed: {sent.error}")
            receiver.verify(rid, sent.checksum or 0, i)
            done = _next(receiver.poll, wake)
            if not done.ok:
                raise RuntimeError(f"{kind} lease {i} did not verify: {done.error}")
            if i:  # lease 0 connects and warms up
                send_s.append(sent_at - start)
                lease_s.append(time.perf_counter() - start)
    finally:
        sender.close()
        receiver.close()
    nbytes = per_lease * layout.block_bytes
    lease_s.sort()
    return {
        "kind": kind,
        "lease_bytes": nbytes,
        "leases": len(send_s),
        "send_gbps": nbytes * len(send_s) / sum(send_s) / 1e9,
        "lease_gbps": nbytes * len(lease_s) / sum(lease_s) / 1e9,
        "lease_p50_ms": lease_s[len(lease_s) // 2] * 1e3,
        "lease_max_ms": lease_s[-1] * 1e3,
    }


def run(opts: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for size in opts.sizes:
        per_lease = max(1, size // (64 << 10))
        num_blocks = max(4 * per_lease, 64)
        plan = leases(num_blocks, per_lease, opts.leases, seed=size)
        for kind in opts.kinds:
            try:
                rounds = [measure(kind, size, plan, num_blocks) for _ in range(opts.rounds)]
            except (RuntimeError, ImportError) as exc:
                rows.append({"kind": kind, "lease_bytes": size, "error": str(exc)})
                print(f"{kind} {size} B: {exc}", file=sys.stderr, flush=True)
                continue
            best = max(rounds, key=lambda r: r["lease_gbps"])
            rows.append(best)
            print(
                f"{kind} {size} B: {best['lease_gbps']:.3f} GB/s, "
                f"p50 {best['lease_p50_ms']:.2f} ms",
                flush=True,
            )
    return rows


def render(rows: list[dict[str, Any]], header: list[str]) -> str:
    lines = [
        *header,
        "",
        "| lease | transport | send GB/s | lease GB/s | lease p50 ms | lease max ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        size = _size(r["lease_bytes"])
        if "error" in r:
            lines.append(f"| {size} | {r['kind']} | could not run: {r['error']} | | | |")
            continue
        lines.append(
            f"| {size} | {r['kind']} | {r['send_gbps']:.3f} | {r['lease_gbps']:.3f} | "
            f"{r['lease_p50_ms']:.2f} | {r['lease_max_ms']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def _size(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def _sizes(text: str) -> tuple[int, ...]:
    sizes = tuple(int(x) for x in text.split(","))
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--sizes must be positive byte counts, got {text!r}")
    return sizes


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(text.split(","))
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise argparse.ArgumentTypeError(f"--kinds must be among {KINDS}, got {bad}")
    return kinds


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", type=_sizes, default=DEFAULT_SIZES, help="bytes per lease")
    p.add_argument("--leases", type=int, default=20, help="leases per transport and size")
    p.add_argument("--rounds", type=int, default=3, help="best of this many rounds")
    p.add_argument("--kinds", type=_kinds, default=KINDS)
    p.add_argument("--results-dir", type=Path, default=REPO / "benchmarks" / "results")
    return p


def main(argv: list[str] | None = None) -> Path:
    opts = _parser().parse_args(argv)
    if opts.leases < 1 or opts.rounds < 1:
        raise SystemExit(f"--leases ({opts.leases}) and --rounds ({opts.rounds}) must be >= 1")
    load_before = os.getloadavg()
    rows = run(opts)
    load_after, now = os.getloadavg(), dt.datetime.now()
    command = "python -m benchmarks.transfer_transports " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    header = [
        f"# KV transports side by side, {now:%Y-%m-%d %H:%M}",
        "",
        *header_lines(command.strip(), None, load_before, load_after, now),
        f"UCX_TLS: {os.environ.get('UCX_TLS', '(unset: UCX picks)')}",
        "",
        f"{opts.leases} leases per transport and size, the same scattered blocks for every "
        f"transport; best of {opts.rounds} rounds. Sender and receiver in one process, own "
        "pools, own threads.",
    ]
    text = render(rows, header)
    opts.results_dir.mkdir(parents=True, exist_ok=True)
    stem = opts.results_dir / f"transfer_transports_{now:%Y-%m-%d}"
    raw = {
        "date": now.isoformat(timespec="seconds"),
        "command": command.strip(),
        "machine": machine(),
        "cpu_flags": isa_line(),
        "rows": rows,
    }
    stem.with_suffix(".json").write_text(json.dumps(raw, indent=2) + "\n")
    stem.with_suffix(".md").write_text(text)
    print(text, flush=True)
    return stem.with_suffix(".md")


if __name__ == "__main__":
    main()
