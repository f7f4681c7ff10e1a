"""jacmem.memory.lean / unlean and BatchNormAct against the stock layers (float64).

The reference for every lean layer is the stock PyTorch layer with the same
parameters, differentiated by autograd: outputs and gradients must agree for every
pattern of what requires a gradient. What a layer keeps is read with
``saved_tensors_hooks`` (through jacmem.memory.report).
"""

import copy
import itertools

import pytest
import torch
from tests.support.reference import cross_entropy, per_sample_grads
from torch import nn

import jacmem
from jacmem.memory import BatchNormAct, lean, report, unlean
from jacmem.memory.functions import pack_bits, unpack_bits

#: every test here in float64 (conftest.py restores the default after each)
pytestmark = pytest.mark.usefixtures("float64_default")

RTOL, ATOL = 1e-10, 1e-12


def _patterns(layer):
    """Every non-empty subset of {input, each parameter} that requires a gradient."""
    names = ["input"] + [n for n, _ in layer.named_parameters()]
    for r in range(1, len(names) + 1):
        yield from itertools.combinations(names, r)


def _run(layer, x, pattern, seed=0):
    """Output and gradients (by name) of ``sum(out * w)`` for random w."""
    for name, p in layer.named_parameters():
        p.requires_grad_(name in pattern)
        p.grad = None
    x = x.clone().requires_grad_("input" in pattern)
    out = layer(x)
    out = out[0] if isinstance(out, tuple) else out
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device)
    (out * w).sum().backward()
    grads = {"input": x.grad} if "input" in pattern else {}
    grads.update({n: p.grad for n, p in layer.named_parameters() if n in pattern})
    return out.detach(), grads


def _compare(stock, x):
    """The lean copy of ``stock`` against ``stock`` for every requires_grad pattern."""
    lean_layer = lean(copy.deepcopy(stock))
    assert type(lean_layer) is not type(stock), f"{type(stock).__name__} was not converted"
    for pattern in _patterns(stock):
        out_s, grads_s = _run(stock, x, pattern)
        out_l, grads_l = _run(lean_layer, x, pattern)
        torch.testing.assert_close(out_l, out_s, rtol=0, atol=0)
        assert grads_l.keys() == grads_s.keys()
        for name in grads_s:
            torch.testing.assert_close(grads_l[name], grads_s[name], rtol=RTOL, atol=ATOL, msg=f"{pattern}: {name}")


CONVS = [
    (nn.Conv1d(3, 4, 3, stride=2, padding=1), (2, 3, 11)),
    (nn.Conv1d(4, 6, 3, padding="same", dilation=2, groups=2, bias=False), (2, 4, 9)),
    (nn.Conv2d(3, 4, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2)), (2, 3, 9, 8)),
    (nn.Conv2d(4, 4, 4, padding="same"), (2, 4, 7, 6)),  # odd total padding: the odd pixel goes right
    (nn.Conv2d(4, 6, 3, padding="valid", groups=2), (2, 4, 6, 6)),
    (nn.Conv2d(3, 4, 3, padding=2, padding_mode="reflect"), (2, 3, 7, 7)),
    (nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular"), (3, 7, 7)),  # unbatched
    (nn.Conv3d(2, 3, 2, stride=(1, 2, 1), padding=1), (2, 2, 4, 5, 4)),
    (nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1, output_padding=1), (2, 3, 6)),
    (nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2, dilation=2, bias=False), (2, 4, 5, 4)),
    (nn.ConvTranspose2d(3, 2, 3, stride=1, padding=1), (3, 5, 5)),  # unbatched
    (nn.ConvTranspose3d(2, 3, 2, stride=2), (2, 2, 3, 2, 3)),
]


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize("stock,shape", CONVS, ids=lambda v: str(v).split("(")[0] if isinstance(v, nn.Module) else None)
def test_conv_matches_stock(stock, shape):
    _compare(copy.deepcopy(stock).double(), torch.randn(shape))  # built at import, in float32


def test_conv_transpose_output_size():
    stock = nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1)
    lean_layer = lean(copy.deepcopy(stock))
    x = torch.randn(2, 3, 4, 4)
    torch.testing.assert_close(lean_layer(x, output_size=[8, 8]), stock(x, output_size=[8, 8]), rtol=0, atol=0)


