"""EKFAC (eigenvalue-corrected KFAC, George et al. 2018): the bases are eigenbases of
the Kronecker factors from the same block (KFAC, KFLR, KFACEF: tested against curvlinops
in test_secondorder_kfac_transformers.py); the corrected eigenvalues, in float64, against

* ``fisher="exact"``: the diagonal of the exact GGN block (torch.func,
  tests/support/secondorder_ref.py) in the Kronecker eigenbasis, for Linear on
  sequences and Embedding (the module chain), and for every Linear, HF Conv1D and
  Embedding of untied GPT-2 and BERT (the autograd path), whole and in slices;
* ``fisher="empirical"``: a per-sample autograd loop's gradients, rotated into the
  basis, for every Linear, HF Conv1D and Embedding of untied GPT-2, BERT and LLaMA (the
  autograd path), and curvlinops' EKFACLinearOperator on the BERT classifier;
* ``fisher="mc"``: the trace that the rotation keeps, ``Σ Λ`` = the sum of DiagGGNMC's
  diagonal from the same sampled roots, whole and in slices.

The position (and BERT's token type) embeddings of default ``[1, T]`` ids, which the
batch shares, are trained in the language models' tests.
"""

from __future__ import annotations

from math import sqrt

import pytest
import torch
from tests.support.secondorder_ref import blocks, dense, freeze, run
from torch import nn
from torch.func import functional_call, hessian, jacrev

import jacmem
from jacmem import EKFAC, KFAC, KFACEF, KFLR, DiagGGNMC, UnsupportedCurvatureError

DT = torch.float64


def _check_basis(U, M):
    """``U`` is orthonormal and diagonalises the factor ``M``."""
    torch.testing.assert_close(U.T @ U, torch.eye(len(U), dtype=DT))
    D = U.T @ M @ U
    torch.testing.assert_close(
        D - torch.diag(torch.diagonal(D)), torch.zeros_like(D), atol=1e-12 * float(M.abs().max()), rtol=0
    )


def _seq_model():
    """Embedding -> Linear on [N, T, ·] -> Tanh -> Linear, a loss per position."""
    return nn.Sequential(nn.Embedding(7, 4), nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)


@pytest.mark.parametrize("approx", [None, "expand"])
def test_exact_is_the_ggn_diagonal_in_the_kronecker_eigenbasis(approx):
    """``fisher="exact"``: ``Λ[i, j] = (u_i ⊗ u_j)ᵀ B (u_i ⊗ u_j)`` with ``B`` the exact GGN
    block of the weight (of ``weight.T`` for the Embedding, whose ``U_A`` is the identity,
    ``None``) and ``U_G``, ``U_A`` eigenbases of KFLR's factors; a bias's ``Λ`` likewise."""
    torch.manual_seed(0)
    model = _seq_model()
    X, y = torch.randint(0, 7, (3, 4)), torch.randn(3, 4, 3, dtype=DT)
    run(model, nn.MSELoss(), X, y, EKFAC("exact", kfac_approx=approx), KFLR(approx))
    ref = blocks(model, dense(model, nn.MSELoss(), X, y)[0])
    for name, p in model.named_parameters():
        got, factors = p.ekfac, p.kflr
        U_G = got[0]
        _check_basis(U_G, factors[0])
        if name.endswith("bias"):
            torch.testing.assert_close(got[1], torch.diagonal(U_G.T @ ref[name] @ U_G), msg=name)
            continue
        U_G, U_A, lam = got
        B = ref[name]
        if name == "0.weight":  # the Embedding: the block of weight.T, A diagonal
            assert U_A is None
            idx = torch.arange(28).reshape(7, 4).T.flatten()
            B, U_A = B[idx][:, idx], torch.eye(7, dtype=DT)
        else:
            _check_basis(U_A, factors[1])
        U = torch.kron(U_G, U_A)
        torch.testing.assert_close(lam, torch.diagonal(U.T @ B @ U).reshape(lam.shape), msg=name)


@pytest.mark.parametrize("model_name", ["seq", "gpt2"])
def test_mc_keeps_the_trace_of_its_roots(model_name):
    """``fisher="mc"``, with KFAC and DiagGGNMC in the block (one set of sampled roots):
    the bases diagonalise KFAC's factors, and ``Σ Λ`` (the rotation keeps the Frobenius
    norm of every per-sample gradient) is the sum of DiagGGNMC's diagonal, per parameter;
    on the module chain, and on GPT-2 (the autograd path) with a ``chunk_bytes`` that
    slices the roots (the bases are then all the slices', the correction summed)."""
    from tests.extensions.test_secondorder_kfac_transformers import _lm

    torch.manual_seed(1)
    if model_name == "seq":
        model, lossf = _seq_model(), nn.MSELoss()
        X, y = torch.randint(0, 7, (3, 4)), torch.randn(3, 4, 3, dtype=DT)
    else:
        (model, X, y), lossf = _lm("gpt2"), nn.CrossEntropyLoss()
    with jacmem.extend(EKFAC(mc_samples=3), KFAC(3), DiagGGNMC(3), chunk_bytes=4096):
        lossf(model(X), y).backward()
    for name, p in model.named_parameters():
        if len(p.ekfac) == 1:  # LayerNorm: KFAC's diagonal
            torch.testing.assert_close(p.ekfac[0], p.kfac[0], msg=name)
        else:
            _check_basis(p.ekfac[0], p.kfac[0])
        torch.testing.assert_close(p.ekfac[-1].sum(), p.diag_ggn_mc.sum(), msg=name)


