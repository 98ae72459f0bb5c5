"""k8s/Dockerfile's recipe: the CUDA variant gets the compiler toolchain Triton builds its
kernels with (k8s/cuda-toolchain.sh, run here with stand-ins for apt-get and python3),
and every JIT cache of the image points under the one directory the chart mounts
writable. That the Dockerfile is hadolint-clean is checked in tests/test_k8s_chart.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.k8s_manifests import JIT_CACHES, K8S

TOOLCHAIN = K8S / "cuda-toolchain.sh"


def stub_system(tmp_path: Path, *, gcc: bool, python_h: bool) -> tuple[Path, Path]:
    """A PATH of stand-ins: python3 (its include dir, with or without Python.h), apt-get
    (logs its calls; installing gcc or python3-dev provides them), rm (logs), maybe gcc."""
    bin_dir, include, log = tmp_path / "bin", tmp_path / "include", tmp_path / "calls.log"
    bin_dir.mkdir(parents=True)
    include.mkdir(parents=True)
    if python_h:
        (include / "Python.h").write_text("")
    scripts = {
        "python3": f'echo "{include}"',
        "apt-get": (
            f'echo "apt-get $*" >> "{log}"\n'
            f'case " $* " in *" gcc "*) printf "#!/bin/sh\\n" > "{bin_dir}/gcc"; '
            f'/bin/chmod +x "{bin_dir}/gcc";; esac\n'
            f'case " $* " in *" python3-dev "*) : > "{include}/Python.h";; esac'
        ),
        "rm": f'echo "rm $*" >> "{log}"',
    }
    if gcc:
        scripts["gcc"] = ":"
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir, log


def run_toolchain(bin_dir: Path, variant: str, offline: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["/bin/sh", str(TOOLCHAIN), variant, offline],
        capture_output=True,
        text=True,
        env={"PATH": str(bin_dir)},
        timeout=60,
    )


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_the_cuda_variant_installs_a_compiler_libc_headers_and_python_h(tmp_path: Path) -> None:
    bin_dir, log = stub_system(tmp_path, gcc=False, python_h=False)
    out = run_toolchain(bin_dir, "cuda", "0")
    assert out.returncode == 0, out.stderr
    logged = calls(log)
    assert logged[:2] == [
        "apt-get update",
        "apt-get install -y --no-install-recommends gcc libc6-dev python3-dev",
    ]
    # The lists are dropped (the glob expanded here; the stand-in rm only logs).
    assert len(logged) == 3 and logged[2].startswith("rm -rf /var/lib/apt/lists/")
    assert (bin_dir / "gcc").exists()


def test_a_base_that_has_them_installs_nothing_and_cpu_gets_nothing(tmp_path: Path) -> None:
    bin_dir, log = stub_system(tmp_path, gcc=True, python_h=True)
    assert run_toolchain(bin_dir, "cuda", "1").returncode == 0
    bin_cpu, log_cpu = stub_system(tmp_path / "cpu", gcc=False, python_h=False)
    assert run_toolchain(bin_cpu, "cpu", "0").returncode == 0
    assert calls(log) == calls(log_cpu) == []
    assert not (bin_cpu / "gcc").exists()


def test_an_offline_cuda_build_without_a_compiler_fails_naming_it(tmp_path: Path) -> None:
    bin_dir, log = stub_system(tmp_path, gcc=False, python_h=True)
    out = run_toolchain(bin_dir, "cuda", "1")
    assert out.returncode == 2
    assert "needs gcc libc6-dev in BASE_IMAGE when OFFLINE=1" in out.stderr
    assert calls(log) == []


def test_the_dockerfile_runs_the_toolchain_step_and_sets_every_jit_cache() -> None:
    text = (K8S / "Dockerfile").read_text()
    assert re.search(r'^RUN sh /tmp/cuda-toolchain.sh "\$VARIANT" "\$OFFLINE"', text, re.M)
    # Before the wheels: the compiler is there whatever pip later does.
    assert text.index("cuda-toolchain.sh") < text.index("pip install")
    env = dict(re.findall(r"^\s+(\w+)=(\S+?)(?: \\)?$", text, re.M))
    for name, value in JIT_CACHES.items():
        assert env.get(name) == value, name
    assert env["HOME"] == "/home/baton"


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_the_toolchain_step_refuses_nothing_it_should_not(variant: str, tmp_path: Path) -> None:
    """Run for either variant on a base that already has everything: exit 0, no output on
    stderr (a build log stays clean)."""
    bin_dir, _ = stub_system(tmp_path, gcc=True, python_h=True)
    out = run_toolchain(bin_dir, variant, "0")
    assert out.returncode == 0 and out.stderr == ""


# --- the entrypoint's pair role: prefill and decode in one container -------------------

FAKE_PYTHON = """#!/bin/sh
# python -m MODULE FLAGS...: logs its start and its SIGTERM; prefill_service exits with
# $PREFILL_EXIT after a moment when that is set. With $LOSE_TERM set, the first SIGTERM
# is lost, as one sent between a worker's fork and its exec is.
mod="$2"; shift 2
lost=0
on_term() {
  if [ -n "${LOSE_TERM:-}" ] && [ "$lost" = 0 ]; then lost=1; return; fi
  echo "$mod TERM" >> "$LOG"; exit 0
}
trap on_term TERM
echo "$mod $*" >> "$LOG"
if [ "$mod" = prefill_service ] && [ -n "${PREFILL_EXIT:-}" ]; then
  sleep 0.5
  exit "$PREFILL_EXIT"
