"""The engine's contracts and messages (issue 13): the registry boundary, compute-once
beside second order, BackPACK habits, and warnings that stay short on large models."""

from __future__ import annotations

import warnings

import pytest
import torch
from tests.support.reference import check_against, mse, per_sample_grads
from torch import nn

import jacmem
from jacmem import derivatives
from jacmem.derivatives import REGISTRY
from jacmem.engine.planner import ContractError

DT = torch.float64


class Scale(nn.Module):
    """y = x * w on the last axis: a module jacmem does not know."""

    def __init__(self, features: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(features, dtype=DT))

    def forward(self, x):
        return x * self.w


@pytest.fixture
def registered():
    """Register strategies for :class:`Scale` in the test; the registry is restored after."""
    yield lambda *args, **kwargs: jacmem.register(Scale, "w", *args, **kwargs)
    REGISTRY.pop(Scale, None)


def scale_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3).double(), Scale(3))


# -- the registry boundary -------------------------------------------------------------


def test_a_strategy_with_the_wrong_shape_raises_naming_module_parameter_and_strategy(registered):
    @registered("batch_grad", "summed_by_mistake")
    def wrong(x, g):
        return (g * x).sum(0)  # [3], not [N, 3]

    model = scale_model()
    with pytest.raises(ContractError, match=r"'summed_by_mistake'.*batch_grad.*'w'.*'1'.*\[3\].*\[5, 3\]"):
        with jacmem.extend(jacmem.BatchGrad()):
            model(torch.randn(5, 4, dtype=DT)).sum().backward()
    assert not hasattr(model[1].w, "grad_batch") and not hasattr(model[0].weight, "grad_batch")
    assert Scale in REGISTRY  # (the fixture removes it)


@pytest.mark.parametrize("quantity", ["batch_l2", "sum_grad_squared"])
def test_a_direct_strategy_with_the_wrong_shape_or_dtype_raises(registered, quantity):
    @registered("batch_grad", "right")
    def right(x, g):
        return g * x

    @registered(quantity, "wrong_dtype")
    def wrong(x, g):
        q = (g * x).square()
        return (q.sum(1) if quantity == "batch_l2" else q.sum(0)).float()  # float32 in a float64 pass

    model = scale_model()
    ext = jacmem.BatchL2Grad() if quantity == "batch_l2" else jacmem.SumGradSquared()
    with pytest.raises(ContractError, match=rf"'wrong_dtype' for {quantity}.*torch.float32.*torch.float64"):
        with jacmem.extend(ext, strategy={"1": "wrong_dtype"}):
            model(torch.randn(5, 4, dtype=DT)).sum().backward()


def test_a_right_user_strategy_passes_the_check(registered):
    @registered("batch_grad", "right")
    def right(x, g):
        return g * x

    model = scale_model()
    X = torch.randn(5, 4, dtype=DT)
    reference = per_sample_grads(model, X, torch.zeros(5, 3, dtype=DT), lambda out, y, reduction: out.sum())
    with jacmem.extend(jacmem.BatchGrad()):
        model(X).sum().backward()
    check_against(model, reference, ["grad_batch"])


def test_a_failing_strategy_suggests_only_the_others(registered):
    """No double period, and the strategy that failed is not suggested."""

    @registered("batch_grad", "only")
    def only(x, g):
        raise ArithmeticError("it failed here.")

    model = scale_model()
    with pytest.raises(RuntimeError) as info:
        with jacmem.extend(jacmem.BatchGrad()):
            model(torch.randn(5, 4, dtype=DT)).sum().backward()
    msg = str(info.value)
    assert "failed: it failed here (strategy 'only')." in msg, msg
    assert ".." not in msg and "among" not in msg and "no other strategy" in msg, msg

    @registered("batch_grad", "other")
    def other(x, g):
        return g * x

    with pytest.raises(RuntimeError) as info:
        with jacmem.extend(jacmem.BatchGrad(), strategy={Scale: "only"}):
            model(torch.randn(5, 4, dtype=DT)).sum().backward()
    msg = str(info.value)
    assert "with a name among ['other']" in msg and ".." not in msg, msg


# -- compute-once beside second order ---------------------------------------------------


