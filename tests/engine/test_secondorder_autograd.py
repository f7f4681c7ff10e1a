"""The autograd path of the second-order engine (jacmem/engine/secondorder/autograd_path.py):
GGN diagonals and Kronecker factors of HF BERT, a timm ViT and a LLaMA block, written as
their libraries write them, against GGNs built with autograd alone (float64).

The reference (:func:`ggn_reference`) takes the Hessian of the loss w.r.t. the logits
with torch.func (the whole batch's, ``[N·D, N·D]``), its eigendecomposition, and pushes
each of its square-root columns through the model with one VJP at a time: the GGN
diagonal ``Σ_k (Jᵀ l_k)²``. Per sample, the same with sample ``n``'s diagonal block,
its columns laid on sample ``n`` alone.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from tests.support.secondorder_models import Block
from tests.support.secondorder_ref import blocks, dense, diagonals
from torch import Tensor, nn
from torch.func import hessian

import jacmem
from jacmem import KFAC, KFLR, BatchDiagGGNExact, BatchDiagGGNMC, DiagGGNExact, DiagGGNMC
from jacmem.engine.secondorder import autograd_path
from jacmem.engine.secondorder.autograd_path import AutogradPath
from jacmem.engine.secondorder.graph import ChainError

pytestmark = pytest.mark.usefixtures("float64_default")
transformers = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")

DT = torch.float64


def _columns(H: Tensor) -> Tensor:
    """``H [M, M]`` (PSD) -> its square root's columns ``[K, M]``."""
    lam, U = torch.linalg.eigh((H + H.T) / 2)
    keep = lam > lam.abs().max() * 1e-12
    return (U[:, keep] * lam[keep].sqrt()).T


def _squared_vjps(z: Tensor, params: dict, cols: Tensor) -> dict[str, Tensor]:
    out = {n: torch.zeros_like(p) for n, p in params.items()}
    for c in cols:
        gs = torch.autograd.grad(z, list(params.values()), c.reshape(z.shape), retain_graph=True, allow_unused=True)
        for n, g in zip(params, gs):
            if g is not None:
                out[n] += g.square()
    return out


def ggn_reference(model: nn.Module, forward, loss_of_z) -> tuple[dict, dict]:
    """``(diag, batch)``: the GGN diagonal per parameter, and per sample ``[N, *shape]``,
    for ``loss_of_z(forward())``, the GGN split at the logits ``forward()`` returns."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    z = forward()
    n, d = z.shape[0], z[0].numel()
    H = hessian(loss_of_z)(z.detach()).reshape(n * d, n * d)
    diag = _squared_vjps(z, params, _columns(H))
    batch = {name: torch.zeros(n, *p.shape) for name, p in params.items()}
    for i in range(n):
        block = _columns(H[i * d : (i + 1) * d, i * d : (i + 1) * d])
        cols = torch.zeros(block.shape[0], n, d)
        cols[:, i] = block
        for name, value in _squared_vjps(z, params, cols.flatten(1)).items():
            batch[name][i] = value
    return diag, batch


def check_diagonals(model, loss_fn, logits_fn, loss_of_z, missing=(), rtol=1e-7):
    """DiagGGNExact and BatchDiagGGNExact through the autograd path equal the reference;
    ``missing``: the parameters that get nothing (and no others), which the block names
    in a warning."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with jacmem.extend(DiagGGNExact(), BatchDiagGGNExact()):
            loss_fn().backward()
    unsaid = [name for name in missing if not any(f".{name}'" in str(w.message) for w in said)]
    assert not unsaid, f"no warning named {unsaid}"
    diag, batch = ggn_reference(model, logits_fn, loss_of_z)
    got = {n for n, p in model.named_parameters() if hasattr(p, "diag_ggn_exact")}
    assert got == set(diag) - set(missing)
    scale = max(float(d.abs().max()) for d in diag.values())  # key biases' curvature is 0: an absolute floor
    for name, p in model.named_parameters():
        if name in got:
            torch.testing.assert_close(p.diag_ggn_exact, diag[name], rtol=rtol, atol=rtol * scale, msg=name)
            torch.testing.assert_close(p.diag_ggn_exact_batch, batch[name], rtol=rtol, atol=rtol * scale, msg=name)


