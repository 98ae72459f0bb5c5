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


def test_the_engine_stall_bound_is_a_flag_with_a_default_that_may_be_off() -> None:
    assert WorkerConfig.from_args("decode", [], {}).engine_stall_timeout_s == 60.0
    env = {"BATON_PREFILL_ENGINE_STALL_TIMEOUT_S": "120"}
    assert WorkerConfig.from_args("prefill", [], env).engine_stall_timeout_s == 120.0
    argv = ["--engine-stall-timeout-s", "0"]
    assert WorkerConfig.from_args("decode", argv, {}).engine_stall_timeout_s == 0.0
    with pytest.raises(ValueError, match="engine_stall_timeout_s"):
        WorkerConfig.from_args("decode", ["--engine-stall-timeout-s", "-5"], {})


def test_panels_are_for_workers_that_decode_unless_told() -> None:
    assert WorkerConfig.from_args("prefill", [], {}).engine.linear_panels is False
    assert WorkerConfig.from_args("decode", [], {}).engine.linear_panels is True
    assert WorkerConfig.from_args("both", ["--single-process"], {}).engine.linear_panels is True
    env = {"BATON_PREFILL_LINEAR_PANELS": "true"}
    assert WorkerConfig.from_args("prefill", [], env).engine.linear_panels is True
    cfg = WorkerConfig.from_args("decode", ["--linear-panels", "false"], {})
    assert cfg.engine.linear_panels is False
    assert defaults("prefill")["linear_panels"] is False and defaults("decode")["linear_panels"]


def test_deterministic_is_a_switch_with_an_environment_twin() -> None:
    assert WorkerConfig.from_args("decode", [], {}).engine.deterministic is False
    assert WorkerConfig.from_args("prefill", ["--deterministic"], {}).engine.deterministic is True
    argv = ["--single-process", "--deterministic", "false"]
    assert WorkerConfig.from_args("both", argv, {}).engine.deterministic is False
    env = {"BATON_PREFILL_DETERMINISTIC": "true"}
    assert WorkerConfig.from_args("prefill", [], env).engine.deterministic is True
    with pytest.raises(ValueError, match="--deterministic='maybe'"):
        WorkerConfig.from_args("decode", ["--deterministic", "maybe"], {})
    with pytest.raises(ValueError, match="CPU only"):
        WorkerConfig.from_args("decode", ["--deterministic", "--device", "cuda"], {})


def test_defaults_cover_every_flag() -> None:
    d = defaults("decode")
    assert d["transport"] == "shm" and d["block_size"] == 16 and d["max_num_seqs"] == 64


def test_advertise_host_defaults_to_a_specific_listening_host() -> None:
    assert WorkerConfig.from_args("decode", ["--host", "10.1.2.3"], {}).advertise_host == "10.1.2.3"
    assert WorkerConfig.from_args("prefill", ["--host", "0.0.0.0"], {}).advertise_host == ""
    env = {"BATON_PREFILL_ADVERTISE_HOST": "10.0.0.7", "BATON_PREFILL_HOST": "0.0.0.0"}
    cfg = WorkerConfig.from_args("prefill", [], env)
    assert (cfg.host, cfg.advertise_host, cfg.reachable_host) == ("0.0.0.0", "10.0.0.7", "10.0.0.7")


@pytest.mark.parametrize(
    ("argv", "address"),
    [
        # The store listens on every interface; peers dial the advertise host.
        (["--transport-address", "0.0.0.0:29500"], "10.0.0.7:29500"),
        (["--transport-address", ":29500"], "10.0.0.7:29500"),
        ([], "10.0.0.7:0"),
        (["--transport-address", "decode-0.example:29500"], "decode-0.example:29500"),
    ],
)
def test_gloo_store_address_is_the_advertised_one(argv: list[str], address: str) -> None:
    env = {"BATON_DECODE_HOST": "0.0.0.0", "BATON_DECODE_ADVERTISE_HOST": "10.0.0.7"}
    cfg = WorkerConfig.from_args("decode", ["--transport", "gloo", *argv], env)
    assert cfg.transport_address == address


def test_a_store_nobody_can_dial_is_refused() -> None:
    with pytest.raises(ValueError, match="needs --advertise-host"):
        WorkerConfig.from_args("decode", ["--host", "0.0.0.0", "--transport", "nccl"], {})
    with pytest.raises(ValueError, match="advertise_host must be an address"):
        WorkerConfig.from_args("decode", ["--advertise-host", "0.0.0.0"], {})
    with pytest.raises(ValueError, match="metrics_port and port must differ"):
        WorkerConfig.from_args("decode", ["--port", "9000", "--metrics-port", "9000"], {})
    # shm keeps its segment name; the wildcard rule is for dialled stores only.
    shm = WorkerConfig.from_args("decode", ["--host", "0.0.0.0", "--transport", "shm"], {})
    assert shm.transport_address == "127.0.0.1:0"


@pytest.mark.parametrize("module", ["prefill_service", "decode_service"])
def test_check_config_prints_the_resolved_config_or_the_error(
    module: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib
    import json

    main = importlib.import_module(f"{module}.__main__").main
    prefix = "BATON_PREFILL_" if module == "prefill_service" else "BATON_DECODE_"
    monkeypatch.setenv(prefix + "ADVERTISE_HOST", "10.0.0.7")
    monkeypatch.setenv(prefix + "MAX_NUM_SEQS", "12")
    assert main(["--check-config", "--host", "0.0.0.0", "--metrics-port", "9100"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["service"] == module
    cfg = printed["config"]
    assert (cfg["advertise_host"], cfg["metrics_port"], cfg["engine"]["max_num_seqs"]) == (
        "10.0.0.7",
        9100,
        12,
    )
    monkeypatch.setenv(prefix + "MAX_NUM_SEQS", "lots")
    assert main(["--check-config"]) == 2
    assert f"{prefix}MAX_NUM_SEQS" in capsys.readouterr().err
