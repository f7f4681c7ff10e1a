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
  how they count backward passes and what an empty batch gives (see there), and
  :class:`DPOptimizer` adds Opacus's draws and scales them in one pass per parameter.

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
drawn once per step for the global batch under ``DistributedDataParallel``, and under
FSDP2 (``fully_shard``) by each rank for the coordinates it owns.
"""

from __future__ import annotations

import inspect
import math
import numbers
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn, optim
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard
from torch.utils.data import DataLoader

try:
    from opacus import PrivacyEngine as OpacusEngine
    from opacus.accountants.utils import get_noise_multiplier
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
    from opacus.grad_sample.utils import get_gsm_class
    from opacus.optimizers import (
        AdaClipDPOptimizer,
        DistributedDPOptimizerFastGradientClipping,
        DPOptimizerFastGradientClipping,
    )
    from opacus.optimizers.optimizer import _check_processed_flag, _generate_noise, _mark_as_processed
except ModuleNotFoundError as err:
    raise ModuleNotFoundError(f'jacmem.privacy needs Opacus ({err}): pip install "jacmem[dp]"', name=err.name) from err

from jacmem.engine.block import Block
from jacmem.extensions.clipping import ClipGrad, check

__all__ = ["PrivacyEngine", "DPOptimizer", "DistributedDPOptimizer", "ShardedDPOptimizer", "AdaptiveDPOptimizer"]

CLIPPING = ("flat", "per_layer", "automatic", "adaptive")
#: set on a ``.grad`` that :meth:`_ClippedSum.accumulate` has added to ``summed_grad``
_ACCUMULATED = "_jacmem_accumulated"

#: Opacus's default criterion (returned only for a ghost grad_sample_mode)
_CROSS_ENTROPY = nn.CrossEntropyLoss()


class _Private:
    """The block of one private model (:class:`jacmem.engine.block.Block`), open from
    :meth:`PrivacyEngine.make_private` to :meth:`PrivacyEngine.detach`. The block tracks
    the model, so that its forwards are recorded wherever they run, for this block
    alone, and it takes their gradients in the user's own ``loss.backward()``. It has no
    global hook: other models' calls, other private models' and a ``jacmem.extend``
    block's are none of its business, and cost nothing.

    Distributed (:func:`_distributed`): the clipping engine sums the clipped sums over
    the ranks itself, in the backward; a ``DistributedDataParallel`` model's own
    gradient synchronisation is off while the block is open, and Opacus's ``DPDDP``
    (which synchronises nothing in the backward) is summed over the default group, as
    Opacus's distributed optimizer sums it. An FSDP2 model's clipped sums are
    reduce-scattered by the engine, as FSDP reduces gradients. Any other model is one
    process's, whatever process group is up: no collective."""

    def __init__(self, module: nn.Module, clip: ClipGrad, batch_first: bool = True):
        group = dist.group.WORLD if isinstance(Block.unwrapped(module), DPDDP) else None
        self.block = Block(clip, process_group=group, batch_first=batch_first)
        self.module, self.clip = module, clip
        self._ddp = [m for m in module.modules() if isinstance(m, nn.parallel.DistributedDataParallel)]

    def open(self) -> _Private:
        try:
            self.block.open()
            for ddp in self._ddp:
                ddp.require_backward_grad_sync = False
            self.block.track(self.module)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for ddp in self._ddp:
            ddp.require_backward_grad_sync = True
        self.block.close()


