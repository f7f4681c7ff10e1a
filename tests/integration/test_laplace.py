"""jacmem.laplace against laplace-torch's own backends, in float64.

References: laplace's CurvlinopsGGN / CurvlinopsEF (their diag, jacobians and
gradients come from torch.func; full from curvlinops' GGN operator; kron from
curvlinops' KFAC) and laplace's BackPACK backend (KFLR factors), on the same model and
data. The marginal likelihood of a fitted Laplace is compared with the CurvlinopsGGN one."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("laplace")
from laplace import Laplace  # noqa: E402
from laplace.curvature import BackPackGGN, CurvlinopsEF, CurvlinopsGGN  # noqa: E402
from laplace.utils import FeatureExtractor  # noqa: E402
from tests.support.secondorder_ref import dense  # noqa: E402

import jacmem  # noqa: E402
from jacmem.laplace import JacmemEF, JacmemGGN  # noqa: E402

pytestmark = pytest.mark.usefixtures("float64_default")

N, C = 6, 3
TARGETS = {"classification": lambda: torch.randint(0, C, (N,)), "regression": lambda: torch.randn(N, C)}


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, C))


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, C))


def small_resnet() -> nn.Module:
    """A ResNet jacmem follows today: BatchNorm (eval) in residual units written with
    jacmem.nn.Residual."""
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        jacmem.nn.Residual(nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU()),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, C),
    )
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.5, 0.5)
    return model.eval()


MODELS = {"mlp": (mlp, (4,)), "cnn": (cnn, (2, 6, 6)), "resnet": (small_resnet, (2, 5, 5))}


def case(name: str, likelihood: str):
    """Two identical copies of the model (one per backend), and the data."""
    build, shape = MODELS[name]
    torch.manual_seed(1)
    model = build()
    twin = build()
    twin.load_state_dict(model.state_dict())
    torch.manual_seed(2)
    return model, twin.train(model.training), torch.randn(N, *shape), TARGETS[likelihood]()


def close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12)


def no_leftovers(model: nn.Module):
    for name, p in model.named_parameters():
        assert p.grad is None, name
        assert not set(vars(p)) & {
            "grad_batch",
            "sum_grad_squared",
            "diag_ggn_exact",
            "diag_ggn_mc",
            "kfac",
            "kflr",
            "kfac_ef",
        }


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "resnet"])
def test_diag_equals_curvlinops(name, likelihood):
    model, twin, X, y = case(name, likelihood)
    loss, H = JacmemGGN(model, likelihood).diag(X, y)
    ref_loss, ref_H = CurvlinopsGGN(twin, likelihood).diag(X, y)
    close(H, ref_H)
    close(loss, ref_loss)
    no_leftovers(model)


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_jacobians_gradients_ef_full_equal_torch_func(name, likelihood):
    model, twin, X, y = case(name, likelihood)
    ours, ref = JacmemGGN(model, likelihood), CurvlinopsGGN(twin, likelihood)
    for got, want in zip(ours.jacobians(X), ref.jacobians(X)):  # Js [N, C, P], f [N, C]
        close(got, want)
    Gs, loss = ours.gradients(X, y)
    ref_Gs, ref_loss = ref.gradients(X, y)
    close(Gs, ref_Gs)
    close(loss, ref_loss)
    for got, want in zip(JacmemEF(model, likelihood).diag(X, y), CurvlinopsEF(twin, likelihood).diag(X, y)):
        close(got, want)
    for got, want in zip(ours.full(X, y), ref.full(X, y)):  # ours from Jacobians, curvlinops' from its operator
        close(got, want)
    no_leftovers(model)


def same_kron(got, want):
    """Two (loss, Kron) pairs: equal losses and factors."""
    close(got[0], want[0])
    assert [len(f) for f in got[1].kfacs] == [len(f) for f in want[1].kfacs]
    for g, w in zip(got[1].kfacs, want[1].kfacs):
        for a, b in zip(g, w, strict=True):
            close(a, b)


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_kron_equals_backpack_and_curvlinops(name, likelihood):
    """The default convention (``kfac_approx="expand"``) is curvlinops' type-2 KFAC;
    ``kfac_approx=None`` is BackPACK's KFLR; for Linear layers the two agree."""
    model, twin, X, y = case(name, likelihood)
    pairs = [
        (JacmemGGN(model, likelihood), CurvlinopsGGN(twin, likelihood)),
        (JacmemGGN(model, likelihood, kfac_approx=None), BackPackGGN(twin, likelihood)),
    ]
    if name == "mlp":
        pairs.append((JacmemGGN(model, likelihood), BackPackGGN(twin, likelihood)))
    for ours, ref in pairs:
        same_kron(ours.kron(X, y, N=4 * N), ref.kron(X, y, N=4 * N))
    no_leftovers(model)


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
def test_kfac_approx_of_a_call_equals_curvlinops(likelihood):
    """laplace passes ``kfac_approx`` to ``kron`` (its ``asdl_fisher_kwargs``): "reduce"
    on a convolution is curvlinops' "reduce", and not the default "expand"."""
    model, twin, X, y = case("cnn", likelihood)
    ours, ref = JacmemGGN(model, likelihood), CurvlinopsGGN(twin, likelihood)
    reduced = ours.kron(X, y, N=N, kfac_approx="reduce")
    same_kron(reduced, ref.kron(X, y, N=N, kfac_approx="reduce"))
    assert not torch.allclose(reduced[1].kfacs[0][1], ours.kron(X, y, N=N)[1].kfacs[0][1])


