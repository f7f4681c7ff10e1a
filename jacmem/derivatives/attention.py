"""nn.MultiheadAttention: packed or separate q/k/v in-projections, their biases,
``bias_k``/``bias_v``, ``add_zero_attn``, the out-projection, ``batch_first`` both ways,
``key_padding_mask``, ``attn_mask`` (2-D, shared, or 3-D, per sample and head),
``is_causal``, ``need_weights`` and ``average_attn_weights``.

Shapes, batch first (``arrange_input`` and ``arrange`` put it there): ``query [N, L, E]``,
``key [N, S, E_k]``, ``value [N, S, E_v]``, ``key_padding_mask [N, S]``, a 3-D
``attn_mask [N·H, L, S]`` kept as ``[N, H, L, S]``; output gradient ``[N, L, E]``, and,
where the attention weights are returned and depend on the parameters, their gradient
``[N, L, S']`` or ``[N, H, L, S']`` (``S'`` counts ``bias_k`` and the zero key).

The out-projection's parameters belong to the submodule ``out_proj``, which the module
calls functionally (so no Linear record exists for it): they are registered here under
their dotted names, ``out_proj.weight`` and ``out_proj.bias``, and this module's record
covers them.

Strategy ``vmap``: each sample's attention is recomputed alone and its gradient taken
by ``torch.func`` (see :mod:`jacmem.derivatives.generic`), for every trainable parameter
in one pass. Dropout on the attention weights (``dropout > 0`` in training mode) cannot
be reproduced by the recomputation: the backward raises an error that says so.
"""

from __future__ import annotations

import inspect
from functools import partial

from einops import rearrange
from torch import Tensor, nn
from torch.func import functional_call

from jacmem.derivatives import Cost, layer, register
from jacmem.derivatives.generic import VMAP, SharedPass, per_sample_vjp

PARAMS = (
    "in_proj_weight",
    "q_proj_weight",
    "k_proj_weight",
    "v_proj_weight",
    "in_proj_bias",
    "bias_k",
    "bias_v",
    "out_proj.weight",
    "out_proj.bias",
)

_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


def _hyperparams(module: nn.MultiheadAttention) -> dict:
    trainable = [n for n in PARAMS if isinstance(p := _get(module, n), nn.Parameter) and p.requires_grad]
    return dict(
        module=module,
        batch_first=module.batch_first,
        num_heads=module.num_heads,
        dropout=module.dropout if module.training else 0.0,
        shared=SharedPass(trainable),
    )


def _get(module: nn.Module, name: str):
    owner, _, leaf = name.rpartition(".")
    return getattr(module.get_submodule(owner), leaf, None)


def _keep(args: tuple, kwargs: dict) -> dict:
    """Every argument of ``forward``, by name."""
    bound = _SIGNATURE.bind(None, *args, **kwargs)
    bound.apply_defaults()
    return {k: v for k, v in bound.arguments.items() if k != "self"}


def _arrange_input(a: dict, *, batch_first: bool, num_heads: int, **_) -> tuple:
    """-> (query [N, L, E], key [N, S, E_k], value [N, S, E_v], key_padding_mask [N, S] or
    None, attn_mask [N, H, L, S] or None, {what every sample shares})"""
    q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
    unbatched = q.dim() == 2
    if not batch_first and not unbatched:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    per_sample = mask is not None and mask.dim() == 3
    shared = dict(
        attn_mask=None if per_sample else mask,
        need_weights=a["need_weights"],
        average_attn_weights=a["average_attn_weights"],
        is_causal=a["is_causal"],
        unbatched=unbatched,
    )
    mask = rearrange(mask, "(n h) l s -> n h l s", h=num_heads) if per_sample and not unbatched else None
    return q, k, v, a["key_padding_mask"], mask, shared


def _outputs(output):
    """(attn_output, attn_weights), or attn_output alone when no weights are returned."""
    out, weights = output
    return out if weights is None else (out, weights)


def _arrange(g, *, batch_first: bool, **_):
    """attn_output's gradient batch first; the weights' gradient already is."""
    if isinstance(g, Tensor):
        return g if batch_first or g.dim() != 3 else g.transpose(0, 1)
    return (_arrange(g[0], batch_first=batch_first), *g[1:])


def _vmap_all(x, g, names, *, module: nn.MultiheadAttention, batch_first: bool, dropout: float):
    """Per-sample gradients of ``names`` by recomputing each sample's attention."""
    q, k, v, key_padding_mask, attn_mask, shared = x
    if shared["unbatched"]:
        raise RuntimeError(
            "its input is unbatched (query [L, E]): there is no batch axis to take per-sample "
            "gradients over; pass query [N, L, E] with batch_first=True, or [L, N, E]"
        )
    if dropout > 0:
        raise RuntimeError(
            f"it applies dropout={dropout} to the attention weights in training mode, which the "
            "per-sample recomputation cannot reproduce; set dropout=0.0 or call .eval() on it"
        )
    gs = (g,) if isinstance(g, Tensor) else tuple(g)
    b = 0 if batch_first else 1

    def run(params, sample):
        q_n, k_n, v_n, kpm_n, mask_n = sample
        out, weights = functional_call(
            module,
            params,
            (q_n.unsqueeze(b), k_n.unsqueeze(b), v_n.unsqueeze(b)),
            dict(
                key_padding_mask=None if kpm_n is None else kpm_n.unsqueeze(0),
                attn_mask=shared["attn_mask"] if mask_n is None else mask_n,
                # the weights' path batches under vmap; without weights, torch takes a fused
                # kernel that vmap runs one sample at a time. Both compute the same output,
                # except under the is_causal hint, where the fused path ignores attn_mask.
                need_weights=shared["need_weights"] or not shared["is_causal"],
                average_attn_weights=shared["average_attn_weights"],
                is_causal=shared["is_causal"],
            ),
        )
        return (out.squeeze(b), *([weights.squeeze(0)] if len(gs) == 2 else []))

    params = {n: _get(module, n) for n in names}
    return per_sample_vjp(run, params, (q, k, v, key_padding_mask, attn_mask), gs)


def _vmap_batch_grad(x, g, *, param: str, module, batch_first, dropout, shared: SharedPass, **_):
    """Per-sample gradients of ``param``: x as ``arrange_input`` gives it, g [N, L, E] (and
    the weights' [N, (H,) L, S']) -> [N, *param.shape]"""
    return shared.take(param, x, g, partial(_vmap_all, module=module, batch_first=batch_first, dropout=dropout))


def _vmap_cost(xs, gs, *, num_heads, **_) -> Cost:
    """A forward and its backward per sample: the projections and the H attention maps."""
    if len(xs[0]) != 3:
        return Cost(0, 0)  # unbatched: the strategy raises the error that explains it
    (n, tq, e), (_, s, ek), (_, _, ev) = xs[:3]
    proj = tq * e * e + s * e * (ek + ev) + tq * e * e
    attention = 2 * tq * s * e
    return Cost(flops=3 * 2 * n * (proj + attention), workspace=n * (3 * num_heads * tq * s + 4 * (tq + s) * e))


layer(
    nn.MultiheadAttention,
    hyperparams=_hyperparams,
    keep=_keep,
    arrange_input=_arrange_input,
    outputs=_outputs,
    arrange=_arrange,
)
for _name in PARAMS:
    register(nn.MultiheadAttention, _name, "batch_grad", VMAP, cost=_vmap_cost)(
        partial(_vmap_batch_grad, param=_name)
    )
