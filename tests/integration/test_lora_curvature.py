"""Curvature over LoRA adapters with the base and the head frozen (the Laplace-LoRA
recipe), through the autograd path, which splits the GGN at the loss's input (the
logits): the frozen attention, MLP, norms and head between the last adapter and the
loss belong to ``J``, crossed by VJPs only (no double backward through SDPA).

Tiny HF LLaMA and GPT-2 (tests/support/hf_models.py) with PEFT's LoRA, under SDPA (HF's
default) and eager attention, with two losses: a classification head on the last
position (``logits[:, -1, answer_ids]``, as examples/plot_bayesian_lora.py) and HF's own
shifted LM loss (``labels=ids``). In float64 against the exact GGN ``Jᵀ H J`` built with
torch.func (``J`` of the logits w.r.t. the adapters, ``H`` of the loss at the logits).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.support.hf_models import build_lora
from tests.support.secondorder_ref import blocks, diagonals
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacrev

import jacmem
from jacmem import KFAC, KFLR, DiagGGNExact, DiagGGNMC

pytestmark = pytest.mark.usefixtures("float64_default")

#: the answer tokens of the classification head
ANSWERS = [3, 7, 11]


class Answer(nn.Module):
    """ids ``[N, T]`` -> the last position's logits over :data:`ANSWERS`, ``[N, K]``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(input_ids=ids).logits[:, -1, ANSWERS]


