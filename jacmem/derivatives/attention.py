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

Two strategies, each for every trainable parameter in one pass:

* ``outer``: the projections are linear maps, so their per-sample gradients are sums of
  outer products, as for nn.Linear: ``∂W_q = Σ_l δq_l query_lᵀ`` (and k, v), and
  ``∂W_o = Σ_l g_l o_lᵀ`` with ``o`` the attention's output before ``out_proj``. One
  batched recomputation of the attention, with the projections taken out of torch's
  functional attention (identity weights in their place) so that ``q, k, v`` and ``o``
  are tensors of their own, and one autograd pass from the output gradient(s), give
  ``δq, δk, δv`` (and those of ``bias_k``/``bias_v``, appended per sample);
* ``vmap``: each sample's attention recomputed alone, and its gradient taken by
  ``torch.func`` (see :mod:`jacmem.derivatives.generic`): exact by construction, slower.

Dropout on the attention weights (``dropout > 0`` in training mode) cannot be
reproduced by a recomputation: the backward raises an error that says so.
"""

from __future__ import annotations

import inspect
from functools import partial

import torch
from einops import rearrange
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn import functional as F

from jacmem.derivatives import linear
from jacmem.derivatives.generic import VMAP, SharedPass, per_sample_vjp, shared_cost, track, trainable_sizes
from jacmem.derivatives.registry import Cost, layer, register

OUTER = "outer"

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
    return dict(
        module=module,
        batch_first=module.batch_first,
        num_heads=module.num_heads,
        dropout=module.dropout if module.training else 0.0,
        shared=SharedPass(trainable_sizes(module, PARAMS)),
    )


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


def _check(shared: dict, dropout: float) -> None:
    """What no recomputation can do."""
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


def _vmap_all(x, g, names, *, module: nn.MultiheadAttention, batch_first: bool, dropout: float, **_):
    """Per-sample gradients of ``names`` by recomputing each sample's attention."""
    q, k, v, key_padding_mask, attn_mask, shared = x
    _check(shared, dropout)
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

    params = {n: module.get_parameter(n) for n in names}
    return per_sample_vjp(run, params, (q, k, v, key_padding_mask, attn_mask), gs, "nn.MultiheadAttention")


def _outer_all(x, g, names, *, module: nn.MultiheadAttention, dropout: float, **_):
    """Per-sample gradients of ``names`` from one batched recomputation (see the module
    docstring)."""
    query, key, value, key_padding_mask, attn_mask, shared = x
    _check(shared, dropout)
    g_out, *g_weights = (g,) if isinstance(g, Tensor) else g
    n, e = query.shape[0], module.embed_dim
    p = {name: t.detach() for name, t in module.named_parameters()}
    if module.in_proj_weight is not None:  # one packed projection for q, k and v
        w_q, w_k, w_v = p["in_proj_weight"].chunk(3)
    else:
        w_q, w_k, w_v = p["q_proj_weight"], p["k_proj_weight"], p["v_proj_weight"]
    b_q, b_k, b_v = p["in_proj_bias"].chunk(3) if "in_proj_bias" in p else (None,) * 3
    mask = None if attn_mask is None else attn_mask.flatten(0, 1)  # [N·H, L, S]
    mask = shared["attn_mask"] if mask is None else mask
    with torch.enable_grad():
        q, k, v = (track(F.linear(t, w, b)) for t, w, b in ((query, w_q, b_q), (key, w_k, b_k), (value, w_v, b_v)))
        keys, values = k, v
        if module.bias_k is not None:  # one copy per sample, appended as torch does
            bias_k, bias_v = (track(p[b].reshape(1, 1, e).repeat(n, 1, 1)) for b in ("bias_k", "bias_v"))
            keys, values = torch.cat([k, bias_k], 1), torch.cat([v, bias_v], 1)
            mask = None if mask is None else F.pad(mask, (0, 1))
            key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
        eye = torch.eye(e, dtype=q.dtype, device=q.device)
        o, weights = F.multi_head_attention_forward(
            *(t.transpose(0, 1) for t in (q, keys, values)),
            e, module.num_heads, None, None, None, None, module.add_zero_attn, 0.0, eye, None,
            training=False,
            key_padding_mask=key_padding_mask,
            need_weights=shared["need_weights"] or bool(g_weights),
            attn_mask=mask,
            use_separate_proj_weight=True,
            q_proj_weight=eye, k_proj_weight=eye, v_proj_weight=eye,
            average_attn_weights=shared["average_attn_weights"],
            is_causal=shared["is_causal"],
        )  # fmt: skip
        o = o.transpose(0, 1)  # [N, L, E], before out_proj
        tracked = [q, k, v] + ([bias_k, bias_v] if module.bias_k is not None else [])
        if any(not name.startswith("out_proj") for name in names):
            outputs = [F.linear(o, p["out_proj.weight"])] + ([weights] if g_weights else [])
            deltas = torch.autograd.grad(outputs, tracked, [g_out, *g_weights], allow_unused=True)
            deltas = [torch.zeros_like(t) if d is None else d for t, d in zip(tracked, deltas)]
    grads = {}
    for name in names:
        if name == "out_proj.weight":
            grads[name] = linear.weight_batch_grad(o.detach(), g_out)
        elif name == "out_proj.bias":
            grads[name] = linear.bias_batch_grad(None, g_out)
        elif name in ("bias_k", "bias_v"):
            grads[name] = deltas[3 if name == "bias_k" else 4].reshape(n, 1, 1, e)
        elif name == "in_proj_bias":
            grads[name] = torch.cat([linear.bias_batch_grad(None, d) for d in deltas[:3]], 1)
        else:
            products = [linear.weight_batch_grad(u, d) for u, d in zip((query, key, value), deltas)]
            if name == "in_proj_weight":
                grads[name] = torch.cat(products, 1)
            else:
                grads[name] = products["qkv".index(name[0])]
    return grads


