"""LoRA through PEFT (issue 25): ``peft.get_peft_model`` on tiny HF GPT-2 (its fused
``c_attn`` is a Conv1D: PEFT's ``fan_in_fan_out``), BERT and a LLaMA-style model, with
adapters on the attention projections and the base frozen.

In float64, against the per-sample autograd loop: the adapters' per-sample quantities,
their clipped sums (``ClipGrad``, flat and per-layer, mean and sum) and one
``PrivacyEngine`` step (noise 0, no Poisson sampling). PEFT's ``lora.Linear`` calls its
frozen base layer and two ``nn.Linear`` adapters (``lora_A``: [N, T, d] -> [N, T, r],
``lora_B``: -> [N, T, out]); only the adapters' calls are recorded, so the frozen base
does no per-sample work. PEFT's ``lora.Embedding`` reads its matrices from
``ParameterDict`` children (``lora_embedding_A``: [r, V], ``lora_embedding_B``: [d, r]):
they are its own parameters to jacmem, given by the exact recomputation (vmap).

PEFT's other adapters on GPT-2 too: prompt tuning (its prompt embedding is called on one
row of virtual-token ids, and the prompts are ``repeat``-ed over the batch), prefix
tuning and IA³.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tests.support import hf_models
from tests.support.clipping import assert_grads, expected, median_norm, per_sample
from tests.support.hf_models import DT, LORA_TARGETS, build_lora
from tests.support.privacy import loader, loop_step, private, train
from tests.support.reference import (
    FLOWS,
    SAVEFIELDS,
    check_against,
    cross_entropy,
    per_sample_grads,
    recorded,
    run_jacmem,
)
from torch import Tensor
from torch.nn import functional as F

import jacmem
from jacmem.privacy import PrivacyEngine

peft = pytest.importorskip("peft")

EXTENSIONS = [jacmem.BatchGrad(), jacmem.BatchL2Grad(), jacmem.SumGradSquared(), jacmem.Variance()]
MODELS = list(LORA_TARGETS)


def token_sum(out: Tensor, y: Tensor, reduction: str) -> Tensor:
    """Cross-entropy summed over each sample's tokens, then reduced over the samples:
    out [N, C, *], y [N, *] -> [N] (``"none"``) or a scalar; a sample's own loss term is
    the same under "mean" and "sum", as the PrivacyEngine's step assumes."""
    per_sample_loss = F.cross_entropy(out, y, reduction="none").reshape(len(y), -1).sum(1)
    return per_sample_loss if reduction == "none" else getattr(per_sample_loss, reduction)()


def thresholds(grads: dict, clipping: str):
    """Thresholds that clip some samples and not others: the median total norm (flat),
    or each adapter's median norm (per-layer)."""
    if clipping == "per_layer":
        return [g.flatten(1).norm(dim=1).median().item() for g in grads.values()]
    return median_norm(grads)


