"""Clipped per-sample gradients in the one backward pass: :class:`ClipGrad`, for DP-SGD.

Inside ``with jacmem.extend(jacmem.ClipGrad(max_norm)):``, ``loss.backward()`` adds to
each trainable parameter's ``.grad`` the sum over the samples of their clipped
gradients, ``Σ_i c_i g_i``, and nothing else: autograd's own (unclipped) gradient never
reaches ``.grad``. The engine that does it is :mod:`jacmem.engine.clipping`; the
clipping math is here.

``g_i`` is the gradient of sample ``i``'s own loss term: with ``loss_reduction="mean"``
(the batch loss is the mean of the terms, as ``F.cross_entropy`` reduces by default),
the gradient of the reduced loss times the batch size ``N``, as in Opacus; with
``"sum"``, as it is. The clip factors (``‖·‖`` the Euclidean norm, taken in float32 at
least):

- ``"flat"``: ``c_i = min(1, C / (‖g_i‖ + 1e-6))``, ``‖g_i‖`` over every trainable
  parameter the block computes (Opacus's flat clipping);
- ``"per_layer"``: each parameter ``p`` by its own threshold,
  ``c_ip = min(1, C_p / (‖g_ip‖ + 1e-6))``; ``max_norm`` is a dict ``{param: C_p}``, or a
  list with one threshold per trainable parameter of the model, in ``model.parameters()``
  order (as Opacus's ``per_layer``; resolved against the models the block runs);
- ``"automatic"``: ``c_i = C / (‖g_i‖ + γ)``, ``γ = stability`` (Bu et al. 2023,
  "Automatic clipping"): every sample's gradient is normalised to norm about ``C``
  (``C = 1`` is the paper's choice; any ``C`` only rescales the step).

``max_norm`` may also be a callable that returns it (a float, or for ``"per_layer"`` a
dict): it is then read at the end of every backward pass, so that a threshold that
moves between optimizer steps (a schedule, adaptive clipping) clips each pass at its
current value. Reading a Python float costs no host synchronisation; a tensor would, so
it is refused.

After each backward pass, ``ext.norms`` holds the pass's per-sample total norms ``‖g_i‖``
``[N]`` (float32 at least; over every parameter, whatever the clipping style), and
``ext.samples`` counts the samples clipped since the last :meth:`ClipGrad.reset`
(under DDP, those of every rank) and ``ext.passes`` the backward passes that reached a
trainable parameter; with flat clipping, ``ext.unclipped`` counts those of
them that the clip left as they were (``c_i = 1``: the count that adaptive clipping
needs; a tensor on the device, this rank's alone); ``ext.held`` is the threshold the
first of those passes was clipped at (a private optimizer's passes share it). Several backward passes add up in
``.grad`` (virtual batches), as autograd's gradients do. A batch of no samples (an empty Poisson batch)
works: ``loss.backward()`` on its loss (NaN under ``"mean"``, the mean of nothing) adds
zeros to ``.grad`` and no samples to ``ext.samples``.

Calls that jacmem cannot give exact per-sample gradients raise, before anything is
written: a module with trainable parameters that no derivative covers, a BatchNorm
with batch statistics, a parameter the loss reaches outside every recorded module call.
:func:`check` finds what can be found before any step, from the model alone.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor, nn

from jacmem.derivatives import lookup
from jacmem.derivatives.generic import normalises_over_batch
from jacmem.derivatives.quantities import BATCH_L2
from jacmem.derivatives.registry import ParametrizedError, own_parameters
from jacmem.errors import unsupported_module_error

CLIPPINGS = ("flat", "per_layer", "automatic")
REDUCTIONS = ("mean", "sum")
#: added to the norm in flat and per-layer clipping, as Opacus does
EPSILON = 1e-6


class ClipGrad:
    """Clip each sample's gradient and sum them into ``.grad`` (see the module docstring).

    Args:
        max_norm: ``C``, a float; for ``clipping="per_layer"``, a dict ``{param: C_p}`` or
            a list of floats in the order of the model's trainable parameters; or a
            callable that returns a float or such a dict, read in every backward pass.
        clipping: ``"flat"``, ``"per_layer"`` or ``"automatic"``.
        loss_reduction: how the batch loss reduces its per-sample terms, ``"mean"`` or ``"sum"``.
        stability: ``γ`` of automatic clipping.
    """

    #: what the engine's messages call the result, and the quantity it stages per call
    savefield, quantities = "grad", (BATCH_L2,)

    def __init__(
        self,
        max_norm: float
        | Sequence[float]
        | Mapping[nn.Parameter, float]
        | Callable[[], float | Mapping[nn.Parameter, float]],
        clipping: str = "flat",
        loss_reduction: str = "mean",
        stability: float = 0.01,
    ):
        if clipping not in CLIPPINGS:
            raise ValueError(f"clipping must be one of {CLIPPINGS}, not {clipping!r}")
        if loss_reduction not in REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {REDUCTIONS}, not {loss_reduction!r}")
        per_layer = clipping == "per_layer"
        if not callable(max_norm) and per_layer == isinstance(max_norm, numbers.Real):
            raise _threshold_type(max_norm, clipping)
        if stability <= 0:
            raise ValueError(f"stability must be positive, not {stability}")
        self.max_norm, self.clipping, self.loss_reduction, self.stability = (
            max_norm,
            clipping,
            loss_reduction,
            stability,
        )
        #: id(parameter) -> its threshold, for per-layer thresholds given as a list, once
        #: paired with the model's parameters (:meth:`bind`)
        self._bound: dict[int, float] | None = None
        #: the latest backward pass's per-sample total norms ``[N]``
        self.norms: Tensor | None = None
        #: samples clipped since the last :meth:`reset` (under DDP or FSDP2, the global
        #: count as a 0-d tensor on the device, which the backward does not wait for)
        self.samples: Tensor | int = 0
        #: flat clipping: of those, the samples with ``c_i = 1`` (a tensor on the device)
        self.unclipped: Tensor | int = 0
        #: backward passes since the last :meth:`reset` that reached a trainable
        #: parameter (one to the inputs alone, ``torch.autograd.grad(loss, x)``, clips nothing)
        self.passes = 0
        #: the threshold the first of those passes was clipped at (:meth:`threshold`'s
        #: form), None before it: a private optimizer hands its threshold down only while
        #: this is None, and its step checks the passes against it
        self.held: float | dict[int, float] | None = None

    def reset(self, keep_threshold: bool = False) -> None:
        """Start counting samples and passes afresh (after an optimizer step); the threshold
        held too, unless ``keep_threshold`` (a skipped step's passes are the next step's)."""
        self.samples = self.unclipped = self.passes = 0
        if not keep_threshold:
            self.held = None

    def __repr__(self) -> str:
        return f"ClipGrad(clipping={self.clipping!r}, loss_reduction={self.loss_reduction!r})"

    def bind(self, params: Iterable[nn.Parameter]) -> None:
        """Per-layer thresholds given as a list: pair them with the model's trainable
        parameters ``params``, in order (the engine does this on the first pass)."""
        if self._bound is not None or callable(self.max_norm) or isinstance(self.max_norm, Mapping):
            return
        params = list(dict.fromkeys(p for p in params if p.requires_grad))
        if len(params) != len(self.max_norm):
            raise ValueError(
                f"jacmem: ClipGrad(clipping='per_layer') got {len(self.max_norm)} thresholds, but the model has "
                f"{len(params)} trainable parameters: give one per trainable parameter, in model.parameters() "
                "order, or a dict {param: max_norm}."
            )
        self._bound = {id(p): float(c) for p, c in zip(params, self.max_norm)}

    def threshold(self) -> float | dict[int, float]:
        """This pass's ``C``: a float, or ``id(param) -> C_p`` for per-layer clipping
        (read from ``max_norm``, called if it is a callable)."""
        value = self.max_norm() if callable(self.max_norm) else self.max_norm
        if self.clipping != "per_layer":
            if not isinstance(value, numbers.Real):
                raise _threshold_type(value, self.clipping)
            return float(value)
        if isinstance(value, Mapping):
            return {id(p): float(c) for p, c in value.items()}
        if self._bound is None:  # a callable's list: no model order to pair it with
            raise _threshold_type(value, self.clipping)
        return self._bound

    def count_unclipped(self, factors: dict[int, Tensor]) -> Tensor | int:
        """:attr:`unclipped` after a pass whose clip factors are ``factors`` (flat
        clipping: ``id(param) -> c [N]``, the same ``c`` for every parameter): the
        samples with ``c_i = 1`` added, counted as Opacus's adaptive clipping counts
        them, ``N - #{i: c_i < 1}``."""
        if self.clipping != "flat" or not factors:
            return self.unclipped
        c = next(iter(factors.values()))
        return self.unclipped + (len(c) - (c < 1).sum())

    def factors(
        self, squared: dict[int, Tensor], names: dict[int, str], max_norm: float | dict[int, float]
    ) -> tuple[dict[int, Tensor], Tensor]:
        """The clip factors and the total norms, from each parameter's squared per-sample
        norms ``squared: id(param) -> [N]`` (of the per-sample gradients as defined in
        the module docstring) and the pass's threshold ``max_norm`` (:meth:`threshold`);
        ``names`` for errors. Returns ``id(param) -> c [N]`` and ``‖g_i‖ [N]``."""
        total = torch.stack(list(squared.values())).sum(0).sqrt()
        if self.clipping == "flat":
            c = (max_norm / (total + EPSILON)).clamp(max=1.0)
            return dict.fromkeys(squared, c), total
        if self.clipping == "automatic":
            c = max_norm / (total + self.stability)
            return dict.fromkeys(squared, c), total
        missing = [names[key] for key in squared if key not in max_norm]
        if missing:
            raise ValueError(
                f"jacmem: ClipGrad(clipping='per_layer') has no threshold for parameter(s) {missing} (modules): "
                "give one to every trainable parameter. PrivacyEngine's are those of the parameters trainable at "
                "make_private: to train one made trainable since, detach() and make the model private again."
            )
        return {key: (max_norm[key] / (sq.sqrt() + EPSILON)).clamp(max=1.0) for key, sq in squared.items()}, total


