"""nn.Linear on inputs of any rank, and HF transformers' ``Conv1D`` (GPT-2's linear layer).

Shapes: ``x [N, *, I]``, ``g [N, *, O]``, ``weight [O, I]``, ``bias [O]``. ``Conv1D``
computes ``x @ weight + bias`` with ``weight [I, O]``: the transposed layout, the same
math; it is registered by its qualified name, so transformers is never imported. So is
Opacus's ``RNNLinear``, the Linear of its DPRNN, DPGRU and DPLSTM cells, which run it one
time step at a time on ``[N, I]``: its batch is axis 0 whatever a block's ``batch_first``
says (``own_layout``, as Opacus's GradSampleModule reads it). The middle
axes ``*`` (a sequence, say) are flattened to one axis ``T``; each sample's gradient sums
over them.

Every contraction here has two operands, so ``torch.einsum`` does it directly;
``opt_einsum.contract`` would plan a path on each call, which costs more than the
product itself on small layers.
"""

from __future__ import annotations

from dataclasses import replace
from math import prod

import torch
from torch import Tensor, nn

from jacmem.derivatives.projection import factors, kronecker, outer_sum
from jacmem.derivatives.quantities import add_moments
from jacmem.derivatives.registry import REGISTRY, Cost, Kronecker, layer, passthrough, register

#: HF transformers' ``Conv1D``, by qualified name (see :func:`jacmem.derivatives.qualified_name`)
CONV1D = "transformers.pytorch_utils.Conv1D"
#: Opacus's ``RNNLinear``, by qualified name
RNN_LINEAR = "opacus.layers.dp_rnn.RNNLinear"


def _flat(t: Tensor) -> Tensor:
    """[N, *, F] -> [N, T, F] (``T`` the product of the middle axes, 1 where there are
    none; a reshape, not einops: this runs for every parameter of every call)"""
    shape = t.shape
    return t.reshape(shape[0], prod(shape[1:-1]), shape[-1])


def _rows(t: Tensor) -> Tensor:
    """[N, *, F] -> [N·T, F]"""
    return t.reshape(-1, t.shape[-1])


def _dims(xs, gs):
    """Shapes of x and g -> (N, T, I, O)."""
    return xs[0], prod(xs[1:-1]), xs[-1], gs[-1]


def _outer_cost(xs, gs) -> Cost:
    N, T, I, O = _dims(xs, gs)
    return Cost(flops=2 * N * T * I * O, workspace=0)


@register(nn.Linear, "weight", "batch_grad", "outer", cost=_outer_cost, writes_out=True)
def weight_batch_grad(x: Tensor, g: Tensor, out=None) -> Tensor:
    """Per-sample gradients Σ_t g_t x_tᵀ: [N, *, I], [N, *, O] -> [N, O, I], written
    into ``out`` where given"""
    if g.dim() == 2:  # [N, O, 1] @ [N, 1, I]: no reshape (this runs for every Linear of every step)
        return torch.bmm(g.unsqueeze(2), x.unsqueeze(1), out=out)
    gs, xs = g.shape, x.shape  # (:func:`_flat` inline)
    return torch.bmm(
        g.reshape(gs[0], prod(gs[1:-1]), gs[-1]).transpose(1, 2), x.reshape(xs[0], prod(xs[1:-1]), xs[-1]), out=out
    )


@register(nn.Linear, "weight", "grad", "direct", cost=_outer_cost)
def weight_grad(x: Tensor, g: Tensor) -> Tensor:
    """Summed gradient: [N, *, I], [N, *, O] -> [O, I], one matrix product over the
    ``N·T`` rows (a transposed operand is BLAS's, not a copy)"""
    if g.dim() == 2:
        return g.t() @ x  # (no reshape: as above)
    return g.reshape(-1, g.shape[-1]).T @ x.reshape(-1, x.shape[-1])  # (:func:`_rows` inline)


def ghost_cost(xs, gs) -> Cost:
    N, T, I, O = _dims(xs, gs)
    if T == 1:
        return Cost(flops=2 * N * (I + O), workspace=0)
    return Cost(flops=2 * N * T * T * (I + O), workspace=2 * N * T * T)