def _per_sample_grads(model, X, y, per_token: bool) -> dict[str, torch.Tensor]:
    """Each sample's gradient of its summed loss terms, by a loop: name -> [N, *shape]."""
    lossf = nn.CrossEntropyLoss(reduction="sum")
    out = {n: [] for n, p in model.named_parameters() if p.requires_grad}
    for n in range(X.shape[0]):
        model.zero_grad()
        lossf(model(X[n : n + 1]), y[n : n + 1]).backward()
        for name, p in model.named_parameters():
            if p.requires_grad:
                out[name].append(p.grad.clone())
    return {name: torch.stack(g) for name, g in out.items()}


#: the embeddings of default position (and token type) ids, ``[1, T]``, that the batch shares
SHARED = {
    "gpt2": ("model.transformer.wpe",),
    "bert": ("model.bert.embeddings.position_embeddings", "model.bert.embeddings.token_type_embeddings"),
    "llama": (),
}


@pytest.mark.parametrize("name", sorted(SHARED))
def test_empirical_on_language_models_equals_a_per_sample_loop(name):
    """``fisher="empirical"`` on untied GPT-2 (HF Conv1D), BERT and LLaMA: the bases
    diagonalise KFACEF's factors, and ``Λ = Σ_n (U_Gᵀ Ĝ_n U_A)²`` with ``Ĝ_n`` sample
    ``n``'s gradient (of ``weight.T`` for Conv1D and Embedding) ``/ √K``, ``K`` the loss's
    terms, from a per-sample autograd loop; every Linear, Conv1D and token Embedding and
    their biases, the position (and BERT's token type) embeddings of default ids, which
    the batch shares, included: their ``Ĝ_n`` sums over sample ``n``'s uses."""
    from tests.extensions.test_secondorder_kfac_transformers import _lm
    from transformers.pytorch_utils import Conv1D

    model, X, y = _lm(name)
    per_token = name != "bert"
    K = X.numel() if per_token else X.shape[0]
    freeze(model, "LlamaRMSNorm")
    run(model, nn.CrossEntropyLoss(), X, y, EKFAC("empirical"), KFACEF())
    grads = _per_sample_grads(model, X, y, per_token)
    rtol = 1e-6 if name == "llama" else 1e-10  # LlamaRMSNorm computes in float32
    checked = 0
    for module_name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, Conv1D, nn.Embedding)) or not module.weight.requires_grad:
            continue
        W = module.weight
        U_G, U_A, lam = W.ekfac
        G, A = W.kfac_ef
        _check_basis(U_G, G)
        g = grads[f"{module_name}.weight"] / sqrt(K)
        if isinstance(module, (Conv1D, nn.Embedding)):
            g = g.transpose(1, 2)
        if U_A is None:
            assert A.dim() == 1
        else:
            _check_basis(U_A, A)
            g = g @ U_A
        ref = (U_G.T @ g).square().sum(0)
        torch.testing.assert_close(lam, ref, rtol=rtol, atol=rtol * float(ref.abs().max()), msg=module_name)
        if module_name.endswith("lm_head") or getattr(module, "bias", None) is None:
            checked += 1
            continue
        g_b = grads[f"{module_name}.bias"] / sqrt(K)
        ref_b = (g_b @ U_G).square().sum(0)
        # up to rounding relative to the weight's: a key projection's bias has no gradient
        torch.testing.assert_close(module.bias.ekfac[1], ref_b, rtol=rtol, atol=rtol * float(ref.abs().max()))
        checked += 1
    assert checked >= 5 + len(SHARED[name])


def _weights(model):
    """(name, module) of every Linear, HF Conv1D and Embedding with a trainable weight."""
    from transformers.pytorch_utils import Conv1D

    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, (nn.Linear, Conv1D, nn.Embedding)) and m.weight.requires_grad
    ]


