"""The second-order engine: factors flow backward module by module, checked against autograd.

In the forward pass (inside :func:`jacmem.extend`), every call of a module that
:mod:`jacmem.derivatives.jacobians` knows (a layer it can pass factors through, or a
loss) becomes a :class:`Node`: its inputs, its output where its derivatives read it,
and, for each input, the node that produced it (if a tracked module did). So does each
call of a function of :data:`jacmem.derivatives.functional.FUNCTIONAL` made outside
the modules it knows (``F.relu``, ``torch.flatten``, ``out += identity``,
``F.cross_entropy``), with the derivatives of its module equivalent: a
:class:`torch.overrides.TorchFunctionMode` (:class:`_Functional`) sees the calls while
the block is open, and nothing outside it; the engine's own tensor work runs without
it. A function call becomes a node where it takes a tracked output (a loss: always; an
op after a loss: never). In-place calls (``relu_``, ``add_``, ``nn.ReLU(inplace=True)``)
are nodes whose input is the graph edge the in-place op took (read before the call, or
from its autograd node). **Where the GGN splits:** at the input of the recognised loss
(a loss module, or a loss function of the table); where that input is the output of a
reshape that merged the batch axis with the next ones (``logits.view(-1, V)``), at the
tensor before the reshape, whose rows are the samples. A loss with
``reduction="none"`` is recognised at its ``.sum()`` or ``.mean()``.

A hook on the node's output runs when autograd has the gradient of that output, which
is after every consumer of the output has run its own hook:

1. A loss node makes the factors of its Hessian (exact, sampled, or KFRA's
   batch-summed dense Hessian; or the empirical Fisher's, its gradient at the true
   targets) and hands them to its input's producer.
2. Any other node sums what its consumers handed it, lets the extensions compute its
   parameters' quantities, and hands ``Jᵀ S`` (and, for DiagHessian, its own
   residual factors) to its inputs' producers. Each factor is freed as soon as it has
   crossed the module: memory holds the factors of one layer's input and output at a
   time, and factors larger than the block's ``chunk_bytes`` cross in slices of ``V``.
   KFRA's matrix crosses as ``1/N Σ_n J_nᵀ Ḡ J_n``; at a module with several inputs it
   goes on as per-sample roots, which collapse back where all their paths have met
   (:mod:`.kfac` gives the rule).

**The chain check.** Each node compares the gradient autograd delivers to its output
with the part of it that came through the tracked modules that consume the output:
autograd computes that part itself, ``J_cᵀ g_c`` for each consumer ``c``, and a hook on
each autograd node of ``c``'s call that takes the output directly (found at forward
time, by a search of ``c``'s own graph) hands it over, so the check costs no
arithmetic but a comparison (none when the only consumer's part is autograd's very
tensor). They differ (beyond rounding) exactly when some operation jacmem does not
see sits between this module and the loss (``torch.sin(x)``, ``x * y``, a broadcast
sum on a branch); then, or when nothing was handed over at all, the backward raises
:class:`ChainError`, naming the module, the op that took its output (its ``grad_fn``)
and the tracked call it leads to, rather than return a wrong curvature. A consumer whose own graph is too large to search (past
``_TAP_NODES`` autograd nodes) hands over ``J_cᵀ g_c`` computed by its Jacobian
instead, as one more row beside the factors. (What the check cannot see: an operation
applied *after* the loss. A loss scaled by ``c > 0`` or a sum of losses is fine; the
Hessian of anything else is not the GGN's.)
"""

from __future__ import annotations

from fractions import Fraction
from math import sqrt

import torch
from torch import Tensor

from jacmem.derivatives import Passthrough
from jacmem.derivatives.jacobians import diagonal_factor, ea_jac_t_mat_jac, vjp_generic
from jacmem.derivatives.quantities import DENSE, EMPIRICAL, EXACT, RESIDUAL
from jacmem.engine import precision
from jacmem.engine.secondorder.graph import (
    ChainError,
    Deposit,
    Node,
    PassState,
    in_compute_dtype,
    several_losses,
    tolerance,
)
from jacmem.extensions.secondorder.base import Factor
from jacmem.extensions.secondorder.kfac import kfra_average, kfra_roots


