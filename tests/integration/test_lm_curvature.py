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
from jacmem import BatchDiagGGNMC, DiagGGNExact, DiagGGNMC

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


def test_diag_ggn_mc_equals_the_gradients_at_the_drawn_labels():
    """The engine's draw ``ŷ ~ softmax(logits)`` (one per position, ``torch.multinomial``
    under the same seed): its GGN diagonal is ``Σ_n g_n² / terms``, ``g_n`` the gradient
    of sample ``n``'s summed cross-entropy at ``ŷ`` over the non-ignored positions."""
    v = 11
    model, (ids, labels) = _gpt2(v), _ids(v)
    with jacmem.extend(DiagGGNMC(mc_samples=1), BatchDiagGGNMC(mc_samples=1)):
        loss = model(ids, labels=labels).loss
        torch.manual_seed(SEED)
        loss.backward()
    params = _params(model)
    logits = model(ids).logits  # [N, T, V]; HF's loss pairs position t with label t + 1
    target = F.pad(labels, (0, 1), value=-100)[:, 1:]
    keep = target != -100
    torch.manual_seed(SEED)
    draws = torch.multinomial(logits.detach().softmax(-1).reshape(-1, v), 1, replacement=True).reshape(N, T)
    drawn = torch.where(keep, draws, -100)
    terms = keep.sum()
    batch = {name: torch.zeros(N, *p.shape) for name, p in params.items()}
    for n in range(N):
        ce = F.cross_entropy(logits[n], drawn[n], reduction="sum")
        for name, g in zip(params, torch.autograd.grad(ce, list(params.values()), retain_graph=True)):
            batch[name][n] = g.square() / terms
    for name, p in params.items():
        torch.testing.assert_close(p.diag_ggn_mc_batch, batch[name], msg=name)
        torch.testing.assert_close(p.diag_ggn_mc, batch[name].sum(0), msg=name)


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
