"""PrivacyEngine's Opacus 1.6 API: several private models in one process, each keyword
of ``make_private``, and the unsupported-module error's types.

Steps are checked in float64, with noise 0 and no Poisson sampling, against a
per-sample loop (one backward per sample), as in ``test_privacy.py``.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import opacus
import pytest
import torch
from opacus.accountants.utils import get_noise_multiplier
from opacus.validators.errors import UnsupportedModuleError as OpacusUnsupportedModuleError
from tests.support.privacy import FLAT, LR, N, batch, clip_factors, loader, loop_step, net, train
from tests.support.reference import cross_entropy, per_sample_grads
from torch import nn
from torch.nn import functional as F
from torch.nn.modules import module as module_hooks

import jacmem
from jacmem.derivatives import REGISTRY, register
from jacmem.engine import recorder
from jacmem.extensions.clipping import check
from jacmem.privacy import PrivacyEngine

pytestmark = [
    pytest.mark.usefixtures("float64_default"),
    pytest.mark.filterwarnings("ignore:Secure RNG turned off"),
    pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha"),
    pytest.mark.filterwarnings("ignore:PrivacyEngine detected new dataset"),
]

Z, D = 3, 5  # the generator's noise and output widths


def generator() -> nn.Module:
    """[N, Z] -> [N, D]."""
    return nn.Sequential(nn.Linear(Z, 4), nn.Tanh(), nn.Linear(4, D))


def discriminator() -> nn.Module:
    """[N, D] -> [N, 2] logits: real or fake."""
    return nn.Sequential(nn.Linear(D, 4), nn.Tanh(), nn.Linear(4, 2))


def sgd_private(engine: PrivacyEngine, model: nn.Module, n: int, max_norm: float, **kwargs):
    """``model`` made private by ``engine``: SGD, noise 0, batches of ``n`` rows."""
    data = loader(torch.zeros(n, 1), torch.zeros(n), batch_size=n)
    return engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), data_loader=data,
        noise_multiplier=0.0, max_grad_norm=max_norm, poisson_sampling=False, **kwargs,
    )  # fmt: skip


def clipped_sgd(params: list[nn.Parameter], rows: list[tuple], max_norm: float) -> list[torch.Tensor]:
    """``params`` after one SGD step on ``Σ_i clip(g_i) / len(rows)``, ``g_i`` the gradient
    of row ``i``'s loss ``rows[i]()``: the loop."""
    per_row = [torch.autograd.grad(loss(), params) for loss in rows]
    grads = {p: torch.stack([row[k] for row in per_row]) for k, p in enumerate(params)}
    c = clip_factors(grads, max_norm, "flat")
    return [(p - LR / len(rows) * torch.einsum("n,n...->...", c[p], grads[p])).detach() for p in params]


def assert_close(params, expected, what: str) -> None:
    for i, (p, e) in enumerate(zip(params, expected)):
        torch.testing.assert_close(p.detach(), e, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what} param {i}: {m}")


@pytest.fixture
def engines():
    """PrivacyEngines made on demand, detached after the test, however it ends."""
    made: list[PrivacyEngine] = []

    def make() -> PrivacyEngine:
        made.append(PrivacyEngine())
        return made[-1]

    yield make
    for eng in made:
        eng.detach()


def no_hooks_left(*models: nn.Module) -> None:
    for model in models:
        for m in model.modules():
            assert not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks, m
        assert not any(p._backward_hooks for p in model.parameters())
    assert not recorder.tracked_models() and recorder.SINK[0] is None


# -- several private models, and a block beside them ----------------------------------------


