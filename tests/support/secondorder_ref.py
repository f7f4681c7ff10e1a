"""Dense references for the second-order tests, built with torch.func (float64).

For a model ``f(θ, X)`` and a loss module: the GGN ``Jᵀ H J`` and the Hessian of the
loss w.r.t. all parameters, whole-batch and per sample (sample ``n``'s term of the
loss as reduced: its ``reduction="sum"`` loss times the mean's normalisation), and
their blocks per parameter.

An ``nn.Embedding``'s ``padding_idx`` row is held constant, as autograd holds it (its
gradient is zero, so training never moves it): its rows and columns of both matrices
are zero. ``torch.func.hessian`` (forward mode over reverse) alone would mix two
conventions: reverse mode zeroes the padding row's gradient, but forward mode's tangent
of the lookup reads the padding row, so the Hessian got non-zero padding columns under
zero padding rows, a matrix that is not symmetric (the Hessian of no function).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacrev

import jacmem
from jacmem import KFLR, KFRA, BatchDiagGGNExact, BatchDiagHessian, DiagGGNExact, DiagHessian


def _split(model: nn.Module):
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = dict(model.named_parameters())
    shapes = [params[n].shape for n in names]
    theta = torch.cat([params[n].detach().flatten() for n in names])
    sizes = [s.numel() for s in shapes]
    pads = _padding_rows(model)

    def unflat(t: Tensor) -> dict[str, Tensor]:
        split = {n: c.reshape(s) for n, c, s in zip(names, t.split(sizes), shapes)}
        return {n: _hold_row(w, pads[n]) if n in pads else w for n, w in split.items()}

    return names, shapes, sizes, theta, unflat


def _padding_rows(model: nn.Module) -> dict[str, int]:
    """weight's name -> its padding row, for each ``nn.Embedding`` with a ``padding_idx``."""
    return {
        f"{name}.weight".removeprefix("."): m.padding_idx
        for name, m in model.named_modules()
        if isinstance(m, nn.Embedding) and m.padding_idx is not None
    }


def _hold_row(w: Tensor, row: int) -> Tensor:
    """``w [V, D]`` with row ``row`` a constant to every transform (forward mode included)."""
    keep = torch.ones(len(w), 1, dtype=w.dtype, device=w.device)
    keep[row] = 0
    return w * keep + (w * (1 - keep)).detach()


def _sum_loss(lossf: nn.Module) -> nn.Module:
    kwargs = {k: getattr(lossf, k) for k in ("ignore_index",) if hasattr(lossf, k)}
    return type(lossf)(reduction="sum", **kwargs)


def dense(model: nn.Module, lossf: nn.Module, X: Tensor, y: Tensor, per_sample: bool = False, hess: bool = True):
    """(GGN, Hessian), ``[P, P]`` each, or ``[N, P, P]`` per sample; ``hess=False``: the
    Hessian is ``None`` (it needs forward-mode AD through the model, which torch's fused
    attention kernels lack)."""
    names, shapes, sizes, theta, unflat = _split(model)
    if not per_sample:
        return _dense(model, lossf, X, y, theta, unflat, hess)
    with torch.no_grad():
        out = model(X)
        scale = float(lossf(out, y) / _sum_loss(lossf)(out, y))
    summed = _sum_loss(lossf)
    parts = [
        _dense(model, lambda z, t: scale * summed(z, t), X[n : n + 1], y[n : n + 1], theta, unflat, hess)
        for n in range(X.shape[0])
    ]
    return torch.stack([g for g, _ in parts]), torch.stack([h for _, h in parts]) if hess else None


def _dense(model, lossf, X, y, theta, unflat, hess: bool = True) -> tuple[Tensor, Tensor | None]:
    def f(t):
        return functional_call(model, unflat(t), (X,))

    z = f(theta)
    J = jacrev(f)(theta).reshape(z.numel(), -1)
    Hz = hessian(lambda z: lossf(z, y))(z).reshape(z.numel(), z.numel())
    H = hessian(lambda t: lossf(f(t), y))(theta) if hess else None
    return J.T @ Hz @ J, H


def diagonals(model: nn.Module, M: Tensor) -> dict[str, Tensor]:
    """The diagonal of ``M [(N,) P, P]`` split per parameter: name -> [(N,) *shape]."""
    names, shapes, sizes, _, _ = _split(model)
    d = torch.diagonal(M, dim1=-2, dim2=-1)
    return {n: c.reshape(*d.shape[:-1], *s) for n, c, s in zip(names, d.split(sizes, -1), shapes)}


def blocks(model: nn.Module, M: Tensor) -> dict[str, Tensor]:
    """The diagonal blocks of ``M [P, P]`` per parameter: name -> [p, p]."""
    names, shapes, sizes, _, _ = _split(model)
    out, start = {}, 0
    for n, k in zip(names, sizes):
        out[n] = M[start : start + k, start : start + k]
        start += k
    return out


def run(model, lossf, X, y, *exts):
    model.zero_grad()
    with jacmem.extend(*exts):
        lossf(model(X), y).backward()


def freeze(model, type_name: str) -> None:
    """Freezes the parameters of ``model``'s modules of type ``type_name`` (LLaMA's
    ``LlamaRMSNorm``, which the Kronecker kinds have no factors for: a backward that
    reaches its weight raises)."""
    for module in model.modules():
        if type(module).__name__ == type_name:
            module.requires_grad_(False)


def check_exact(model, lossf, X, y, per_sample=True, atol=1e-10):
    """DiagGGNExact, DiagHessian (and their batch versions) equal the dense diagonals."""
    exts = [DiagGGNExact(), DiagHessian()] + ([BatchDiagGGNExact(), BatchDiagHessian()] if per_sample else [])
    run(model, lossf, X, y, *exts)
    ggn, hess = dense(model, lossf, X, y)
    refs = {"diag_ggn_exact": diagonals(model, ggn), "diag_h": diagonals(model, hess)}
    if per_sample:
        ggn_n, hess_n = dense(model, lossf, X, y, per_sample=True)
        refs["diag_ggn_exact_batch"] = diagonals(model, ggn_n)
        refs["diag_h_batch"] = diagonals(model, hess_n)
    for field, ref in refs.items():
        for name, p in model.named_parameters():
            got = getattr(p, field)
            assert got.shape == ref[name].shape, (field, name)
            torch.testing.assert_close(got, ref[name], atol=atol, rtol=1e-7, msg=f"{field} of {name}")


def check_kronecker_blocks(model, lossf, X, y):
    """KFLR's and KFRA's factors equal the exact GGN blocks (one sample, ``X [1, ...]``):
    G ⊗ A for a weight (row-major vec), G for a bias."""
    run(model, lossf, X, y, KFLR(), KFRA())
    ref = blocks(model, dense(model, lossf, X, y)[0])
    for name, p in model.named_parameters():
        for field in ("kflr", "kfra"):
            factors = getattr(p, field)
            got = torch.kron(*factors) if name.endswith("weight") else factors[0]
            assert len(factors) == (2 if name.endswith("weight") else 1)
            torch.testing.assert_close(got, ref[name], msg=f"{field} {name}")


@contextmanager
def default_dtype(dtype: torch.dtype):
    """BackPACK builds some buffers in the default dtype: make it the model's (other
    test modules set float64 globally at import)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
