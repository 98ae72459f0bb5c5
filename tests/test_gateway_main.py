"""gateway.config (flags over BATON_GATEWAY_* env), ``python -m gateway`` as a real process,
and the client's CLI (``baton generate``, ``python -m protos.client``) against it."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.cli import main as baton_main
from gateway.config import GatewayConfig
from protos.client import AsyncClient, SamplingParams
from protos.client.cli import main as client_main
from tests.fake_workers import FakeDecodeWorker, Script, eventually, fake_workers

REPO = Path(__file__).resolve().parent.parent

# --- config ----------------------------------------------------------------------------


def test_flags_and_defaults() -> None:
    config = GatewayConfig.from_args(
        ["--decode", "d1:1", "--decode", "d2:2,d3:3", "--prefill", "p:9", "--port", "0"], {}
    )
    assert config.decode == ("d1:1", "d2:2", "d3:3")
    assert config.prefill == ("p:9",)
    assert config.port == 0
    assert (config.model, config.max_retries, config.grace_s) == ("smollm2-135m", 2, 30.0)
    assert (config.stats_interval_s, config.stats_timeout_s) == (0.25, 1.0)
    assert config.port_file is None and config.max_model_len == 0


def test_env_fills_what_flags_leave_out_and_flags_win() -> None:
    env = {
        "BATON_GATEWAY_DECODE": "a:1, b:2",
        "BATON_GATEWAY_PREFILL": "",
        "BATON_GATEWAY_MAX_RETRIES": "5",
        "BATON_GATEWAY_GRACE_S": "2.5",
        "BATON_GATEWAY_PORT_FILE": "/tmp/x/port",
        "BATON_GATEWAY_LOG_LEVEL": "debug",
        "BATON_GATEWAY_HOST": "0.0.0.0",
    }
    config = GatewayConfig.from_args(["--max-retries", "1"], env)
    assert config.decode == ("a:1", "b:2")
    assert config.prefill == ()
    assert config.max_retries == 1
    assert config.grace_s == 2.5
    assert config.port_file == Path("/tmp/x/port")
    assert config.log_level == "DEBUG"
    assert config.host == "0.0.0.0"


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        ([], {}, "decode"),
        (["--decode", "nocolon"], {}, "decode: target .nocolon."),
        (["--decode", "a:1", "--port", "http"], {}, "--port"),
        (["--decode", "a:1"], {"BATON_GATEWAY_MAX_RETRIES": "many"}, "BATON_GATEWAY_MAX_RETRIES"),
        (["--decode", "a:1", "--max-retries", "-1"], {}, "max_retries"),
        (["--decode", "a:1", "--stats-interval-s", "0"], {}, "stats_interval_s"),
        (["--decode", "a:1", "--log-level", "loud"], {}, "log_level"),
    ],
)
def test_bad_values_name_the_setting(argv: list[str], env: dict[str, str], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        GatewayConfig.from_args(argv, env)


# --- the real process --------------------------------------------------------------------


async def wait_for_port(path: Path, process: asyncio.subprocess.Process) -> int:
    async def written() -> bool:
        assert process.returncode is None, "the gateway exited early"
        return path.exists() and path.read_text().endswith("\n")

    await eventually(written, timeout=120)
    return int(path.read_text())


async def test_python_m_gateway_serves_drains_and_exits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    decode = FakeDecodeWorker()
    decode.script = Script(token_ids=[28120, 905, 30], chunk=1)  # "hello world." in SmolLM2
    port_file = tmp_path / "gateway.port"
    async with fake_workers([decode]) as (d, _):
        env = {
            **os.environ,
            "BATON_GATEWAY_DECODE": d[0].address,
            "BATON_GATEWAY_STATS_INTERVAL_S": "0.1",
        }
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gateway",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--grace-s",
            "5",
            cwd=REPO,
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            port = await wait_for_port(port_file, process)
            address = f"127.0.0.1:{port}"
            async with grpc.aio.insecure_channel(address) as channel:
                health = health_pb2_grpc.HealthStub(channel)

                async def serving() -> bool:
                    reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                    return reply.status == health_pb2.HealthCheckResponse.SERVING

                await eventually(serving, timeout=120)

            async with AsyncClient(address) as client:
                info = await client.model_info()
                assert info.model_id == "smollm2-135m"
                sampling = SamplingParams(max_tokens=3)
                got = [c async for c in client.generate(text="hi", sampling=sampling)]
            assert "".join(c.text for c in got) == "hello world."

            # `baton generate`, as a human would run it (in a thread: the client blocks).
            rc = await asyncio.to_thread(baton_main, ["generate", "--address", address, "hi"])
            assert rc == 0
            captured = capsys.readouterr()
            assert captured.out == "hello world."
            assert "[stop;" in captured.err and "completion 3" in captured.err

            process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(process.wait(), 30) == 0
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        stderr = (await process.stderr.read()).decode() if process.stderr else ""
    assert "gateway is SERVING" in stderr
    assert "gateway stopped" in stderr


def test_client_cli_reports_a_failed_call(capsys: pytest.CaptureFixture[str]) -> None:
    rc = client_main(["--address", "127.0.0.1:1", "--timeout", "2", "hi"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "error: UnavailableError" in err or "error: DeadlineExceededError" in err


def test_help_lists_every_flag_and_the_env_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        GatewayConfig.from_args(["--help"], {})
    out = capsys.readouterr().out
    for field in dataclasses.fields(GatewayConfig):
        assert "--" + field.name.replace("_", "-") in out
    assert "BATON_GATEWAY_" in out


def test_check_config_prints_targets_from_the_env_twin(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from gateway.__main__ import main

    monkeypatch.setenv("BATON_GATEWAY_DECODE", "dns:///baton-decode:50053, 10.0.0.9:50053")
    monkeypatch.setenv("BATON_GATEWAY_WORKER_DOWN_AFTER_S", "4.5")
    assert main(["--check-config", "--prefill", "dns:///baton-prefill:50052"]) == 0
    cfg = json.loads(capsys.readouterr().out)["config"]
    assert cfg["decode"] == ["dns:///baton-decode:50053", "10.0.0.9:50053"]
    assert cfg["prefill"] == ["dns:///baton-prefill:50052"]
    assert cfg["worker_down_after_s"] == 4.5
    assert main(["--check-config", "--decode", "dns:///no-port"]) == 2
    assert "dns:///NAME:PORT" in capsys.readouterr().err