def adapters_only(model) -> None:
    """Only LoRA's matrices train; the frozen base has no gradient and no quantity."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all(".lora_" in n for n in names), names
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None and not any(hasattr(p, f) for f in SAVEFIELDS), n


@pytest.mark.parametrize("embedding", [False, True])
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("flow", FLOWS)
def test_adapters_get_exact_per_sample_quantities(name, flow, embedding):
    model, X, y = build_lora(name, embedding)
    reference = per_sample_grads(model, X, y, cross_entropy, "mean")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback: the adapters are plain Linears
        if embedding:  # PEFT's lora.Embedding has no closed form yet: the vmap fallback, which says so
            warnings.filterwarnings("ignore", message=r"jacmem: module .*\(Embedding\).*recomputed one sample")
        run_jacmem(model, X, y, cross_entropy, "mean", EXTENSIONS, flow)
    check_against(model, reference, SAVEFIELDS, f"[{name} lora {flow}]")
    adapters_only(model)


@pytest.mark.parametrize("name", MODELS)
def test_the_frozen_base_is_neither_recorded_nor_planned(name):
    """Every recorded call is an adapter's (one per ``lora_A``/``lora_B`` Linear), and the
    plan and ``explain()`` name adapter parameters only: the frozen base layers, the
    embeddings and the head cost what they cost in a plain step."""
    model, X, y = build_lora(name)
    adapters = {n for n, m in model.named_modules() if n.endswith((".lora_A.default", ".lora_B.default"))}
    with recorded() as records, jacmem.extend(jacmem.BatchL2Grad()) as ctx:
        value = cross_entropy(model(X), y, "mean")
        names = sorted(r().name for r in records if r() is not None)
        value.backward()
    assert names == sorted(adapters), names
    assert {d.module for d in ctx.plan.decisions.values()} == adapters
    lines = ctx.explain().splitlines()
    assert lines and all(".lora_A." in line or ".lora_B." in line for line in lines), ctx.explain()


@pytest.mark.parametrize("embedding", [False, True])
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("flow", FLOWS)
def test_adapters_clipped_sums_are_exact(name, clipping, reduction, flow, path, embedding):
    model, X, y = build_lora(name, embedding)
    grads = per_sample(model, X, y, cross_entropy, reduction)
    C = thresholds(grads, clipping)
    clip = jacmem.ClipGrad(C, clipping, reduction)
    run_jacmem(model, X, y, cross_entropy, reduction, [clip], flow)
    assert_grads(model, expected(grads, C, clipping), f"{name} {clipping} {reduction} {flow} {path} {embedding}")
    adapters_only(model)


@pytest.mark.usefixtures("float64_default")
@pytest.mark.filterwarnings("ignore:Secure RNG turned off", "ignore:Optimal order is the largest alpha")
@pytest.mark.parametrize("embedding", [False, True])
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_one_private_step_equals_the_loops_and_generate_still_works(name, clipping, embedding):
    """The PEFT model itself is made private (``module is`` the PeftModel, so its
    methods stay); one step with noise 0 equals the loop's clipped SGD step on the
    adapters, and the frozen base does not move."""
    model, X, y = build_lora(name, embedding)
    grads = per_sample(model, X, y, token_sum, "mean")
    max_norm = thresholds(grads, clipping)
    # the loop at the training loss's scale: LLaMA's RMSNorm computes in float32
    want = loop_step(model, [(X, y)], max_norm, clipping, token_sum, "mean")  # the frozen base stays
    engine = PrivacyEngine()
    try:
        returned, optimizer, _ = private(engine, model.model, max_norm, clipping, data_loader=loader(X, y, len(X)))
        assert returned is model.model
        train(model, optimizer, [(X, y)], token_sum)
        for (n, p), w in zip(model.named_parameters(), want):
            torch.testing.assert_close(p.detach(), w, rtol=1e-10, atol=1e-12, msg=lambda m: f"{n}: {m}")
        if name != "bert":  # a causal LM: generation runs on the private model
            out = model.model.generate(input_ids=X[:1], max_new_tokens=2, do_sample=False, pad_token_id=0)
            assert out.shape == (1, X.shape[1] + 2)
    finally:
        engine.detach()


#: PEFT's adapters other than LoRA, on GPT-2: (config, virtual tokens prepended to the output)
OTHER_ADAPTERS = {
    "prompt tuning": (lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3), 3),
    "prefix tuning": (lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3), 0),
    "IA3": (
        lambda: peft.IA3Config(
            task_type="CAUSAL_LM",
            target_modules=["c_attn", "mlp.c_proj"],
            feedforward_modules=["mlp.c_proj"],
            fan_in_fan_out=True,
        ),  # fmt: skip
        0,
    ),
}


@pytest.mark.parametrize("adapter", list(OTHER_ADAPTERS))
@pytest.mark.parametrize("flow", FLOWS)
def test_other_peft_adapters_get_exact_per_sample_quantities_and_clipped_sums(adapter, flow):
    """Prompt tuning ran its prompt embedding on a batch of one and ``repeat``-ed the
    prompts over the batch, which jacmem did not follow: every first-order quantity was
    the batch's sum, with no word (``ClipGrad`` refused it). The repeat is now the
    expansion it is, and the quantities are per sample."""
    config, virtual = OTHER_ADAPTERS[adapter]
    model, X, _ = hf_models.build("gpt2")
    model.model = peft.get_peft_model(model.model, config()).to(DT)
    y = torch.randint(0, hf_models.V, (X.shape[0], X.shape[1] + virtual))
    reference = per_sample_grads(model, X, y, cross_entropy, "mean")
    run_jacmem(model, X, y, cross_entropy, "mean", EXTENSIONS, flow)
    check_against(model, reference, SAVEFIELDS, f"[{adapter} {flow}]")
    grads = per_sample(model, X, y, cross_entropy, "mean")
    C = median_norm(grads)
    model.zero_grad(set_to_none=True)
    run_jacmem(model, X, y, cross_entropy, "mean", [jacmem.ClipGrad(C)], flow)
    assert_grads(model, expected(grads, C), f"{adapter} {flow} ClipGrad")
