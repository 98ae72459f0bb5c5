"""The engine timeline: what it records, the Chrome trace it writes, and the worker flag.

The recorder itself (tracks, complete and async events, the file), an ``AsyncEngine``
whose loop and runner record on it (and whose next step is scheduled while the current
one computes: the overlap the timeline exists to show), the shm transfer worker's sends
and leases, ``--timeline-file`` on real worker processes, and the plot of two workers'
files (without matplotlib: the trace and the report still written, one line saying why).
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.kv_layout import KVLayout
from engine.sampling_params import SamplingParams
from engine.timeline import ENGINE, OFF, RECEIVE, RUNNER, SEND, TRACKS, Timeline
from engine.transfer.base import SendJob
from engine.transfer.factory import make_receiver, make_sender
from tests.e2e_helpers import gateway_stub, generate, ids_request, tiny_cluster
from tests.engine_helpers import make_core

STEP_S = 0.03  # each forward made at least this slow, so spans are measurable


def spans(doc: dict[str, Any], ph: str = "X") -> list[dict[str, Any]]:
    return [e for e in doc["traceEvents"] if e["ph"] == ph]


def tracks_of(doc: dict[str, Any]) -> dict[int, str]:
    return {
        e["tid"]: e["args"]["name"]
        for e in doc["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }


# --- the recorder -------------------------------------------------------------------------


def test_off_records_nothing_and_costs_one_shared_no_op() -> None:
    assert not OFF.enabled
    assert OFF.span("forward", RUNNER) is OFF.span("sample", RUNNER)
    with OFF.span("forward", RUNNER):
        pass
    OFF.complete("send", SEND, time.perf_counter_ns())
    OFF.interval("lease", RECEIVE, time.perf_counter_ns(), "r1")


def test_spans_from_many_threads_become_a_chrome_trace(tmp_path: Path) -> None:
    tl = Timeline("decode")

    def work(i: int) -> None:
        for _ in range(50):
            with tl.span("forward", RUNNER, {"i": i}):
                pass

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    started = time.perf_counter_ns()
    time.sleep(0.002)
    tl.interval("lease", RECEIVE, started, "r1", {"blocks": 3})
    path = tmp_path / "t.json"
    tl.write(path)
    doc = json.loads(path.read_text())
    assert [e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"] == [
        "decode"
    ]
    assert sorted(tracks_of(doc).values()) == sorted(TRACKS)
    forwards = spans(doc)
    assert len(forwards) == 200 and {e["name"] for e in forwards} == {"forward"}
    assert {tracks_of(doc)[e["tid"]] for e in forwards} == {RUNNER}
    assert all(e["dur"] >= 0 for e in forwards)
    (begin,) = spans(doc, "b")
    (end,) = spans(doc, "e")
    assert begin["id"] == end["id"] == "r1" and begin["args"] == {"blocks": 3}
    assert end["ts"] - begin["ts"] >= 2000  # microseconds
    assert doc["otherData"]["dropped_events"] == 0


def test_past_max_events_the_oldest_go() -> None:
    tl = Timeline("prefill", max_events=3)
    for name in "abcde":
        tl.complete(name, ENGINE, time.perf_counter_ns())
    assert [e[0] for e in tl.events()] == ["c", "d", "e"] and tl.num_dropped == 2
    with pytest.raises(ValueError, match="max_events"):
        Timeline("x", max_events=0)


# --- the engine loop and the runner ---------------------------------------------------------


async def test_the_engine_loop_schedules_the_next_step_under_the_current_forward(
    tiny_llama: Path,
) -> None:
    core = await asyncio.to_thread(make_core, tiny_llama, num_blocks=64)
    real = core.runner._forward

    def slow(batch):  # noqa: ANN001, ANN202
        time.sleep(STEP_S)
        return real(batch)

    core.runner._forward = slow  # type: ignore[method-assign]
    tl = Timeline("worker")
    # The overlapping loop, asked for: left to itself the engine runs serially wherever the
    # forward's team holds every core (as on a 2-core host), and then nothing overlaps.
    engine = AsyncEngine(core, timeline=tl, overlap=True)
    await engine.start()
    try:
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        outs = [o async for o in engine.generate("t1", list(range(300, 340)), params)]
    finally:
        await engine.shutdown()
    assert sum(len(o.new_token_ids) for o in outs) == 6
    doc = tl.to_chrome()
    names = tracks_of(doc)
    by_track: dict[str, list[dict[str, Any]]] = {}
    for e in spans(doc):
        by_track.setdefault(names[e["tid"]], []).append(e)
    assert {e["name"] for e in by_track[ENGINE]} >= {"schedule", "wait", "update"}
    forwards = [e for e in by_track[RUNNER] if e["name"] == "forward"]
    assert len(forwards) >= 6
    assert {e["name"] for e in by_track[RUNNER]} == {"prepare", "forward", "sample"}
    assert forwards[0]["args"] == {"seqs": 1, "decode_seqs": 0, "prefill_tokens": 40}
    assert forwards[-1]["args"] == {"seqs": 1, "decode_seqs": 1, "prefill_tokens": 0}
    assert all(e["dur"] >= STEP_S * 1e6 * 0.9 for e in forwards)
    # Overlap: some step's scheduling ran entirely while a forward was computing.
    schedules = [e for e in by_track[ENGINE] if e["name"] == "schedule"]
    assert any(
        f["ts"] <= s["ts"] and s["ts"] + s["dur"] <= f["ts"] + f["dur"]
        for f in forwards
        for s in schedules
    )


# --- the transfer worker --------------------------------------------------------------------


def test_shm_sends_and_leases_are_on_their_own_tracks() -> None:
    layout = KVLayout(num_layers=2, block_size=4, num_kv_heads=1, head_dim=8, dtype="float32")
    receiver = make_receiver("shm", layout, 8)
    source = torch.randn(layout.pool_shape(8))
    sender = make_sender("shm", source, layout)
    sent, received = Timeline("prefill"), Timeline("decode")
    sender.timeline, receiver.timeline = sent, received
    try:
        desc = receiver.expect("r1", (1, 2), 5, time.monotonic() + 10)
        sender.submit(SendJob("r1", (3, 4), desc, time.monotonic() + 10))
        deadline = time.monotonic() + 10
        while not (done := sender.poll()):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        (completion,) = done
        assert completion.ok and completion.checksum is not None
        receiver.verify("r1", completion.checksum, completion.epoch)
        while not receiver.poll():
            assert time.monotonic() < deadline
            time.sleep(0.005)
    finally:
        sender.close()
        receiver.close()
    (send,) = spans(sent.to_chrome())
    assert send["name"] == "send" and send["args"]["request_id"] == "r1"
    assert send["args"]["blocks"] == 2 and send["args"]["bytes"] > 0
    doc = received.to_chrome()
    (verify,) = spans(doc)
    assert verify["name"] == "verify" and tracks_of(doc)[verify["tid"]] == RECEIVE
    (lease,) = spans(doc, "b")
    assert lease["name"] == "lease" and lease["id"] == "r1" and lease["args"]["blocks"] == 2


# --- the worker flag ------------------------------------------------------------------------


def test_timeline_file_flag_on_real_workers(tiny_llama: Path, tmp_path: Path) -> None:
    files = {kind: tmp_path / f"{kind}.json" for kind in ("prefill", "decode")}
    with tiny_cluster(
        tiny_llama,
        prefill_args=("--timeline-file", str(files["prefill"])),
        decode_args=("--timeline-file", str(files["decode"])),
    ) as cluster:

        async def run() -> None:
            async with gateway_stub(cluster.gateway_address) as stub:
                outcomes = await asyncio.gather(
                    *(generate(stub, ids_request(40, f"tl-{i}", max_tokens=6)) for i in range(3))
                )
            assert all(o.num_tokens == 6 for o in outcomes), [str(o) for o in outcomes]

        asyncio.run(run())
        assert not any(f.exists() for f in files.values())  # written on shutdown
    docs = {kind: json.loads(path.read_text()) for kind, path in files.items()}
    for kind, doc in docs.items():
        assert doc["otherData"]["process"] == kind
        assert {e["name"] for e in spans(doc)} >= {"schedule", "forward", "sample"}
    assert len([e for e in spans(docs["prefill"]) if e["name"] == "send"]) == 3
    assert len(spans(docs["decode"], "b")) == 3  # one lease per request
    assert len([e for e in spans(docs["decode"]) if e["name"] == "verify"]) == 3


# --- the plot -------------------------------------------------------------------------------


def _two_workers_files(tmp_path: Path) -> list[Path]:
    """A prefill and a decode worker's timeline files, three short steps each."""
    paths = []
    for n, (process, track, name) in enumerate(
        [("prefill", SEND, "send"), ("decode", RECEIVE, "verify")]
    ):
        tl = Timeline(process)
        for _ in range(3):
            with tl.span("forward", RUNNER, {"seqs": 1}):
                time.sleep(0.001)
            with tl.span(name, track):
                pass
        if process == "decode":
            tl.interval("lease", RECEIVE, time.perf_counter_ns() - 10**6, "r1")
        doc = tl.to_chrome()
        for e in doc["traceEvents"]:
            e["pid"] += n  # two workers are two processes
        paths.append(tmp_path / f"{process}.json")
        paths[-1].write_text(json.dumps(doc))
    return paths


