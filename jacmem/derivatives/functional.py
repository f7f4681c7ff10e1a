"""Functional operations as second-order extensions see them: each stands for a module.

Inside a block with second-order extensions, the engine sees the calls of the functions
in :data:`FUNCTIONAL` made outside any module it knows (``F.relu(x)``, ``torch.flatten(x,
1)``, ``out += identity``, ``F.cross_entropy(logits, y)``), and makes each a link of the
chain with the derivatives of its module equivalent. An entry is ``build(out, *args,
**kwargs) -> (module, inputs)``: the stand-in module (whose registered derivatives cross
it) and the call's tensor inputs, in the stand-in's order; or ``None`` where the call is
in a form the chain cannot follow (a broadcast sum, a product of two tensors, a reshape
that mixes samples), which the chain check then reports with the op's ``grad_fn``.
In-place forms (``relu_``, ``add_``, ``x += y``) stand for the same modules; the engine
reads their input's place in the graph before the call.

Reshapes that merge the batch axis with the next ones (``logits.view(-1, V)`` before a
loss, as HuggingFace's causal-LM loss does) return :class:`Merged`: not a link, but a
note that a loss on it is a loss on the unmerged tensor. A loss with ``reduction="none"``
is one where its whole sum or mean is taken (:class:`Reduced`). Both give a
:class:`StandInLoss`.

Where the GGN splits: the model's output is the input of the recognised loss (a loss
module, or a loss function of this table), unmerged where it was merged.

:class:`Sum` and :class:`Scale`, what ``x + y`` and ``x * c`` stand for, are public as
:class:`jacmem.nn.Sum` and :class:`jacmem.nn.Scale`.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod, sqrt

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from jacmem.derivatives.registry import LossHessian, lookup_loss, loss, passthrough
from jacmem.derivatives.shape import flatten_jac_t


@dataclass
class Reduced:
    """``out`` is ``x.sum()`` (``mean=False``) or ``x.mean()``: where ``x`` is a loss with
    ``reduction="none"``, the loss."""

    x: Tensor
    mean: bool


@dataclass
class Merged:
    """``out`` is ``x`` with its first ``k`` axes merged into one (``[N, T, *F] -> [N·T, *F]``)."""

    x: Tensor
    k: int


class Sum(nn.Module):
    """``Sum()(x_1, ..., x_k) = x_1 + ... + x_k``, inputs of one shape (BackPACK's
    ``SumModule``)."""

    __module__ = "jacmem.nn"  # its public name, re-exported there

    def forward(self, *xs: Tensor) -> Tensor:
        if not xs or any(x.shape != xs[0].shape for x in xs):
            raise ValueError(f"jacmem.nn.Sum needs inputs of one shape, got {[tuple(x.shape) for x in xs]}")
        out = xs[0]
        for x in xs[1:]:
            out = out + x
        return out if len(xs) > 1 else out.clone()


class Scale(nn.Module):
    """``Scale(w)(x) = w * x`` for a constant ``w`` (BackPACK's ``ScaleModule``)."""

    __module__ = "jacmem.nn"

    def __init__(self, weight: float = 1.0):
        super().__init__()
        self.weight = weight

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight

    def extra_repr(self) -> str:
        return f"weight={self.weight}"


def _sum_jac_t(xs, out, S: Tensor):
    """Every input gets the output's factor: [V, N, *] -> one [V, N, *] per input."""
    return tuple(S for _ in xs)


def _scale_df(x: Tensor, out: Tensor, *, weight: float) -> Tensor:
    return x.new_full((), weight).expand_as(x)


passthrough(Sum, jac_t=_sum_jac_t, sample_independent=True)
passthrough(Scale, df=_scale_df, hyperparams=lambda m: {"weight": m.weight})


class Reshape(nn.Module):
    """A reshape that keeps the batch axis (a stand-in: only its derivatives are used)."""


class GetItem(nn.Module):
    """``x[index]`` for an index that keeps the batch axis whole (slices, integers,
    ``None``, ``...`` past it)."""

    def __init__(self, index):
        super().__init__()
        self.index = index

    def forward(self, x: Tensor) -> Tensor:
        return x[self.index]


class StandInLoss(nn.Module):
    """``scale · inner(x.flatten(0, k - 1), y.flatten(0, k - 1))`` on ``x [N, *T, *F]``:
    a loss on ``x`` with its first ``k`` axes merged (:class:`Merged`), and reduced
    afterwards where ``inner`` reduced nothing (``reduction="none"``, then ``.sum()`` or
    ``.mean()``: ``inner`` sums, ``scale`` is ``1/numel`` for the mean). For a
    class-index loss (cross-entropy) the classes are axis ``k`` of ``x``. Each sample
    ``n`` is one row of ``x``: its loss is the sum over its ``T`` positions, and the
    loss Hessian is per sample again."""

    def __init__(self, inner: nn.Module, k: int = 1, scale: float = 1.0):
        super().__init__()
        self.inner, self.k, self.scale = inner, k, scale

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return self.scale * self.inner(x.flatten(0, self.k - 1), y.flatten(0, self.k - 1))


def _stand_in_hp(module: StandInLoss) -> dict:
    entry = lookup_loss(module.inner)
    hp = entry.params(module.inner)
    del hp["forward"]
    classes = isinstance(module.inner, nn.CrossEntropyLoss)
    return {"entry": entry, "inner": hp, "k": module.k, "classes": classes, "scale": module.scale}


def _unmerge(x: Tensor, y: Tensor, k: int, classes: bool) -> tuple[Tensor, Tensor]:
    """``x [N, *T, C, *D]`` (classes at axis ``k``) -> ``[N, C, *T, *D]``, and ``y`` alike."""
    if not classes:
        return x, y.reshape(x.shape)
    if y.is_floating_point():
        return x.movedim(k, 1), y.reshape(x.shape).movedim(k, 1)
    return x.movedim(k, 1), y.reshape(x.shape[:k] + x.shape[k + 1 :])


def _stand_in_sqrt_hessian(x: Tensor, y: Tensor, *, entry, inner: dict, k: int, classes: bool, scale: float):
    """[N, *T, C, *D] -> [V, N, *T, C, *D]"""
    S = entry.sqrt_hessian(*_unmerge(x, y, k, classes), **inner) * sqrt(scale)
    return S.movedim(2, k + 1) if classes else S


def _stand_in_sampled(x: Tensor, y: Tensor, mc: int, *, entry, inner: dict, k: int, classes: bool, scale: float):
    """[N, *T, C, *D] -> [M, N, *T, C, *D]"""
    S = entry.sampled(*_unmerge(x, y, k, classes), mc, **inner) * sqrt(scale)
    return S.movedim(2, k + 1) if classes else S


def _stand_in_empirical(x: Tensor, y: Tensor, *, entry, inner: dict, k: int, classes: bool, scale: float):
    """[N, *T, C, *D] -> [1, N, *T, C, *D]"""
    S = entry.empirical(*_unmerge(x, y, k, classes), **inner) * sqrt(scale)
    return S.movedim(2, k + 1) if classes else S


class Cast(nn.Module):
    """A change of floating-point dtype (``logits.float()``; a stand-in)."""


def _cast_jac_t(xs, out, S: Tensor):
    """[V, N, *] in the output's dtype -> in the input's"""
    return (S.to(xs[0].dtype),)


loss(
    StandInLoss,
    LossHessian(lambda m: None, _stand_in_sqrt_hessian, _stand_in_sampled, _stand_in_hp, _stand_in_empirical),
)
passthrough(Reshape, jac_t=flatten_jac_t, sample_independent=True)
passthrough(GetItem, sample_independent=True)
passthrough(Cast, jac_t=_cast_jac_t, sample_independent=True, keep_input=False)

# -- the table -----------------------------------------------------------------------

_RELU, _TANH, _SIGMOID, _SILU = nn.ReLU(), nn.Tanh(), nn.Sigmoid(), nn.SiLU()
_RESHAPE, _SUM, _CAST, _IDENTITY = Reshape(), Sum(), Cast(), nn.Identity()


def _unary(module: nn.Module):
    def build(out, input, *args, **kwargs):
        return module, (input,)

    return build


def _gelu(out, input, approximate="none"):
    return nn.GELU(approximate), (input,)


def _dropout(out, input, p=0.5, training=True, inplace=False):
    module = nn.Dropout(p)
    module.train(training)
    return module, (input,)


def _reshape(out, input, *args, **kwargs):
    """Keeps the batch axis: a link; merges it with the next ones: :class:`Merged`."""
    if input.dim() == 0 or out.dim() == 0 or out.dtype != input.dtype:
        return None
    if out.shape[0] == input.shape[0]:
        return _RESHAPE, (input,)
    for k in range(2, input.dim() + 1):
        if out.shape[0] == prod(input.shape[:k]) and out.shape[1:] == input.shape[k:]:
            return Merged(input, k)
    return None


def _cast(out, input, *args, **kwargs):
    """Floating point to floating point, nothing else changed: a link."""
    same = out.shape == input.shape and out.device == input.device and out is not input
    return (_CAST, (input,)) if same and out.is_floating_point() and input.is_floating_point() else None


def _add(out, input, other, *, alpha=1, **kwargs):
    """Two tensors of one shape: :class:`jacmem.nn.Sum`; a number: the identity."""
    if isinstance(other, Tensor) and other.shape == input.shape == out.shape and alpha == 1:
        return _SUM, (input, other)
    return (_IDENTITY, (input,)) if _number(other) else None


def _number(c) -> bool:
    return isinstance(c, (int, float)) and not isinstance(c, bool)


def _mul(out, input, other):
    """By a number: :class:`jacmem.nn.Scale`; by a tensor: not followed."""
    if _number(other):
        return Scale(float(other)), (input,)
    return (Scale(float(input)), (other,)) if _number(input) else None


def _div(out, input, other, *, rounding_mode=None):
    return _mul(out, input, 1 / other) if _number(other) and rounding_mode is None else None


def _getitem(out, input, index):
    """Slices, integers, ``None`` past the batch axis (which ``...`` or ``:`` keeps)."""
    index = index if isinstance(index, tuple) else (index,)
    if not all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in index):
        return None
    named = [i for i in index if i is not None]
    ellipsis_first = named and named[0] is Ellipsis and len(named) - 1 < input.dim()
    whole_first = named and isinstance(named[0], slice) and named[0] == slice(None) and index[0] is not None
    return (GetItem(index), (input,)) if ellipsis_first or whole_first else None


