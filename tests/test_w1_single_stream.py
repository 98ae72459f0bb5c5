"""The W1 harness's single-stream measurement runs its memory reads where the engine's
torch ops run, on the compute thread.

A read on the harness's own thread gave that thread an OpenMP team; with more OpenMP
threads than CPUs libgomp stops spinning between parallel regions, and the stream that
the reads bracket ran at 70 tok/s where the same engine made 99.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from benchmarks import baton_w1, common
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from tests.factories import make_tiny_model_dir


def test_single_stream_reads_memory_on_the_engines_compute_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[tuple[str, int]] = []

    class RecordingReader(common.MemoryReader):
        def __init__(self, size_mib: int) -> None:
            threads.append(("init", threading.get_ident()))
            super().__init__(size_mib)

        def rates(self, repeats: int) -> list[float]:
            threads.append(("rates", threading.get_ident()))
            return super().rates(repeats)

    monkeypatch.setattr(common, "MemoryReader", RecordingReader)
    model = make_tiny_model_dir(tmp_path / "model")
    core = EngineCore(
        EngineConfig(model=str(model), dtype="float32", max_model_len=64, num_threads=2),
        show_progress=False,
    )
    try:
        rate, read = baton_w1._single_stream(core, prompt_len=8, new_tokens=4, read_mib=1)
        compute = core.runner.compute.call(threading.get_ident)
    finally:
        core.runner.close()
    assert rate > 0 and read > 0
    assert [kind for kind, _ in threads] == ["init", "rates", "rates"]
    assert {ident for _, ident in threads} == {compute} != {threading.get_ident()}
