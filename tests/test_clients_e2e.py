"""Clients other than the server's own code, against a live gateway: Node.js and the Python
client with torch and transformers out of reach.

One disaggregated shm cluster of the tiny model. Each test records every worker's free KV
blocks first and ends by checking they are back at exactly that value: a client that
cancels mid-stream must leave nothing held on either worker.

The Node.js test runs ``tests/node/client_check.js`` with ``@grpc/grpc-js`` and
``@grpc/proto-loader`` as pinned in ``tests/node/package-lock.json`` (``.ci/setup.sh``
runs ``npm ci`` there where npm is installed). It is skipped when ``node`` is not
installed, or when those packages are absent and no npm could install them.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e_helpers import E2ECluster, tiny_cluster, wait_settled, worker_stats

REPO = Path(__file__).resolve().parent.parent
NODE_DIR = REPO / "tests" / "node"


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path) -> Iterator[E2ECluster]:
    with tiny_cluster(tiny_llama, decode_args=("--num-blocks", "128")) as c:
        yield c


async def free_blocks(cluster: E2ECluster) -> dict[str, int]:
    """Free KV blocks of every live worker, by address."""
    out = {}
    for kind, address in cluster.live_workers():
        out[address] = (await worker_stats(address, kind)).free_kv_blocks
    return out


async def assert_blocks_back(cluster: E2ECluster, before: dict[str, int]) -> None:
    await wait_settled(cluster.live_workers(), logs=cluster.logs)
    after = await free_blocks(cluster)
    assert after == before, f"free KV blocks {before} -> {after}\n{cluster.logs()}"


async def run(*argv: str, cwd: Path, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), 120)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    return process.returncode, out.decode(), err.decode()


async def test_node_client_streams_cancels_and_gets_invalid_argument(cluster: E2ECluster) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the Node.js gRPC client test needs it")
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        # .ci/setup.sh installs tests/node's packages only where npm is there to do it.
        if shutil.which("npm") is None:
            pytest.skip("node is installed but npm is not, so tests/node has no packages (npm ci)")
        pytest.fail(
            "tests/node has no node_modules: run `npm ci` in tests/node (.ci/setup.sh does)"
        )
    before = await free_blocks(cluster)
    decode = cluster.addresses("decode")[0]
    rc, out, err = await run(
        node,
        "client_check.js",
        cluster.gateway_address,
        decode,
        str(REPO / "protos"),
        cwd=NODE_DIR,
    )
    assert rc == 0, f"node client_check.js failed:\n{err}\n{cluster.logs()}"
    result = json.loads(out)
    assert len(result["stream"]["tokens"]) == 8
    cancel = result["cancel"]
    assert cancel["code"] == 1  # grpc.status.CANCELLED
    assert 4 <= cancel["tokens_before_cancel"] < 1000
    assert cancel["free_kv_blocks_during"] < before[decode]  # it held blocks when cancelled
    assert result["bad_request"]["code"] == 3  # INVALID_ARGUMENT
    assert "sampling_params.temperature" in result["bad_request"]["details"]
    await assert_blocks_back(cluster, before)


# Run in a subprocess with PYTHONPATH at the repository: imports of the server's heavy
# dependencies (and of baton's server packages) raise, so the client must do without them.
BLOCKED_CLIENT = r"""
import asyncio, importlib.abc, json, sys

BLOCKED = ("torch", "transformers", "numpy", "engine", "gateway", "rpc")

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, Blocker())
import protos.client as bc

address, decode_ids, cancel_ids = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
short = bc.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
long = bc.SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)
out = {}
with bc.Client(address, timeout=60) as client:
    done = client.complete(token_ids=decode_ids, sampling=short)
    out["sync"] = [len(done.token_ids), done.finish_reason.value, done.usage.completion_tokens]
    with client.generate(token_ids=cancel_ids, sampling=long) as s:
        out["sync_cancelled_after"] = sum(len(next(s).token_ids) for _ in range(3))
    try:
        client.complete(text="hi", sampling=bc.SamplingParams(top_p=1.5))
    except bc.InvalidRequestError as err:
        out["bad"] = [err.code.name, err.message]

async def main():
    async with bc.AsyncClient(address, timeout=60) as client:
        chunks = []
        async with client.generate(chat=[("user", "Hello")], sampling=short) as s:
            async for chunk in s:
                chunks.append(chunk)
        tokens = sum(len(c.token_ids) for c in chunks)
        out["async"] = [chunks[-1].finish_reason.value, chunks[-1].usage.completion_tokens, tokens]
        got = 0
        async with client.generate(token_ids=cancel_ids[::-1], sampling=long) as s:
            async for chunk in s:
                got += len(chunk.token_ids)
                if got >= 3:
                    break
        out["async_cancelled_after"] = got

asyncio.run(main())
out["loaded"] = sorted({m.split(".")[0] for m in sys.modules} & set(BLOCKED))
print(json.dumps(out))
"""


async def test_python_client_with_torch_and_transformers_blocked(cluster: E2ECluster) -> None:
    before = await free_blocks(cluster)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ids = json.dumps(list(range(1000, 1016)))
    long_ids = json.dumps(list(range(2000, 2030)))
    rc, out, err = await run(
        sys.executable,
        "-c",
        BLOCKED_CLIENT,
        cluster.gateway_address,
        ids,
        long_ids,
        cwd=REPO,
        env=env,
    )
    assert rc == 0, f"{err}\n{cluster.logs()}"
    result = json.loads(out)
    assert result["sync"] == [6, "length", 6]
    assert result["async"] == ["length", 6, 6]
    assert 3 <= result["sync_cancelled_after"] < 900
    assert 3 <= result["async_cancelled_after"] < 900
    assert result["bad"][0] == "INVALID_ARGUMENT" and "sampling_params.top_p" in result["bad"][1]
    assert result["loaded"] == []
    await assert_blocks_back(cluster, before)
