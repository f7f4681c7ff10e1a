"""The autograd path: GGN-type curvature through operations without a module-level
Jacobian (functional ops, attention, residual streams written any way).

It runs instead of the module chain for a backward whose chain is broken (a tracked
module's input made by an untracked op, or no loss module), for the GGN kinds
(``exact``, ``mc<M>``), first in that backward, from a hook on the root's node. The GGN
is ``Σ_n J_nᵀ H_n J_n``, split at ``z [N, *]``:

* where the root is one registered loss (cross-entropy, also HF's shifted LM loss with
  ``ignore_index``; MSE; BCE) times a factor, ``z`` is that loss's input (the logits),
  batch axis first: ``J`` runs from the parameters to the logits through everything in
  between, frozen modules and curved operations included (a frozen head and the frozen
  attention above a LoRA adapter), which the columns cross by VJPs only (no double
  backward through attention: only the loss's own Hessian needs one, at the logits);
* otherwise ``z`` is the output of the last tracked module with parameters.

Each kind's factor at ``z``:

* ``mc<M>``, where the root is one registered loss times a factor, on ``z`` (or on ``z``
  through linear links: casts, reshapes, slices): the loss's own sampled factor
  ``[M, N, *x]`` (gradients at labels drawn from the model's predictive, as BackPACK and
  curvlinops' MC Fisher), carried back to ``z``: ``M`` columns at any ``D``, nothing of
  size ``D × D``;
* otherwise ``H_n [D, D]`` (``D = |z_n|``, ``T·V`` for a language model's logits) from
  ``D`` Hessian-vector products of the loss, batched over probes; its factor
  ``S_n = U_n Λ_n^½ [D, K]`` by ``eigh`` (``S_n ε / √M``, ``ε [K, M]`` standard normal,
  for ``mc<M>``), refused before any work where ``N·D²`` is out of reach, naming the
  Monte-Carlo kinds;
* ``empirical`` (the empirical Fisher's root, no Hessian): the loss's own root at its
  input (:class:`jacmem.derivatives.LossHessian`), times the square root of the loss's
  weight in the backward, brought to ``z`` by one VJP; one loss call only;
* the factor's ``V`` columns reach each module's output by VJPs
  (``is_grads_batched``, in slices under ``chunk_bytes``);
* checked, else ``ChainError`` naming the fix: the loss depends on ``z``, reaches the
  parameters only through ``z`` (against autograd's gradient at each module's output),
  is per-sample (a random probe) and convex in ``z`` (``H_n`` has no negative
  eigenvalue).

The whole account is in the guide's "Second order: the math" (docs/guide/curvature.rst).
"""

from __future__ import annotations

from dataclasses import replace
from math import prod, sqrt
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, get_gradient_edge

from jacmem import compat, walker
from jacmem.derivatives import LOSSES
from jacmem.derivatives.functional import StandInLoss
from jacmem.derivatives.quantities import EMPIRICAL, EXACT, FactorKind
from jacmem.engine import hooks, precision
from jacmem.engine.secondorder.graph import ChainError, Node, in_compute_dtype, several_losses, tolerance
from jacmem.extensions.secondorder.base import Call, Factor, UnsupportedModule

#: the relative tolerance of the loss Hessian's checks at least: a loss computed in float32
#: on float64 logits (HF's causal-LM loss upcasts with ``.float()``) rounds as float32
_LOOSE = 1e-5


