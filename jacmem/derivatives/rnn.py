"""nn.RNN (tanh, relu), nn.GRU and nn.LSTM: several layers, bidirectional, ``batch_first``
both ways, with or without bias, LSTM ``proj_size``, ``h_0``/``c_0`` given or not.

Shapes, batch first (``arrange_input`` and ``arrange`` put it there): input ``[N, T, I]``
(padded, with ``lengths [N]``, where it came packed),
``h_0 [N, L·D, H_out]``, ``c_0 [N, L·D, H]``; output gradient ``[N, T, D·H_out]``, and
those of ``h_n [N, L·D, H_out]`` and ``c_n [N, L·D, H]`` (zeros where the loss ignores
them). ``L`` layers, ``D`` directions, ``G`` gates (1, 3 or 4), ``H_out`` is ``proj_size``
or ``H``.

Every weight is used as a linear map inside the recurrence, so its per-sample gradient
is a sum of outer products, as for nn.Linear (BackPACK does the same for one-layer
RNN/LSTM). For layer ``l`` and direction ``d``, with ``x_t`` the layer's input and
``h_{t-1}`` its previous (projected) state,

* ``a_t = W_ih x_t + b_ih`` and ``b_t = W_hh h_{t-1} + b_hh`` (both ``[N, G·H]``):
  ``∂W_ih = Σ_t δa_t x_tᵀ``, ``∂b_ih = Σ_t δa_t``, ``∂W_hh = Σ_t δb_t h_{t-1}ᵀ``,
  ``∂b_hh = Σ_t δb_t`` (GRU's ``r ⊙ (W_hn h + b_hn)`` included, as ``b_t`` is the whole
  linear map);
* with ``proj_size``, ``h_t = W_hr r_t``, ``r_t = o_t ⊙ tanh(c_t)``: ``∂W_hr = Σ_t δh_t r_tᵀ``.

The δ's are the gradients of the loss w.r.t. ``a_t``, ``b_t`` and ``h_t``. torch's
kernels do not expose them, and ``vmap`` cannot batch the fused RNN ops (it fails on
them), so the recurrence is recomputed, and one autograd pass from the output gradients
gives the δ's of every layer and direction at once. Two strategies recompute it:

* ``fused``: torch's fused recurrence, one layer and direction at a time, fed ``a`` with
  identity input weights, so that the gradient w.r.t. its input is the gates' δ (see
  :func:`_fused_all`); faster;
* ``unroll``: the recurrence step by step in plain tensor operations, with every
  ``a_t``, ``b_t``, ``h_t`` a tensor of its own: the same δ's by the definition.

Packed sequences (``PackedSequence`` input): ``arrange_input`` pads the input (and
notes how it was sorted in the call's :class:`Packing`, for ``arrange`` to pad the
output gradient alike); ``fused`` packs each chunk again for torch's packed kernels,
reverses each sequence within its own length (:func:`_reverse`), and adds ``∂L/∂h_n`` at
each sample's last step. ``unroll`` does not take them (its cost says so, and ``auto``
passes it by).

The recomputation cannot reproduce dropout between layers (``dropout > 0`` in training
mode): the backward raises an error that says so.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from jacmem import compat
from jacmem.derivatives import linear
from jacmem.derivatives.generic import SharedPass, shared_cost, track, trainable_sizes
from jacmem.derivatives.registry import REGISTRY, Cost, LayerDerivatives, Strategy, layer, register, registered_type

UNROLL, FUSED = "unroll", "fused"
GATES = {"RNN_TANH": 1, "RNN_RELU": 1, "GRU": 3, "LSTM": 4}


def _suffixes(num_layers: int, bidirectional: bool) -> list[str]:
    """Parameter name suffixes in torch's order: layer-major, forward then reverse."""
    return [f"_l{k}{s}" for k in range(num_layers) for s in (("", "_reverse") if bidirectional else ("",))]


def _names(module: nn.RNNBase) -> list[str]:
    return [n for n, _ in module.named_parameters()]


