"""Per-sample gradients by recomputation with torch.func, and the generic fallback.

For a module ``f(θ, x)`` whose samples do not interact, sample ``n``'s gradient of the
loss w.r.t. ``θ`` is the vector-Jacobian product of its output gradient ``g_n`` with
the module alone: ``g_nᵀ ∂f(θ, x_n)/∂θ``. :func:`per_sample_vjp` computes it for the
whole batch as ``vmap`` over the samples of ``vjp`` of a ``functional_call`` (each
sample goes through the module as a batch of one), from the kept inputs and the output
gradient: exact by construction, for any module, at the price of recomputing its
forward. The layer files use it as a strategy (``vmap``) where no closed form is
registered (attention), and :func:`fallback` applies it to any trainable module with
no registered derivative:

* it covers the module's *own* parameters; its children are recorded separately, and
  the recomputation holds their parameters fixed;
* a container with no parameters of its own gets no fallback (and no record);
* it applies only where recomputing one sample alone reproduces that sample's forward.
  It refuses (``lookup`` gives ``None``, and the block warns, or raises with
  ``strict=True``, naming the module) a module in which some submodule holds buffers
  while in training mode, or is a BatchNorm that uses batch statistics (in training
  mode, or without running statistics): such a forward mutates its buffers (running
  statistics) or mixes the samples. A module whose buffers are constant must therefore
  be in eval mode to get the fallback (its own buffers cannot be told apart from
  running statistics after the fact). Random ops (dropout in training mode) make the
  recomputation differ from the forward: ``vmap`` detects them and the backward raises
  an error that names the fix.

Inputs: every tensor argument (positional or keyword, in nested tuples/lists/dicts)
whose leading size equals that of the first tensor argument is taken as batched on
axis 0; every other argument is passed unchanged to each sample. The output may be a
tensor or a (nested) tuple of them, each batched on axis 0. Under a block's
``batch_first=False`` the block moves axis 1 of the inputs and output gradients first
(:mod:`jacmem.engine.layout`), and the fallback for ``batch_axis=1`` runs each sample through
the module on axis 1, as ``[T, 1, ...]``.

All parameters of one call share one recomputation per chunk: :class:`SharedPass`
keeps the per-sample gradients of every trainable parameter until each parameter has
taken its own.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from math import prod
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap

from jacmem import compat
from jacmem.derivatives import registry
from jacmem.derivatives.registry import Cost, LayerDerivatives, Strategy

#: the strategy name of every recomputation through torch.func
VMAP = "vmap"


def _same(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are the same chunk: the same tensors, or views of the same
    memory with the same layout (each chunk is a fresh slice of the record's tensors,
    which stay alive while the chunks are compared, so equal addresses are equal data)."""
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return a is b or (
            a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
        )
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    return a is b


class SharedPass:
    """One recomputation per chunk for all the parameters of one call of one module.

    The engine asks for one parameter at a time, chunk by chunk. The first parameter
    asked for a chunk computes every parameter's per-sample gradients on it; the others
    take theirs later. It lives in the call's hyper-parameters: it goes when the record
    goes. :meth:`cost` makes the chunks of every parameter the same, so that each chunk
    is computed once.
    """

    def __init__(self, sizes: dict[str, int]):
        #: number of elements of each trainable parameter
        self.sizes = dict(sizes)
        #: the narrowest floating dtype the recomputed forward computed in (HF's
        #: ``LlamaRMSNorm`` runs in float32 inside a float64 model): its gradients, and
        #: those of another program of the same forward (a compiled graph's), agree
        #: only to that dtype's rounding; ``None`` before the first recomputation
        self.narrowest: torch.dtype | None = None
        self.pending: list[tuple[Any, Any, dict[str, Tensor]]] = []

    def take(self, name: str, x, g, compute: Callable[[Any, Any, tuple[str, ...]], dict[str, Tensor]]) -> Tensor:
        """``compute(x, g, names) -> {name: [n, *shape]}`` runs once per chunk."""
        entry = next((e for e in self.pending if name in e[2] and _same(e[0], x) and _same(e[1], g)), None)
        if entry is None:
            entry = (x, g, compute(x, g, tuple(self.sizes)))
            self.pending.append(entry)
        value = entry[2].pop(name)
        if not entry[2]:
            self.pending = [e for e in self.pending if e is not entry]
        return value

    def note(self, dtype: torch.dtype | None) -> None:
        """Narrow :attr:`narrowest` to ``dtype``, a dtype a recomputation computed in."""
        self.narrowest = _narrower(self.narrowest, dtype)

    def cost(self, name: str, cost: Cost | None, batch: int) -> Cost | None:
        """``cost`` of the whole pass, with the workspace of the other parameters'
        per-sample gradients held meanwhile: the engine adds ``name``'s own, so every
        parameter gets the same chunks."""
        if cost is None:
            return None
        others = sum(self.sizes.values()) - self.sizes.get(name, 0)
        return Cost(cost.flops, cost.workspace + batch * others)