class _ClippedSum:
    """What jacmem changes in Opacus's ghost-clipping optimizers, which take ``.grad``
    as the clipped sum already: backward passes are counted (each adds its clipped sum
    to ``.grad``), ``k`` of them make the accountant's sampling rate ``k·q`` and the
    divisor ``B·k``, as Opacus's per-sample optimizers count them; a parameter no sample
    reached (an empty Poisson batch) has a zero clipped sum and gets noise alone.

    The clipping threshold is the optimizer's, handed down to the block's :class:`ClipGrad`
    (:meth:`_hand_down`) whenever it changes while no pass of the step has been clipped,
    and after each step: what Opacus's grad-clip schedulers (or adaptive clipping) set
    between steps clips the next step's passes, and the noise of a step has the ``C`` its
    passes were clipped at (the clip holds it, :attr:`ClipGrad.held`). The engine never
    reads the optimizer."""

    private: _Private
    #: per_layer: one threshold per parameter of ``_threshold_params`` (:attr:`max_grad_norms`)
    _max_grad_norms: list[float] | None = None
    #: per_layer: the optimizer's parameters trainable at make_private, which the
    #: thresholds belong to (``self.params`` is those trainable now: one frozen since
    #: would shift every later threshold onto the next parameter)
    _threshold_params: Sequence[nn.Parameter] = ()

    def _own_threshold(
        self, private: _Private, optimizer: optim.Optimizer, max_grad_norm: float | Sequence[float]
    ) -> float:
        """Take the block's clipping threshold over (before Opacus's ``__init__``, to which
        it returns the noise's ``C``, and which sets :attr:`max_grad_norm`, handing it
        down); per-layer thresholds belong to ``optimizer``'s trainable parameters, in its
        order."""
        self.private = private
        if isinstance(max_grad_norm, numbers.Real):
            return max_grad_norm
        self._threshold_params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        self._max_grad_norms = [float(c) for c in max_grad_norm]
        return self.max_grad_norm

    @property
    def max_grad_norm(self) -> float:
        """``C``, the noise's scale: the clipping threshold, or with per-layer thresholds
        their Euclidean norm (the clipped sum's sensitivity). Setting it (as Opacus's
        grad-clip schedulers do) sets the threshold of the next backward pass; per
        layer, it scales every threshold by the same factor (Opacus's per-layer
        optimizer would scale its noise alone, and leave its clipping as it was)."""
        if self.max_grad_norms is None:
            return self._max_grad_norm
        return math.sqrt(sum(c * c for c in self.max_grad_norms))

    @max_grad_norm.setter
    def max_grad_norm(self, value: float) -> None:
        if self.max_grad_norms is None:
            self._max_grad_norm = value
            self._hand_down()
        else:
            scale = value / self.max_grad_norm
            self.max_grad_norms = [c * scale for c in self.max_grad_norms]

    @property
    def max_grad_norms(self) -> list[float] | None:
        """per_layer: one threshold per parameter trainable at make_private, in the
        optimizer's order (as Opacus's ``DPPerLayerOptimizer`` keeps them); None for one
        threshold. Setting them sets the next backward pass's thresholds."""
        return self._max_grad_norms

    @max_grad_norms.setter
    def max_grad_norms(self, value: Sequence[float]) -> None:
        self._max_grad_norms = list(value)
        self._hand_down()

    def _hand_down(self) -> None:
        """Set the block's :class:`ClipGrad` to the optimizer's threshold, for the next
        backward passes; not once a pass of this step was clipped (the clip holds its
        threshold: the step's passes share one noise)."""
        if self.private.clip.held is None:
            self.private.clip.max_norm = self._threshold_now(by=lambda p: p)

    def _threshold_now(self, by: Callable = id) -> float | dict:
        """The optimizer's threshold: one float, or per layer ``by(param) -> C_p``."""
        if self.max_grad_norms is None:
            return self.max_grad_norm
        return {by(p): c for p, c in zip(self._threshold_params, self.max_grad_norms)}

    def _check_threshold(self) -> None:
        """Raise where the threshold changed after this step's first backward pass: its
        passes were clipped at the old one, and the noise would take the new one."""
        held, now = self.private.clip.held, self._threshold_now()
        if held is not None and held != now:
            was = held if self.max_grad_norms is None else [held.get(id(p)) for p in self._threshold_params]
            raise RuntimeError(
                f"jacmem: max_grad_norm changed from {was} to {self.max_grad_norms or now} after the backward "
                "passes of this step were clipped at the former, so the noise would not match their sensitivity. "
                "Change it between optimizer.step() and the next backward pass (as Opacus's grad-clip schedulers "
                "do when they step after the optimizer), or set it back before this step."
            )

    @property
    def accumulated_iterations(self) -> int:
        """Backward passes since the last step or ``zero_grad`` that reached a trainable
        parameter (at least 1): one to the inputs alone clipped nothing."""
        return max(1, self.private.clip.passes)

    def _restart(self) -> None:
        """After a step (or ``zero_grad``): the clip counts afresh, and takes the
        optimizer's threshold now; a skipped step's passes are the next step's, and keep theirs."""
        self.private.clip.reset(keep_threshold=self._is_last_step_skipped)
        self._hand_down()

    def accumulate(self) -> None:
        """Opacus's, with zeros for a gradient no sample gave (in place, so that a
        second step without ``zero_grad`` raises, as Opacus's does), and without its
        copy: the first ``summed_grad`` is the clipped sum itself (``.grad``'s storage;
        :meth:`zero_grad` gives a skipped step's parameters a fresh ``.grad``).

        Raises:
            ValueError: as Opacus's per-sample optimizer, where a ``.grad`` was
                accumulated already by a skipped step (``BatchMemoryManager``'s) with no
                ``zero_grad`` since: its clipped sum would count twice.
        """
        if any(p.grad is not None and hasattr(p.grad, _ACCUMULATED) for p in self.params):
            raise ValueError(
                "Gradients haven't been cleared since the last optimizer step: call optimizer.zero_grad() after "
                "every optimizer.step(), also those BatchMemoryManager skips, or a clipped sum counts twice"
            )
        for p in self.params:
            if p.grad is None:
                grad = torch.zeros_like(p)
            else:
                grad = p.grad.detach()
                setattr(p.grad, _ACCUMULATED, True)
            if getattr(p, "summed_grad", None) is None:  # None: a parameter of add_param_group since
                p.summed_grad = grad
            else:
                p.summed_grad.add_(grad)

    def pre_step(self, closure=None) -> bool:
        self._check_threshold()
        stepped = super().pre_step(closure)
        self._restart()
        return stepped

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is not None and hasattr(p.grad, _ACCUMULATED):  # a skipped step's: its storage is summed_grad
                p.grad = None if set_to_none else torch.zeros_like(p.grad)
        super().zero_grad(set_to_none)
        self._restart()


