"""Differentially private training, Opacus's API on jacmem's one-pass clipping.

``from jacmem.privacy import PrivacyEngine`` in place of ``from opacus import
PrivacyEngine``::

    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0
    )
    for x, y in loader:
        optimizer.zero_grad()
        lossfunc(model(x), y).backward()  # .grad: the sum of the clipped per-sample gradients
        optimizer.step()  # noise, 1/B, the update, and one accountant step
    engine.get_epsilon(delta=1e-5)

What is jacmem's and what is Opacus's:

- jacmem clips: :class:`jacmem.ClipGrad` on the user's own module (no wrapper, so HF and
  PEFT models keep their attributes and methods) leaves in each trainable parameter's
  ``.grad``, in the one backward pass, ``Σ_i clip(g_i)``, each sample's gradient clipped
  (``g_i`` the gradient of the sample's own loss term). Models whose per-sample
  gradients jacmem cannot compute exactly are refused in :meth:`PrivacyEngine.make_private`,
  before any step.
- Opacus does the rest, reused as it is: the accountants (``prv``, ``rdp``, ``gdp``),
  the Poisson-sampling data loader, :func:`opacus.accountants.utils.get_noise_multiplier`
  and the noise. Its ghost-clipping optimizers (``DPOptimizerFastGradientClipping`` and
  the distributed one) expect ``.grad`` to hold the clipped sum already, which is what
  ClipGrad writes; :class:`DPOptimizer` and :class:`DistributedDPOptimizer` change only
  how they count backward passes and what an empty batch gives (see there).

Not reused, and why: Opacus's ``make_private`` itself (it wraps the module, or hooks
it for per-sample gradients, and forbids gradient accumulation with Poisson sampling),
its ``GradSampleModule`` and ghost-clipping criterion (jacmem clips in the one backward
pass, without a second one), and its ``ModuleValidator`` (what jacmem cannot clip
exactly is its own question: :func:`jacmem.extensions.clipping.check`, and errors in
the backward pass).

One step therefore moves the parameters (plain SGD, ``loss_reduction="mean"``) by
``-lr/(B·k) · (Σ_i clip_C(g_i) + n)``: ``B`` the expected batch size (the loader's
``batch_size`` without Poisson sampling), ``k`` the backward passes since the last step
(virtual batches: each pass adds its clipped sum), ``n ~ N(0, σ²C²)`` per coordinate,
drawn once per step for the global batch under ``DistributedDataParallel``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn, optim
from torch.utils.data import DataLoader

try:
    from opacus import PrivacyEngine as OpacusEngine
    from opacus.accountants.utils import get_noise_multiplier
    from opacus.optimizers import DistributedDPOptimizerFastGradientClipping, DPOptimizerFastGradientClipping
except ModuleNotFoundError as err:
    raise ModuleNotFoundError(f'jacmem.privacy needs Opacus ({err}): pip install "jacmem[dp]"', name=err.name) from err

from jacmem import hooks, recorder
from jacmem.context import extend
from jacmem.extensions.clipping import ClipGrad, check

__all__ = ["PrivacyEngine", "DPOptimizer", "DistributedDPOptimizer"]

CLIPPING = ("flat", "per_layer", "automatic")


class _Private(extend):
    """The block of one private model, open from :meth:`PrivacyEngine.make_private` to
    :meth:`PrivacyEngine.detach`: the model is tracked (:func:`jacmem.track`), so that
    its forwards are recorded wherever they run, and the block takes their gradients
    in the user's own ``loss.backward()``. Unlike a ``with jacmem.extend(...)`` block it
    has no global module hooks and does not watch untracked backwards: other models'
    calls are none of its business and cost nothing. It counts its backward passes.

    Distributed: the clipping engine sums the clipped sums over the ranks itself, in
    the backward; a ``DistributedDataParallel`` model's own gradient synchronisation is
    off while the block is open, and a model that is not DDP-wrapped, in a process
    group of more than one rank, is summed over the default group."""

    def __init__(self, module: nn.Module, clip: ClipGrad):
        ddp = isinstance(module, nn.parallel.DistributedDataParallel)
        super().__init__(clip, process_group=dist.group.WORLD if _distributed(module) and not ddp else None)
        self.module, self.clip = module, clip
        #: backward passes ended since the block opened
        self.passes = 0
        self._ddp = [m for m in module.modules() if isinstance(m, nn.parallel.DistributedDataParallel)]

    def __enter__(self) -> _Private:
        super().__enter__()
        hooks.remove(self._module_handles)
        self._module_handles = []
        self._watch.close()
        self._passes.on_end = self._ended
        for ddp in self._ddp:
            ddp.require_backward_grad_sync = False
        recorder.track(self.module)
        # the engine's hooks that keep autograd's unclipped gradients out of .grad, from
        # now on rather than from the first recorded call: a backward the block cannot
        # clip (another thread's) raises, even the first one
        root = type(self.module).__name__
        for engine in self._engines:
            engine._guard((f"{root}.{n}", p) for n, p in self.module.named_parameters())
        return self

    def _ended(self) -> None:
        self.passes += 1
        self._notices.flush()

    def __exit__(self, *exc) -> None:
        recorder.untrack(self.module)
        for ddp in self._ddp:
            ddp.require_backward_grad_sync = True
        super().__exit__(*exc)


class _ClippedSum:
    """What jacmem changes in Opacus's ghost-clipping optimizers, which take ``.grad``
    as the clipped sum already: backward passes are counted (each adds its clipped sum
    to ``.grad``), ``k`` of them make the accountant's sampling rate ``k·q`` and the
    divisor ``B·k``, as Opacus's per-sample optimizers count them; a parameter no sample
    reached (an empty Poisson batch) has a zero clipped sum and gets noise alone."""

    private: _Private
    #: the block's pass count at the last step or zero_grad
    _mark = 0

    @property
    def accumulated_iterations(self) -> int:
        """Backward passes since the last step or ``zero_grad`` (at least 1)."""
        return max(1, self.private.passes - self._mark)

    def _restart(self) -> None:
        self._mark = self.private.passes
        self.private.clip.reset()

    def accumulate(self) -> None:
        """Opacus's, with zeros for a gradient no sample gave (in place, so that a
        second step without ``zero_grad`` raises, as Opacus's does)."""
        for p in self.params:
            grad = torch.zeros_like(p) if p.grad is None else p.grad.detach()
            if p.summed_grad is None:
                p.summed_grad = grad.clone()
            else:
                p.summed_grad.add_(grad)

    def pre_step(self, closure=None) -> bool:
        stepped = super().pre_step(closure)
        self._restart()
        return stepped

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._restart()