def _batchnorm(cls, c, affine=True):
    bn = cls(c, affine=affine)
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        if affine:
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-1, 1)
    return bn.eval()


@pytest.mark.parametrize(
    "cls,shape,affine",
    [
        (nn.BatchNorm1d, (5, 3), True),
        (nn.BatchNorm1d, (4, 3, 6), False),
        (nn.BatchNorm2d, (3, 4, 5, 5), True),
        (nn.BatchNorm3d, (2, 2, 3, 4, 3), True),
    ],
)
def test_batchnorm_eval_matches_stock(cls, shape, affine):
    _compare(_batchnorm(cls, shape[1], affine), torch.randn(shape))


def test_batchnorm_train_mode_runs_stock():
    stock = _batchnorm(nn.BatchNorm2d, 3).train()
    lean_layer = lean(copy.deepcopy(stock))
    x = torch.randn(4, 3, 5, 5)
    torch.testing.assert_close(lean_layer(x), stock(x), rtol=0, atol=0)
    torch.testing.assert_close(lean_layer.running_mean, stock.running_mean, rtol=0, atol=0)
    _compare(stock, x)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("shape", [(4, 3, 5, 5), (13,)])  # 13: not a multiple of 8
def test_relu_matches_stock(shape, inplace):
    x = torch.randn(shape)
    x.view(-1)[::4] = 0.0  # relu's gradient at 0 is 0 in both
    stock, lean_layer = nn.ReLU(inplace), lean(nn.ReLU(inplace))
    for layer in (stock, lean_layer):  # in place: on an activation, not on a leaf
        assert not list(layer.parameters())
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out1, out2 = stock(x1 * 1), lean_layer(x2 * 1)
    torch.testing.assert_close(out2, out1, rtol=0, atol=0)
    g = torch.randn(shape)
    (out1 * g).sum().backward()
    (out2 * g).sum().backward()
    torch.testing.assert_close(x2.grad, x1.grad, rtol=0, atol=0)


def _relu_step(x, g, inplace, pick=lambda t: t):
    """ReLUFunction's output, saved bits and input gradient, on ``pick(x * 1)``."""
    from jacmem.memory.functions import ReLUFunction

    leaf = x.clone().requires_grad_()
    out = ReLUFunction.apply(pick(leaf * 1), inplace)
    # in place on a view, out's node is autograd's CopySlices, not the function's
    bits = out.grad_fn.saved_tensors[0] if hasattr(out.grad_fn, "saved_tensors") else None
    (grad,) = torch.autograd.grad(out, leaf, g)
    return out.detach(), bits, grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("n", [5, 8, 1001])
def test_relu_kernels_equal_the_stock_ops(n, inplace, dtype, monkeypatch):
    """The compiled loops (jacmem.memory.kernels) and the stock-op path give the same
    output, bits and gradient, bit for bit, at -0, NaN, and infinite gradients; a
    non-contiguous input takes the stock ops."""
    from jacmem.memory import kernels

    if kernels._library() is None:
        pytest.skip(
            "no compiled loops here (no C compiler, or JACMEM_NO_KERNELS=1): the stock-op path runs, and every other ReLU test covers it"
        )
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen, dtype=dtype)
    x[::3], x[1::7], x[2::11] = -0.0, float("nan"), 0.0
    g = torch.randn(n, generator=gen, dtype=dtype)
    g[::5] = float("inf")
    fused = _relu_step(x, g, inplace)
    monkeypatch.setattr(kernels, "available", lambda t: False)
    stock_ops = _relu_step(x, g, inplace)
    for a, b in zip(fused, stock_ops):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # bitwise: -0, NaN and all
    assert torch.equal(fused[0].view(torch.uint8), torch.relu(x).view(torch.uint8))

    calls = []
    monkeypatch.setattr(kernels, "available", lambda t: calls.append(t.is_contiguous()) or t.is_contiguous())
    wide = torch.stack([x, x], 1)
    strided = _relu_step(wide, g, inplace, pick=lambda t: t[:, 0])  # every other element: not contiguous
    assert torch.equal(strided[0].contiguous().view(torch.uint8), stock_ops[0].view(torch.uint8))
    assert torch.equal(strided[2][:, 0].contiguous().view(torch.uint8), stock_ops[2].view(torch.uint8))
    assert calls[0] is False  # the forward took the stock ops; the backward reads their bits with the loop


