"""Every trainable parameter the loss reaches gets its second-order result, or the
backward raises before any is written (issue 36, item 3): stock attention
(``nn.MultiheadAttention`` inside ``nn.TransformerEncoderLayer``: a module with children
and parameters of its own) and parameters read directly in a module's forward (a
position embedding on the root), against the dense GGN of torch.func (float64).
"""

from __future__ import annotations

import pytest
import torch
from tests.support.reference import cross_entropy, per_sample_grads
from tests.support.secondorder_ref import blocks, dense, diagonals
from torch import nn

import jacmem
from jacmem import (
    EKFAC,
    GGNMP,
    KFAC,
    KFLR,
    KFRA,
    BatchDiagGGNExact,
    DiagGGNExact,
    DiagHessian,
    UnsupportedCurvatureError,
)
from jacmem.derivatives import generic

pytestmark = pytest.mark.usefixtures("float64_default")

N, T, D, C = 3, 3, 4, 3


class Encoder(nn.Module):
    """A position parameter added to the input on the root, a stock encoder layer, a head."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, T, D) / 2)
        self.enc = nn.TransformerEncoderLayer(D, 2, dim_feedforward=6, dropout=0.0, batch_first=True)
        self.head = nn.Linear(T * D, C)

    def forward(self, x):
        return self.head(self.enc(x + self.pos).flatten(1))


class Shifted(nn.Module):
    """Modules jacmem has Jacobians for, and a position parameter on the root."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(T, D) / 2)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(T * D, 5), nn.Tanh(), nn.Linear(5, C))

    def forward(self, x):
        return self.net(x + self.pos)


def _data():
    torch.manual_seed(0)
    return torch.randn(N, T, D), torch.randint(0, C, (N,))


def _check_ggn_diagonals(model: nn.Module, X, y) -> None:
    """DiagGGNExact and BatchDiagGGNExact of every trainable parameter, after one backward
    of the mean cross-entropy, against torch.func's dense GGN, whole and per sample."""
    lossf = nn.CrossEntropyLoss()
    with jacmem.extend(DiagGGNExact(), BatchDiagGGNExact()):
        lossf(model(X), y).backward()
    ggn, _ = dense(model, lossf, X, y, hess=False)
    ggn_n, _ = dense(model, lossf, X, y, per_sample=True, hess=False)
    want, want_n = diagonals(model, ggn), diagonals(model, ggn_n)
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.diag_ggn_exact, want[name], rtol=1e-9, atol=1e-12, msg=name)
            torch.testing.assert_close(p.diag_ggn_exact_batch, want_n[name], rtol=1e-9, atol=1e-12, msg=name)


def test_a_parameter_no_call_covers_raises_before_any_result():
    """DiagHessian follows module Jacobians only: the root's ``pos`` has none, so the
    backward raises, naming it and its module, and nothing is written (it used to give
    every other parameter its result, ``pos`` nothing, and a warning with the wrong cause)."""
    model, (X, y) = Shifted(), _data()
    with pytest.raises(NotImplementedError, match=r"'pos' of module 'Shifted' \(Shifted\)"):
        with jacmem.extend(DiagHessian()):
            nn.CrossEntropyLoss()(model(X), y).backward()
    assert not any(hasattr(p, "diag_h") for p in model.parameters())


@pytest.mark.filterwarnings("ignore:.*recomputed with torch.func")  # exact, slow where vmap runs attention by sample
def test_stock_encoder_layer_and_a_root_position_parameter_are_exact():
    """MultiheadAttention's in_proj_weight, in_proj_bias and out_proj (a module with
    children and parameters of its own) and the root's ``pos`` (read in the root's
    forward: its direct-use records, as first order's) get their GGN diagonals, whole
    and per sample, through the autograd path: they used to get nothing (the second-order
    engine skipped every module with children)."""
    model, (X, y) = Encoder().eval(), _data()
    _check_ggn_diagonals(model, X, y)


def test_a_parameter_read_outside_every_module_raises():
    """A parameter the loss reads outside every module's forward (``logits * scale``)
    has no call to follow: the backward raises before any result, naming it by its shape."""
    model, (X, y) = Shifted(), _data()
    scale = nn.Parameter(torch.tensor(2.0))
    with pytest.raises(NotImplementedError, match=r"a parameter of shape \[\] read outside every module"):
        with jacmem.extend(DiagGGNExact()):
            nn.CrossEntropyLoss()(model(X) * scale, y).backward()
    assert not any(hasattr(p, "diag_ggn_exact") for p in model.parameters())


