"""nn.RNN (tanh, relu), nn.GRU and nn.LSTM against a per-sample autograd loop, float64.

Every case runs every strategy the registry offers for its module type (enumerated; the
model tests run ``"auto"``): each of BatchGrad, BatchL2Grad, SumGradSquared and Variance alone, then all
four together in both flows (forward inside ``jacmem.extend``; ``jacmem.track`` before
the block) and with ``chunk_bytes=1`` (one sample per chunk).

The cases cover: several layers, bidirectional, ``batch_first`` both ways, bias on and
off, LSTM ``proj_size``, ``h_0``/``c_0`` given (computed by a Linear, so they are inputs
that require a gradient) or not, gradients arriving through the output alone, the
final states alone, or all of them (the others are completed with zeros), and packed
sequences of different lengths in no sorted order.

BackPACK 1.7.1 answers only for one layer, ``batch_first=True``, with bias, no dropout,
unidirectional, RNN with tanh and LSTM without projection (its ``_check_parameters``
raises otherwise), and only through the output sequence (its graph needs
``ReduceTuple``); those cases are compared with it too. It has no GRU at all.
"""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch
from tests.support.reference import (
    FIRST_ORDER,
    FIRST_ORDER_RUNS,
    FLOWS,
    REFERENCE,
    assert_close,
    check_against,
    check_dropout_raises_then_eval_works,
    mse,
    per_sample_grads,
    run_jacmem,
)
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import jacmem
from jacmem.derivatives import REGISTRY, lookup

N, T, I, H = 3, 4, 3, 3


class Head(nn.Module):
    """x [N, T, I] (always batch first here) -> [N, 2]: the recurrent layer, then a Linear
    on what ``use`` selects of (output, h_n, c_n). ``h0``: the initial state(s) come from a
    Linear of the input's mean, so they require a gradient."""

    def __init__(self, rnn: nn.RNNBase, use: str = "all", h0: bool = False):
        super().__init__()
        self.rnn, self.use = rnn, use
        d = 2 if rnn.bidirectional else 1
        self.states = rnn.num_layers * d
        h_out = rnn.proj_size or rnn.hidden_size
        self.h0 = nn.Linear(rnn.input_size, self.states * h_out) if h0 else None
        self.c0 = nn.Linear(rnn.input_size, self.states * rnn.hidden_size) if h0 and isinstance(rnn, nn.LSTM) else None
        features = {"output": d * h_out, "states": self.states * h_out, "all": d * h_out + self.states * h_out}[use]
        if isinstance(rnn, nn.LSTM) and use != "output":
            features += self.states * rnn.hidden_size
        self.out = nn.Linear(features, 2)

    def _state(self, lin, x):
        return None if lin is None else lin(x.mean(1)).unflatten(1, (self.states, -1)).transpose(0, 1).contiguous()

    def forward(self, x):
        hx = self._state(self.h0, x)
        if self.c0 is not None:
            hx = (hx, self._state(self.c0, x))
        seq = x if self.rnn.batch_first else x.transpose(0, 1)
        out, state = self.rnn(seq, hx) if hx is not None else self.rnn(seq)
        out = out if self.rnn.batch_first else out.transpose(0, 1)
        states = state if isinstance(state, tuple) else (state,)
        parts = []
        if self.use in ("output", "all"):
            parts.append(out.mean(1))
        if self.use in ("states", "all"):
            parts += [s.transpose(0, 1).flatten(1) for s in states]
        return self.out(torch.tanh(torch.cat(parts, 1)))


#: id -> (RNN class, its keyword arguments, what the head uses, h_0 given)
CASES: dict[str, tuple] = {
    "rnn-tanh-bf": (nn.RNN, dict(batch_first=True), "output", False),
    "rnn-relu-2layers-bidir-sf-nobias": (
        nn.RNN,
        dict(nonlinearity="relu", num_layers=2, bidirectional=True, bias=False),
        "all",
        True,
    ),
    "rnn-tanh-3layers-states-only": (nn.RNN, dict(num_layers=3, batch_first=True), "states", False),
    "gru-bf": (nn.GRU, dict(batch_first=True), "all", False),
    "gru-2layers-bidir-sf-h0": (nn.GRU, dict(num_layers=2, bidirectional=True), "all", True),
    "gru-nobias-states-only": (nn.GRU, dict(bias=False, batch_first=True), "states", True),
    "lstm-bf": (nn.LSTM, dict(batch_first=True), "output", False),
    "lstm-2layers-bidir-proj-sf-h0": (nn.LSTM, dict(num_layers=2, bidirectional=True, proj_size=2), "all", True),
    "lstm-3layers-nobias-bf-states": (nn.LSTM, dict(num_layers=3, bias=False, batch_first=True), "states", False),
    "lstm-bidir-proj-bf-output": (nn.LSTM, dict(bidirectional=True, proj_size=2, batch_first=True), "output", True),
}

_CACHE: dict = {}