@pytest.mark.parametrize("n", [1, 7, 8, 9, 64, 1001])
def test_pack_bits_roundtrip(n):
    mask = torch.rand(n, generator=torch.Generator().manual_seed(n)) > 0.5
    packed = pack_bits(mask)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-n // 8)
    assert torch.equal(unpack_bits(packed, n), mask)
    # element 8j + k sits in bit k of byte j
    expected = [sum(int(mask[8 * j + k]) << k for k in range(8) if 8 * j + k < n) for j in range(packed.numel())]
    assert packed.tolist() == expected


def _relu_paths(model, x):
    """Run ``model(x)`` twice (a lean ReLU learns its readers in the first pass); the
    grad_fn names of the ReLU outputs in the second pass, by module name."""
    model(x)
    paths, handles = {}, []

    def note(name, output):
        paths[name] = type(output.grad_fn).__name__

    for name, m in model.named_modules():
        if isinstance(m, nn.ReLU):
            handles.append(m.register_forward_hook(lambda m, i, o, n=name: note(n, o)))
    model(x)
    for h in handles:
        h.remove()
    return paths


STOCK_RELU, MASK = "ReluBackward0", "ReLUFunctionBackward"


def _bn(train):
    return _batchnorm(nn.BatchNorm2d, 4).train(train)


# (reader of the ReLU's output, its parameters trainable?, what the lean ReLU keeps): the
# output itself where the reader keeps that very tensor, else the mask
READERS = [
    ("conv", lambda: nn.Conv2d(4, 4, 3, padding=1), True, STOCK_RELU),
    ("conv frozen", lambda: nn.Conv2d(4, 4, 3, padding=1), False, MASK),
    ("conv bias only", lambda: nn.Conv2d(4, 4, 3, padding=1), "bias", MASK),
    (
        "conv reflect",
        lambda: nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"),
        False,
        STOCK_RELU,
    ),  # F.pad keeps it
    ("conv circular", lambda: nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular"), True, MASK),  # a padded copy
    ("conv same", lambda: nn.Conv2d(4, 4, 3, padding="same"), True, STOCK_RELU),
    ("conv same odd", lambda: nn.Conv2d(4, 4, 4, padding="same"), True, MASK),  # keeps a padded copy
    ("convT", lambda: nn.ConvTranspose2d(4, 4, 3), True, STOCK_RELU),
    ("convT frozen", lambda: nn.ConvTranspose2d(4, 4, 3), False, MASK),
    ("bn eval", lambda: _bn(False), True, STOCK_RELU),
    ("bn eval frozen", lambda: _bn(False), False, MASK),
    ("bn train frozen", lambda: _bn(True), False, STOCK_RELU),  # batch statistics: keeps its input anyway
    ("maxpool", lambda: nn.MaxPool2d(2), None, MASK),
    ("dropout", lambda: nn.Dropout(0.5), None, MASK),
    ("linear", lambda: nn.Linear(6, 3), True, STOCK_RELU),
    ("linear frozen", lambda: nn.Linear(6, 3), False, MASK),
    ("softplus (not lean)", lambda: nn.Softplus(), None, MASK),  # keeps its input unseen: the mask is extra
]


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize("reader,trainable,kept", [r[1:] for r in READERS], ids=[r[0] for r in READERS])
def test_relu_keeps_output_only_where_its_reader_keeps_it(reader, trainable, kept):
    """Conv -> ReLU -> reader, lean against stock: the ReLU keeps its output (as stock)
    where the reader keeps it anyway, else the 1-bit mask; outputs and gradients are
    the stock ones either way, in the first pass (readers unknown yet) and later."""
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 4, 1), nn.ReLU(), reader())
    for name, p in stock[2].named_parameters():
        p.requires_grad_(trainable is True or name == trainable)
    leaned = lean(copy.deepcopy(stock))
    x = torch.randn(2, 3, 6, 6)
    assert _relu_paths(leaned, x) == {"1": kept}
    if isinstance(stock[2], nn.Softplus):  # keeps the output, unseen: the mask is extra
        assert _saved(leaned, x) == _saved(stock, x) + 2 * 4 * 6 * 6 // 8
    else:
        assert _saved(leaned, x) < _saved(stock, x) if kept == MASK else _saved(leaned, x) <= _saved(stock, x)
    names = ["input", "0.weight"] + [f"2.{n}" for n, p in stock[2].named_parameters() if p.requires_grad]
    for _ in range(2):
        torch.manual_seed(1)  # dropout: lean draws its own mask; compared through x = 0 elsewhere
        out_s, grads_s = _run(stock, x, names)
        out_l, grads_l = _run(leaned, x, names)
        if isinstance(stock[2], nn.Dropout):  # a different mask: compare where both keep
            both = (out_s != 0) & (out_l != 0)
            torch.testing.assert_close(out_l[both], out_s[both], rtol=0, atol=0)
            continue
        torch.testing.assert_close(out_l, out_s, rtol=0, atol=0)
        for n in grads_s:
            torch.testing.assert_close(grads_l[n], grads_s[n], rtol=RTOL, atol=ATOL, msg=n)


