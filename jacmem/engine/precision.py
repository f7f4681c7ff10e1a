"""One dtype policy for every engine, autocast included.

The forward may run in bfloat16 or float16 (``torch.autocast``, or a half model): what a
hook keeps and the gradients it gets are then in low precision. Every engine computes
its quantities in :func:`compute_dtype` (float32, or float64 where a parameter or kept
tensor is float64), with autocast off and without a graph (:func:`computing`), on
inputs cast by :func:`cast`; each result is returned in its parameter's dtype
(:func:`result`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from torch import Tensor

#: 16-bit dtypes: what an engine keeps in one of them it computes with in float32
LOW = (torch.bfloat16, torch.float16)


def compute_dtype(tensors: Iterable[Tensor]) -> torch.dtype:
    """float32 at least (bf16/fp16 forwards are computed in float32), float64 where a
    floating tensor among ``tensors`` (parameters, kept inputs) is float64."""
    dtype = torch.float32
    for t in tensors:
        if t is not None and t.is_floating_point():
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def is_low(obj) -> bool:
    """Whether a floating tensor, alone or in (nested) tuples, lists and dicts, is 16-bit
    (:data:`LOW`): what an autocast forward keeps."""
    if isinstance(obj, Tensor):
        return obj.dtype in LOW
    if isinstance(obj, (tuple, list)):
        return any(is_low(o) for o in obj)
    if isinstance(obj, dict):
        return any(is_low(v) for v in obj.values())
    return False


def cast(obj, dtype: torch.dtype):
    """Floating tensors, alone or in tuples, lists and dicts, detached and in ``dtype``;
    the rest passes."""
    if isinstance(obj, Tensor):
        return obj.detach().to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj.detach()
    if isinstance(obj, (tuple, list)):
        return type(obj)(cast(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: cast(v, dtype) for k, v in obj.items()}
    return obj


def device_of(obj) -> torch.device:
    """The device of a tensor, or of the first tensor in (nested) tuples and lists."""
    if isinstance(obj, Tensor):
        return obj.device
    return next(device_of(o) for o in obj if isinstance(o, (Tensor, tuple, list)))


def computing(device: torch.device) -> contextlib.AbstractContextManager:
    """Where an engine computes: no graph, and autocast off on ``device``'s type where
    it is on (a backward called inside the autocast region)."""
    if not torch.is_autocast_enabled(device.type):
        return torch.no_grad()  # (the usual case: one context, made by one call)
    stack = contextlib.ExitStack()
    stack.enter_context(torch.no_grad())
    stack.enter_context(torch.autocast(device.type, enabled=False))
    return stack


#: the device types whose autocast :func:`uncast` turns off
_AUTOCAST_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu")


def uncast() -> contextlib.ExitStack:
    """Autocast off on every device type where it is on: the end of a backward pass called
    inside the autocast region, where the engines finish (a probe's projection, a clipped
    sum's product) on tensors of any device."""
    stack = contextlib.ExitStack()
    for device_type in _AUTOCAST_TYPES:
        if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
            stack.enter_context(torch.autocast(device_type, enabled=False))
    return stack


def result(value, param: Tensor):
    """A result in ``param``'s dtype: a tensor, or each tensor of a tuple or list (a
    Kronecker factor pair); the rest passes."""
    if isinstance(value, Tensor):
        return value.to(param.dtype) if value.dtype != param.dtype and value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(result(v, param) for v in value)
    return value
