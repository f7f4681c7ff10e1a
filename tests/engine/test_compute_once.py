"""Layers that run through :class:`jacmem.engine.hooks.ComputeOnce` inside a block.

Their backward computes ``.grad`` and the input gradient itself, from the per-sample
pass, instead of autograd's own. The quantities are checked for every layer and
strategy elsewhere (``tests/derivatives/test_linear_conv.py`` compares ``.grad`` too); here,
every way a backward can reach such a call: after the block, twice, with
``create_graph``, for some inputs only, and the cases that must keep autograd's path.
Float64, against plain autograd on the same model.
"""

import pytest
import torch
from torch import nn

import jacmem
from jacmem.engine.hooks import ComputeOnce


def net():
    """[N, 2, 6, 6] -> [N, 3]: a padded conv (circular, so the input gradient crosses
    the padding), ReLU, Linear."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1, padding_mode="circular"), nn.ReLU(), nn.Flatten(), nn.Linear(144, 3)
    ).double()


def data():
    return torch.randn(5, 2, 6, 6, dtype=torch.float64, requires_grad=True)


def loss(out):
    return out.square().sum()


def autograd_grads(model, X, create_graph=False):
    return torch.autograd.grad(loss(model(X)), [X, *model.parameters()], create_graph=create_graph)


def assert_all_close(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def fused(out) -> bool:
    return type(out.grad_fn).__name__ == ComputeOnce.__name__ + "Backward"


def test_the_layers_run_through_it_and_give_autograds_gradients():
    model, X = net(), data()
    want = autograd_grads(model, X)
    with jacmem.extend(jacmem.BatchGrad()):
        h = model[0](X)
        assert fused(h)
        out = model[1:](h)
        got = torch.autograd.grad(loss(out), [X, *model.parameters()])
    assert_all_close(got, want)
    for p, g in zip(model.parameters(), want[1:]):
        torch.testing.assert_close(p.grad_batch.sum(0), g)


def test_backward_after_the_block_is_autograds():
    model, X = net(), data()
    want = autograd_grads(model, X)
    with jacmem.extend(jacmem.BatchGrad()):
        out = model(X)
    with pytest.warns(UserWarning, match="after the block had closed"):
        got = torch.autograd.grad(loss(out), [X, *model.parameters()])
    assert_all_close(got, want)
    assert not any(hasattr(p, "grad_batch") for p in model.parameters())


def tied():
    """ids [N, T] -> [N, T, 7]: an embedding, tanh, and an output head that shares its weight."""
    torch.manual_seed(0)
    emb, head = nn.Embedding(7, 4), nn.Linear(4, 7, bias=False)
    head.weight = emb.weight
    return nn.Sequential(emb, nn.Tanh(), head).double()


@pytest.mark.parametrize("when", ["after the block", "create_graph"])
@pytest.mark.filterwarnings("ignore:jacmem. a backward pass went through")
def test_a_tied_weight_gets_autograds_gradient_where_autograds_path_runs(when):
    """The head's recomputed backward gives its own part only: the embedding's part comes
    from the rest of the backward, as in autograd (and, under ``create_graph``, so do the
    second derivatives, taken after the block: inside it, a backward through the first
    one's gradients is refused, see tests/engine/test_create_graph.py)."""
    model, ids = tied(), torch.randint(0, 7, (3, 5))
    w = model[2].weight
    (want,) = torch.autograd.grad(loss(model(ids)), w, create_graph=True)
    with jacmem.extend(jacmem.BatchGrad()):
        out = model(ids)
        assert fused(out)
        if when == "create_graph":
            (got,) = torch.autograd.grad(loss(out), w, create_graph=True)
    if when == "create_graph":
        torch.testing.assert_close(
            torch.autograd.grad(got.square().sum(), w), torch.autograd.grad(want.square().sum(), w)
        )
    if when == "after the block":
        (got,) = torch.autograd.grad(loss(out), w)
    torch.testing.assert_close(got, want)


def test_two_backward_passes_through_one_graph():
    model, X = net(), data()
    want = autograd_grads(model, X)
    with jacmem.extend(jacmem.BatchGrad()):
        out = model(X)
        loss(out).backward(retain_graph=True)
        first = [p.grad_batch for p in model.parameters()]
        loss(out).backward()
    for p, g, b in zip(model.parameters(), want[1:], first):
        torch.testing.assert_close(p.grad, 2 * g)  # .grad accumulates, as autograd's does
        torch.testing.assert_close(p.grad_batch, b)  # each pass writes its own
    torch.testing.assert_close(X.grad, 2 * want[0])


def test_create_graph_gives_a_differentiable_gradient():
    model, X = net(), data()
    gx = autograd_grads(model, X, create_graph=True)[0]
    want = torch.autograd.grad(gx.square().sum(), list(model.parameters()))
    with jacmem.extend(jacmem.BatchGrad()):
        out = model(X)
        gx_got = torch.autograd.grad(loss(out), X, create_graph=True)[0]
    got = torch.autograd.grad(gx_got.square().sum(), list(model.parameters()))
    assert_all_close(got, want)


def test_gradients_for_some_inputs_only():
    model, X = net(), data()
    want = autograd_grads(model, X)
    with jacmem.extend(jacmem.BatchGrad()):
        (gx,) = torch.autograd.grad(loss(model(X)), [X])
    torch.testing.assert_close(gx, want[0])
    assert all(p.grad is None and not hasattr(p, "grad_batch") for p in model.parameters())


def test_a_weight_changed_in_place_before_the_backward_raises_as_autograd_does():
    model, X = net(), data()
    with jacmem.extend(jacmem.BatchGrad()):
        out = model(X)
        with torch.no_grad():
            model[0].weight.add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss(out).backward()


@pytest.mark.parametrize("case", ["second-order", "bias only", "autocast"])
def test_autograds_path_is_kept_where_compute_once_cannot_apply(case):
    """Second-order extensions hook the layer's own output; a frozen weight leaves
    autograd nothing to compute twice; under autocast, casts sit between the
    parameters and the layer."""
    model, X = net(), data()
    exts = [jacmem.DiagGGNExact()] if case == "second-order" else [jacmem.BatchGrad()]
    if case == "bias only":
        model[0].weight.requires_grad_(False)
    if case == "autocast":
        model, X = model.float(), X.detach().float()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast"), jacmem.extend(*exts):
        h = model[0](X)
    assert not fused(h)


def test_an_input_passed_by_keyword():
    """``linear(input=x)``: the hooks' path (what a record keeps is found by keyword)."""
    torch.manual_seed(0)
    model, X = nn.Linear(3, 2).double(), torch.randn(4, 3, dtype=torch.float64)
    with jacmem.extend(jacmem.BatchGrad()):
        loss(model(input=X)).backward()
    want = torch.stack([torch.autograd.grad(loss(model(X[i : i + 1])), model.weight)[0] for i in range(4)])
    torch.testing.assert_close(model.weight.grad_batch, want)


@pytest.mark.parametrize(
    "conv",
    [
        lambda: nn.Conv2d(2, 4, 3, stride=2, padding=1),  # an odd input: the stride skips a row
        lambda: nn.Conv2d(2, 4, (3, 2), stride=(2, 1), padding=(2, 1), dilation=(2, 1), groups=2),
        lambda: nn.Conv2d(2, 4, 4, padding="same"),  # even kernel: one more pixel right
        lambda: nn.Conv1d(2, 3, 3, stride=3, padding=2),
        lambda: nn.Conv3d(2, 2, 2, stride=2, padding=1),
    ],
    ids=["2d-stride2-pad1", "2d-dil-groups-asym", "2d-same-evenk", "1d-stride3-pad2", "3d-stride2-pad1"],
)
def test_input_gradient_through_zero_padding(conv):
    """The input gradient of a zero-padded conv comes from one transposed convolution of
    the input's size (symmetric padding) or from a crop of the padded one."""
    torch.manual_seed(0)
    layer = conv().double()
    X = torch.randn(3, 2, *[7] * (layer.weight.dim() - 2), dtype=torch.float64, requires_grad=True)
    want = torch.autograd.grad(layer(X).square().sum(), X)[0]
    with jacmem.extend(jacmem.BatchGrad()):
        out = layer(X)
        assert fused(out)
        got = torch.autograd.grad(out.square().sum(), X)[0]
    torch.testing.assert_close(got, want)
    if layer.padding != "same":  # symmetric: no crop, so downstream ops read it at full speed
        assert got.is_contiguous()