def shared_cost(cost: Callable[..., Cost | None], param: str) -> Callable[..., Cost | None]:
    """The cost function of ``param``'s strategy whose work a :class:`SharedPass` shares:
    ``cost(xs, gs, **hp)`` for the whole pass, adjusted by :meth:`SharedPass.cost`."""

    def adjusted(xs, gs, *, shared: SharedPass, **hp) -> Cost | None:
        first = gs if isinstance(gs[0], int) else gs[0]
        return shared.cost(param, cost(xs, gs, **hp), first[0])

    return adjusted


def trainable_sizes(module: nn.Module, names: Sequence[str]) -> dict[str, int]:
    """{name: numel} of those of ``names`` (dotted, or the module's own) that require a gradient."""
    params = ((n, _param(module, n)) for n in names)
    return {n: p.numel() for n, p in params if isinstance(p, nn.Parameter) and p.requires_grad}


def _param(module: nn.Module, name: str):
    owner, _, leaf = name.rpartition(".")
    return getattr(module.get_submodule(owner), leaf, None)


def per_sample_vjp(
    call: Callable[[dict[str, Tensor], tuple], Any],
    params: dict[str, Tensor],
    batched: tuple,
    g: Any,
    what: str,
) -> dict[str, Tensor]:
    """Per-sample vector-Jacobian products w.r.t. ``params``.

    call: ``(params, samples) -> output``, with ``samples`` one sample of each tensor in
        ``batched`` (``None`` stays ``None``), batch axis removed; its output (a tensor
        or a tuple of them) matches ``g`` with the batch axis removed.
    batched: tensors ``[N, ...]`` or ``None``. g: tensor or tuple of tensors ``[N, ...]``.
    what: what is recomputed (``"module type 'Attention'"``), for the warning that says
        so where torch.func has no batching rule for one of its ops (:func:`_attributed`).
    Returns ``{name: [N, *params[name].shape]}``.
    """
    in_dims = tuple(None if t is None else 0 for t in batched)
    params = {k: v.detach() for k, v in params.items()}

    def one(samples: tuple, g_n):
        _, pull = vjp(lambda p: call(p, samples), params)
        return pull(g_n)[0]

    try:
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:  # no graph outside the transform
            warnings.simplefilter("always")
            out = vmap(one, in_dims=(in_dims, 0))(batched, g)
    except RuntimeError as err:
        if "random" not in str(err):
            raise
        raise RuntimeError(
            "its forward draws random numbers (dropout in training mode?), so the per-sample "
            "recomputation cannot reproduce it; put the random submodules in eval mode (or set "
            "their dropout to 0), or register a derivative with jacmem.register(...)"
        ) from err
    _attributed(caught, what)
    return out


#: torch.func's warning for an op it runs sample by sample, for want of a batching rule
_NO_BATCHING_RULE = re.compile(r"not yet implemented the batching rule for (\S+?)\.")
#: (what, op) already warned about, so that a long training run warns once
_WARNED: set[tuple[str, str]] = set()


def _attributed(caught: list, what: str) -> None:
    """Warnings raised inside a recomputation, passed on; torch.func's "performance drop"
    warnings become one naming what jacmem recomputed, the ops, and the fix (once per op)."""
    ops = []
    for w in caught:
        found = _NO_BATCHING_RULE.search(str(w.message))
        if found is None:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        elif (what, found[1]) not in _WARNED:
            _WARNED.add((what, found[1]))
            ops.append(found[1])
    if ops:
        warnings.warn(
            f"jacmem: {what} has no derivative of its own, so its per-sample gradients are recomputed with "
            f"torch.func, which has no batching rule for {', '.join(ops)} and runs it sample by sample (slow). "
            "Register a derivative for it (jacmem.register), or freeze its parameters.",
            RuntimeWarning,
            stacklevel=2,
        )


def track(t: Tensor) -> Tensor:
    """``t``, made part of the graph that a recomputation takes its gradients in."""
    return t if t.requires_grad else t.requires_grad_()


def _module_params(module: nn.Module, names: Sequence[str]) -> dict[str, Tensor]:
    return {n: _param(module, n) for n in names}


# -- the fallback ---------------------------------------------------------------------


def normalises_over_batch(module: nn.Module) -> bool:
    """Whether ``module`` or a submodule is a BatchNorm that uses batch statistics (in
    training mode, or without running statistics): there, the samples mix."""
    return any(
        isinstance(sub, nn.modules.batchnorm._BatchNorm) and (sub.training or sub.running_mean is None)
        for sub in module.modules()
    )


def _mixes_samples(module: nn.Module) -> bool:
    """Whether a recomputation one sample at a time could differ from the forward: some
    submodule holds buffers in training mode, or normalises with batch statistics."""
    held = any(sub.training and next(sub.buffers(recurse=False), None) is not None for sub in module.modules())
    return held or normalises_over_batch(module)


#: marks, among the kept arguments, the slot of a batched tensor
_BATCHED = object()


def _is_batched(leaf: Any, n: int | None) -> bool:
    return isinstance(leaf, Tensor) and leaf.dim() > 0 and leaf.shape[0] == n


