"""KFAC, KFLR and KFRA: Kronecker factors of the GGN, as BackPACK 1.7.1 lays them out.

For a weight, ``[G, A]`` with ``G ⊗ A`` approximating its GGN block (row-major
``vec``); for a bias, ``[G]``. ``G`` comes from the output side, ``A`` from the input.

**The output factor** ``G`` of a layer whose output has ``O`` channels, from what the
engine (:mod:`jacmem.engine.secondorder.engine`) brings to the output:

* KFAC (``mc_samples`` Monte-Carlo factors) and KFLR (the exact factor): roots
  ``S [V, N, *out]`` with ``Σ_v S[v, n] S[v, n]ᵀ`` sample ``n``'s GGN w.r.t. the output;
  ``G = Σ_v Σ_n s sᵀ``;
* KFRA (Botev et al. 2017): ``Ḡ [D, D]`` (``D`` the entries of one sample's output),
  the loss's batch-summed Hessian carried back with the batch average taken at every
  module, ``Ḡ_in = 1/N Σ_n J_nᵀ Ḡ_out J_n``; ``G`` is read off ``Ḡ`` the way KFLR's is
  read off ``Σ_v Σ_n S Sᵀ`` (below, and the branches section).

**Per layer**, as each layer file registers its rules beside its derivatives
(:class:`jacmem.derivatives.Kronecker`: the input factor, the output's layout, the
settings it refuses); a layer without them raises :class:`.UnsupportedModule`. With
the default ``kfac_approx=None`` (the section on ``kfac_approx`` below gives the other
two; ``N`` samples; ``T`` positions: the middle axes of a Linear or Embedding input
``[N, *, ·]``, the output positions of a convolution; ``s_t`` the root's entries at
position ``t``, ``[O]``):

* Linear, input ``[N, *, I]``: ``G = Σ_{v,n,t} s_t s_tᵀ``, position by position (KFRA:
  ``Σ_t Ḡ[t, t]``, the diagonal position blocks); ``A = Σ_{n,t} x_t x_tᵀ / (N·T)``.
* Conv1d/2d/3d: ``G = Σ_{v,n} (Σ_t s_t)(Σ_t s_t)ᵀ``, summed over positions first (KFRA:
  ``Σ_{t,t'} Ḡ[t, t']``); ``A = Σ_{n,t} a_t a_tᵀ / N`` over the im2col columns ``a_t``
  ``[C_in·K]``.
* ConvTranspose1d/2d/3d: ``G`` as for Conv; ``A`` as for Conv, over the columns of the
  input unfolded by a transposed convolution with one-hot kernels.
* Embedding, input ``[N, *]``: ``G`` as for Linear; ``A`` diagonal, ``a[v]`` = the count
  of index ``v`` among the ``N·T`` positions ``/ (N·T)``.

* *Linear with middle axes*: the axes are flattened into the batch: the factors are
  those of the same layer applied to ``x.reshape(N·T, I)`` (KFAC-expand, Eschenhagen
  et al. 2023); for a 2d input, ``T = 1`` and these are BackPACK's. BackPACK 1.7.1
  raises for such inputs.
* *HF transformers' Conv1D* (GPT-2's linear layer, ``weight [I, O]``): a Linear's
  factors, ``G ⊗ A`` approximating the block of ``weight.T`` ``[O, I]`` (the Linear's
  layout, as for Embedding).
* *LayerNorm, RMSNorm* (``weight``, ``bias`` ``[D]``, each entry scaled by its own
  parameter): no Kronecker form; KFAC and KFLR give each parameter its GGN diagonal
  from their own factors (Monte-Carlo for KFAC, exact for KFLR), as a one-entry list
  ``[d]``, ``d.shape == param.shape`` (DiagGGNMC's/DiagGGNExact's value). KFRA raises
  (use KFLR). Their input Jacobian is the vjp of their forward; DiagHessian raises
  through them (their second derivative is not zero).
* *Convolutions*: BackPACK's convention by default (``G`` is also the bias's factor,
  which makes ``G ⊗ A`` ``T`` times the KFC paper's; ``kfac_approx`` below). *Transposed* convolutions, as BackPACK's:
  ``G ⊗ A`` approximates the block of ``weight.transpose(0, 1)``, ``[C_out, C_in, *K]``
  (``A`` [C_in·K, C_in·K]); ``output_padding`` is honoured (BackPACK 1.7.1 unfolds as if
  it were 0).
* *Grouped convolutions* (``groups = g > 1``, which BackPACK refuses): the factorisation
  is per group, and the curvature between groups is dropped: ``G [g, O/g, O/g]`` and
  ``A [g, I/g·K, I/g·K]``, the weight's block approximated by
  ``block_diag(G[0] ⊗ A[0], ..., G[g-1] ⊗ A[g-1])`` (rows of group ``j`` are output
  channels ``j·O/g ...``; for a transposed conv, group ``j`` of
  ``weight.transpose(0, 1)``). ``G[j]`` is the ``j``-th diagonal block of the bias's
  ``G``; the bias keeps its whole ``[O, O]`` factor (its GGN block couples all
  channels).
* *Embedding* (``weight [V, D]``): a Linear on one-hot inputs, so ``A`` is diagonal and
  comes as its diagonal ``a [V]``: ``[G, a]``, with ``G ⊗ diag(a)`` approximating the
  block of ``weight.T`` ``[D, V]`` (the Linear's layout; the transposition as for
  transposed convolutions). ``padding_idx`` rows get 0 (autograd gives them no
  gradient); ``scale_grad_by_freq`` raises (its Jacobian depends on the whole batch).
* *BatchNorm* raises: its parameters are per-channel vectors scaled by the normalised
  input, with no standard Kronecker factorisation (BackPACK has none); DiagGGNExact
  gives their curvature.

**Weight sharing: ``kfac_approx``** (Eschenhagen et al., "Kronecker-Factored
Approximate Curvature for Modern Neural Network Architectures", NeurIPS 2023; the
names and scalings are curvlinops' ``KFACLinearOperator(kfac_approx=...)``). For a
layer applied at ``T`` positions (a Linear's middle axes, a convolution's output
positions), with input vectors ``a_{n,t}`` and roots ``s_{v,n,t}``:

* ``"expand"`` (positions as extra samples): ``A = Σ_{n,t} a aᵀ / (N·T)``,
  ``G = Σ_{v,n,t} s sᵀ``;
* ``"reduce"`` (positions reduced first): ``A = Σ_n ā āᵀ / N`` with
  ``ā_n = 1/T Σ_t a_{n,t}``, ``G = Σ_{v,n} (Σ_t s_t)(Σ_t s_t)ᵀ``; Embedding raises
  (its reduced ``A`` is a dense ``[V, V]``);
* ``None`` (the default): Linear and Embedding ``"expand"``, convolutions BackPACK's
  (``G`` of ``"reduce"``, ``A`` ``T`` times ``"expand"``'s, the list above).

The scaling of the loss is in the roots (``1/√(terms)`` for ``reduction="mean"``), so
for losses that curvlinops also reduces by the mean over ``N`` (·positions) the
factors are curvlinops' own, ``G`` and ``A`` each, not only their product. With
``T = 1`` all three coincide.

**KFRA through branches** (:class:`jacmem.nn.Sum`, ``Residual``, ``Parallel``). Where a
tensor feeds several paths that meet again, the region's per-sample Jacobian is the sum
over paths ``J_n = Σ_b J_{b,n}``, and the batch average

    1/N Σ_n J_nᵀ Ḡ J_n = Σ_{b,b'} 1/N Σ_n J_{b,n}ᵀ Ḡ J_{b',n}

has cross terms ``b ≠ b'`` that no sum of matrices handed along each path can form.
So at a module with several inputs (where, backward, the paths part) ``Ḡ`` is
factorised, ``Ḡ = L Lᵀ`` (``L [D, r]`` from its eigendecomposition, ``r`` its rank:
eigenvalues within rounding of 0 dropped; any negative ones would go as a root of sign
-1), and every sample carries its own root from there, ``P_n = L``, which crosses
modules as KFLR's factors do, ``P_n ← J_nᵀ P_n``, the roots of all paths adding where
the paths meet. A module inside the region reads ``Ḡ = 1/N Σ_n P_n P_nᵀ`` at its
output. Each root carries the share of its merge's paths it stands for (1 at the merge,
split evenly among the tracked inputs of every module with several); where the shares
arriving at a module sum to 1, every path from that merge has met there, the graph
above is a chain again, and the roots collapse back: ``Ḡ = 1/N Σ_n P_n P_nᵀ``. (A path
that ends at the model's input, as the skip of a block applied to it does, keeps its
share: those roots then never collapse, and the modules above read them per sample.)
The rule keeps KFRA's average at every step of a chain and takes, where paths part,
the one average that the chain rule allows, over the region's whole Jacobian. Hence:

* on a chain nothing changes: BackPACK's KFRA;
* ``Residual(f)`` gives its input ``1/N Σ_n (I + J_{f,n})ᵀ Ḡ (I + J_{f,n})``, cross
  terms included, and ``f``'s modules the matrices of per-sample roots of ``Ḡ`` (no
  average inside the region);
* with one sample every ``Ḡ`` is the exact GGN w.r.t. its output, so KFRA equals KFLR
  (the exact GGN block for a Linear layer), on any architecture;
* inside a region KFRA costs what KFLR does with ``V = r ≤ D`` vectors per sample.

The activations' Jacobians are those of their derivatives alone, so every activation
works (BackPACK refuses LeakyReLU, SELU, GELU and SiLU), as does every dtype.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor

from jacmem.derivatives import REGISTRY, Kronecker
from jacmem.extensions.secondorder.base import Call, SecondOrderExtension, UnsupportedModule, mc_kind
from jacmem.extensions.secondorder.diag_ggn import squared_vjps


def _has_rules(rule: Kronecker | None, diagonal: bool) -> bool:
    return rule is not None and (rule.input_factor is not None or (diagonal and rule.diagonal))


def _rule(call: Call, ext: _KF) -> Kronecker:
    """The layer's Kronecker rules (registered with its derivatives); raises
    :class:`UnsupportedModule` where it has none, or none with these settings."""
    rule = getattr(call.entry, "kronecker", None)
    kind = type(call.module).__name__
    if not _has_rules(rule, ext.diagonal):
        why = f": {rule.why_not}" if rule is not None and rule.why_not else ""
        if rule is not None and rule.diagonal:
            why = ": its parameters scale elementwise and get their GGN diagonal, which KFAC and KFLR give"
        supported = ", ".join(
            t if isinstance(t, str) else t.__name__
            for t, e in REGISTRY.items()
            if _has_rules(e.kronecker, ext.diagonal)
        )
        raise UnsupportedModule(
            f"{ext!r} has no Kronecker factors for {kind} (module {call.name!r}){why}; "
            f"supported: {supported}. Freeze its parameters (requires_grad=False) or use DiagGGNExact"
        )
    why = rule.refuse(approx=ext.kfac_approx, **call.hp)
    if why:
        raise UnsupportedModule(
            f"{ext!r} has no Kronecker factors for {kind} module {call.name!r} {why} or use DiagGGNExact"
        )
    return rule


def _group_blocks(M: Tensor, groups: int) -> Tensor:
    """The diagonal blocks of ``M [g·m, g·m]``: ``[g, m, m]`` (``M`` itself if ``g == 1``)."""
    if groups == 1:
        return M
    return torch.diagonal(M.unflatten(0, (groups, -1)).unflatten(2, (groups, -1)), dim1=0, dim2=2).permute(2, 0, 1)


def input_factor(call: Call, approx: str | None = None) -> Tensor:
    """``A``, by the layer's rule (:class:`jacmem.derivatives.Kronecker`) and ``approx``
    (the module docstring): ``[I, I]`` for Linear; ``[C_in·K, C_in·K]`` for a
    convolution (``[g, C_in/g·K, C_in/g·K]`` with ``g > 1`` groups); the diagonal
    ``[V]`` for Embedding."""
    rule = call.entry.kronecker
    return rule.input_factor(call.x, call.out_shape, call.params["weight"].dtype, approx, **call.hp)


def _channels(call: Call, S: Tensor, approx: str | None = None) -> Tensor:
    """A root ``[V, N, *out]`` -> the vectors whose outer products make ``G``, channels
    last: ``[V, N·T, O]`` per position (channels-last layers; convolutions with
    ``approx="expand"``), or ``[V, N, O]`` summed over positions (convolutions;
    channels-last layers with ``approx="reduce"``)."""
    v, n = S.shape[:2]
    if call.entry.kronecker.channels_last:
        if approx == "reduce":
            return S.reshape(v, n, -1, S.shape[-1]).sum(2)
        return S.reshape(v, -1, S.shape[-1])
    S = S.reshape(v, n, S.shape[2], -1)  # [V, N, O, T]
    if approx == "expand":
        return S.transpose(2, 3).reshape(v, -1, S.shape[2])
    return S.sum(3)


def output_factor_sqrt(call: Call, kinds, approx: str | None = None) -> Tensor | None:
    """``G = Σ_factors sign · Σ_{v,n} s sᵀ`` of the factors of ``kinds``, ``s`` by
    :func:`_channels`: ``[O, O]``, or ``None`` if none arrived."""
    G = None
    for f in call.of_kind(*kinds):
        s = _channels(call, f.S, approx)
        s = s.reshape(-1, s.shape[-1])  # [(V M), O]
        part = (s.T @ s).mul_(f.sign)
        G = part if G is None else G + part
    return G


def output_factor_dense(call: Call, H: Tensor) -> Tensor:
    """KFRA's ``G`` from ``Ḡ [D, D]``: the sum of its diagonal position blocks for
    channels-last layers (``D = T·O``), of all its position blocks for a convolution
    (``D = O·T``): ``[O, O]``."""
    if call.entry.kronecker.channels_last:
        blocks = rearrange(H, "(t o) (s p) -> t s o p", o=call.out_shape[-1], p=call.out_shape[-1])
        return torch.diagonal(blocks, dim1=0, dim2=1).sum(-1)
    c = call.out_shape[1]
    return rearrange(H, "(c s) (d t) -> c d s t", c=c, d=c).sum((2, 3))


def kfra_roots(H: Tensor, n: int, out_shape: tuple[int, ...]) -> list[tuple[float, Tensor]]:
    """``Ḡ [D, D]`` -> per-sample roots ``[(sign, S [r, N, *out])]`` with
    ``Σ sign · Σ_v S[v, n] S[v, n]ᵀ = Ḡ`` for every ``n``, by the eigendecomposition
    (eigenvalues within rounding of 0 dropped); ``out_shape`` is one sample's."""
    lam, U = torch.linalg.eigh((H + H.T) / 2)
    tol = float(lam.abs().max()) * H.shape[0] * torch.finfo(H.dtype).eps
    roots = []
    for sign in (1.0, -1.0):
        keep = sign * lam > tol
        if bool(keep.any()):
            L = U[:, keep] * (sign * lam[keep]).sqrt()  # [D, r]
            roots.append((sign, L.T.reshape(-1, 1, *out_shape).expand(-1, n, *out_shape).contiguous()))
    return roots