class DPOptimizer(_ClippedSum, DPOptimizerFastGradientClipping):
    """Opacus's ghost-clipping optimizer on ``.grad`` = ClipGrad's clipped sums:
    ``step()`` adds ``N(0, σ²C²)`` noise, divides by ``B·k`` (``loss_reduction="mean"``),
    steps the accountant, then the wrapped optimizer."""

    def __init__(self, optimizer: optim.Optimizer, *, private: _Private, **kwargs):
        self.private = private
        super().__init__(optimizer, **kwargs)


class DistributedDPOptimizer(_ClippedSum, DistributedDPOptimizerFastGradientClipping):
    """:class:`DPOptimizer` over ranks. The backward leaves every rank's ``.grad`` with
    the clipped sum over the global batch (jacmem sums over the ranks), so ``B`` is the
    global expected batch size; rank 0 alone adds the noise (Opacus's distributed
    ``add_noise``) and its gradient goes to every rank, in place of Opacus's all-reduce
    of per-rank sums: the noise is drawn once, for the global batch."""

    def __init__(self, optimizer: optim.Optimizer, *, private: _Private, **kwargs):
        self.private = private
        super().__init__(optimizer, **kwargs)

    def reduce_gradients(self) -> None:
        for p in self.params:
            dist.broadcast(p.grad, src=0)


def _distributed(module: nn.Module) -> bool:
    return isinstance(module, nn.parallel.DistributedDataParallel) or (
        dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    )


def _thresholds(
    optimizer: optim.Optimizer, clipping: str, max_grad_norm: float | Sequence[float]
) -> tuple[float | dict, float]:
    """ClipGrad's ``max_norm`` and the noise's ``C``. ``per_layer``: one threshold per
    parameter of the optimizer, in its order (as Opacus), and the noise's ``C`` their
    Euclidean norm (the clipped sum's sensitivity)."""
    if clipping not in CLIPPING:
        raise ValueError(f"clipping={clipping!r}: choose from {', '.join(map(repr, CLIPPING))}")
    if clipping != "per_layer":
        if not isinstance(max_grad_norm, (int, float)):
            raise TypeError(f"max_grad_norm: one float with clipping={clipping!r}; a list is for 'per_layer'")
        return float(max_grad_norm), float(max_grad_norm)
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if isinstance(max_grad_norm, (int, float)) or len(max_grad_norm) != len(params):
        raise ValueError(
            f"clipping='per_layer' takes one max_grad_norm per trainable parameter of the optimizer "
            f"({len(params)}), in its order"
        )
    norms = [float(c) for c in max_grad_norm]
    return dict(zip(params, norms)), math.sqrt(sum(c * c for c in norms))


