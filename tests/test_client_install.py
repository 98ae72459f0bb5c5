"""The ``baton-client`` distribution (``protos/pyproject.toml``) installs into a fresh
virtual environment that has no torch, transformers or baton server code, and streams
from a gateway there, sync and asyncio.

Offline and quick (a few seconds): the wheel is built with this environment's setuptools
(``pip wheel --no-build-isolation --no-index``) from a copy of ``protos/``; a new venv
(``python -m venv --without-pip``) gets it with a real ``pip install --no-index``. Its
declared dependencies are not downloaded: each ``Requires-Dist`` of the wheel, and their
own requirements in turn, is linked file by file from this environment into a directory
the venv reads through a ``.pth`` file. So the venv holds the wheel plus exactly what the
wheel declares, and a missing declaration fails the test as it would fail a user.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

from tests.fake_gateway import FakeGateway, fake_gateway

REPO = Path(__file__).resolve().parent.parent

# Run with `python -I` in the venv, from a directory outside the repository.
CLIENT_SCRIPT = r"""
import asyncio, importlib.util, json, sys

missing = {m: importlib.util.find_spec(m) is None
           for m in ("torch", "transformers", "numpy", "engine", "rpc", "gateway")}
import protos.client as bc

address = sys.argv[1]
with bc.Client(address, timeout=30) as client:
    with client.generate(token_ids=[5, 6], sampling=bc.SamplingParams(max_tokens=3)) as s:
        sync_chunks = [(c.text, list(c.token_ids)) for c in s]
    try:
        client.complete(text="bad")
        bad = None
    except bc.InvalidRequestError as err:
        bad = [err.code.name, err.message]

async def main():
    async with bc.AsyncClient(address) as client:
        done = await client.complete(chat=[{"role": "user", "content": "hi"}])
        return done.text, done.finish_reason.value

print(json.dumps({
    "missing": missing,
    "client_file": bc.__file__,
    "sync": sync_chunks,
    "async": asyncio.run(main()),
    "bad": bad,
    "modules": sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers")),
}))
"""


def _requirement_names(dist: metadata.Distribution) -> list[str]:
    """Names of ``dist``'s unconditional requirements (no extras, markers that hold here)."""
    names = []
    for req in dist.requires or []:
        spec, _, marker = req.partition(";")
        if "extra ==" in marker:
            continue
        names.append(re.match(r"[A-Za-z0-9._-]+", spec.strip()).group(0))
    return names


def _link_distribution(name: str, target: Path, seen: set[str]) -> None:
    """Symlink every installed file of distribution ``name`` (and of its requirements)
    into ``target``, keeping paths relative to site-packages."""
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key in seen:
        return
    seen.add(key)
    dist = metadata.distribution(name)
    for file in dist.files or []:
        if file.parts[0] == ".." or file.suffix == ".pyc":
            continue  # console scripts, bytecode
        link = target / file
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            link.symlink_to(Path(dist.locate_file(file)).resolve())
    for requirement in _requirement_names(dist):
        _link_distribution(requirement, target, seen)


def _build_wheel(tmp: Path) -> Path:
    source = tmp / "src"
    shutil.copytree(
        REPO / "protos",
        source,
        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"),
    )
    wheels = tmp / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
        + ["--no-index", "--quiet", "-w", str(wheels), str(source)],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("baton_client-*.whl")
    return wheel


def _fresh_venv(tmp: Path, wheel: Path) -> Path:
    venv = tmp / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True
    )
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps"]
        + ["--no-index", "--quiet", str(wheel)],
        check=True,
        capture_output=True,
    )
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        declared = re.findall(r"^Requires-Dist: ([A-Za-z0-9._-]+)", zf.read(meta).decode(), re.M)
    deps = tmp / "deps"
    seen: set[str] = set()
    for name in declared:
        _link_distribution(name, deps, seen)
    (site,) = venv.glob("lib/python*/site-packages")
    (site / "baton-client-deps.pth").write_text(f"{deps}\n")
    return python


async def test_wheel_installs_into_a_fresh_venv_and_streams_without_torch(tmp_path: Path) -> None:
    wheel = await asyncio.to_thread(_build_wheel, tmp_path)
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    declared = sorted(re.findall(r"^Requires-Dist: ([A-Za-z0-9._-]+)", meta, re.M))
    assert declared == ["grpcio", "protobuf"]
    assert {n.split("/")[0] for n in names} == {
        "protos",
        wheel.name.split("-")[0] + "-0.1.0.dist-info",
    }
    assert "protos/client/py.typed" in names and "protos/baton/v1/generate_pb2.pyi" in names

    python = await asyncio.to_thread(_fresh_venv, tmp_path, wheel)
    gateway = FakeGateway(texts=("a", "b", "c"), refuse_text="bad")
    async with fake_gateway(gateway) as (_, address):
        process = await asyncio.create_subprocess_exec(
            str(python),
            "-I",
            "-c",
            CLIENT_SCRIPT,
            address,
            cwd=tmp_path,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, err.decode()
    result = json.loads(out)
    assert all(result["missing"].values()), result["missing"]
    assert result["client_file"].startswith(str(tmp_path / "venv")), result["client_file"]
    assert result["sync"] == [["a", [1]], ["b", [2]], ["c", [3]]]
    assert result["async"] == ["abc", "length"]
    assert result["bad"] == ["INVALID_ARGUMENT", "sampling_params.max_tokens must be >= 1"]
    assert result["modules"] == []