def test_relu_readers_any_keeps_and_changed_in_place():
    """Two readers, one keeping its input: the output is kept. An output changed in place
    before its reader is no longer the ReLU's: the mask (where stock would fail in backward)."""

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.relu, self.a, self.b = nn.ReLU(), nn.Conv2d(4, 2, 1).requires_grad_(False), nn.Conv2d(4, 2, 1)

        def forward(self, x):
            h = self.relu(x * 1)
            return self.a(h) + self.b(h)

    class InPlace(Two):
        def forward(self, x):
            return self.b(self.relu(x * 1).mul_(2))

    x = torch.randn(2, 4, 3, 3, requires_grad=True)
    model = Two()
    (g_stock,) = torch.autograd.grad(model(x).sum(), x)
    assert _relu_paths(lean(model), x) == {"relu": STOCK_RELU}
    (g_lean,) = torch.autograd.grad(model(x).sum(), x)
    torch.testing.assert_close(g_lean, g_stock, rtol=RTOL, atol=ATOL)

    model = InPlace()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(model(x).sum(), x)  # stock keeps the output that mul_ changed
    assert _relu_paths(lean(model), x) == {"relu": MASK}
    (g_lean,) = torch.autograd.grad(model(x).sum(), x)
    ref = torch.where(x > 0, 2.0, 0.0) * model.b.weight.sum(0).view(1, 4, 1, 1)
    torch.testing.assert_close(g_lean, ref, rtol=RTOL, atol=ATOL)


def test_relu_without_gradient_records_nothing():
    relu = lean(nn.ReLU())
    x = torch.randn(3, 4)
    assert relu(x).grad_fn is None
    with torch.no_grad():
        assert relu(x.requires_grad_()).grad_fn is None


@pytest.mark.parametrize(
    "stock,shape",
    [
        (nn.MaxPool1d(3, stride=2, padding=1), (2, 3, 9)),
        (nn.MaxPool2d(3, stride=1), (2, 3, 6, 6)),  # overlapping windows: gradients add up
        (nn.MaxPool2d(2, dilation=2, ceil_mode=True), (3, 7, 7)),  # unbatched
        (nn.MaxPool2d(2, return_indices=True), (2, 2, 4, 4)),
        (nn.MaxPool3d(2, stride=(1, 2, 2), padding=1), (2, 2, 4, 5, 4)),
    ],
)
def test_maxpool_matches_stock(stock, shape):
    x = torch.randn(shape)
    _compare(stock, x)
    _compare(stock, torch.relu(x))  # ties at 0: same indices, same gradients
    if stock.return_indices:
        assert torch.equal(lean(copy.deepcopy(stock))(x)[1], stock(x)[1])


def _saved(fn, *inputs):
    """Activation bytes autograd keeps for ``fn(*inputs)``."""
    return report(fn, *inputs).saved_bytes