@pytest.mark.parametrize("kfac_approx", ["expand", "reduce"])
@pytest.mark.parametrize("likelihood", ["classification", "regression"])
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_kron_ef_equals_curvlinops(name, likelihood, kfac_approx):
    """JacmemEF's ``kron`` (KFACEF) is CurvlinopsEF's (curvlinops' KFAC with
    ``fisher_type="empirical"``), with laplace's ``kfac_approx`` and M/N scaling; on a
    convolution "reduce" is not "expand"."""
    model, twin, X, y = case(name, likelihood)
    ours = JacmemEF(model, likelihood).kron(X, y, N=4 * N, kfac_approx=kfac_approx)
    same_kron(ours, CurvlinopsEF(twin, likelihood).kron(X, y, N=4 * N, kfac_approx=kfac_approx))
    if name == "cnn" and kfac_approx == "reduce":
        expanded = JacmemEF(model, likelihood).kron(X, y, N=4 * N)[1].kfacs[0][1]
        assert not torch.allclose(ours[1].kfacs[0][1], expanded)
    no_leftovers(model)


def test_default_kron_convention_is_the_closer_to_the_exact_diagonal():
    """On a convolution (weight shared over positions), the Kronecker diagonal of the
    default ``kfac_approx="expand"`` is closer to the exact GGN diagonal (torch.func) than
    BackPACK's (``None``), for the convolution's weight and for the whole network."""
    model, _, X, y = case("cnn", "classification")
    exact = torch.diagonal(dense(model, nn.CrossEntropyLoss(reduction="sum"), X, y)[0])
    errors = {}
    for approx in ("expand", None):
        diag = JacmemGGN(model, "classification", kfac_approx=approx).kron(X, y, N=N)[1].diag()
        conv = model[0].weight.numel()
        errors[approx] = [((diag - exact)[s].norm() / exact[s].norm()).item() for s in (slice(conv), slice(None))]
    assert all(e < n for e, n in zip(errors["expand"], errors[None])), errors


def test_mc_samples_of_a_call_is_num_samples():
    """laplace's ``mc_samples`` keyword of ``diag``, ``kron`` and ``full`` draws as many
    samples as the backend's ``num_samples``: the same numbers from the same seed, and
    not those of one sample."""
    model, _, X, y = case("mlp", "classification")
    many, one = (
        JacmemGGN(model, "classification", stochastic=True, num_samples=7),
        JacmemGGN(model, "classification", stochastic=True),
    )
    for call, kwargs in (("diag", {}), ("kron", {"N": N}), ("full", {})):
        results = []
        for backend, mc in ((many, {}), (one, {"mc_samples": 7}), (one, {})):
            torch.manual_seed(3)
            got = getattr(backend, call)(X, y, **kwargs, **mc)[1]
            results.append(got.to_matrix() if call == "kron" else got)
        close(results[1], results[0])
        assert not torch.allclose(results[2], results[0]), call
    assert one.num_samples == 1
    no_leftovers(model)