def test_a_gan_two_private_models_alternating_equal_the_loop(engines):
    """Discriminator and generator, each private with its own engine, alternate steps;
    the generator's loss goes through the discriminator, whose block clips its own part.
    A jacmem.extend block on a third model runs between the steps."""
    g, d, third = generator(), discriminator(), net()
    g_ref, d_ref = copy.deepcopy(g), copy.deepcopy(d)
    c_g, c_d = 0.3, 0.5
    _, opt_g, _ = sgd_private(engines(), g, N, c_g)
    _, opt_d, _ = sgd_private(engines(), d, 2 * N, c_d)
    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        z, real = torch.randn(N, Z, generator=gen), torch.randn(N, D, generator=gen)
        labels = torch.cat([torch.ones(N), torch.zeros(N)]).long()

        # the discriminator, on real and fake rows: 2N samples
        X = torch.cat([real, g(z).detach()])
        train(d, opt_d, [(X, labels)])
        X_ref = torch.cat([real, g_ref(z).detach()])
        rows = [lambda i=i: F.cross_entropy(d_ref(X_ref[i : i + 1]), labels[i : i + 1]) for i in range(2 * N)]
        expected = clipped_sgd(list(d_ref.parameters()), rows, c_d)
        assert_close(d.parameters(), expected, f"step {step}: discriminator")
        with torch.no_grad():
            for p, e in zip(d_ref.parameters(), expected):
                p.copy_(e)

        # the generator, through the discriminator
        train(nn.Sequential(g, d), opt_g, [(z, torch.ones(N).long())])
        rows = [lambda i=i: F.cross_entropy(d_ref(g_ref(z[i : i + 1])), torch.ones(1).long()) for i in range(N)]
        expected = clipped_sgd(list(g_ref.parameters()), rows, c_g)
        assert_close(g.parameters(), expected, f"step {step}: generator")
        with torch.no_grad():
            for p, e in zip(g_ref.parameters(), expected):
                p.copy_(e)

        # a plain block on another model, while both are private
        X3, y3 = batch(seed=step)
        with jacmem.extend(jacmem.BatchGrad()):
            F.cross_entropy(third(X3), y3).backward()
        for p, ps in per_sample_grads(third, X3, y3, cross_entropy).items():
            torch.testing.assert_close(p.grad_batch, ps, rtol=1e-10, atol=1e-12)


def test_two_private_models_of_the_same_architecture_each_clip_their_own():
    """Two private models side by side, and their detach: each equals the loop, and
    nothing of either stays behind."""
    models = [net(), net()]
    twins = [copy.deepcopy(m) for m in models]
    engs = [PrivacyEngine(), PrivacyEngine()]
    opts = [sgd_private(eng, m, N, FLAT)[1] for eng, m in zip(engs, models)]
    batches = [batch(seed=1), batch(seed=2)]
    for model, opt, b in zip(models, opts, batches):
        train(model, opt, [b])
    for model, twin, b in zip(models, twins, batches):
        assert_close(model.parameters(), loop_step(twin, [b], FLAT, "flat"), "model")
    assert [eng.detach() for eng in engs] == models
    no_hooks_left(*models)
    fresh = net()  # never private: autograd's own gradient
    fresh.load_state_dict(models[0].state_dict())
    X, y = batches[0]
    expected = torch.autograd.grad(F.cross_entropy(fresh(X), y), list(fresh.parameters()))
    models[0].zero_grad()
    F.cross_entropy(models[0](X), y).backward()
    for p, e in zip(models[0].parameters(), expected):
        torch.testing.assert_close(p.grad, e, rtol=0, atol=0)


def test_the_same_model_twice_is_refused_naming_detach(engines):
    model = net()
    first = engines()
    sgd_private(first, model, N, FLAT)
    for eng in (first, engines()):
        with pytest.raises(ValueError, match=r"detach\(\)"):
            sgd_private(eng, model, N, FLAT)
    with pytest.raises(ValueError, match="detach"):
        sgd_private(engines(), model[4], N, FLAT)  # a part of it shares its parameters
    with pytest.raises(ValueError, match=r"detach\(\)"):
        jacmem.untrack(model)
    first.detach()
    no_hooks_left(model)
    twin = copy.deepcopy(model)
    _, opt, _ = sgd_private(first, model, N, FLAT)  # private anew
    train(model, opt, [batch()])
    assert_close(model.parameters(), loop_step(twin, [batch()], FLAT, "flat"), "after detach")


def test_a_model_given_to_track_is_refused_naming_untrack(engines):
    model = jacmem.track(net())
    try:
        with pytest.raises(ValueError, match=r"jacmem.untrack\(model\)"):
            sgd_private(engines(), model, N, FLAT)
    finally:
        jacmem.untrack(model)
    no_hooks_left(model)


def test_detach_after_a_failed_make_private_leaves_nothing(engines):
    model = net()
    with pytest.raises(TypeError, match="unexpected keyword"):
        sgd_private(engines(), model, N, FLAT, no_such_keyword=1)
    no_hooks_left(model)