@pytest.mark.parametrize(
    "stock,shape",
    [
        (nn.Conv2d(3, 4, 3), (2, 3, 8, 8)),
        (nn.ConvTranspose2d(3, 4, 3), (2, 3, 8, 8)),
        (nn.Conv1d(3, 4, 3), (2, 3, 8)),
    ],
)
def test_conv_keeps_only_what_is_needed(stock, shape):
    """The input is an activation (x * 1): stock keeps it whether or not the weight is
    trainable; lean keeps it only for the weight's gradient."""
    stock = copy.deepcopy(stock).double()  # built at import, in float32
    x = torch.randn(shape, requires_grad=True)
    lean_layer = lean(copy.deepcopy(stock))
    x_bytes = x.numel() * x.element_size()
    stock.weight.requires_grad_(False)
    lean_layer.weight.requires_grad_(False)
    assert _saved(lambda t: stock(t * 1), x) == x_bytes
    assert _saved(lambda t: lean_layer(t * 1), x) == 0
    # only the bias trainable, and an input that needs no gradient: stock keeps it all the same
    assert _saved(lambda t: stock(t.detach() * 1), x) == x_bytes
    assert _saved(lambda t: lean_layer(t.detach() * 1), x) == 0
    lean_layer.weight.requires_grad_(True)
    assert _saved(lambda t: lean_layer(t * 1), x) == x_bytes


def test_frozen_weight_functions_refuse_a_trainable_weight():
    """ConvFunction and BatchNormEvalFunction compute no weight gradient: a trainable
    weight is an error, not a silently missing gradient."""
    from jacmem.memory.functions import BatchNormEvalFunction, ConvFunction

    x, w = torch.randn(1, 2, 4, 4), torch.randn(3, 2, 3, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="frozen weight"):
        ConvFunction.apply(x, w, None, (1, 1), (0, 0), (1, 1), False, (0, 0), 1)
    with pytest.raises(RuntimeError, match="frozen weight"):
        BatchNormEvalFunction.apply(x, torch.zeros(2), torch.ones(2), torch.ones(2, requires_grad=True), None, 1e-5)


def test_batchnorm_eval_keeps_input_only_for_weight():
    stock = _batchnorm(nn.BatchNorm2d, 3)
    lean_layer = lean(copy.deepcopy(stock))
    x = torch.randn(2, 3, 4, 4, requires_grad=True)
    x_bytes = x.numel() * 8
    for layer in (stock, lean_layer):
        layer.weight.requires_grad_(False)
    assert _saved(lambda t: stock(t * 1), x) == x_bytes
    assert _saved(lambda t: lean_layer(t * 1), x) == 0
    lean_layer.weight.requires_grad_(True)
    assert _saved(lambda t: lean_layer(t * 1), x) == x_bytes


