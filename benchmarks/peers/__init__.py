"""Peer engines for side-by-side benchmarks, each run as its own child process.

Nothing here is imported eagerly: `vllm_cpu` runs under vLLM's own interpreter, which has
neither baton nor transformers, and `hf_static` pulls in transformers.
"""