def _adaptive_avg_pool2d(out, input, output_size):
    return nn.AdaptiveAvgPool2d(output_size), (input,)


def _max_pool2d(out, input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
    if return_indices:
        return None
    return nn.MaxPool2d(kernel_size, stride, padding, dilation, ceil_mode=ceil_mode), (input,)


def _avg_pool2d(out, input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True, **kw):
    return nn.AvgPool2d(kernel_size, stride, padding, ceil_mode, count_include_pad, **kw), (input,)


def _reduction(size_average, reduce, reduction: str) -> str:
    """The ``reduction`` that torch's deprecated ``size_average`` and ``reduce`` mean
    (each True when None): no reduce is ``none``, else size_average is ``mean``."""
    if size_average is None and reduce is None:
        return reduction
    if reduce is False:
        return "none"
    return "sum" if size_average is False else "mean"


def _cross_entropy(
    out, input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean", **kw
):
    reduction = _reduction(size_average, reduce, reduction)
    return nn.CrossEntropyLoss(weight, ignore_index=ignore_index, reduction=reduction, **kw), (input, target)


def _mse_loss(out, input, target, size_average=None, reduce=None, reduction="mean", weight=None):
    if weight is not None:
        return None
    return nn.MSELoss(reduction=_reduction(size_average, reduce, reduction)), (input, target)


def _bce_with_logits(
    out, input, target, weight=None, size_average=None, reduce=None, reduction="mean", pos_weight=None
):
    reduction = _reduction(size_average, reduce, reduction)
    return nn.BCEWithLogitsLoss(weight, reduction=reduction, pos_weight=pos_weight), (input, target)


def _sum(out, input, *args, **kwargs):
    return Reduced(input, mean=False) if not args and not kwargs else None


def _mean(out, input, *args, **kwargs):
    return Reduced(input, mean=True) if not args and not kwargs else None


#: function -> ``build(out, *args, **kwargs)``: (stand-in module, tensor inputs), a
#: :class:`Merged` or :class:`Reduced`, or ``None`` (not followed)
FUNCTIONAL = {
    **dict.fromkeys((F.relu, torch.relu, torch.relu_, Tensor.relu, Tensor.relu_), _unary(_RELU)),
    **dict.fromkeys((torch.tanh, Tensor.tanh, F.tanh), _unary(_TANH)),
    **dict.fromkeys((torch.sigmoid, Tensor.sigmoid, F.sigmoid), _unary(_SIGMOID)),
    F.silu: _unary(_SILU),
    F.gelu: _gelu,
    F.dropout: _dropout,
    **dict.fromkeys((torch.flatten, Tensor.flatten, Tensor.view, Tensor.reshape, torch.reshape), _reshape),
    **dict.fromkeys((torch.add, Tensor.add, Tensor.add_, Tensor.__add__, Tensor.__iadd__), _add),
    **dict.fromkeys((torch.mul, Tensor.mul, Tensor.__mul__, Tensor.__rmul__), _mul),
    **dict.fromkeys((torch.div, Tensor.div, Tensor.__truediv__), _div),
    Tensor.__getitem__: _getitem,
    **dict.fromkeys((Tensor.float, Tensor.double, Tensor.to), _cast),
    F.adaptive_avg_pool2d: _adaptive_avg_pool2d,
    F.max_pool2d: _max_pool2d,
    F.avg_pool2d: _avg_pool2d,
    F.cross_entropy: _cross_entropy,
    F.mse_loss: _mse_loss,
    F.binary_cross_entropy_with_logits: _bce_with_logits,
    **dict.fromkeys((torch.sum, Tensor.sum), _sum),
    **dict.fromkeys((torch.mean, Tensor.mean), _mean),
}