def test_stochastic_is_the_monte_carlo_fisher():
    """stochastic=True samples the labels (DiagGGNMC, KFAC): with one sample it is not the
    GGN, with 4000 it is within 5% of it (of the largest entry; seeded)."""
    model, twin, X, y = case("mlp", "classification")
    _, exact = CurvlinopsGGN(twin, "classification").diag(X, y)
    _, exact_kron = BackPackGGN(twin, "classification").kron(X, y, N=N)
    _, one = JacmemGGN(model, "classification", stochastic=True).diag(X, y)
    assert (one - exact).abs().max() > 0.05 * exact.abs().max()
    many = JacmemGGN(model, "classification", stochastic=True, num_samples=4000)
    _, diag = many.diag(X, y)
    torch.testing.assert_close(diag, exact, rtol=0.05, atol=0.05 * exact.abs().max().item())
    _, kron = many.kron(X, y, N=N)
    for got, want in zip(kron.kfacs, exact_kron.kfacs):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0.05, atol=0.05 * w.abs().max().item())
    no_leftovers(model)


def test_full_stochastic_converges_with_mc_samples():
    model, twin, X, y = case("mlp", "classification")
    _, exact = CurvlinopsGGN(twin, "classification").full(X, y)
    torch.manual_seed(4)
    _, H = JacmemGGN(model, "classification", stochastic=True).full(X, y, mc_samples=4000)
    torch.testing.assert_close(H, exact, rtol=0.05, atol=0.05 * exact.abs().max().item())


@pytest.mark.parametrize("backends", [(JacmemGGN, CurvlinopsGGN), (JacmemEF, CurvlinopsEF)], ids=["GGN", "EF"])
def test_kron_without_factors_takes_the_diagonal(backends):
    """BatchNorm's weight and bias have no Kronecker factors: their blocks are the
    diagonal (the exact GGN's, the empirical Fisher's), of the whole model, which
    curvlinops' KFAC refuses. The last Linear's factors are curvlinops' (on the Linear
    alone fed the features)."""
    ours, Ref = backends
    model, twin, X, y = case("resnet", "classification")
    _, kron = ours(model, "classification").kron(X, y, N=N)
    _, diag = Ref(twin, "classification").diag(X, y)
    norms = {id(p) for m in model.modules() if isinstance(m, nn.BatchNorm2d) for p in m.parameters()}
    offset = 0
    for p, factors in zip(model.parameters(), kron.kfacs):
        if id(p) in norms:
            assert len(factors) == 1
            close(factors[0], torch.diag(diag[offset : offset + p.numel()]))
        offset += p.numel()
    assert offset == diag.numel() and len(norms) == 4
    head = copy.deepcopy(twin[-1])
    _, ref_kron = Ref(head, "classification").kron(twin[:-1](X).detach(), y, N=N)
    for got, want in zip(kron.kfacs[-2:], ref_kron.kfacs):
        for g, w in zip(got, want, strict=True):
            close(g, w)


