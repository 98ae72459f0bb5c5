"""Peer: vLLM-CPU's side of the structured-output benchmark, a leg worker in vLLM's venv.

Loads vLLM-CPU once as `benchmarks.peers.vllm_cpu` does for W1 (same settings, same
warm-up), then runs W1 passes on command (`benchmarks.leg_worker`): all free, or with the
requests `benchmarks.structured_schemas` picks under their JSON schema through vLLM's
structured outputs (``SamplingParams(structured_outputs=StructuredOutputsParams(json=...))``,
backend ``auto``: xgrammar unless it refuses the schema; ``disable_any_whitespace``, so its
JSON has no free whitespace, as baton's has not). Each leg returns its wall time,
every request's output ids and the backend vLLM chose for the constrained ones.

    <vllm python> -m benchmarks.peers.vllm_structured --spec JSON
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from benchmarks import leg_worker, structured_schemas
from benchmarks.common import RunSpec, load_workload
from benchmarks.peers import vllm_cpu


def _params(index: int, r: Any, every: int, max_tokens: int | None) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    picked = structured_schemas.schema_for(index, every)
    tokens = r.output_len if max_tokens is None else min(max_tokens, r.output_len)
    return SamplingParams(
        temperature=0,
        max_tokens=tokens,
        ignore_eos=True,
        structured_outputs=None
        if picked is None
        else StructuredOutputsParams(
            json=structured_schemas.schema_json(picked[1]), disable_any_whitespace=True
        ),
    )


def _backends(llm: Any, params: list[Any]) -> list[str]:
    """The structured-output backends vLLM chose (it writes its choice into the params it
    validates), else the engine's configured one."""
    chosen = {
        p.structured_outputs._backend
        for p in params
        if p.structured_outputs is not None and p.structured_outputs._backend
    }
    if chosen:
        return sorted(chosen)
    configured = llm.llm_engine.vllm_config.structured_outputs_config.backend
    return [f"{configured} (not recorded per request)"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="a RunSpec as JSON")
    args = parser.parse_args()
    spec = RunSpec.from_json(args.spec)
    workload = load_workload(Path(spec.workload), spec.limit)
    llm = vllm_cpu.load_llm(spec)

    def run_leg(command: dict[str, Any]) -> dict[str, Any]:
        requests = workload[: command.get("limit") or len(workload)]
        every = int(command["every"])
        params = [_params(i, r, every, command.get("max_tokens")) for i, r in enumerate(requests)]
        # Every pass starts from an empty prefix cache: the passes repeat the same prompts,
        # and a hit would spare the later pass its prefill.
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache")
        wall, outputs = vllm_cpu.generate_w1(llm, requests, params)
        backends = _backends(llm, params) if every else []
        return {"wall_s": wall, "outputs": outputs, "backends": backends}

    try:
        leg_worker.serve(run_leg)
    finally:
        vllm_cpu.shutdown(llm)


if __name__ == "__main__":
    main()
