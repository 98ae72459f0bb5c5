"""Prefill worker service: prompt pass, KV hand-off to decode."""