def test_relu_dropout_maxpool_keep_bits_seed_indices():
    x = torch.randn(4, 6, 8, 8, requires_grad=True)  # 1536 elements
    n = x.numel()
    # "+ 0" keeps nothing, and makes the layer's output an intermediate (an output is kept anyway)
    assert _saved(lambda t: lean(nn.ReLU())(t) + 0, x) == n // 8
    assert _saved(lambda t: nn.ReLU()(t) + 0, x) == n * 8
    assert _saved(lambda t: lean(nn.Dropout(0.5))(t) + 0, x) == 0
    # a float mask on CPU (x * bernoulli / (1 - p)), a bool mask from CUDA's fused kernel
    assert _saved(lambda t: nn.Dropout(0.5)(t) + 0, x) == n * 8
    pool = lean(nn.MaxPool2d(2))
    assert _saved(lambda t: pool(t * 1), x) == n // 4  # the argmax offsets, one byte each, no input
    assert _saved(lambda t: nn.MaxPool2d(2)(t * 1), x) == n * 8 + (n // 4) * 8


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("p", [0.0, 1e-6, 0.3, 0.999, 1.0])
def test_dropout(p, inplace):
    """Train mode: out = x * keep / (1 - p), keep drawn with probability 1 - p, and the
    gradient uses the same keep (drawn again in backward): g * keep / (1 - p)."""
    torch.manual_seed(0)
    layer = lean(nn.Dropout(p, inplace=inplace))
    x = torch.randn(64, 50, requires_grad=True)
    out = layer(x * 1)
    keep = (out != 0).double()
    scale = 1 / (1 - p) if p < 1 else 0.0
    torch.testing.assert_close(out, x.detach() * keep * scale, rtol=0, atol=0)
    assert abs(keep.mean().item() - (1 - p)) < 0.02
    g = torch.randn(64, 50)
    (out * g).sum().backward()
    torch.testing.assert_close(x.grad, g * keep * scale, rtol=0, atol=0)


@pytest.mark.parametrize(
    "dtype,tol", [(torch.float64, 0), (torch.float32, 0), (torch.bfloat16, 1e-2)], ids=["f64", "f32", "bf16"]
)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed"])
def test_dropout_dtypes_and_layouts(dtype, tol, layout):
    """x = 1, so the output is the scaled mask and the gradient g * out; the output has
    the stock op's strides, and the mask drawn again in backward (in a buffer of the
    output's strides, whatever the gradient's) is the same."""
    x = torch.ones(4, 3, 5, 6, dtype=dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "transposed":
        x = x.transpose(1, 3)
    x.requires_grad_()
    out = lean(nn.Dropout(0.4))(x * 1)
    assert out.dtype == dtype and out.stride() == nn.functional.dropout(x * 1, 0.4).stride()
    assert 0.5 < (out != 0).double().mean().item() < 0.7
    g = torch.randn(out.shape, dtype=dtype)  # contiguous, whatever out's strides
    out.backward(g)
    torch.testing.assert_close(x.grad, g * out.detach(), rtol=tol, atol=tol)


def test_dropout_eval_and_reproducible():
    layer = lean(nn.Dropout(0.5))
    x = torch.randn(10, 10)
    assert layer.eval()(x) is x
    layer.train()
    assert lean(nn.Dropout(0.0))(x) is x  # as stock: nothing to keep
    with torch.no_grad():  # no gradient: the mask is drawn once, and nothing kept
        assert 0 < (layer(x) == 0).sum() < 100
    torch.manual_seed(3)
    a = layer(x)
    torch.manual_seed(3)
    assert torch.equal(layer(x), a)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("p", [0.0, 0.2, 0.7, 1.0])
def test_dropout_cuda(p):
    layer = lean(nn.Dropout(p))
    x = torch.ones(256, 257, device="cuda", requires_grad=True)
    out = layer(x * 1)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    torch.testing.assert_close(x.grad, g * out, rtol=0, atol=1e-15)
    if 0 < p < 1:
        assert abs((out != 0).double().mean().item() - (1 - p)) < 0.02


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_lean_network_cuda():
    torch.manual_seed(0)
    stock = nn.Sequential(_net(), BatchNormAct(5)).cuda().eval()
    leaned = lean(copy.deepcopy(stock))
    x = torch.randn(3, 3, 10, 10, device="cuda")
    for names in (["input"], [n for n, _ in stock.named_parameters()]):
        out_s, grads_s = _run(stock, x, names)
        out_l, grads_l = _run(leaned, x, names)
        torch.testing.assert_close(out_l, out_s, rtol=1e-12, atol=1e-12)
        for n in grads_s:
            torch.testing.assert_close(grads_l[n], grads_s[n], rtol=1e-9, atol=1e-11)


# -- BatchNormAct ----------------------------------------------------------------------


def _pair(c, slope, affine=True, track=True, momentum=0.1):
    bn = nn.BatchNorm2d(c, affine=affine, track_running_stats=track, momentum=momentum)
    if affine:
        with torch.no_grad():
            bn.weight.copy_(torch.tensor([0.8, -1.3, 1.1]))  # a negative weight: the inversion must hold
            bn.bias.copy_(torch.tensor([0.2, -0.4, 0.1]))
    return nn.Sequential(bn, nn.LeakyReLU(slope)), BatchNormAct.from_batchnorm(bn, slope)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("affine,track,momentum", [(True, True, 0.1), (False, True, None), (True, False, 0.1)])
def test_batchnorm_act_matches_stock(training, affine, track, momentum):
    stock, fused = _pair(3, 0.1, affine, track, momentum)
    if track:
        for bn in (stock[0], fused):
            bn.running_mean.fill_(0.3)
            bn.running_var.fill_(1.7)
    stock.train(training)
    fused.train(training)
    x = torch.randn(4, 3, 5, 5)
    names = ["input"] + ([] if not affine else ["weight", "bias"])
    for r in range(1, len(names) + 1):
        for pattern in itertools.combinations(names, r):
            in_stock = {n: n if n == "input" else f"0.{n}" for n in pattern}
            out_s, grads_s = _run(stock, x, tuple(in_stock.values()))
            out_f, grads_f = _run(fused, x, pattern)
            torch.testing.assert_close(out_f, out_s, rtol=1e-14, atol=1e-14)
            assert grads_f.keys() == set(pattern)
            for n in pattern:
                torch.testing.assert_close(grads_f[n], grads_s[in_stock[n]], rtol=1e-9, atol=1e-11, msg=f"{pattern}")
    stock_state = {k.removeprefix("0."): v for k, v in stock.state_dict().items()}
    assert stock_state.keys() == fused.state_dict().keys()
    for k, v in stock_state.items():
        torch.testing.assert_close(fused.state_dict()[k], v)  # running stats updated alike


def test_batchnorm_act_keeps_only_its_output():
    stock, fused = _pair(3, 0.01)
    x = torch.randn(4, 3, 6, 6, requires_grad=True)
    n_bytes = x.numel() * 8
    stats = 3 * 8  # [C] float64
    # stock: BN's input and batch mean and invstd, LeakyReLU's input
    assert _saved(lambda t: stock(t * 1) + 0, x) == 2 * n_bytes + 2 * stats
    assert _saved(lambda t: fused(t * 1) + 0, x) == n_bytes + stats  # its output and invstd


def test_batchnorm_act_errors():
    with pytest.raises(ValueError, match="negative_slope > 0"):
        BatchNormAct(3, negative_slope=0.0)
    layer = BatchNormAct(3)
    with torch.no_grad():
        layer.weight[1] = 0
    with pytest.raises(ValueError, match="zero weight"):
        layer(torch.randn(2, 3, 4))
    with torch.no_grad():
        layer(torch.randn(2, 3, 4))  # no gradients recorded: fine


# -- conversion ------------------------------------------------------------------------


def _net():
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 8, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Dropout(0.0),
        nn.Linear(8 * 3 * 3, 5),
    )


def test_lean_unlean_roundtrip():
    class MyConv(nn.Conv2d):
        pass

    model = nn.Sequential(_net(), MyConv(3, 3, 1))
    state = copy.deepcopy(model.state_dict())
    types = [type(m) for m in model.modules()]
    assert lean(model) is model
    assert type(model[0][0]).__name__ == "LeanConv2d" and isinstance(model[0][0], nn.Conv2d)
    assert type(model[1]) is MyConv  # subclasses keep their own forward
    assert model.state_dict().keys() == state.keys()
    assert unlean(model) is model
    assert [type(m) for m in model.modules()] == types
    lean(model, types=[nn.Conv2d])
    assert type(model[0][0]).__name__ == "LeanConv2d" and type(model[0][2]) is nn.ReLU
    with pytest.raises(ValueError, match="no version of.*Tanh"):
        lean(model, types=[nn.Tanh])
    unlean(model)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k])