class PrivacyEngine(OpacusEngine):
    """Opacus's ``PrivacyEngine`` (its accountant, data loader and noise), with jacmem
    clipping in the backward pass on the user's own module.

    Args:
        accountant: ``"prv"``, ``"rdp"`` or ``"gdp"`` (Opacus's accountants).
        secure_mode: Opacus's: noise and sampling from ``torchcsprng``.
    """

    def __init__(self, *, accountant: str = "prv", secure_mode: bool = False):
        super().__init__(accountant=accountant, secure_mode=secure_mode)
        #: the private model's block, from make_private to detach
        self._private: _Private | None = None

    def make_private(
        self,
        *,
        module: nn.Module,
        optimizer: optim.Optimizer,
        data_loader: DataLoader,
        noise_multiplier: float,
        max_grad_norm: float | Sequence[float],
        poisson_sampling: bool = True,
        clipping: str = "flat",
        loss_reduction: str = "mean",
        noise_generator: torch.Generator | None = None,
    ) -> tuple[nn.Module, DPOptimizer, DataLoader]:
        """Clip every sample's gradient in ``module``'s backward passes, and noise and
        account ``optimizer``'s steps.

        Args:
            module: the model; returned as it is (``model is module``), its hooks
                installed. A ``DistributedDataParallel`` model (or a process group of
                more than one rank) gets the distributed optimizer.
            optimizer: over (a subset of) ``module``'s parameters.
            data_loader: with ``poisson_sampling``, replaced by Opacus's
                ``DPDataLoader`` over the same dataset.
            noise_multiplier: σ; the noise's standard deviation is ``σ·C``.
            max_grad_norm: ``C``; with ``clipping="per_layer"`` one per trainable
                parameter of the optimizer, in its order (the noise then takes the
                norm of the list).
            clipping: ``"flat"`` (one norm over all trainable parameters),
                ``"per_layer"`` or ``"automatic"`` (``C·g/(‖g‖+γ)``, Bu et al. 2023);
                see :class:`jacmem.ClipGrad`.
            loss_reduction: how the loss reduces over the batch, ``"mean"`` or ``"sum"``.
            noise_generator: the noise's ``torch.Generator`` (not with ``secure_mode``).

        Returns:
            ``(module, optimizer, data_loader)``. Until :meth:`detach`, the model's
            clipping block is open in the calling thread, the process's one jacmem
            block: ``with jacmem.extend(...)`` raises meanwhile. Other models'
            forward and backward passes are untouched.

        Raises:
            ValueError: where a trainable parameter's per-sample gradient cannot be
                computed exactly (e.g. BatchNorm in training mode), before any hook is
                installed; or on bad arguments.
        """
        if noise_generator is not None and self.secure_mode:
            raise ValueError("noise_generator: not with secure_mode, whose noise comes from torchcsprng")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction={loss_reduction!r}: 'mean' or 'sum'")
        own = {id(p) for p in module.parameters()}
        if any(id(p) not in own for group in optimizer.param_groups for p in group["params"]):
            raise ValueError(
                "the optimizer has parameters that are not the module's: build it from module.parameters()"
            )
        if self._private is not None:
            raise ValueError(
                "this PrivacyEngine has a private model already: one per engine (and per process, as jacmem's "
                "block); call engine.detach() first"
            )
        if isinstance(optimizer, _ClippedSum):
            optimizer = optimizer.original_optimizer
        max_norm, noise_norm = _thresholds(optimizer, clipping, max_grad_norm)
        check(module)  # refuses before anything is installed
        distributed = _distributed(module)
        data_loader = self._prepare_data_loader(data_loader, poisson_sampling=poisson_sampling, distributed=distributed)
        sample_rate = 1 / len(data_loader)
        # the global batch's: under DDP every rank's .grad holds the global clipped sum
        expected_batch_size = int(len(data_loader.dataset) * sample_rate)
        private = _Private(module, ClipGrad(max_norm, clipping=clipping, loss_reduction=loss_reduction))
        optimizer_class = DistributedDPOptimizer if distributed else DPOptimizer
        optimizer = optimizer_class(
            optimizer,
            private=private,
            noise_multiplier=noise_multiplier,
            max_grad_norm=noise_norm,
            expected_batch_size=expected_batch_size,
            loss_reduction=loss_reduction,
            generator=self.secure_rng if self.secure_mode else noise_generator,
            secure_mode=self.secure_mode,
        )
        optimizer.attach_step_hook(self.accountant.get_optimizer_hook_fn(sample_rate=sample_rate))
        self._private = private.__enter__()
        return module, optimizer, data_loader

    def make_private_with_epsilon(
        self,
        *,
        module: nn.Module,
        optimizer: optim.Optimizer,
        data_loader: DataLoader,
        target_epsilon: float,
        target_delta: float,
        epochs: int,
        max_grad_norm: float | Sequence[float],
        **kwargs,
    ) -> tuple[nn.Module, DPOptimizer, DataLoader]:
        """:meth:`make_private` with the noise multiplier that spends ``target_epsilon``
        at ``target_delta`` in ``epochs`` epochs (Opacus's ``get_noise_multiplier``,
        with this engine's accountant); ``kwargs`` go to :meth:`make_private`."""
        noise_multiplier = get_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            sample_rate=1 / len(data_loader),
            epochs=epochs,
            accountant=self.accountant.mechanism(),
        )
        return self.make_private(
            module=module,
            optimizer=optimizer,
            data_loader=data_loader,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            **kwargs,
        )

    def detach(self) -> nn.Module | None:
        """Remove every hook :meth:`make_private` installed: the model's backward passes
        are plain again, and jacmem blocks can open. Returns the model (None if there
        is none)."""
        private, self._private = self._private, None
        if private is None:
            return None
        private.__exit__(None, None, None)
        return private.module
