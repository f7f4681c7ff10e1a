"""The methods compared: ``prepare(method, model, X, y)`` returns a ``step()`` that runs
one forward+backward with the method and then drops what it produced, so that the
next step starts from the same memory.

Method names: ``plain``; ``floor`` (plain, then writing zeros into fresh tensors of the
per-sample gradients' size with PyTorch's default allocator: what returning them costs
by itself); ``jacmem:<Extension>:<strategy>``; ``backpack:<Extension>`` and
``backpack:BatchGrad:save_memory`` (BackPACK's conv mode of Rochette et al.);
``opacus:hooks``, ``opacus:ew`` (per-sample gradients), ``opacus:ghost`` (ghost-clipping
norms); ``torch.func``: ``vmap(grad)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

EXTENSIONS = ("BatchGrad", "BatchL2Grad", "SumGradSquared", "Variance")
#: the parameter attributes each family's results land in
_FIELDS = ("grad_batch", "batch_l2", "sum_grad_squared", "variance", "grad_sample", "_norm_sample")


def clear(model: nn.Module) -> None:
    """Drop the gradients and every family's per-sample results from ``model``'s parameters."""
    for p in model.parameters():
        p.grad = None
        for field in _FIELDS:
            if getattr(p, field, None) is not None:
                setattr(p, field, None)


def _plain(model, X, y, lossfunc):
    def step():
        lossfunc(model(X), y).backward()

    return step


def _floor(model, X, y, lossfunc):
    shapes = [(X.shape[0], *p.shape) for p in model.parameters() if p.requires_grad]

    def step():
        lossfunc(model(X), y).backward()
        for shape in shapes:
            torch.zeros(shape, dtype=X.dtype, device=X.device)

    return step


def _jacmem(model, X, y, lossfunc, extension: str, strategy: str, log: dict):
    import jacmem

    ext = getattr(jacmem, extension)()

    def step():
        with jacmem.extend(ext, strategy=strategy) as ctx:
            lossfunc(model(X), y).backward()
        log["explain"] = ctx.explain()

    return step


def _backpack(model, X, y, lossfunc, extension: str, save_memory: bool):
    from backpack import backpack, extend, extensions
    from backpack.core.derivatives.convnd import weight_jac_t_save_memory

    model, lossfunc = extend(model), extend(lossfunc)
    ext = getattr(extensions, extension)()

    def step():
        with weight_jac_t_save_memory(save_memory=save_memory), backpack(ext):
            lossfunc(model(X), y).backward()

    return step


def _opacus(model, X, y, lossfunc, mode: str):
    from opacus.grad_sample import (
        GradSampleModule,
        GradSampleModuleExpandedWeights,
        GradSampleModuleFastGradientClipping,
    )

    if mode == "hooks":
        wrapped = GradSampleModule(model, strict=False)
    elif mode == "ew":
        wrapped = GradSampleModuleExpandedWeights(model)
    else:
        wrapped = GradSampleModuleFastGradientClipping(model, strict=False, use_ghost_clipping=True)

    def step():
        lossfunc(wrapped(X), y).backward()
        if mode == "ghost":
            wrapped.get_norm_sample()

    return step


def _torch_func(model, X, y, lossfunc):
    from torch.func import functional_call, grad, vmap

    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    frozen = {k: p.detach() for k, p in model.named_parameters() if not p.requires_grad}
    buffers = dict(model.named_buffers())

    def loss_one(params: dict[str, Tensor], x: Tensor, t: Tensor) -> Tensor:
        out = functional_call(model, ({**params, **frozen}, buffers), (x.unsqueeze(0),))
        return lossfunc(out, t.unsqueeze(0))

    per_sample = vmap(grad(loss_one), in_dims=(None, 0, 0))

    def step():
        per_sample(params, X, y)

    return step


def prepare(method: str, model: nn.Module, X: Tensor, y: Tensor, log: dict) -> Callable[[], None]:
    """A ``step()`` for ``method`` on ``(model, X, y)``; ``log`` receives notes (auto's
    choices)."""
    lossfunc = nn.CrossEntropyLoss()
    family, *args = method.split(":")
    if family == "plain":
        inner = _plain(model, X, y, lossfunc)
    elif family == "floor":
        inner = _floor(model, X, y, lossfunc)
    elif family == "jacmem":
        inner = _jacmem(model, X, y, lossfunc, args[0], args[1], log)
    elif family == "backpack":
        inner = _backpack(model, X, y, lossfunc, args[0], save_memory=args[1:] == ["save_memory"])
    elif family == "opacus":
        inner = _opacus(model, X, y, lossfunc, args[0])
    elif family == "torch.func":
        inner = _torch_func(model, X, y, lossfunc)
    else:
        raise ValueError(f"unknown method {method!r}")

    def step():
        inner()
        clear(model)

    return step


def jacmem_strategies(model: nn.Module, extension: str) -> list[str]:
    """The strategy names worth comparing for ``extension`` on ``model``: those offered
    for the largest trainable parameter that jacmem supports, where it has a choice,
    plus ``auto``. Names that only change a summed ``grad`` are left out."""
    import jacmem
    from jacmem.derivatives import lookup

    quantities = [q for q in getattr(jacmem, extension).quantities if q != "grad"]
    best, names = -1, []
    for module in model.modules():
        entry = lookup(module)
        if entry is None:
            continue
        for pname, p in module.named_parameters(recurse=False):
            if not p.requires_grad or pname not in entry.params or p.numel() <= best:
                continue
            offered = set(entry.strategies[(pname, "batch_grad")])
            for q in quantities:
                offered |= set(entry.strategies.get((pname, q), {}))
            best, names = p.numel(), sorted(offered)
    return (names if len(names) > 1 else []) + ["auto"]


def methods_for(model: nn.Module, compare: Iterable[str] = EXTENSIONS) -> list[str]:
    """Every method name benchmarked on ``model``, plain first; jacmem with each
    strategy for the extensions in ``compare``, with ``auto`` alone for the others."""
    out = ["plain", "floor"]
    for ext in EXTENSIONS:
        out += [f"jacmem:{ext}:{s}" for s in (jacmem_strategies(model, ext) if ext in compare else ["auto"])]
    has_conv = any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    for ext in ("BatchGrad", "BatchL2Grad"):
        out += [f"backpack:{ext}"] + ([f"backpack:{ext}:save_memory"] if has_conv else [])
    out += ["opacus:hooks", "opacus:ew", "opacus:ghost", "torch.func"]
    return out


def expected_extra(method: str, per_sample_bytes: int, has_conv: bool) -> float:
    """A generous guess of a method's extra peak memory, to skip what would not fit:
    BackPACK's default conv mode holds every conv's unfolded input and Jacobian whole
    (about 15x the per-sample gradients on the seed CNN); the others stay under 3x."""
    family, *args = method.split(":")
    default_conv = family == "backpack" and has_conv and args[1:] != ["save_memory"]
    return 0.0 if method == "plain" else per_sample_bytes * (15 if default_conv else 3)


def per_sample_quantity(method: str) -> str:
    """What the method produces, for the report."""
    family, *args = method.split(":")
    if family in ("jacmem", "backpack"):
        return args[0]
    if method == "opacus:ghost":
        return "BatchL2Grad"
    return "none" if family in ("plain", "floor") else "BatchGrad"