@pytest.mark.parametrize("ext", [KFLR(), KFAC(), KFRA(), EKFAC(), GGNMP()], ids=repr)
def test_kinds_with_nothing_for_a_parameter_raise_before_any_result(ext):
    """The Kronecker kinds have no factors for MultiheadAttention's ``in_proj_*`` or the
    root's ``pos`` (KFRA none for LayerNorm either); the products cannot repeat the root's call (issue 36, item 3: they
    used to warn and give the other parameters theirs). The backward raises before it
    begins, naming the parameter and its module; nothing is written, not even ``.grad``."""
    model, (X, y) = Encoder().eval(), _data()
    with pytest.raises(
        UnsupportedCurvatureError,
        match=r"'(pos|in_proj_\w+|weight|bias)' of module '(Encoder|enc.self_attn|enc.norm\d)'",
    ):
        with jacmem.extend(ext):
            nn.CrossEntropyLoss()(model(X), y).backward()
    assert not any(hasattr(p, ext.savefield) or p.grad is not None for p in model.parameters())


def test_kflr_of_the_parameters_backward_asks_for():
    """``backward(inputs=...)``: only those parameters are asked for, so the ones KFLR has
    nothing for, left out, raise nothing; the head's ``G ⊗ A`` is its exact GGN block at
    one sample."""
    model = Encoder().eval()
    X, y = (t[:1] for t in _data())
    lossf = nn.CrossEntropyLoss()
    with jacmem.extend(KFLR()):
        lossf(model(X), y).backward(inputs=list(model.head.parameters()))
    assert not any(hasattr(p, "kflr") or p.grad is not None for p in model.enc.parameters())
    want = blocks(model, dense(model, lossf, X, y, hess=False)[0])
    G, A = model.head.weight.kflr
    torch.testing.assert_close(torch.kron(G, A), want["head.weight"], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(model.head.bias.kflr[0], want["head.bias"], rtol=1e-9, atol=1e-12)


def test_a_parameter_left_out_of_the_backward_is_not_refused():
    """DiagHessian has no call to follow for the root's ``pos``; a backward that asks only
    for the Sequential's parameters (``inputs=``) does not reach it, and gives them the
    dense Hessian's diagonal (it used to raise on ``pos`` all the same)."""
    model, (X, y) = Shifted(), _data()
    lossf = nn.CrossEntropyLoss()
    with jacmem.extend(DiagHessian()):
        lossf(model(X), y).backward(inputs=list(model.net.parameters()))
    assert not hasattr(model.pos, "diag_h") and model.pos.grad is None
    want = diagonals(model, dense(model, lossf, X, y)[1])
    for name, p in model.net.named_parameters():
        torch.testing.assert_close(p.diag_h, want[f"net.{name}"], rtol=1e-9, atol=1e-12, msg=name)


class Recurrent(nn.Module):
    """An RNN, GRU or LSTM on ``[N, T, I]`` or ``[T, N, I]``, a head on its last step."""

    def __init__(self, cls, batch_first):
        super().__init__()
        self.rnn, self.head = cls(D, 5, batch_first=batch_first), nn.Linear(5, C)

    def forward(self, x):
        out = self.rnn(x)[0]
        return self.head(out[:, -1] if self.rnn.batch_first else out[-1])


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("cls", [nn.RNN, nn.GRU, nn.LSTM])
def test_recurrent_layers_raise_naming_the_module_and_the_cause(cls, batch_first):
    """The autograd path follows one output per call, and an RNN's call returns its
    output and its final states: the backward raises before any result, naming the
    module, the cause and the fix (``T == N``, where a batch on axis 1 read as axis 0
    would pass unseen); frozen, the head's GGN diagonal is the dense one's."""
    torch.manual_seed(0)
    model, lossf = Recurrent(cls, batch_first), nn.CrossEntropyLoss()
    X, y = torch.randn(N, T, D) if batch_first else torch.randn(T, N, D), torch.randint(0, C, (N,))
    msg = rf"'weight_ih_l0' of module 'rnn' \({cls.__name__}\).*returns [23] tensors.*one output per call: freeze"
    with pytest.raises(UnsupportedCurvatureError, match=msg), jacmem.extend(DiagGGNExact()):
        lossf(model(X), y).backward()
    assert not any(hasattr(p, "diag_ggn_exact") or p.grad is not None for p in model.parameters())
    model.rnn.requires_grad_(False)
    with jacmem.extend(DiagGGNExact()):
        lossf(model(X), y).backward()
    want = diagonals(model, dense(model, lossf, X, y, hess=False)[0])
    for name, p in model.head.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, want[f"head.{name}"], rtol=1e-9, atol=1e-12, msg=name)