class Chain:
    """The module chain's backward for one second-order engine (see the module docstring):
    at each node's output gradient, the node's quantities and the factors it hands on."""

    def __init__(self, engine):
        self.engine = engine

    def on_grad(self, run: PassState, node: Node, grad: Tensor) -> None:
        """The gradient of ``node``'s output arrived: a loss makes its factors, any other
        node computes its quantities and hands ``Jᵀ S`` on to its inputs' producers."""
        with precision.computing(grad.device):
            if node.loss is not None:
                self._loss(run, node, in_compute_dtype(node, grad) if node.kept_low_precision or node.dtype else grad)
            else:
                self._layer(run, node, grad)

    def _loss(self, run: PassState, node: Node, grad: Tensor) -> None:
        x, y = node.inputs[0], node.inputs[1] if len(node.inputs) > 1 else None
        if len(node.producers) > 1 and node.producers[1] is not None:
            raise NotImplementedError(
                f"jacmem: the target of loss {node} comes from tracked modules; second-order "
                "extensions need it constant (detach it)"
            )
        c = float(grad)
        if not c >= 0:
            raise ValueError(
                f"jacmem: loss {node} enters the backward with weight {c}; the GGN needs a non-negative "
                "one (call backward on the loss, a positive multiple of it, or a sum of losses)"
            )
        hp = {k: v for k, v in node.hp.items() if k != "forward"}
        factors: dict[tuple, Factor] = {}
        dense = None
        kinds = self.engine.kinds
        if any(k.exact_root for k in kinds):
            S = node.loss.sqrt_hessian(x, y, **hp) * sqrt(c)
            if DENSE in kinds:
                flat = S.flatten(2)
                dense = torch.einsum("vni,vnj->ij", flat, flat)
            if EXACT in kinds or RESIDUAL in kinds:
                factors[(EXACT, id(node), 1)] = Factor(EXACT, 1.0, S)
        for kind in sorted(k for k in kinds if k.samples):
            S = node.loss.sampled(x, y, kind.samples, **hp) * sqrt(c)
            factors[(kind, id(node), 1)] = Factor(kind, 1.0, S)
        if EMPIRICAL in kinds:
            run.empirical.append(node)
            if len(run.empirical) > 1:
                raise several_losses(run.empirical)
            factors[(EMPIRICAL, id(node), 1)] = Factor(EMPIRICAL, 1.0, _empirical(node, x, y, hp) * sqrt(c))
        g = vjp_generic(node.hp["forward"], node.inputs, grad.reshape(1))[0][0] if node.grad_by_jacobian else None
        run.handover(node, 0, factors, g, dense, {})

    def _layer(self, run: PassState, node: Node, grad: Tensor) -> None:
        dep = run.deposits.pop(id(node), None)
        _check_chain(node, dep, grad)  # in autograd's dtype, with its tolerance
        if node.kept_low_precision or node.dtype:
            grad = in_compute_dtype(node, grad)
        factors, dense, shares = dep.factors, self._kfra_whole(dep), dep.shares
        if node.params:
            self._compute(run, node, factors, dense)
        if not any(p is not None for p in node.producers):
            return
        entry, xs, hp = node.entry, node.inputs, node.hp
        if dense is not None and len(xs) > 1:
            # backward, the paths fork here: KFRA's matrix goes on as per-sample roots (kfac.py)
            for sign, S in kfra_roots(dense, xs[0].shape[0], node.out_shape[1:]):
                key = ("kfra", id(node), sign)
                factors[key], shares[key] = Factor("kfra", sign, S), Fraction(1)
            dense = None
        try:
            for key in list(factors):
                f = factors.pop(key)  # freed once it has crossed
                for i, S_in in enumerate(_owned(self._backprop(entry, xs, node.out, f.S, hp))):
                    run.deposit(node, i, key, f.kind, f.sign, S_in)
                del f
            rows = entry.backprop(xs, node.out, grad.unsqueeze(0), hp) if node.grad_by_jacobian else [None] * len(xs)
            residual = _residual(node, grad) if RESIDUAL in self.engine.kinds else {}
            dense_in = None if dense is None else ea_jac_t_mat_jac(entry, xs, node.out, node.out_shape, dense, hp)
        except (ChainError, NotImplementedError):
            raise
        except Exception as err:
            raise RuntimeError(f"jacmem: passing curvature through module {node} failed: {err}") from err
        tracked = sum(p is not None for p in node.producers)
        split = {key: share / tracked for key, share in shares.items()}
        for i, p in enumerate(node.producers):
            if p is not None:
                row = None if rows[i] is None else rows[i][0]
                run.handover(node, i, residual if i == 0 else {}, row, dense_in, split)

    @staticmethod
    def _kfra_whole(dep: Deposit) -> Tensor | None:
        """KFRA's matrix at this output: what arrived whole, plus the roots all of whose
        merge's paths met here, collapsed (kfac.py); the other roots stay in ``dep``."""
        dense = dep.dense
        for key in [k for k, share in dep.shares.items() if share == 1]:
            del dep.shares[key]
            f = dep.factors.pop(key, None)
            if f is None:  # its paths carried nothing (inputs that need no factor)
                continue
            part = f.sign * kfra_average(f.S)
            dense = part if dense is None else dense + part
        return dense

    def _backprop(self, entry: Passthrough, xs, out, S: Tensor, hp: dict) -> tuple[Tensor | None, ...]:
        """``Jᵀ S`` per input, in slices of ``V`` where ``S`` is larger than the budget;
        ``S`` is the engine's own (no one else holds it): elementwise maps overwrite it."""
        if entry.elementwise:
            return entry.backprop(xs, out, S, hp, inplace=True)
        v = S.shape[0]
        step = max(1, int(self.engine.budget // max(S[0].numel() * S.element_size() * 2, 1)))
        if step >= v:
            return entry.backprop(xs, out, S, hp)
        outs: list | None = None
        for start in range(0, v, step):
            part = entry.backprop(xs, out, S[start : start + step], hp)
            if outs is None:
                outs = [None if t is None else t.new_empty((v, *t.shape[1:])) for t in part]
            for o, t in zip(outs, part):
                if o is not None:
                    o[start : start + step] = t
        return tuple(outs)

    def _compute(self, run: PassState, node: Node, factors: dict[tuple, Factor], dense: Tensor | None) -> None:
        """The extensions' results for ``node``'s parameters, staged; its tied ones' vectors
        gathered instead, per factor key (:meth:`SecondOrderEngine.gather`)."""
        self.engine.check_unshared(run, node)
        if node.tied:
            self.engine.gather(run, node, factors)
        call = self.engine.call(node, list(factors.values()), dense)
        results: dict[str, dict[str, object]] = {pname: {} for pname in call.params}
        for ext in self.engine.extensions if call.params else ():
            out = self.engine.run_extension(ext, call)
            for pname, value in (out or {}).items():
                results[pname][ext.savefield] = precision.result(value, node.params[pname])
        self.engine.stage(run, node, results)


def _empirical(node: Node, x: Tensor, y: Tensor | None, hp: dict) -> Tensor:
    """The empirical Fisher's root at the loss's input, ``[1, N, *x]``; raises for a loss
    that has none."""
    if node.loss.empirical is None:
        raise NotImplementedError(f"jacmem: loss {node} has no empirical Fisher; use a GGN kind (KFAC, KFLR)")
    return node.loss.empirical(x, y, **hp)


def _residual(node: Node, grad: Tensor) -> dict[tuple, Factor]:
    """DiagHessian's residual of an elementwise activation at its input:
    ``f''(x) ⊙ g_out`` split into ``diag(√r₊)`` (+) and ``diag(√r₋)`` (-)."""
    entry = node.entry
    if entry.curved:
        raise NotImplementedError(
            f"jacmem: DiagHessian cannot pass curvature through module {node}: its second derivative w.r.t. "
            "its input is not zero and jacmem has none; use DiagGGNExact"
        )
    if entry.d2f is None:
        return {}
    r = entry.d2f(node.inputs[0], node.out, **node.hp) * grad
    out = {}
    for sign, part in ((1.0, r.clamp(min=0)), (-1.0, (-r).clamp(min=0))):
        if bool(part.any()):
            out[(RESIDUAL, id(node), sign)] = Factor(RESIDUAL, sign, diagonal_factor(part.sqrt()))
    return out


def _check_chain(node: Node, dep: Deposit | None, grad: Tensor) -> None:
    fix = (
        " Second-order extensions follow a chain of modules, and of the functional ops in "
        "jacmem.derivatives.functional.FUNCTIONAL (F.relu, x + y, x * c, torch.flatten, F.cross_entropy, ...), "
        "from the loss back: write other operations as modules that jacmem knows (jacmem.nn.Scale, "
        "jacmem.nn.Sum / jacmem.nn.Residual / jacmem.nn.Parallel for sums and skip connections) or register "
        "one (jacmem.derivatives.passthrough), and compute the loss inside the block."
    )
    downstream = ""
    if node.untracked_consumers:
        names = ", ".join(dict.fromkeys(node.untracked_consumers))
        downstream = f" on its way to {names}"
    if dep is None:
        raise ChainError(
            f"jacmem: the output of module {node} reaches the loss only through operations jacmem cannot "
            f"backpropagate curvature through{downstream}." + fix
        )
    if len(dep.grads) == 1 and _same(dep.grads[0], grad):
        return  # one consumer, whose part autograd passed on as it was: nothing else added to it
    diff = float((sum(dep.grads) - grad).norm()) if dep.grads else float(grad.norm())
    scale = sum(float(g.norm()) for g in dep.grads) + float(grad.norm())
    if diff == diff and diff > tolerance(grad.dtype) * scale:  # NaN passes: nothing to compare
        raise ChainError(
            f"jacmem: the output of module {node} reaches the loss through operations jacmem cannot "
            f"backpropagate curvature through{downstream}, besides the tracked modules "
            f"{', '.join(map(repr, dict.fromkeys(dep.sources)))} (the gradient they pass back differs "
            f"from autograd's by {diff / max(scale, 1e-300):.2e}, relative)." + fix
        )


def _same(a: Tensor, b: Tensor) -> bool:
    """The same numbers: one tensor, or views of the same memory alike."""
    return a is b or (
        a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
    )


def _owned(tensors: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
    """Each deposit owns its tensor (deposits are updated in place): a tensor handed to
    several inputs (a Sum's) is copied for all but the first."""
    seen: set = set()
    out = []
    for t in tensors:
        out.append(t.clone() if t is not None and id(t) in seen else t)
        seen.add(id(t))
    return tuple(out)