def test_kron_of_a_layer_norm_is_its_ggn_diagonal():
    """KFLR gives a LayerNorm's weight and bias their GGN diagonal ``[d]``: laplace's
    Kron must hold it as the diagonal block, not as a [d, d] factor."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Linear(5, C))
    twin = copy.deepcopy(model)
    X, y = torch.randn(N, 4), TARGETS["classification"]()
    _, kron = JacmemGGN(model, "classification").kron(X, y, N=N)
    _, diag = CurvlinopsGGN(twin, "classification").diag(X, y)
    offset = 0
    for p, factors in zip(model.parameters(), kron.kfacs):
        if p.dim() == 1 and p.numel() == 5 and offset in (25, 30):  # the LayerNorm's weight and bias
            close(factors[0], torch.diag(diag[offset : offset + p.numel()]))
        offset += p.numel()
    assert offset == diag.numel() == 53


def test_kron_of_an_embedding_is_its_ggn_block_at_one_sample():
    """At one sample and one position, KFLR is exact: laplace's Kron block of the
    Embedding's weight ``[V, D]`` (``[diag(A), G]``, row-major) equals the exact GGN block
    (curvlinops' GGN operator)."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Embedding(5, 3), nn.Flatten(), nn.Tanh(), nn.Linear(3, C))
    twin = copy.deepcopy(model)
    X, y = torch.tensor([[2]]), torch.tensor([1])
    _, kron = JacmemGGN(model, "classification").kron(X, y, N=1)
    _, full = CurvlinopsGGN(twin, "classification").full(X, y)
    Q, H = kron.kfacs[0]
    assert Q.shape == (5, 5) and H.shape == (3, 3)
    close(torch.kron(Q, H), full[:15, :15])
    assert full[:15, :15].abs().max() > 0


def test_a_parameter_the_output_does_not_use_gets_zeros():
    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.net, self.unused = mlp(), nn.Linear(2, 2)

        def forward(self, x):
            return self.net(x)

    torch.manual_seed(1)
    model = Unused()
    twin = copy.deepcopy(model)
    X, y = torch.randn(N, 4), torch.randint(0, C, (N,))
    ours, ref = JacmemGGN(model, "classification"), CurvlinopsGGN(twin, "classification")
    close(ours.diag(X, y)[1], ref.diag(X, y)[1])
    close(ours.jacobians(X)[0], ref.jacobians(X)[0])
    close(ours.gradients(X, y)[0], ref.gradients(X, y)[0])
    _, kron = ours.kron(X, y, N=N)
    assert [[f.shape for f in fs] for fs in kron.kfacs[-2:]] == [[(2, 2), (2, 2)], [(2, 2)]]
    assert all(f.abs().max() == 0 for fs in kron.kfacs[-2:] for f in fs)
    assert all(f.abs().max() > 0 for fs in kron.kfacs[:-2] for f in fs)
    no_leftovers(model)


def loader(X, y) -> DataLoader:
    return DataLoader(TensorDataset(X, y), batch_size=N // 2)


@pytest.mark.parametrize("backends", [(JacmemGGN, CurvlinopsGGN), (JacmemEF, CurvlinopsEF)], ids=["GGN", "EF"])
@pytest.mark.parametrize("structure", ["diag", "kron"])
@pytest.mark.parametrize("likelihood", ["classification", "regression"])
def test_laplace_end_to_end_matches_curvlinops(structure, likelihood, backends):
    model, twin, X, y = case("mlp", likelihood)
    kwargs = dict(subset_of_weights="all", hessian_structure=structure)
    la = Laplace(model, likelihood, backend=backends[0], **kwargs)
    ref = Laplace(twin, likelihood, backend=backends[1], **kwargs)
    for lap in (la, ref):
        lap.fit(loader(X, y))
    close(la.log_marginal_likelihood(), ref.log_marginal_likelihood())
    la.optimize_prior_precision(method="marglik", n_steps=20)
    ref.optimize_prior_precision(method="marglik", n_steps=20)
    torch.testing.assert_close(la.prior_precision, ref.prior_precision, rtol=1e-8, atol=1e-10)
    pred = dict(pred_type="glm") | (dict(link_approx="probit") if likelihood == "classification" else {})
    for got, want in zip(la(X, **pred), ref(X, **pred)):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)
    no_leftovers(model)


@pytest.mark.parametrize("structure", ["diag", "kron"])
def test_laplace_fits_a_resnet_that_backpack_cannot(structure):
    model, _, X, y = case("resnet", "classification")
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure=structure, backend=JacmemGGN)
    la.fit(loader(X, y))
    la.optimize_prior_precision(method="marglik", n_steps=5)
    probs = la(X, pred_type="glm", link_approx="probit")
    assert torch.isfinite(la.log_marginal_likelihood())
    close(probs.sum(-1), torch.ones(N))


@pytest.mark.slow
def test_laplace_on_stock_torchvision_resnet18():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(1)
    model = torchvision.models.resnet18(num_classes=C).eval()
    twin = torchvision.models.resnet18(num_classes=C).eval()
    twin.load_state_dict(model.state_dict())
    X, y = torch.randn(2, 3, 32, 32), torch.randint(0, C, (2,))
    _, H = JacmemGGN(model, "classification").diag(X, y)
    _, ref_H = CurvlinopsGGN(twin, "classification").diag(X, y)
    close(H, ref_H)


