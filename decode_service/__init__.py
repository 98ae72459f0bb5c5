"""Decode worker service: owns KV blocks, receives KV, decodes and streams tokens."""