class DPOptimizer(_ClippedSum, DPOptimizerFastGradientClipping):
    """Opacus's ghost-clipping optimizer on ``.grad`` = ClipGrad's clipped sums:
    ``step()`` adds ``N(0, σ²C²)`` noise, divides by ``B·k`` (``loss_reduction="mean"``),
    steps the accountant, then the wrapped optimizer. ``max_grad_norm``: ``C``, or with
    per-layer clipping the list of thresholds (kept as ``max_grad_norms``)."""

    def __init__(
        self, optimizer: optim.Optimizer, *, private: _Private, max_grad_norm: float | Sequence[float], **kwargs
    ):
        super().__init__(optimizer, max_grad_norm=self._own_threshold(private, optimizer, max_grad_norm), **kwargs)

    def add_noise(self) -> None:
        """Opacus's noise and its ``1/(B·k)`` (``loss_reduction="mean"``) in one pass over
        each parameter: the same draws from the same generator, in the same order, drawn
        at ``σC/(B·k)``, with ``summed_grad/(B·k)`` added into them (Opacus allocates a
        zero tensor per parameter before each draw, adds, then divides, in three more
        passes; the two agree to rounding). ``secure_mode`` and ``σ = 0`` are Opacus's own."""
        std = getattr(self, "_adjusted_noise_multiplier", self.noise_multiplier) * self.max_grad_norm
        if self.secure_mode or std == 0:
            super().add_noise()
            super().scale_grad()
            return
        scale = 1 / (self.expected_batch_size * self.accumulated_iterations) if self.loss_reduction == "mean" else 1.0
        for p in self.params:
            summed = p.summed_grad
            _check_processed_flag(summed)
            noise = torch.normal(
                mean=0, std=std * scale, size=summed.shape, device=summed.device, generator=self.generator,
                dtype=summed.dtype,
            )  # fmt: skip
            p.grad = noise.add_(summed, alpha=scale).view_as(p)
            _mark_as_processed(summed)

    def scale_grad(self) -> None:
        """Nothing: :meth:`add_noise` scaled ``.grad`` already (Opacus calls it right after)."""