def check_kronecker(model, loss_fn):
    """KFAC/KFLR: symmetric PSD factors of the right sizes for every Linear, Conv and
    Embedding weight. The parameters they have no factors for (LLaMA's RMSNorm, a ViT's
    cls_token and pos_embed) are frozen: a backward that reaches them raises."""
    for module in model.modules():
        if not isinstance(module, (nn.Linear, nn.Conv2d, nn.Embedding, nn.LayerNorm)):
            for p in module.parameters(recurse=False):
                p.requires_grad_(False)
    with jacmem.extend(KFAC(), KFLR()):
        loss_fn().backward()
    seen = 0
    for module in model.modules():
        if not isinstance(module, (nn.Linear, nn.Conv2d, nn.Embedding)):
            continue
        w = module.weight
        for field in ("kfac", "kflr"):
            G, A = getattr(w, field)
            rows = w.shape[1] if isinstance(module, nn.Embedding) else w.shape[0]
            assert G.shape == (rows, rows)
            cols = w.shape[0] if isinstance(module, nn.Embedding) else w[0].numel()
            assert A.shape == ((cols,) if A.dim() == 1 else (cols, cols))
            for M in (G, A) if A.dim() == 2 else (G,):
                torch.testing.assert_close(M, M.T)
                assert float(torch.linalg.eigvalsh(M).min()) > -1e-10 * float(M.abs().max())
        seen += 1
    assert seen > 0


# -- a small functional MLP --------------------------------------------------------


class FunctionalMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.norm = nn.Linear(5, 6), nn.Linear(6, 4), nn.LayerNorm(6)

    def forward(self, x):
        h = F.gelu(self.a(x))
        return self.b(self.norm(h + torch.tanh(h)))


def test_functional_mlp_with_functional_loss():
    torch.manual_seed(0)
    model, X, y = FunctionalMLP(), torch.randn(3, 5), torch.tensor([0, 3, 1])
    check_diagonals(model, lambda: F.cross_entropy(model(X), y), lambda: model(X), lambda z: F.cross_entropy(z, y))


def test_loss_module_after_a_functional_op():
    torch.manual_seed(0)
    model, X, y = FunctionalMLP(), torch.randn(3, 5), torch.randn(3, 4)
    lossf = nn.MSELoss()
    check_diagonals(model, lambda: lossf(model(X), y), lambda: model(X), lambda z: lossf(z, y))


def test_mc_factors_average_to_the_exact_ggn():
    """DiagGGNMC's Gaussian draws are unbiased: many draws' mean nears the exact diagonal."""
    torch.manual_seed(0)
    model, X, y = FunctionalMLP(), torch.randn(3, 5), torch.tensor([0, 3, 1])
    with jacmem.extend(DiagGGNExact(), DiagGGNMC(mc_samples=4000), BatchDiagGGNMC(mc_samples=4000)):
        F.cross_entropy(model(X), y).backward()
    for p in model.parameters():
        scale = float(p.diag_ggn_exact.abs().max())
        torch.testing.assert_close(p.diag_ggn_mc, p.diag_ggn_exact, atol=0.1 * scale, rtol=0)
        torch.testing.assert_close(p.diag_ggn_mc_batch.sum(0), p.diag_ggn_mc)