def kfra_average(S: Tensor) -> Tensor:
    """``1/N Σ_n Σ_v S[v, n] S[v, n]ᵀ``: a root ``[V, N, *out]`` -> ``[D, D]``."""
    flat = S.flatten(2).flatten(0, 1)  # [(V N), D]
    return (flat.T @ flat).div_(S.shape[1])


def _contiguous_symmetric(M: Tensor) -> Tensor:
    """``M``, symmetric in its last two axes (or a vector: Embedding's diagonal ``A``),
    as a contiguous tensor: its transpose where that is one already (opt_einsum often
    returns ``xᵀx`` transposed), with no copy; a strided copy of a [784, 784] factor
    costs ~10 ms."""
    if M.dim() < 2 or M.is_contiguous():
        return M.contiguous()
    t = M.transpose(-1, -2)
    return t if t.is_contiguous() else M.contiguous()


KFAC_APPROX = (None, "expand", "reduce")


def _check_approx(kfac_approx: str | None) -> str | None:
    if kfac_approx not in KFAC_APPROX:
        raise ValueError(f"kfac_approx must be one of {KFAC_APPROX}, got {kfac_approx!r}")
    return kfac_approx


class _KF(SecondOrderExtension):
    #: how positions that share a weight count (module docstring); ``None``: each
    #: layer's default
    kfac_approx: str | None = None
    #: LayerNorm/RMSNorm parameters get their GGN diagonal from ``kinds``' factors
    diagonal = True

    def output_factor(self, call: Call) -> Tensor | None:
        return output_factor_sqrt(call, self.kinds, self.kfac_approx)

    def merge_chunks(self, a: list[Tensor], b: list[Tensor]) -> list[Tensor]:
        """``G`` sums over slices of ``V``; ``A`` (the input's) is each slice's own."""
        return [a[0] + b[0], *a[1:]]

    def compute(self, call: Call) -> dict[str, list[Tensor]]:
        rule = _rule(call, self)
        if rule.input_factor is None:  # a diagonal rule
            diag = squared_vjps(call, call.of_kind(*self.kinds), batch=False)
            return {name: [diag[name] if name in diag else torch.zeros_like(p)] for name, p in call.params.items()}
        G = self.output_factor(call)
        if G is None:
            o = call.out_shape[-1 if rule.channels_last else 1]
            G = torch.zeros(o, o, dtype=call.params["weight"].dtype, device=call.params["weight"].device)
        G = _contiguous_symmetric(G)
        out = {}
        for name in call.params:
            if name == "weight":
                A = input_factor(call, self.kfac_approx)
                blocks = _contiguous_symmetric(_group_blocks(G, A.shape[0] if A.dim() == 3 else 1))
                out[name] = [blocks, _contiguous_symmetric(A)]
            else:
                out[name] = [G]
        return out