def _keep_call(args: tuple, kwargs: dict):
    """Every argument: ``(batched tensors [N, ...], {"spec", "leaves"})``; the dict holds
    the call's structure and the arguments that all samples share (batched slots
    ``_BATCHED``)."""
    leaves, spec = compat.tree_flatten((args, kwargs))
    n = next((t.shape[0] for t in leaves if isinstance(t, Tensor) and t.dim() > 0), None)
    batched = tuple(t for t in leaves if _is_batched(t, n))
    shared = [_BATCHED if _is_batched(t, n) else t for t in leaves]
    return batched, {"spec": spec, "leaves": shared}


class _NarrowestDtype(torch.overrides.TorchFunctionMode):
    """Within it, ``dtype``: the narrowest floating dtype of the tensors the torch
    functions called returned (``None`` where none)."""

    dtype: torch.dtype | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in compat.tree_flatten(out)[0]:
            if isinstance(t, Tensor) and t.is_floating_point():
                self.dtype = _narrower(self.dtype, t.dtype)
        return out


def _narrower(a: torch.dtype | None, b: torch.dtype | None) -> torch.dtype | None:
    return b if a is None else a if b is None else max(a, b, key=lambda t: torch.finfo(t).eps)


def _float_leaves(output: Any) -> list:
    return [t for t in compat.tree_flatten(output)[0] if isinstance(t, Tensor) and t.is_floating_point()]


def _fallback_batch_grad(x, g, *, param: str, module: nn.Module, shared: SharedPass, axis: int) -> Tensor:
    """Per-sample gradients of one of ``module``'s own parameters, by recomputation:
    x = (batched args [N, ...], call structure), g: output gradient(s) [N, ...]
    -> [N, *param.shape]; the module takes each sample's batch of one on ``axis``."""
    return shared.take(param, x, g, partial(_fallback_all, module=module, axis=axis, shared=shared))


def _fallback_all(
    x, g, names: tuple[str, ...], *, module: nn.Module, axis: int, shared: SharedPass
) -> dict[str, Tensor]:
    batched, call = x
    gs = (g,) if isinstance(g, Tensor) else tuple(g)
    if batched and batched[0].shape[0] != gs[0].shape[0]:
        raise RuntimeError(
            f"its input's batch axis (axis 0, size {batched[0].shape[0]}) and its output's "
            f"(size {gs[0].shape[0]}) differ; the generic fallback needs the batch first in both. "
            "Register a derivative with jacmem.layer(..., keep=..., arrange=...) and jacmem.register(...)"
        )

    def run(params, samples):
        it = iter(samples)
        leaves = [next(it).unsqueeze(axis) if t is _BATCHED else t for t in call["leaves"]]
        args, kwargs = compat.tree_unflatten(leaves, call["spec"])
        with _NarrowestDtype() as seen:
            outs = _float_leaves(functional_call(module, params, args, kwargs))
        shared.note(seen.dtype)
        if len(outs) != len(gs):
            raise RuntimeError(
                f"it returns {len(outs)} floating-point tensors, of which {len(gs)} depend on its "
                "parameters; the generic fallback needs each to depend on them. Register a derivative "
                "with jacmem.register(...)"
            )
        return tuple(o.squeeze(axis) for o in outs)

    what = f"module type {type(module).__name__!r}"
    return per_sample_vjp(run, _module_params(module, names), batched, gs, what)


def numel(shapes: Any) -> int:
    """Total number of elements, from a shape or a (nested) tuple of shapes."""
    if isinstance(shapes, (tuple, list)):
        if all(isinstance(s, int) for s in shapes):
            return prod(shapes)
        return sum(numel(s) for s in shapes)
    return 0


def recompute_cost(xs, gs, **_) -> Cost:
    """Rough, for want of the module's arithmetic: a forward and a backward per sample,
    over the inputs and outputs; the workspace (what chunking divides) is a few copies
    of them."""
    size = numel(xs) + numel(gs)
    return Cost(flops=6 * size, workspace=4 * size)


_FALLBACKS: dict[tuple[type, tuple[str, ...]], LayerDerivatives] = {}


@registry.fallback
def fallback(module: nn.Module, batch_axis: int = 0) -> LayerDerivatives | None:
    """The generic entry for ``module``'s own parameters, for calls whose batch is on
    ``batch_axis`` (0 or 1) of their inputs and outputs; ``None`` where it has none, or
    where a recomputation one sample at a time could differ from its forward."""
    names = tuple(n for n, _ in registry.own_parameters(module))
    if not names or _mixes_samples(module):
        return None
    key = (type(module), names, batch_axis)
    if key not in _FALLBACKS:
        strategies = {
            (name, "batch_grad"): {
                VMAP: Strategy(
                    partial(_fallback_batch_grad, param=name, axis=batch_axis), shared_cost(recompute_cost, name)
                )
            }
            for name in names
        }
        _FALLBACKS[key] = LayerDerivatives(
            hyperparams=lambda m: dict(
                module=m, shared=SharedPass(trainable_sizes(m, [n for n, _ in registry.own_parameters(m)]))
            ),
            keep=_keep_call,
            outputs=_float_leaves,
            strategies=strategies,
            recomputed=True,
        )
    return _FALLBACKS[key]