def case(case_id: str):
    """(model, X, y, reduction, reference per-sample gradients), computed once."""
    if case_id not in _CACHE:
        torch.manual_seed(sum(map(ord, case_id)))
        cls, kwargs, use, h0 = CASES[case_id]
        model = Head(cls(I, H, **kwargs), use, h0).double()
        X = torch.randn(N, T, I, dtype=torch.float64)
        y = torch.randn(N, 2, dtype=torch.float64)
        reduction = ("mean", "sum")[len(case_id) % 2]
        _CACHE[case_id] = (model, X, y, reduction, per_sample_grads(model, X, y, mse, reduction))
    return _CACHE[case_id]


def strategies(module_type: type):
    """Every strategy registered for the module type."""
    return sorted(REGISTRY[module_type].names())


GRID = [(c, s) for c in CASES for s in strategies(CASES[c][0])]


@pytest.mark.parametrize("case_id,strategy", GRID, ids=[f"{c}-{s}" for c, s in GRID])
def test_rnn_layers(case_id, strategy):
    model, X, y, reduction, reference = case(case_id)
    for fields, flow, kwargs in FIRST_ORDER_RUNS:
        ctx = run_jacmem(
            model,
            X,
            y,
            mse,
            reduction,
            [FIRST_ORDER[f]() for f in fields],
            flow,
            strategy=strategy,
            strict=True,
            **kwargs,
        )
        check_against(model, reference, fields, f"[{case_id} {strategy} {'+'.join(fields)} {flow} {kwargs}]")
        rnn_decisions = [d for d in ctx.plan.decisions.values() if d.module.startswith("rnn")]
        assert rnn_decisions and all(d.chosen == strategy for d in rnn_decisions), ctx.explain()


def test_every_parameter_name_has_a_strategy_at_any_depth():
    """Parameter names depend on the depth: the registry's entry for each instance covers all."""
    for cls in (nn.RNN, nn.GRU, nn.LSTM):
        module = cls(2, 3, num_layers=5, bidirectional=True, **(dict(proj_size=2) if cls is nn.LSTM else {}))
        entry = lookup(module)
        assert set(entry.params) == {n for n, _ in module.named_parameters()}