def test_lean_network_matches_stock_every_setting():
    """A whole network, in memsave's settings: all trainable, input only, norm only, one layer."""
    torch.manual_seed(0)
    stock = _net().eval()
    leaned = lean(copy.deepcopy(stock))
    x = torch.randn(3, 3, 10, 10)
    settings = {
        "all": [n for n, _ in stock.named_parameters()],
        "input": ["input"],
        "norm": ["1.weight", "1.bias"],
        "surgical": ["4.weight", "4.bias"],
    }
    for names in [*settings.values()] * 2:  # in the first round, lean ReLUs do not know their readers yet
        out_s, grads_s = _run(stock, x, names)
        out_l, grads_l = _run(leaned, x, names)
        torch.testing.assert_close(out_l, out_s, rtol=0, atol=0)
        for n in grads_s:
            torch.testing.assert_close(grads_l[n], grads_s[n], rtol=RTOL, atol=ATOL)


def _lean_batch_grad(stock: nn.Module, x, y) -> nn.Module:
    """jacmem's BatchGrad on ``lean`` of a copy of ``stock`` equals the per-sample loop on
    ``stock`` (cross-entropy, mean) for every trainable parameter; returns the lean copy."""
    leaned = lean(copy.deepcopy(stock))
    reference = per_sample_grads(stock, x, y, cross_entropy)
    with jacmem.extend(jacmem.BatchGrad()):
        nn.functional.cross_entropy(leaned(x), y).backward()
    params = dict(leaned.named_parameters())
    for n, p in stock.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(params[n].grad_batch, reference[p], rtol=1e-9, atol=1e-12, msg=n)
    return leaned


