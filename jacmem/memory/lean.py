"""``lean(model)``: swap stock layers for subclasses that keep only what the current
``requires_grad`` pattern needs for the backward pass; ``unlean(model)`` swaps back.

The conversion changes each module's class in place (``module.__class__``): the
parameters, buffers, hooks, ``state_dict`` keys and everything else stay as they were,
so ``lean`` and ``unlean`` are free and round-trip exactly. Only modules of exactly a
stock type convert; subclasses of your own keep their ``forward``.

======================  ======================================================
stock                   lean
======================  ======================================================
Conv1d/2d/3d            with a frozen weight: no input (the stock op keeps it
ConvTranspose1d/2d/3d   whenever anything needs a gradient; reflect or replicate
                        padding still keeps it, in F.pad's backward); with a
                        trainable weight the stock op itself
BatchNorm1d/2d/3d       in eval mode with a frozen weight: no input; otherwise
                        the stock op (it keeps no more than it needs then)
ReLU                    a 1-bit mask instead of the float output, unless a
                        lean layer reading the output keeps it anyway
Dropout                 the RNG seed instead of the mask
MaxPool1d/2d/3d         the argmax's offset in its window (1 byte up to 256
                        window elements), not the input nor int64 indices
LayerNorm, RMSNorm      where a lean layer reading the output keeps it (a
                        trainable Linear, a LoRA down-projection): that output
                        and a rstd per row, not the input (x̂ = (y - b) / w;
                        a zero weight entry runs the stock op); RMSNorm
                        otherwise its input and rstd (stock: input and x̂)
GELU, SiLU              the stock op (it keeps its input), telling a lean
                        Linear that reads its output how to recompute it
Linear                  the stock op (a frozen weight keeps no input already);
                        after a lean GELU/SiLU with a trainable weight, no
                        copy of the activation's output: it keeps the
                        activation's input, which the activation keeps anyway
(HF attention)          transformers models using "sdpa" or "eager" attention
                        switch to jacmem's (config._attn_implementation): with
                        dropout, q, k, v, the row log-sum-exp and a seed, not
                        the softmax, the mask and the dropped softmax
======================  ======================================================

Frozen ``nn.Embedding`` and frozen ``nn.Linear`` keep nothing of their input in stock
PyTorch already (tests/memory/test_transformer.py checks it); a LoRA adapter (frozen
Linear + trainable low-rank pair) then keeps only its down-projection's input, which
a lean norm before it shares.

torch.compile: inside a compiled region every lean layer runs its stock ``forward``, so
a lean model compiles with the graph breaks of the stock one (none, for these layers).
What is kept is then decided by the compiler: AOTAutograd partitions the joint
forward/backward graph itself, saving some tensors and recomputing cheap elementwise
ops, and it would re-decide whatever a lean layer chose. The lean Functions cannot be
traced as they are: ReLU's mask loop is a ctypes call, dropout draws its seed as a
Python int, and a norm checks its weight for zeros (a data-dependent branch); each is a
graph break (``torch._dynamo.explain`` lists them). Lean layers save
memory in eager mode.

Where the stock op keeps nothing more than the gradients asked for need, the lean
layer calls it, so it costs no time: a Python ``autograd.Function`` (with its
overhead) runs only where it keeps less.

Each lean type declares the stock type it stands for (``stands_for = nn.Conv2d``), so
jacmem's derivatives of the stock layer serve it (:func:`jacmem.derivatives.registered_type`):
``jacmem.extend`` computes per-sample quantities and curvature on lean layers, and a
frozen lean layer keeps nothing at all. Nothing is registered for the lean types.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from jacmem import compat
from jacmem.memory.functions import (
    BatchNormEvalFunction,
    ConvFunction,
    DropoutFunction,
    MaxPoolFunction,
    ReLUFunction,
)
from jacmem.memory.transformer import LinearOfActFunction, NormFunction, hf_attention


def _same_totals(module: nn.modules.conv._ConvNd) -> list:
    """The total padding per axis of ``padding="same"`` (an odd total: one more pixel right)."""
    return [dil * (k - 1) for dil, k in zip(module.dilation, module.kernel_size)]


def _explicit_padding(module: nn.modules.conv._ConvNd, x: Tensor):
    """(x, padding as ints): pads x first where the stock layer does (non-zero
    ``padding_mode``, or ``padding="same"`` with an odd total, the odd pixel right)."""
    d = len(module.kernel_size)
    if module.padding_mode != "zeros":
        return F.pad(x, module._reversed_padding_repeated_twice, mode=module.padding_mode), (0,) * d
    if not isinstance(module.padding, str):
        return x, tuple(module.padding)
    if module.padding == "valid":
        return x, (0,) * d
    totals = _same_totals(module)
    odd = [side for t in reversed(totals) for side in (0, t % 2)]
    if any(odd):
        x = F.pad(x, odd)
    return x, tuple(t // 2 for t in totals)


# -- ReLU and the layers that read its output ----------------------------------------

#: the attribute a lean ReLU's output carries, for the lean layers that read it: (the ReLU
#: module, the output's version counter then; an output changed in place since is not its)
_PRODUCER = "_jacmem_relu"
#: lean ReLU -> the lean layers that read its output in its forward passes so far (weak both ways)
_READERS: weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet] = weakref.WeakKeyDictionary()


def _read(reader: nn.Module, input: Tensor) -> None:
    """Note that ``reader`` reads ``input``, if a lean ReLU made it."""
    tag = getattr(input, _PRODUCER, None)
    if tag is not None and tag[1] == compat.tensor_version(input):
        relu = tag[0]
        readers = _READERS.get(relu)
        if readers is None:
            readers = _READERS[relu] = weakref.WeakSet()
        readers.add(reader)


def _frozen_weight_needs_lean(weight: Tensor | None, bias: Tensor | None, input: Tensor) -> bool:
    """Whether the stock op would keep its input for nothing: a gradient is recorded,
    but not the weight's. (With a trainable weight, the stock op keeps what the
    weight's gradient needs and no more; with nothing to differentiate, nothing.)"""
    if not torch.is_grad_enabled() or (weight is not None and weight.requires_grad):
        return False
    return input.requires_grad or (bias is not None and bias.requires_grad)