class Gated(nn.Module):
    """A gate (a product of two tensors) breaks the module chain: the autograd path runs."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 6), nn.Linear(6, 4)

    def forward(self, x):
        h = self.a(x)
        return self.b(h * torch.sigmoid(h))


def _exact_diagonal(model, loss_fn) -> dict:
    with jacmem.extend(DiagGGNExact()):
        loss_fn().backward()
    return {n: p.diag_ggn_exact.clone() for n, p in model.named_parameters()}


def _no_hessian(monkeypatch) -> list:
    """Makes building the loss Hessian fail; returns the list of the sampler's answers."""
    sampler, seen = AutogradPath._sampler, []

    def refuse(*args):
        raise AssertionError("the loss Hessian was built")

    def spy(*args):
        seen.append(sampler(*args))
        return seen[-1]

    monkeypatch.setattr(AutogradPath, "_loss_factor", refuse)
    monkeypatch.setattr(AutogradPath, "_sampler", spy)
    return seen


@pytest.mark.parametrize("loss", ["cross_entropy", "cross_entropy_sum_doubled", "mse_module"])
def test_mc_samples_the_loss_labels_without_its_hessian(loss, monkeypatch):
    """One registered loss, times a factor, on the model's output: the Monte-Carlo kinds
    take the loss's own sampled factor (no Hessian is built) and average to the exact
    diagonal, per sample too."""
    torch.manual_seed(0)
    model, X = Gated(), torch.randn(3, 5)
    y, lossf = torch.tensor([0, 3, 1]), nn.MSELoss()
    fns = {
        "cross_entropy": lambda: F.cross_entropy(model(X), y),
        "cross_entropy_sum_doubled": lambda: 2 * F.cross_entropy(model(X), y, reduction="sum"),
        "mse_module": lambda: lossf(model(X), torch.randn(3, 4, generator=torch.Generator().manual_seed(1))),
    }
    exact = _exact_diagonal(model, fns[loss])
    seen = _no_hessian(monkeypatch)
    with jacmem.extend(DiagGGNMC(mc_samples=4000), BatchDiagGGNMC(mc_samples=4000)):
        fns[loss]().backward()
    assert len(seen) == 1 and seen[0] is not None  # the autograd path ran, and sampled
    for name, p in model.named_parameters():
        scale = float(exact[name].abs().max())
        torch.testing.assert_close(p.diag_ggn_mc, exact[name], atol=0.1 * scale, rtol=0, msg=name)
        torch.testing.assert_close(p.diag_ggn_mc_batch.sum(0), p.diag_ggn_mc)


def test_mc_of_two_losses_samples_their_hessian():
    """A sum of two losses has no one loss to sample labels from: the Monte-Carlo kinds
    sample the Hessian's factor, and still average to the exact diagonal."""
    torch.manual_seed(0)
    model, X, y, y2 = Gated(), torch.randn(3, 5), torch.tensor([0, 3, 1]), torch.tensor([2, 2, 0])

    def loss_fn():
        z = model(X)
        return F.cross_entropy(z, y) + F.cross_entropy(z, y2)

    exact = _exact_diagonal(model, loss_fn)
    with jacmem.extend(DiagGGNMC(mc_samples=4000)):
        loss_fn().backward()
    for name, p in model.named_parameters():
        scale = float(exact[name].abs().max())
        torch.testing.assert_close(p.diag_ggn_mc, exact[name], atol=0.1 * scale, rtol=0, msg=name)


def test_an_exact_hessian_out_of_reach_raises_before_the_work(monkeypatch):
    """The exact kinds need ``D`` columns per sample: past the limit, an error names the
    Monte-Carlo kinds before any Hessian-vector product."""
    torch.manual_seed(0)
    model, X, y = Gated(), torch.randn(3, 5), torch.tensor([0, 3, 1])
    monkeypatch.setattr(autograd_path, "_EXACT_BYTES", 3 * 4 * 4 * 4 - 1)
    monkeypatch.setattr(AutogradPath, "_gradient", None)  # the first product would fail otherwise
    with pytest.raises(RuntimeError, match=r"3x4x4 entries.*DiagGGNMC, KFAC"), jacmem.extend(DiagGGNExact()):
        F.cross_entropy(model(X), y).backward()


# -- HF BERT, timm ViT, a LLaMA block --------------------------------------------------

V, T = 32, 4