def test_compute_once_stays_on_with_a_second_order_extension():
    """Linear and Conv run through ComputeOnce with DiagGGNExact in the block too; per-sample
    gradients match autograd's per-sample loop in float64, and .grad matches autograd's."""
    torch.manual_seed(3)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 5), nn.Tanh(), nn.Linear(5, 3)
    ).to(DT)
    X, y = torch.randn(4, 2, 6, 6, dtype=DT), torch.randint(0, 3, (4,))
    lossf = nn.CrossEntropyLoss()
    reference = per_sample_grads(
        model, X, y, lambda out, y, reduction: nn.CrossEntropyLoss(reduction=reduction)(out, y)
    )
    model.zero_grad()
    lossf(model(X), y).backward()
    grads = {p: p.grad.clone() for p in model.parameters()}
    model.zero_grad()
    with jacmem.extend(jacmem.BatchGrad(), jacmem.DiagGGNExact()):
        out = model(X)
        fns = [type(m(torch.zeros(1, *s, dtype=DT)).grad_fn).__name__ for m, s in ((model[0], (2, 6, 6)),)]
        lossf(out, y).backward()
    assert fns == ["ComputeOnceBackward"], "compute-once was switched off by the second-order extension"
    check_against(model, reference, ["grad_batch"])
    for p in model.parameters():
        torch.testing.assert_close(p.grad, grads[p])
        assert p.diag_ggn_exact.shape == p.shape


# -- BackPACK habits ------------------------------------------------------------------


def test_extend_of_a_model_says_what_to_call():
    with pytest.raises(TypeError, match=r"jacmem.track\(model\).*BatchGrad"):
        jacmem.extend(nn.Linear(2, 2))


def test_forward_before_the_block_on_an_untracked_model_warns_naming_track():
    model = nn.Sequential(nn.Linear(4, 3)).to(DT)
    loss = model(torch.randn(2, 4, dtype=DT)).sum()
    with pytest.warns(UserWarning, match=r"jacmem.track\(model\)"):
        with jacmem.extend(jacmem.BatchGrad()):
            loss.backward()
    assert not hasattr(model[0].weight, "grad_batch")
    assert torch.autograd.backward.__module__ == "torch.autograd", "the block left its wrapper behind"