def _approx_repr(kfac_approx: str | None) -> str:
    return "" if kfac_approx is None else f"kfac_approx={kfac_approx!r}"


class KFAC(_KF):
    """Kronecker-factored GGN from ``mc_samples`` Monte-Carlo samples of the loss
    Hessian (Martens & Grosse 2015; Grosse & Martens 2016), ``param.kfac``;
    ``kfac_approx``: ``"expand"``, ``"reduce"`` (Eschenhagen et al. 2023) or ``None``
    (each layer's default), as the module docstring says."""

    savefield = "kfac"

    def __init__(self, mc_samples: int = 1, kfac_approx: str | None = None):
        self.mc_samples = mc_samples
        self.kinds = (mc_kind(mc_samples),)
        self.kfac_approx = _check_approx(kfac_approx)

    def __repr__(self) -> str:
        approx = _approx_repr(self.kfac_approx)
        return f"KFAC(mc_samples={self.mc_samples}{', ' + approx if approx else ''})"


class KFLR(_KF):
    """Kronecker-factored GGN from the exact loss Hessian (Botev et al. 2017),
    ``param.kflr``; ``kfac_approx`` as for :class:`KFAC`."""

    savefield, kinds = "kflr", ("exact",)

    def __init__(self, kfac_approx: str | None = None):
        self.kfac_approx = _check_approx(kfac_approx)

    def __repr__(self) -> str:
        return f"KFLR({_approx_repr(self.kfac_approx)})"


class KFRA(_KF):
    """Kronecker-factored GGN with the batch average taken at every step of the
    backward (Botev et al. 2017), ``param.kfra``; through branches as the module
    docstring says."""

    savefield, kinds = "kfra", ("dense",)
    diagonal = False  # its dense Ḡ would need the module's Jacobian: use KFLR

    def output_factor(self, call: Call) -> Tensor | None:
        G = None if call.dense is None else output_factor_dense(call, call.dense)
        roots = output_factor_sqrt(call, ("kfra",))
        if roots is not None:
            roots = roots / call.out_shape[0]
            G = roots if G is None else G + roots
        return G