def bert() -> nn.Module:
    config = transformers.BertConfig(
        num_hidden_layers=1, hidden_size=8, num_attention_heads=2, intermediate_size=12, vocab_size=V,
        max_position_embeddings=8, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config).to(DT).eval()


def llama() -> nn.Module:
    config = transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=8, num_attention_heads=2, num_key_value_heads=1, intermediate_size=12,
        vocab_size=V, max_position_embeddings=8, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).to(DT).eval()


def vit() -> nn.Module:
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=8, num_classes=3, depth=1,
        embed_dim=32, num_heads=2,
    )  # fmt: skip
    return model.to(DT).eval()


@pytest.mark.parametrize("labels", [False, True], ids=["F.cross_entropy", "labels="])
def test_bert_classifier(labels):
    torch.manual_seed(0)
    model, ids, y = bert(), torch.randint(0, V, (3, T)), torch.tensor([0, 2, 1])
    logits = lambda: model(ids).logits  # noqa: E731
    loss = (lambda: model(ids, labels=y).loss) if labels else (lambda: F.cross_entropy(logits(), y))
    check_diagonals(model, loss, logits, lambda z: F.cross_entropy(z, y))


@pytest.mark.filterwarnings("ignore:.*recomputed with torch.func")
def test_vit():
    """The ViT's own cls_token and pos_embed (parameters of a module with submodules,
    read in its own forward) get their diagonals by the generic recomputation, as in first
    order (they used to get nothing, beside a warning); every layer's parameters get theirs."""
    torch.manual_seed(0)
    model, X, y = vit(), torch.randn(2, 3, 16, 16), torch.tensor([0, 2])
    check_diagonals(model, lambda: F.cross_entropy(model(X), y), lambda: model(X), lambda z: F.cross_entropy(z, y))


def _causal_lm_loss(z: Tensor, ids: Tensor) -> Tensor:
    """HF's shifted causal-LM loss, written out: token t predicts token t + 1."""
    return F.cross_entropy(z[:, :-1].reshape(-1, z.shape[-1]), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("labels", [False, True], ids=["F.cross_entropy", "labels="])
def test_llama_sequence_ggn_is_exact(labels):
    """The GGN of a sequence sample is Σ_t J_tᵀ H_t J_t: the reference's Hessian is the
    whole [N·T·C]² one, so cross-token terms would show. HF's loss (``labels=``) runs in
    float32 (``logits.float()``), hence its tolerance."""
    torch.manual_seed(0)
    model, ids = llama(), torch.randint(0, V, (2, T))
    logits = lambda: model(ids).logits  # noqa: E731
    loss = (lambda: model(ids, labels=ids).loss) if labels else (lambda: _causal_lm_loss(logits(), ids))
    check_diagonals(model, loss, logits, lambda z: _causal_lm_loss(z, ids), rtol=1e-5 if labels else 1e-7)


@pytest.mark.parametrize("make", [bert, vit, llama])
def test_kronecker_factors_on_transformers(make):
    torch.manual_seed(0)
    model = make()
    if make is vit:
        X, y = torch.randn(2, 3, 16, 16), torch.tensor([0, 2])
        check_kronecker(model, lambda: F.cross_entropy(model(X), y))
    elif make is bert:
        ids, y = torch.randint(0, V, (3, T)), torch.tensor([0, 2, 1])
        check_kronecker(model, lambda: model(ids, labels=y).loss)
    else:
        ids = torch.randint(0, V, (2, T))
        check_kronecker(model, lambda: model(ids, labels=ids).loss)


# -- where the chain breaks, the GGN-type extensions are now exact ------------------


@pytest.mark.parametrize("op", [F.relu, torch.tanh, lambda h: h * 2], ids=["F.relu", "torch.tanh", "times2"])
def test_functional_ops_on_a_branch_are_exact(op):
    """The blocks on which the chain raises (test_secondorder_chain.py), against the dense
    GGN of secondorder_ref (torch.func.jacrev)."""
    torch.manual_seed(4)
    model, lossf = Block(op, functional_sum=True), nn.CrossEntropyLoss()
    X, y = torch.randn(3, 4), torch.randint(0, 3, (3,))
    with jacmem.extend(DiagGGNExact(), BatchDiagGGNExact()):
        lossf(model(X), y).backward()
    ggn, ggn_n = dense(model, lossf, X, y)[0], dense(model, lossf, X, y, per_sample=True)[0]
    ref, ref_n = diagonals(model, ggn), diagonals(model, ggn_n)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, ref[name], msg=name)
        torch.testing.assert_close(p.diag_ggn_exact_batch, ref_n[name], msg=name)


