"""Which grammar library baton constrains with: llguidance or xgrammar, by measurement.

For each library that imports, on the bundled SmolLM2 tokenizer (49152 tokens): the time
to build its tokenizer view once, to compile a typical extraction schema (cold, then from
a fresh schema of the same shape), and the per-step time to fill the token bitmask of 64
matchers (a batch-64 decode step, each matcher a few tokens into its JSON).

    .venv/bin/python -m benchmarks.grammar_choice            # llguidance only
    PYTHONPATH=/tmp/xgr .venv/bin/python -m benchmarks.grammar_choice   # + xgrammar

(xgrammar is not a baton dependency; install it aside with
``pip install --no-deps --target /tmp/xgr xgrammar apache-tvm-ffi``.)
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from engine.model_files import load_tokenizer
from tests.factories import smollm2_files

BATCH = 64
STEPS = 20
# A typical extraction schema: nested object, array, enum, bounded numbers.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
        },
        "status": {"enum": ["active", "inactive", "banned"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "status"],
    "additionalProperties": False,
}
PREFIX = '{"name": "Ada'


def _schema(i: int) -> str:
    s = json.loads(json.dumps(SCHEMA))
    s["properties"][f"extra_{i}"] = {"type": "boolean"}
    return json.dumps(s)


def bench_llguidance(hf) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t0 = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf)
    tok_s = time.perf_counter() - t0
    compiles = []
    for i in range(5):
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(_schema(i)))
        compiles.append(time.perf_counter() - t0)
        assert not m.is_error(), m.get_error()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(_schema(0))
    prefix = hf.encode(PREFIX, add_special_tokens=False)
    matchers = []
    for _ in range(BATCH):
        m = llguidance.LLMatcher(tok, grammar)
        assert m.consume_tokens(prefix), m.get_error()
        matchers.append(m)
    mask = llguidance.torch.allocate_token_bitmask(BATCH, tok.vocab_size)
    ex = llguidance.LLExecutor()
    steps = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask_par(
            ex, [(m, i) for i, m in enumerate(matchers)], mask
        )
        steps.append(time.perf_counter() - t0)
    return {
        "tokenizer_s": tok_s,
        "compile_first_s": compiles[0],
        "compile_median_s": statistics.median(compiles[1:]),
        "mask_batch64_median_ms": 1000 * statistics.median(steps),
    }


def bench_xgrammar(hf) -> dict[str, float]:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    tok_s = time.perf_counter() - t0
    compiles = []
    compiled = None
    for i in range(5):
        t0 = time.perf_counter()
        c = compiler.compile_json_schema(_schema(i))
        compiles.append(time.perf_counter() - t0)
        compiled = compiled or c
    prefix = hf.encode(PREFIX, add_special_tokens=False)
    matchers = []
    for _ in range(BATCH):
        m = xgr.GrammarMatcher(compiled)
        for t in prefix:
            assert m.accept_token(t)
        matchers.append(m)
    mask = xgr.allocate_token_bitmask(BATCH, info.vocab_size)
    steps = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, i)
        steps.append(time.perf_counter() - t0)
    return {
        "tokenizer_s": tok_s,
        "compile_first_s": compiles[0],
        "compile_median_s": statistics.median(compiles[1:]),
        "mask_batch64_median_ms": 1000 * statistics.median(steps),
    }


def main() -> None:
    torch.set_num_threads(1)
    hf = load_tokenizer(smollm2_files())
    print(f"tokenizer: SmolLM2-135M-Instruct, {len(hf)} tokens; batch {BATCH}, {STEPS} steps")
    for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        try:
            result = fn(hf)
        except ImportError as exc:
            print(f"{name}: not installed ({exc})")
            continue
        print(name, json.dumps({k: round(v, 4) for k, v in result.items()}))


if __name__ == "__main__":
    main()
