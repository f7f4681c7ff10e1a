"""Flatten, Dropout, padding, slicing and Identity, for second-order extensions.

BackPACK's own ``Pad`` (``F.pad`` as a module, any mode) and ``Slicing`` (``x[slice_info]``)
custom modules are registered by qualified name, so nothing here imports BackPACK: both
cross by the vjp of their ``forward`` (a crop, a scatter into zeros).

Shapes: ``S [V, N, *out] -> [V, N, *in]``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from jacmem.derivatives.registry import passthrough


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


#: BackPACK's custom modules (``backpack.custom_module``), a dev dependency only
BACKPACK_PAD = "backpack.custom_module.pad.Pad"
BACKPACK_SLICING = "backpack.custom_module.slicing.Slicing"


def _slicing_hyperparams(module: nn.Module) -> dict[str, Any]:
    """Refuses a ``Slicing`` that slices the batch axis: a factor ``[V, N, *out]`` needs
    the output's samples to be the input's."""
    info = module.slice_info if isinstance(module.slice_info, tuple) else (module.slice_info,)
    if info[0] != slice(None):
        raise NotImplementedError(
            f"second-order extensions need Slicing to keep the batch axis whole, but its slice_info starts "
            f"with {info[0]!r}; slice the batch outside the model (construct Slicing with slice(None) first)"
        )
    return {}


passthrough(BACKPACK_PAD, sample_independent=True)
passthrough(BACKPACK_SLICING, sample_independent=True, hyperparams=_slicing_hyperparams)