def test_the_plot_draws_two_workers_files_together(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from benchmarks import timeline_plot

    paths = _two_workers_files(tmp_path)
    rows = [label for label, _ in timeline_plot._rows(timeline_plot.merge(paths))]
    assert rows == [
        "decode: runner",
        "decode: kv receive",
        "decode: leases",
        "prefill: runner",
        "prefill: kv send",
    ]
    out = timeline_plot.main(
        ["--from-files", *map(str, paths), "--out", str(tmp_path / "t.png"), "--zoom-s", "0.01"]
    )
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_run_keeps_its_trace_and_report(
    tmp_path: Path,
    tiny_llama: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from benchmarks import timeline_plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as without the bench extra
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the merged trace goes
    paths = _two_workers_files(tmp_path)
    info = {"requests": 3, "prompt_tokens": 30, "output_tokens": 6, "wall_s": 0.5,
            "cpus": {"prefill": [0], "decode": [1]}}  # fmt: skip
    monkeypatch.setattr(timeline_plot, "run_w1", lambda *args: (paths, info))
    png = tmp_path / "t.png"
    argv = ["--model", str(tiny_llama), "--limit", "3", "--out", str(png)]
    md = timeline_plot.main(argv)
    assert md == png.with_suffix(".md") and "30 prompt tokens" in md.read_text()
    assert "![timeline]" not in md.read_text() and not png.exists()
    (trace,) = tmp_path.glob("*.trace.json")
    assert len(json.loads(trace.read_text())["traceEvents"]) > 6
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("no plot: matplotlib is not installed") and str(md) in line
    # Drawing existing files is all --from-files does: one line, and a failing status.
    with pytest.raises(SystemExit) as exited:
        timeline_plot.main(["--from-files", *map(str, paths), "--out", str(png)])
    assert exited.value.code == 1 and not png.exists()
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("no plot: matplotlib is not installed")
