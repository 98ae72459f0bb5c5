"""Worker flags and their BATON_* environment twins."""

from __future__ import annotations

from pathlib import Path

import pytest

from rpc.worker_config import WorkerConfig, defaults


def test_flags_win_over_environment() -> None:
    env = {"BATON_DECODE_MAX_NUM_SEQS": "8", "BATON_DECODE_DTYPE": "float32"}
    cfg = WorkerConfig.from_args("decode", ["--max-num-seqs", "16", "--port-file", "/tmp/p"], env)
    assert cfg.engine.max_num_seqs == 16
    assert cfg.engine.dtype == "float32"
    assert cfg.port_file == Path("/tmp/p")


def test_prefill_reads_its_own_prefix_and_single_process_reads_decode_s() -> None:
    env = {
        "BATON_PREFILL_TRANSPORT": "gloo",
        "BATON_DECODE_TRANSPORT": "shm",
        "BATON_DECODE_ENABLE_PREFIX_CACHING": "false",
    }
    assert WorkerConfig.from_args("prefill", [], env).transport == "gloo"
    both = WorkerConfig.from_args("both", ["--single-process"], env)
    assert both.transport == "shm" and both.engine.enable_prefix_caching is False


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["--dtype", "int4"], {}, "dtype"),
        (["--transport", "carrier-pigeon"], {}, "transport"),
        (["--port", "70000"], {}, "port"),
        (["--max-num-seqs", "many"], {}, "--max-num-seqs"),
        ([], {"BATON_DECODE_BLOCK_SIZE": "7"}, "block_size"),
        ([], {"BATON_DECODE_ENABLE_PREFIX_CACHING": "maybe"}, "BATON_DECODE_ENABLE_PREFIX_CACHING"),
    ],
)
def test_bad_values_name_the_flag(argv: list[str], env: dict[str, str], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        WorkerConfig.from_args("decode", argv, env)


def test_defaults_cover_every_flag() -> None:
    d = defaults("decode")
    assert d["transport"] == "shm" and d["block_size"] == 16 and d["max_num_seqs"] == 64