def test_kflr_is_the_exact_ggn_block_for_one_sample():
    """With one sample and 2d Linear inputs, G ⊗ A is the GGN block (Botev et al. 2017)."""
    torch.manual_seed(5)
    model, lossf = Block(F.relu, functional_sum=True), nn.CrossEntropyLoss()
    X, y = torch.randn(1, 4), torch.randint(0, 3, (1,))
    with jacmem.extend(KFLR()):
        lossf(model(X), y).backward()
    ref = blocks(model, dense(model, lossf, X, y)[0])
    for name, p in model.named_parameters():
        got = torch.kron(*p.kflr) if name.endswith("weight") else p.kflr[0]
        torch.testing.assert_close(got, ref[name], msg=name)


def test_a_loss_linear_in_the_output_has_a_zero_ggn():
    torch.manual_seed(0)
    model, X = FunctionalMLP(), torch.randn(3, 5)
    with jacmem.extend(DiagGGNExact(), BatchDiagGGNExact()):
        (2 * model(X)).sum().backward()
    for p in model.parameters():
        assert torch.equal(p.diag_ggn_exact, torch.zeros_like(p))
        assert p.diag_ggn_exact_batch.shape == (3, *p.shape) and not p.diag_ggn_exact_batch.any()


# -- refusals ---------------------------------------------------------------------


def test_a_loss_term_on_hidden_states_raises():
    """A penalty on a hidden layer's output reaches the loss other than through the
    logits: the GGN split there is not the loss's; refused, and nothing is written."""
    torch.manual_seed(0)
    model, X, y = FunctionalMLP(), torch.randn(3, 5), torch.tensor([0, 3, 1])
    with pytest.raises(ChainError, match="module .*\\(Linear\\) reaches the loss"):
        with jacmem.extend(DiagGGNExact()):
            h = model.a(X)
            z = model.b(model.norm(F.gelu(h)))
            (F.cross_entropy(z, y) + h.square().mean()).backward()
    assert not any(hasattr(p, "diag_ggn_exact") for p in model.parameters())


@pytest.mark.parametrize("ext", [DiagGGNExact, KFLR])
def test_a_loss_target_made_by_the_model_raises(ext):
    """The loss's target needs a gradient (a hidden layer's output): that layer's
    output reaches the loss other than through the loss's input, where the GGN splits;
    refused."""
    torch.manual_seed(0)
    model, X = FunctionalMLP(), torch.randn(3, 5)
    with pytest.raises((ChainError, NotImplementedError), match="comes from tracked modules|reaches the loss"):
        with jacmem.extend(ext()):
            h = model.a(X)
            z = model.b(model.norm(F.gelu(h)))
            F.mse_loss(z, torch.tanh(h[:, :4])).backward()


