"""First-order extensions on real transformer code, against a per-sample autograd loop
in float64: tiny configurations of HF GPT-2 (tied embeddings, default ``[1, T]``
position ids), HF BERT, an HF LLaMA block (RMSNorm, rotary embeddings, SiLU-gated MLP)
and timm's ViT (its own ``cls_token`` and ``pos_embed``), all with random weights.

Every trainable parameter must carry every quantity, shaped ``[N, *p.shape]`` where
per sample, and equal to the loop's.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tests.support.hf_models import DT, MODELS, N, T, V, build, timm, tokens, transformers
from tests.support.reference import SAVEFIELDS, check_against, cross_entropy, mse, per_sample_grads, run_jacmem
from torch import nn

import jacmem

EXTENSIONS = [jacmem.BatchGrad(), jacmem.BatchL2Grad(), jacmem.SumGradSquared(), jacmem.Variance()]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("flow", ["inside", "track"])
def test_every_parameter_gets_exact_per_sample_quantities(name, flow):
    model, X, y = build(name)
    reference = per_sample_grads(model, X, y, cross_entropy, "mean")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning, no torch.func performance warning
        run_jacmem(model, X, y, cross_entropy, "mean", EXTENSIONS, flow)
    for p in reference:
        assert p.grad_batch.shape == (N, *p.shape)
    check_against(model, reference, SAVEFIELDS, f"[{name} {flow}]")


def test_gpt2_ties_its_embeddings():
    """``lm_head.weight`` is ``wte.weight``: one parameter, the sum of both uses."""
    model, X, y = build("gpt2")
    lm = model.model
    assert lm.lm_head.weight is lm.transformer.wte.weight
    reference = per_sample_grads(model, X, y, cross_entropy, "sum")
    run_jacmem(model, X, y, cross_entropy, "sum", EXTENSIONS)
    check_against(model, reference, SAVEFIELDS, "[gpt2 tied]")


def test_hf_loss_from_labels():
    """The loss the model computes itself (``labels=``: shifted, mean over tokens)."""
    model, X, _ = build("gpt2")
    lm = model.model
    params = [p for p in lm.parameters() if p.requires_grad]
    rows = [torch.autograd.grad(lm(X[n : n + 1], labels=X[n : n + 1]).loss / N, params) for n in range(N)]
    with jacmem.extend(*EXTENSIONS):
        lm(X, labels=X).loss.backward()
    for i, p in enumerate(params):
        expected = torch.stack([row[i] for row in rows])
        torch.testing.assert_close(p.grad_batch, expected, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(p.batch_l2, expected.flatten(1).square().sum(1), rtol=1e-9, atol=1e-12)


class DoubledLayerNorm(nn.LayerNorm):
    """A subclass whose forward is *not* LayerNorm's function."""

    def forward(self, x):
        return 2 * super().forward(x)


def _norm_model(norm: nn.Module, dtype: torch.dtype):
    torch.manual_seed(0)
    norm = norm.to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    model = nn.Sequential(nn.Linear(4, 4), norm).to(dtype)
    return model, torch.randn(N, 2, 4, dtype=dtype), torch.randn(N, 2, 4, dtype=dtype)


def _norm_chosen(ctx) -> set:
    return {d.chosen for d in ctx.plan.decisions.values() if d.module == "1"}


@pytest.mark.parametrize(
    "make, native", [(lambda: timm.layers.LayerNorm(4), True), (lambda: DoubledLayerNorm(4), False)]
)
def test_norm_subclasses_are_recognised_by_what_they_compute(make, native):
    """A subclass that overrides ``forward`` takes the norm's own derivatives where its
    output on the first call equals the norm's function (timm's LayerNorm), and the
    exact recomputation otherwise."""
    model, X, y = _norm_model(make(), DT)
    reference = per_sample_grads(model, X, y, mse, "mean")
    ctx = run_jacmem(model, X, y, mse, "mean", EXTENSIONS)
    check_against(model, reference, SAVEFIELDS, f"[{type(model[1]).__name__}]")
    assert ("vmap" not in _norm_chosen(ctx)) == native, ctx.explain()


def test_a_recognised_norm_runs_on_its_own_parameters_after_its_first_call():
    """timm's LayerNorm, recognised as LayerNorm's function on its first call, runs its
    later calls on its own parameters, not on watched views (whose every op jacmem would
    read), and its per-sample gradients stay exact in the steps after."""
    model, X, y = _norm_model(timm.layers.LayerNorm(4), DT)
    norm, seen = model[1], []
    model[1].register_forward_pre_hook(lambda module, args: seen.append(type(module.weight)))
    reference = per_sample_grads(model, X, y, mse, "mean")
    for _ in range(2):
        run_jacmem(model, X, y, mse, "mean", EXTENSIONS)
        check_against(model, reference, SAVEFIELDS, "[timm LayerNorm]")
    assert seen[-1] is nn.Parameter and norm.weight.__class__ is nn.Parameter, seen