class DistributedDPOptimizer(_ClippedSum, DistributedDPOptimizerFastGradientClipping):
    """:class:`DPOptimizer` over ranks. The backward leaves every rank's ``.grad`` with
    the clipped sum over the global batch (jacmem sums over the ranks), so ``B`` is the
    global expected batch size; rank 0 alone adds the noise (Opacus's distributed
    ``add_noise``) and its gradient goes to every rank, in place of Opacus's all-reduce
    of per-rank sums: the noise is drawn once, for the global batch."""

    def __init__(
        self, optimizer: optim.Optimizer, *, private: _Private, max_grad_norm: float | Sequence[float], **kwargs
    ):
        super().__init__(optimizer, max_grad_norm=self._own_threshold(private, optimizer, max_grad_norm), **kwargs)

    def reduce_gradients(self) -> None:
        for p in self.params:
            dist.broadcast(p.grad, src=0)


class ShardedDPOptimizer(_ClippedSum, DPOptimizerFastGradientClipping):
    """:class:`DPOptimizer` under FSDP2 (``fully_shard``). The backward leaves each
    parameter's ``.grad`` a ``DTensor`` sharded like the parameter (``Shard(0)``), the
    rank's rows of the clipped sum over the global batch, so ``B`` is the global expected
    batch size. The shards do not overlap: each rank adds ``N(0, σ²C²)`` to the rows it
    owns (``grad.to_local()``), and every coordinate gets its noise once, from one rank,
    for the global batch. The ranks' noise is independent: without ``secure_mode``
    (whose ``torchcsprng`` generator reads ``/dev/urandom`` in each process), the noise
    comes from a generator of this rank's own (:func:`_rank_generator`)."""

    def __init__(
        self,
        optimizer: optim.Optimizer,
        *,
        private: _Private,
        max_grad_norm: float | Sequence[float],
        generator: torch.Generator | None = None,
        secure_mode: bool = False,
        **kwargs,
    ):
        if not secure_mode:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            generator = _rank_generator(generator, params[0].device if params else torch.device("cpu"))
        super().__init__(
            optimizer,
            max_grad_norm=self._own_threshold(private, optimizer, max_grad_norm),
            generator=generator,
            secure_mode=secure_mode,
            **kwargs,
        )

    def add_noise(self) -> None:
        """Noise on this rank's rows of each ``summed_grad``; ``.grad`` the noised
        ``DTensor``, with the parameter's placement."""
        for p in self.params:
            summed = p.summed_grad
            _check_processed_flag(summed)
            local = summed.to_local()
            noise = _generate_noise(
                std=self.noise_multiplier * self.max_grad_norm,
                reference=local,
                generator=self.generator,
                secure_mode=self.secure_mode,
            )
            p.grad = DTensor.from_local(
                local + noise,
                summed.device_mesh,
                summed.placements,
                run_check=False,
                shape=summed.shape,
                stride=summed.stride(),
            )
            _mark_as_processed(summed)


def _rank_generator(generator: torch.Generator | None, device: torch.device) -> torch.Generator:
    """A generator on ``device`` for this rank alone: seeded from one draw of
    ``generator`` (torch's default generator where None) and the rank, through NumPy's
    ``SeedSequence`` (its ``spawn_key``), so that ranks seeded alike (the same
    ``noise_generator``, or the same ``torch.manual_seed`` for the same initial model)
    never draw the same noise, and a seeded run draws the same noise again."""
    where = generator.device if generator is not None else torch.device("cpu")
    entropy = int(torch.randint(2**63 - 1, (), generator=generator, device=where))
    seed = np.random.SeedSequence(entropy, spawn_key=(dist.get_rank(),)).generate_state(1, np.uint64)[0]
    return torch.Generator(device).manual_seed(int(seed))


