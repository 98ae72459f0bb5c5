"""Per-step timing of a live engine, for the W1 profile: which thread spent what, where.

``StepProbe.attach`` wraps the methods one step goes through on an ``EngineCore`` (and,
in asynchronous mode, on its ``AsyncEngine``) with timers that record, per phase and
per step, the wall interval, the calling thread and that thread's CPU time:

- ``schedule`` (the scheduler's decision), ``prepare`` (input tensors), ``forward``
  (model forward and logits), ``sample``, ``update`` (scheduler update + runner forget),
  ``publish`` (handing outputs to asyncio, asynchronous mode only);
- ``wait``: the engine thread blocked on the runner's future (asynchronous mode);
- module-level splits of the forward (``attention``, ``linear``, ``logits``) when
  ``breakdown=True``: forward hooks on the attention and linear modules. Hooks cost a
  few microseconds per call, so take shares from such a run, not totals.

Per-thread CPU seconds of the whole process (OpenMP workers included) come from
``/proc/self/task``. The wrappers replace instance attributes only, so ``detach``
restores the engine exactly.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PHASES = ("schedule", "prepare", "forward", "sample", "update", "publish", "wait")
SPLITS = ("attention", "linear", "logits")
_MISSING = object()


@dataclass(slots=True)
class StepRecord:
    """What one step cost, phase by phase (seconds), and its shape."""

    step_id: int
    num_seqs: int = 0
    num_tokens: int = 0
    has_prefill: bool = False
    wall: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)
    # Start and end (perf_counter) of the forward, for in-flight accounting.
    forward_span: tuple[float, float] | None = None
    # Involuntary context switches of the forward's thread during the forward.
    forward_preempted: int = 0


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) of every thread of this process, by ``name:tid``.

    Python threads carry their ``threading`` name (the main thread: ``MainThread``);
    others (torch's OpenMP workers) are named ``native``.
    """
    tick = float(os.sysconf("SC_CLK_TCK"))
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        name = names.get(int(task.name), "native")
        out[f"{name}:{task.name}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


class StepProbe:
    def __init__(self, breakdown: bool = False):
        self.breakdown = breakdown
        self.steps: dict[int, StepRecord] = {}
        self._local = threading.local()
        self._restore: list[tuple[object, str, Any]] = []
        self._hooks: list[Any] = []

    # -- records ----------------------------------------------------------------------

    def _step(self, step_id: int) -> StepRecord:
        rec = self.steps.get(step_id)
        if rec is None:
            rec = self.steps[step_id] = StepRecord(step_id)
        return rec

    def _add(self, step_id: int, phase: str, wall: float, cpu: float) -> None:
        rec = self._step(step_id)
        rec.wall[phase] = rec.wall.get(phase, 0.0) + wall
        rec.cpu[phase] = rec.cpu.get(phase, 0.0) + cpu

    def _current(self) -> int:
        return getattr(self._local, "step_id", 0)

    # -- wrapping ---------------------------------------------------------------------

    def _patch(self, obj: object, name: str, wrapper: Callable[..., Any]) -> None:
        self._restore.append((obj, name, obj.__dict__.get(name, _MISSING)))
        setattr(obj, name, wrapper)

    def _timed(self, phase: str, fn: Callable[..., Any], step_of: Callable[..., int]):
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            w0, c0 = time.perf_counter(), time.thread_time()
            out = fn(*args, **kwargs)
            w1, c1 = time.perf_counter(), time.thread_time()
            self._add(step_of(out, *args), phase, w1 - w0, c1 - c0)
            return out

        return wrapper

    def attach(self, core: Any, engine: Any = None) -> None:
        """Wrap ``core``'s step methods (and ``engine``'s, an AsyncEngine) with timers."""
        sched, runner = core.scheduler, core.runner

        def schedule_step(out: Any) -> int:
            rec = self._step(out.step_id)
            rec.num_seqs = len(out.seqs)
            rec.num_tokens = out.num_batched_tokens
            rec.has_prefill = any(s.num_new > 1 for s in out.seqs)
            return out.step_id

        self._patch(sched, "schedule", self._timed("schedule", sched.schedule, schedule_step))
        run = runner._run  # on the compute thread, whichever loop queued the step

        def run_wrapper(step: Any) -> Any:
            self._local.step_id = step.sched.step_id
            return run(step)

        self._patch(runner, "_run", run_wrapper)
        self._patch(
            runner,
            "prepare",
            self._timed("prepare", runner.prepare, lambda out, *_: out.sched.step_id),
        )
        forward = runner._forward

        def forward_wrapper(batch: Any) -> Any:
            step = self._current()
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw
            w0, c0 = time.perf_counter(), time.thread_time()
            out = forward(batch)
            w1, c1 = time.perf_counter(), time.thread_time()
            rec = self._step(step)
            rec.forward_span = (w0, w1)
            rec.forward_preempted += resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw - before
            self._add(step, "forward", w1 - w0, c1 - c0)
            return out

        self._patch(runner, "_forward", forward_wrapper)
        self._patch(
            runner, "sampler", self._timed("sample", runner.sampler, lambda *_: self._current())
        )
        self._patch(core, "update", self._timed("update", core.update, lambda _o, s, *_: s.step_id))
        if engine is not None:
            self._attach_async(engine)
        if self.breakdown:
            self._attach_hooks(runner.model)

    def _attach_async(self, engine: Any) -> None:
        probe = self
        last_update = {"step": 0}
        update = engine.core.update

        def update_wrapper(s: Any, sampled: Any) -> Any:
            last_update["step"] = s.step_id
            return update(s, sampled)

        self._patch(engine.core, "update", update_wrapper)
        self._patch(
            engine, "_publish",
            self._timed("publish", engine._publish, lambda *_: last_update["step"]),
        )  # fmt: skip
        runner = engine.core.runner
        submit = runner.submit_run

        class _TimedFuture:
            def __init__(self, fut: Any, step_id: int):
                self._fut, self._step_id = fut, step_id

            def result(self, timeout: float | None = None) -> Any:
                w0, c0 = time.perf_counter(), time.thread_time()
                out = self._fut.result(timeout)
                probe._add(self._step_id, "wait", time.perf_counter() - w0, time.thread_time() - c0)
                return out

            def __getattr__(self, name: str) -> Any:
                return getattr(self._fut, name)

        def submit_wrapper(step: Any) -> Any:
            return _TimedFuture(submit(step), step.sched.step_id)

        self._patch(runner, "submit_run", submit_wrapper)

    def _attach_hooks(self, model: Any) -> None:
        from torch import nn

        from engine.layers.attention import PagedAttention

        starts: dict[int, tuple[float, float]] = {}

        def pre(mod: Any, _args: Any) -> None:
            starts[id(mod)] = (time.perf_counter(), time.thread_time())

        def post_for(split: str) -> Callable[..., None]:
            def post(mod: Any, _args: Any, _out: Any) -> None:
                w0, c0 = starts.pop(id(mod))
                self._add(self._current(), split, time.perf_counter() - w0, time.thread_time() - c0)

            return post

        for mod in model.modules():
            split = None
            if isinstance(mod, PagedAttention):
                split = "attention"
            elif isinstance(mod, nn.Linear):
                split = "logits" if mod is getattr(model, "lm_head", None) else "linear"
            if split is not None:
                self._hooks.append(mod.register_forward_pre_hook(pre))
                self._hooks.append(mod.register_forward_hook(post_for(split)))

    def detach(self) -> None:
        for obj, name, old in reversed(self._restore):
            if old is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, old)
        self._restore.clear()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
