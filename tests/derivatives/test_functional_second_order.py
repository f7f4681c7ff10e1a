"""Second order through functional ops and functional losses (jacmem.derivatives.functional):
models written with F.relu, in-place ReLU, torch.flatten, ``out += identity``, and
losses written ``F.cross_entropy(model(X), y)``, against dense autograd references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.support.secondorder_ref import check_exact, check_kronecker_blocks, dense, diagonals, run
from torch import nn

import jacmem
from jacmem import (
    KFAC,
    KFLR,
    KFRA,
    BatchDiagGGNExact,
    ChainError,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
)

DT = torch.float64


class TinyBasicBlock(nn.Module):
    """torchvision's BasicBlock, small: in-place ReLU (called twice), ``out += identity``
    after a downsampling branch; then functional pooling, ``torch.flatten`` and a head."""

    def __init__(self):
        super().__init__()
        self.conv0 = nn.Conv2d(1, 2, 3, padding=1)
        self.conv1, self.bn1 = nn.Conv2d(2, 3, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(3)
        self.conv2, self.bn2 = nn.Conv2d(3, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = nn.Sequential(nn.Conv2d(2, 3, 1, stride=2, bias=False), nn.BatchNorm2d(3))
        self.fc = nn.Linear(3 * 2 * 2, 3)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv0(x)), 2)  # [N, 2, 4, 4]
        identity = self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        out = self.relu(out)
        out = F.adaptive_avg_pool2d(out, (2, 2))
        return self.fc(torch.flatten(out, 1))


def tiny_block() -> nn.Module:
    model = TinyBasicBlock().to(DT).eval()
    for bn in (model.bn1, model.bn2, model.downsample[1]):  # non-trivial eval statistics
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 1.5)
        bn.weight.data.uniform_(0.5, 1.5)
        bn.bias.data.uniform_(-0.5, 0.5)
    return model


class Smooth(nn.Module):
    """Functional activations with second derivatives (DiagHessian's residuals), a skip
    sum, scales, a shift, a view, a slice and dropout in eval."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(5, 3)

    def forward(self, x):
        h = F.silu(self.a(x))
        h = torch.tanh(self.b(h)) + h
        h = (F.gelu(0.5 * h + 0.1) / 2).view(x.shape[0], 2, 3).reshape(x.shape[0], 6)
        return self.c(F.dropout(torch.sigmoid(h)[:, 1:], 0.3, training=False))


def test_tiny_basic_block_exact():
    """In-place ReLU, out += identity, functional max/avg pooling and torch.flatten:
    DiagGGNExact, DiagHessian and their per-sample versions equal dense autograd."""
    torch.manual_seed(0)
    check_exact(tiny_block(), nn.CrossEntropyLoss(), torch.randn(3, 1, 8, 8, dtype=DT), torch.randint(0, 3, (3,)))


def test_functional_activations_exact():
    """DiagHessian's residual terms come from F.silu, torch.tanh, F.gelu, torch.sigmoid's
    second derivatives, through a skip sum, x * 0.5, view/reshape and x[:, 1:]."""
    torch.manual_seed(1)
    check_exact(Smooth().to(DT), nn.MSELoss(), torch.randn(4, 4, dtype=DT), torch.randn(4, 3, dtype=DT))


def test_functional_kflr_kfra_at_batch_size_one():
    torch.manual_seed(2)
    model, X, y = Smooth().to(DT), torch.randn(1, 4, dtype=DT), torch.randint(0, 3, (1,))
    check_kronecker_blocks(model, nn.CrossEntropyLoss(), X, y)


class Inner(nn.Module):
    def forward(self, x):
        return F.relu(x) * 2 + x  # piecewise linear: a generic passthrough has no residual


class Registered(nn.Module):
    """A module registered to pass factors through by the vjp of its forward, whose
    forward is written with functional ops in a child module the engine does not know:
    they are its own, not links of the chain."""

    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x):
        return self.inner(x)


jacmem.derivatives.passthrough(Registered)


