"""The forward inside a block, the backward after it: no extension can take part (what
the block kept went with it), so the backward warns, naming the fix, instead of
silently giving nothing. It does not warn where the backward ran inside the block,
where there is no backward, or for the tracked flow; and it leaves nothing behind but a
hook that lives and dies with the graph.
"""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from tests.support.reference import recorded
from torch import nn

import jacmem
import jacmem.context

pytestmark = pytest.mark.usefixtures("float64_default")

MATCH = r"after the block had closed.*Call loss\.backward\(\) inside the block, or call jacmem\.track\(model\)"
N = 6


def mlp() -> nn.Module:
    """[N, 3] -> [N, 2]"""
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def data():
    return torch.randn(N, 3), torch.randn(N, 2)


def plain_grads(model, X, y):
    return torch.autograd.grad(nn.MSELoss()(model(X), y), list(model.parameters()))


EXTENSIONS = {
    "BatchGrad": (jacmem.BatchGrad, "grad_batch"),
    "ClipGrad": (lambda: jacmem.ClipGrad(1e-3), None),  # a bound every sample's gradient exceeds
    "DiagGGNExact": (jacmem.DiagGGNExact, "diag_ggn_exact"),
}


@pytest.mark.parametrize("name", EXTENSIONS)
def test_a_backward_after_the_block_warns_naming_the_fix(name):
    make, field = EXTENSIONS[name]
    model, (X, y) = mlp(), data()
    expected = plain_grads(model, X, y)
    with jacmem.extend(make()):
        loss = nn.MSELoss()(model(X), y)
    with pytest.warns(UserWarning, match=MATCH):
        loss.backward()
    for p, g in zip(model.parameters(), expected):
        assert field is None or not hasattr(p, field)
        torch.testing.assert_close(p.grad, g)  # autograd's plain (unclipped) gradient, as the warning says


def test_a_hugging_face_model_output_warns_and_gives_autograds_gradient():
    """Tiny GPT-2 with random weights: its output is a ModelOutput, its loss beside the
    logits and the cache; its output head's weight is tied to the token embedding."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=8, n_head=2, vocab_size=23, n_positions=8, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 23, (2, 5))
    params = [p for p in model.parameters() if p.requires_grad]
    expected = torch.autograd.grad(model(ids, labels=ids).loss, params)
    with jacmem.extend(jacmem.BatchGrad()):
        out = model(ids, labels=ids)
    with pytest.warns(UserWarning, match=MATCH):
        out.loss.backward()
    for p, g in zip(params, expected):
        assert not hasattr(p, "grad_batch")
        torch.testing.assert_close(p.grad, g)


def inside(model, X, y):
    with jacmem.extend(jacmem.BatchGrad()):
        nn.MSELoss()(model(X), y).backward()


def retained_then_after(model, X, y):
    with jacmem.extend(jacmem.BatchGrad()):
        loss = nn.MSELoss()(model(X), y)
        loss.backward(retain_graph=True)
    loss.backward()


def no_backward(model, X, y):
    with jacmem.extend(jacmem.BatchGrad()):
        nn.MSELoss()(model(X), y)
    gc.collect()


def tracked(model, X, y):
    jacmem.track(model)
    try:
        loss = nn.MSELoss()(model(X), y)
        with jacmem.extend(jacmem.BatchGrad()):
            loss.backward()
    finally:
        jacmem.untrack(model)


def plain_after_a_block(model, X, y):
    inside(model, X, y)
    nn.MSELoss()(model(X), y).backward()


@pytest.mark.parametrize("flow", [inside, retained_then_after, no_backward, tracked, plain_after_a_block])
def test_no_warning_where_the_backward_ran_in_the_block_or_not_at_all(flow):
    model, (X, y) = mlp(), data()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flow(model, X, y)


def test_it_warns_once_for_the_block():
    model, (X, y) = mlp(), data()
    with jacmem.extend(jacmem.BatchGrad()):
        first = nn.MSELoss()(model(X), y)
        second = nn.MSELoss()(model(2 * X), y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first.backward(retain_graph=True)
        first.backward()
        second.backward()
    assert len([w for w in caught if "after the block had closed" in str(w.message)]) == 1


def test_nothing_is_left_behind_but_a_hook_that_goes_with_the_graph():
    """After the block: no block active, no record alive that keeps an input, no hook on
    the output tensors, and nothing in the graph that holds the block; the hook's state
    goes when the graph does. (Layer norms only: a Linear's graph runs through
    ComputeOnce, whose backward holds its engine.)"""
    model, X = nn.Sequential(nn.LayerNorm(3), nn.Tanh(), nn.LayerNorm(3)), torch.randn(N, 3)
    with recorded() as records, jacmem.extend(jacmem.BatchGrad()) as block:
        out = model(X)
        loss = out.square().sum()
    assert records
    block_ref, late = weakref.ref(block), weakref.ref(block.block._late)
    del block
    gc.collect()
    assert jacmem.context._ACTIVE is None and block_ref() is None
    assert all(r() is None or not r().release.alive for r in records), "a record still counts as live"
    assert not out._backward_hooks and not loss._backward_hooks
    assert all(r() is None or r().x is None for r in records)
    assert late() is not None, "the hook's state lives with the graph"
    del out, loss
    gc.collect()
    assert late() is None


def test_the_warning_points_at_the_users_backward():
    """The warning is attributed to the user's ``loss.backward()`` line, not to torch's
    or jacmem's machinery."""
    model = nn.Linear(3, 2)
    with jacmem.extend(jacmem.BatchGrad()):
        loss = model(torch.randn(4, 3)).sum()
    with pytest.warns(UserWarning, match="after the block had closed") as caught:
        loss.backward()
    assert caught[0].filename == __file__