def _threshold_type(value, clipping: str) -> TypeError:
    return TypeError(
        "jacmem: ClipGrad's max_norm is one float for flat and automatic clipping, and a list or dict of floats "
        "(one per parameter) for per_layer clipping; a callable returns a float or a dict. A tensor would cost a "
        f"host synchronisation in every backward pass: pass float(t). Got {type(value).__name__} with "
        f"clipping={clipping!r}."
    )


def check(model: nn.Module) -> None:
    """Raise, before any step, where ``model`` cannot have exact per-sample gradients,
    naming the module and the fix; what only a forward shows (a parameter used outside
    any module's call, a module called on a batch of one whose output mixes the
    samples) raises in the backward pass instead.

    Checked here: a BatchNorm that uses batch statistics (training mode, or no running
    statistics), anywhere in the model (its output mixes the samples, so every layer
    before it would get wrong per-sample gradients); a registered layer whose per-sample
    gradients are shares that depend on the other samples (``LayerDerivatives.shared``);
    a registered layer with a trainable parameter its derivatives do not cover; a
    ``DistributedDataParallel`` built with ``static_graph=True`` (clipping turns DDP's
    gradient synchronisation off, as ``no_sync()`` does, which a static graph's reducer
    does not support: it fails on an internal assert). Each raises
    :class:`jacmem.errors.UnsupportedModuleError` (a ``ValueError``)."""
    for name, module in model.named_modules():
        _refuse_model_wide(name, module)
        label = _label(name, module)
        own = [n for n, p in own_parameters(module) if p.requires_grad]
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse and "weight" in own:
            raise unsupported_module_error()(
                f"jacmem: module {label} has sparse=True: its gradient is a sparse tensor, and the clipped sum of "
                "its per-sample gradients is dense. Build it with sparse=False."
            )
        try:
            entry = lookup(module) if own else None
        except ParametrizedError as err:
            raise unsupported_module_error()(f"{err} (module {label})") from None
        shared = entry.shared(**entry.hyperparams(module)) if entry is not None else None
        if shared:
            raise unsupported_module_error()(f"jacmem: module {label} {shared}.")
        uncovered = [n for n in own if entry is not None and n not in entry.params]
        if uncovered:
            raise unsupported_module_error()(
                f"jacmem: module {label} has trainable parameter(s) {uncovered} that its registered derivatives "
                "do not cover: their per-sample gradients are unknown. Register them with jacmem.register(...), "
                "or freeze them (requires_grad=False)."
            )


