"""engine.model_fetch against a local fake of the Hugging Face Hub (tests/fake_hub.py,
reached through ``endpoint`` as ``HF_ENDPOINT`` would): a gated tiny checkpoint is
downloaded with the token, loaded by the engine with greedy output equal to HF's on the
same checkpoint, and not fetched again at a pinned revision; a GGUF is converted once into
the volume, or refused with the sizes when it cannot fit."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from engine import model_files
from engine.model_fetch import FetchConfig, fetch, parse
from engine.sampling_params import SamplingParams
from gateway.served_model import locate_model, read_model_card
from gateway.text.tokenizer import Tokenizer
from tests.engine_helpers import compare_greedy, hf_greedy, hf_model, make_core
from tests.factories import TINY_GGUF_VOCAB_SIZE, make_tiny_gguf, make_tiny_model_dir
from tests.fake_hub import FakeRepo, serve

TOKEN = "hf_test_token"
PROMPTS = [[1, 5, 70, 100], [3, 9, 200, 17, 42, 8]]


def token_file(tmp_path: Path, token: str = TOKEN) -> Path:
    path = tmp_path / "token"
    path.write_text(token + "\n")  # as a Secret written by hand often is
    return path


def test_a_gated_repo_is_fetched_with_the_token_and_the_engine_serves_it_like_hf(
    tiny_llama: Path, tmp_path: Path
) -> None:
    hub = FakeRepo.from_dir("acme/tiny-llama", tiny_llama, token=TOKEN)
    dest = tmp_path / "volume" / "acme--tiny-llama" / hub.sha
    with serve(hub) as url:
        cfg = FetchConfig(
            repo="acme/tiny-llama",
            revision=hub.sha,
            dest=dest,
            token_file=token_file(tmp_path),
            endpoint=url,
        )
        checkpoint = fetch(cfg)
        assert checkpoint == dest / "tiny-llama"
        assert {p.name for p in checkpoint.iterdir() if not p.name.startswith(".")} == set(
            hub.files
        )
        fetched = len(hub.requests)
        assert fetched > 0
        # Pinned and complete: a restarted pod does not touch the hub.
        assert fetch(cfg) == checkpoint and len(hub.requests) == fetched
        # A branch is resolved again.
        fetch(FetchConfig(**{**_fields(cfg), "revision": "main"}))
        assert ("GET", "/api/models/acme/tiny-llama/revision/main") in hub.requests[fetched:]

    core = make_core(checkpoint, dtype="float32")
    outs = core.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    hf = hf_model(tiny_llama)
    verdicts = [compare_greedy(o, *hf_greedy(hf, p, 8)) for p, o in zip(PROMPTS, outs, strict=True)]
    assert "mismatch" not in verdicts, verdicts


def _fields(cfg: FetchConfig) -> dict[str, object]:
    return {name: getattr(cfg, name) for name in FetchConfig.__slots__}  # type: ignore[attr-defined]


def test_a_wrong_token_fetches_nothing(tiny_llama: Path, tmp_path: Path) -> None:
    hub = FakeRepo.from_dir("acme/tiny-llama", tiny_llama, token=TOKEN)
    dest = tmp_path / "volume"
    with serve(hub) as url, pytest.raises(Exception) as failed:  # noqa: PT011 - the hub's own
        fetch(
            FetchConfig(
                repo="acme/tiny-llama",
                dest=dest,
                token_file=token_file(tmp_path, "hf_wrong"),
                endpoint=url,
            )
        )
    assert not (dest / "tiny-llama" / "config.json").exists(), failed.value
    assert all(method == "GET" and "/api/" in path for method, path in hub.requests)


def test_the_gateways_fetch_skips_the_weights(tiny_llama: Path, tmp_path: Path) -> None:
    hub = FakeRepo.from_dir("acme/tiny-llama", tiny_llama)
    with serve(hub) as url:
        cfg = FetchConfig(
            repo="acme/tiny-llama", dest=tmp_path / "v", tokenizer_only=True, endpoint=url
        )
        checkpoint = fetch(cfg)
    assert (checkpoint / "config.json").is_file() and (checkpoint / "tokenizer.json").is_file()
    assert not list(checkpoint.glob("*.safetensors"))
    assert not [p for _, p in hub.requests if p.endswith(".safetensors")]
    # All the gateway reads: its model card and tokenizer.
    source = locate_model(str(checkpoint))
    tokenizer = Tokenizer.load(source.directory)
    try:
        card = read_model_card(source, tokenizer)
    finally:
        tokenizer.close()
    assert card.max_model_len > 0


def test_a_repo_without_safetensors_is_refused(tmp_path: Path) -> None:
    hub = FakeRepo("acme/old", {"config.json": b'{"model_type": "llama"}', "x.bin": b"0"})
    with serve(hub) as url, pytest.raises(ValueError, match="has no config.json and"):
        fetch(FetchConfig(repo="acme/old", dest=tmp_path / "v", endpoint=url))


def _gguf_repo(tmp_path: Path) -> FakeRepo:
    src = make_tiny_model_dir(tmp_path / "src", vocab_size=TINY_GGUF_VOCAB_SIZE)
    gguf = make_tiny_gguf(tmp_path / "tiny.Q8.gguf", src)
    return FakeRepo("acme/tiny-gguf", {"tiny.Q8.gguf": gguf.read_bytes(), "README.md": b"hi"})


def test_a_gguf_is_converted_once_into_the_volume(tmp_path: Path) -> None:
    hub = _gguf_repo(tmp_path)
    dest = tmp_path / "volume"
    cfg = FetchConfig(
        repo="acme/tiny-gguf", revision=hub.sha, dest=dest, gguf_file="tiny.Q8.gguf", endpoint=""
    )
    with serve(hub) as url:
        cfg = FetchConfig(**{**_fields(cfg), "endpoint": url})
        checkpoint = fetch(cfg)
        assert (checkpoint / "model.safetensors").is_file()
        assert (checkpoint / "tokenizer_config.json").is_file()
        assert not [p for _, p in hub.requests if p.endswith("README.md")]
        before = len(hub.requests)
        assert fetch(cfg) == checkpoint and len(hub.requests) == before
        # At a branch the hub is asked again, but the same GGUF is not converted again.
        weights = (checkpoint / "model.safetensors").stat().st_mtime_ns
        fetch(FetchConfig(**{**_fields(cfg), "revision": "main"}))
        assert len(hub.requests) > before
        assert (checkpoint / "model.safetensors").stat().st_mtime_ns == weights
    assert model_files.resolve_model(str(checkpoint)).path == checkpoint


def test_a_gguf_that_cannot_fit_is_refused_with_the_sizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = _gguf_repo(tmp_path)
    monkeypatch.setattr(model_files.shutil, "disk_usage", lambda p: SimpleNamespace(free=10 << 20))
    dest = tmp_path / "volume"
    with serve(hub) as url, pytest.raises(ValueError) as refused:
        fetch(FetchConfig(repo="acme/tiny-gguf", dest=dest, gguf_file="tiny.Q8.gguf", endpoint=url))
    assert "GiB in" in str(refused.value) and "0.01 GiB free" in str(refused.value)
    assert not (dest / "tiny-gguf").exists()
    assert not list(dest.glob(".convert-*"))


def test_flags_env_twins_and_hf_endpoint() -> None:
    cfg = parse(
        ["--repo", "org/m", "--dest", "/models/x", "--revision", "v1"],
        {"HF_ENDPOINT": "http://mirror:8080", "BATON_FETCH_TOKEN_FILE": "/etc/t"},
    )
    assert (cfg.repo, cfg.revision, cfg.endpoint, str(cfg.token_file)) == (
        "org/m",
        "v1",
        "http://mirror:8080",
        "/etc/t",
    )
    assert cfg.checkpoint == Path("/models/x/m")
    flag_wins = parse(
        ["--repo", "o/m", "--dest", "/d", "--endpoint", "http://e"], {"HF_ENDPOINT": "x"}
    )
    assert flag_wins.endpoint == "http://e"
    with pytest.raises(ValueError, match="repo must be ORG/NAME"):
        parse(["--repo", "justname", "--dest", "/d"], {})
    with pytest.raises(ValueError, match="--repo and --dest are required"):
        parse(["--repo", "o/m"], {})
    with pytest.raises(ValueError, match="gguf_file must name a .gguf"):
        parse(["--repo", "o/m", "--dest", "/d", "--gguf-file", "../x.gguf"], {})
