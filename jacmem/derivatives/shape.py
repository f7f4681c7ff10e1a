"""Flatten, Dropout, padding and Identity, for second-order extensions.

Shapes: ``S [V, N, *out] -> [V, N, *in]``.
"""

from __future__ import annotations

from torch import Tensor, nn

from jacmem.derivatives.jacobians import passthrough


def flatten_jac_t(xs, out, S: Tensor):
    """[V, N, *out] -> [V, N, *in]: the same numbers, reshaped."""
    return (S.reshape(S.shape[0], *xs[0].shape),)


def _dropout_df(x: Tensor, out: Tensor, *, p: float, training: bool) -> Tensor:
    """The mask the forward pass drew, read off its output, times the rescaling."""
    if not training or p == 0:
        return (out == out).to(out.dtype)
    return (out != 0).to(out.dtype) / (1 - p)


def _identity_jac_t(xs, out, S: Tensor):
    return (S,)


passthrough(nn.Flatten, nn.Unflatten, jac_t=flatten_jac_t, sample_independent=True)
passthrough(
    nn.Dropout,
    df=_dropout_df,
    keep_output=True,
    keep_input=False,
    hyperparams=lambda m: {"p": m.p, "training": m.training},
)
passthrough(nn.Identity, jac_t=_identity_jac_t, sample_independent=True)
# padding: the vjp of the module's forward is a crop
passthrough(
    nn.ZeroPad1d,
    nn.ZeroPad2d,
    nn.ZeroPad3d,
    nn.ConstantPad1d,
    nn.ConstantPad2d,
    nn.ConstantPad3d,
    sample_independent=True,
)
