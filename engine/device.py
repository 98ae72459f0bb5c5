"""Where a worker computes: its one validated ``torch.device``, and building a model there.

A worker names its device once (``--device``); ``resolve_device`` turns the name into a
``torch.device`` that the model runner, the KV pool and the transport all share. A bare
``"cuda"`` becomes ``cuda:<current device>`` here, once: an unindexed CUDA device is
refused by ``torch.cuda.set_device`` (which NCCL needs) and would silently follow
whatever device a thread has current.

The engine computes on the device's default stream (``compute_stream``); transports
order their own streams against it with events (``engine.transfer.cuda_stream``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# Factories that make floating-point tensors when no dtype is given.
_FLOAT_FACTORIES: frozenset[Callable[..., Any]] = frozenset(
    {torch.empty, torch.zeros, torch.ones, torch.rand, torch.randn, torch.empty_strided}
)


def resolve_device(spec: str) -> torch.device:
    """``"cpu"``, ``"cuda"`` or ``"cuda:N"`` as a torch.device; CUDA always with its index.

    Raises ValueError naming ``device`` when the name is malformed, CUDA is unusable in
    this process, or the index is not a visible device.
    """
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {spec!r} is not 'cpu' or 'cuda[:N]': {exc}") from exc
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {spec!r}")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {spec!r}: CUDA is not available to this process (torch "
            f"{torch.__version__}, built for CUDA {torch.version.cuda or 'none'})"
        )
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if device.index is None else device.index
    if not 0 <= index < count:
        raise ValueError(f"device {spec!r}: this process sees {count} CUDA device(s)")
    return torch.device("cuda", index)


def compute_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream the engine's forward passes run on: the device's default stream."""
    return torch.cuda.default_stream(device)


class _DefaultFloatDtype(TorchFunctionMode):
    """Gives floating-point factory calls without a dtype the target dtype (this thread only,
    like ``with torch.device(...)``; ``torch.set_default_dtype`` would change every thread)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = dict(kwargs or {})
        if func in _FLOAT_FACTORIES and kwargs.get("dtype") is None:
            kwargs["dtype"] = self.dtype
        return func(*args, **kwargs)


# The in-place random fills that modules' ``reset_parameters`` run: ``nn.init``'s
# random initialisers (they dispatch through torch-function modes themselves) and the
# tensor methods they end in.
_RANDOM_FILLS: frozenset[Callable[..., Any]] = frozenset(
    {
        torch.nn.init.uniform_,
        torch.nn.init.normal_,
        torch.nn.init.trunc_normal_,
        torch.nn.init.kaiming_uniform_,
        torch.nn.init.kaiming_normal_,
        torch.nn.init.xavier_uniform_,
        torch.nn.init.xavier_normal_,
        torch._C.TensorBase.uniform_,
        torch._C.TensorBase.normal_,
    }
)


class _NoRandomFill(TorchFunctionMode):
    """Leaves tensors as allocated where a module would fill them with random values: the
    checkpoint overwrites every parameter anyway, and SmolLM2-135M's random
    initialisation alone took ~1.7 s of each worker's start."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func in _RANDOM_FILLS:  # nn.init's take the tensor as ``tensor``
            return args[0] if args else (kwargs or {})["tensor"]
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def build_on(
    device: torch.device, dtype: torch.dtype, *, random_init: bool = True
) -> Iterator[None]:
    """Modules built inside get their parameters allocated on ``device`` in ``dtype`` at
    once, never as an fp32 copy first (a bf16 8B model would briefly need 32 GB).

    ``random_init=False`` skips the random fills of parameter initialisation, leaving
    those parameters' memory as allocated: only for a model whose every parameter is then
    loaded (``load_weights`` refuses a checkpoint that misses one)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.device(device))
        stack.enter_context(_DefaultFloatDtype(dtype))
        if not random_init:
            stack.enter_context(no_random_init())
        yield


def no_random_init() -> contextlib.AbstractContextManager[object]:
    """Modules built inside skip the random fills of their parameters' initialisation
    (this thread only): for models whose every parameter is loaded right after."""
    return _NoRandomFill()