def test_functional_ops_inside_a_known_module_are_its_own():
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(4, 5), Registered(), nn.Linear(5, 3)).to(DT)
    check_exact(model, nn.CrossEntropyLoss(), torch.randn(3, 4, dtype=DT), torch.randint(0, 3, (3,)))


# -- functional losses ------------------------------------------------------------------


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)


def _data(kind: str, n: int = 6):
    X = torch.randn(n, 4, dtype=DT)
    if kind == "ce":
        return X, torch.tensor([0, 2, 1, 2, 1, 0][:n])
    if kind == "mse":
        return X, torch.randn(n, 3, dtype=DT)
    return X, torch.rand(n, 3, dtype=DT).round()


FUNCTIONS = {"ce": F.cross_entropy, "mse": F.mse_loss, "bce": F.binary_cross_entropy_with_logits}
MODULES = {"ce": nn.CrossEntropyLoss, "mse": nn.MSELoss, "bce": nn.BCEWithLogitsLoss}


def _functional(kind: str, reduction: str, form: str = "function", **kw):
    """The loss written with the function (``form="module"``: with the loss module); ``none+sum``:
    ``reduction="none"``, summed."""
    f = (
        FUNCTIONS[kind]
        if form == "function"
        else lambda z, t, reduction, **kw: MODULES[kind](reduction=reduction)(z, t)
    )
    if reduction.startswith("none"):
        then = torch.sum if reduction == "none+sum" else torch.mean
        return lambda z, t: then(f(z, t, reduction="none", **kw))
    return lambda z, t: f(z, t, reduction=reduction, **kw)


@pytest.mark.parametrize("form", ["function", "module"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none+sum", "none+mean"])
@pytest.mark.parametrize("kind", ["ce", "mse", "bce"])
def test_functional_losses_against_autograd(kind, reduction, form):
    """Every reduction (``none`` then ``.sum()`` or ``.mean()``), written with the function or
    the loss module: DiagGGNExact and DiagHessian equal the dense GGN and Hessian
    diagonals of the written loss."""
    torch.manual_seed(3)
    model, (X, y) = mlp(), _data(kind)
    lossf = _functional(kind, reduction, form)
    run(model, lossf, X, y, DiagGGNExact(), DiagHessian())
    ggn, hess = dense(model, lossf, X, y)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, diagonals(model, ggn)[name], msg=name)
        torch.testing.assert_close(p.diag_h, diagonals(model, hess)[name], msg=name)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_ignore_index(reduction):
    """Rows whose target is ignore_index contribute nothing; the mean counts the others.
    Equal to the loss module's result and to autograd (per sample too)."""
    torch.manual_seed(4)
    model, (X, y) = mlp(), _data("ce")
    y[[1, 4]] = 7
    module = nn.CrossEntropyLoss(reduction=reduction, ignore_index=7)
    check_exact(model, lambda z, t: F.cross_entropy(z, t, ignore_index=7, reduction=reduction), X, y, per_sample=False)
    run(model, module, X, y, BatchDiagGGNExact())
    by_module = {n: p.diag_ggn_exact_batch for n, p in model.named_parameters()}
    run(model, lambda z, t: F.cross_entropy(z, t, ignore_index=7, reduction=reduction), X, y, BatchDiagGGNExact())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact_batch, by_module[name], rtol=0, atol=0)
        assert p.diag_ggn_exact_batch[[1, 4]].abs().max() == 0


@pytest.mark.parametrize("targets", ["classes", "probabilities"])
def test_cross_entropy_label_smoothing(targets):
    """``label_smoothing`` leaves a class target's Hessian as it is and scales a
    probability target's by the smoothed targets' sum (``(1-ε) Σ y + ε``, rows here not
    summing to 1): DiagGGNExact equals the dense GGN diagonal of the written loss, for
    the module and the function."""
    torch.manual_seed(13)
    model, (X, y) = mlp(), _data("ce")
    if targets == "probabilities":
        y = torch.rand(6, 3, dtype=DT)
    else:
        y[2] = -100
    for reduction in ("mean", "sum"):
        module = nn.CrossEntropyLoss(label_smoothing=0.2, reduction=reduction)
        check_exact(model, module, X, y, per_sample=False)
        lossf = _functional("ce", reduction, label_smoothing=0.2)
        run(model, lossf, X, y, DiagGGNExact())
        ggn = diagonals(model, dense(model, lossf, X, y)[0])
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.diag_ggn_exact, ggn[name], msg=f"{reduction} {name}")


