"""Property-based: hypothesis draws layers, shapes and strategies; every first-order
quantity must equal the per-sample autograd loop's, in float64.

Drawn: Linear (input rank 2 or 3, bias or not); ConvNd and ConvTransposeNd for d = 1, 2,
3 (kernel, stride, padding incl. "same" and "valid" where torch allows them, dilation,
groups, padding_mode, output_padding); batch size 1-4; the loss reduction; the flow
(forward inside the block, or tracked); and a strategy name among every registered one
and "auto" (a name a layer does not offer falls back to auto for it, so every name is
valid for every layer). A chunk budget is drawn too, so that chunking over the batch
is exercised.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.support.reference import FLOWS, check_against, mse, per_sample_grads, run_jacmem
from torch import nn

import jacmem
from jacmem.derivatives import REGISTRY, all_strategy_names

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
STRATEGIES = sorted(all_strategy_names() | {"auto"})
FIELDS = ("grad_batch", "batch_l2", "sum_grad_squared", "variance")
CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
CONV_T = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}


def extensions():
    return [jacmem.BatchGrad(), jacmem.BatchL2Grad(), jacmem.SumGradSquared(), jacmem.Variance()]


common = st.fixed_dictionaries(
    {
        "n": st.integers(1, 4),
        "reduction": st.sampled_from(["mean", "sum"]),
        "flow": st.sampled_from(FLOWS),
        "strategy": st.sampled_from(STRATEGIES),
        "chunk_bytes": st.sampled_from([64 * 2**20, 256]),  # 256 B: one sample at a time
    }
)


def check(layer: nn.Module, X: torch.Tensor, run: dict) -> None:
    layer = layer.double()
    with torch.no_grad():
        y = torch.randn_like(layer(X))
    reference = per_sample_grads(layer, X, y, mse, run["reduction"])
    run_jacmem(
        layer, X, y, mse, run["reduction"], extensions(), run["flow"], strategy=run["strategy"],
        chunk_bytes=run["chunk_bytes"],
    )  # fmt: skip
    check_against(layer, reference, FIELDS, f"{layer} {tuple(X.shape)} {run}")


@st.composite
def linears(draw):
    i, o = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    middle = draw(st.lists(st.integers(1, 3), max_size=1))
    layer = nn.Linear(i, o, bias=draw(st.booleans()))
    return layer, middle, i


@SETTINGS
@given(drawn=linears(), run=common)
def test_linear(drawn, run):
    layer, middle, i = drawn
    check(layer, torch.randn(run["n"], *middle, i, dtype=torch.float64), run)


@st.composite
def convs(draw, transpose: bool):
    d = draw(st.integers(1, 3))
    groups = draw(st.sampled_from([1, 2]))
    c_in, c_out = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 2))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(d))
    stride = tuple(draw(st.integers(1, 2)) for _ in range(d))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(d))
    # enough input that every padding, including reflect's, is legal
    size = tuple(draw(st.integers(dl * (k - 1) + 1, dl * (k - 1) + 3)) + 2 for k, dl in zip(kernel, dilation))
    kw = dict(kernel_size=kernel, stride=stride, dilation=dilation, groups=groups, bias=draw(st.booleans()))
    if transpose:
        padding = tuple(draw(st.integers(0, dl * (k - 1))) for k, dl in zip(kernel, dilation))
        output_padding = tuple(draw(st.integers(0, max(s, dl) - 1)) for s, dl in zip(stride, dilation))
        layer = CONV_T[d](c_in, c_out, padding=padding, output_padding=output_padding, **kw)
    else:
        options = [st.tuples(*[st.integers(0, 2) for _ in range(d)]), st.just("valid")]
        if all(s == 1 for s in stride):
            options.append(st.just("same"))
        padding = draw(st.one_of(*options))
        mode = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
        if padding == "valid" or padding == (0,) * d:
            mode = "zeros"
        layer = CONV[d](c_in, c_out, padding=padding, padding_mode=mode, **kw)
    return layer, (c_in, *size)


@SETTINGS
@given(drawn=convs(transpose=False), run=common)
def test_conv(drawn, run):
    layer, shape = drawn
    check(layer, torch.randn(run["n"], *shape, dtype=torch.float64), run)


@pytest.mark.skipif(
    not all(cls in REGISTRY for cls in CONV_T.values()), reason="jacmem.derivatives has no ConvTranspose registered"
)
@SETTINGS
@given(drawn=convs(transpose=True), run=common)
def test_conv_transpose(drawn, run):
    layer, shape = drawn
    check(layer, torch.randn(run["n"], *shape, dtype=torch.float64), run)
