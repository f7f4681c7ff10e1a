"""Whether a weight is tied (several live calls contribute to it) is the state of the
recorder that made the calls, not of the process: the records of another recorder (a
tracked model's, another block's) never make a weight used once look tied."""

import torch
from torch import nn

import jacmem
from jacmem.engine import hooks
from jacmem.engine.recorder import Recorder

torch.set_num_threads(1)
V, D, N = 7, 5, 4


def _tied_pair():
    torch.manual_seed(0)
    emb = nn.Embedding(V, D).double()
    head = nn.Linear(D, V, bias=False).double()
    head.weight = emb.weight  # [V, D] either way
    return emb, head


def _sum_grad_squared(head: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The reference: a per-sample autograd loop over ``(head(x_n) ** 2).sum()``."""
    grads = [torch.autograd.grad(head(x[n : n + 1]).square().sum(), head.weight)[0] for n in range(len(x))]
    return torch.stack(grads).square().sum(0)


def test_a_tracked_models_live_call_does_not_tie_a_weight_the_block_uses_once():
    """An embedding's call, recorded by ``jacmem.track`` in a graph still alive, and its
    weight read once by a Linear inside a block: the block's backward has one call of the
    weight. A process-wide count saw two, staged the Linear's call as one of a tied
    weight's with the embedding's rows to come, and its end-of-pass sum found no factors
    (StopIteration)."""
    emb, head = _tied_pair()
    ids, x = torch.randint(0, V, (N, 3)), torch.randn(N, D, dtype=torch.float64)
    jacmem.track(emb)
    try:
        other = emb(ids)  # noqa: F841 (its graph, and so its record, stays alive)
        with jacmem.extend(jacmem.SumGradSquared()):
            head(x).square().sum().backward()
    finally:
        jacmem.untrack(emb)
    torch.testing.assert_close(head.weight.sum_grad_squared, _sum_grad_squared(head, x), rtol=1e-12, atol=1e-12)


def test_each_recorder_counts_its_own_calls():
    """Two recorders each record one call of the same Linear: neither calls its weight
    tied; a second call in one recorder does, for that recorder's records only."""
    lin = nn.Linear(3, 2)
    first, second = Recorder(lambda rec: None), Recorder(lambda rec: None)
    x = torch.randn(4, 3)
    outs = [lin(x) for _ in range(3)]  # (kept: a record lives with its graph)
    a = _record(first, lin, x, outs[0])
    b = _record(second, lin, x, outs[1])
    assert not a.shared(lin.weight) and not b.shared(lin.weight)
    assert a.others(lin.weight) == [] and b.others(lin.weight) == []
    c = _record(first, lin, x, outs[2])
    assert a.shared(lin.weight) and c.shared(lin.weight) and not b.shared(lin.weight)
    assert a.others(lin.weight) == [c] and b.others(lin.weight) == []
    first.close()
    assert not b.shared(lin.weight) and not a.shared(lin.weight), "closing a recorder releases its records"
    second.close()


def _record(recorder: Recorder, module: nn.Module, x: torch.Tensor, out: torch.Tensor) -> hooks.Record:
    """The record ``recorder`` makes of the call ``module(x) -> out``."""
    before = set(recorder.records)
    recorder.record(module, (x,), {}, out, "lin")
    (rec,) = set(recorder.records) - before
    return rec