def test_monte_carlo_matches_the_module_and_converges():
    """DiagGGNMC with a functional loss draws what the module loss draws (same seed), and
    with many samples comes near the exact diagonal."""
    model, (X, y) = mlp(), _data("ce")
    got = {}
    for lossf in (nn.CrossEntropyLoss(), F.cross_entropy):
        torch.manual_seed(5)
        run(model, lossf, X, y, DiagGGNMC(mc_samples=3))
        got[lossf] = [p.diag_ggn_mc.clone() for p in model.parameters()]
    for a, b in zip(*got.values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.manual_seed(6)
    run(model, F.cross_entropy, X, y, DiagGGNMC(mc_samples=20000), DiagGGNExact())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_mc, p.diag_ggn_exact, rtol=0.05, atol=1e-3, msg=name)


def test_a_class_weight_refuses():
    """A class weight: the loss module's own refusal, at the forward."""
    torch.manual_seed(12)
    model, (X, y) = mlp(), _data("ce")
    with pytest.raises(NotImplementedError, match=r"weight=\.\.\.\) is not supported"):
        run(model, lambda z, t: F.cross_entropy(z, t, weight=torch.ones(3, dtype=DT)), X, y, DiagGGNExact())


def test_a_none_loss_reduced_in_parts_takes_the_autograd_path():
    """A 'none' loss reduced other than whole is not recognised as a loss: the GGN-type
    extensions take the autograd path (the loss Hessian from the graph), exact; for
    DiagHessian the chain breaks, naming the module."""
    torch.manual_seed(12)
    model, (X, y) = mlp(), _data("ce")
    X, y = X.reshape(2, 3, 4), y.reshape(2, 3)
    lossf = lambda z, t: F.cross_entropy(z.transpose(1, 2), t, reduction="none").sum(1).sum()  # noqa: E731
    run(model, lossf, X, y, DiagGGNExact())
    ggn, _ = dense(model, lossf, X, y)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, diagonals(model, ggn)[name], rtol=1e-8, atol=1e-10)
    with pytest.raises(ChainError, match=r"module '2' \(Linear\)"):
        run(model, lossf, X, y, DiagHessian())


# -- a loss computed inside the model (HuggingFace's labels=) -----------------------------


class TinyCausalLM(nn.Module):
    """Logits ``[N, T, V]`` and, given labels, HuggingFace's own causal-LM loss (labels
    shifted, logits cast to float32 and viewed as ``[N·T, V]``, ``F.cross_entropy``
    with ignore_index -100)."""

    def __init__(self, vocab: int = 5):
        super().__init__()
        self.emb, self.lin, self.head = nn.Embedding(vocab, 4), nn.Linear(4, 4), nn.Linear(4, vocab)
        self.vocab = vocab

    def forward(self, ids, labels=None):
        logits = self.head(torch.tanh(self.lin(self.emb(ids))))
        if labels is None:
            return logits
        from transformers.loss.loss_utils import ForCausalLMLoss

        return ForCausalLMLoss(logits, labels, self.vocab)