class AutogradPath:
    """The autograd path of one second-order engine (see the module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        #: (node, its output's autograd edge) of each call of a module with parameters
        self.records: list[tuple[Node, GradientEdge]] = []
        #: an untracked operation fed a tracked module since the last backward
        self.untracked = False
        #: each loss called since the last backward: (node, its output's autograd edge, its
        #: input's where the empirical kind needs it)
        self.losses: list[tuple[Node, GradientEdge, GradientEdge | None]] = []
        #: the path serves this backward (from its start, before the loss's hooks, which
        #: would otherwise build the loss's factors for nothing, to its products' end):
        #: every hook of the engine stands by
        self.busy = False
        #: the path's own products are running
        self.running = False
        #: :meth:`jacmem.engine.block.Block.explain`'s line on the last split (:func:`_note`)
        self.notes: list[str] = []
        self.handles = hooks.Handles()

    def close(self) -> None:
        hooks.remove(self.handles)
        self.records, self.losses = [], []

    def serves(self) -> bool:
        """Whether the block's extensions are all GGN-type (else the chain runs)."""
        return all(k.serves for k in self.engine.kinds)

    # -- forward -------------------------------------------------------------------

    def record(self, node: Node, output: Tensor, x: Tensor | None = None, target: Tensor | None = None) -> None:
        """A call the engine kept (``x``, ``target``: a loss's inputs): a loss, or a
        module whose parameters the path serves. A loss whose target has a gradient is
        not one of its input alone (its Hessian there misses the target's path, which may
        couple the samples): not counted, so the GGN splits at the model's output, where
        the root's own Hessian is formed and checked."""
        if node.loss is not None and not (target is not None and target.requires_grad):
            edge = get_gradient_edge(x) if x is not None and x.requires_grad else None
            self.losses.append((node, get_gradient_edge(output), edge))
        if not node.params:
            return
        self.records.append((node, get_gradient_edge(output)))
        self.handles.add(output.register_hook(lambda grad: self._check(node, grad)))

    # -- backward ------------------------------------------------------------------

    def on_backward(self, tensors, grad_tensors, alone: bool) -> None:
        """A backward is about to begin: where the chain is incomplete and the block's
        extensions are GGN-type, hook the path onto the root (``alone``: no first-order
        engine in the block, whose hooks would see the path's batched products)."""
        self.busy = False
        records, self.records = self.records, []
        losses, self.losses = self.losses, []
        needed, self.untracked = self.untracked or not losses, False
        if not records or not needed or not self.serves():
            return
        if not alone:
            raise NotImplementedError(
                "jacmem: this model's curvature needs the autograd path (operations with no module-level "
                "Jacobian lie between its modules and the loss), which does not run beside first-order "
                "extensions: compute them in a separate block and backward"
            )
        roots = [tensors] if isinstance(tensors, Tensor) else list(tensors)
        if len(roots) != 1 or roots[0].grad_fn is None:
            raise ChainError(
                f"jacmem: the curvature of this model goes through operations that only autograd can "
                f"differentiate, which needs a backward from one loss tensor; this one starts from {len(roots)} "
                "tensors: sum the losses first (torch.stack(losses).sum().backward())"
            )
        root = get_gradient_edge(roots[0])
        handle = None

        def start(grad_outputs):
            if self.running:
                return
            handle.remove()
            self._run(root, grad_outputs[root.output_nr], records, losses)

        handle = root.node.register_prehook(start)
        self.handles.add(handle)
        self.busy = True

    def _run(self, root: GradientEdge, g_root: Tensor, records: list, losses: list) -> None:
        run = self.engine.passes.state(self.engine)
        self.busy = self.running = True
        try:
            with torch.enable_grad(), precision.computing(g_root.device):
                split = _split(root, records, losses)
                kinds = self.engine.kinds
                mc = any(k.samples for k in kinds)
                sampler = self._sampler(root, split, losses)
                self.notes = [_note(split, sampler, mc)]
                if EXACT in kinds or (sampler is None and mc):
                    L, g_z = self._loss_factor(root, g_root, split)
                else:
                    L, g_z = None, self._gradient(root, g_root, split, create_graph=False)
                empirical = self._empirical(root, g_root, split, losses) if EMPIRICAL in kinds else None
                factors = self._factors(L, split.shape, sampler, root, g_root, empirical)
                self._push(run, factors, g_z, split, records)
                run.autograd = _expected(split, records, g_z, losses)
        finally:
            self.busy = self.running = False

    def _gradient(self, root: GradientEdge, g_root: Tensor, split: Split, create_graph: bool) -> Tensor:
        """``∂L/∂z`` (with its graph where ``create_graph``, for the Hessian)."""
        (g_z,) = torch.autograd.grad(
            [root], [split.edge], [g_root], create_graph=create_graph, retain_graph=True, allow_unused=True
        )
        if g_z is None:
            raise ChainError(
                f"jacmem: the loss does not depend on {split.where}, where the GGN splits (with no single loss at "
                "the root, the autograd path takes the output of the last module with trainable parameters called "
                "before this backward for the model's output): call the loss's backward after each model's "
                "forward, with no module with parameters called after the model"
            )
        return g_z

    def _sampler(self, root: GradientEdge, split: Split, losses: list) -> tuple[Node, GradientEdge, list[Node]] | None:
        """Where the Monte-Carlo kinds can sample the loss's own labels (the loss
        module's ``sampled``: ``O(M)`` columns, whatever ``|z|``): ``(the loss's node,
        its output's edge, the nodes from the loss back to z)``. That needs one loss,
        which the root is a multiple of (``loss``, ``loss / count``): at its input
        where the GGN splits there (:func:`_split`), else on an input that ``z``
        reaches through linear links only (casts, reshapes, slices: no curvature
        between ``z`` and the loss, so ``z``'s loss Hessian is the loss's, carried back).
        ``None`` otherwise: the Monte-Carlo kinds then sample the Hessian's factor."""
        if len(losses) != 1 or not any(k.samples for k in self.engine.kinds):
            return None
        loss, edge, _ = losses[0]
        if split.node is None:
            return loss, edge, []
        if not _multiple_of(root, edge):
            return None
        z_node = split.node
        links, node = [], loss.producers[0] if loss.producers else None
        while node is not None and node is not z_node:
            entry = node.entry
            if entry is None or entry.curved or entry.d2f is not None or len(node.producers) != 1:
                return None
            links.append(node)
            node = node.producers[0]
        return (loss, edge, links) if node is z_node else None

    def _loss_factor(self, root: GradientEdge, g_root: Tensor, split: Split) -> tuple[Tensor, Tensor]:
        """``(L [N, D, K], ∂L/∂z)``: ``L_n L_nᵀ = H_n``, the loss Hessian of sample ``n``
        w.r.t. ``z``, where the GGN splits (double backward, from the root to ``z``
        only; checked block-diagonal and PSD)."""
        n, shape, z = split.shape[0], split.shape[1:], split.edge
        d = prod(shape)
        _check_cost(split.where, n, d, self.engine.kinds)
        g_z = self._gradient(root, g_root, split, create_graph=True)
        H = g_z.new_zeros(d, n, d)
        if g_z.requires_grad:  # else the loss is linear in z: H = 0
            step = max(1, int(self.engine.budget // max(n * d * g_z.element_size() * 4, 1)))
            for start in range(0, d, step):
                k = min(step, d - start)
                E = torch.zeros(k, n, d, dtype=g_z.dtype, device=g_z.device)
                E[torch.arange(k), :, torch.arange(start, start + k)] = 1
                (Hk,) = torch.autograd.grad(
                    [g_z], [z], [E.reshape(k, n, *shape)], is_grads_batched=True, retain_graph=True
                )
                H[start : start + k] = Hk.reshape(k, n, d)
            self._check_separable(g_z, z, H, split.where)
        H = H.permute(1, 2, 0)  # [N, D (row), D (probe)]
        lam, U = torch.linalg.eigh((H + H.transpose(1, 2)) / 2)
        top = float(lam.abs().max())
        tol = top * d * torch.finfo(lam.dtype).eps * 10
        if bool((lam < -max(tol, _LOOSE * top)).any()):
            raise ChainError(
                f"jacmem: the loss is not convex in {split.where}, where the GGN splits (its Hessian there has the "
                f"eigenvalue {float(lam.min()):.3g}): some operation with curvature lies between there and the loss. "
                "Compute the loss from the model's output directly, with one loss module or function "
                "(CrossEntropyLoss, MSELoss, BCEWithLogitsLoss), where the GGN then splits"
            )
        keep = (lam > tol).any(0)
        keep[-1] = True  # one column at least: a loss linear in z has a GGN of zeros, not none
        L = U[:, :, keep] * lam[:, keep].clamp(min=0).sqrt().unsqueeze(1)
        return L, g_z.detach()

    def _check_separable(self, g_z: Tensor, z: GradientEdge, H: Tensor, where: str) -> None:
        """``H [D, N, D]`` holds every sample's Hessian block only if the loss has no
        cross-sample terms: checked on one random vector against the whole Hessian."""
        n = H.shape[1]
        w = torch.randn(g_z.shape, dtype=g_z.dtype, device=g_z.device)
        (Hw,) = torch.autograd.grad([g_z], [z], [w], retain_graph=True)
        blocks = torch.einsum("dne,ne->nd", H, w.reshape(n, -1))
        diff, scale = float((Hw.reshape(n, -1) - blocks).norm()), float(Hw.norm() + blocks.norm())
        if diff > max(tolerance(g_z.dtype), _LOOSE) * max(scale, torch.finfo(g_z.dtype).tiny):
            raise ChainError(
                f"jacmem: the loss couples the samples at {where}, where the GGN splits (its "
                "Hessian there is not block-diagonal over the batch), so it has no per-sample GGN: compute the loss "
                "as a sum or mean of per-sample terms"
            )

    def _empirical(self, root: GradientEdge, g_root: Tensor, split: Split, losses: list) -> Tensor:
        """The empirical Fisher's root at ``z``, ``[1, N, *z]`` (module docstring)."""
        if not losses:
            raise ChainError(
                "jacmem: the backward's root calls no loss that has an empirical Fisher "
                f"({', '.join(t.__name__ for t, e in LOSSES.items() if e.empirical and t is not StandInLoss)}, as a module "
                "or its F. function): use one of them, "
                "or a GGN kind (KFAC, KFLR)"
            )
        if len(losses) > 1:
            raise several_losses([node for node, _, _ in losses])
        node, out, x = losses[0]
        if node.loss.empirical is None or x is None:
            raise NotImplementedError(
                f"jacmem: loss {node} gives no empirical Fisher (a loss of its own without one, or called with its "
                "input by keyword): call it as loss(input, target), or use a GGN kind (KFAC, KFLR)"
            )
        (c,) = torch.autograd.grad([root], [out], [g_root], retain_graph=True)  # the loss's weight
        hp = {k: v for k, v in node.hp.items() if k != "forward"}
        y = node.inputs[1] if len(node.inputs) > 1 else None
        S = node.loss.empirical(node.inputs[0], y, **hp)[0] * c.clamp(min=0).sqrt()
        if split.node is not None:
            (S,) = torch.autograd.grad([x], [split.edge], [S], retain_graph=True)
        return S.detach().unsqueeze(0)

    def _factors(
        self, L: Tensor | None, shape: tuple[int, ...], sampler, root: GradientEdge, g_root: Tensor, empirical
    ) -> dict[FactorKind, Tensor]:
        """Each kind's factor at ``z``, ``[V, N, *z]`` (module docstring): the
        Monte-Carlo kinds' from the loss's own sampled labels where ``sampler`` (see
        :meth:`_sampler`), else from ``L``; ``empirical`` (:meth:`_empirical`) as it is."""
        out = {} if empirical is None else {EMPIRICAL: empirical}
        for kind in sorted(k for k in self.engine.kinds if k.ggn):
            if not kind.samples:
                out[kind] = L.permute(2, 0, 1).reshape(L.shape[2], *shape)
            elif sampler is not None:
                out[kind] = _sampled(sampler, kind.samples, root, g_root).reshape(-1, *shape)
            else:
                n, _, k = L.shape
                m = kind.samples
                eps = torch.randn(m, n, k, dtype=L.dtype, device=L.device)
                out[kind] = torch.einsum("ndk,mnk->mnd", L, eps).div_(sqrt(m)).reshape(m, *shape)
        return out

    def _push(self, run, factors: dict[FactorKind, Tensor], g_z: Tensor, split: Split, records: list) -> None:
        """Every kind's factor from ``z`` to each module's output, in slices of its ``V``
        columns under ``chunk_bytes`` (one batched backward each); the modules' results
        staged in ``run``. Where the columns come in more than one slice and an extension
        needs something of all of them first (:attr:`SecondOrderExtension.fits`: EKFAC's
        eigenbases), the slices are taken twice: that ``fit`` first (:meth:`_fit`)."""
        nodes, edges, z = [r[0] for r in records], [r[1] for r in records], split.edge
        n = split.shape[0]
        shared = [i for i, node in enumerate(nodes) if _shared(node, n)]
        column = (prod(split.shape) + sum(prod(node.out_shape) for node in nodes)) * g_z.element_size()
        step = max(1, int(self.engine.budget // max(column, 1)))
        acc: list[dict] = [{} for _ in nodes]  # per node: {param: {ext: merged result}}
        adds = _broadcast_adds(z, [edges[i] for i in shared]) if shared else []
        direct = [add for add in adds if add is not None]  # taken in the same backward as the modules' outputs

        def columns(S: Tensor):
            """Per slice of ``S``'s columns, each node's ``[v, N, *out]`` (``None`` where
            unused; a shared call's ``[v, N, 1, *out]``), a list the caller empties as it
            goes (each freed once used)."""
            for start in range(0, S.shape[0], step):
                cols = S[start : start + step]
                grads = _batched_vjps(z, edges + direct, cols)
                grads, at_adds = grads[: len(edges)], grads[len(edges) :]
                if shared:
                    shapes = [nodes[i].out_shape for i in shared]
                    per = _per_sample(z, [edges[i] for i in shared], shapes, cols, max(1, step // n), adds, at_adds)
                    for k, i in enumerate(shared):
                        grads[i] = per[k]
                yield grads

        for kind, S in factors.items():
            exts = [e for e in self.engine.extensions if kind in e.kinds]
            fitting = [e for e in exts if e.fits] if S.shape[0] > step else []
            fits = self._fit(nodes, shared, kind, fitting, columns(S)) if fitting else [{} for _ in nodes]
            for grads in columns(S):
                for i, node in enumerate(nodes):
                    G, grads[i] = grads[i], None
                    if G is not None:
                        self._compute(
                            node, acc[i], exts, kind, in_compute_dtype(node, G.detach()), i in shared, fits[i]
                        )
        for node, results in zip(nodes, acc):
            self.engine.stage(
                run,
                node,
                {
                    p: {e.savefield: precision.result(v, node.params[p]) for e, v in results.get(p, {}).items()}
                    for p in node.params
                },
            )

    def _call(self, node, kind: FactorKind, G: Tensor, shared: bool) -> Call:
        """What the extensions see of ``node`` with the slice ``G [v, N, *out]`` at its
        output. A shared call's ``G [v, N, 1, *out]`` is taken as the call repeated over
        the batch (:func:`_repeated`), so that sample ``n``'s gradient of its parameters
        is the sum over that sample's uses of it, as for a call per sample (EKFAC's
        correction needs those, all at once)."""
        call = self.engine.call(node, [Factor(kind, 1.0, G.squeeze(2) if shared else G)], None)
        return _repeated(call, G.shape[1]) if shared else call

    def _fit(self, nodes: list, shared: list, kind: FactorKind, exts: list, columns) -> list[dict]:
        """The first of two passes over the slices ``columns`` (:meth:`_push`): per node,
        ``{ext: its fit over all the slices}`` (:meth:`SecondOrderExtension.fit`, merged
        by ``merge_fit``); a module an extension has nothing for gets none (``compute``
        then warns)."""
        fits: list[dict] = [{} for _ in nodes]
        for grads in columns:
            for i, node in enumerate(nodes):
                G, grads[i] = grads[i], None
                if G is None:
                    continue
                call = self._call(node, kind, in_compute_dtype(node, G.detach()), i in shared)
                for ext in exts:
                    try:
                        part = ext.fit(call)
                    except UnsupportedModule:
                        continue
                    have = fits[i].get(ext)
                    fits[i][ext] = part if have is None else {p: ext.merge_fit(have[p], v) for p, v in part.items()}
        return fits

    def _compute(self, node, acc: dict, exts: list, kind: FactorKind, G: Tensor, shared: bool, fits: dict) -> None:
        """The extensions' results for ``node`` from one slice ``G [v, N, *out]`` (a
        shared call's ``[v, N, 1, *out]``: :meth:`_call`), merged into ``acc``
        (``{param: {ext: result}}``), each with its fit over all the slices where it has
        one (``fits``: :meth:`_fit`); the tied parameters' vectors are gathered
        (:meth:`SecondOrderEngine.gather_column`)."""
        if node.tied:
            self.engine.gather_column(self.engine.passes.state(self.engine), node, kind, G, shared)
        call = self._call(node, kind, G, shared)
        for ext in exts:
            try:
                out = self.engine.run_extension(ext, replace(call, fitted=fits[ext]) if ext in fits else call)
                for pname, value in (out or {}).items():
                    have = acc.setdefault(pname, {}).get(ext)
                    acc[pname][ext] = value if have is None else ext.merge_chunks(have, value)
            except NotImplementedError as err:  # a merge the extension cannot make: name the module
                raise NotImplementedError(f"{err} (module {node})") from err

    def _check(self, node: Node, grad: Tensor) -> None:
        """autograd's gradient at a module's output, where the path ran: all of it must
        have come through ``z`` (module docstring)."""
        if self.busy:
            return
        run = self.engine.passes.state(self.engine)
        if run.autograd is None or run.autograd is _THROUGH_Z:
            return
        want = run.autograd.get(id(node))
        have = _summary(grad)
        norm = have[0] + (want[0] if want is not None else 0.0)
        tol = tolerance(grad.dtype) * max(norm, torch.finfo(grad.dtype).tiny)
        if want is None:
            off = have[0] > tol
        else:
            off = abs(have[0] - want[0]) > tol or abs(have[1] - want[1]) > tol * sqrt(grad.numel())
        if off:
            raise ChainError(
                f"jacmem: the output of module {node} reaches the loss other than through where the GGN splits (the "
                "autograd path takes that to be the input of the loss at the backward's root, or, with no single "
                "loss there, the output of the last module with trainable parameters called before the backward): "
                "compute the loss from the model's output alone (no auxiliary losses on hidden states or "
                "parameters), or freeze that module's parameters"
            )


#: :meth:`AutogradPath._check`'s reference where every gradient passes through ``z`` by
#: the graph's shape (:func:`_expected`): nothing to compare
_THROUGH_Z: dict = {}

#: how many autograd nodes between a loss's output and its input :func:`_only_through` walks
_LOSS_NODES = 64


def _expected(split: Split, records: list, g_z: Tensor, losses: list) -> dict:
    """:meth:`AutogradPath._check`'s reference: ``{id(node): the summary of the image of
    ∂L/∂z at its output}`` (one backward); :data:`_THROUGH_Z` where ``z`` is the input of
    the loss that the root is a multiple of (:func:`_split`) and the loss's graph takes
    nothing else that needs a gradient: every gradient then comes through ``z``."""
    if split.node is None and _only_through(losses[0][1], split.edge):
        return _THROUGH_Z
    nodes, edges = [r[0] for r in records], [r[1] for r in records]
    return {id(node): _summary(G) for node, G in zip(nodes, _vjps(split.edge, edges, g_z)) if G is not None}


def _only_through(out: GradientEdge, z: GradientEdge) -> bool:
    """Whether every path of autograd's graph from ``out`` down ends at ``z`` (or at a
    tensor that needs no gradient), within :data:`_LOSS_NODES` nodes."""

    def elsewhere(nxt, nr: int) -> bool:  # another output of z's node, or a leaf (a parameter)
        return nxt is z.node and nr != z.output_nr or nxt is not z.node and not nxt.next_functions

    def step(fn) -> list:
        return [nxt for nxt, nr in walker.edges(fn) if nxt is not z.node]

    walk = walker.Walk([out.node], step, limit=_LOSS_NODES)
    for fn in walk:
        if any(elsewhere(nxt, nr) for nxt, nr in walker.edges(fn)):
            return False
    return not walk.cut


def _sampled(sampler: tuple, m: int, root: GradientEdge, g_root: Tensor) -> Tensor:
    """The loss's Monte-Carlo factor ``[M, N, *x]`` at its input ``x`` (gradients at
    labels drawn from the model's predictive, :class:`jacmem.derivatives.LossHessian`),
    times the square root of the loss's weight in the root, carried back to ``z``
    through the linear links: ``[M, N, *z]``."""
    loss, edge, links = sampler
    (c,) = torch.autograd.grad([root], [edge], [g_root], retain_graph=True)
    compat.assert_on_device(
        c >= 0, "jacmem: the loss enters the backward with a negative weight; the GGN needs it >= 0"
    )
    x, y = loss.inputs[0], loss.inputs[1] if len(loss.inputs) > 1 else None
    hp = {k: v for k, v in loss.hp.items() if k != "forward"}
    S = loss.loss.sampled(x, y, m, **hp) * c.sqrt()
    for node in links:
        (S,) = node.entry.backprop(node.inputs, node.out, S, node.hp)
    return S


class Split(NamedTuple):
    """Where the GGN splits, ``z`` in ``Σ_n J_nᵀ H_n J_n``."""

    #: the words that name it in errors
    where: str
    #: ``[N, *z]``
    shape: tuple[int, ...]
    edge: GradientEdge
    #: the module whose output it is; ``None`` at the loss's input
    node: Node | None


def _split(root: GradientEdge, records: list, losses: list) -> Split:
    """Where the GGN splits: at the input of the loss where the root is one registered
    loss times a factor, on an input with the batch axis first (everything between the
    parameters and the loss, frozen modules and curved operations included, is then
    in ``J``: the GGN of the parameters w.r.t. the loss's input, as in a frozen-head
    LoRA); else at the output of the last module with trainable parameters."""
    z_node, z = records[-1]
    if len(losses) == 1:
        loss, edge, x = losses[0]
        shape = tuple(loss.inputs[0].shape)
        batch = z_node.out_shape[0] in (shape[0], 1) if shape else False  # 1: a call the batch shares
        if x is not None and batch and _multiple_of(root, edge):
            return Split(f"the input of loss {loss}", shape, x, None)
    return Split(f"the output of module {z_node}", tuple(z_node.out_shape), z, z_node)


#: autograd nodes that take one tensor to a multiple of it (by a number, or by a tensor
#: that needs no gradient: HF's ``loss / num_items_in_batch``)
_SCALINGS = {"MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1", "NegBackward0", "CloneBackward0"}


def _multiple_of(root: GradientEdge, edge: GradientEdge) -> bool:
    """Whether the root is the tensor at ``edge`` times a factor (no other terms)."""
    fn, nr = root.node, root.output_nr
    for _ in range(16):
        if fn is edge.node and nr == edge.output_nr:
            return True
        following = walker.edges(fn)
        if fn.name() not in _SCALINGS or len(following) != 1:
            return False
        fn, nr = following[0]
    return False


#: the most bytes the exact loss Hessian at the model's output (``[N, D, D]``) may take
_EXACT_BYTES = 2**32
#: the extensions that sample, for the messages that name them where the exact ones cannot run
_MC_KINDS = "DiagGGNMC, KFAC, SqrtGGNMC, BatchDiagGGNMC"


def _check_cost(where: str, n: int, d: int, kinds) -> None:
    """Raise, before any work, where the loss Hessian at ``z`` (``where``: ``D``
    backward columns per sample, ``N·D²`` entries) is out of reach."""
    size = _hessian_bytes(n, d)
    if size <= _EXACT_BYTES:
        return
    fix = (
        f"use the Monte-Carlo kinds ({_MC_KINDS}), which sample the loss's labels and cost one backward per sample"
        if EXACT in kinds
        else "the Monte-Carlo kinds sample the loss's labels only where the root is one loss (CrossEntropyLoss, "
        "MSELoss, BCEWithLogitsLoss, as a module or function) times a factor, on the model's output through casts, "
        "reshapes and slices: compute the loss that way"
    )
    raise RuntimeError(
        f"jacmem: the curvature at {where}, where the GGN splits, needs the loss Hessian there whole: {d} backward "
        f"columns per sample and {n}x{d}x{d} entries (at least {size / 2**30:.0f} GiB), out of reach: {fix}"
    )


def _hessian_bytes(n: int, d: int) -> int:
    """The bytes of the loss Hessian ``[N, D, D]`` at ``z``, in float32 at least."""
    return n * d * d * 4


def _note(split: Split, sampler, mc: bool) -> str:
    """What the path chose for :meth:`jacmem.engine.block.Block.explain`: where the GGN
    splits, whether the exact kinds' loss Hessian there is in reach, and (``mc``: the
    block has Monte-Carlo kinds) what they sample (``sampler``: :meth:`AutogradPath._sampler`)."""
    n, d = split.shape[0], prod(split.shape[1:])
    size = _hessian_bytes(n, d)
    reach = (
        "in reach"
        if size <= _EXACT_BYTES
        else "out of reach: the exact kinds (DiagGGNExact, KFLR, SqrtGGNExact, BatchDiagGGNExact) refuse, use "
        f"the Monte-Carlo kinds ({_MC_KINDS})"
    )
    drawn = (
        "the loss's labels, one backward column per Monte-Carlo sample"
        if sampler is not None
        else "the loss Hessian's factor"
    )
    return (
        f"curvature by the autograd path: the GGN splits at {split.where}, {d} outputs per sample; the exact "
        f"kinds' loss Hessian there ({n}x{d}x{d}, {d} backward columns) is {reach}"
        + (f"; the Monte-Carlo kinds sample {drawn}" if mc else "")
    )


def _shared(node, n: int) -> bool:
    """A call whose output all ``n`` samples share (batch axis 1, broadcast over the
    batch: BERT's position embeddings); raises where its batch axis is neither."""
    b = node.out_shape[0] if node.out_shape else None
    if b == n:
        return False
    if b == 1:
        return True
    raise ChainError(
        f"jacmem: the output of module {node} has {b} rows where the model's output has {n} samples: the "
        "autograd path needs every module with parameters called per sample (batch axis first) or once for "
        "all samples (batch axis 1). Keep the batch axis through the model (no flattening of tokens into it)"
    )


def _repeated(call: Call, n: int) -> Call:
    """A call whose output all ``n`` samples share (batch axis 1), as if each sample made
    it: its kept input and arguments with 1 row expanded to ``n`` (views), its output
    shape ``[n, *out]``. Each sample's Jacobian is the shared call's."""

    def expand(x):
        if isinstance(x, Tensor):
            return x.expand(n, *x.shape[1:]) if x.dim() and x.shape[0] == 1 else x
        return type(x)(map(expand, x)) if isinstance(x, (tuple, list)) else x

    inputs = None if call.inputs is None else expand(call.inputs)
    return replace(call, x=expand(call.x), inputs=inputs, out_shape=(n, *call.out_shape[1:]))


def _vjps(z: GradientEdge, edges: list, s: Tensor) -> list[Tensor | None]:
    """One column ``s [N, *z]`` to each edge (``None`` where unused)."""
    return list(torch.autograd.grad([z], edges, [s], retain_graph=True, allow_unused=True))


def _batched_vjps(z: GradientEdge, edges: list, cols: Tensor) -> list[Tensor | None]:
    """Columns ``cols [v, N, *z]`` to each edge, one batched backward: ``[v, N, *out]``."""
    if cols.shape[0] == 1:
        return [None if G is None else G.unsqueeze(0) for G in _vjps(z, edges, cols[0])]
    return list(torch.autograd.grad([z], edges, [cols], retain_graph=True, allow_unused=True, is_grads_batched=True))


def _per_sample(
    z: GradientEdge, edges: list, shapes: list, cols: Tensor, step: int, adds: list, at_adds: list
) -> list[Tensor | None]:
    """Columns ``cols [v, N, *z]`` to shared outputs ``[1, *out]``, one sample at a time
    (the VJP of a whole column would sum the samples): ``[v, N, 1, *out]`` (``shapes``:
    each output's, ``[1, *out]``). An output that enters the batch by one broadcast
    addition (``adds``, by :func:`_broadcast_adds`: BERT's position embeddings) takes
    the columns at that addition's output ``[v, N, *out]`` (``at_adds``, one per addition
    found, from the backward that gave the other modules theirs), which is its gradient
    sample by sample; any other, each column split into its ``N`` samples' parts,
    ``step`` columns' parts (``step·N``) per batched backward."""
    v, n = cols.shape[:2]
    out: list[Tensor | None] = [None] * len(edges)
    direct = [k for k, add in enumerate(adds) if add is not None]
    for k, G in zip(direct, at_adds):
        if G is not None and G.shape[1:] == (n, *shapes[k][1:]):  # else the addition broadcasts more
            out[k] = G.unsqueeze(2)
    rest = [k for k, add in enumerate(adds) if add is None or out[k] is None]
    if not rest:
        return out
    eye = torch.eye(n, dtype=cols.dtype, device=cols.device).reshape(1, n, n, *[1] * (cols.dim() - 2))
    parts = []
    for start in range(0, v, step):
        one = (eye * cols[start : start + step, None]).flatten(0, 1)  # [k·N, N, *z]: sample m's part alone
        parts.append(_batched_vjps(z, [edges[k] for k in rest], one))
    for j, k in enumerate(rest):
        if parts[0][j] is not None:
            out[k] = torch.cat([p[j] for p in parts]).reshape(v, n, *parts[0][j].shape[1:])
    return out


def _broadcast_adds(z: GradientEdge, edges: list) -> list[GradientEdge | None]:
    """Per shared output, the output edge of the addition through which alone it reaches
    ``z`` (an ``AddBackward0`` with ``alpha`` 1, the output its only use there, found by
    walking autograd's graph back from ``z``), ``None`` where there is no such one. Its
    other operand carries the batch: its gradient is the shared output's, per sample."""
    users: list[list] = [[] for _ in edges]

    def step(fn) -> list:
        following = []
        for nxt, nr in walker.edges(fn):
            hit = [k for k, e in enumerate(edges) if nxt is e.node and nr == e.output_nr]
            for k in hit:
                users[k].append(fn)
            if not hit:
                following.append(nxt)
        return following

    walker.Walk([z.node], step)
    return [
        GradientEdge(u[0], 0)
        if len(u) == 1 and u[0].name() == "AddBackward0" and compat.saved_value(u[0], "alpha") == 1
        else None
        for u in users
    ]


def _summary(g: Tensor) -> tuple[float, float]:
    """What the check compares of a gradient: its norm and its sum."""
    return float(g.norm()), float(g.sum())