class AdaptiveDPOptimizer(_ClippedSum, AdaClipDPOptimizer, DPOptimizerFastGradientClipping):
    """Adaptive clipping (Andrew et al. 2021), Opacus's ``AdaClipDPOptimizer`` on
    ClipGrad's flat clipped sums. Each step, with ``b`` the samples of the step's passes
    whose gradient the clip left as it was (``c_i = 1``) and ``n`` all of them: the
    noise's multiplier is ``(σ⁻² - (2σ_b)⁻²)^(-1/2)`` (the count's noise spends the rest
    of ``σ``; the accountant takes ``σ``), ``b̃ = b + N(0, σ_b²)``, and the next
    threshold is ``C·exp(-η (b̃/n - γ))`` clamped to ``[min_clipbound, max_clipbound]``;
    ``σ_b = unclipped_num_std``, ``η = clipbound_learning_rate``,
    ``γ = target_unclipped_quantile``. The count, the noise and the update are
    Opacus's; ``b`` and ``n`` come from :class:`ClipGrad`'s counts."""

    def __init__(self, optimizer: optim.Optimizer, *, private: _Private, max_grad_norm: float, **kwargs):
        super().__init__(optimizer, max_grad_norm=self._own_threshold(private, optimizer, max_grad_norm), **kwargs)

    def clip_and_accumulate(self) -> None:
        """Opacus's counts, of the passes since the last step (clipped in the backward)."""
        self.sample_size += self.private.clip.samples
        self.unclipped_num = self.unclipped_num + torch.as_tensor(self.private.clip.unclipped)

    def update_max_grad_norm(self) -> None:
        """Opacus's update (in float32, as Opacus computes it), then a Python float,
        which the next backward passes read without a host synchronisation."""
        super().update_max_grad_norm()
        self.max_grad_norm = float(self.max_grad_norm)

    def pre_step(self, closure=None) -> bool:
        self.clip_and_accumulate()
        return super().pre_step(closure)


def _distributed(module: nn.Module) -> bool:
    """Whether ``module`` is data-parallel, decided as Opacus decides, by its wrapper:
    ``DistributedDataParallel`` or Opacus's ``DPDDP``, also under ``torch.compile``'s
    wrapper (FSDP2 is :func:`_fsdp`'s). Not by an initialised process group: a model
    without such a wrapper may be one rank's own (a reference run on rank 0 of a
    ``torchrun`` script), whose steps must neither wait for the other ranks nor add
    their gradients."""
    return isinstance(Block.unwrapped(module), (nn.parallel.DistributedDataParallel, DPDDP))


