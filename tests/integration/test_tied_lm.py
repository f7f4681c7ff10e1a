"""Tied input and output embeddings on real HF language models at their real vocabularies
(:func:`tests.support.hf_models.tied_lm`), against the per-sample loop in float64.

- BatchL2Grad and ClipGrad (flat and per-layer thresholds, mean and sum reductions) on
  BERT's masked-LM head (30522 tokens, with token type ids and its default ``[1, T]``
  position ids) and a LLaMA-style model with ``tie_word_embeddings=True`` (32000 tokens):
  the cost model picks the tied ghost norm, and nothing of ``[N, V, d]`` is allocated.
  GPT-2 (50257 tokens) adds the clipping styles and reductions that
  tests/extensions/test_tied_ghost.py does not run on it.
- jacmem's PrivacyEngine on tied GPT-2 at 50257 tokens: a step without noise is the
  loop's clipped SGD step, and the noise it adds has the standard deviation ``σC/B``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tests.support.allocations import Allocations
from tests.support.clipping import assert_grads, expected, median_norm, norms, per_sample
from tests.support.hf_models import VOCAB, tied_lm
from tests.support.privacy import LR, loader, loop_step, private
from tests.support.reference import batch_l2, chosen, clear, cross_entropy, per_sample_grads

import jacmem
from jacmem.privacy import PrivacyEngine

DT = torch.float64
N, T, D = 3, 8, 16

#: the name explain() gives each model's tied weight
TIED = {"gpt2": "model.lm_head.weight", "bert": "model.cls.predictions.decoder.weight", "llama": "model.lm_head.weight"}


def case(name: str, n: int = N):
    """(model, X, y) in float64, eval mode (no dropout, as the loop needs); token ids drawn
    from a few values, so that they repeat within and across samples."""
    torch.manual_seed(0)
    model = tied_lm(name, D, T).to(DT).eval()
    X = torch.randint(0, 6, (n, T))
    if name == "bert":
        X = torch.stack([X, torch.randint(0, 2, (n, T))], 1)  # token type ids beside the tokens
    return model, X, torch.randint(0, VOCAB[name], (n, T))


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_batch_l2_without_per_sample_gradients(name):
    model, X, y = case(name)
    reference = per_sample_grads(model, X, y, cross_entropy, "mean")
    clear(model)
    watch = Allocations(N * VOCAB[name] * D)
    with jacmem.extend(jacmem.BatchL2Grad()) as ctx:
        loss = cross_entropy(model(X), y, "mean")
        with watch:
            loss.backward()
    assert chosen(ctx, TIED[name]) == "tied ghost"
    assert watch.large == []
    for pname, p in model.named_parameters():
        torch.testing.assert_close(
            p.batch_l2, batch_l2(reference[p]), rtol=1e-9, atol=1e-15, msg=lambda m: f"{pname}: {m}"
        )


CLIPS = [
    (name, clipping, reduction)
    for name in ("bert", "llama", "gpt2")
    for clipping in ("flat", "per_layer")
    for reduction in ("mean", "sum")
    if (name, clipping, reduction) != ("gpt2", "flat", "mean")  # tests/extensions/test_tied_ghost.py
]


@pytest.mark.parametrize("name, clipping, reduction", CLIPS)
def test_clipped_sum_without_per_sample_gradients(name, clipping, reduction, path):
    """Per-layer thresholds are each parameter's median per-sample norm; the tied weight's
    is the norm of the sum over its two uses. Both ways to the clipped sum (``path``);
    staged per-sample gradients are ``[N, V, d]`` by design, so the watch is on the other."""
    model, X, y = case(name)
    grads = per_sample(model, X, y, cross_entropy, reduction)
    if clipping == "flat":
        C = median_norm(grads)
    else:
        C = [g.flatten(1).norm(dim=1).median().item() for g in grads.values()]
    clear(model)
    watch = Allocations(N * VOCAB[name] * D)
    with jacmem.extend(jacmem.ClipGrad(C, clipping=clipping, loss_reduction=reduction)) as ctx:
        loss = cross_entropy(model(X), y, reduction)
        with watch:
            loss.backward()
    assert chosen(ctx, TIED[name]) == "tied ghost"
    assert watch.large == [] or path == "per_sample"
    assert_grads(model, expected(grads, C, clipping), f"{name} {clipping} {reduction}")


@pytest.mark.filterwarnings("ignore:Secure RNG turned off")
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_private_step_on_gpt2_at_its_real_vocabulary(mode):
    """Noise 0, no Poisson sampling: one SGD step equals the loop's on the clipped
    per-sample gradients, in either of Opacus's ways to ask (a ghost mode returns the
    criterion too; both clip in jacmem's one backward)."""
    model, X, y = case("gpt2", n=4)
    twin = copy.deepcopy(model)
    grads = per_sample(model, X, y, cross_entropy, "mean")
    C = median_norm(grads)
    engine = PrivacyEngine()
    try:
        out = private(engine, model, C, data_loader=loader(X, y, batch_size=4), grad_sample_mode=mode,
                      criterion=torch.nn.CrossEntropyLoss())  # fmt: skip
        opt = out[1]
        opt.zero_grad()
        cross_entropy(model(X), y, "mean").backward()
        opt.step()
    finally:
        engine.detach()
    for i, (p, e) in enumerate(zip(model.parameters(), loop_step(twin, [(X, y)], C, "flat", reduction="mean"))):
        torch.testing.assert_close(p.detach(), e, rtol=1e-10, atol=1e-12, msg=lambda m: f"param {i}: {m}")


@pytest.mark.filterwarnings("ignore:Secure RNG turned off")
def test_noise_on_gpt2_has_std_sigma_c_over_b():
    """The same step with noise σ and without: the difference is the noise, ``-lr·n/B``,
    ``n ~ N(0, σ²C²)`` per coordinate. The tied weight alone has 50257·16 coordinates:
    the sample standard deviation is within 5 of its own standard deviations
    (``1/sqrt(2n)``, relative), with a fixed seed."""
    sigma, B = 1.3, 4
    model, X, y = case("gpt2", n=B)
    C = norms(per_sample(model, X, y, cross_entropy, "mean")).median().item()
    steps = []
    for noise in (sigma, 0.0):
        twin = copy.deepcopy(model)
        engine = PrivacyEngine()
        try:
            _, opt, _ = engine.make_private(
                module=twin, optimizer=torch.optim.SGD(twin.parameters(), lr=LR), data_loader=loader(X, y, B),
                noise_multiplier=noise, max_grad_norm=C, poisson_sampling=False,
                noise_generator=torch.Generator().manual_seed(0),
            )  # fmt: skip
            opt.zero_grad()
            cross_entropy(twin(X), y, "mean").backward()
            opt.step()
        finally:
            engine.detach()
        steps.append(twin.model.lm_head.weight.detach())
    noise = ((steps[1] - steps[0]) / LR).flatten()
    n, want = noise.numel(), sigma * C / B
    assert abs(noise.std().item() / want - 1) < 5 / (2 * n) ** 0.5
    assert abs(noise.mean().item()) < 5 * want / n**0.5
