"""Monte-Carlo curvature of HF GPT-2 on its own shifted LM loss (``labels=ids``, the
functional cross-entropy with ``ignore_index``), through the autograd path: one VJP
per MC sample at any vocabulary (jacmem/engine/secondorder/autograd_path.py).

* with the labels the engine draws (the same seed), DiagGGNMC and BatchDiagGGNMC equal
  the squared per-sample gradients of the loss at those labels, built with autograd;
  ignored positions contribute nothing;
* DiagGGNMC converges to DiagGGNExact, its error shrinking as ``1/√M``;
* at GPT-2's real vocabulary nothing of size ``T·V × T·V`` is allocated, and the exact
  kinds refuse, naming the Monte-Carlo ones, before any work.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.support.allocations import Allocations

import jacmem
from jacmem import KFAC, BatchDiagGGNMC, DiagGGNExact, DiagGGNMC
from jacmem.derivatives.losses import categorical

pytestmark = pytest.mark.usefixtures("float64_default")
transformers = pytest.importorskip("transformers")

N, T, SEED = 3, 5, 7


def _gpt2(v: int, d: int = 8):
    config = transformers.GPT2Config(
        n_layer=2, n_embd=d, n_head=2, vocab_size=v, n_positions=T, bos_token_id=0, eos_token_id=0,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def _ids(v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[N, T]`` and labels with two ignored positions."""
    torch.manual_seed(1)
    ids = torch.randint(v, (N, T))
    labels = ids.clone()
    labels[0, 2] = labels[2, 4] = -100
    return ids, labels


def _params(model) -> dict:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _drawn(model, ids, labels, v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logits [N, T, V], drawn labels [N, T], keep [N, T])``: the engine's draw
    ``ŷ ~ softmax(logits)`` (one per position, under :data:`SEED`; its distribution is
    what the convergence test checks), on HF's float32 logits,
    ``-100`` where HF's shifted labels are ignored."""
    logits = model(ids).logits  # HF's loss pairs position t with label t + 1
    keep = F.pad(labels, (0, 1), value=-100)[:, 1:] != -100
    torch.manual_seed(SEED)
    draws = categorical(logits.detach().float().softmax(-1).reshape(-1, v), 1).reshape(N, T)
    return logits, torch.where(keep, draws, -100), keep


@pytest.mark.parametrize("count", [None, 4.0], ids=["mean", "sum-over-count"])
def test_diag_ggn_mc_equals_the_gradients_at_the_drawn_labels(count):
    """Its GGN diagonal is ``Σ_n g_n² / c``, ``g_n`` the gradient of sample ``n``'s
    summed cross-entropy at ``ŷ`` over the non-ignored positions, ``c`` the number of
    those (the mean) or HF's ``num_items_in_batch`` (a sum divided by it)."""
    v = 11
    model, (ids, labels) = _gpt2(v), _ids(v)
    extra = {} if count is None else {"num_items_in_batch": torch.tensor(count)}
    with jacmem.extend(DiagGGNMC(mc_samples=1), BatchDiagGGNMC(mc_samples=1)):
        loss = model(ids, labels=labels, **extra).loss
        torch.manual_seed(SEED)
        loss.backward()
    params = _params(model)
    logits, drawn, keep = _drawn(model, ids, labels, v)
    c = keep.sum() if count is None else count
    batch = {name: torch.zeros(N, *p.shape) for name, p in params.items()}
    for n in range(N):
        ce = F.cross_entropy(logits[n], drawn[n], reduction="sum")
        for name, g in zip(params, torch.autograd.grad(ce, list(params.values()), retain_graph=True)):
            batch[name][n] = g.square() / c
    for name, p in params.items():
        torch.testing.assert_close(p.diag_ggn_mc_batch, batch[name], msg=name)
        torch.testing.assert_close(p.diag_ggn_mc, batch[name].sum(0), msg=name)


def test_kfac_of_the_head_equals_its_factors_at_the_drawn_labels():
    """The LM head's KFAC (``"expand"``): ``A = Σ_{n,t} a aᵀ / (N·T)`` from its inputs,
    ``G = Σ_{n,t} s sᵀ`` from the roots ``s = (softmax − onehot(ŷ)) / √c``, zero at the
    ignored positions."""
    v = 11
    model, (ids, labels) = _gpt2(v), _ids(v)
    with jacmem.extend(KFAC()):
        loss = model(ids, labels=labels).loss
        torch.manual_seed(SEED)
        loss.backward()
    logits, drawn, keep = _drawn(model, ids, labels, v)
    a = model.transformer(ids).last_hidden_state.detach().reshape(N * T, -1)
    s = (logits.detach().softmax(-1) - F.one_hot(drawn.clamp(min=0), v)) * keep[..., None] / keep.sum().sqrt()
    s = s.reshape(N * T, v)
    G, A = model.lm_head.weight.kfac
    torch.testing.assert_close(A, a.T @ a / (N * T))
    torch.testing.assert_close(G, s.T @ s)


def _error(model, ids, labels, exact: dict, m: int) -> float:
    with jacmem.extend(DiagGGNMC(mc_samples=m)):
        model(ids, labels=labels).loss.backward()
    num = sum(float((p.diag_ggn_mc - exact[n]).square().sum()) for n, p in _params(model).items())
    return (num / sum(float(e.square().sum()) for e in exact.values())) ** 0.5


def test_diag_ggn_mc_converges_to_the_exact_diagonal():
    """The relative error shrinks as ``1/√M``: 16 times fewer at 256 times the samples
    (asked: at least 5 times; a biased estimator's error stops shrinking)."""
    v = 7
    model, (ids, labels) = _gpt2(v), _ids(v)
    with jacmem.extend(DiagGGNExact()):
        model(ids, labels=labels).loss.backward()
    exact = {n: p.diag_ggn_exact.clone() for n, p in _params(model).items()}
    torch.manual_seed(SEED)
    few = sum(_error(model, ids, labels, exact, 2) for _ in range(4)) / 4
    many = _error(model, ids, labels, exact, 512)
    assert many < few / 5, (few, many)
    assert many < 0.1, many


def test_gpt2_vocabulary_mc_allocates_no_hessian_and_exact_refuses():
    """V = 50257: DiagGGNMC allocates nothing near ``[T·V, T·V]`` (the factor itself,
    ``[M, N, T, V]``, is the largest, with the softmax); DiagGGNExact raises first."""
    v = 50257
    model, (ids, labels) = _gpt2(v, d=4), _ids(v)
    model.float()
    with Allocations(limit=8 * N * T * v) as watch, jacmem.extend(DiagGGNMC()):
        model(ids, labels=labels).loss.backward()
    assert watch.large == []
    assert all(p.diag_ggn_mc.isfinite().all() for p in _params(model).values())
    with pytest.raises(RuntimeError, match="DiagGGNMC, KFAC"), jacmem.extend(DiagGGNExact()):
        model(ids, labels=labels).loss.backward()
