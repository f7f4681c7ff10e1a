"""Lean max pooling keeps each output's argmax as its offset in the window (uint8 up to
256 window elements): outputs, indices and input gradients bit-identical to stock's, in
float64, for every hyper-parameter, ties and NaN included."""

import copy
import itertools

import pytest
import torch
from torch import nn

from jacmem.memory import lean, report
from jacmem.memory.functions import window_indices, window_offsets

pytestmark = pytest.mark.usefixtures("float64_default")

POOLS = {1: nn.MaxPool1d, 2: nn.MaxPool2d, 3: nn.MaxPool3d}
SHAPES = {1: (2, 3, 11), 2: (2, 2, 7, 6), 3: (1, 2, 5, 6, 4)}


def _configs(d):
    for k, s, p, dil, ceil in itertools.product((1, 2, 3), (None, 1, 2), (0, 1), (1, 2), (False, True)):
        if p <= k // 2:
            yield k, s, p, dil, ceil
    if d >= 2:  # per-axis values
        yield (
            (2, 3)[:d] + (1,) * (d - 2),
            (1, 2)[:d] + (2,) * (d - 2),
            (1, 0)[:d] + (0,) * (d - 2),
            (2, 1)[:d] + (1,) * (d - 2),
            True,
        )


def _inputs(shape):
    x = torch.randn(shape)
    yield x
    yield torch.round(x)  # many ties
    yield torch.zeros(shape)  # every window a tie
    nan = x.clone()
    nan.view(-1)[::5] = float("nan")
    yield nan
    yield torch.full(shape, -float("inf"))


def _bitwise(a, b):
    return a.shape == b.shape and a.stride() == b.stride() and torch.equal(a.view(torch.int64), b.view(torch.int64))


def _check(stock, x):
    leaned = lean(copy.deepcopy(stock))
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    try:
        out_s = stock(a)
    except RuntimeError:  # an invalid configuration (an empty output): stock refuses, lean too
        with pytest.raises(RuntimeError):
            leaned(b)
        return
    out_l = leaned(b)
    if isinstance(out_s, tuple):
        assert torch.equal(out_l[1], out_s[1])
        out_s, out_l = out_s[0], out_l[0]
    assert _bitwise(out_l.detach(), out_s.detach())
    g = torch.randn(out_s.shape)
    out_s.backward(g)
    out_l.backward(g)
    assert _bitwise(b.grad, a.grad)


@pytest.mark.parametrize("d", [1, 2, 3])
def test_maxpool_every_hyperparameter_bitwise(d):
    for k, s, p, dil, ceil in _configs(d):
        stock = POOLS[d](k, s, p, dil, return_indices=(k == 2), ceil_mode=ceil)
        for x in _inputs(SHAPES[d]):
            _check(stock, x)
        _check(stock, torch.randn(SHAPES[d][1:]))  # unbatched


def test_maxpool_channels_last_gradient_layout():
    stock = nn.MaxPool2d(3, 2, 1)
    x = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    _check(stock, x)


@pytest.mark.parametrize("kernel,dtype", [(16, torch.uint8), (17, torch.int16)])
def test_offset_dtype_and_roundtrip(kernel, dtype):
    """Offsets in one byte up to 256 window elements (16x16), two beyond; the round trip
    gives stock's indices."""
    x = torch.randn(2, 1, 40, 40)
    args = ((kernel, kernel), (3, 3), (kernel // 2, kernel // 2), (1, 2))
    out, idx = nn.functional.max_pool2d(x, *args, return_indices=True)
    off = window_offsets(idx, x.shape[-2:], *args)
    assert off.dtype == dtype and int(off.min()) >= 0 and int(off.max()) < kernel * kernel
    assert torch.equal(window_indices(off, x.shape[-2:], *args), idx)


def test_maxpool_keeps_one_byte_per_output():
    x = torch.randn(4, 6, 8, 8, requires_grad=True)
    pool = lean(nn.MaxPool2d(2))
    n_out = x.numel() // 4
    assert report(lambda t: pool(t * 1), x).saved_bytes == n_out  # uint8 offsets, no input
    assert report(lambda t: nn.MaxPool2d(2)(t * 1), x).saved_bytes == x.numel() * 8 + n_out * 8
