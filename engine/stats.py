"""A snapshot of an engine's load and KV occupancy, as workers report it. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_waiting_for_kv: int
    num_total_blocks: int
    num_free_blocks: int
    num_held_blocks: int
    num_queued_prompt_tokens: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    num_preemptions: int
    num_steps: int
    busy_seconds: float