def _hyperparams(module: nn.RNNBase) -> dict:
    return dict(
        mode=module.mode,
        num_layers=module.num_layers,
        bidirectional=module.bidirectional,
        batch_first=module.batch_first,
        proj_size=module.proj_size,
        dropout=module.dropout if module.training and module.num_layers > 1 else 0.0,
        weights={n: p.detach() for n, p in module.named_parameters()},
        shared=SharedPass(trainable_sizes(module, _names(module))),
        packing=Packing(),
    )


class Packing:
    """How a call's packed input was sorted, for ``arrange`` to pad the output gradient
    as ``arrange_input`` padded the input: one per call, in its hyper-parameters (the
    gradient arrives without the input's ``batch_sizes``)."""

    def __init__(self):
        self.layout: tuple | None = None  # (batch_sizes, sorted_indices, unsorted_indices)

    def pad(self, data: Tensor) -> Tensor:
        """Packed [ΣT_n, F] -> padded [N, T, F], in the samples' original order, zeros past each end."""
        return pad_packed_sequence(PackedSequence(data, *self.layout), batch_first=True)[0]


def _keep(args: tuple, kwargs: dict) -> tuple:
    """(input, hx) of ``forward(input, hx=None)``; a packed input as its four fields."""
    inp = args[0]
    inp = tuple(inp) if isinstance(inp, PackedSequence) else inp
    return inp, args[1] if len(args) > 1 else kwargs.get("hx")


def _arrange_input(x: tuple, *, batch_first: bool, packing: Packing, **_) -> tuple:
    """-> (input [N, T, I], h_0 [N, L·D, H_out] or None, c_0 [N, L·D, H] or None,
    lengths [N] for a packed input or None, {flags}); a packed input is padded."""
    inp, hx = x
    h0, c0 = hx if isinstance(hx, (tuple, list)) else (hx, None)
    h0, c0 = (None if h is None or h.dim() != 3 else h.transpose(0, 1) for h in (h0, c0))
    if isinstance(inp, tuple):
        data, *packing.layout = inp
        padded, lengths = pad_packed_sequence(PackedSequence(data, *packing.layout), batch_first=True)
        return padded, h0, c0, lengths, dict(unbatched=False)
    if inp.dim() == 2:
        return None, None, None, None, dict(unbatched=True)
    return inp if batch_first else inp.transpose(0, 1), h0, c0, None, dict(unbatched=False)


def _outputs(output) -> tuple:
    """(output, h_n) or (output, h_n, c_n); a packed output's data."""
    out, state = output
    out = out.data if isinstance(out, PackedSequence) else out
    return (out, *state) if isinstance(state, tuple) else (out, state)


def _arrange(g, *, batch_first: bool, packing: Packing, **_) -> tuple:
    """Every gradient batch first (the states' always come batch second); a packed
    output's padded."""
    out, *states = g
    if packing.layout is not None:
        out = packing.pad(out)
    elif not batch_first and out.dim() == 3:
        out = out.transpose(0, 1)
    return (out, *(s.transpose(0, 1) if s.dim() == 3 else s for s in states))