def _batch_grad(x, g, *, param: str, compute_all, shared: SharedPass, **hp):
    """Per-sample gradients of ``param``: x as ``arrange_input`` gives it, g [N, L, E] (and
    the weights' [N, (H,) L, S']) -> [N, *param.shape]"""
    return shared.take(param, x, g, partial(compute_all, **hp))


def _sizes(xs):
    """(N, L, S, E, E_k + E_v) from the kept inputs' shapes."""
    (n, tq, e), (_, s, ek), (_, _, ev) = xs[:3]
    return n, tq, s, e, ek + ev


def _workspace(n, tq, s, e, num_heads) -> float:
    """What a recomputation holds: the H attention maps (scores, weights, their
    gradient) and q, k, v, the output and their gradients."""
    return n * (3 * num_heads * tq * s + 6 * (tq + s) * e)


def _vmap_cost(xs, gs, *, num_heads, **_) -> Cost:
    """A forward and its backward per sample: the projections and the H attention maps,
    charged 8× the forward's arithmetic (3× for the forward and backward, the rest for
    vmap's work on batches of one; without weights under ``is_causal`` it runs torch's
    fused kernel one sample at a time)."""
    if len(xs[0]) != 3:
        return Cost(0, 0)  # unbatched: the strategy raises the error that explains it
    n, tq, s, e, ekv = _sizes(xs)
    flops = 2 * n * (2 * tq * e * e + s * e * ekv + 2 * tq * s * e)
    return Cost(flops=8 * flops, workspace=_workspace(n, tq, s, e, num_heads))


def _outer_cost(xs, gs, *, num_heads, **_) -> Cost:
    """The projections, the identity maps in their place, the attention forward and
    backward, and the outer products."""
    if len(xs[0]) != 3:
        return Cost(0, 0)
    n, tq, s, e, ekv = _sizes(xs)
    projections = 2 * n * (2 * tq * e * e + s * e * ekv)
    identities = 2 * n * (2 * tq + 2 * s) * e * e
    return Cost(
        flops=2 * projections + 2 * identities + 3 * 4 * n * tq * s * e, workspace=_workspace(n, tq, s, e, num_heads)
    )


layer(
    nn.MultiheadAttention,
    hyperparams=_hyperparams,
    keep=_keep,
    arrange_input=_arrange_input,
    outputs=_outputs,
    arrange=_arrange,
    own_layout=True,
)
for _name in PARAMS:
    for _strategy, _all, _cost in ((OUTER, _outer_all, _outer_cost), (VMAP, _vmap_all, _vmap_cost)):
        register(nn.MultiheadAttention, _name, "batch_grad", _strategy, cost=shared_cost(_cost, _name))(
            partial(_batch_grad, param=_name, compute_all=_all)
        )