def test_laplace_on_hf_bert_classifier():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=20,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=6,
        num_labels=C,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )

    class Logits(nn.Module):  # laplace's backends take a model that returns a tensor
        def __init__(self):
            super().__init__()
            self.bert = transformers.BertForSequenceClassification(config).eval()

        def forward(self, input_ids):
            return self.bert(input_ids).logits

    torch.manual_seed(1)
    model, twin = Logits(), Logits()
    twin.load_state_dict(model.state_dict())
    X, y = torch.randint(0, 20, (2, 6)), torch.randint(0, C, (2,))
    _, H = JacmemGGN(model, "classification").diag(X, y)
    _, ref_H = CurvlinopsGGN(twin, "classification").diag(X, y)
    close(H, ref_H)


def test_dict_like_inputs():
    """A model that takes a Hugging Face-style batch (laplace's ``dict_key_x``)."""

    class FromDict(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def forward(self, batch):
            return self.net(batch["input_ids"])

    torch.manual_seed(1)
    model = FromDict()
    twin = copy.deepcopy(model)
    X, y = {"input_ids": torch.randn(N, 4)}, torch.randint(0, C, (N,))
    ours, ref = JacmemGGN(model, "classification"), CurvlinopsGGN(twin, "classification")
    close(ours.diag(X, y)[1], ref.diag(X, y)[1])
    close(ours.jacobians(X)[0], ref.jacobians(X)[0])
    on_tensor = CurvlinopsGGN(twin.net, "classification")  # laplace's vmap'ed gradients take tensors only
    close(ours.gradients(X, y)[0], on_tensor.gradients(X["input_ids"], y)[0])


def test_subnetwork_indices():
    model, twin, X, y = case("mlp", "classification")
    idx = torch.tensor([0, 3, 7, 40])
    ours, ref = JacmemGGN(model, "classification", subnetwork_indices=idx), CurvlinopsGGN(twin, "classification")
    close(ours.diag(X, y)[1], ref.diag(X, y)[1][idx])
    close(ours.jacobians(X)[0], ref.jacobians(X)[0][..., idx])


class SinFeatures(nn.Module):
    """An MLP whose features pass through ``torch.sin``, a chain jacmem cannot follow
    (:class:`jacmem.ChainError`): last-layer Laplace must not need it to."""

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(4, 5), nn.Linear(5, C)

    def forward(self, x):
        return self.head(torch.sin(self.body(x)))


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
@pytest.mark.parametrize("likelihood", ["classification", "regression"])
def test_last_layer_laplace_matches_curvlinops(structure, likelihood):
    """laplace's default, ``subset_of_weights="last_layer"``: the curvature of the head
    on the features, equal to CurvlinopsGGN's, on a body jacmem could not extend."""
    torch.manual_seed(1)
    model = SinFeatures()
    twin = copy.deepcopy(model)
    X, y = torch.randn(N, 4), TARGETS[likelihood]()
    kwargs = dict(subset_of_weights="last_layer", hessian_structure=structure)
    la = Laplace(model, likelihood, backend=JacmemGGN, **kwargs)
    ref = Laplace(twin, likelihood, backend=CurvlinopsGGN, **kwargs)
    for lap in (la, ref):
        lap.fit(loader(X, y))
    H, ref_H = (la.H, ref.H) if structure != "kron" else (la.H.to_matrix(), ref.H.to_matrix())
    assert H.shape == ((C * 6, C * 6) if structure != "diag" else (C * 6,))
    close(H, ref_H)
    close(la.log_marginal_likelihood(), ref.log_marginal_likelihood())
    pred = dict(pred_type="glm") | (dict(link_approx="probit") if likelihood == "classification" else {})
    for got, want in zip(la(X, **pred), ref(X, **pred)):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)
    no_leftovers(model)


