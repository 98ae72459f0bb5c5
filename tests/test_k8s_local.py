"""The rendered chart, run: 2 prefill, 2 decode and 1 gateway pod as local processes.

Each pod runs exactly the arguments and environment the chart renders (tests.k8s_pods
maps pod IPs onto 127.0.0.x, container ports onto free ports and emptyDirs onto test
directories). The gateway finds the workers only through the ``dns:///`` names in its
rendered environment, answered from a file standing in for the cluster DNS (each
headless Service name -> its ready pods). Completions must equal HF greedy on the same
tiny model, and the KV of every request moves over gloo between the workers, each of
which advertises its own pod IP. The second decode pod joins the DNS answer only after
the gateway started (as a pod that just became ready) and then takes requests too.
"""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import grpc.aio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos.baton.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.engine_helpers import compare_greedy, hf_greedy, hf_model
from tests.k8s_manifests import containers, named, render
from tests.k8s_pods import LocalPods, Pod

START_TIMEOUT_S = 240.0
MAX_TOKENS = 8


def values_for(model_dir: Path) -> dict:
    """Chart values: the tiny model from a hostPath volume, gloo between pods."""
    return {
        "model": {"source": "hostPath", "hostPath": str(model_dir), "name": ""},
        "engine": {"dtype": "float32", "numThreads": 1, "numBlocks": 256, "maxNumSeqs": 8},
        "transfer": {"transport": "gloo"},
        "gateway": {"settings": {"statsIntervalS": 0.1, "resolveIntervalS": 0.5}},
        "prefill": {"replicas": 2},
        "decode": {"replicas": 2},
    }


def scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> dict[int, tuple[list[int], object]]:
    model = hf_model(tiny_llama)
    return {n: hf_greedy(model, prompt(n), MAX_TOKENS) for n in range(4)}


def prompt(n: int) -> list[int]:
    return [1000 + 97 * n + 13 * i for i in range(20 + 9 * n)]


async def wait_metric(address: str, key: tuple, value: float, timeout_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (got := scrape(address).get(key)) != value:
        assert loop.time() < deadline, f"{key} is {got}, not {value}"
        await asyncio.sleep(0.2)


async def test_rendered_pods_serve_correct_completions_with_kv_over_gloo(
    tiny_llama: Path, tmp_path: Path, reference: dict
) -> None:
    objects = render(values_for(tiny_llama))
    by_deployment = {c.deployment: c for c in containers(objects)}
    data = named(objects, "ConfigMap", "baton-config")["data"]
    with LocalPods(tmp_path) as pods:
        workers: dict[str, list[Pod]] = {"prefill": [], "decode": []}
        for role in ("prefill", "decode"):
            deployment = named(objects, "Deployment", f"baton-{role}")
            for i in range(deployment["spec"]["replicas"]):
                workers[role].append(
                    pods.start(f"{role}-{i}", by_deployment[f"baton-{role}"], objects)
                )
        for role, started in workers.items():
            for pod in started:
                pods.wait_serving(pod, f"grpc-{role}", START_TIMEOUT_S)
        # The headless Services' DNS: each rendered target name -> its ready pods; the
        # second decode pod is not in it yet.
        targets = {
            role: data[f"BATON_GATEWAY_{role.upper()}"].removeprefix("dns:///")
            for role in ("prefill", "decode")
        }
        assert targets == {"prefill": "baton-prefill:50052", "decode": "baton-decode:50053"}
        dns = {
            targets[role]: [p.address(f"grpc-{role}") for p in workers[role]] for role in workers
        }
        dns[targets["decode"]] = dns[targets["decode"]][:1]
        pods.publish_dns(dns)
        gateway = pods.start("gateway-0", by_deployment["baton-gateway"], objects)
        pods.wait_serving(gateway, "grpc", START_TIMEOUT_S)
        decode_up = ("baton_workers_up", (("kind", "decode"),))
        await wait_metric(gateway.address("metrics"), decode_up, 1)

        async with grpc.aio.insecure_channel(gateway.address("grpc")) as channel:
            stub = generate_pb2_grpc.BatonStub(channel)

            async def complete(n: int) -> list[int]:
                request = generate_pb2.GenerateRequest(
                    token_ids=generate_pb2.TokenIds(ids=prompt(n)),
                    sampling_params=common_pb2.SamplingParameters(
                        max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True
                    ),
                )
                got = [r async for r in stub.Generate(request, timeout=60)]
                assert got[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
                return [t for r in got for t in r.token_ids]

            try:
                outputs = [await complete(0)]
                # decode-1 becomes ready: it joins the answer, and the gateway's next
                # lookup (every resolveIntervalS) finds it.
                dns[targets["decode"]] = [p.address("grpc-decode") for p in workers["decode"]]
                pods.publish_dns(dns)
                await wait_metric(gateway.address("metrics"), decode_up, 2)
                outputs += await asyncio.gather(*(complete(n) for n in range(1, 4)))
            except grpc.aio.AioRpcError as err:
                pytest.fail(f"{err.code().name}: {err.details()}\n{pods.logs()}")
        for n, ours in enumerate(outputs):
            ref, ref_logits = reference[n]
            verdict = compare_greedy(ours, ref, ref_logits)
            assert verdict in ("equal", "tie"), f"prompt {n}: {ours} vs HF {ref}"

        gw = scrape(gateway.address("metrics"))
        assert gw[("baton_workers_up", (("kind", "decode"),))] == 2
        assert gw[("baton_workers_up", (("kind", "prefill"),))] == 2
        assert gw[("baton_requests_total", (("status", "OK"),))] == 4
        moved = {
            p.name: scrape(p.address(f"metrics-{role}"))[
                ("baton_kv_transfer_bytes_total", (("role", role),))
            ]
            for role, started in workers.items()
            for p in started
        }
        sent = moved["prefill-0"] + moved["prefill-1"]
        assert sent > 0 and sent == moved["decode-0"] + moved["decode-1"], moved
        assert moved["decode-1"] > 0, f"the decode pod that joined took no request: {moved}"
        logs = pods.logs()
        for pod in workers["decode"]:
            # Each decode worker's KV store is advertised at its own pod IP.
            assert f"store at {pod.ip}:{pod.port('kv-store')}" in logs, logs