@pytest.mark.parametrize(
    ("name", "trainable", "chunk_bytes"),
    [("gpt2", "all", None), ("gpt2", "all", 4096), ("bert", "all", 4096), ("gpt2", "shared", None),
     ("bert", "shared", 4096)],
)  # fmt: skip
def test_exact_on_language_models_is_the_ggn_diagonal(name, trainable, chunk_bytes):
    """``fisher="exact"`` on untied GPT-2 and BERT, every Linear, Conv1D and Embedding, or
    only the embeddings that the batch shares (HF's default ``[1, T]`` position ids, BERT's
    token type ids): ``Λ`` is the diagonal of the exact GGN block of the weight (of
    ``weight.T`` for Conv1D and Embedding; ``J`` by torch.func's ``jacrev``, the loss
    Hessian at the logits by its ``hessian``) in the eigenbasis of KFLR's factors; with a
    small ``chunk_bytes`` the roots come in slices, and the bases are still all of them's."""
    from tests.extensions.test_secondorder_kfac_transformers import _lm
    from transformers.pytorch_utils import Conv1D

    model, X, y = _lm(name)
    if trainable == "shared":
        for p in model.parameters():
            p.requires_grad_(False)
        for shared in SHARED[name]:
            model.get_submodule(shared).weight.requires_grad_(True)
    with jacmem.extend(EKFAC("exact"), KFLR(), **({} if chunk_bytes is None else {"chunk_bytes": chunk_bytes})):
        nn.CrossEntropyLoss()(model(X), y).backward()
    z = model(X).detach()
    Hz = hessian(lambda z: nn.functional.cross_entropy(z, y))(z).reshape(z.numel(), z.numel())
    checked = 0
    for module_name, module in _weights(model):
        W = module.weight
        J = jacrev(lambda w: functional_call(model, {f"{module_name}.weight": w}, (X,)))(W.detach())
        J = J.reshape(z.numel(), W.numel())
        ggn = (J.T @ Hz @ J).detach()  # the GGN block of vec(weight): no double backward through attention
        U_G, U_A, lam = W.ekfac
        G, A = W.kflr
        _check_basis(U_G, G)
        if isinstance(module, (Conv1D, nn.Embedding)):  # vec(weight) -> vec(weight.T)
            idx = torch.arange(W.numel()).reshape(W.shape).T.flatten()
            ggn = ggn[idx][:, idx]
        if U_A is None:
            U_A = torch.eye(lam.shape[1], dtype=DT)
        else:
            _check_basis(U_A, A)
        U = torch.kron(U_G, U_A)
        want = torch.diagonal(U.T @ ggn @ U).reshape(lam.shape)
        torch.testing.assert_close(lam, want, atol=1e-10 * float(want.abs().max()), rtol=1e-8, msg=module_name)
        checked += 1
    assert checked >= (len(SHARED[name]) if trainable == "shared" else 7)


def test_refusals():
    """A convolution: the backward raises before any result, naming it and the fix;
    frozen, the other layers' results as usual; a bad ``fisher``: ValueError."""
    torch.manual_seed(2)
    cnn = nn.Sequential(nn.Conv2d(2, 3, 2), nn.Flatten(), nn.Linear(12, 3)).to(DT)
    X, y = torch.randn(2, 2, 3, 3, dtype=DT), torch.tensor([0, 2])
    msg = r"'(weight|bias)' of module '0' \(Conv2d\).*no eigenvalue correction for Conv2d \(module '0'\).*use KFAC"
    with pytest.raises(UnsupportedCurvatureError, match=msg):
        run(cnn, nn.CrossEntropyLoss(), X, y, EKFAC("exact"))
    assert not any(hasattr(p, "ekfac") for p in cnn.parameters())
    cnn[0].requires_grad_(False)
    run(cnn, nn.CrossEntropyLoss(), X, y, EKFAC("exact"))
    assert not hasattr(cnn[0].weight, "ekfac") and cnn[2].weight.ekfac[2].shape == (3, 12)
    with pytest.raises(ValueError, match="fisher must be one of"):
        EKFAC("type-2")
    assert repr(EKFAC()) == "EKFAC(fisher='mc', mc_samples=1)"
    assert repr(EKFAC("empirical", kfac_approx="reduce")) == "EKFAC(fisher='empirical', kfac_approx='reduce')"


def test_empirical_on_bert_equals_curvlinops():
    """``fisher="empirical"`` on the BERT classifier (one loss term per sample: curvlinops'
    EKFAC takes 2d outputs only): every Linear's ``Λ`` equals curvlinops'
    ``EKFACLinearOperator(fisher_type="empirical")``'s, whose two passes over one batch
    are jacmem's one (the embeddings frozen: curvlinops has no Embedding)."""
    from curvlinops import EKFACLinearOperator
    from tests.extensions.test_secondorder_kfac_transformers import _lm

    model, X, y = _lm("bert")
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            m.weight.requires_grad_(False)
    params = [p for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()]
    op = EKFACLinearOperator(
        model, nn.CrossEntropyLoss(), params, [(X, y)], fisher_type="empirical", check_deterministic=False
    )
    op.compute_eigenvalue_correction()
    run(model, nn.CrossEntropyLoss(), X, y, EKFAC("empirical"))
    assert len(op._corrected_eigenvalues) == 14
    for name, ref in op._corrected_eigenvalues.items():
        weight, bias = sorted(ref.values(), key=lambda t: -t.dim())
        module = model.get_submodule(name)
        torch.testing.assert_close(module.weight.ekfac[2], weight, msg=name)
        torch.testing.assert_close(module.bias.ekfac[1], bias, atol=1e-12 * float(weight.abs().max()), rtol=1e-10)