class _LeanConvNd:
    """Mixin for Conv1d/2d/3d: the stock forward, through :class:`ConvFunction` where
    the weight is frozen."""

    def _keeps_input(self) -> bool:
        """Whether this layer keeps its very input tensor for the backward pass (when the
        input needs a gradient): reflect and replicate padding keep it for their backward
        (whatever the weight); a trainable weight keeps it, unless it reads a padded copy
        (circular padding, or an odd ``padding="same"``)."""
        if self.padding_mode in ("reflect", "replicate"):
            return True
        if not self.weight.requires_grad or self.padding_mode != "zeros":
            return False
        return self.padding != "same" or not any(t % 2 for t in _same_totals(self))

    def forward(self, input: Tensor) -> Tensor:
        if torch.compiler.is_compiling():  # see "torch.compile" in the module docstring
            return super().forward(input)
        _read(self, input)
        if not _frozen_weight_needs_lean(self.weight, self.bias, input):
            return super().forward(input)
        d = len(self.kernel_size)
        unbatched = input.dim() == d + 1
        x, padding = _explicit_padding(self, input.unsqueeze(0) if unbatched else input)
        out = ConvFunction.apply(
            x, self.weight, self.bias, self.stride, padding, self.dilation, False, (0,) * d, self.groups
        )
        return out.squeeze(0) if unbatched else out


class _LeanConvTransposeNd:
    """Mixin for ConvTranspose1d/2d/3d: the stock forward, through :class:`ConvFunction`
    where the weight is frozen."""

    def _keeps_input(self) -> bool:
        return self.weight.requires_grad

    def forward(self, input: Tensor, output_size: list | None = None) -> Tensor:
        if torch.compiler.is_compiling():  # see "torch.compile" in the module docstring
            return super().forward(input, output_size)
        _read(self, input)
        if not _frozen_weight_needs_lean(self.weight, self.bias, input):
            return super().forward(input, output_size)
        if self.padding_mode != "zeros":
            raise ValueError(f"Only `zeros` padding mode is supported for {type(self).__name__}")
        d = len(self.kernel_size)
        output_padding = self._output_padding(
            input, output_size, self.stride, self.padding, self.kernel_size, d, self.dilation
        )
        unbatched = input.dim() == d + 1
        out = ConvFunction.apply(
            input.unsqueeze(0) if unbatched else input,
            self.weight,
            self.bias,
            self.stride,
            self.padding,
            self.dilation,
            True,
            output_padding,
            self.groups,
        )
        return out.squeeze(0) if unbatched else out