@register(nn.Linear, "weight", "batch_l2", "ghost", cost=ghost_cost)
def weight_batch_l2_ghost(x: Tensor, g: Tensor) -> Tensor:
    """Ghost norm ‖Gᵀ X‖² = ⟨X Xᵀ, G Gᵀ⟩ per sample, without the gradient:
    [N, *, I], [N, *, O] -> [N]"""
    x, g = _flat(x), _flat(g)
    if x.shape[1] == 1:
        return x.square().sum((1, 2)) * g.square().sum((1, 2))
    xx = torch.bmm(x, x.transpose(1, 2))  # [N, T, T], contiguous: the dot below copies neither
    gg = torch.bmm(g, g.transpose(1, 2))
    return torch.linalg.vecdot(xx.flatten(1), gg.flatten(1))


def weight_ghost_factors(x: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """``weight [O, I]``'s per-sample gradient is ``Σ_t g_t ⊗ x_t``: -> ``[N, T, O]``, ``[N, T, I]``"""
    return _flat(g), _flat(x)


def conv1d_weight_ghost_factors(x: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """``Conv1D``'s ``weight [I, O]``: ``Σ_t x_t ⊗ g_t`` -> ``[N, T, I]``, ``[N, T, O]``"""
    return _flat(x), _flat(g)


def _squares_cost(xs, gs):
    N, T, I, O = _dims(xs, gs)
    return Cost(flops=N * (I + O) + 2 * N * I * O, workspace=N * (I + O)) if T == 1 else None


@register(nn.Linear, "weight", "sum_grad_squared", "squares", cost=_squares_cost)
def weight_sum_grad_squared(x: Tensor, g: Tensor) -> Tensor:
    """Σ_n (g_n x_nᵀ)² = (g²)ᵀ x², valid without middle axes: [N, I], [N, O] -> [O, I]"""
    return torch.einsum("no,ni->oi", _flat(g).squeeze(1).square(), _flat(x).squeeze(1).square())


#: bytes of per-sample gradients that the ``outer`` second moments hold at once
_MOMENT_BLOCK_BYTES = 16 * 2**20


def _moments_cost(xs, gs) -> Cost:
    """The per-sample products and their squares, summed; no workspace that grows with
    the batch (:func:`_sum_outer_squares` reuses one block of :data:`_MOMENT_BLOCK_BYTES`)"""
    N, T, I, O = _dims(xs, gs)
    return Cost(flops=2 * N * T * I * O + 2 * N * I * O, workspace=0)


def _sum_outer_squares(a: Tensor, b: Tensor, also: tuple[str, ...] = ()) -> Tensor | dict[str, Tensor]:
    """Σ_n (a_nᵀ b_n) ⊙ (a_nᵀ b_n), the products of a block of samples at a time in one
    reused buffer, squared into one result (a weight ``[3072, 768]`` at T > 1 otherwise
    went one sample per chunk, each with new buffers): [N, T, P], [N, T, Q] -> [P, Q];
    with ``also=("grad",)``, ``{"sum_grad_squared": that, "grad": Σ_n a_nᵀ b_n}``, the sum
    taken from the same products while they are in cache"""
    n, p, q = a.shape[0], a.shape[-1], b.shape[-1]
    block = max(1, min(n, _MOMENT_BLOCK_BYTES // max(p * q * a.element_size(), 1)))
    buffer, out = a.new_empty((block, p, q)), a.new_zeros((p, q))
    total = a.new_zeros((p, q)) if "grad" in also else None
    for start in range(0, n, block):
        k = min(block, n - start)
        add_moments(torch.bmm(a[start : start + k].transpose(1, 2), b[start : start + k], out=buffer[:k]), out, total)
    return out if total is None else {"sum_grad_squared": out, "grad": total}


@register(nn.Linear, "weight", "sum_grad_squared", "outer", cost=_moments_cost, also=("grad",))
def weight_sum_grad_squared_outer(x: Tensor, g: Tensor, also=()) -> Tensor | dict[str, Tensor]:
    """Σ_n (Σ_t g_t x_tᵀ)², blocks of samples at a time: [N, *, I], [N, *, O] -> [O, I]
    (and the summed gradient where ``also`` asks, see :func:`_sum_outer_squares`)"""
    return _sum_outer_squares(_flat(g), _flat(x), also)


@register(nn.Linear, "bias", "batch_grad", "sum")
@register(CONV1D, "bias", "batch_grad", "sum")
def bias_batch_grad(x, g: Tensor) -> Tensor:
    """Per-sample bias gradients: [N, *, O] -> [N, O]"""
    if g.dim() == 2:  # (g itself, copied: one op, where a sum over T = 1 takes two)
        return g.clone(memory_format=torch.contiguous_format)
    gs = g.shape  # (:func:`_flat` inline: this runs for every Linear of every step)
    return g.reshape(gs[0], prod(gs[1:-1]), gs[-1]).sum(1)


def grad_proj_cost(xs, gs, *, dim, kind, **_) -> Cost | None:
    """The kronecker kind's: both factors projected, then their outer products summed
    (``None`` for the dense kind: from per-sample gradients)"""
    if kind != "kronecker":
        return None
    N, T, I, O = _dims(xs, gs)
    return Cost(flops=2 * N * T * (O + I) * max(factors(dim)) + 2 * N * T * dim, workspace=N * T * sum(factors(dim)))


@register(nn.Linear, "weight", "grad_proj", "kronecker", cost=grad_proj_cost)
def weight_grad_proj(x: Tensor, g: Tensor, *, dim, kind, seed, name) -> Tensor:
    """The kronecker projection ``Σ_t (P_rows g_t)(P_cols x_t)ᵀ`` of ``weight [O, I]``, never
    the per-sample gradients: [N, *, I], [N, *, O] -> [N, dim]"""
    p_rows, p_cols = kronecker(seed, name, dim, g.shape[-1], x.shape[-1], dtype=g.dtype, device=g.device)
    return outer_sum(_flat(g) @ p_rows.T, _flat(x) @ p_cols.T)


@register(CONV1D, "weight", "grad_proj", "kronecker", cost=grad_proj_cost)
def conv1d_weight_grad_proj(x: Tensor, g: Tensor, *, dim, kind, seed, name) -> Tensor:
    """Conv1D's ``weight [I, O]``: ``Σ_t (P_rows x_t)(P_cols g_t)ᵀ``: [N, *, I], [N, *, O] -> [N, dim]"""
    p_rows, p_cols = kronecker(seed, name, dim, x.shape[-1], g.shape[-1], dtype=g.dtype, device=g.device)
    return outer_sum(_flat(x) @ p_rows.T, _flat(g) @ p_cols.T)


# -- HF Conv1D: weight [I, O] --------------------------------------------------------


@register(CONV1D, "weight", "batch_grad", "outer", cost=_outer_cost, writes_out=True)
def conv1d_weight_batch_grad(x: Tensor, g: Tensor, out=None) -> Tensor:
    """Per-sample gradients Σ_t x_t g_tᵀ: [N, *, I], [N, *, O] -> [N, I, O], written
    into ``out`` where given"""
    return torch.bmm(_flat(x).transpose(1, 2), _flat(g), out=out)


@register(CONV1D, "weight", "grad", "direct", cost=_outer_cost)
def conv1d_weight_grad(x: Tensor, g: Tensor) -> Tensor:
    """Summed gradient: [N, *, I], [N, *, O] -> [I, O]"""
    return _rows(x).T @ _rows(g)


register(CONV1D, "weight", "batch_l2", "ghost", cost=ghost_cost)(weight_batch_l2_ghost)  # a norm: layout-free


@register(CONV1D, "weight", "sum_grad_squared", "squares", cost=_squares_cost)
def conv1d_weight_sum_grad_squared(x: Tensor, g: Tensor) -> Tensor:
    """Σ_n (x_n g_nᵀ)²: [N, I], [N, O] -> [I, O]"""
    return torch.einsum("ni,no->io", _flat(x).squeeze(1).square(), _flat(g).squeeze(1).square())


@register(CONV1D, "weight", "sum_grad_squared", "outer", cost=_moments_cost, also=("grad",))
def conv1d_weight_sum_grad_squared_outer(x: Tensor, g: Tensor, also=()) -> Tensor | dict[str, Tensor]:
    """Σ_n (Σ_t x_t g_tᵀ)², blocks of samples at a time: [N, *, I], [N, *, O] -> [I, O]
    (and the summed gradient where ``also`` asks)"""
    return _sum_outer_squares(_flat(x), _flat(g), also)


# -- Curvature: Kronecker factors and the GGN diagonal ----------------------------------


def kronecker_input(x: Tensor, out_shape, dtype, approx=None, **_) -> Tensor:
    """``A = Σ_{n,t} x_t x_tᵀ / (N·T)``, the middle axes flattened into the batch
    (KFAC-expand, the default); with ``approx="reduce"``, ``Σ_n x̄ x̄ᵀ / N`` of the
    means over the middle axes ``x̄ = 1/T Σ_t x_t``: ``[N, *, I] -> [I, I]``"""
    if approx == "reduce":
        x = x.reshape(x.shape[0], -1, x.shape[-1]).mean(1)
    flat = x.reshape(-1, x.shape[-1])
    return (flat.T @ flat).div_(flat.shape[0])  # two operands: a matmul, without opt_einsum's planning


def kronecker_input_with_bias(x: Tensor, out_shape, dtype, approx=None, **hp) -> Tensor:
    """:func:`kronecker_input` of ``[x, 1]``, a one appended to each row (the bias as a
    column of ones): ``[N, *, I] -> [I + 1, I + 1]``"""
    return kronecker_input(torch.cat([x, x.new_ones(*x.shape[:-1], 1)], dim=-1), out_shape, dtype, approx, **hp)


def squared_vjps(x, S: Tensor, params, batch: bool, budget: float, **_) -> dict[str, Tensor] | None:
    """Without middle axes, ``Σ_v (S[v] ⊗ x)² = (Σ_v S[v]²) ⊗ x²``: ``x [N, I]``,
    ``S [V, N, O]`` -> ``[(N,) O, I]`` and ``[(N,) O]``; ``None`` for other inputs"""
    if not isinstance(x, Tensor) or x.dim() != 2:
        return None
    s2 = S.square().sum(0)  # [N, O]
    out = {}
    for name in params:
        if name == "weight":  # two operands: a product, without opt_einsum's planning (~50 µs a call)
            x2 = x.square()
            out[name] = s2.unsqueeze(2) * x2.unsqueeze(1) if batch else s2.T @ x2
        else:
            out[name] = s2 if batch else s2.sum(0)
    return out


layer(
    nn.Linear,
    input_free=("bias",),
    compute_once=True,
    kronecker=Kronecker(kronecker_input, channels_last=True, with_bias=kronecker_input_with_bias),
    squared_vjps=squared_vjps,
    ghost_factors={"weight": weight_ghost_factors},
)


# -- Input Jacobian, for second-order extensions ---------------------------------------


def jac_t(xs, out, S: Tensor, *, weight: Tensor):
    """Jᵀ S = S W per vector: [V, N, *, O] -> ([V, N, *, I],), as one matrix product
    (``S @ W`` on a strided ``S``, such as KFRA's transposed rows, becomes V·N
    vector-matrix products); where ``S``'s last two axes are column-major (an LM head's
    output gradient from logits transposed to ``[N, V, T]``), whose rows cannot be
    flattened without copying ``S`` whole, a batched product over the leading axes"""
    if S.dim() > 3 and S.stride(-2) == 1 and S.stride(-1) != 1:
        batched = S.flatten(0, -3)  # [V·N·…, T, O]: a view where only the last two axes are transposed
        return (torch.bmm(batched, weight.expand(batched.shape[0], *weight.shape)).view(*S.shape[:-1], -1),)
    return ((S.flatten(0, -2) @ weight).unflatten(0, S.shape[:-1]),)


def vjp(x, g: Tensor, *, weight: Tensor) -> Tensor:
    """The input's gradient ``g W``: [N, *, O] -> [N, *, I]; one matrix product where ``g``
    is ``[N, O]``, else :func:`jac_t`'s (on one vector)"""
    return g @ weight if g.dim() == 2 else jac_t((x,), None, g.unsqueeze(0), weight=weight)[0][0]


passthrough(
    nn.Linear, jac_t=jac_t, vjp=vjp, sample_independent=True, hyperparams=lambda m: {"weight": m.weight.detach()}
)
passthrough(
    CONV1D, jac_t=jac_t, vjp=vjp, sample_independent=True, hyperparams=lambda m: {"weight": m.weight.detach().T}
)
# Conv1D's factors are the Linear's: G ⊗ A approximates the block of weight.T [O, I]
layer(
    CONV1D,
    input_free=("bias",),
    compute_once=True,
    kronecker=Kronecker(kronecker_input, channels_last=True, transposed=True, with_bias=kronecker_input_with_bias),
    ghost_factors={"weight": conv1d_weight_ghost_factors},
)
# RNNLinear is nn.Linear, one time step at a time: its entry, but for the batch axis
REGISTRY[RNN_LINEAR] = replace(REGISTRY[nn.Linear], own_layout=True)
