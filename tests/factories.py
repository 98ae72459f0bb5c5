"""Factory helpers that build small, deterministic test inputs: tiny random checkpoints.

Plain functions, not fixtures, so a test says exactly what it builds. A tiny model here is a
real HF checkpoint directory (config.json, generation_config.json, model.safetensors) that
`engine.model_files.resolve_model` accepts and HF `transformers` can load as the reference.
`make_tiny_gguf` writes such a model as a GGUF file, so the conversion path can be tested in
seconds instead of on the 135M-parameter bundled model.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.model_files import ModelFiles, resolve_model

# Architectures `make_tiny_model_dir` builds; qwen2 differs by its q/k/v biases.
TINY_ARCHS = ("llama", "qwen2", "mistral")

# Files that make up an HF tokenizer; copied when `tokenizer_from` is given.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)

# The tiny GGUF tokenizer: ChatML specials at the ids SmolLM2 uses, then the 256 byte-level
# symbols, then a few merges so that BPE actually merges something.
_GGUF_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_GGUF_MERGES = ("h e", "l l", "Ġ t", "Ġ w", "o r")
_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_GGUF_EOS_ID = 2


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    by_byte = dict(zip(printable, codes, strict=True))
    return [chr(by_byte[b]) for b in range(256)]


def _gguf_tokens() -> list[str]:
    merged = [merge.replace(" ", "") for merge in _GGUF_MERGES]
    return [*_GGUF_SPECIALS, *_byte_symbols(), *merged]


# Vocabulary size a model must have to be written by `make_tiny_gguf`.
TINY_GGUF_VOCAB_SIZE = len(_gguf_tokens())


def make_tiny_model_dir(
    dest: Path,
    *,
    arch: str = "llama",
    seed: int = 0,
    vocab_size: int = 49152,
    tokenizer_from: Path | None = None,
    **config_overrides: Any,
) -> Path:
    """Build a tiny random HF checkpoint in ``dest`` and return ``dest``.

    The same ``arch``/``seed``/overrides always give bit-identical weights. ``vocab_size``
    defaults to SmolLM2's, so ``tokenizer_from=smollm2_files().path`` makes a tiny model that
    serves real text through the real tokenizer. ``config_overrides`` replace any config field.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = _tiny_config(arch, vocab_size, config_overrides)
    # Seed a private generator state so that building a model never perturbs the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    eos = config.eos_token_id
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=eos, pad_token_id=config.pad_token_id
    ).save_pretrained(dest)
    if tokenizer_from is not None:
        copied = 0
        for name in _TOKENIZER_FILES:
            if (tokenizer_from / name).is_file():
                shutil.copy2(tokenizer_from / name, dest / name)
                copied += 1
        if copied == 0:
            raise ValueError(
                f"tokenizer_from={tokenizer_from} holds none of the tokenizer files "
                f"{', '.join(_TOKENIZER_FILES)}"
            )
    return dest


def _tiny_config(arch: str, vocab_size: int, overrides: dict[str, Any]) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}
    if arch not in classes:
        raise ValueError(f"arch={arch!r} is not a tiny arch; allowed: {', '.join(TINY_ARCHS)}")
    fields: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "max_position_embeddings": 1024,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        # Tied like SmolLM2: keeps the default model at ~3.2M parameters (an untied 49152-row
        # head alone would add 3.1M), and exercises loaders on a checkpoint without lm_head.
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "dtype": "float32",
    }
    if arch == "mistral":
        # Mistral's config defaults to a 4096-token sliding window; keep attention full so the
        # tiny model behaves like the Llama reference at every length we test.
        fields["sliding_window"] = None
    fields.update(overrides)
    return classes[arch](**fields)


def make_tiny_gguf(path: Path, model_dir: Path) -> Path:
    """Write the tiny llama checkpoint in ``model_dir`` to ``path`` as an F32 GGUF.

    The model must be a ``llama`` with ``vocab_size == TINY_GGUF_VOCAB_SIZE``: the file gets
    a small byte-level BPE tokenizer with ChatML specials and a chat template (eos id 2).
    Q and K rows are permuted the way llama.cpp's converter does, so loading the file back
    must undo that exactly: the converted copy's logits equal ``model_dir``'s.
    """
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type != "llama":
        raise ValueError(f"make_tiny_gguf writes llama models only, got {config.model_type!r}")
    if config.vocab_size != TINY_GGUF_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={config.vocab_size} does not match the tiny GGUF tokenizer; "
            f"build the model with vocab_size=TINY_GGUF_VOCAB_SIZE ({TINY_GGUF_VOCAB_SIZE})"
        )
    state = load_file(str(model_dir / "model.safetensors"))
    n_head, n_kv = config.num_attention_heads, config.num_key_value_heads

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    tokens = _gguf_tokens()
    token_types = [gguf.TokenType.CONTROL] * len(_GGUF_SPECIALS) + [gguf.TokenType.NORMAL] * (
        len(tokens) - len(_GGUF_SPECIALS)
    )
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(list(_GGUF_MERGES))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(TINY_GGUF_EOS_ID)
    writer.add_pad_token_id(TINY_GGUF_EOS_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(_CHATML_TEMPLATE)

    def put(name: str, tensor: torch.Tensor) -> None:
        writer.add_tensor(name, np.ascontiguousarray(tensor.float().numpy()))

    put("token_embd.weight", state["model.embed_tokens.weight"])
    put("output_norm.weight", state["model.norm.weight"])
    if "lm_head.weight" in state:
        put("output.weight", state["lm_head.weight"])
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", state[p + "input_layernorm.weight"])
        q, k = state[p + "self_attn.q_proj.weight"], state[p + "self_attn.k_proj.weight"]
        put(f"blk.{i}.attn_q.weight", _llama_cpp_permute(q, n_head))
        put(f"blk.{i}.attn_k.weight", _llama_cpp_permute(k, n_kv))
        put(f"blk.{i}.attn_v.weight", state[p + "self_attn.v_proj.weight"])
        put(f"blk.{i}.attn_output.weight", state[p + "self_attn.o_proj.weight"])
        put(f"blk.{i}.ffn_norm.weight", state[p + "post_attention_layernorm.weight"])
        put(f"blk.{i}.ffn_gate.weight", state[p + "mlp.gate_proj.weight"])
        put(f"blk.{i}.ffn_up.weight", state[p + "mlp.up_proj.weight"])
        put(f"blk.{i}.ffn_down.weight", state[p + "mlp.down_proj.weight"])

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _llama_cpp_permute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    # llama.cpp stores rotary halves interleaved per head; this is its converter's permute().
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def smollm2_files(cache_dir: Path | None = None) -> ModelFiles:
    """The bundled SmolLM2-135M-Instruct as a converted checkpoint (converts on first use)."""
    return resolve_model("smollm2-135m", cache_dir=cache_dir)