def test_last_layer_empirical_fisher():
    """JacmemEF on the head: ``diag`` is the diagonal of CurvlinopsEF's ``full``
    (laplace's own EF ``diag`` gives zeros on a last layer: its torch.func gradients
    name the head's parameters as the whole model's)."""
    torch.manual_seed(1)
    model = SinFeatures()
    X, y = torch.randn(N, 4), TARGETS["classification"]()
    features = FeatureExtractor(model, last_layer_name="head")
    twin = FeatureExtractor(copy.deepcopy(model), last_layer_name="head")
    _, ref_full = CurvlinopsEF(twin, "classification", last_layer=True).full(X, y)
    ours = JacmemEF(features, "classification", last_layer=True)
    close(ours.diag(X, y)[1], torch.diagonal(ref_full))
    close(ours.full(X, y)[1], ref_full)
    no_leftovers(model)


@pytest.mark.parametrize("structure", ["diag", "full"])
def test_subnetwork_laplace_matches_curvlinops(structure):
    model, twin, X, y = case("mlp", "classification")
    idx = torch.tensor([0, 3, 7, 21, 40, 42])
    kwargs = dict(subset_of_weights="subnetwork", hessian_structure=structure, subnetwork_indices=idx)
    la = Laplace(model, "classification", backend=JacmemGGN, **kwargs)
    ref = Laplace(twin, "classification", backend=CurvlinopsGGN, **kwargs)
    for lap in (la, ref):
        lap.fit(loader(X, y))
    close(la.H, ref.H)
    close(la.log_marginal_likelihood(), ref.log_marginal_likelihood())
    no_leftovers(model)


def test_refusals_name_the_fix():
    grouped = nn.Sequential(nn.Conv2d(2, 2, 3, groups=2), nn.Flatten(), nn.Linear(2 * 4 * 4, C))
    for backend in (JacmemGGN, JacmemEF):
        with pytest.raises(ValueError, match="0.weight is a grouped convolution"):
            backend(grouped, "classification").kron(torch.randn(2, 2, 6, 6), torch.tensor([0, 1]), N=2)
    no_leftovers(grouped)


def test_import_jacmem_does_not_import_laplace():
    code = "import sys, jacmem; assert 'laplace' not in sys.modules; import jacmem.laplace; assert 'laplace' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


#: a stand-in for laplace-torch's own tests (which ship in neither its wheel nor its sdist)
TINY_LAPLACE_TESTS = """
import pytest
import torch
from laplace import Laplace
from laplace.curvature import CurvlinopsEF, CurvlinopsGGN
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


@pytest.mark.parametrize("backend", [CurvlinopsGGN, CurvlinopsEF])
def test_kron_fit(backend):
    torch.manual_seed(0)
    X, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    la = Laplace(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), "classification",
                 hessian_structure="kron", backend=backend)
    la.fit(DataLoader(TensorDataset(X, y), batch_size=4))
    assert torch.isfinite(la.log_marginal_likelihood())


@pytest.mark.parametrize("backend", [CurvlinopsGGN])
def test_backend_is_curvlinops(backend):
    assert backend.__name__ == "CurvlinopsGGN"


def test_default_backend_is_curvlinops():
    la = Laplace(nn.Linear(3, 2), "classification", subset_of_weights="all", hessian_structure="diag")
    assert type(la.backend).__name__ == "CurvlinopsGGN"
"""


@pytest.mark.slow
def test_laplace_suite_swaps_the_backends(tmp_path):
    """tools/laplace_suite.py and its plugin (tests/support/laplace_swap.py) on a tiny
    clone: the swapped run fits with jacmem's backends, and a test that passes with
    curvlinops and fails with jacmem is reported, a parametrized one under its
    swapped id (laplace's default backend included)."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "__init__.py").touch()
    (tmp_path / "tests" / "test_tiny.py").write_text(TINY_LAPLACE_TESTS)
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, str(root / "tools" / "laplace_suite.py"), str(tmp_path)],
        check=True,
        capture_output=True,
        text=True,
    )
    assert run.stdout.splitlines() == [
        "curvlinops: 4 passed, 0 failed, 0 skipped",
        "jacmem: 2 passed, 2 failed, 0 skipped",
        "pass with curvlinops, fail with jacmem (2):",
        "  tests/test_tiny.py::test_backend_is_curvlinops[JacmemGGN]",
        "  tests/test_tiny.py::test_default_backend_is_curvlinops",
    ]
