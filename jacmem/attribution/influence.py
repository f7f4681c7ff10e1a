"""Influence functions on any model jacmem extends: ``g_qᵀ (C + λ)⁻¹ g_n``.

``g_q`` and ``g_n`` are the gradients of a query's and of a training example's loss
(:class:`jacmem.BatchGrad`, one backward per batch), ``C`` a block-diagonal curvature
fitted on the training set, ``λ`` the damping. Scores are pairwise ``[n_query, n_train]``;
a positive score says that training on example ``n`` lowered the query's loss.

**jacmem's conventions** (the default). ``C`` is the Fisher of the *summed* training loss,
``Σ_n``, not the mean, one block per parameter, but a bias joins its weight's Kronecker
block as a column of ones in the activations (``A = Σ [x; 1][x; 1]ᵀ``) where the layer's
rule has that factor (``Kronecker.with_bias``: ``nn.Linear``, HF's Conv1D, and
``nn.Conv1d/2d/3d``, whose ``x`` is the unfolded patch at each output position, KFC's
homogeneous coordinates; ``Influence._folds``); elsewhere a bias is its own ``[O, 1]``
block (a transposed convolution's, a frozen weight's, and every bias under a
projection). The joint block keeps the weight-bias correlation, which separate blocks
drop: on the LDS benchmark (``benchmarks/attribution.py``), EK-FAC reads 0.624 folded
against 0.601 with separate bias blocks (docs/guide/attribution.rst). Then,
for a model at a minimum of that loss, ``g_qᵀ C⁻¹ g_n`` is to first order the rise of the
query's loss when example ``n`` is left out of training: a score reads in the units of the
query's loss. ``damping=None`` adds ``0.1 ×`` the mean eigenvalue of each block.
With ``projection=k``, all of this holds in the projected space (the class docstring).

* ``"ekfac"``: KFAC's eigenbasis ``U_G ⊗ U_A`` of the factors summed over the training
  batches (:class:`jacmem.KFACEF` for ``fisher="empirical"``, :class:`jacmem.KFAC` for
  ``"mc"``; ``A`` averaged over the batches by their samples), and ``Λ = Σ_n (U_Gᵀ G_n
  U_A)²`` over the training examples, ``G_n`` sample ``n``'s gradient (empirical) or a
  Monte-Carlo square root of its GGN (:class:`jacmem.SqrtGGNMC`, ``"mc"``): two passes
  over the training data, as kronfluence; the blocks of :class:`jacmem.EKFAC` otherwise
  (a weight of HF's Conv1D or an Embedding as ``weight.T``, an Embedding's diagonal ``A``
  with the identity for its basis, LayerNorm/RMSNorm their diagonal ``Σ_n g_n²``), and
  convolutions too (``[C_out, C_in·prod(kernel)]``, KFAC's factors of
  :doc:`/guide/curvature`; ``Λ`` from the per-sample gradients, which need no patches);
  grouped convolutions are refused;
* ``"kfac"``: the same factors, ``Λ = λ_G ⊗ λ_A`` (LayerNorm/RMSNorm: KFAC's diagonal);
* ``"diag"``: ``Λ = Σ_n g_n²`` (the same vectors as ``"ekfac"``'s);
* ``"identity"``: ``C + λ = I`` (TracIn at one checkpoint, gradient dot products).

**kronfluence's conventions** (``conventions="kronfluence"``, kronfluence 1.0.1's
pairwise scores): one Kronecker block per ``nn.Linear`` and ``nn.Conv2d`` (``groups=1``,
zero padding), its bias folded in as above, ``A = Σ [x; 1][x; 1]ᵀ`` (a convolution's
``x`` the unfolded patch at each output pixel) and ``G`` normalised by the number of rows
(tokens, output pixels; KFAC-expand's factors),
``Λ`` (EK-FAC and the diagonal) divided by the number of training examples, then the
damping (``None``: 0.1 × the mean of the block's ``Λ``). On ``nn.Linear`` layers with
one row per example, its scores are ``n_train`` times jacmem's (its ``C`` is the mean's).
"""

from __future__ import annotations

import contextlib
import tempfile
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import jacmem
from jacmem.attribution import ranks
from jacmem.attribution.blocks import Block, Diagonal, Eigen, Slot, damped, eigh, identity
from jacmem.attribution.progress import progress_bar
from jacmem.attribution.store import GradientStore, allocate
from jacmem.derivatives.registry import first_input, lookup
from jacmem.engine.base import stable_names

CURVATURES = ("ekfac", "kfac", "diag", "identity")
FISHERS = ("empirical", "mc")
CONVENTIONS = ("jacmem", "kronfluence")

#: what serves a parameter that has no Kronecker factors
_NO_FACTORS = "or choose curvature='diag' or 'identity', which need no Kronecker factors"

#: the parameter attributes the extensions used here write
_FIELDS = ("grad_batch", "grad_proj", "sqrt_ggn_mc", "kfac", "kfac_ef")


def _length(loader: Iterable) -> int | None:
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return None