def test_attention_with_the_batch_second_raises_naming_the_fix():
    """``batch_first=False`` attention (``[T, N, D]``, ``T == N``): the autograd path
    reads the batch on axis 0 of a call's output, so the backward raises, naming the
    module and ``batch_first=True``."""
    torch.manual_seed(0)
    enc = nn.TransformerEncoderLayer(D, 2, dim_feedforward=6, dropout=0.0).eval()
    model, lossf = nn.Sequential(enc, nn.Flatten(0, 1), nn.Linear(D, C)), nn.CrossEntropyLoss()
    X, y = torch.randn(T, N, D), torch.randint(0, C, (T * N,))
    msg = r"'in_proj_weight' of module '0.self_attn' \(MultiheadAttention\).*batch_first=False.*batch_first=True"
    with pytest.raises(UnsupportedCurvatureError, match=msg), jacmem.extend(DiagGGNExact()):
        lossf(model(X), y).backward()
    assert not any(hasattr(p, "diag_ggn_exact") for p in model.parameters())


@pytest.mark.filterwarnings("ignore:.*recomputed with torch.func")
def test_attention_with_its_input_projection_frozen_is_exact_in_both_orders():
    """MultiheadAttention with ``in_proj_*`` frozen (LoRA-style fine-tuning) reads its
    ``out_proj``'s parameters itself: the one rule counts the call (a registered type), in
    first order as in second. Second order used to count only modules with trainable
    parameters of their own, and raised naming ``out_proj``'s parameters as read outside
    every module, where first order gave them their per-sample gradients."""
    model, (X, y) = Encoder().eval(), _data()
    attn = model.enc.self_attn
    attn.in_proj_weight.requires_grad_(False)
    attn.in_proj_bias.requires_grad_(False)
    _check_ggn_diagonals(model, X, y)
    grads = per_sample_grads(model, X, y, cross_entropy)
    with jacmem.extend(jacmem.BatchGrad()):
        nn.CrossEntropyLoss()(model(X), y).backward()
    for p in (attn.out_proj.weight, attn.out_proj.bias):
        torch.testing.assert_close(p.grad_batch, grads[p], rtol=1e-9, atol=1e-12)


V = 7