def test_loss_inside_the_model_hf_causal_lm():
    """The GGN splits at the logits ``[N, T, V]``, the input of the recognised loss once
    ``.view(-1, V)`` is undone: DiagGGNExact and its per-sample version equal dense
    autograd of HF's loss (the loss runs in float32, as HF casts it: hence rtol 1e-5)."""
    torch.manual_seed(7)
    model = TinyCausalLM().to(DT)
    ids = torch.randint(0, 5, (3, 4))
    labels = ids.clone()
    labels[0, 2] = -100

    def lossf(logits, labels):
        from transformers.loss.loss_utils import ForCausalLMLoss

        return ForCausalLMLoss(logits, labels, 5)

    model.zero_grad()
    with jacmem.extend(DiagGGNExact(), BatchDiagGGNExact()):
        model(ids, labels=labels).backward()
    ggn, _ = dense(model, lossf, ids, labels)
    per_sample = torch.stack([dense(model, lossf, ids[n : n + 1], labels[n : n + 1])[0] for n in range(3)])
    # the mean divides by all non-ignored tokens of the batch, not those of one sample
    counts = (labels[:, 1:] != -100).sum(1).to(DT)
    per_sample = per_sample * (counts / counts.sum())[:, None, None]
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, diagonals(model, ggn)[name], rtol=1e-5, atol=1e-9, msg=name)
        ref = diagonals(model, per_sample)[name]
        torch.testing.assert_close(p.diag_ggn_exact_batch, ref, rtol=1e-5, atol=1e-9, msg=name)


# -- what the chain cannot follow ---------------------------------------------------------


@pytest.mark.parametrize(
    "op, grad_fn", [(torch.sin, "SinBackward0"), (lambda z: z * z, "MulBackward0")], ids=["sin", "z*z"]
)
def test_chain_error_names_the_op(op, grad_fn):
    """DiagHessian with an op jacmem has no derivatives for between a Linear and the
    loss: ChainError names the op's grad_fn, the module before it and the loss after."""
    torch.manual_seed(8)
    model = mlp()
    with pytest.raises(
        ChainError, match=rf"module '2' \(Linear\).*'cross_entropy' \(through the operation {grad_fn}\)"
    ):
        with jacmem.extend(DiagHessian()):
            F.cross_entropy(op(model(torch.randn(2, 4, dtype=DT))), torch.tensor([0, 1])).backward()


@pytest.mark.heavy
def test_hf_gpt2_labels_refuses():
    """HF GPT2 with ``labels=``: the loss inside the model is followed; its tied
    embedding and head weight is refused by KFLR (the sum of the calls' Kronecker factors
    is none of the shared weight: tests/integration/test_tied_curvature.py), and no
    number is written."""
    import transformers

    torch.manual_seed(10)
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=11, n_positions=8)
    cfg.bos_token_id = cfg.eos_token_id = 0
    model = transformers.GPT2LMHeadModel(cfg).to(DT).eval()
    ids = torch.randint(0, 11, (2, 5))
    with pytest.raises(NotImplementedError, match=r"parameter 'weight' of module .* is used by more than one call"):
        with jacmem.extend(jacmem.KFLR()):
            model(ids, labels=ids).loss.backward()
    assert all(not hasattr(p, "kflr") for p in model.parameters())


def test_no_mode_outside_the_block():
    """The interception costs nothing outside a block: no torch function mode is active
    before or after it, and inside it only while second-order extensions are on."""
    from torch.overrides import _get_current_function_mode_stack

    assert not _get_current_function_mode_stack()
    with jacmem.extend(jacmem.BatchGrad()):
        assert not _get_current_function_mode_stack()
    with jacmem.extend(DiagGGNExact()):
        assert len(_get_current_function_mode_stack()) == 1
    assert not _get_current_function_mode_stack()


# -- stock torchvision resnet18 -----------------------------------------------------------


def _resnet18():
    import torchvision

    torch.manual_seed(9)
    model = torchvision.models.resnet18(num_classes=5).to(DT).eval()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):  # non-trivial eval statistics
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
    return model


