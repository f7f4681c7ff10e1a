"""KFAC, KFLR and KFRA: Kronecker factors of the GGN, as BackPACK 1.7.1 lays them out.

For a weight, ``[G, A]`` with ``G ⊗ A`` approximating its GGN block; for a bias,
``[G]``. ``A`` is the uncentred covariance of the layer's input, averaged over the
batch: ``xᵀx / N`` for Linear, the unfolded (im2col) input's ``Σ_t a_t a_tᵀ / N`` for
convolutions. ``G`` comes from the output side:

* KFAC (``mc_samples`` Monte-Carlo factors) and KFLR (the exact factor):
  ``G = Σ_v Σ_n S[v, n] S[v, n]ᵀ``, a convolution's ``S`` summed over its output
  positions first;
* KFRA: ``G = H``, the dense batch-averaged GGN w.r.t. the output, backpropagated as
  ``H_in = 1/N Σ_n J_nᵀ H J_n`` from the loss's batch-summed Hessian; for a
  convolution, ``H`` summed over pairs of output positions.

The activations' Jacobians are those of their derivatives alone, so every activation
works (BackPACK refuses LeakyReLU, SELU, GELU and SiLU), as does every dtype.
Grouped convolutions and Linear layers with middle axes raise (BackPACK's factors
are not defined there).
"""

from __future__ import annotations

from typing import Dict, List

import torch
from einops import rearrange
from opt_einsum import contract
from torch import Tensor, nn

from jacmem.derivatives.conv import pad, unfold
from jacmem.extensions.secondorder.base import Call, SecondOrderExtension, mc_kind

_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _check(call: Call, ext: SecondOrderExtension) -> None:
    if type(call.module) is nn.Linear and call.x.dim() != 2:
        raise NotImplementedError(
            f"{ext!r} needs 2d inputs [N, I] for Linear module {call.name!r}, got {tuple(call.x.shape)}; "
            "flatten the middle axes into the batch, or use DiagGGNExact"
        )
    if isinstance(call.module, _CONV) and call.hp["groups"] != 1:
        raise NotImplementedError(
            f"{ext!r} is not defined for grouped convolutions (module {call.name!r}, groups="
            f"{call.hp['groups']}); use DiagGGNExact"
        )
    if not isinstance(call.module, (nn.Linear, *_CONV)):
        raise NotImplementedError(
            f"{ext!r} has no Kronecker factors for {type(call.module).__name__} (module {call.name!r}); "
            "supported: Linear, Conv1d/2d/3d. Freeze its parameters or use DiagGGNExact"
        )


def input_factor(call: Call) -> Tensor:
    """A = Σ_n Σ_t a_{n,t} a_{n,t}ᵀ / N: [I, I] for Linear, [C_in·K, C_in·K] for conv."""
    x = call.x
    n = x.shape[0]
    if type(call.module) is nn.Linear:
        return contract("ni,nj->ij", x, x) / n
    hp = call.hp
    cols = unfold(pad(x, hp["padding"], hp["padding_mode"]), hp["kernel_size"], hp["stride"], hp["dilation"])
    d = len(hp["kernel_size"])
    cols = cols.flatten(1, 1 + d).flatten(2)  # [N, C_in·K, T]
    return contract("nit,njt->ij", cols, cols) / n


def output_factor_sqrt(call: Call, kinds) -> Tensor:
    """G = Σ_factors Σ_{v,n} s s ᵀ with s = S[v, n] summed over output positions: [O, O]"""
    G = None
    for f in call.of_kind(*kinds):
        s = f.S if f.S.dim() == 3 else f.S.flatten(3).sum(3)  # [V, N, O]
        part = f.sign * contract("vno,vnp->op", s, s)
        G = part if G is None else G + part
    return G


def output_factor_dense(call: Call) -> Tensor:
    """KFRA's G from the dense output GGN H [D_out, D_out]: H itself for Linear,
    summed over pairs of positions for a convolution: [O, O]"""
    H = call.dense
    if type(call.module) is nn.Linear:
        return H
    c = call.out_shape[1]
    return rearrange(H, "(c s) (d t) -> c d s t", c=c, d=c).sum((2, 3))


class _KF(SecondOrderExtension):
    def output_factor(self, call: Call) -> Tensor:
        return output_factor_sqrt(call, self.kinds)

    def compute(self, call: Call) -> Dict[str, List[Tensor]]:
        _check(call, self)
        G = self.output_factor(call)
        if G is None:
            G = torch.zeros(call.out_shape[1], call.out_shape[1], dtype=call.x.dtype, device=call.x.device)
        G = G.contiguous()
        A = input_factor(call).contiguous() if "weight" in call.params else None
        return {name: [G, A] if name == "weight" else [G] for name in call.params}


class KFAC(_KF):
    """Kronecker-factored GGN from ``mc_samples`` Monte-Carlo samples of the loss
    Hessian (Martens & Grosse 2015; Grosse & Martens 2016), ``param.kfac``."""

    savefield = "kfac"

    def __init__(self, mc_samples: int = 1):
        self.mc_samples = mc_samples
        self.kinds = (mc_kind(mc_samples),)

    def __repr__(self) -> str:
        return f"KFAC(mc_samples={self.mc_samples})"


class KFLR(_KF):
    """Kronecker-factored GGN from the exact loss Hessian (Botev et al. 2017),
    ``param.kflr``."""

    savefield, kinds = "kflr", ("exact",)


class KFRA(_KF):
    """Kronecker-factored GGN with the batch average taken at every step of the
    backward (Botev et al. 2017), ``param.kfra``."""

    savefield, kinds = "kfra", ("dense",)

    def output_factor(self, call: Call) -> Tensor:
        return output_factor_dense(call)