def test_extend_batch_grad_on_lean_partly_frozen_model():
    """jacmem.extend(BatchGrad()) through lean layers: per-sample gradients of the
    trainable tail, against an autograd loop and BackPACK (on the stock model: BackPACK
    does not know the lean types); the frozen head keeps nothing."""
    backpack = pytest.importorskip("backpack")
    torch.manual_seed(1)
    stock = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 5, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(5 * 2 * 2, 3),
    )
    for p in stock[3].parameters():
        p.requires_grad_(False)
    x, y = torch.randn(6, 3, 8, 8), torch.randint(0, 3, (6,))
    leaned = _lean_batch_grad(stock, x, y)
    params = dict(leaned.named_parameters())
    assert params["3.weight"].grad is None and not hasattr(params["3.weight"], "grad_batch")

    bp_model = backpack.extend(copy.deepcopy(stock))
    with backpack.backpack(backpack.extensions.BatchGrad()):
        backpack.extend(nn.CrossEntropyLoss())(bp_model(x), y).backward()
    for n, p in bp_model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(params[n].grad_batch, p.grad_batch, rtol=1e-9, atol=1e-12, msg=n)

    # the frozen conv 3 keeps nothing; stock keeps its input for the gradient it does not compute
    lean_rows = {m.name: m for m in report(leaned, x).modules}
    stock_rows = {m.name: m for m in report(stock, x).modules}
    assert lean_rows["3"].bytes == 0 and lean_rows["3"].wasted == 0
    assert stock_rows["3"].wasted == 4 * 4 * 4 * 6 * 8  # its input [6, 4, 4, 4], float64


def test_extend_batch_grad_through_lean_batchnorm_and_conv_transpose():
    """Lean eval-mode BatchNorm and ConvTranspose share jacmem's derivatives of the stock
    layers too: per-sample gradients against an autograd loop on the stock model."""
    torch.manual_seed(2)
    stock = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        _batchnorm(nn.BatchNorm2d, 4),
        nn.ReLU(),
        nn.ConvTranspose2d(4, 2, 3, stride=2),
        nn.Flatten(),
        nn.Linear(2 * 13 * 13, 3),
    ).eval()
    for p in stock[0].parameters():
        p.requires_grad_(False)
    _lean_batch_grad(stock, x=torch.randn(4, 3, 8, 8), y=torch.randint(0, 3, (4,)))


def test_second_order_through_lean_layers_matches_backpack():
    """jacmem's DiagGGNExact crosses lean ReLU and max pooling (the stock types'
    passthroughs, with the stock forward for the generic vjp); reference: BackPACK's
    DiagGGNExact on the stock model (BackPACK does not know the lean types)."""
    backpack = pytest.importorskip("backpack")
    torch.manual_seed(3)
    stock = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 3, 2), nn.Flatten(), nn.Linear(12, 3)
    )
    leaned = lean(copy.deepcopy(stock))
    x, y = torch.randn(5, 3, 8, 8), torch.randint(0, 3, (5,))
    with jacmem.extend(jacmem.DiagGGNExact()):
        nn.CrossEntropyLoss()(leaned(x), y).backward()
    bp_model = backpack.extend(copy.deepcopy(stock))
    with backpack.backpack(backpack.extensions.DiagGGNExact()):
        backpack.extend(nn.CrossEntropyLoss())(bp_model(x), y).backward()
    lean_params = dict(leaned.named_parameters())
    for n, p in bp_model.named_parameters():
        torch.testing.assert_close(lean_params[n].diag_ggn_exact, p.diag_ggn_exact, rtol=1e-9, atol=1e-12, msg=n)