class _LeanBatchNorm:
    """Mixin for BatchNorm1d/2d/3d: eval mode with running statistics and a frozen (or
    no) weight through :class:`BatchNormEvalFunction`; otherwise the stock forward."""

    def _eval_stats(self) -> bool:
        return not self.training and self.running_mean is not None

    def _keeps_input(self) -> bool:
        # with batch statistics the stock op keeps its input for the input's gradient too
        return not self._eval_stats() or (self.weight is not None and self.weight.requires_grad)

    def forward(self, input: Tensor) -> Tensor:
        if torch.compiler.is_compiling():  # see "torch.compile" in the module docstring
            return super().forward(input)
        _read(self, input)
        if not (self._eval_stats() and _frozen_weight_needs_lean(self.weight, self.bias, input)):
            return super().forward(input)
        self._check_input_dim(input)
        return BatchNormEvalFunction.apply(input, self.running_mean, self.running_var, self.weight, self.bias, self.eps)


class LeanReLU(nn.ReLU):
    """nn.ReLU keeping a 1-bit mask, unless a layer that reads its output keeps that
    output anyway (a conv with a trainable weight, say): then it keeps the output as
    the stock layer does, which costs no memory and no time.

    The readers are the lean layers this module's output went to in its forward
    passes so far (the first pass keeps the mask); whether they keep their input is
    asked at each forward, so the current ``requires_grad`` pattern decides. A module
    called at several places decides once for all of them: any reader that keeps its
    input makes it keep its output everywhere. Readers that are not lean layers (an
    ``nn.Linear``, a functional op, a view of the output) are not seen: the mask is
    kept for them, which costs at most the mask (1/32 of a float32 output) more than
    stock, where such a reader keeps the output.
    """

    stands_for = nn.ReLU

    def forward(self, input: Tensor) -> Tensor:
        if torch.compiler.is_compiling():  # see "torch.compile" in the module docstring
            return super().forward(input)
        if not (torch.is_grad_enabled() and input.requires_grad):
            return super().forward(input)
        readers = _READERS.get(self)
        if readers is not None and any(r._keeps_input() for r in readers):
            out = super().forward(input)
        else:
            out = ReLUFunction.apply(input, self.inplace)
        setattr(out, _PRODUCER, (self, compat.tensor_version(out)))
        return out


class LeanDropout(nn.Dropout):
    """nn.Dropout keeping the seed of its mask (in training, for ``0 < p < 1``; otherwise
    the stock layer keeps nothing)."""

    stands_for = nn.Dropout

    def _keeps_input(self) -> bool:
        return False

    def forward(self, input: Tensor) -> Tensor:
        if torch.compiler.is_compiling():  # see "torch.compile" in the module docstring
            return super().forward(input)
        _read(self, input)
        if not (self.training and 0 < self.p < 1):
            return super().forward(input)
        return DropoutFunction.apply(input, self.p, self.inplace)


class _LeanMaxPoolNd:
    """Mixin for MaxPool1d/2d/3d: keeps the argmax offsets only (see :class:`MaxPoolFunction`)."""

    _dims: int

    def _keeps_input(self) -> bool:
        return False

    def forward(self, input: Tensor):
        if torch.compiler.is_compiling():  # see "torch.compile" in the module docstring
            return super().forward(input)
        _read(self, input)
        out, idx = MaxPoolFunction.apply(
            input, self._dims, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode
        )
        return (out, idx) if self.return_indices else out


# -- transformer layers ----------------------------------------------------------------

#: the attribute a lean GELU/SiLU output carries, for a lean Linear that reads it: (the
#: activation's input, the activation as a function, the input's and the output's version
#: counters then)
_ACTIVATION = "_jacmem_activation"


def _readers_keep(producer: nn.Module) -> bool:
    """Whether any lean layer that read ``producer``'s output so far keeps it."""
    readers = _READERS.get(producer)
    return readers is not None and any(r._keeps_input() for r in readers)


