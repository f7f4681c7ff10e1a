"""Elementwise activations: first and second derivatives, for second-order extensions.

Each function takes ``x`` (the input, ``[N, *]``) and ``out`` (the output, same shape)
and returns the derivative at every entry, ``[N, *]``. ``d2f`` is absent where it is
zero almost everywhere (ReLU, LeakyReLU). At a kink the derivative is that of the
right-hand piece for ``x > 0`` and of the left-hand piece at ``x = 0``, as BackPACK.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from jacmem.derivatives.registry import passthrough


def _relu_df(x: Tensor, out: Tensor) -> Tensor:
    return (out > 0).to(out.dtype)  # out > 0 exactly where x > 0


def _leaky_df(x: Tensor, out: Tensor, *, negative_slope: float) -> Tensor:
    return torch.where(x > 0, 1.0, negative_slope).to(x.dtype)


def _sigmoid_df(x: Tensor, out: Tensor) -> Tensor:
    return out * (1 - out)


def _sigmoid_d2f(x: Tensor, out: Tensor) -> Tensor:
    return out * (1 - out) * (1 - 2 * out)


def _tanh_df(x: Tensor, out: Tensor) -> Tensor:
    return 1 - out**2


def _tanh_d2f(x: Tensor, out: Tensor) -> Tensor:
    return -2 * out * (1 - out**2)


def _elu_df(x: Tensor, out: Tensor, *, alpha: float, scale: float = 1.0) -> Tensor:
    return scale * torch.where(x > 0, 1.0, alpha * x.exp())


def _elu_d2f(x: Tensor, out: Tensor, *, alpha: float, scale: float = 1.0) -> Tensor:
    return scale * torch.where(x > 0, 0.0, alpha * x.exp())


def _logsigmoid_df(x: Tensor, out: Tensor) -> Tensor:
    return torch.sigmoid(-x)


def _logsigmoid_d2f(x: Tensor, out: Tensor) -> Tensor:
    return -torch.sigmoid(x) * torch.sigmoid(-x)


def _silu_df(x: Tensor, out: Tensor) -> Tensor:
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


def _silu_d2f(x: Tensor, out: Tensor) -> Tensor:
    s = torch.sigmoid(x)
    return s * (1 - s) * (2 + x * (1 - 2 * s))


def _phi(x: Tensor) -> Tensor:
    """Standard normal density."""
    return torch.exp(-0.5 * x**2) / math.sqrt(2 * math.pi)


def _gelu_tanh_parts(x: Tensor):
    """u = √(2/π)(x + 0.044715 x³), tanh(u) and du/dx, for GELU's tanh approximation."""
    c, k = math.sqrt(2 / math.pi), 0.044715
    t = torch.tanh(c * (x + k * x**3))
    return t, c * (1 + 3 * k * x**2), c * 6 * k * x


def _gelu_df(x: Tensor, out: Tensor, *, approximate: str) -> Tensor:
    if approximate == "tanh":
        t, du, _ = _gelu_tanh_parts(x)
        return 0.5 * (1 + t) + 0.5 * x * (1 - t**2) * du
    return 0.5 * (1 + torch.erf(x / math.sqrt(2))) + x * _phi(x)


def _gelu_d2f(x: Tensor, out: Tensor, *, approximate: str) -> Tensor:
    if approximate == "tanh":
        t, du, d2u = _gelu_tanh_parts(x)
        sech2 = 1 - t**2
        return sech2 * du + 0.5 * x * (sech2 * d2u - 2 * t * sech2 * du**2)
    return _phi(x) * (2 - x**2)


passthrough(nn.ReLU, df=_relu_df, keep_output=True, keep_input=False)
passthrough(nn.LeakyReLU, df=_leaky_df, hyperparams=lambda m: {"negative_slope": m.negative_slope})
passthrough(nn.Sigmoid, df=_sigmoid_df, d2f=_sigmoid_d2f, keep_output=True, keep_input=False)
passthrough(nn.Tanh, df=_tanh_df, d2f=_tanh_d2f, keep_output=True, keep_input=False)
passthrough(nn.ELU, df=_elu_df, d2f=_elu_d2f, hyperparams=lambda m: {"alpha": m.alpha})
passthrough(
    nn.SELU,
    df=_elu_df,
    d2f=_elu_d2f,
    hyperparams=lambda m: {"alpha": 1.6732632423543772848170429916717, "scale": 1.0507009873554804934193349852946},
)
passthrough(nn.LogSigmoid, df=_logsigmoid_df, d2f=_logsigmoid_d2f)
passthrough(nn.SiLU, df=_silu_df, d2f=_silu_d2f)
passthrough(nn.GELU, df=_gelu_df, d2f=_gelu_d2f, hyperparams=lambda m: {"approximate": m.approximate})