def _ggn_diagonals_by_vjps(model, X, y):
    """Per-sample GGN diagonals from a square root of each sample's loss Hessian (by
    torch.func.hessian of the loss w.r.t. the logits, eigendecomposed), pushed back
    through the model by autograd: ``Σ_v (J_nᵀ s_v)²``."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        z = model(X)
    H = torch.func.hessian(lambda z: F.cross_entropy(z, y))(z)  # [N, C, N, C]
    out = {name: [] for name in params}
    for n in range(X.shape[0]):
        evals, evecs = torch.linalg.eigh(H[n, :, n, :])
        roots = evecs * evals.clamp(min=0).sqrt()  # columns s_v
        zn = model(X[n : n + 1])
        acc = {name: torch.zeros_like(p) for name, p in params.items()}
        for v in range(roots.shape[1]):
            grads = torch.autograd.grad(zn, list(params.values()), roots[:, v].unsqueeze(0), retain_graph=True)
            for name, g in zip(params, grads):
                acc[name] += g**2
        for name in params:
            out[name].append(acc[name])
    return {name: torch.stack(parts) for name, parts in out.items()}


@pytest.mark.heavy
def test_resnet18_diagonals():
    """Stock torchvision resnet18 (in-place ReLU, torch.flatten, out += identity),
    loss F.cross_entropy(model(X), y): DiagGGNExact and BatchDiagGGNExact equal the GGN
    diagonals built with autograd; DiagHessian equals the Hessian's diagonal, read off
    Hessian-vector products at a few entries of several layers."""
    model = _resnet18()
    X, y = torch.randn(2, 3, 16, 16, dtype=DT), torch.tensor([1, 3])
    run(model, F.cross_entropy, X, y, DiagGGNExact(), BatchDiagGGNExact(), DiagHessian())
    ref = _ggn_diagonals_by_vjps(model, X, y)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact_batch, ref[name], msg=name)
        torch.testing.assert_close(p.diag_ggn_exact, ref[name].sum(0), msg=name)
    params = dict(model.named_parameters())
    picks = ["conv1.weight", "layer1.0.conv2.weight", "layer2.0.downsample.0.weight", "layer3.1.bn2.weight"]
    picks += ["layer4.1.conv1.weight", "fc.weight", "fc.bias"]
    grads = torch.autograd.grad(F.cross_entropy(model(X), y), [params[k] for k in picks], create_graph=True)
    gen = torch.Generator().manual_seed(0)
    for name, g in zip(picks, grads):
        for i in torch.randint(0, g.numel(), (2,), generator=gen).tolist():
            (row,) = torch.autograd.grad(g.flatten()[i], params[name], retain_graph=True)
            torch.testing.assert_close(params[name].diag_h.flatten()[i], row.flatten()[i], msg=f"{name}[{i}]")


def _check_factors(model, field):
    """Each trainable parameter's factors: symmetric, PSD, [out, out] (and [in, in])."""
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        factors = getattr(p, field)
        sizes = [p.shape[0], p[0].numel()] if p.dim() > 1 else [p.shape[0]]
        assert [f.shape for f in factors] == [(s, s) for s in sizes], (field, name)
        for f in factors:
            torch.testing.assert_close(f, f.T, msg=f"{field} {name}")
            assert torch.linalg.eigvalsh(f).min() >= -1e-10 * f.abs().max(), (field, name)


def _few_trainable(model):
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(("layer3.0.conv1", "fc", "layer1.0.conv1", "layer2.0.downsample.0")))
    return model


@pytest.mark.heavy
def test_resnet18_kfac_kflr():
    """KFAC and KFLR run through stock resnet18 and give symmetric positive
    semi-definite factors of the layers' sizes."""
    model = _few_trainable(_resnet18())
    run(model, F.cross_entropy, torch.randn(2, 3, 4, 4, dtype=DT), torch.tensor([0, 4]), KFAC(), KFLR())
    _check_factors(model, "kfac")
    _check_factors(model, "kflr")


@pytest.mark.heavy
def test_resnet18_kfra():
    """KFRA too (input 4×4: its dense matrices are [D, D] per layer, and each residual
    sum forks them into roots by an eigendecomposition)."""
    model = _few_trainable(_resnet18())
    run(model, F.cross_entropy, torch.randn(2, 3, 4, 4, dtype=DT), torch.tensor([0, 4]), KFRA())
    _check_factors(model, "kfra")