class Model(nn.Module):
    """Conv1d over time, an LSTM or GRU, a residual connection around it, a Linear head:
    x [N, T, C] -> [N, 2]."""

    def __init__(self, cls):
        super().__init__()
        self.conv = nn.Conv1d(3, 4, 3, padding=1)
        self.rnn = cls(4, 2, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        z = torch.relu(self.conv(x.transpose(1, 2))).transpose(1, 2)  # [N, T, 4]
        out, _ = self.rnn(z)
        return self.head((out + z).mean(1))


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
def test_model_with_conv_linear_and_residual(cls):
    torch.manual_seed(1)
    model = Model(cls).double()
    X = torch.randn(4, 5, 3, dtype=torch.float64)
    y = torch.randn(4, 2, dtype=torch.float64)
    reference = per_sample_grads(model, X, y, mse, "mean")
    for flow in FLOWS:
        run_jacmem(model, X, y, mse, "mean", [e() for e in FIRST_ORDER.values()], flow, strict=True)
        check_against(model, reference, FIRST_ORDER, f"[{cls.__name__} model {flow}]")


def test_dropout_between_layers():
    """Dropout between layers in training mode cannot be recomputed: a clear error.
    In eval mode it is off, and the answer is right."""
    torch.manual_seed(2)
    model = Head(nn.LSTM(I, H, num_layers=2, dropout=0.5, batch_first=True)).double()
    X, y = torch.randn(N, T, I, dtype=torch.float64), torch.randn(N, 2, dtype=torch.float64)
    check_dropout_raises_then_eval_works(model, X, y, r"'rnn'.*dropout=0.5.*eval")


class Packed(nn.Module):
    """Packed sequences of lengths read off the data (so that each sample alone has its
    own), in no sorted order: x [N, T, I] -> [N, 2], through the padded output and h_n."""

    def __init__(self, rnn: nn.RNNBase, h0: bool = False):
        super().__init__()
        self.rnn = rnn
        d = 2 if rnn.bidirectional else 1
        h_out = rnn.proj_size or rnn.hidden_size
        self.states = rnn.num_layers * d
        self.h0 = nn.Linear(I, self.states * h_out) if h0 else None
        self.out = nn.Linear(d * h_out + self.states * h_out, 2)

    def forward(self, x):
        lengths = 1 + (x[:, 0, 0].abs() * 10).long() % T
        seq = x if self.rnn.batch_first else x.transpose(0, 1)
        seq = pack_padded_sequence(seq, lengths, batch_first=self.rnn.batch_first, enforce_sorted=False)
        hx = None
        if self.h0 is not None:  # [L·D, N, H_out], from a Linear
            hx = self.h0(x.mean(1)).unflatten(1, (self.states, -1)).transpose(0, 1).contiguous()
            if isinstance(self.rnn, nn.LSTM):
                hx = (hx, torch.zeros(self.states, x.shape[0], self.rnn.hidden_size, dtype=x.dtype))
        out, state = self.rnn(seq, hx)
        padded, _ = pad_packed_sequence(out, batch_first=True, total_length=T)
        h_n = (state[0] if isinstance(state, tuple) else state).transpose(0, 1).flatten(1)
        return self.out(torch.tanh(torch.cat([padded.sum(1) / lengths[:, None], h_n], 1)))


PACKED = {
    "gru-2layers-bidir": lambda: Packed(nn.GRU(I, H, num_layers=2, bidirectional=True, batch_first=True)),
    "lstm-bidir-proj-h0-sf": lambda: Packed(nn.LSTM(I, H, bidirectional=True, proj_size=2), h0=True),
    "rnn-relu-nobias": lambda: Packed(nn.RNN(I, H, nonlinearity="relu", bias=False, batch_first=True)),
}


@pytest.mark.parametrize("case_id", PACKED)
def test_packed_sequences(case_id):
    """Every strategy name; those that cannot take packed sequences say so in their cost,
    and auto takes one that can."""
    torch.manual_seed(sum(map(ord, case_id)))
    model = PACKED[case_id]().double()
    X, y = torch.randn(5, T, I, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    assert len(set((1 + (X[:, 0, 0].abs() * 10).long() % T).tolist())) > 1, "want lengths that differ"
    reference = per_sample_grads(model, X, y, mse, "mean")
    for strategy, flow in itertools.product(strategies(type(model.rnn)), FLOWS):
        run_jacmem(model, X, y, mse, "mean", [e() for e in FIRST_ORDER.values()], flow, strategy=strategy, strict=True)
        check_against(model, reference, FIRST_ORDER, f"[packed {case_id} {strategy} {flow}]")
    run_jacmem(model, X, y, mse, "mean", [e() for e in FIRST_ORDER.values()], chunk_bytes=1, strict=True)
    check_against(model, reference, FIRST_ORDER, f"[packed {case_id} chunked]")


def test_unbatched_input_raises():
    rnn = nn.RNN(I, H).double()
    with pytest.raises(RuntimeError, match=r"RNN.*unbatched"):
        with jacmem.extend(jacmem.BatchGrad()):
            rnn(torch.randn(T, I, dtype=torch.float64))[0].sum().backward()


# -- BackPACK, where it answers ----------------------------------------------------------


def _backpack_fields(cls, seed: int):
    """jacmem and BackPACK on Sequential(cls(batch_first), ReduceTuple(0), Flatten, Linear)."""
    from backpack import backpack, extend, extensions
    from backpack.custom_module.reduce_tuple import ReduceTuple

    torch.manual_seed(seed)
    model = nn.Sequential(cls(I, H, batch_first=True), ReduceTuple(index=0), nn.Flatten(), nn.Linear(T * H, 2)).double()
    X, y = torch.randn(N, T, I, dtype=torch.float64), torch.randn(N, 2, dtype=torch.float64)
    bp_model = extend(copy.deepcopy(model))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantities = [
            extensions.BatchGrad(),
            extensions.BatchL2Grad(),
            extensions.SumGradSquared(),
            extensions.Variance(),
        ]
        with backpack(*quantities):
            mse(bp_model(X), y, "mean").backward()
    return model, X, y, bp_model


@pytest.mark.parametrize("cls", [nn.RNN, nn.LSTM])
def test_against_backpack(cls):
    model, X, y, bp_model = _backpack_fields(cls, 3)
    bp = dict(bp_model.named_parameters())
    for strategy in strategies(cls):
        run_jacmem(model, X, y, mse, "mean", [e() for e in FIRST_ORDER.values()], strategy=strategy)
        for name, p in model.named_parameters():
            for field in FIRST_ORDER:
                assert_close(getattr(p, field), getattr(bp[name], field), f"{cls.__name__} {name} {field} vs BackPACK")
    reference = per_sample_grads(model, X, y, mse, "mean")  # and BackPACK agrees with the loop
    for p, gb in reference.items():
        name = next(n for n, q in model.named_parameters() if q is p)
        assert_close(bp[name].variance, REFERENCE["variance"](gb), f"BackPACK {name} variance vs loop")


@pytest.mark.parametrize(
    "cls,kwargs,why",
    [
        (nn.RNN, dict(num_layers=2), "num_layers"),
        (nn.LSTM, dict(bidirectional=True), "bidirectional"),
        (nn.RNN, dict(batch_first=False), "Batch axis"),
    ],
)
def test_backpack_cannot_answer(cls, kwargs, why):
    """Where BackPACK raises, jacmem's cases above compare with the loop only."""
    from backpack import backpack, extend, extensions

    kwargs = {"batch_first": True, **kwargs}
    rnn = extend(cls(I, H, **kwargs).double())
    with pytest.raises(NotImplementedError, match=why):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with backpack(extensions.BatchGrad()):
                rnn(torch.randn(N, T, I, dtype=torch.float64))[0].sum().backward()