def _fsdp(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` or to one of its submodules."""
    return any(isinstance(m, FSDPModule) for m in module.modules())


def _refuse_unsharded(module: nn.Module, optimizer: optim.Optimizer) -> None:
    """Under FSDP2, every trainable parameter of the optimizer must be a ``DTensor``
    with FSDP's ``Shard(0)`` on a 1-D mesh: each rank noises the rows it owns, once. A
    plain parameter (its module outside every ``fully_shard``) is whole on every rank,
    and an HSDP parameter (a 2-D mesh) is whole on every replica: either would get its
    noise once per rank. Raises ``ValueError`` naming the parameter and its module."""
    names = {id(p): name for name, p in module.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad:
                continue
            name = names[id(p)]
            owner = name.rpartition(".")[0] or type(module).__name__
            if not isinstance(p, DTensor):
                raise ValueError(
                    f"jacmem: FSDP: parameter {name!r} (module {owner!r}) is not sharded, though the model is "
                    "fully_shard-ed: every rank would add noise to it. Apply fully_shard to the root model too "
                    "(after its blocks), so that every trainable parameter is sharded."
                )
            if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
                raise ValueError(
                    f"jacmem: FSDP: parameter {name!r} (module {owner!r}) has placements {tuple(p.placements)} on a "
                    f"{p.device_mesh.ndim}-D mesh; private training under FSDP takes fully_shard's Shard(0) on a "
                    "1-D mesh (HSDP replicates shards, and each replica would add its own noise)."
                )


def _refuse_tracked(module: nn.Module) -> None:
    """A model that shares parameters with a tracked one (a private model, or one given
    to :func:`jacmem.track`) would have its gradients taken twice: it raises."""
    own = {id(p) for p in module.parameters()}
    for model, private in Block.tracked():
        if own & {id(p) for p in model.parameters()}:
            raise ValueError(
                f"jacmem: the model ({type(module).__name__}) is, or shares parameters with, a model "
                + ("made private already" if private else "given to jacmem.track")
                + f" ({type(model).__name__}); call "
                + ("detach() on the PrivacyEngine that made it private" if private else "jacmem.untrack(model)")
                + " first."
            )


def _refuse_unknown(optimizer_class: type, kwargs: dict) -> None:
    """Python's ``TypeError`` for keywords that ``optimizer_class`` does not name (Opacus's
    optimizers take ``**kwargs`` and would drop them silently)."""
    named = {
        name
        for cls in optimizer_class.__mro__
        if "__init__" in vars(cls)
        for name, param in inspect.signature(cls.__init__).parameters.items()
        if param.kind is not inspect.Parameter.VAR_KEYWORD
    }
    unknown = sorted(set(kwargs) - named)
    if unknown:
        raise TypeError(f"make_private() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}")


def _thresholds(optimizer: optim.Optimizer, clipping: str, max_grad_norm: float | Sequence[float]) -> float | list:
    """``max_grad_norm`` checked: one float, or for ``per_layer`` one threshold per
    trainable parameter of the optimizer, in its order (as Opacus)."""
    if clipping not in CLIPPING:
        raise ValueError(f"clipping={clipping!r}: choose from {', '.join(map(repr, CLIPPING))}")
    if clipping != "per_layer":
        if not isinstance(max_grad_norm, numbers.Real):
            raise TypeError(f"max_grad_norm: one float with clipping={clipping!r}; a list is for 'per_layer'")
        return float(max_grad_norm)
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if isinstance(max_grad_norm, numbers.Real) or len(max_grad_norm) != len(params):
        raise ValueError(
            f"clipping='per_layer' takes one max_grad_norm per trainable parameter of the optimizer "
            f"({len(params)}), in its order"
        )
    return [float(c) for c in max_grad_norm]


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
        criterion: Callable = _CROSS_ENTROPY,
        data_loader: DataLoader,
        noise_multiplier: float,
        max_grad_norm: float | Sequence[float],
        batch_first: bool = True,
        loss_reduction: str = "mean",
        poisson_sampling: bool = True,
        clipping: str = "flat",
        noise_generator: torch.Generator | None = None,
        grad_sample_mode: str = "hooks",
        wrap_model: bool = True,
        rand_on_empty: bool = False,
        **kwargs,
    ) -> tuple[nn.Module, DPOptimizer, DataLoader] | tuple[nn.Module, DPOptimizer, Callable, DataLoader]:
        """Clip every sample's gradient in ``module``'s backward passes, and noise and
        account ``optimizer``'s steps. Opacus 1.6's keywords, in its order.

        Args:
            module: the model; returned as it is (``model is module``), its hooks
                installed and its ``.grad`` (from backward passes before, unclipped)
                dropped. A ``DistributedDataParallel`` model, or one wrapped in Opacus's
                ``DPDDP``, gets the distributed optimizer; a ``fully_shard``-ed one
                (FSDP2) :class:`ShardedDPOptimizer`, each rank noising its shards; any
                other model :class:`DPOptimizer`, and no collective, also where a
                process group is initialised (as Opacus decides, by the wrapper).
            optimizer: over (a subset of) ``module``'s parameters.
            criterion: the loss, returned as it is where Opacus returns its ghost-clipping
                criterion (``grad_sample_mode`` ``"ghost"`` or ``"ghost_fsdp"``):
                ``criterion(out, y).backward()`` clips, as any backward of the model
                does, in one pass. Its ``reduction``, where it has one, must be
                ``loss_reduction``.
            data_loader: with ``poisson_sampling``, replaced by Opacus's
                ``DPDataLoader`` over the same dataset.
            noise_multiplier: σ; the noise's standard deviation is ``σ·C``.
            max_grad_norm: ``C``; with ``clipping="per_layer"`` one per trainable
                parameter of the optimizer, in its order (the noise then takes the
                norm of the list). Kept by the optimizer (``optimizer.max_grad_norm``,
                and ``optimizer.max_grad_norms`` per layer), which every backward pass
                reads: what a grad-clip scheduler sets there between steps clips the
                next step.
            batch_first: whether the model's inputs have the batch on axis 0 (Opacus's);
                ``False`` for ``[T, N, ...]`` inputs (see :class:`jacmem.extend`'s
                ``batch_first``, which it sets for the model's block).
            loss_reduction: how the loss reduces over the batch, ``"mean"`` or ``"sum"``.
            poisson_sampling: replace the loader by Opacus's Poisson-sampling one.
            clipping: ``"flat"`` (one norm over all trainable parameters),
                ``"per_layer"``, ``"automatic"`` (``C·g/(‖g‖+γ)``, Bu et al. 2023;
                see :class:`jacmem.ClipGrad`) or ``"adaptive"`` (flat, with the
                threshold moved at each step towards a quantile of the per-sample
                norms: :class:`AdaptiveDPOptimizer`).
            noise_generator: the noise's ``torch.Generator`` (not with ``secure_mode``).
            grad_sample_mode: any of Opacus's (``"hooks"``, ``"functorch"``, ``"ew"``,
                ``"ghost"``, ``"ghost_fsdp"``, ``"no_op"``). jacmem has one code path
                for all: per-sample norms (ghost norms where cheaper) and the clipped
                sum in the one backward pass. The mode only decides, as in Opacus,
                whether ``criterion`` is returned.
            wrap_model: accepted for Opacus's sake; jacmem returns the user's own module
                either way, as it hooks the module in place and wraps nothing (so HF and
                PEFT models keep their attributes and methods).
            rand_on_empty: Opacus's ``DPDataLoader`` option for empty Poisson batches.
            **kwargs: go to the optimizer, as Opacus forwards them; one it does not
                take raises ``TypeError``. ``clipping="adaptive"`` takes Opacus's
                ``target_unclipped_quantile``, ``clipbound_learning_rate``,
                ``max_clipbound``, ``min_clipbound`` and ``unclipped_num_std``.

        Returns:
            ``(module, optimizer, data_loader)``, or ``(module, optimizer, criterion,
            data_loader)`` for a ghost ``grad_sample_mode``, as Opacus. Until
            :meth:`detach`, the model's clipping block is open in the calling thread.
            Other models' forward and backward passes are untouched; other private
            models (each with its own engine) and ``with jacmem.extend(...)`` blocks on
            other models run beside it.

        Raises:
            UnsupportedModuleError: where a trainable parameter's per-sample gradient
                cannot be computed exactly (e.g. BatchNorm in training mode), before any
                hook is installed (a ``ValueError``, and Opacus's error of that name).
            ValueError: on bad arguments, or a model that is private already; under
                FSDP, a trainable parameter that is not a ``Shard(0)`` ``DTensor`` on a
                1-D mesh (its name, its module and the fix).
        """
        if noise_generator is not None and self.secure_mode:
            raise ValueError("noise_generator: not with secure_mode, whose noise comes from torchcsprng")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction={loss_reduction!r}: 'mean' or 'sum'")
        get_gsm_class(grad_sample_mode)  # Opacus's ValueError for a mode it does not know
        ghost = "ghost" in grad_sample_mode
        if ghost and getattr(criterion, "reduction", loss_reduction) != loss_reduction:
            raise ValueError(
                f"criterion.reduction={criterion.reduction!r} but loss_reduction={loss_reduction!r}: they must agree"
            )
        own = {id(p) for p in module.parameters()}
        if any(id(p) not in own for group in optimizer.param_groups for p in group["params"]):
            raise ValueError(
                "Module parameters are different than optimizer Parameters (Opacus's words): the optimizer has "
                "parameters that are not the module's; build it from module.parameters()"
            )
        if self._private is not None:
            raise ValueError(
                "this PrivacyEngine has a private model already: one per engine. Make another PrivacyEngine for "
                "another model, or call engine.detach() first"
            )
        _refuse_tracked(module)
        if isinstance(optimizer, _ClippedSum):
            optimizer = optimizer.original_optimizer
        max_grad_norm = _thresholds(optimizer, clipping, max_grad_norm)
        check(module)  # refuses before anything is installed
        sharded = _fsdp(module)
        distributed = sharded or _distributed(module)
        if clipping == "adaptive" and distributed:
            raise ValueError(
                f"clipping='adaptive' is not for distributed training{' (FSDP)' if sharded else ''}, "
                "nor is Opacus's: choose 'flat', 'per_layer' or 'automatic'"
            )
        if clipping == "adaptive":
            optimizer_class = AdaptiveDPOptimizer
        elif sharded:
            _refuse_unsharded(module, optimizer)
            optimizer_class = ShardedDPOptimizer
        else:
            optimizer_class = DistributedDPOptimizer if distributed else DPOptimizer
        _refuse_unknown(optimizer_class, kwargs)
        data_loader = self._prepare_data_loader(
            data_loader,
            poisson_sampling=poisson_sampling,
            distributed=distributed,
            batch_first=batch_first,
            rand_on_empty=rand_on_empty,
        )
        sample_rate = 1 / len(data_loader)
        # the global batch's: under DDP every rank's .grad holds the global clipped sum,
        # under FSDP its rows of it
        expected_batch_size = int(len(data_loader.dataset) * sample_rate)
        # adaptive clipping clips flat; its optimizer moves the threshold between steps
        clip = ClipGrad(
            max_grad_norm, clipping="flat" if clipping == "adaptive" else clipping, loss_reduction=loss_reduction
        )
        private = _Private(module, clip, batch_first)
        optimizer = optimizer_class(  # from here on, the clip's threshold is the optimizer's max_grad_norm
            optimizer,
            private=private,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            loss_reduction=loss_reduction,
            generator=self.secure_rng if self.secure_mode else noise_generator,
            secure_mode=self.secure_mode,
            **kwargs,
        )
        optimizer.attach_step_hook(self.accountant.get_optimizer_hook_fn(sample_rate=sample_rate))
        self._private = private.open()
        # a .grad from a backward before now is unclipped: the clipped sums would add to
        # it (Opacus's step ignores it, writing its own sum over .grad); the module's, for
        # a parameter the optimizer takes later (add_param_group)
        module.zero_grad(set_to_none=True)
        if ghost:
            return module, optimizer, criterion, data_loader
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
        epsilon_tolerance: float = 0.01,
        **kwargs,
    ) -> tuple:
        """:meth:`make_private` with the noise multiplier that spends ``target_epsilon``
        at ``target_delta`` in ``epochs`` epochs (Opacus's ``get_noise_multiplier``, with
        this engine's accountant, to within ``epsilon_tolerance``); the other keywords
        are :meth:`make_private`'s. As Opacus, it warns where the accountant has spent
        some budget already (the noise multiplier assumes none)."""
        sample_rate = 1 / len(data_loader)
        if len(self.accountant) > 0:
            warnings.warn(
                "make_private_with_epsilon: this engine's accountant has spent some privacy budget already; the "
                "noise multiplier assumes none, so the total budget will exceed target_epsilon.",
                stacklevel=2,
            )
        noise_multiplier = get_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            sample_rate=sample_rate,
            epochs=epochs,
            accountant=self.accountant.mechanism(),
            epsilon_tolerance=epsilon_tolerance,
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
        are plain again, and it may be made private anew. Returns the model (None if
        there is none)."""
        private, self._private = self._private, None
        if private is None:
            return None
        private.close()
        return private.module