def batch_size(batch: Any) -> int:
    """The samples in ``batch``: axis 0 of its first tensor (the batch itself, or the first
    of a tuple's, list's or mapping's values), as kronfluence counts them."""
    if isinstance(batch, Tensor):
        return batch.shape[0]
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, Sequence) else ()
    for value in values:
        if isinstance(value, (Tensor, Mapping)) or (isinstance(value, Sequence) and not isinstance(value, str)):
            try:
                return batch_size(value)
            except TypeError:
                continue
    raise TypeError(f"jacmem.attribution: found no tensor in the batch {type(batch).__name__} to count its samples")


class Influence:
    """Influence scores of training examples on queries (the module docstring gives the math).

    ``loss_fn(model, batch)`` returns the SUM of the batch's per-example losses (e.g.
    ``F.cross_entropy(model(x), y, reduction="sum")``); the loaders yield batches it takes,
    in a fixed order (no shuffling: rows are stored by position; a shuffling loader raises). ``store``: a directory
    for the training gradients (kept across runs; a fill that stops resumes where it
    stopped), or ``None`` for a temporary one. ``progress``: tqdm bars (``None``: where
    tqdm is installed).

    ``projection=k`` (with ``seed``): LoGra's Kronecker projection of each weight's
    gradient to ``k`` dimensions (``jacmem.BatchGradProjection(k, kind="kronecker", seed=seed)``,
    which never forms ``[N, *p.shape]``), for the curvature and the scores alike: KFAC's
    factors projected, ``P_out G P_outᵀ`` and ``P_in A P_inᵀ`` (``(P_out, P_in)`` the rule's
    matrices of the weight's output and input sides), EK-FAC's ``Λ`` from the projected
    gradients; a parameter the rule projects densely (a bias, a norm's scale) and a tied
    weight (GPT-2's ``wte``/``lm_head``: its projection sums its uses, and it has no
    Kronecker factors) get the whole ``[k, k]`` second moment of their projected
    gradients (``"ekfac"``, ``"kfac"``) or its diagonal (``"diag"``). The empirical Fisher and jacmem's conventions only.

    The model is run in eval mode (dropout off, batch norm on its running statistics, as
    kronfluence's ``prepare_model``), each module's training flag restored after every
    forward: nothing of the model (running statistics, modes) nor torch's random state
    (but for ``fisher="mc"``'s draws) changes. Its trainable parameters are those scored
    (freeze the others).

    ``process_group``: the group whose ranks each feed their own shard of the training
    and query data (found from a ``DistributedDataParallel`` model, whose module is run:
    the per-sample gradients its own, not scaled by DDP's averaging); the curvature is
    summed over the ranks, and :meth:`scores` and :meth:`self_influence` return on every
    rank those of the whole data, the ranks' shards in rank order (docs/guide/attribution.rst,
    "Several processes")."""

    #: the kind of ``BatchGradProjection`` that ``projection=`` asks for
    projection_kind = "kronecker"

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[nn.Module, Any], Tensor],
        *,
        curvature: str = "ekfac",
        fisher: str = "empirical",
        damping: float | None = None,
        projection: int | None = None,
        conventions: str = "jacmem",
        store: str | Path | None = None,
        progress: bool | None = None,
        seed: int = 0,
        process_group: Any = None,
    ):
        for what, value, valid in (
            ("curvature", curvature, CURVATURES),
            ("fisher", fisher, FISHERS),
            ("conventions", conventions, CONVENTIONS),
        ):
            if value not in valid:
                raise ValueError(f"jacmem.attribution.Influence: {what} must be one of {valid}, got {value!r}")
        if curvature == "identity" and damping is not None:
            raise ValueError(
                "jacmem.attribution.Influence: curvature='identity' has no damping (its scores are gradient dot "
                "products); leave damping=None, or choose curvature='diag', 'kfac' or 'ekfac'"
            )
        if damping is not None and damping < 0:
            raise ValueError(f"jacmem.attribution.Influence: damping must be >= 0 or None, got {damping!r}")
        if projection is not None:
            _check_projection(projection, fisher, conventions)
        #: the model run (a DDP model's module) and the group its ranks' shards are summed over
        self.model, self.group = ranks.unwrapped(model, process_group)
        self.loss_fn = loss_fn
        self.curvature, self.fisher, self.damping = curvature, fisher, damping
        self.conventions, self.progress = conventions, progress
        self.projection, self.seed = projection, seed
        stable = _stable_names(self.model)
        #: the trainable parameters and their stable names (as ``BatchGradProjection`` draws by)
        self.params = tuple(p for p in self.model.parameters() if p.requires_grad)
        self.names = tuple(stable[id(p)] for p in self.params)
        #: the parameters (indices) whose rows are the Kronecker projection ``[k_rows, k_cols]``
        self.kronecker_projected = set() if projection is None else self._kronecker_projected()
        #: the parameters whose projected curvature is their whole ``[k, k]`` second moment
        #: with a projection (tied weights: no Kronecker factors, one projected gradient)
        self._whole = set() if projection is None else self._tied()
        self.slots, start = [], 0
        for i, p in enumerate(self.params):
            shape = tuple(p.shape) if projection is None else (projection,)
            if i in self.kronecker_projected and i not in self._whole:
                from jacmem.derivatives.projection import factors

                shape = factors(projection)
            self.slots.append(Slot(start, shape))
            start += Slot(start, shape).size
        self.width = start
        self._store_dir = store
        self._store: GradientStore | None = None
        self.blocks: list[Block] = []
        self.preconditioners: list[Callable[[Tensor], Tensor]] = []
        self.fitted = False
        #: what the training store's rows are (its key)
        self._stored = "per-sample gradients"

    # -- one backward per batch ------------------------------------------------------

    def _backward(
        self, batch: Any, extension: Any, field: str, hint: str = "", skip: set[int] = frozenset()
    ) -> list[Any]:
        """One forward and backward of ``loss_fn`` on ``batch`` under ``extension``: its
        attribute ``field`` of each trainable parameter (``None`` where the loss does not
        use it, and for the parameters of ``skip``, frozen for this forward and backward);
        ``.grad`` is untouched. ``hint``: added to what jacmem cannot compute (a
        ``NotImplementedError``, which names the parameter and its module)."""
        wanted = [p for i, p in enumerate(self.params) if i not in skip]
        frozen = [self.params[i] for i in skip]
        with jacmem.extend(extension), _evaluating(self.model):
            try:
                for p in frozen:  # (for this forward and backward only: jacmem leaves them out)
                    p.requires_grad_(False)
                loss = self.loss_fn(self.model, batch)
                found = iter(torch.autograd.grad(loss, wanted, allow_unused=True))
                grads = [None if i in skip else next(found) for i in range(len(self.params))]
                got = [None if g is None else getattr(p, field, None) for p, g in zip(self.params, grads, strict=True)]
            except NotImplementedError as err:
                if not hint:
                    raise
                message = f"jacmem.attribution.Influence(curvature={self.curvature!r}): {err} ({hint})"
                params = getattr(err, "params", None)
                raise (type(err)(message) if params is None else type(err)(message, params)) from err
            finally:
                for p in frozen:
                    p.requires_grad_(True)
                for p in self.params:
                    for name in _FIELDS:
                        if hasattr(p, name):
                            delattr(p, name)
        for name, g, value in zip(self.names, grads, got, strict=True):
            if g is not None and value is None:
                raise ValueError(
                    f"jacmem.attribution: jacmem gave no {field} for parameter {name!r}; freeze it "
                    "(requires_grad=False) or make its module one jacmem supports"
                )
        return got

    def _rows(self, batch: Any, role: str) -> Tensor:
        """The batch's rows ``[N, D]`` for ``role``: ``"train"`` and ``"query"``, the
        per-sample gradients; ``"curvature"``, the vectors whose second moments the
        curvature is (the gradients, or for ``fisher="mc"`` a Monte-Carlo square root of
        each sample's GGN)."""
        if role == "curvature" and self.fisher == "mc":
            got = [None if v is None else v[0] for v in self._backward(batch, jacmem.SqrtGGNMC(1), "sqrt_ggn_mc")]
        elif self.projection is not None:
            extension = jacmem.BatchGradProjection(self.projection, kind=self.projection_kind, seed=self.seed)
            got = self._backward(batch, extension, "grad_proj")
        else:
            got = self._backward(batch, jacmem.BatchGrad(), "grad_batch")
        return self._flat(got)

    def _flat(self, got: list[Tensor | None]) -> Tensor:
        """Per-parameter rows ``[N, *slot.shape]`` (``None``: zeros of the slot's width, the
        projected one with a projection) as rows ``[N, D]``."""
        n = next((len(v) for v in got if v is not None), None)
        if n is None:
            raise ValueError("jacmem.attribution: the loss depends on no trainable parameter")
        return torch.cat(
            [
                p.new_zeros(n, s.size) if v is None else v.detach().reshape(n, -1)
                for p, s, v in zip(self.params, self.slots, got, strict=True)
            ],
            dim=1,
        )

    def _bar(self, loader: Iterable, desc: str) -> Iterable:
        return progress_bar(loader, total=_length(loader), desc=desc, enabled=self.progress)

    # -- fit ---------------------------------------------------------------------------

    def fit(self, train_loader: Iterable) -> Influence:
        """Fit the curvature on the training set (one pass; two for ``"ekfac"``); with a
        process group, on this rank's shard, summed over the ranks."""
        ranks.check_sharded(self.group, train_loader, "training")
        if self.curvature == "identity":
            self.blocks, self.preconditioners = [Block("all", vector=tuple(self.slots))], [identity]
        elif self.curvature == "diag":
            self._fit_diag(train_loader)
        else:
            self._fit_kronecker(train_loader)
        self.fitted = True
        return self

    def _vector_blocks(self) -> list[Block]:
        """One vector block per parameter, or (kronfluence) per module."""
        if self.conventions == "jacmem":
            return [Block(n, vector=(s,)) for n, s in zip(self.names, self.slots)]
        return [Block(name, vector=tuple(s for s in (w, b) if s is not None)) for name, w, b in self._tracked()]

    def _fit_diag(self, loader: Iterable) -> None:
        blocks = self._vector_blocks()
        sums, n = torch.zeros(self.width, dtype=self.params[0].dtype, device=self.params[0].device), 0
        for batch in self._bar(loader, "fitting the diagonal"):
            rows = self._rows(batch, "curvature")
            sums += rows.square().sum(0)
            n += len(rows)
        total = ranks.summed(self.group, {"sums": sums, "n": sums.new_tensor(float(n))})
        sums, n = total["sums"], int(total["n"])
        scale = n if self.conventions == "kronfluence" else 1
        self.blocks = blocks
        self.preconditioners = []
        for block in blocks:
            lam = block.matrix(sums[None])[0] / scale
            self.preconditioners.append(Diagonal(lam, damped(lam, self.damping)))

    def _tracked(self) -> list[tuple[str, Slot | None, Slot | None]]:
        """kronfluence's blocks: ``(module name, weight slot, bias slot)`` of each module
        kronfluence tracks (``nn.Linear``, ``nn.Conv2d``); a trainable parameter of any
        other module, and a convolution kronfluence does not differentiate as torch does
        (:func:`_kronfluence_refuses`), raise."""
        slot_of = {id(p): s for p, s in zip(self.params, self.slots)}
        out, covered = [], set()
        for name, module in self.model.named_modules():
            own = {n: p for n, p in module.named_parameters(recurse=False) if id(p) in slot_of}
            if not own:
                continue
            why = _kronfluence_refuses(module)
            if why:
                raise ValueError(
                    f"jacmem.attribution.Influence(conventions='kronfluence'): module {name!r} is a "
                    f"{type(module).__name__}{why}: freeze its parameters (requires_grad=False), or use "
                    "conventions='jacmem'"
                )
            covered.update(id(p) for p in own.values())
            w, b = own.get("weight"), own.get("bias")
            out.append((name, None if w is None else slot_of[id(w)], None if b is None else slot_of[id(b)]))
        if len(covered) != len(slot_of):
            raise ValueError(
                "jacmem.attribution.Influence(conventions='kronfluence'): a trainable parameter belongs to no module "
                "of the model; freeze it, or use conventions='jacmem'"
            )
        return out

    def _fit_kronecker(self, loader: Iterable) -> None:
        """KFAC's factors over the training set (pass 1), their eigenbases, and for
        EK-FAC ``Λ`` from the per-sample vectors (pass 2)."""
        kron = self.conventions == "kronfluence"
        approx = "expand" if kron else None  # kronfluence's: a factor per position (row), for convolutions too
        if self.fisher == "empirical":
            extension, field = jacmem.KFACEF(kfac_approx=approx), "kfac_ef"
        else:
            extension, field = jacmem.KFAC(1, kfac_approx=approx), "kfac"
        G: dict[int, Tensor] = {}  # parameter index -> its summed factors
        A: dict[int, Tensor] = {}
        D: dict[int, Tensor] = {}  # a diagonal's (LayerNorm's)
        tracked = {name for name, _, _ in self._tracked()} if kron else set()
        inputs = _Inputs(self.model, self._folds(), tracked, approx)
        n, skip = 0, self._factorless()
        try:
            for batch in self._bar(loader, "fitting Kronecker factors"):
                b = batch_size(batch)
                inputs.start_batch()
                got = (
                    [None] * len(self.params)  # (no parameter needs factors: no backward)
                    if len(skip) == len(self.params)
                    else self._backward(batch, extension, field, hint=_NO_FACTORS, skip=skip)
                )
                for i, factors in enumerate(got):
                    if factors is None:
                        continue
                    if len(factors) == 1 and factors[0].dim() == 1:
                        D[i] = D.get(i, 0) + factors[0]  # a norm's diagonal [d]
                        continue
                    G[i] = G.get(i, 0) + factors[0]
                    if len(factors) == 2:
                        weight = inputs.batch_rows[id(self.params[i])] if kron else b
                        A[i] = A.get(i, 0) + weight * factors[1]
                inputs.end_batch(None if kron else b)
                n += b
        finally:
            inputs.remove()
        G, A, D, n = self._summed_factors(G, A, D, n, inputs)
        self.blocks, eigens = self._kronecker_blocks(G, A, D, n, inputs)
        if self.curvature == "ekfac" or any(e is None for e in eigens):
            lams = [_second_moments(e, block, self.params[0]) for e, block in zip(eigens, self.blocks)]
            for batch in self._bar(loader, "fitting EK-FAC's eigenvalues"):
                rows = self._rows(batch, "curvature")
                for block, e, lam in zip(self.blocks, eigens, lams):
                    X = block.matrix(rows)
                    if e is None:  # a projected block's whole second moment
                        lam.addmm_(X[..., 0].T, X[..., 0])
                    elif self.curvature == "ekfac":
                        lam += (e.rotate(X) if isinstance(e, Eigen) else X).square().sum(0)
            total = ranks.summed(self.group, dict(enumerate(lams)))
            lams = [total[k] for k in range(len(lams))]
            scale = n if kron else 1
            for k, (e, lam) in enumerate(zip(eigens, lams)):
                if e is None:
                    values, vectors = eigh(lam)
                    eigens[k] = Eigen(vectors, None, values[:, None], 0.0)
                elif self.curvature == "ekfac":
                    if isinstance(e, Eigen):
                        e.lam = lam / scale
                    else:
                        eigens[k] = lam / scale
        self.preconditioners = []
        for e in eigens:
            if isinstance(e, Eigen):
                e.damping = damped(e.lam, self.damping)
                self.preconditioners.append(e)
            else:
                self.preconditioners.append(Diagonal(e, damped(e, self.damping)))

    def _summed_factors(self, G: dict, A: dict, D: dict, n: int, inputs: _Inputs) -> tuple[dict, dict, dict, int]:
        """The factors ``G``, ``A``, ``D`` (parameter index -> summed factor), the number of
        examples ``n`` and the inputs' folded factors and rows, summed over the ranks
        (``inputs`` in place); as they are in one process."""
        if self.group is None:
            return G, A, D, n
        like = self.params[0]
        mine = {
            **{("G", i): v for i, v in G.items()},
            **{("A", i): v for i, v in A.items()},
            **{("D", i): v for i, v in D.items()},
            **{("folded", name): v for name, v in inputs.folded.items()},
            **{("rows", name): like.new_tensor(float(r)) for name, r in inputs.rows.items()},
            ("n", ""): like.new_tensor(float(n)),
        }
        total = ranks.summed(self.group, mine)
        of = {kind: {k: v for (what, k), v in total.items() if what == kind} for kind in ("G", "A", "D")}
        inputs.folded = {k: v for (what, k), v in total.items() if what == "folded"}
        inputs.rows = {k: int(v) for (what, k), v in total.items() if what == "rows"}
        return of["G"], of["A"], of["D"], int(total[("n", "")])

    def _kronecker_blocks(self, G, A, D, n, inputs) -> tuple[list[Block], list[Eigen | Tensor]]:
        """The blocks and, per block, its :class:`Eigen` (``lam``: KFAC's ``λ_G ⊗ λ_A``)
        or a vector block's diagonal."""
        blocks, eigens = [], []
        if self.conventions == "kronfluence":
            for name, w, b in self._tracked():
                i = self.slots.index(w if w is not None else b)
                rows = inputs.rows[name]
                Gk = G[i] / rows
                if w is None:  # a frozen weight: its bias, with A = [[1]]
                    Ak = torch.ones(1, 1, dtype=Gk.dtype, device=Gk.device)
                else:
                    Ak = (A[i] if b is None else inputs.folded[name]) / rows
                blocks.append(Block(name, weight=w, bias=b))
                eigens.append(_eigen(Gk, Ak))
            return blocks, eigens
        #: the modules whose bias joins their weight's block (a weight the loss used)
        folds = {name: ij for name, ij in self._folds().items() if name in inputs.folded and ij[0] in G}
        folded = {j for _, j in folds.values()}
        weight_of = {i: (name, j) for name, (i, j) in folds.items()}
        for i, (name, slot, p) in enumerate(zip(self.names, self.slots, self.params)):
            if i in folded:  # in its weight's block
                continue
            if i in self._whole or (self.projection is not None and i not in self.kronecker_projected):
                blocks.append(Block(name, bias=slot))
                eigens.append(None)
                continue
            if i in D or i not in G:  # a diagonal (or a parameter the loss never used)
                blocks.append(Block(name, vector=(slot,)))
                eigens.append(D.get(i, torch.zeros(slot.size, dtype=p.dtype, device=p.device)).flatten())
                continue
            if i in A:
                if A[i].dim() == 3:
                    raise ValueError(
                        f"jacmem.attribution.Influence(curvature={self.curvature!r}): parameter {name!r} is a grouped "
                        "convolution's weight, whose Kronecker factors are block-diagonal; choose curvature='diag', "
                        "or freeze it"
                    )
                transposed = self._transposed(p)
                if i in weight_of:  # the bias as a column of ones in the activations
                    module, j = weight_of[i]
                    blocks.append(Block(module, weight=slot, bias=self.slots[j], transposed=transposed))
                    eigens.append(_eigen(G[i], inputs.folded[module] / n))
                    continue
                Gi, Ai = G[i], A[i] / n
                if i in self.kronecker_projected:
                    Gi, Ai = self._projected(name, p, Gi, Ai, transposed)
                blocks.append(Block(name, weight=slot, transposed=transposed))
                eigens.append(_eigen(Gi, Ai))
            else:  # a bias alone: [O, 1]
                blocks.append(Block(name, bias=slot))
                eigens.append(_eigen(G[i], torch.ones(1, 1, dtype=G[i].dtype, device=G[i].device)))
        return blocks, eigens

    def _folds(self) -> dict[str, tuple[int, int]]:
        """The modules whose bias joins their weight's Kronecker block as a column of ones
        in the activations: module name -> (weight index, bias index). kronfluence's: each
        module it tracks with a trainable weight and bias. jacmem's (unprojected): each
        module with a trainable weight and bias of its own whose layer's rule has an input
        factor of ``[x, 1]`` (``Kronecker.with_bias``: ``nn.Linear``, HF's Conv1D, and
        ``nn.Conv1d/2d/3d``, a one per patch position); not a tied weight."""
        index = {id(p): i for i, p in enumerate(self.params)}
        if self.conventions == "kronfluence":
            return {
                name: (self.slots.index(w), self.slots.index(b))
                for name, w, b in self._tracked()
                if w is not None and b is not None
            }
        if self.projection is not None:
            return {}
        tied = self._tied()
        out = {}
        for name, module in self.model.named_modules():
            own = dict(module.named_parameters(recurse=False))
            w, b = own.get("weight"), own.get("bias")
            if w is None or b is None or id(w) not in index or id(b) not in index or index[id(w)] in tied:
                continue
            entry = lookup(module)
            rule = None if entry is None else entry.kronecker
            if rule is not None and rule.with_bias is not None:
                out[name] = (index[id(w)], index[id(b)])
        return out

    def _factorless(self) -> set[int]:
        """The parameters whose curvature needs no Kronecker factors: with a projection,
        every one but those the Kronecker rule projects (tied weights, biases, norms, layers
        KFAC has no rule for: the second moment of their projected gradients)."""
        if self.projection is None:
            return set()
        return self._whole | (set(range(len(self.params))) - self.kronecker_projected)

    def _tied(self) -> set[int]:
        """The parameters that several modules own (tied weights: GPT-2's ``wte`` and ``lm_head``)."""
        owners: dict[int, int] = {}
        for module in self.model.modules():
            for q in module.parameters(recurse=False):
                owners[id(q)] = owners.get(id(q), 0) + 1
        return {i for i, p in enumerate(self.params) if owners.get(id(p), 0) > 1}

    def _kronecker_projected(self) -> set[int]:
        """The parameters whose layer projects them by the Kronecker rule (a registered
        ``kronecker`` strategy of ``grad_proj``; the others take the dense rule)."""
        out = set()
        if self.projection_kind != "kronecker":
            return out
        for i, p in enumerate(self.params):
            for module in self.model.modules():
                own = [n for n, q in module.named_parameters(recurse=False) if q is p]
                if own:
                    entry = lookup(module)
                    if entry is not None and "kronecker" in entry.strategies.get((own[0], "grad_proj"), {}):
                        out.add(i)
                    break
        return out

    def _projected(self, name: str, p: nn.Parameter, G: Tensor, A: Tensor, transposed: bool) -> tuple[Tensor, Tensor]:
        """KFAC's factors of a weight in the space of its Kronecker projection: ``P_out G
        P_outᵀ`` and ``P_in A P_inᵀ`` (``A [I]`` diagonal: ``P_in diag(A) P_inᵀ``), with
        ``(P_rows, P_cols)`` the rule's matrices of the weight as stored (its input side on
        the rows for a transposed layer: HF's Conv1D, an Embedding)."""
        from jacmem.derivatives.projection import kronecker

        rows, cols = p.shape[0], p[0].numel()
        P_rows, P_cols = kronecker(self.seed, name, self.projection, rows, cols, dtype=G.dtype, device=G.device)
        P_out, P_in = (P_cols, P_rows) if transposed else (P_rows, P_cols)
        A = P_in @ A @ P_in.T if A.dim() == 2 else (P_in * A) @ P_in.T
        return P_out @ G @ P_out.T, A

    def _transposed(self, p: nn.Parameter) -> bool:
        """Whether the Kronecker factors of ``p`` are of its dims 0 and 1 swapped (the
        layer's registered rule: HF's Conv1D, Embedding, transposed convolutions)."""
        for module in self.model.modules():
            if any(q is p for q in module.parameters(recurse=False)):
                entry = lookup(module)
                return bool(entry is not None and entry.kronecker is not None and entry.kronecker.transposed)
        return False

    # -- scores ------------------------------------------------------------------------

    def _train_store(self, train_loader: Iterable) -> GradientStore:
        """The training rows of this rank's shard (with a process group, under the store's
        ``rank_<r>``: ranks sharing one directory never read each other's chunks)."""
        ranks.check_sharded(self.group, train_loader, "training")
        ranks.check_ordered(train_loader, "training")
        if self._store is None:
            path = self._store_dir
            if path is None:
                tmp = tempfile.TemporaryDirectory(prefix="jacmem-attribution-")
                weakref.finalize(self, tmp.cleanup)
                path = tmp.name
            if self.group is not None:
                path = Path(path) / f"rank_{torch.distributed.get_rank(self.group)}"
            self._store = GradientStore(path, self._key())
        self._store.fill(
            train_loader, lambda batch: self._rows(batch, "train"), total=_length(train_loader), progress=self.progress
        )
        return self._store

    def _key(self) -> dict:
        """What the stored rows are: the parameters (names, shapes, and a fingerprint of
        their values, so that a store of another checkpoint raises) and the dtype."""
        with torch.no_grad():
            return {
                "rows": self._stored,
                "dtype": str(self.params[0].dtype),
                "projection": None if self.projection is None else [self.projection, self.seed],
                "params": [
                    [n, list(p.shape), repr(float(p.double().sum())), repr(float(p.double().norm()))]
                    for n, p in zip(self.names, self.params)
                ],
            }

    def precondition(self, rows: Tensor) -> Tensor:
        """``(C + λ)⁻¹`` of ``rows [n, D]``, block by block: ``[n, D]``."""
        if not self.fitted:
            raise RuntimeError("jacmem.attribution.Influence: call fit(train_loader) first")
        out = torch.zeros_like(rows)
        for block, inverse in zip(self.blocks, self.preconditioners):
            block.put(inverse(block.matrix(rows)), out)
        return out

    def scores(self, query_loader: Iterable, train_loader: Iterable, *, out: str | Path | None = None) -> Tensor:
        """Pairwise scores ``[n_query, n_train]``: ``g_qᵀ (C + λ)⁻¹ g_n``. The training
        gradients come from the store (computed where missing); each query batch is
        scored against one stored chunk at a time. ``out``: a ``.npy`` file to write the
        scores to, returned memory-mapped, for score matrices larger than memory.

        With a process group, both loaders are this rank's shards: the preconditioned
        query gradients are gathered from every rank, each rank scores them against its
        own training shard, and every rank returns the whole matrix, rows and columns the
        ranks' shards in rank order (rank 0's examples in its loaders' order, then rank 1's, ...)."""
        ranks.check_sharded(self.group, query_loader, "query")
        ranks.check_ordered(query_loader, "query")
        train = self._train_store(train_loader)
        with tempfile.TemporaryDirectory(prefix="jacmem-queries-") as tmp:
            queries = GradientStore(tmp, {"rows": "preconditioned query gradients"})
            queries.fill(
                query_loader,
                lambda batch: self.precondition(self._rows(batch, "query")),
                total=_length(query_loader),
                desc="query gradients",
                progress=self.progress,
            )
            chunks = list(queries.chunks())
            if self.group is not None:
                mine = torch.cat(chunks) if chunks else self.params[0].new_zeros(0, self.width).cpu()
                chunks = [ranks.gathered(self.group, mine)]
            shape = (sum(map(len, chunks)), len(train))
            result = allocate(shape, self.params[0].dtype, out if self.group is None else None)
            q0 = 0
            for q in self._bar(chunks, "scores"):
                t0 = 0
                for t in train.chunks():
                    result[q0 : q0 + len(q), t0 : t0 + len(t)] = q @ t.T
                    t0 += len(t)
                q0 += len(q)
        if self.group is None:
            return result
        whole = ranks.gathered(self.group, result, dim=1)
        if out is None:
            return whole
        written = allocate(tuple(whole.shape), whole.dtype, out)
        written[...] = whole
        return written

    def self_influence(self, train_loader: Iterable) -> Tensor:
        """``g_nᵀ (C + λ)⁻¹ g_n`` of each training example: ``[n_train]``, the diagonal of
        ``scores(train, train)``, from the store, one chunk at a time. With a process group:
        this rank's shard's, gathered in rank order (as :meth:`scores`'s columns)."""
        train = self._train_store(train_loader)
        mine = torch.cat([(self.precondition(t) * t).sum(1) for t in train.chunks()])
        return ranks.gathered(self.group, mine)