@pytest.mark.parametrize(
    "make",
    [
        lambda: transformers.models.llama.modeling_llama.LlamaRMSNorm(4, eps=1e-5),
        lambda: transformers.models.t5.modeling_t5.T5LayerNorm(4),
    ],
)
def test_hf_rms_norms_need_no_recomputation(make):
    """HF's RMSNorms (not subclasses of nn.RMSNorm) multiply by their weight with a
    broadcast, which jacmem makes explicit: exact per-sample gradients in float64, with
    no recomputation."""
    model, X, y = _norm_model(make(), DT)
    reference = per_sample_grads(model, X, y, mse, "mean")
    ctx = run_jacmem(model, X, y, mse, "mean", EXTENSIONS)
    assert "vmap" not in _norm_chosen(ctx), ctx.explain()
    check_against(model, reference, SAVEFIELDS, f"[{type(model[1]).__name__}]")


class OwnAttention(nn.Module):
    """A module that uses its own projection in a matrix product, then fused attention:
    only the recomputation gives its per-sample gradients."""

    def __init__(self, d: int):
        super().__init__()
        self.proj = nn.Parameter(torch.randn(d, d, dtype=DT) / d**0.5)

    def forward(self, x):  # [N, T, d]
        h = (x @ self.proj).unsqueeze(1)  # one head: [N, 1, T, d]
        return nn.functional.scaled_dot_product_attention(h, h, h).squeeze(1)


def test_torch_func_performance_warnings_are_attributed():
    """torch.func's "performance drop" warning (no batching rule for fused attention)
    comes out once, naming the module and the fix, not as torch's bare warning."""
    torch.manual_seed(0)
    model, X, y = OwnAttention(4), torch.randn(N, 3, 4, dtype=DT), torch.randn(N, 3, 4, dtype=DT)
    reference = per_sample_grads(model, X, y, mse, "mean")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_jacmem(model, X, y, mse, "mean", [jacmem.BatchGrad()])
    check_against(model, reference, ["grad_batch"], "[own attention]")
    texts = [str(w.message) for w in caught]
    assert not any(t.startswith("There is a performance drop") for t in texts), texts
    ours = [t for t in texts if "module type 'OwnAttention'" in t]
    assert len(ours) == 1 and "scaled_dot_product" in ours[0] and "jacmem.register" in ours[0], texts


class SharedPositions(nn.Module):
    """Token and position embeddings, the positions ``[1, T]`` shared by the batch;
    ``use`` says how the position embedding meets the tokens'."""

    def __init__(self, use: str):
        super().__init__()
        self.use = use
        self.tok, self.pos = nn.Embedding(V, 4), nn.Embedding(T, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, ids):  # [N, T] -> [N, 3, T]
        pos = self.pos(torch.arange(ids.shape[1])[None])  # [1, T, 4]
        if self.use == "add":
            h = self.tok(ids) + pos
        elif self.use == "slice-add":
            h = self.tok(ids) + pos[:, : ids.shape[1]].to(DT)
        else:  # squeezed: the batch axis is gone before the broadcast
            h = self.tok(ids) + pos.squeeze(0)
        return self.head(h).transpose(1, 2)


@pytest.mark.parametrize("use", ["add", "slice-add"])
def test_position_ids_shared_by_the_batch_are_exact(use):
    torch.manual_seed(0)
    model, (X, y) = SharedPositions(use).to(DT), tokens(None)
    y = torch.randint(0, 3, (N, T))
    reference = per_sample_grads(model, X, y, cross_entropy, "mean")
    for flow in ("inside", "track"):
        run_jacmem(model, X, y, cross_entropy, "mean", EXTENSIONS, flow)
        check_against(model, reference, SAVEFIELDS, f"[{use} {flow}]")


def test_a_broadcast_jacmem_cannot_follow_raises_naming_the_module_and_the_fix():
    """``pos.squeeze(0)`` drops the batch axis before the broadcast: the per-sample
    quantities of ``pos`` cannot be told apart, so the backward raises, writes nothing,
    and names the module and the fix, with or without strict."""
    torch.manual_seed(0)
    model, (X, _) = SharedPositions("squeeze").to(DT), tokens(None)
    y = torch.randint(0, 3, (N, T))
    for strict in (False, True):
        with pytest.raises(RuntimeError, match=r"'pos'.*batch of one.*expand"):
            run_jacmem(model, X, y, cross_entropy, "mean", EXTENSIONS, strict=strict)
        assert not any(hasattr(p, "grad_batch") for p in model.parameters())
