"""The clipping threshold of jacmem.privacy is the optimizer's, step by step.

Opacus's grad-clip schedulers set ``optimizer.max_grad_norm`` between steps; adaptive
clipping (Andrew et al. 2021) moves it at each step towards a quantile of the per-sample
norms. Each backward pass must clip at the value in force for its step. Checked in
float64 against a per-sample loop whose thresholds come from the schedule's formula,
and against Opacus's own engine on a copy of the model.
"""

from __future__ import annotations

import copy
import math

import opacus
import pytest
import torch
from opacus.schedulers import ExponentialGradClip, LambdaGradClip, StepGradClip
from tests.support.privacy import FLAT, LR, N, batch, clip_factors, loader, loop_step, medians, net, private
from tests.support.reference import cross_entropy, per_sample_grads
from torch import nn

import jacmem
from jacmem.privacy import PrivacyEngine

pytestmark = [
    pytest.mark.usefixtures("float64_default"),
    pytest.mark.filterwarnings("ignore:Secure RNG turned off"),
    pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha"),
]

STEPS = 4


@pytest.fixture
def engine():
    """A PrivacyEngine whose model is detached after the test, however it ends."""
    eng = PrivacyEngine()
    yield eng
    eng.detach()


#: name -> (the scheduler on an optimizer, the factor on the first threshold after t steps)
SCHEDULES = {
    "step": (lambda opt: StepGradClip(opt, step_size=2, gamma=0.5), lambda t: 0.5 ** (t // 2)),
    "exponential": (lambda opt: ExponentialGradClip(opt, gamma=0.6), lambda t: 0.6**t),
    "lambda": (lambda opt: LambdaGradClip(opt, scheduler_function=lambda e: 1 / (1 + e)), lambda t: 1 / (1 + t)),
}


def passes(step: int) -> list:
    """Two backward passes of N samples for each step (a virtual batch of 2N)."""
    return [batch(seed=10 * step + 1), batch(seed=10 * step + 2)]


def scaled(max_norm, factor: float):
    return max_norm * factor if isinstance(max_norm, float) else [c * factor for c in max_norm]


def clipped_sum(model, batches, max_norm, clipping: str) -> list[torch.Tensor]:
    """``Σ_i c_i g_i`` over ``batches`` per parameter: the per-sample loop."""
    total = [torch.zeros_like(p) for p in model.parameters()]
    for X, y in batches:
        grads = per_sample_grads(model, X, y, cross_entropy, "sum")
        factors = clip_factors(grads, max_norm, clipping)
        for t, (p, g) in zip(total, grads.items()):
            t += torch.einsum("n,n...->...", factors[p], g)
    return total


def opacus_private(model, max_norm, clipping: str, noise: float = 0.0, data_loader=None, **kwargs):
    """Opacus's own engine on a copy of ``model``: (copy, wrapped copy, optimizer, engine)."""
    model = copy.deepcopy(model)
    theirs = opacus.PrivacyEngine()
    wrapped, opt, _ = theirs.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), data_loader=data_loader or loader(*batch()),
        noise_multiplier=noise, max_grad_norm=max_norm, poisson_sampling=False, clipping=clipping, **kwargs,
    )  # fmt: skip
    return model, wrapped, opt, theirs


def backward(model, batches) -> None:
    for X, y in batches:
        nn.functional.cross_entropy(model(X), y).backward()


def close(actual, expected, what: str) -> None:
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a.detach(), e, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what} param {i}: {m}")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_schedulers_clip_at_the_current_threshold(engine, schedule, clipping):
    """Each step's ``.grad`` is the loop's clipped sum at that step's threshold (the
    first times the schedule's factor; per layer, every threshold times it), and the
    parameters after each step are the loop's and Opacus's (whose per-layer clipping
    ignores its schedulers: its thresholds are set to the same schedule by hand)."""
    make_scheduler, factor = SCHEDULES[schedule]
    model = net()
    ref = copy.deepcopy(model)
    first = FLAT if clipping == "flat" else medians(model, *batch())
    theirs, wrapped, their_opt, _ = opacus_private(model, first, clipping)
    _, opt, _ = private(engine, model, first, clipping)
    ours, their_scheduler = make_scheduler(opt), make_scheduler(their_opt)
    for t in range(STEPS):
        max_norm = scaled(first, factor(t))
        if clipping == "per_layer":
            their_opt.max_grad_norms = max_norm
            assert opt.max_grad_norms == pytest.approx(max_norm, rel=1e-12)
        batches = passes(t)
        expected = clipped_sum(ref, batches, max_norm, clipping)
        opt.zero_grad()
        backward(model, batches)
        close([p.grad for p in model.parameters()], expected, f"step {t}: .grad against the loop")
        opt.step()
        with torch.no_grad():
            for p, s in zip(ref.parameters(), expected):
                p -= LR / (2 * N) * s
        close(list(model.parameters()), list(ref.parameters()), f"step {t}: the loop")
        their_opt.zero_grad()
        backward(wrapped, batches)
        their_opt.step()
        close(list(model.parameters()), list(theirs.parameters()), f"step {t}: Opacus")
        ours.step()
        their_scheduler.step()
    assert factor(STEPS - 1) < 1  # the threshold did move