class SequenceFirst(nn.Module):
    """``[T, N]`` token ids -> ``[N, 2]``: Embedding, then Linear on ``[T, N, 4]``, summed over T."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(7, 4), nn.Linear(4, 2)

    def forward(self, ids):
        return self.fc(self.emb(ids)).sum(0)


def test_batch_first_false_clips_each_sample_not_each_step(engines):
    """``[T, N]`` inputs: the clip is per sample (axis 1), as the loop over axis 1 and
    Opacus's own ``make_private(batch_first=False)`` on a copy take it."""
    torch.manual_seed(0)
    T, max_norm = 5, 0.3
    ids, y = torch.randint(0, 7, (T, N)), torch.randint(0, 2, (N,))
    model = SequenceFirst()
    theirs = copy.deepcopy(model)
    params = list(model.parameters())
    rows = [lambda i=i: F.cross_entropy(model(ids[:, i : i + 1]), y[i : i + 1]) for i in range(N)]
    expected = clipped_sgd(params, rows, max_norm)

    def step(engine, m):
        data = loader(ids.T, y, batch_size=N)  # the loader's rows are samples; the model takes [T, N]
        m, opt, _ = engine.make_private(
            module=m, optimizer=torch.optim.SGD(m.parameters(), lr=LR), data_loader=data, noise_multiplier=0.0,
            max_grad_norm=max_norm, poisson_sampling=False, batch_first=False,
        )  # fmt: skip
        opt.zero_grad()
        F.cross_entropy(m(ids), y).backward()
        opt.step()

    step(engines(), model)
    assert_close(params, expected, "jacmem, batch_first=False")
    opacus_engine = opacus.PrivacyEngine()
    step(opacus_engine, theirs)
    assert_close(list(theirs.parameters()), expected, "Opacus, batch_first=False")


# -- each keyword ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ew", "no_op", "ghost", "ghost_fsdp"])
def test_every_grad_sample_mode_is_one_code_path(engines, mode):
    """Opacus's modes all clip as the loop does; a ghost mode returns the criterion
    too, as Opacus, and ``criterion(out, y).backward()`` is the private backward."""
    model, criterion = net(), nn.CrossEntropyLoss()
    twin = copy.deepcopy(model)
    out = sgd_private(engines(), model, N, FLAT, criterion=criterion, grad_sample_mode=mode)
    ghost = "ghost" in mode
    assert len(out) == (4 if ghost else 3) and out[0] is model
    if ghost:
        assert out[2] is criterion
    opt = out[1]
    X, y = batch()
    opt.zero_grad()
    criterion(model(X), y).backward()
    opt.step()
    assert_close(model.parameters(), loop_step(twin, [(X, y)], FLAT, "flat"), mode)


def test_the_ghost_return_matches_opacus():
    model, twin = net(), net()
    returned = opacus.PrivacyEngine().make_private(
        module=twin, optimizer=torch.optim.SGD(twin.parameters(), lr=LR),
        criterion=nn.CrossEntropyLoss(), data_loader=loader(*batch()), noise_multiplier=0.0, max_grad_norm=FLAT,
        grad_sample_mode="ghost",
    )  # fmt: skip
    eng = PrivacyEngine()
    try:
        ours = sgd_private(eng, model, N, FLAT, criterion=nn.CrossEntropyLoss(), grad_sample_mode="ghost")
        assert len(ours) == len(returned) == 4
        assert isinstance(ours[3], torch.utils.data.DataLoader) and isinstance(returned[3], torch.utils.data.DataLoader)
    finally:
        eng.detach()


def test_bad_grad_sample_mode_and_criterion_reduction_raise(engines):
    with pytest.raises(ValueError, match="grad_sample_mode: bogus"):
        sgd_private(engines(), net(), N, FLAT, grad_sample_mode="bogus")
    with pytest.raises(ValueError, match="reduction"):
        sgd_private(engines(), net(), N, FLAT, grad_sample_mode="ghost", criterion=nn.CrossEntropyLoss(reduction="sum"))