class _LeanNorm:
    """Mixin for LayerNorm and RMSNorm: where a lean layer reading the output keeps it
    anyway (a Linear with a trainable weight, a LoRA adapter's down-projection), keeps
    that output and the per-row rstd instead of the input (:class:`NormFunction`
    rebuilds ``x̂ = (y - b) / w``; a weight with a zero entry runs the stock layer).
    RMSNorm otherwise keeps its input and rstd (stock's composite keeps the input and the
    normalised input). LayerNorm otherwise runs the stock op (input, mean, rstd)."""

    _rms: bool

    def _keeps_input(self) -> bool:
        return True  # the stock op keeps it, and so may this one (a ReLU before it keeps its output)

    def forward(self, input: Tensor) -> Tensor:
        if torch.compiler.is_compiling():  # see "torch.compile" in the module docstring
            return super().forward(input)
        _read(self, input)
        params = [p for p in (self.weight, getattr(self, "bias", None)) if p is not None]
        if not (torch.is_grad_enabled() and (input.requires_grad or any(p.requires_grad for p in params))):
            return super().forward(input)
        if input.dtype not in (torch.float32, torch.float64) or any(p.dtype != input.dtype for p in params):
            return super().forward(input)
        shared = _readers_keep(self) and (self.weight is None or not bool((self.weight == 0).any()))
        if shared or self._rms:
            d = len(self.normalized_shape)
            if tuple(input.shape[-d:]) != tuple(self.normalized_shape):
                return super().forward(input)  # let the stock layer raise its error
            eps = self.eps if self.eps is not None else torch.finfo(input.dtype).eps
            bias = getattr(self, "bias", None)
            out = NormFunction.apply(input, self.weight, bias, d, eps, self._rms, "output" if shared else "input")
        else:
            out = super().forward(input)
        setattr(out, _PRODUCER, (self, compat.tensor_version(out)))
        return out


class _LeanActivation:
    """Mixin for GELU and SiLU: the stock op (it keeps its input), whose output tells a
    lean Linear that reads it how to recompute it from that input, so that the Linear
    keeps no copy of it (:class:`LinearOfActFunction`)."""

    def _keeps_input(self) -> bool:
        return True

    def _function(self):
        if isinstance(self, nn.GELU):
            return functools.partial(F.gelu, approximate=self.approximate)
        return F.silu

    def forward(self, input: Tensor) -> Tensor:
        if torch.compiler.is_compiling():  # see "torch.compile" in the module docstring
            return super().forward(input)
        _read(self, input)
        out = super().forward(input)
        if torch.is_grad_enabled() and input.requires_grad and out is not input:
            setattr(
                out, _ACTIVATION, (input, self._function(), compat.tensor_version(input), compat.tensor_version(out))
            )
        return out


class _LeanLinear:
    """Mixin for Linear: the stock op (with a frozen weight it keeps no input already),
    except after a lean GELU or SiLU with a trainable weight: then it keeps the
    activation's input (which the activation keeps anyway) instead of its output, and
    recomputes the activation for the weight's gradient."""

    def _keeps_input(self) -> bool:
        return self.weight.requires_grad

    def forward(self, input: Tensor) -> Tensor:
        if torch.compiler.is_compiling():  # see "torch.compile" in the module docstring
            return super().forward(input)
        _read(self, input)
        tag = getattr(input, _ACTIVATION, None)
        if tag is not None and self.weight.requires_grad and torch.is_grad_enabled():
            pre, function, pre_version, version = tag
            if compat.tensor_version(pre) == pre_version and compat.tensor_version(input) == version:
                return LinearOfActFunction.apply(input, pre.detach(), function, self.weight, self.bias)
        return super().forward(input)


def _lean_type(base: type, mixin: type, **attrs) -> type:
    name = "Lean" + base.__name__
    doc = f"``nn.{base.__name__}`` that keeps only what the gradients asked for need; see :mod:`jacmem.memory.lean`."
    return type(name, (mixin, base), {"__doc__": doc, "__module__": __name__, "stands_for": base, **attrs})