def _stable_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> its stable name``: its qualified name without the segments of
    wrappers (``nn.DataParallel``'s ``module.``, ``torch.compile``'s ``_orig_mod.``), the
    name the projection's matrices are drawn from; a tied parameter's first name."""
    names, _ = stable_names([model])
    out: dict[int, str] = {}
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            out.setdefault(id(p), names[(id(module), pname)])
    return out


@contextlib.contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode inside, each module's training flag restored after."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def _check_projection(projection: Any, fisher: str, conventions: str) -> None:
    """What ``projection=`` needs: a positive int, jacmem's ``BatchGradProjection``, the
    empirical Fisher and jacmem's conventions."""
    if not isinstance(projection, int) or isinstance(projection, bool) or projection < 1:
        raise ValueError(f"jacmem.attribution.Influence: projection must be a positive int or None, got {projection!r}")
    if not hasattr(jacmem, "BatchGradProjection"):
        raise NotImplementedError(
            "jacmem.attribution.Influence: projection= needs jacmem.BatchGradProjection, which this build of "
            "jacmem does not have; use projection=None (the full gradients)"
        )
    if fisher != "empirical":
        raise ValueError(
            "jacmem.attribution.Influence: projection= projects the gradients, not a Monte-Carlo root of the GGN; "
            "use fisher='empirical' with a projection, or projection=None"
        )
    if conventions != "jacmem":
        raise ValueError(
            "jacmem.attribution.Influence: conventions='kronfluence' has no projection (kronfluence projects "
            "nothing); use conventions='jacmem' with a projection, or projection=None"
        )