fi
while :; do sleep 0.1; done
"""


def start_pair(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.Popen[str], Path]:
    bin_dir, log = tmp_path / "bin", tmp_path / "pair.log"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(FAKE_PYTHON)
    (bin_dir / "python").chmod(0o755)
    proc = subprocess.Popen(
        ["/bin/sh", str(K8S / "entrypoint.sh"), "pair", *args],
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "LOG": str(log), **env},
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    return proc, log


def exit_status(proc: subprocess.Popen[str]) -> int:
    """The entrypoint's status within 10 s. Its whole group is killed afterwards either
    way: a worker it failed to stop would hold stderr open (reading it would hang) and
    outlive the test."""
    try:
        return proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        raise AssertionError("the entrypoint did not exit within 10 s") from None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def wait_for_lines(log: Path, count: int) -> list[str]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = log.read_text().splitlines() if log.exists() else []
        if len(lines) >= count:
            return lines
        time.sleep(0.05)
    raise AssertionError(f"{log} has {lines}, wanted {count} lines")


def test_pair_runs_both_workers_with_their_own_flags_and_drains_both(tmp_path: Path) -> None:
    proc, log = start_pair(tmp_path, "--port", "50052", "--grace-s", "30", "--", "--port", "50053")
    assert sorted(wait_for_lines(log, 2)) == [
        "decode_service --port 50053",
        "prefill_service --port 50052 --grace-s 30",
    ]
    proc.send_signal(signal.SIGTERM)  # the kubelet stopping the pod
    assert exit_status(proc) == 0
    assert sorted(log.read_text().splitlines()[2:]) == [
        "decode_service TERM",
        "prefill_service TERM",
    ]


def test_pair_stopped_while_its_workers_start_leaves_none_running(tmp_path: Path) -> None:
    """SIGTERM while the workers start: the entrypoint still stops both and exits, rather
    than dying with its workers left running. The window is a few hundred microseconds,
    so the signal is swept across the start-up, and the order that closes it is checked
    in the script itself."""
    body = (K8S / "entrypoint.sh").read_text().split("run_pair() {", 1)[1]
    assert body.index("trap ") < body.index('(prefill_worker "$@") &')
    for attempt in range(5):
        proc, _ = start_pair(tmp_path / str(attempt), "--port", "1", "--", "--port", "2")
        time.sleep(0.002 * attempt)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 2
        while True:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            if time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                raise AssertionError(f"a worker outlived the entrypoint (attempt {attempt})")
            time.sleep(0.02)


def test_pair_repeats_the_signal_to_a_worker_that_lost_it(tmp_path: Path) -> None:
    """A worker forked while the signal came can lose it (its shell resets the traps
    before it execs): the entrypoint repeats SIGTERM until both exit, instead of waiting
    on that worker until the kubelet's SIGKILL."""
    proc, log = start_pair(tmp_path, "--port", "1", "--", "--port", "2", LOSE_TERM="1")
    wait_for_lines(log, 2)
    proc.send_signal(signal.SIGTERM)
    assert exit_status(proc) == 0
    assert sorted(log.read_text().splitlines()[2:]) == [
        "decode_service TERM",
        "prefill_service TERM",
    ]


def test_pair_stops_the_other_worker_and_fails_when_one_exits(tmp_path: Path) -> None:
    proc, log = start_pair(tmp_path, "--port", "1", "--", "--port", "2", PREFILL_EXIT="3")
    assert exit_status(proc) == 3
    assert log.read_text().splitlines()[-1] == "decode_service TERM"
    assert "the prefill worker exited (3); stopping the other" in (proc.stderr.read() or "")
    # A worker that stops unasked with status 0 still fails the container.
    proc, _ = start_pair(tmp_path / "zero", "--", "--port", "2", PREFILL_EXIT="0")
    assert exit_status(proc) == 1


def test_pair_needs_the_separator(tmp_path: Path) -> None:
    proc, log = start_pair(tmp_path, "--port", "1")
    assert exit_status(proc) == 2 and not log.exists()
    assert "PREFILL_FLAGS... -- DECODE_FLAGS..." in (proc.stderr.read() or "")


def test_pair_check_config_prints_both_resolved_configurations(tmp_path: Path) -> None:
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "PYTHONPATH": str(K8S.parent),
        "BATON_PREFILL_TRANSPORT": "shm",
        "BATON_DECODE_TRANSPORT": "shm",
    }
    out = subprocess.run(
        ["/bin/sh", str(K8S / "entrypoint.sh"), "pair", "--check-config", "--metrics-port",
         "9123", "--", "--check-config", "--metrics-port", "9124"],
        capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    printed = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [(p["service"], p["config"]["metrics_port"]) for p in printed] == [
        ("prefill_service", 9123),
        ("decode_service", 9124),
    ]