class Everything(nn.Module):
    """Each kind of call the one rule counts: an embedding whose weight the head shares (a
    tied weight, two calls), a position embedding called on ``[1, T]`` ids (a broadcast over
    the batch), a parameter read in the root's forward, and MultiheadAttention (its own
    parameters and its ``out_proj``'s)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.pos = nn.Embedding(T, D)
        self.shift = nn.Parameter(torch.randn(1, 1, D) / 3)
        self.att = nn.MultiheadAttention(D, 2, batch_first=True)
        self.head = nn.Linear(D, V)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids) + self.pos(torch.arange(ids.shape[1])[None]) + self.shift
        h, _ = self.att(h, h, h, need_weights=False)
        return self.head(h).flatten(1)


@pytest.mark.filterwarnings("ignore:.*recomputed with torch.func")
def test_first_and_second_order_count_the_same_calls():
    """Both engines count each call of :class:`Everything` (issue 37, item 1): every
    trainable parameter gets its per-sample gradient (against a loop of per-sample
    backwards) and its GGN diagonal, whole and per sample (against torch.func's dense GGN),
    the tied weight summed over its two calls, the broadcast and the root's parameter per
    sample."""
    torch.manual_seed(0)
    model = Everything()
    ids, y = torch.randint(0, V, (N, T)), torch.randint(0, T * V, (N,))
    _check_ggn_diagonals(model, ids, y)
    grads = per_sample_grads(model, ids, y, cross_entropy)
    model.zero_grad()
    with jacmem.extend(jacmem.BatchGrad()):
        nn.CrossEntropyLoss()(model(ids), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, grads[p], rtol=1e-9, atol=1e-12, msg=name)


class Twice(nn.Module):
    """One Linear called twice (its weight and bias shared by two calls), then a head."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.head = nn.Linear(T * D, C)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(torch.tanh(self.lin(x)))).flatten(1))


def _nodes(engine) -> dict[str, list]:
    """The second-order engine's nodes with parameters made since the last backward began, by name."""
    nodes: dict[str, list] = {}
    for node in engine.calls.values():
        nodes.setdefault(node.name, []).append(node)
    return nodes


@pytest.mark.filterwarnings("ignore:.*recomputed with torch.func")
def test_second_order_builds_its_nodes_on_first_orders_records():
    """One recorder (issue 37, item 1): in a block with first- and second-order extensions,
    the recorder of first order's stager is the block's, and the second-order engine's node
    of each call it recorded whole holds that very record (MultiheadAttention's, with its
    ``out_proj``'s parameters; the tied embedding's and head's, whose tie comes from that
    recorder's use counts; the position embedding's, on a batch of one), making none of its
    own. The root's ``shift``, which first order follows as a direct use, is the one call
    it records itself (with the generic recomputation, as before)."""
    torch.manual_seed(0)
    model = Everything()
    ids, y = torch.randint(0, V, (N, T)), torch.randint(0, T * V, (N,))
    with jacmem.extend(jacmem.BatchGrad(), DiagGGNExact()) as ext:
        first, second = ext.block.engines
        nn.CrossEntropyLoss()(model(ids), y)
        assert ext.block.context.recorder is first.recorder
        nodes = _nodes(second)
        assert sorted(nodes) == ["Everything", "att", "emb", "head", "pos"]
        records = set(first.recorder.records)
        for name in ("emb", "pos", "att", "head"):
            (node,) = nodes[name]
            assert node.record in records and node.record.module is node.module, name
            assert node.param_input is node.record.x and node.param_hyperparams is node.record.hp, name
        assert set(nodes["att"][0].params) == {"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"}
        assert nodes["emb"][0].tied == nodes["head"][0].tied == {"weight"}
        assert [rec.name for rec in second.own.records] == ["Everything"]


def test_a_second_order_block_alone_records_with_its_own_recorder():
    """A block with second-order extensions alone: the engine's own recorder is the block's,
    and every node with parameters is built on one of its records."""
    model, (X, y) = Twice(), _data()
    with jacmem.extend(DiagGGNExact()) as ext:
        (second,) = ext.block.engines
        nn.CrossEntropyLoss()(model(X), y)
        assert ext.block.context.recorder is second.own
        nodes = _nodes(second)
        assert {name: len(calls) for name, calls in nodes.items()} == {"lin": 2, "head": 1}
        assert all(n.record in set(second.own.records) for ns in nodes.values() for n in ns)
        assert all(n.tied == {"weight", "bias"} for n in nodes["lin"])


def test_a_module_called_twice_beside_first_order_is_exact():
    """A Linear called twice, in a block with BatchGrad and DiagGGNExact: second order finds
    the two calls sharing its parameters through first order's recorder (its use counts),
    and sums their curvature; both results against references (float64): the per-sample
    gradients against a loop of per-sample backwards, the GGN diagonal against torch.func's
    dense GGN."""
    model, (X, y) = Twice(), _data()
    lossf = nn.CrossEntropyLoss()
    with jacmem.extend(jacmem.BatchGrad(), DiagGGNExact()):
        lossf(model(X), y).backward()
    want = diagonals(model, dense(model, lossf, X, y, hess=False)[0])
    grads = per_sample_grads(model, X, y, cross_entropy)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, want[name], rtol=1e-9, atol=1e-12, msg=name)
        torch.testing.assert_close(p.grad_batch, grads[p], rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("make", [Everything, Encoder, Shifted], ids=lambda m: m.__name__)
def test_a_root_parameter_comes_from_its_direct_use_records(make, monkeypatch):
    """A parameter read in the root's own forward that meets the batch by broadcasts alone
    (``shift``, ``pos``): second order takes it from the recorder's direct-use records, on
    the tensor its per-sample gradient arrives at, as first order does, and recomputes
    nothing. It used to recompute the root's whole forward sample by sample (torch.func's
    vmap: MultiheadAttention's backward one sample at a time, with a warning; 2.9 s
    against 0.03 s on :class:`Everything`). Whole and per sample, against torch.func's
    dense GGN (float64)."""
    torch.manual_seed(0)
    model = make().eval()
    if make is Everything:
        X, y = torch.randint(0, V, (N, T)), torch.randint(0, T * V, (N,))
    else:
        X, y = _data()
    recomputed = []
    vjp = generic.per_sample_vjp
    monkeypatch.setattr(generic, "per_sample_vjp", lambda *a: recomputed.append(a[-1]) or vjp(*a))
    _check_ggn_diagonals(model, X, y)
    assert not [what for what in recomputed if make.__name__ in what]


class PosTwice(nn.Module):
    """A root parameter read twice in the root's forward, each time met by the batch."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(T, D) / 2)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(T * D, 5), nn.Tanh(), nn.Linear(5, C))

    def forward(self, x):
        return self.net(torch.tanh(x + self.pos) * 2 + self.pos)


class PosMixed(PosTwice):
    """One use met by the batch, one that may mix the samples (a matrix product)."""

    def forward(self, x):
        return self.net(x + self.pos + x @ self.pos.T @ self.pos)


class PosCalledTwice(nn.Module):
    """:class:`PosTwice` called twice: its ``pos`` used by two calls, two uses each."""

    def __init__(self):
        super().__init__()
        self.inner = PosTwice()

    def forward(self, x):
        return self.inner(x) + self.inner(x * 2)


@pytest.mark.parametrize("make", [PosTwice, PosMixed, PosCalledTwice], ids=lambda m: m.__name__)
def test_a_root_parameter_used_many_times_is_exact(make):
    """A directly read parameter with several uses: each exact use is a node of its own,
    their curvature summed over them as a tied parameter's (the recorder's count of its
    live records says they share it); one with a use that may mix the samples is left whole
    to the module's generic recomputation. Against torch.func's dense GGN (float64)."""
    torch.manual_seed(0)
    _check_ggn_diagonals(make(), *_data())