def _kronfluence_refuses(module: nn.Module) -> str:
    """Why kronfluence 1.0.1's conventions cannot be reproduced on ``module`` (the rest of
    the message after its type's name), or ``""``. It tracks ``nn.Linear`` and
    ``nn.Conv2d`` (its covariances per row: a token, a pixel); it unfolds a convolution's
    input with zero padding after averaging its channels over groups, which is not the
    layer's gradient with ``groups > 1`` or another ``padding_mode``."""
    if type(module) is nn.Linear:
        return ""
    if type(module) is not nn.Conv2d:
        return "; kronfluence's conventions cover nn.Linear and nn.Conv2d only (its other modules are not tracked)"
    if module.groups != 1:
        return (
            f" with groups={module.groups}; kronfluence averages a grouped convolution's input channels over its "
            "groups, which is not the layer's gradient, so its scores are not reproduced"
        )
    if module.padding_mode != "zeros":
        return (
            f" with padding_mode={module.padding_mode!r}; kronfluence unfolds its input with zero padding, which is "
            "not the layer's gradient, so its scores are not reproduced"
        )
    return ""


def _second_moments(e: Eigen | Tensor | None, block: Block, like: Tensor) -> Tensor:
    """Zeros to sum a block's second moments into: ``Λ`` of an EK-FAC block, a diagonal's,
    or (``e`` ``None``) a projected block's whole ``[k, k]`` (dtype and device of ``like``)."""
    if e is None:
        return like.new_zeros(block.bias.size, block.bias.size)
    return torch.zeros_like(e.lam if isinstance(e, Eigen) else e)