@pytest.mark.parametrize("wrap_model", [True, False])
def test_wrap_model_returns_the_users_module(engines, wrap_model):
    model = net()
    assert sgd_private(engines(), model, N, FLAT, wrap_model=wrap_model)[0] is model


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_noise_generator_gives_opacus_noise(engines, reduction):
    """The same generator seed gives the same noised step as Opacus's engine (jacmem
    draws the noise at ``σC/B`` and adds the scaled sum into it, under "mean")."""
    model = net()
    twin = copy.deepcopy(model)
    X, y = batch()

    def make(eng, m):
        return eng.make_private(
            module=m, optimizer=torch.optim.SGD(m.parameters(), lr=LR), data_loader=loader(X, y),
            noise_multiplier=1.3, max_grad_norm=FLAT, poisson_sampling=False, loss_reduction=reduction,
            noise_generator=torch.Generator().manual_seed(7),
        )  # fmt: skip

    def loss(out, target, _):
        return cross_entropy(out, target, reduction)

    wrapped, opt_o, _ = make(opacus.PrivacyEngine(), twin)
    train(wrapped, opt_o, [(X, y)], loss)
    _, opt, _ = make(engines(), model)
    train(model, opt, [(X, y)], loss)
    assert_close(model.parameters(), [p.detach() for p in twin.parameters()], "noised step")


@pytest.mark.slow
def test_make_private_with_epsilon_takes_opacus_keywords(engines):
    model = net()
    data = loader(*batch(), batch_size=2)
    out = engines().make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), data_loader=data, target_epsilon=2.0,
        target_delta=1e-5, epochs=3, max_grad_norm=1.0, epsilon_tolerance=0.5, criterion=nn.CrossEntropyLoss(),
        grad_sample_mode="ghost", batch_first=True, wrap_model=False, noise_generator=torch.Generator(),
        rand_on_empty=False,
    )  # fmt: skip
    expected = get_noise_multiplier(
        target_epsilon=2.0, target_delta=1e-5, sample_rate=1 / len(data), epochs=3, accountant="prv",
        epsilon_tolerance=0.5,
    )  # fmt: skip
    assert len(out) == 4 and out[1].noise_multiplier == expected
    model = net()
    with pytest.raises(TypeError, match="no_such_keyword"):
        engines().make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), data_loader=data,
            target_epsilon=2.0, target_delta=1e-5, epochs=3, max_grad_norm=1.0, no_such_keyword=0,
        )  # fmt: skip


# -- the unsupported-module error -------------------------------------------------------------


class ScaleShift(nn.Module):
    """x ⊙ weight + bias."""

    def __init__(self, d: int = 3):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(d)), nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.weight + self.bias


@pytest.fixture
def weight_only():
    """``ScaleShift`` registered for its weight alone; the registry is restored afterwards."""
    register(ScaleShift, "weight", "batch_grad", "mine")(lambda x, g: g * x)
    yield
    REGISTRY.pop(ScaleShift, None)


@pytest.mark.parametrize("uncovered", [False, True], ids=["batchnorm", "uncovered parameter"])
def test_unsupported_module_error_is_a_valueerror_and_opacus_error(request, uncovered):
    if uncovered:
        request.getfixturevalue("weight_only")
    model = ScaleShift() if uncovered else nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4))
    with pytest.raises(jacmem.UnsupportedModuleError, match="bias" if uncovered else "BatchNorm2d") as info:
        check(model)
    assert isinstance(info.value, ValueError) and isinstance(info.value, OpacusUnsupportedModuleError)
    eng = PrivacyEngine()
    with pytest.raises(OpacusUnsupportedModuleError):
        sgd_private(eng, model, N, 1.0)
    no_hooks_left(model)
    assert jacmem.errors.UnsupportedModuleError is jacmem.UnsupportedModuleError


def test_core_imports_without_opacus_and_the_error_is_a_valueerror():
    code = (
        "import sys; sys.modules['opacus'] = None\n"
        "import jacmem\n"
        "assert jacmem.UnsupportedModuleError.__bases__ == (ValueError,), jacmem.UnsupportedModuleError.__bases__\n"
        "print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "ok", done.stderr


def test_no_global_hooks_while_private(engines):
    """A private model adds no global module hook (conftest checks that none is left)."""
    before = (len(module_hooks._global_forward_pre_hooks), len(module_hooks._global_forward_hooks))
    sgd_private(engines(), net(), N, FLAT)
    sgd_private(engines(), net(), N, FLAT)
    assert (len(module_hooks._global_forward_pre_hooks), len(module_hooks._global_forward_hooks)) == before
