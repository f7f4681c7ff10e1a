"""KFAC, KFLR, KFACEF and KFRA: Kronecker factors of the GGN, as BackPACK 1.7.1 lays them out.

A weight gets ``[G, A]``, ``G ⊗ A`` approximating its GGN block (row-major ``vec``); a
bias ``[G]``. ``G [O, O]`` is from the output side: ``Σ_{v,n} s sᵀ`` over the roots
``S [V, N, *out]`` (KFAC: Monte-Carlo, KFLR: exact, KFACEF: the loss's gradient), or read off KFRA's batch-averaged
``Ḡ [D, D]``, ``Ḡ_in = 1/N Σ_n J_nᵀ Ḡ_out J_n``. ``A`` is from the input, by the layer's
:class:`jacmem.derivatives.Kronecker` rule: ``[I, I]``; ``[g, m, m]`` for ``g`` groups
(the block is then ``block_diag(G[j] ⊗ A[j])``); the diagonal ``[V]`` for Embedding.

``kfac_approx`` (Eschenhagen et al. 2023, with curvlinops' scaling), for a layer applied
at ``T`` positions with inputs ``a_{n,t}`` and roots ``s_{v,n,t}``:

* ``"expand"``: ``A = Σ_{n,t} a aᵀ / (N·T)``, ``G = Σ_{v,n,t} s sᵀ``;
* ``"reduce"``: ``A = Σ_n ā āᵀ / N`` (``ā_n`` the mean over ``t``),
  ``G = Σ_{v,n} (Σ_t s_t)(Σ_t s_t)ᵀ``;
* ``None``: ``"expand"`` for Linear and Embedding; BackPACK's for convolutions
  (``"reduce"``'s ``G``, ``T`` times ``"expand"``'s ``A``).

Where paths part (a module with several inputs), KFRA's ``Ḡ = L Lᵀ`` goes on as
per-sample roots ``P_n = L``, ``P_n ← J_nᵀ P_n``, which collapse back to
``1/N Σ_n P_n P_nᵀ`` where all the paths have met. The per-layer rules and the reasons
are in the guide's "Second order: the math" (docs/guide/curvature.rst).
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor

from jacmem.derivatives import REGISTRY, Kronecker
from jacmem.derivatives.quantities import DENSE, EMPIRICAL, EXACT, MonteCarlo
from jacmem.extensions.secondorder.base import Call, SecondOrderExtension, UnsupportedModule
from jacmem.extensions.secondorder.diag_ggn import squared_vjps


def _has_rules(rule: Kronecker | None, diagonal: bool) -> bool:
    return rule is not None and (rule.input_factor is not None or (diagonal and rule.diagonal))


def _rule(call: Call, ext: KroneckerExtension) -> Kronecker:
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
    returns ``xᵀx`` transposed), with no copy: a strided copy of an ``[I, I]`` factor
    reads it column by column."""
    if M.dim() < 2 or M.is_contiguous():
        return M.contiguous()
    t = M.transpose(-1, -2)
    return t if t.is_contiguous() else M.contiguous()


KFAC_APPROX = (None, "expand", "reduce")


def check_approx(kfac_approx: str | None) -> str | None:
    if kfac_approx not in KFAC_APPROX:
        raise ValueError(f"kfac_approx must be one of {KFAC_APPROX}, got {kfac_approx!r}")
    return kfac_approx


class KroneckerExtension(SecondOrderExtension):
    """The base of KFAC, KFLR, KFACEF, KFRA and EKFAC: ``compute`` gives each weight
    ``[G, A]`` and each bias ``[G]`` from the roots of ``kinds`` (the module docstring)."""

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

    def check(self, call: Call) -> None:
        _rule(call, self)

    def compute(self, call: Call) -> dict[str, list[Tensor]]:
        self.check(call)
        rule = call.entry.kronecker
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


def approx_repr(kfac_approx: str | None) -> str:
    return "" if kfac_approx is None else f"kfac_approx={kfac_approx!r}"


class KFAC(KroneckerExtension):
    """Kronecker-factored GGN from ``mc_samples`` Monte-Carlo samples of the loss
    Hessian (Martens & Grosse 2015; Grosse & Martens 2016), ``param.kfac``;
    ``kfac_approx``: ``"expand"``, ``"reduce"`` (Eschenhagen et al. 2023) or ``None``
    (each layer's default), as the module docstring says."""

    savefield = "kfac"

    def __init__(self, mc_samples: int = 1, kfac_approx: str | None = None):
        self.mc_samples = mc_samples
        self.kinds = (MonteCarlo(mc_samples),)
        self.kfac_approx = check_approx(kfac_approx)

    def __repr__(self) -> str:
        approx = approx_repr(self.kfac_approx)
        return f"KFAC(mc_samples={self.mc_samples}{', ' + approx if approx else ''})"


class KFLR(KroneckerExtension):
    """Kronecker-factored GGN from the exact loss Hessian (Botev et al. 2017),
    ``param.kflr``; ``kfac_approx`` as for :class:`KFAC`."""

    savefield, kinds = "kflr", (EXACT,)

    def __init__(self, kfac_approx: str | None = None):
        self.kfac_approx = check_approx(kfac_approx)

    def __repr__(self) -> str:
        return f"KFLR({approx_repr(self.kfac_approx)})"


class KFACEF(KroneckerExtension):
    """Kronecker-factored empirical Fisher, ``param.kfac_ef``: :class:`KFAC`'s factors with
    ``G`` from the gradient of the loss at the true targets instead of sampled ones, the
    one root ``s`` per sample that autograd's own backward carries (curvlinops'
    ``fisher_type="empirical"``: for ``reduction="mean"`` over ``K`` terms,
    ``G = K Σ g gᵀ`` of the output gradients ``g``); ``kfac_approx`` as for :class:`KFAC`."""

    savefield, kinds = "kfac_ef", (EMPIRICAL,)

    def __init__(self, kfac_approx: str | None = None):
        self.kfac_approx = check_approx(kfac_approx)

    def __repr__(self) -> str:
        return f"KFACEF({approx_repr(self.kfac_approx)})"


class KFRA(KroneckerExtension):
    """Kronecker-factored GGN with the batch average taken at every step of the
    backward (Botev et al. 2017), ``param.kfra``; through branches as the module
    docstring says."""

    savefield, kinds = "kfra", (DENSE,)
    diagonal = False  # its dense Ḡ would need the module's Jacobian: use KFLR

    def output_factor(self, call: Call) -> Tensor | None:
        G = None if call.dense is None else output_factor_dense(call, call.dense)
        roots = output_factor_sqrt(call, ("kfra",))
        if roots is not None:
            roots = roots / call.out_shape[0]
            G = roots if G is None else G + roots
        return G
