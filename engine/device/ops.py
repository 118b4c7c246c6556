"""Typed calls of ops that torch types as `Any`: `torch.ops.*` (torch's private kernels and our
compiled ones, engine/device/native.py), module calls, and a few untyped torch functions. The one place
their results are cast to what they are."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch


def tensor_op(op: Any, *args: object) -> torch.Tensor:
    """`op(*args)`, an op (or module) that returns one tensor."""
    return cast(torch.Tensor, op(*args))


def tensor_pair_op(op: Any, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
    """`op(*args)`, an op that returns two tensors."""
    return cast(tuple[torch.Tensor, torch.Tensor], op(*args))


def mkldnn_available() -> bool:
    """torch.backends.mkldnn.is_available(), which torch leaves untyped."""
    return cast(Callable[[], bool], torch.backends.mkldnn.is_available)()


def cuda_stream(device: torch.device) -> torch.cuda.Stream:
    """A new CUDA stream on `device` (torch.cuda.Stream's constructor is untyped)."""
    return cast(Callable[[torch.device], torch.cuda.Stream], torch.cuda.Stream)(device)