class Tokens(nn.Module):
    """ids ``[N, T]`` -> every position's logits ``[N, T, V]`` (the reference's model)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(input_ids=ids).logits


class ShiftedLM(nn.Module):
    """HF's shifted LM loss on the logits ``[N, T, V]``, position ``t`` against label
    ``t + 1``, the mean over the ``N·(T-1)`` pairs (the reference's loss)."""

    def forward(self, z: Tensor, ids: Tensor) -> Tensor:
        return F.cross_entropy(z[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _lora(name: str, attention: str, n: int | None = None, t: int | None = None):
    """The LoRA model (only the adapters train: base and head frozen), ids ``[N, T]`` and
    class labels ``[N]`` in ``range(len(ANSWERS))``."""
    lora, ids, _ = build_lora(name)
    hf = lora.model
    hf.set_attn_implementation(attention)
    assert not any(p.requires_grad for n_, p in hf.named_parameters() if "lora_" not in n_)
    ids = ids[:n, :t]
    y = torch.arange(ids.shape[0]) % len(ANSWERS)
    return hf, ids, y


def _run(hf, ids, y, head: str, *exts) -> str:
    """One backward with ``exts``; what ``explain()`` says after it."""
    hf.zero_grad()
    with jacmem.extend(*exts) as ctx:
        loss = F.cross_entropy(Answer(hf)(ids), y) if head == "answer" else hf(input_ids=ids, labels=ids).loss
        loss.backward()
    return ctx.explain()


def _exact(hf, ids, y, head: str) -> Tensor:
    """The exact GGN ``Jᵀ H J [P, P]`` over the adapters, in the order of
    :func:`_reference_model`'s trainable parameters: ``J`` by ``jacrev`` (reverse mode
    only: SDPA's CPU kernel has no forward-mode derivative), ``H`` of the loss at the
    logits by ``hessian``."""
    model = _reference_model(hf, head)
    lossf, target = (nn.CrossEntropyLoss(), y) if head == "answer" else (ShiftedLM(), ids)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = dict(model.named_parameters())
    shapes = [params[n].shape for n in names]
    theta = torch.cat([params[n].detach().flatten() for n in names])

    def f(t: Tensor) -> Tensor:
        parts = {n: c.reshape(s) for n, c, s in zip(names, t.split([s.numel() for s in shapes]), shapes)}
        return functional_call(model, parts, (ids,))

    z = f(theta).detach()
    J = jacrev(f)(theta).reshape(z.numel(), -1)
    H = hessian(lambda z: lossf(z, target))(z).reshape(z.numel(), z.numel())
    return J.T @ H @ J


def _reference_model(hf, head: str) -> nn.Module:
    return Answer(hf) if head == "answer" else Tokens(hf)


CASES = [(m, a, h) for m in ("llama", "gpt2") for a in ("sdpa", "eager") for h in ("answer", "lm")]


@pytest.mark.parametrize(("name", "attention", "head"), CASES)
def test_diag_ggn_exact_on_the_adapters(name, attention, head):
    """DiagGGNExact of every adapter weight equals the diagonal of ``Jᵀ H J``. HF's loss
    computes in float32 (its ``logits.float()``), and so does LLaMA's RMSNorm: the
    looser tolerance there."""
    hf, ids, y = _lora(name, attention)
    _run(hf, ids, y, head, DiagGGNExact())
    ref = diagonals(_reference_model(hf, head), _exact(hf, ids, y, head))
    rtol = 1e-9 if (name, head) == ("gpt2", "answer") else 1e-5
    for pname, p in hf.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.diag_ggn_exact, ref["model." + pname], rtol=rtol, atol=rtol * 1e-3, msg=pname)


@pytest.mark.parametrize(("name", "attention", "head"), [c for c in CASES if c[1] == "sdpa"])
def test_diag_ggn_mc_converges_to_the_exact_diagonal(name, attention, head):
    """DiagGGNMC (labels drawn from the model's predictive at the logits): its error to
    the exact diagonal shrinks about as ``1/√M``."""
    hf, ids, y = _lora(name, attention)
    ref = diagonals(_reference_model(hf, head), _exact(hf, ids, y, head))
    exact = torch.cat([ref["model." + n].flatten() for n, p in hf.named_parameters() if p.requires_grad])
    errors = []
    for m in (4, 1024):
        torch.manual_seed(m)
        _run(hf, ids, y, head, DiagGGNMC(mc_samples=m))
        got = torch.cat([p.diag_ggn_mc.flatten() for p in hf.parameters() if p.requires_grad])
        errors.append(float((got - exact).norm() / exact.norm()))
    assert errors[1] < errors[0] / 3 and errors[1] < 0.15, errors


@pytest.mark.parametrize(("name", "attention"), [("llama", "sdpa"), ("gpt2", "sdpa"), ("llama", "eager")])
def test_kflr_and_kfac_with_one_sample_and_one_position_are_the_exact_blocks(name, attention):
    """With one sample at one position the Kronecker form of an adapter's GGN block is
    exact: KFLR's ``G ⊗ A`` equals it, and KFAC's (Monte-Carlo ``G``) approaches it
    (the query's adapters have a zero block: one key, so the attention is constant in
    the query). LLaMA's RMSNorm computes in float32."""
    hf, ids, y = _lora(name, attention, n=1, t=1)
    rtol = 1e-5 if name == "llama" else 1e-9
    ref = blocks(Answer(hf), _exact(hf, ids, y, "answer"))
    torch.manual_seed(0)
    _run(hf, ids, y, "answer", KFLR(), KFAC(mc_samples=4096))
    for pname, p in hf.named_parameters():
        if p.requires_grad:
            want = ref["model." + pname]
            scale = float(want.norm())
            torch.testing.assert_close(torch.kron(*p.kflr), want, rtol=rtol, atol=rtol * 1e-3, msg=pname)
            G, A = p.kfac
            torch.testing.assert_close(A, p.kflr[1], msg=pname)
            if scale > 1e-20:
                assert float((torch.kron(G, A) - want).norm()) < 0.1 * scale, pname


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_kflr_on_the_adapters_equals_curvlinops(name):
    """KFLR (``expand``) of every adapter with the head frozen, under SDPA, ``T`` > 1,
    equals curvlinops' type-2 KFAC over the same parameters (its own backward through
    the frozen model); LLaMA's RMSNorm computes in float32."""
    from curvlinops import KFACLinearOperator

    hf, ids, y = _lora(name, "sdpa")
    rtol = 1e-5 if name == "llama" else 1e-9
    model = Answer(hf)
    adapters = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and "lora_" in n}
    params = [m.weight for m in adapters.values()]
    op = KFACLinearOperator(
        model, nn.CrossEntropyLoss(), params, [(ids, y)], fisher_type="type-2", kfac_approx="expand",
        check_deterministic=False,
    )  # fmt: skip
    op.compute_kronecker_factors()
    _run(hf, ids, y, "answer", KFLR("expand"))
    for name, module in adapters.items():
        G, A = module.weight.kflr
        torch.testing.assert_close(G, op._gradient_covariances[name], rtol=rtol, atol=rtol * 1e-3, msg=name)
        torch.testing.assert_close(A, op._input_covariances[name], rtol=rtol, atol=rtol * 1e-3, msg=name)


def test_explain_names_the_split_and_the_exact_kinds_refuse_out_of_reach(monkeypatch):
    """``explain()`` says where the GGN split (the loss's input) and whether the exact
    kinds' loss Hessian there is in reach; where it is not (the limit lowered here in
    place of a real vocabulary: tests/integration/test_lm_curvature.py has GPT-2's), the
    exact kinds refuse before any work, naming the Monte-Carlo kinds, and explain() says
    so after a Monte-Carlo backward."""
    from jacmem.engine.secondorder import autograd_path

    hf, ids, y = _lora("llama", "sdpa")
    said = _run(hf, ids, y, "lm", DiagGGNExact())
    assert "the GGN splits at the input of loss" in said and f"{ids.shape[1] * 23} outputs per sample" in said, said
    assert "is in reach" in said and "Monte-Carlo kinds sample" not in said, said
    for p in hf.parameters():
        if p.requires_grad:
            del p.diag_ggn_exact
    monkeypatch.setattr(autograd_path, "_EXACT_BYTES", 1000)
    with pytest.raises(RuntimeError, match=r"out of reach: use the Monte-Carlo kinds \(DiagGGNMC, KFAC"):
        _run(hf, ids, y, "lm", DiagGGNExact())
    assert all(not hasattr(p, "diag_ggn_exact") for p in hf.parameters())
    said = _run(hf, ids, y, "lm", DiagGGNMC(mc_samples=2))
    assert "out of reach: the exact kinds" in said and "sample the loss's labels" in said, said
