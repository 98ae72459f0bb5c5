"""``model.source: hf`` as rendered: every pod's init container fetches the model into the
model volume (writable there only) with the token from its Secret and ``HF_ENDPOINT``;
its arguments parse (engine.model_fetch) to the very directory every service is told to
load; the cache volume is what ``model.hf.cache`` says. Then the rendered init container
runs through the image's entrypoint against a local fake hub, and the engine loads what
it left, with greedy output equal to HF's on that checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.model_fetch import parse
from engine.sampling_params import SamplingParams
from tests.engine_helpers import compare_greedy, hf_greedy, hf_model, make_core
from tests.fake_hub import FakeRepo, serve
from tests.k8s_manifests import K8S, containers, named, of_kind, render, render_notes

REVISION = "0123456789abcdef0123456789abcdef01234567"
HF = {
    "source": "hf",
    "name": "acme/tiny-llama",
    "revision": REVISION,
    "hf": {"tokenSecret": "hub-token", "tokenKey": "hf", "endpoint": "https://hub.example.com"},
}


def init_containers(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        d["metadata"]["name"]: d["spec"]["template"]["spec"]["initContainers"][0]
        for d in of_kind(objects, "Deployment")
    }


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


@pytest.mark.parametrize("mode", ["disaggregated", "single", "colocated"])
def test_every_pod_fetches_into_the_directory_its_services_load(mode: str) -> None:
    values: dict[str, Any] = {"mode": mode, "model": HF}
    if mode == "colocated":
        values["transfer"] = {"transport": "shm"}
    objects = render(values)
    data = named(objects, "ConfigMap", "baton-config")["data"]
    model = "/models/acme--tiny-llama/" + REVISION + "/tiny-llama"
    assert data["BATON_GATEWAY_MODEL"] == data["BATON_DECODE_MODEL"] == model
    inits = init_containers(objects)
    assert set(inits) == {d["metadata"]["name"] for d in of_kind(objects, "Deployment")}
    for deployment, init in inits.items():
        assert init["args"][0] == "fetch-model"
        cfg = parse(init["args"][1:], env_of(init))
        assert str(cfg.checkpoint) == model
        assert (cfg.repo, cfg.revision) == ("acme/tiny-llama", REVISION)
        assert cfg.endpoint == "https://hub.example.com"
        assert str(cfg.token_file) == "/etc/baton/hf-token/hf"
        assert cfg.tokenizer_only == (deployment == "baton-gateway")
        assert "nvidia.com/gpu" not in str(init["resources"])
        mounts = {m["name"]: m for m in init["volumeMounts"]}
        assert mounts["model"] == {"name": "model", "mountPath": "/models"}  # writable
        assert mounts["hf-token"]["readOnly"] is True
    for c in containers(objects):
        mounts = {m["name"]: m for m in c.spec["volumeMounts"]}
        assert mounts["model"]["readOnly"] is True, c.name
        assert "hf-token" not in mounts, c.name  # only the init step reads the token
        volumes = {v["name"]: v for v in c.pod["volumes"]}
        assert volumes["hf-token"]["secret"] == {"secretName": "hub-token", "defaultMode": 0o440}


def test_the_cache_volume_decides_how_often_the_model_is_fetched() -> None:
    def model_volume(cache: dict[str, Any]) -> dict[str, Any]:
        objects = render({"model": {**HF, "hf": cache}})
        pod = named(objects, "Deployment", "baton-decode")["spec"]["template"]["spec"]
        return next(v for v in pod["volumes"] if v["name"] == "model")

    assert model_volume({"cacheSizeLimit": "20Gi"})["emptyDir"] == {"sizeLimit": "20Gi"}
    assert model_volume({"cache": "hostPath", "cacheHostPath": "/srv/hf"})["hostPath"] == {
        "path": "/srv/hf",
        "type": "DirectoryOrCreate",
    }
    claim = model_volume({"cache": "pvc", "cacheClaimName": "shared"})["persistentVolumeClaim"]
    assert claim == {"claimName": "shared"}  # the init step writes into it
    with pytest.raises(Exception, match="model.hf.cacheClaimName is required"):
        model_volume({"cache": "pvc"})
    with pytest.raises(Exception, match="model.name must be ORG/NAME"):
        render({"model": {**HF, "name": "tiny-llama"}})


def test_the_gguf_file_is_converted_by_every_pods_fetch() -> None:
    objects = render({"model": {**HF, "ggufFile": "m.Q8_0.gguf"}})
    for deployment, init in init_containers(objects).items():
        cfg = parse(init["args"][1:], {})
        assert cfg.gguf_file == "m.Q8_0.gguf" and not cfg.tokenizer_only, deployment


def test_rendered_init_step_fetches_from_a_local_hub_and_the_worker_serves_it(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """The decode pod's init container, run as the kubelet would (its args through the
    image's entrypoint, its env, /models and the token Secret mapped to local dirs, the
    endpoint pointed at the fake hub), then the engine on the path the worker is given."""
    objects = render({"model": HF})
    init = init_containers(objects)["baton-decode"]
    model = named(objects, "ConfigMap", "baton-config")["data"]["BATON_DECODE_MODEL"]
    volume, secret = tmp_path / "models", tmp_path / "hf-token"
    secret.mkdir()
    (secret / "hf").write_text("hf_pod_token")

    def local(value: str) -> str:
        return value.replace("/models", str(volume)).replace("/etc/baton/hf-token", str(secret))

    hub = FakeRepo.from_dir("acme/tiny-llama", tiny_llama, sha=REVISION, token="hf_pod_token")
    with serve(hub) as url:
        env = {**env_of(init), "HF_ENDPOINT": url}  # the cluster's hub, here
        env = {k: local(v) for k, v in env.items() if not v.startswith("/home/baton")}
        env["PATH"] = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
        env["PYTHONPATH"] = str(K8S.parent)
        out = subprocess.run(
            ["sh", str(K8S / "entrypoint.sh"), *[local(a) for a in init["args"]]],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
    assert out.returncode == 0, out.stderr
    assert any(p.endswith("model.safetensors") for _, p in hub.requests)
    core = make_core(local(model), dtype="float32")
    prompts = [[1, 5, 70, 100], [3, 9, 200, 17, 42, 8]]
    outs = core.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    hf = hf_model(tiny_llama)
    verdicts = [compare_greedy(o, *hf_greedy(hf, p, 8)) for p, o in zip(prompts, outs, strict=True)]
    assert "mismatch" not in verdicts, verdicts


def test_notes_say_where_the_model_comes_from_and_the_access_mode_it_needs() -> None:
    mine = {"image": {"repository": "registry.example.com/baton"}}
    notes = render_notes({**mine, "model": HF})
    assert f"downloads acme/tiny-llama@{REVISION} into the\nemptyDir volume" in notes
    assert "once per pod" in notes and "logs <pod> -c fetch-model" in notes
    assert "not a commit hash" not in notes
    branch = render_notes({**mine, "model": {**HF, "revision": "main"}})
    assert "model.revision main is not a commit hash" in branch
    shared = render_notes(
        {**mine, "model": {**HF, "hf": {"cache": "pvc", "cacheClaimName": "weights"}}}
    )
    assert "once per claim, weights: ReadWriteMany when pods run on several nodes" in shared
    pvc = render_notes({**mine, "model": {"source": "pvc", "claimName": "llama"}})
    assert "The claim llama is mounted read-only by every pod of every role" in pvc
    assert "ReadOnlyMany or ReadWriteMany" in pvc


def test_rendered_pods_fetch_from_a_local_hub_and_serve_completions_equal_to_hf(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """model.source hf end to end: the rendered single-process and gateway pods, each with
    its rendered init container first (the hub's endpoint is the fake hub; the token is a
    Secret file), then a Generate through the gateway, greedy-equal to HF."""
    import asyncio

    import grpc

    from protos.baton.v1 import common_pb2, generate_pb2, generate_pb2_grpc
    from tests.k8s_pods import LocalPods

    hub = FakeRepo.from_dir("acme/tiny-llama", tiny_llama, sha=REVISION, token="hf_pod_token")
    token = tmp_path / "token"
    token.write_text("hf_pod_token")
    with serve(hub) as url:
        objects = render(
            {
                "mode": "single",
                "model": {**HF, "hf": {**HF["hf"], "endpoint": url}},
                "engine": {"dtype": "float32", "numThreads": 1, "numBlocks": 128},
                "gateway": {"settings": {"statsIntervalS": 0.1, "resolveIntervalS": 0.5}},
            }
        )
        by_deployment = {c.deployment: c for c in containers(objects)}
        data = named(objects, "ConfigMap", "baton-config")["data"]
        with LocalPods(tmp_path / "pods", secrets={"hub-token": {"hf": token}}) as pods:
            worker = pods.start("single-0", by_deployment["baton-single"], objects)
            pods.wait_ready(worker, 240)
            name = data["BATON_GATEWAY_DECODE"].removeprefix("dns:///")
            pods.publish_dns({name: [worker.address("grpc-decode")]})
            gateway = pods.start("gateway-0", by_deployment["baton-gateway"], objects)
            pods.wait_ready(gateway, 240)
            prompt = [1000 + 13 * i for i in range(24)]

            async def generate() -> list[int]:
                async with grpc.aio.insecure_channel(gateway.address("grpc")) as channel:
                    request = generate_pb2.GenerateRequest(
                        token_ids=generate_pb2.TokenIds(ids=prompt),
                        sampling_params=common_pb2.SamplingParameters(
                            max_tokens=8, temperature=0, ignore_eos=True
                        ),
                    )
                    stub = generate_pb2_grpc.BatonStub(channel)
                    replies = [r async for r in stub.Generate(request, timeout=60)]
                return [t for r in replies for t in r.token_ids]

            ours = asyncio.run(generate())
    weights = [p for _, p in hub.requests if p.endswith("model.safetensors")]
    assert len(weights) == 2  # HEAD and GET by the worker's init step; none by the gateway's
    ref, ref_logits = hf_greedy(hf_model(tiny_llama), prompt, 8)
    assert compare_greedy(ours, ref, ref_logits) in ("equal", "tie"), (ours, ref)