@pytest.mark.parametrize(
    "target", ["batch_mean", "own_softmax"], ids=["target_couples_the_samples", "target_curves_in_z"]
)
@pytest.mark.parametrize("ext", [DiagGGNExact, DiagGGNMC, KFAC])
def test_a_loss_whose_target_has_a_gradient_is_not_sampled_as_a_loss(ext, target):
    """A loss whose target depends on its input by untracked ops (the batch's mean, a
    self-distillation target softmax(2z)) is not a loss of its input alone: its Hessian
    there misses the target's path. The Monte-Carlo kinds sampled its labels all the
    same (DiagGGNMC 150% off, no error) where the exact kind refused; now every kind
    takes the root's Hessian at the model's output and its checks: the batch's mean
    couples the samples, softmax(2z) is not convex in z."""
    torch.manual_seed(0)
    model, X = FunctionalMLP(), torch.randn(3, 5)
    targets = {
        "batch_mean": (lambda z: z.mean(0, keepdim=True).expand_as(z), F.mse_loss, "couples the samples"),
        "own_softmax": (lambda z: torch.softmax(2 * z, 1), F.cross_entropy, "not convex"),
    }
    make, lossf, match = targets[target]
    with pytest.raises(ChainError, match=match):
        with jacmem.extend(ext()):
            z = model(X)
            lossf(z, make(z)).backward()


def test_a_per_sample_loss_whose_target_is_part_of_the_output_is_exact():
    """``F.mse_loss(z[:, :2], z[:, 2:])``: the GGN splits at the model's output, where
    the loss is per sample and convex: DiagGGNExact and BatchDiagGGNExact are exact."""
    torch.manual_seed(0)
    model, X = FunctionalMLP(), torch.randn(3, 5)

    def loss_of_z(z):
        return F.mse_loss(z[:, :2], z[:, 2:])

    check_diagonals(model, lambda: loss_of_z(model(X)), lambda: model(X), loss_of_z)


def test_the_gradient_check_is_skipped_only_where_the_loss_takes_nothing_else():
    """Where the loss's graph takes only its input ``z`` (and tensors with no gradient),
    every gradient passes through ``z`` and the check's own backward is skipped; a
    target with a gradient keeps it."""
    from jacmem.engine.secondorder.autograd_path import _only_through

    model, X, y = FunctionalMLP(), torch.randn(3, 5), torch.tensor([0, 3, 1])
    z = model(X)
    edge = torch.autograd.graph.get_gradient_edge
    assert _only_through(edge(F.cross_entropy(z, y)), edge(z))
    assert _only_through(edge(F.cross_entropy(z[:, 1:].float() / 2, y.clamp(max=2))), edge(z))
    assert not _only_through(edge(F.mse_loss(z, model.a(X)[:, :4])), edge(z))
    assert not _only_through(edge(F.cross_entropy(z + model.b.bias, y)), edge(z))


def test_a_loss_coupling_samples_raises():
    torch.manual_seed(0)
    model, X = FunctionalMLP(), torch.randn(3, 5)
    with pytest.raises(ChainError, match="couples the samples"):
        with jacmem.extend(DiagGGNExact()):
            model(X).sum(0).square().sum().backward()


def test_a_loss_not_convex_in_the_output_raises():
    torch.manual_seed(0)
    model, X = FunctionalMLP(), torch.randn(3, 5)
    with pytest.raises(ChainError, match="not convex"):
        with jacmem.extend(DiagGGNExact()):
            torch.cos(model(X)).sum().backward()


def test_tokens_flattened_into_the_batch_raise():
    torch.manual_seed(0)
    lin, head = nn.Linear(5, 6), nn.Linear(6 * 4, 3)
    X, y = torch.randn(2, 4, 5), torch.tensor([0, 2])
    with pytest.raises(ChainError, match="module 'Linear' \\(Linear\\) has 8 rows where the model's output has 2"):
        with jacmem.extend(DiagGGNExact()):
            h = F.gelu(lin(X.reshape(8, 5)))
            F.cross_entropy(head(h.reshape(2, 24)), y).backward()


def test_first_order_extensions_beside_the_autograd_path_raise():
    torch.manual_seed(0)
    model, X, y = FunctionalMLP(), torch.randn(3, 5), torch.tensor([0, 3, 1])
    with pytest.raises(NotImplementedError, match="separate block"):
        with jacmem.extend(DiagGGNExact(), jacmem.BatchGrad()):  # torch.sin: not in the chain
            F.cross_entropy(model.b(model.norm(torch.sin(model.a(X)))), y).backward()
