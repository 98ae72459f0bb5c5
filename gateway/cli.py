"""``baton``: the command a person types.

    baton run "Write a haiku about relay races"     # start everything, stream one answer
    baton serve --gateway-port 50051                # start everything, serve until Ctrl-C
    baton serve --http-port 8000                    # ... with the OpenAI-compatible HTTP API
    baton generate --address HOST:PORT "prompt"     # talk to a running gateway

``run`` and ``serve`` start a gateway and ``--prefill-workers`` prefill and
``--decode-workers`` decode workers (one each by default) as separate processes on
127.0.0.1 (``--single-process`` for workers doing both), which share the host's cores
by a plan (``gateway.core_plan``; ``--no-core-plan`` turns it off) and lend each other
the cores they leave idle (``engine.core_lending``). The gateway finds them as it
does in Kubernetes, by ``dns:///`` names, answered here from a file the launcher keeps
(``gateway.launcher``). ``generate`` and the streaming part of ``run`` are the Python
client's command line (``protos.client``).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Sequence

from engine.cpu_budget import format_cpu_list
from gateway.launcher import ClusterSpec, LocalCluster
from protos.client import cli as client_cli


def _cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="bundled name, .gguf or checkpoint dir")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument(
        "--single-process",
        action="store_true",
        help="one worker runs prefill and decode (no KV transfer)",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="every worker in deterministic mode: a request's tokens and logprobs are the same "
        "bits whatever else is in the batch, however its prompt is chunked, and whether "
        "prefill and decode run in one process or two (CPU; see README, Numerics)",
    )
    p.add_argument(
        "--transport", default="shm", choices=("shm", "gloo", "cuda_ipc", "nccl", "nixl")
    )
    p.add_argument("--prefill-workers", type=int, default=1, help="prefill worker processes")
    p.add_argument(
        "--decode-workers", type=int, default=1, help="decode (or single-process) workers"
    )
    p.add_argument(
        "--core-plan",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split this host's cores between the workers: each pinned to its own CPUs "
        "with a compute team as wide as its share, never more threads in all than cores "
        "(default on; --no-core-plan: every worker sizes its team from the whole host)",
    )
    p.add_argument(
        "--core-lending",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with the core plan, a worker with no work lends its cores to the others, "
        "which widen their teams until it wants them back (default on; --no-core-lending: "
        "each worker keeps to its share)",
    )
    p.add_argument(
        "--fork-workers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start workers as forks of one process that has imported torch once "
        "(default on; --no-fork-workers: each worker is a fresh python process)",
    )
    p.add_argument("--log-level", default="WARNING")


def _spec(
    args: argparse.Namespace, gateway_port: int = 0, http_port: int | None = None
) -> ClusterSpec:
    return ClusterSpec(
        model=args.model,
        mode="single" if args.single_process else "disaggregated",
        transport=args.transport,
        num_prefill=args.prefill_workers,
        num_decode=args.decode_workers,
        dtype=args.dtype,
        deterministic=args.deterministic,
        gateway_port=gateway_port,
        http_port=http_port,
        log_level=args.log_level,
        core_plan=args.core_plan,
        core_lending=args.core_lending,
        fork_workers=args.fork_workers,
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="baton", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="start a local deployment and stream one completion")
    _cluster_args(run)
    run.add_argument("prompt", help="the prompt (sent as a chat message unless --raw)")
    run.add_argument("--raw", action="store_true", help="plain text completion, no chat template")
    run.add_argument("--max-tokens", type=int, default=128)
    run.add_argument("--temperature", type=float, default=0.0)
    serve = sub.add_parser("serve", help="start a local deployment and serve until Ctrl-C")
    _cluster_args(serve)
    serve.add_argument("--gateway-port", type=int, default=50051)
    serve.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="also serve the OpenAI-compatible HTTP API (/v1/...) on this port; 0: any free one",
    )
    sub.add_parser("generate", help="stream from a running gateway (see --help)", add_help=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["generate"]:
        return client_cli.main(argv[1:], prog="baton generate")
    args = _parser().parse_args(argv)
    if args.command == "run":
        print(
            "baton: starting gateway, prefill and decode workers "
            "(the first start converts the model; later ones take seconds)...",
            file=sys.stderr,
        )
        with LocalCluster(_spec(args)) as cluster:
            flags = [
                "--address",
                cluster.gateway_address,
                "--max-tokens",
                str(args.max_tokens),
                "--temperature",
                str(args.temperature),
            ]
            if not args.raw:
                flags.append("--chat")
            return client_cli.main([*flags, args.prompt], prog="baton run")
    with LocalCluster(_spec(args, args.gateway_port, args.http_port)) as cluster:
        http = f", OpenAI HTTP on http://{cluster.http_address}/v1" if cluster.http_address else ""
        cores = "; ".join(
            f"{p.kind} cpus {format_cpu_list(p.cores.cpus)} x{p.cores.threads} threads"
            for p in cluster.procs
            if p.cores is not None
        )
        print(
            f"baton: serving on {cluster.gateway_address}{http} "
            f"(decode {cluster.addresses('decode')}, prefill {cluster.addresses('prefill')}; "
            f"the gateway finds them by name in {cluster.resolve_file})"
            f"{'; cores: ' + cores if cores else ''}; Ctrl-C stops",
            file=sys.stderr,
        )
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            while all(p.popen.poll() is None for p in cluster.procs):
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
