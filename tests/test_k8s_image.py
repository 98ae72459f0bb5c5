"""k8s/Dockerfile's recipe: the CUDA variant gets the compiler toolchain Triton builds its
kernels with (k8s/cuda-toolchain.sh, run here with stand-ins for apt-get and python3),
and every JIT cache of the image points under the one directory the chart mounts
writable. That the Dockerfile is hadolint-clean is checked in tests/test_k8s_chart.py."""

from __future__ import annotations

import re
import subprocess
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