def check_model_wide(model: nn.Module) -> None:
    """The refusals of :func:`check` that no layer's own call makes in a backward pass:
    a BatchNorm that normalises with batch statistics (one without affine parameters has
    no call of its own, and every layer before it would be clipped by norms that mix the
    samples), a ``DistributedDataParallel`` with ``static_graph=True`` (whose
    synchronisation clipping turns off). Raises
    :class:`jacmem.errors.UnsupportedModuleError`, naming the module and the fix."""
    for name, module in model.named_modules():
        _refuse_model_wide(name, module)


def _refuse_model_wide(name: str, module: nn.Module) -> None:
    """Raise where ``module`` (named ``name`` in its model) is one that :func:`check_model_wide` refuses."""
    if isinstance(module, nn.parallel.DistributedDataParallel) and module.static_graph:
        raise unsupported_module_error()(
            f"jacmem: module {_label(name, module)} has static_graph=True: clipping sums the clipped per-sample "
            "gradients over the ranks itself, with DDP's gradient synchronisation off (as in no_sync()), which "
            "DDP's static graph does not support. Build it with static_graph=False (the default)."
        )
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and normalises_over_batch(module):
        raise unsupported_module_error()(
            f"jacmem: module {_label(name, module)} normalises with batch statistics, which mix the samples: "
            "per-sample gradients, and so clipping, are not defined. Replace it with GroupNorm (e.g. "
            f"nn.GroupNorm(min(32, {module.num_features}), {module.num_features}), as Opacus's "
            "ModuleValidator.fix does), or put it in eval mode with running statistics."
        )


def _label(name: str, module: nn.Module) -> str:
    return f"{name or type(module).__name__!r} ({type(module).__name__})"