def _eigen(G: Tensor, A: Tensor) -> Eigen:
    """KFAC's ``G ⊗ A`` in its eigenbasis: ``lam = λ_G ⊗ λ_A``; a diagonal ``A [I]`` has
    the identity for its basis."""
    lam_G, U_G = eigh(G)
    if A.dim() == 1:
        return Eigen(U_G, None, lam_G[:, None] * A[None, :], 0.0)
    lam_A, U_A = eigh(A)
    return Eigen(U_G, U_A, lam_G[:, None] * lam_A[None, :], 0.0)


class _Inputs:
    """Forward hooks on a model's modules (removed by :meth:`remove`). For each module of
    ``folds`` (name -> its weight's and bias's indices): ``folded``, the input factor of
    ``[x, 1]`` (a one appended to each position's input) by the layer's own Kronecker
    rule (``Kronecker.with_bias``, with ``approx``), summed over the batches weighted by
    their samples (``end_batch(b)``: jacmem's, as KFAC's ``A`` is averaged) or by their
    rows (``end_batch(None)``: kronfluence's, a sum over rows; jacmem's Kronecker factors
    refuse a module called more than once per backward, so a batch has one call's). For
    each module of ``tracked``, its rows (the positions its weight is applied at: tokens,
    pixels) in all (``rows``) and in the current batch, per parameter (``batch_rows``),
    as kronfluence weighs its factors."""

    def __init__(self, model: nn.Module, folds: Mapping[str, tuple[int, int]], tracked: set[str], approx: str | None):
        self.folded: dict[str, Tensor] = {}
        self.rows: dict[str, int] = {}
        #: id(weight or bias) -> the rows of the current batch
        self.batch_rows: dict[int, int] = {}
        self._batch: dict[str, list[tuple[Tensor, int]]] = {}  # module name -> this batch's (factor, rows)
        self._approx = approx
        self._handles = [
            m.register_forward_hook(self._hook(name, m, name in folds), with_kwargs=True)
            for name, m in model.named_modules()
            if name in folds or name in tracked
        ]

    def _hook(self, name: str, module: nn.Module, fold: bool):
        entry = lookup(module)
        rule = entry.kronecker

        def hook(mod, args, kwargs, output):
            rows = rule.positions(output.shape)
            self.rows[name] = self.rows.get(name, 0) + rows
            for p in module.parameters(recurse=False):
                self.batch_rows[id(p)] = self.batch_rows.get(id(p), 0) + rows
            if fold:
                x = first_input(args, kwargs).detach().to(module.weight.dtype)
                with torch.autocast(x.device.type, enabled=False):  # in the weight's dtype, not autocast's
                    A = rule.with_bias(x, output.shape, x.dtype, self._approx, **entry.hyperparams(module))
                self._batch.setdefault(name, []).append((A, rows))

        return hook

    def start_batch(self) -> None:
        self.batch_rows.clear()
        self._batch.clear()

    def end_batch(self, samples: int | None) -> None:
        """Adds the batch's factors, each ``samples ×`` or (``None``) ``rows ×`` its own."""
        for name, calls in self._batch.items():
            for A, rows in calls:
                self.folded[name] = self.folded.get(name, 0) + (samples or rows) * A

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
