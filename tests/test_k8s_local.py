"""The rendered chart, run: 2 prefill, 2 decode and 1 gateway pod as local processes.

Each pod runs exactly the arguments and environment the chart renders (tests.k8s_pods
maps pod IPs onto 127.0.0.x, container ports onto free ports and emptyDirs onto test
directories). The gateway finds the workers only through the ``dns:///`` names in its
rendered environment, answered from a file standing in for the cluster DNS (each
headless Service name -> its ready pods). Completions must equal HF greedy on the same
tiny model, and the KV of every request moves over gloo between the workers, each of
which advertises its own pod IP. The second decode pod joins the DNS answer only after
the gateway started (as a pod that just became ready) and then takes requests too. Pods
count as ready when their rendered readiness probes pass.

With every ``security`` value on, the rendered pods serve over TLS with API keys, mTLS
and the fleet secret inside the fleet, from the Secrets' files where the chart mounts
them, and pass their rendered exec (mTLS workers) and HTTPS (gateway) probes.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc.aio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos.baton.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.certs import FLEET_NAME, CertAuthority
from tests.engine_helpers import compare_greedy, hf_greedy, hf_model
from tests.k8s_manifests import containers, named, render
from tests.k8s_pods import LocalPods, Pod

START_TIMEOUT_S = 240.0
MAX_TOKENS = 8
API_KEY = "sk-rendered-pods-0123456789"


def values_for(model_dir: Path) -> dict:
    """Chart values: the tiny model from a hostPath volume, gloo between pods.

    The one value changed for loopback: decode's prefill allow-list names the cluster's
    headless Service, which a local process cannot resolve (tests/test_k8s_values.py
    checks what it renders; tests/test_security.py what it admits)."""
    return {
        "model": {"source": "hostPath", "hostPath": str(model_dir), "name": ""},
        "engine": {"dtype": "float32", "numThreads": 1, "numBlocks": 256, "maxNumSeqs": 8},
        "transfer": {"transport": "gloo"},
        # Every prompt crosses to a prefill worker: the KV over gloo is under test.
        "gateway": {
            "settings": {"statsIntervalS": 0.1, "resolveIntervalS": 0.5, "localPrefillTokens": 0}
        },
        "prefill": {"replicas": 2},
        "decode": {"replicas": 2},
        "security": {"prefillAllowList": False},
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
        for started in workers.values():
            for pod in started:
                pods.wait_ready(pod, START_TIMEOUT_S)
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
        pods.wait_ready(gateway, START_TIMEOUT_S)
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


async def test_rendered_security_serves_tls_and_api_keys_with_mtls_in_the_fleet(
    tiny_llama: Path, tmp_path: Path, reference: dict
) -> None:
    ca = CertAuthority(tmp_path / "pki")
    fleet, public = ca.issue("fleet"), ca.issue("gateway")
    keys = tmp_path / "api-keys"
    keys.write_text(f"{API_KEY}\n")
    secret = tmp_path / "fleet-secret"
    secret.write_bytes(b"the fleet secret of the rendered pods\n")
    values = values_for(tiny_llama)
    values["prefill"] = values["decode"] = {"replicas": 1}
    values["http"] = {"enabled": True}
    values["security"] = {
        "prefillAllowList": False,
        "gatewayTls": {"secretName": "gateway-tls"},
        "fleetTls": {"secretName": "fleet-tls", "serverName": FLEET_NAME},
        "apiKeys": {"secretName": "gateway-keys"},
        "fleetSecret": {"secretName": "fleet-secret"},
    }
    secrets = {
        "gateway-tls": {"tls.crt": public.cert, "tls.key": public.key, "ca.crt": ca.ca_path},
        "fleet-tls": {"tls.crt": fleet.cert, "tls.key": fleet.key, "ca.crt": ca.ca_path},
        "gateway-keys": {"api-keys": keys},
        "fleet-secret": {"fleet-secret": secret},
    }
    objects = render(values)
    by_deployment = {c.deployment: c for c in containers(objects)}
    for role in ("prefill", "decode"):  # mTLS ports: the kubelet's gRPC probe cannot do TLS
        assert "exec" in by_deployment[f"baton-{role}"].spec["readinessProbe"]
    assert "httpGet" in by_deployment["baton-gateway"].spec["readinessProbe"]
    with LocalPods(tmp_path / "pods", secrets=secrets) as pods:
        prefill = pods.start("prefill-0", by_deployment["baton-prefill"], objects)
        decode = pods.start("decode-0", by_deployment["baton-decode"], objects)
        for pod in (prefill, decode):
            pods.wait_ready(pod, START_TIMEOUT_S)  # the exec probe, with the fleet's files
        pods.publish_dns(
            {
                "baton-prefill:50052": [prefill.address("grpc-prefill")],
                "baton-decode:50053": [decode.address("grpc-decode")],
            }
        )
        gateway = pods.start("gateway-0", by_deployment["baton-gateway"], objects)
        pods.wait_ready(gateway, START_TIMEOUT_S)  # HTTPS GET /health

        # The public certificate names 127.0.0.1 and localhost, not the loopback pod IP.
        credentials = public.channel_credentials(with_cert=False)
        options = [("grpc.ssl_target_name_override", "localhost")]
        async with grpc.aio.secure_channel(
            gateway.address("grpc"), credentials, options=options
        ) as channel:
            stub = generate_pb2_grpc.BatonStub(channel)
            request = generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=prompt(0)),
                sampling_params=common_pb2.SamplingParameters(
                    max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True
                ),
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Generate(request, timeout=30).read()
            assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
            try:
                got = [
                    r
                    async for r in stub.Generate(
                        request, timeout=60, metadata=[("authorization", f"Bearer {API_KEY}")]
                    )
                ]
            except grpc.aio.AioRpcError as err:
                pytest.fail(f"{err.code().name}: {err.details()}\n{pods.logs()}")
        ours = [t for r in got for t in r.token_ids]
        ref, ref_logits = reference[0]
        assert compare_greedy(ours, ref, ref_logits) in ("equal", "tie"), f"{ours} vs HF {ref}"

        context = ssl.create_default_context(cafile=str(ca.ca_path))
        context.check_hostname = False  # the certificate names localhost, not the pod IP

        def models(headers: dict[str, str]) -> int:
            url = f"https://{gateway.address('http')}/v1/models"
            try:
                with urllib.request.urlopen(
                    urllib.request.Request(url, headers=headers), timeout=10, context=context
                ) as reply:
                    return reply.status
            except urllib.error.HTTPError as err:
                return err.code

        assert models({}) == 401
        assert models({"Authorization": f"Bearer {API_KEY}"}) == 200
        moved = scrape(decode.address("metrics-decode"))
        assert moved[("baton_kv_transfer_bytes_total", (("role", "decode"),))] > 0


def test_rendered_gateway_starts_before_any_worker_and_is_ready_once_one_is(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """The gateway's startup and liveness probes pass once its server listens, so its pod
    starts (and is not restarted) while no decode worker exists; its readiness probe
    passes only once a decode worker answers."""
    objects = render({**values_for(tiny_llama), "mode": "single"})
    by_deployment = {c.deployment: c for c in containers(objects)}
    data = named(objects, "ConfigMap", "baton-config")["data"]
    with LocalPods(tmp_path) as pods:
        pods.publish_dns({})  # no worker pod is ready yet
        gateway = pods.start("gateway-0", by_deployment["baton-gateway"], objects)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not gateway.probe("startupProbe"):
            assert gateway.popen.poll() is None, gateway.log_tail()
            assert time.monotonic() < deadline, gateway.log_tail()
            time.sleep(0.1)
        assert gateway.probe("livenessProbe")
        assert not gateway.ready()
        worker = pods.start("single-0", by_deployment["baton-single"], objects)
        pods.wait_ready(worker, START_TIMEOUT_S)
        assert not gateway.ready()  # not in the DNS answer yet
        pods.publish_dns(
            {data["BATON_GATEWAY_DECODE"].removeprefix("dns:///"): [worker.address("grpc-decode")]}
        )
        pods.wait_ready(gateway, START_TIMEOUT_S)
        assert gateway.probe("livenessProbe") and gateway.probe("startupProbe")


def test_a_worker_in_a_long_prefill_answers_its_rendered_probes_in_time(tmp_path: Path) -> None:
    """Health is answered from the server's own state, never by the engine thread: while a
    rendered single-process pod computes one long prefill step, every run of its rendered
    readiness and liveness probes passes within the probe's timeoutSeconds."""
    from protos.baton.v1 import worker_pb2, worker_pb2_grpc
    from tests.factories import make_tiny_model_dir

    wide = make_tiny_model_dir(
        tmp_path / "wide",
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=4096,
    )
    values = values_for(wide)
    values["mode"] = "single"
    values["engine"] = {**values["engine"], "maxNumBatchedTokens": 4096, "numBlocks": 300}
    objects = render(values)
    (single,) = [c for c in containers(objects) if c.deployment == "baton-single"]
    with LocalPods(tmp_path / "pods") as pods:
        worker = pods.start("single-0", single, objects)
        pods.wait_ready(worker, START_TIMEOUT_S)
        request = worker_pb2.DecodeRequest(
            request_id="long-prefill",
            prompt_token_ids=[100 + i % 1000 for i in range(4000)],
            sampling_params=common_pb2.SamplingParameters(max_tokens=1, temperature=0),
        )
        answered: list[float] = []

        def prefill() -> None:
            with grpc.insecure_channel(worker.address("grpc-decode")) as channel:
                began = time.monotonic()
                replies = list(
                    worker_pb2_grpc.DecodeWorkerStub(channel).Decode(request, timeout=300)
                )
                answered.append(time.monotonic() - began)
                assert replies[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH

        thread = threading.Thread(target=prefill)
        thread.start()
        probes: list[tuple[str, bool, float]] = []
        while thread.is_alive():
            for kind in ("readinessProbe", "livenessProbe"):
                began = time.monotonic()
                passed = worker.probe(kind)
                probes.append((kind, passed, time.monotonic() - began))
            time.sleep(0.2)
        thread.join()
    assert answered and answered[0] > 2.0, f"the prefill took {answered}: not long enough"
    assert len(probes) >= 4, probes
    timeout = single.spec["readinessProbe"]["timeoutSeconds"]
    assert all(passed for _, passed, _ in probes), probes
    assert max(seconds for _, _, seconds in probes) < timeout, probes