def _cell(mode: str, a: Tensor, b: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """One step from the two linear maps ``a = W_ih x + b_ih`` and ``b = W_hh h + b_hh``:
    [N, G·H] ×2, h [N, H_out], c [N, H] (LSTM) -> new (r, c), with r [N, H] the state
    before any projection."""
    if mode == "RNN_TANH":
        return torch.tanh(a + b), c
    if mode == "RNN_RELU":
        return torch.relu(a + b), c
    if mode == "GRU":
        (ar, az, an), (br, bz, bn) = a.chunk(3, -1), b.chunk(3, -1)
        r, z = torch.sigmoid(ar + br), torch.sigmoid(az + bz)
        n = torch.tanh(an + r * bn)
        return (1 - z) * n + z * h, c
    i, f, gg, o = (a + b).chunk(4, -1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(gg)
    return torch.sigmoid(o) * torch.tanh(c), c


def _prepare(x, g, *, mode: str, num_layers: int, bidirectional: bool, dropout: float, weights) -> tuple:
    """What no recomputation can do raises; else (input [N, T, I], h_0 [N, L·D, H_out],
    c_0 [N, L·D, H], lengths [N] or None, output gradients), with zero initial states
    where none were given."""
    inp, h0, c0, lengths, flags = x
    if flags["unbatched"]:
        raise RuntimeError(
            "its input is unbatched ([T, I]): there is no batch axis to take per-sample gradients "
            "over; pass [N, T, I] with batch_first=True, or [T, N, I]"
        )
    if dropout > 0:
        raise RuntimeError(
            f"it applies dropout={dropout} between layers in training mode, which the per-sample "
            "recomputation cannot reproduce; set dropout=0.0 or call .eval() on it"
        )
    n, states = inp.shape[0], num_layers * (2 if bidirectional else 1)
    hidden = weights["weight_hh_l0"].shape[1]  # H_out
    cell = weights["weight_hh_l0"].shape[0] // GATES[mode]  # H
    h0 = inp.new_zeros(n, states, hidden) if h0 is None else h0
    c0 = inp.new_zeros(n, states, cell) if c0 is None else c0
    return inp, h0, c0, lengths, g


def _unroll_all(x, g, names, *, mode, num_layers, bidirectional, proj_size, dropout, weights) -> dict[str, Tensor]:
    """Per-sample gradients of ``names`` (see the module docstring)."""
    inp, h0, c0, lengths, (g_out, g_hn, *g_cn) = _prepare(
        x, g, mode=mode, num_layers=num_layers, bidirectional=bidirectional, dropout=dropout, weights=weights
    )
    if lengths is not None:  # its cost says so, and auto never picks it
        raise RuntimeError("strategy 'unroll' does not take packed sequences; strategy 'fused' does")
    steps = inp.shape[1]
    tracked: dict[str, tuple[list[Tensor], list[Tensor]]] = {}  # name -> (maps' outputs, their inputs)
    finals_h, finals_c = [], []
    with torch.enable_grad():
        layer_in = inp
        forward_seq = None  # the forward direction's output of a bidirectional layer
        for k, suffix in enumerate(_suffixes(num_layers, bidirectional)):
            w = partial(_weight, weights, suffix)
            a = track(F.linear(layer_in, w("weight_ih"), w("bias_ih")))  # [N, T, G·H]
            h, c = h0[:, k], c0[:, k]
            order = range(steps - 1, -1, -1) if suffix.endswith("_reverse") else range(steps)
            bs, hs_prev, hs, rs = [], [], [], []
            for t in order:
                b = track(F.linear(h, w("weight_hh"), w("bias_hh")))
                r, c = _cell(mode, a[:, t], b, h, c)
                bs.append(b), hs_prev.append(h), rs.append(r)
                h = track(F.linear(r, w("weight_hr"))) if proj_size else r
                hs.append(h)
            tracked["weight_ih" + suffix] = ([a], [layer_in.detach()])
            tracked["weight_hh" + suffix] = (bs, [t.detach() for t in hs_prev])
            if proj_size:
                tracked["weight_hr" + suffix] = (hs, [t.detach() for t in rs])
            finals_h.append(h), finals_c.append(c)
            seq = torch.stack(hs[::-1] if suffix.endswith("_reverse") else hs, 1)  # [N, T, H_out]
            if suffix.endswith("_reverse") or not bidirectional:
                layer_in = seq if not bidirectional else torch.cat([forward_seq, seq], -1)
            else:
                forward_seq = seq
        outputs = [layer_in, torch.stack(finals_h, 1)] + ([torch.stack(finals_c, 1)] if g_cn else [])
        wanted = {_map(name): tracked[_map(name)][0] for name in names}
        flat = [t for maps in wanted.values() for t in maps]
        deltas = torch.autograd.grad(outputs, flat, [g_out, g_hn, *g_cn], allow_unused=True)
    it = iter(deltas)
    delta = {key: [torch.zeros_like(t) if (d := next(it)) is None else d for t in maps] for key, maps in wanted.items()}
    return {name: _contract(name, delta[_map(name)], tracked[_map(name)][1]) for name in names}


def _weight(weights: dict[str, Tensor], suffix: str, kind: str):
    return weights.get(kind + suffix)


def _map(name: str) -> str:
    """The linear map a parameter belongs to: its weight's name."""
    return name.replace("bias_", "weight_")


def _contract(name: str, deltas: list[Tensor], inputs: list[Tensor]) -> Tensor:
    """Σ_t δ_t u_tᵀ (weights) or Σ_t δ_t (biases), from the maps' gradients and inputs,
    either one [N, T, ·] tensor each, or one [N, ·] per step."""
    delta = deltas[0] if len(deltas) == 1 else torch.stack(deltas, 1)
    if name.startswith("bias"):
        return linear.bias_batch_grad(None, delta)
    u = inputs[0] if len(inputs) == 1 else torch.stack(inputs, 1)
    return linear.weight_batch_grad(u, delta)


def _fused_all(x, g, names, *, mode, num_layers, bidirectional, proj_size, dropout, weights) -> dict[str, Tensor]:
    """Per-sample gradients of ``names``, with torch's fused recurrence computing the δ's.

    Each layer and direction runs alone, on ``a = W_ih x + b_ih`` as its input, with the
    identity as its input weights: so the gradient w.r.t. ``a`` is the gates' δ, from the
    fused backward. In processing order (reversed for ``_reverse``), with ``h_{t-1}`` the
    fused output shifted by one step behind ``h_0``:

    * ``δb = δa`` for RNN and LSTM (the gates add both maps); for GRU
      ``δb = [δa_r, δa_z, δa_n ⊙ r]`` with ``r = σ(a_r + b_r)``, ``b = W_hh h_{t-1} + b_hh``;
    * with ``proj_size``: ``δh_t = ∂L/∂out_t + W_hhᵀ δa_{t+1}`` (``+ ∂L/∂h_n`` at the
      last step), and ``r_t = o_t ⊙ tanh(c_t)`` from the gates and the cell recurrence.
    """
    inp, h0, c0, lengths, (g_out, g_hn, *g_cn) = _prepare(
        x, g, mode=mode, num_layers=num_layers, bidirectional=bidirectional, dropout=dropout, weights=weights
    )
    lstm, has_bias = mode == "LSTM", "bias_ih_l0" in weights
    runs = []  # per layer and direction: (suffix, input, a, output in processing order)
    finals_h, finals_c = [], []
    with torch.enable_grad():
        layer_in = inp
        forward_seq = None  # the forward direction's output of a bidirectional layer
        for k, suffix in enumerate(_suffixes(num_layers, bidirectional)):
            w = partial(_weight, weights, suffix)
            a = track(F.linear(layer_in, w("weight_ih"), w("bias_ih")))  # [N, T, G·H]
            eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
            params = [eye, w("weight_hh")] + ([torch.zeros_like(eye[0]), w("bias_hh")] if has_bias else [])
            params += [w("weight_hr")] if proj_size else []
            hx = (h0[:, k], c0[:, k]) if lstm else (h0[:, k],)
            reverse = suffix.endswith("_reverse")
            out, state = _run(mode, _reverse(a, lengths) if reverse else a, lengths, hx, params, has_bias)
            runs.append((suffix, layer_in.detach(), a, out))
            finals_h.append(state[0]), finals_c.extend(state[1:])
            seq = _reverse(out, lengths) if reverse else out
            if reverse or not bidirectional:
                layer_in = torch.cat([forward_seq, seq], -1) if bidirectional else seq
            else:
                forward_seq = seq
        outputs = [layer_in, torch.stack(finals_h, 1)] + ([torch.stack(finals_c, 1)] if g_cn else [])
        inputs = [a for _, _, a, _ in runs] + ([out for *_, out in runs] if proj_size else [])
        deltas = torch.autograd.grad(outputs, inputs, [g_out, g_hn, *g_cn], allow_unused=True)
    deltas = [torch.zeros_like(t) if d is None else d for t, d in zip(inputs, deltas)]
    last = torch.full_like(inp[:, 0, 0], inp.shape[1], dtype=torch.long) if lengths is None else lengths.to(inp.device)
    grads = {}
    for k, (suffix, x_in, a, out) in enumerate(runs):
        wanted = [name for name in names if _suffix_of(name) == suffix]
        if not wanted:
            continue
        w = partial(_weight, weights, suffix)
        reverse = suffix.endswith("_reverse")
        delta_a = deltas[k]  # time order, as a
        a_seq, d_seq = (_reverse(a.detach(), lengths), _reverse(delta_a, lengths)) if reverse else (a.detach(), delta_a)
        out = out.detach()
        h_prev = torch.cat([h0[:, k, None], out[:, :-1]], 1)  # [N, T, H_out], processing order
        b = F.linear(h_prev, w("weight_hh"), w("bias_hh"))  # [N, T, G·H]
        delta_b = d_seq
        if mode == "GRU":
            (ar, _, _), (br, _, _) = a_seq.chunk(3, -1), b.chunk(3, -1)
            dr, dz, dn = d_seq.chunk(3, -1)
            delta_b = torch.cat([dr, dz, dn * torch.sigmoid(ar + br)], -1)
        for name in wanted:
            kind = name[: -len(suffix)]
            if kind == "weight_ih":
                grads[name] = linear.weight_batch_grad(x_in, delta_a)
            elif kind == "bias_ih":
                grads[name] = linear.bias_batch_grad(None, delta_a)
            elif kind == "weight_hh":
                grads[name] = linear.weight_batch_grad(h_prev, delta_b)
            elif kind == "bias_hh":
                grads[name] = linear.bias_batch_grad(None, delta_b)
            else:  # weight_hr
                delta_h = deltas[len(runs) + k] + F.pad(d_seq[:, 1:] @ w("weight_hh"), (0, 0, 0, 1))
                delta_h[torch.arange(len(last)), last - 1] += g_hn[:, k]
                grads[name] = linear.weight_batch_grad(_lstm_cells(a_seq + b, c0[:, k]), delta_h)
    return grads


def _reverse(seq: Tensor, lengths: Tensor | None) -> Tensor:
    """Each sequence reversed within its length: [N, T, F] -> [N, T, F] (steps past the
    end stay where they are)."""
    if lengths is None:
        return seq.flip(1)
    steps = torch.arange(seq.shape[1], device=seq.device)
    lengths = lengths.to(seq.device)[:, None]
    index = torch.where(steps < lengths, lengths - 1 - steps, steps)  # [N, T]
    return seq.gather(1, index[..., None].expand_as(seq))


def _run(mode: str, seq: Tensor, lengths: Tensor | None, hx: tuple, params: list[Tensor], has_bias: bool):
    """One layer and direction of torch's fused recurrence, forward in time:
    seq [N, T, F], hx ([N, H_out], ([N, H])) -> (output [N, T, H_out], zeros past each
    end; final states ([N, H_out], ([N, H])))."""
    fused = compat.fused_recurrence(mode)
    if lengths is None:
        hx = tuple(h[None] for h in hx)
        out, *state = fused(seq, hx if len(hx) == 2 else hx[0], params, has_bias, 1, 0.0, False, False, True)
        return out, [h[0] for h in state]
    packed = pack_padded_sequence(seq, lengths.cpu(), batch_first=True, enforce_sorted=False)
    hx = tuple(h[packed.sorted_indices.to(seq.device)][None] for h in hx)
    hx = hx if len(hx) == 2 else hx[0]
    out, *state = fused(packed.data, packed.batch_sizes, hx, params, has_bias, 1, 0.0, False, False)
    out = pad_packed_sequence(PackedSequence(out, *packed[1:]), batch_first=True, total_length=seq.shape[1])[0]
    return out, [h[0][packed.unsorted_indices.to(seq.device)] for h in state]


def _suffix_of(name: str) -> str:
    """``weight_ih_l1_reverse`` -> ``_l1_reverse``"""
    return name[name.index("_l") :]


def _lstm_cells(gates: Tensor, c: Tensor) -> Tensor:
    """``r_t = o_t ⊙ tanh(c_t)``, the states before the projection, from the gates'
    pre-activations [N, T, 4H] and c_0 [N, H] -> [N, T, H]"""
    i, f, gg, o = gates.chunk(4, -1)
    i, f, gg, o = torch.sigmoid(i), torch.sigmoid(f), torch.tanh(gg), torch.sigmoid(o)
    cells = []
    for t in range(gates.shape[1]):
        c = f[:, t] * c + i[:, t] * gg[:, t]
        cells.append(c)
    return o * torch.tanh(torch.stack(cells, 1))


def _batch_grad(x, g, *, param: str, compute_all, shared: SharedPass, batch_first, packing, **hp) -> Tensor:
    """Per-sample gradients of ``param``: x as ``arrange_input`` gives it, g = (output
    [N, T, D·H_out], h_n [N, L·D, H_out], (c_n [N, L·D, H])) -> [N, *param.shape]"""
    return shared.take(param, x, g, partial(compute_all, **hp))


def _forward_flops(xs, weights) -> float:
    """The forward's multiply-adds, counted twice, over every weight matrix."""
    n, steps, _ = xs[0]
    return sum(2 * n * steps * w.numel() for name, w in weights.items() if name.startswith("weight"))


#: FLOP-equivalent of the Python and autograd work of one step of one layer and direction,
#: forward and backward, in the unrolled recurrence
STEP_OVERHEAD = 3e7


def _unroll_cost(xs, gs, *, num_layers, bidirectional, weights, **_) -> Cost:
    """Forward and backward of the recurrence step by step, and the contractions; the
    workspace holds each step's maps and states."""
    if xs[0] is None:
        return Cost(0, 0)  # unbatched: the strategy raises the error that explains it
    if xs[3] is not None:
        return None  # packed sequences: only 'fused' takes them
    n, steps, _ = xs[0]
    layers = num_layers * (2 if bidirectional else 1)
    return Cost(
        flops=4 * _forward_flops(xs, weights) + STEP_OVERHEAD * steps * layers,
        workspace=6 * n * steps * layers * weights["weight_hh_l0"].shape[0],
    )


def _fused_cost(xs, gs, *, num_layers, bidirectional, weights, **_) -> Cost:
    """Forward and backward of the fused recurrence, with its identity input weights,
    and the contractions; the workspace holds the maps, δ's and states of every layer."""
    if xs[0] is None:
        return Cost(0, 0)
    n, steps, _ = xs[0]
    gates = weights["weight_hh_l0"].shape[0]
    layers = num_layers * (2 if bidirectional else 1)
    identities = 2 * n * steps * gates * gates * layers
    return Cost(flops=4 * _forward_flops(xs, weights) + 2 * identities, workspace=5 * n * steps * layers * gates)


#: strategy name -> (all parameters at once, cost)
STRATEGIES = {UNROLL: (_unroll_all, _unroll_cost), FUSED: (_fused_all, _fused_cost)}


def _strategies(name: str) -> dict[str, Strategy]:
    return {
        strategy: Strategy(partial(_batch_grad, param=name, compute_all=fn), shared_cost(cost, name))
        for strategy, (fn, cost) in STRATEGIES.items()
    }


_ENTRIES: dict[tuple[type, tuple[str, ...]], LayerDerivatives] = {}


def _for_module(module: nn.RNNBase) -> LayerDerivatives:
    """The entry for this module's parameter names (they depend on its depth)."""
    base = REGISTRY[registered_type(REGISTRY, type(module))]
    key = (type(module), tuple(_names(module)))
    if key not in _ENTRIES:
        strategies = {(name, "batch_grad"): _strategies(name) for name in key[1]}
        _ENTRIES[key] = replace(base, for_module=None, strategies=strategies)
    return _ENTRIES[key]


for _module in (nn.RNN, nn.GRU, nn.LSTM):
    layer(
        _module,
        hyperparams=_hyperparams,
        keep=_keep,
        arrange_input=_arrange_input,
        outputs=_outputs,
        arrange=_arrange,
        for_module=_for_module,
        own_layout=True,
    )
    # the names of a one-layer bidirectional instance (with a projection for the LSTM), built
    # on the meta device: no storage and no draw from torch's random state at import
    example = _module(1, 2, bidirectional=True, device="meta", **(dict(proj_size=1) if _module is nn.LSTM else {}))
    for _name in _names(example):
        for _strategy, _impl in _strategies(_name).items():
            register(_module, _name, "batch_grad", _strategy, cost=_impl.cost)(_impl.fn)