LeanConv1d = _lean_type(nn.Conv1d, _LeanConvNd)
LeanConv2d = _lean_type(nn.Conv2d, _LeanConvNd)
LeanConv3d = _lean_type(nn.Conv3d, _LeanConvNd)
LeanConvTranspose1d = _lean_type(nn.ConvTranspose1d, _LeanConvTransposeNd)
LeanConvTranspose2d = _lean_type(nn.ConvTranspose2d, _LeanConvTransposeNd)
LeanConvTranspose3d = _lean_type(nn.ConvTranspose3d, _LeanConvTransposeNd)
LeanBatchNorm1d = _lean_type(nn.BatchNorm1d, _LeanBatchNorm)
LeanBatchNorm2d = _lean_type(nn.BatchNorm2d, _LeanBatchNorm)
LeanBatchNorm3d = _lean_type(nn.BatchNorm3d, _LeanBatchNorm)
LeanMaxPool1d = _lean_type(nn.MaxPool1d, _LeanMaxPoolNd, _dims=1)
LeanMaxPool2d = _lean_type(nn.MaxPool2d, _LeanMaxPoolNd, _dims=2)
LeanMaxPool3d = _lean_type(nn.MaxPool3d, _LeanMaxPoolNd, _dims=3)
LeanLayerNorm = _lean_type(nn.LayerNorm, _LeanNorm, _rms=False)
LeanRMSNorm = _lean_type(nn.RMSNorm, _LeanNorm, _rms=True)
LeanGELU = _lean_type(nn.GELU, _LeanActivation)
LeanSiLU = _lean_type(nn.SiLU, _LeanActivation)
LeanLinear = _lean_type(nn.Linear, _LeanLinear)

#: stock type -> lean type
LEAN: dict[type, type] = {
    lean_type.stands_for: lean_type
    for lean_type in (
        LeanConv1d,
        LeanConv2d,
        LeanConv3d,
        LeanConvTranspose1d,
        LeanConvTranspose2d,
        LeanConvTranspose3d,
        LeanBatchNorm1d,
        LeanBatchNorm2d,
        LeanBatchNorm3d,
        LeanReLU,
        LeanDropout,
        LeanMaxPool1d,
        LeanMaxPool2d,
        LeanMaxPool3d,
        LeanLayerNorm,
        LeanRMSNorm,
        LeanGELU,
        LeanSiLU,
        LeanLinear,
    )
}
STOCK: dict[type, type] = {lean_type: stock for stock, lean_type in LEAN.items()}


def lean(model: nn.Module, types: Iterable[type] | None = None) -> nn.Module:
    """Convert, in place, every module of ``model`` (itself included) whose type is a
    stock type in :data:`LEAN` (or in ``types``, a subset of it) to its lean version.
    Returns ``model``.

    Outputs and gradients are those of the stock layers; what is kept for the
    backward pass depends on ``requires_grad`` when the forward runs, so freezing
    after ``lean`` works. Double backward through lean layers is not supported.

    The ReLU mask costs time (packing in forward, unpacking in backward) and saves
    memory only where nothing else keeps the ReLU's output. A lean ReLU keeps its
    output instead where a lean layer that reads it keeps it anyway (a conv with a
    trainable weight, say; see :class:`LeanReLU`); a stock reader such as a trainable
    ``nn.Linear`` also keeps it, but is not seen. ``report`` tells which case you are
    in; ``types=`` leaves ReLU out where it does not pay.
    """
    wanted = set(LEAN) if types is None else set(types)
    unknown = wanted - set(LEAN)
    if unknown:
        raise ValueError(
            f"lean has no version of {sorted(t.__name__ for t in unknown)}; it converts "
            f"{', '.join(t.__name__ for t in LEAN)}"
        )
    for module in model.modules():
        if type(module) in wanted:
            module.__class__ = LEAN[type(module)]
    if types is None:
        _hf_attention(model, lean=True)
    return model


#: the name jacmem's attention has in transformers' attention registry
HF_ATTENTION = "jacmem_lean"


def _hf_attention(model: nn.Module, lean: bool) -> None:
    """transformers models choose their attention by ``config._attn_implementation``:
    ``lean`` switches "sdpa" and "eager" to :func:`jacmem.memory.transformer.hf_attention`
    (registered as ``HF_ATTENTION``), ``unlean`` switches back."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    for config in configs.values():
        current = getattr(config, "_attn_implementation", None)
        if lean and current in ("sdpa", "eager"):
            from transformers import AttentionInterface

            AttentionInterface.register(HF_ATTENTION, hf_attention)
            config._jacmem_attention = current
            config._attn_implementation = HF_ATTENTION
        elif not lean and current == HF_ATTENTION:
            config._attn_implementation = config.__dict__.pop("_jacmem_attention", "sdpa")


def unlean(model: nn.Module) -> nn.Module:
    """Undo :func:`lean` in place. Returns ``model``."""
    for module in model.modules():
        stock = STOCK.get(type(module))
        if stock is not None:
            module.__class__ = stock
    _hf_attention(model, lean=False)
    return model