def test_the_clipped_norm_follows_the_scheduler(engine):
    """One sample per pass, noise 0: its clipped gradient's norm is the threshold in
    force, 1 then 0.1 (the sample's norm is above both)."""
    model = net()
    ref = copy.deepcopy(model)  # for the loop's norm
    X, y = batch(1, seed=3)
    _, opt, _ = private(engine, model, 1.0, data_loader=loader(X, y, batch_size=1))
    scheduler = ExponentialGradClip(opt, gamma=0.1)
    for threshold in (1.0, 0.1):
        ref.load_state_dict(model.state_dict())
        grads = per_sample_grads(ref, X, y, cross_entropy, "sum").values()
        g = torch.cat([t.flatten() for t in grads]).norm().item()
        assert g > threshold
        opt.zero_grad()
        backward(model, [(X, y)])
        norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
        assert norm == pytest.approx(threshold * g / (g + 1e-6), rel=1e-12)
        opt.step()
        scheduler.step()


def test_a_threshold_changed_between_the_passes_of_a_step_raises(engine):
    """The passes of one step share a noise of one ``C``: a change after the first
    raises at the step, before any noise or update; set back, the step goes on."""
    model = net()
    _, opt, _ = private(engine, model, FLAT)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    backward(model, passes(0)[:1])
    opt.max_grad_norm = FLAT / 2
    backward(model, passes(0)[1:])
    with pytest.raises(RuntimeError, match="max_grad_norm changed from 4.0 to 2.0"):
        opt.step()
    close(list(model.parameters()), before, "after the refused step")
    opt.max_grad_norm = FLAT
    opt.step()
    ref = net()
    ref.load_state_dict(dict(zip(ref.state_dict(), before)))
    close(list(model.parameters()), loop_step(ref, passes(0), FLAT, "flat"), "the loop")


def test_per_layer_thresholds_and_the_noise_scale_are_one(engine):
    """Per layer, ``max_grad_norm`` (the noise's ``C``) is the norm of ``max_grad_norms``
    (the thresholds): setting either sets the other."""
    model = net()
    first = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    _, opt, _ = private(engine, model, first, "per_layer")
    assert opt.max_grad_norm == pytest.approx(math.sqrt(sum(c * c for c in first)), rel=1e-15)
    opt.max_grad_norm = 2 * opt.max_grad_norm
    assert opt.max_grad_norms == pytest.approx([2 * c for c in first], rel=1e-15)
    opt.max_grad_norms = [1.0] * 6
    assert opt.max_grad_norm == pytest.approx(math.sqrt(6), rel=1e-15)


def test_per_layer_thresholds_stay_with_their_parameters_when_one_is_frozen(engine):
    """The thresholds are given in the order of the parameters trainable at
    ``make_private``; a parameter frozen after it (``requires_grad_(False)``) keeps the
    others' thresholds where they were: each is clipped at its own (they were shifted
    one parameter along before, silently, as in Opacus). A parameter frozen at
    ``make_private`` and unfrozen since has none, and the backward names its module."""
    model = net()
    model[1].weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    X, y = batch()
    thresholds = medians(model, X, y)
    _, opt, _ = private(engine, model, thresholds, "per_layer")
    for m in (model, ref):
        m[0].weight.requires_grad_(False)
    opt.zero_grad()
    backward(model, [(X, y)])
    opt.step()
    grads = per_sample_grads(ref, X, y, cross_entropy, "sum")
    factors = clip_factors(grads, thresholds[1:], "per_layer")
    step = {p: LR / N * torch.einsum("n,n...->...", factors[p], g) for p, g in grads.items()}
    close(list(model.parameters()), [(p - step.get(p, 0)).detach() for p in ref.parameters()], "the loop")
    model[1].weight.requires_grad_(True)
    opt.zero_grad()
    with pytest.raises(ValueError, match=r"no threshold for parameter\(s\) \['1'\]"):
        backward(model, [(X, y)])