def test_no_warning_where_the_block_saw_the_forward_or_the_model_is_tracked():
    model = nn.Sequential(nn.Linear(4, 3)).to(DT)
    X = torch.randn(2, 4, dtype=DT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with jacmem.extend(jacmem.BatchGrad()):
            model(X).sum().backward()
            torch.autograd.grad(model(X).sum(), [model[0].weight])
        jacmem.track(model)
        try:
            loss = model(X).sum()
            with jacmem.extend(jacmem.BatchGrad()):
                loss.backward()
        finally:
            jacmem.untrack(model)
        with jacmem.extend(jacmem.BatchGrad()):  # no parameter in the graph: nothing to say
            (torch.randn(3, dtype=DT, requires_grad=True) * 2).sum().backward()
    assert model[0].weight.grad_batch.shape == (2, 3, 4)


def _read_outside_every_module():
    """A Linear whose container holds ``logit_scale``, and a free parameter, both read in
    the loss (as CLIP's is): the model, the free parameter and the loss's maker."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3)).to(DT)
    model.logit_scale = nn.Parameter(torch.tensor(0.5, dtype=DT))
    free = nn.Parameter(torch.randn(3, dtype=DT))
    X, y = torch.randn(5, 4, dtype=DT), torch.tensor([0, 1, 2, 0, 1])

    def loss():
        return nn.functional.cross_entropy(model(X) * model.logit_scale.exp() + free, y)

    return model, free, loss


@pytest.mark.parametrize("extension", [jacmem.BatchGrad(), jacmem.BatchL2Grad(), jacmem.Variance()], ids=type)
def test_a_parameter_read_outside_every_module_call_warns_naming_it(extension):
    """A parameter the loss reads outside every module's forward (CLIP's ``logit_scale``
    applied in the loss; a free ``nn.Parameter``) gets ``.grad`` and none of the block's
    results: the block says so, naming it, once, instead of leaving it silently without
    (the model's other parameters get theirs)."""
    model, free, loss = _read_outside_every_module()

    with pytest.warns(UserWarning, match=r"reached .*got \.grad but none of the block's results.*nn\.Module") as said:
        with jacmem.extend(extension):
            loss().backward()
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                loss().backward()  # said once per parameter and block
    (message,) = [str(w.message) for w in said if "got .grad" in str(w.message)]
    assert "'Sequential.logit_scale'" in message and "a parameter of shape [3]" in message
    field = extension.savefield
    assert all(hasattr(p, field) for p in model[0].parameters())
    assert not hasattr(model.logit_scale, field) and not hasattr(free, field)
    with warnings.catch_warnings():  # gradients asked of the recorded parameters only: nothing to say
        warnings.simplefilter("error")
        with jacmem.extend(extension):
            torch.autograd.grad(loss(), [model[0].weight])
            loss().backward(inputs=[model[0].bias])


def test_a_parameter_read_outside_every_module_call_refuses_curvature():
    """Second order raises before the backward instead, naming both: the root's
    ``logit_scale`` (the generic recomputation of the root's call, which does not read
    it, gave it a GGN diagonal of 0) and the free parameter; asked only for the recorded
    parameters, it gives them theirs."""
    model, free, loss = _read_outside_every_module()

    with pytest.raises(jacmem.UnsupportedCurvatureError) as err, jacmem.extend(jacmem.DiagGGNExact()):
        loss().backward()
    said = str(err.value)
    assert "'logit_scale' of module 'Sequential' (Sequential)" in said and "a parameter of shape [3]" in said
    assert not any(hasattr(p, "diag_ggn_exact") for p in [*model.parameters(), free])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with jacmem.extend(jacmem.DiagGGNExact()):
            loss().backward(inputs=list(model[0].parameters()))
    assert all(hasattr(p, "diag_ggn_exact") for p in model[0].parameters()) and model.logit_scale.grad is None


def _saved_and_loaded(model: nn.Module) -> nn.Module:
    import io

    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_of_a_tracked_model_runs_as_an_untracked_one(how):
    """``copy.deepcopy`` of a tracked model (an EMA or evaluation copy; ``PrivacyEngine``
    tracks its model), or ``torch.save`` of the whole model and ``torch.load``, copies its
    modules' hooks, not its tracking: the copy runs as a model jacmem never saw (its
    forward raised a KeyError before, and ``torch.save`` could not pickle the hooks), and
    inside a block its calls are recorded like any model's, exactly."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)
    X = torch.randn(3, 4, dtype=DT)
    jacmem.track(model)
    try:
        twin = copy.deepcopy(model) if how == "deepcopy" else _saved_and_loaded(model)
        twin(X).sum().backward()
        assert all(p.grad is not None and not hasattr(p, "grad_batch") for p in twin.parameters())
        y = torch.randn(3, 3, dtype=DT)
        reference = per_sample_grads(twin, X, y, mse, "sum")
        twin.zero_grad(set_to_none=True)
        with jacmem.extend(jacmem.BatchGrad()):
            mse(twin(X), y, "sum").backward()
        check_against(twin, reference, ["grad_batch"])
    finally:
        jacmem.untrack(model)


# -- aggregated warnings --------------------------------------------------------------


def bn_net(blocks: int = 6):
    layers = []
    for _ in range(blocks):
        layers += [nn.Linear(4, 4), nn.BatchNorm1d(4)]
    return nn.Sequential(*layers, nn.Linear(4, 3)).to(DT).eval()


def test_kfac_refuses_many_unsupported_modules_in_one_error():
    """resnet18 gave twenty warnings, one per BatchNorm, beside the other layers' results:
    one error before the backward, naming five parameters and the count of the others,
    which it lists (``params``); nothing is written."""
    model, lossf = bn_net(), nn.CrossEntropyLoss()
    X, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))
    with pytest.raises(jacmem.UnsupportedCurvatureError, match=r"of module '\d+' \(BatchNorm1d\) and 7 more") as err:
        with jacmem.extend(jacmem.KFLR()):
            lossf(model(X), y).backward()
    norms = {id(p) for m in model if isinstance(m, nn.BatchNorm1d) for p in m.parameters()}
    assert {id(p) for p in err.value.params} == norms
    assert not any(hasattr(p, "kflr") for p in model.parameters())


def test_first_order_unsupported_parameters_raise_at_the_first_met():
    """Five modules no derivative covers: the backward raises at the first it meets (the
    last, '9'), naming it and its parameter, and writes nothing; it warned once for all
    five and gave them nothing."""

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = nn.Parameter(torch.ones(4, dtype=DT))
            self.register_buffer("running", torch.zeros((), dtype=DT))

        def forward(self, x):
            self.running.add_(1)  # a buffer it mutates: no generic fallback in training mode
            return x @ torch.diag(self.p)  # not a broadcast jacmem can make explicit

    if derivatives.lookup(Odd()) is not None:
        pytest.skip("jacmem handles Odd now")
    model = nn.Sequential(*[m for _ in range(5) for m in (nn.Linear(4, 4), Odd())]).to(DT)
    with pytest.raises(jacmem.UnsupportedModuleError, match=r"module '9' \(Odd\) has trainable parameter\(s\) \['p'\]"):
        with jacmem.extend(jacmem.BatchGrad()):
            model(torch.randn(3, 4, dtype=DT)).sum().backward()
    assert not any(hasattr(p, "grad_batch") for p in model.parameters()), "a failed backward wrote results"


def test_batch_size_warning_names_at_most_three_modules_per_size():
    class Reshaped(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])
            self.second = nn.Sequential(*[nn.Linear(8, 8) for _ in range(5)])

        def forward(self, x):
            return self.second(self.first(x).reshape(-1, 8))

    model = Reshaped().to(DT)
    with pytest.warns(RuntimeWarning, match="different batch sizes") as caught:
        with jacmem.extend(jacmem.BatchGrad()):
            model(torch.randn(6, 4, dtype=DT)).sum().backward()
    msg = str(caught[0].message)
    assert "6: " in msg and "3: " in msg and msg.count("and 3 more") == 1 and msg.count("and 2 more") == 1, msg
    assert msg.count("'first.") == 3 and msg.count("'second.") == 3, msg