def test_a_tensor_threshold_is_refused(engine):
    """A tensor threshold would be read with a host synchronisation in every backward."""
    model = net()
    _, opt, _ = private(engine, model, FLAT)
    opt.max_grad_norm = torch.tensor(FLAT)
    with pytest.raises(TypeError, match=r"pass float\(t\)"):
        backward(model, passes(0)[:1])
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())  # no clipped sum written


ADAPTIVE = dict(
    target_unclipped_quantile=0.5, clipbound_learning_rate=0.5, max_clipbound=20.0, min_clipbound=0.5,
    unclipped_num_std=2.0,
)  # fmt: skip


def test_adaptive_clipping_is_opacus_adaclip(engine):
    """Opacus's ``clipping="adaptive"`` on a copy, the same noise generator's seed: the
    same sequence of thresholds, the same parameters and the same ε; each step's
    unclipped count is the loop's."""
    model = net()
    ref = copy.deepcopy(model)  # for the loop's norms
    data = loader(*batch(4 * N), batch_size=N)  # q = 1/4
    theirs, wrapped, their_opt, their_engine = opacus_private(
        model, FLAT, "adaptive", 0.8, data, noise_generator=torch.Generator().manual_seed(7), **ADAPTIVE
    )
    _, opt, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), data_loader=data,
        noise_multiplier=0.8, max_grad_norm=FLAT, poisson_sampling=False, clipping="adaptive",
        noise_generator=torch.Generator().manual_seed(7), **ADAPTIVE,
    )  # fmt: skip
    ours, bounds = [], []
    for t in range(STEPS + 2):
        batches = passes(t)
        norms = torch.cat([
            torch.cat([g.flatten(1) for g in per_sample_grads(ref, X, y, cross_entropy, "sum").values()], 1)
            .norm(dim=1) for X, y in batches
        ])  # fmt: skip
        opt.zero_grad()
        backward(model, batches)
        assert int(opt.private.clip.unclipped) == int((opt.max_grad_norm / (norms + 1e-6) >= 1).sum())
        opt.step()
        their_opt.zero_grad()
        backward(wrapped, batches)
        their_opt.step()
        ours.append(opt.max_grad_norm)
        bounds.append(float(their_opt.max_grad_norm))
        assert isinstance(opt.max_grad_norm, float)
        ref.load_state_dict(model.state_dict())
        # Opacus's noise std is float32 after the first update (its threshold is a float32
        # tensor there), jacmem's the same value times σ in float64: 1e-7 of the noise
        # (std about 3, times lr/2N) apart
        for i, (p, q) in enumerate(zip(model.parameters(), theirs.parameters())):
            torch.testing.assert_close(
                p.detach(), q.detach(), rtol=1e-6, atol=1e-7, msg=lambda m: f"step {t} param {i}: {m}"
            )
    assert ours == bounds
    assert len(set(ours)) == len(ours)  # the threshold moved at every step
    assert engine.get_epsilon(1e-5) == their_engine.get_epsilon(1e-5)


def test_adaptive_clipping_takes_opacus_checks(engine):
    model = net()
    with pytest.raises(ValueError, match="noise_multiplier must be smaller than 2 \\* unclipped_num_std"):
        engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), data_loader=loader(*batch()),
            noise_multiplier=5.0, max_grad_norm=FLAT, clipping="adaptive", **ADAPTIVE,
        )  # fmt: skip


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_clip_grad_reads_a_callable_threshold_in_every_pass(clipping):
    """Without the engine: ``ClipGrad(max_norm=callable)`` clips each pass at what the
    callable returns then; ``unclipped`` counts the flat clip's ``c_i = 1``."""
    model = net()
    ref = copy.deepcopy(model)
    first = FLAT if clipping == "flat" else medians(model, *batch())
    current = {"max_norm": first}

    def threshold():
        max_norm = current["max_norm"]
        return max_norm if clipping == "flat" else dict(zip(model.parameters(), max_norm))

    clip = jacmem.ClipGrad(threshold, clipping=clipping)
    for t, factor in enumerate((1.0, 0.9)):
        current["max_norm"] = scaled(first, factor)
        X, y = passes(t)[0]
        model.zero_grad(set_to_none=True)
        with jacmem.extend(clip):
            nn.functional.cross_entropy(model(X), y).backward()
        close([p.grad for p in model.parameters()], clipped_sum(ref, [(X, y)], current["max_norm"], clipping), f"{t}")
        if clipping == "flat":
            grads = per_sample_grads(ref, X, y, cross_entropy, "sum").values()
            norms = torch.cat([g.flatten(1) for g in grads], 1).norm(dim=1)
            assert int(clip.unclipped) == int((current["max_norm"] / (norms + 1e-6) >= 1).sum()) > 0
        clip.reset()
