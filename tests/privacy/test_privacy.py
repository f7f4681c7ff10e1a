"""jacmem.privacy.PrivacyEngine against a per-sample loop and against Opacus 1.6.

With noise 0 and no Poisson sampling, one step of SGD moves the parameters by
``-lr/B · Σ_i clip_C(g_i)``, ``g_i`` the gradient of sample ``i``'s own loss term (the
loop: one backward per sample, in float64), and equals what Opacus's own engine does on
a copy of the model. The noise, the accountant, the data loader and the noise
multiplier are Opacus's: checked against Opacus fed the same inputs.
"""

from __future__ import annotations

import copy
import faulthandler
import threading
import warnings

import opacus
import pytest
import torch
from opacus.accountants import create_accountant
from opacus.accountants.utils import get_noise_multiplier
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from opacus.utils.batch_memory_manager import BatchMemoryManager
from tests.support.clipping import expected as expected_clipped
from tests.support.clipping import per_sample
from tests.support.distributed import needs_gloo, run_ranks
from tests.support.privacy import FLAT, LR, N, batch, clip_factors, loader, loop_step, medians, net, private, train
from tests.support.reference import REFERENCE, cross_entropy, per_sample_grads
from torch import nn

import jacmem.context
from jacmem.engine import recorder
from jacmem.privacy import DPOptimizer, PrivacyEngine

pytestmark = [
    pytest.mark.usefixtures("float64_default"),
    pytest.mark.filterwarnings("ignore:Secure RNG turned off"),
    pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha"),
]


@pytest.fixture
def engine():
    """A PrivacyEngine whose model is detached after the test, however it ends."""
    eng = PrivacyEngine()
    yield eng
    eng.detach()


def opacus_step(model, max_norm, clipping, batches) -> list[torch.Tensor]:
    """Opacus's own engine (per-sample hooks), on a copy, the same step."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    wrapped, opt, _ = opacus.PrivacyEngine().make_private(
        module=model, optimizer=opt, data_loader=loader(*batch()), noise_multiplier=0.0, max_grad_norm=max_norm,
        poisson_sampling=False, clipping=clipping,
    )  # fmt: skip
    train(wrapped, opt, batches)
    return [p.detach() for p in model.parameters()]


def opacus_private(model):
    """Opacus's own engine (per-sample hooks) on ``model``, SGD at threshold FLAT, noise 0."""
    return opacus.PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), data_loader=loader(*batch()),
        noise_multiplier=0.0, max_grad_norm=FLAT, poisson_sampling=False,
    )  # fmt: skip


def assert_params(model, expected, what: str) -> None:
    for i, (p, e) in enumerate(zip(model.parameters(), expected)):
        torch.testing.assert_close(p.detach(), e, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what} param {i}: {m}")


@pytest.mark.parametrize("clipping", ["flat", "per_layer", "automatic"])
def test_one_step_equals_the_loop_and_opacus(engine, clipping):
    model = net()
    twin = copy.deepcopy(model)
    batches = [batch()]
    max_norm = {"flat": FLAT, "per_layer": medians(model, *batches[0]), "automatic": 0.7}[clipping]
    factors = clip_factors(per_sample_grads(model, *batches[0], cross_entropy, "sum"), max_norm, clipping)
    if clipping != "automatic":  # the thresholds clip some samples, not all
        c = torch.cat(list(factors.values()))
        assert (c < 1).any(), c
    expected = loop_step(twin, batches, max_norm, clipping)
    returned, opt, _ = private(engine, model, max_norm, clipping)
    assert returned is model
    train(model, opt, batches)
    assert_params(model, expected, "loop")
    if clipping != "automatic":  # not in Opacus
        assert_params(model, opacus_step(twin, max_norm, clipping, batches), "opacus")


def test_two_backward_passes_then_one_step(engine):
    """Virtual batches: the clipped sums of both passes add up, divided by 2B (as
    Opacus's per-sample optimizer divides accumulated batches); the accountant counts
    the step at twice the sampling rate."""
    model = net()
    twin = copy.deepcopy(model)
    batches = [batch(seed=1), batch(seed=2)]
    _, opt, _ = private(engine, model, FLAT)
    train(model, opt, batches)
    assert_params(model, loop_step(twin, batches, FLAT, "flat"), "loop")
    assert_params(model, opacus_step(twin, FLAT, "flat", batches), "opacus")
    assert engine.accountant.history == [(0.0, 2 / 1, 1)]  # one batch per epoch: q = 1, twice
    train(model, opt, batches[:1])  # the count starts afresh after a step
    assert engine.accountant.history == [(0.0, 2.0, 1), (0.0, 1.0, 1)]


def test_a_grad_left_before_make_private_is_not_in_the_first_step(engine):
    """A plain backward before ``make_private`` leaves unclipped gradients in ``.grad``;
    a loop that zeroes them after each step (backward, step, zero_grad) added them to
    the first step's clipped sum, a privacy leak. ``make_private`` drops them, as
    Opacus's step ignores them: the first step is the loop's, and Opacus's."""
    model = net()
    twin, theirs = copy.deepcopy(model), copy.deepcopy(model)
    X, y = batch(seed=1)
    warm_X, warm_y = batch(seed=2)
    for m, make_private in ((model, lambda m: private(engine, m, FLAT)), (theirs, opacus_private)):
        nn.functional.cross_entropy(m(warm_X), warm_y).backward()
        wrapped, opt, _ = make_private(m)
        nn.functional.cross_entropy(wrapped(X), y).backward()
        opt.step()
        opt.zero_grad()
    expected = loop_step(twin, [(X, y)], FLAT, "flat")
    assert_params(model, expected, "loop")
    assert_params(theirs, expected, "opacus")


def test_a_param_group_added_after_make_private_steps_as_the_loop(engine):
    """``optimizer.add_param_group`` after ``make_private``, with the module's other
    parameters (unfreezing the body): its ``.grad`` from a warm-up before was dropped
    too, and the first step, without a ``zero_grad`` since, is the loop's (it raised an
    AttributeError, 'summed_grad', as Opacus's optimizers do)."""
    model = net()
    twin = copy.deepcopy(model)
    nn.functional.cross_entropy(model(batch(seed=2)[0]), batch(seed=2)[1]).backward()
    data = loader(*batch())
    _, opt, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model[4].parameters(), lr=LR), data_loader=data,
        noise_multiplier=0.0, max_grad_norm=FLAT, poisson_sampling=False,
    )  # fmt: skip
    opt.add_param_group({"params": [p for layer in model[:2] for p in layer.parameters()]})
    X, y = batch(seed=1)
    nn.functional.cross_entropy(model(X), y).backward()
    opt.step()
    assert_params(model, loop_step(twin, [(X, y)], FLAT, "flat"), "loop")


def test_a_backward_to_the_inputs_alone_is_not_a_pass(engine):
    """``torch.autograd.grad`` of the loss with respect to the inputs (an adversarial
    example, a saliency map) between ``zero_grad`` and the training backward reaches no
    parameter: it clips nothing and is not one of the step's backward passes. It counted
    as one, so the step was divided by 2B (half the loop's) and the accountant charged
    twice the sampling rate. An empty batch's pass is one."""
    model = net()
    twin = copy.deepcopy(model)
    X, y = batch(seed=1)
    _, opt, _ = private(engine, model, FLAT)
    opt.zero_grad()
    inputs = X.clone().requires_grad_(True)
    torch.autograd.grad(nn.functional.cross_entropy(model(inputs), y), inputs)
    nn.functional.cross_entropy(model(X), y).backward()
    opt.step()
    assert_params(model, loop_step(twin, [(X, y)], FLAT, "flat"), "loop")
    assert engine.accountant.history == [(0.0, 1.0, 1)]
    opt.zero_grad()  # a pass on an empty batch reaches the parameters: it is one
    nn.functional.cross_entropy(model(X[:0]), y[:0], reduction="sum").backward()
    nn.functional.cross_entropy(model(X), y).backward()
    opt.step()
    assert engine.accountant.history == [(0.0, 1.0, 1), (0.0, 2.0, 1)]


def test_micro_batches_of_different_sizes_in_one_backward_raise_naming_the_fix(engine):
    """One backward of the summed losses of micro-batches of different samples: row n of
    each call is sample n (two views of one sample), so micro-batches of 5 and 3 samples
    cannot be told apart as samples; it raises naming the module and the fix (one
    backward per micro-batch), not a strategy to try. Nothing is written; the fix steps
    as the loop."""
    model = net()
    twin = copy.deepcopy(model)
    X, y = batch(8, seed=1)
    parts = (slice(0, 5), slice(5, 8))
    _, opt, _ = private(engine, model, FLAT)
    opt.zero_grad()
    with pytest.raises(ValueError, match=r"module '4' \(Linear\) is used with batch sizes 3 and 5.*backward pass each"):
        sum(nn.functional.cross_entropy(model(X[i]), y[i]) for i in parts).backward()
    assert all(p.grad is None for p in model.parameters())
    train(model, opt, [(X[i], y[i]) for i in parts])
    # the loop's step on the 8 samples divides by 8; the engine's by B·k = 2N (two passes)
    loop = loop_step(twin, [(X, y)], FLAT, "flat")
    assert_params(model, [(p + (e - p) * 8 / (2 * N)).detach() for p, e in zip(twin.parameters(), loop)], "loop")


def physical_steps(model, opt, data_loader, zero_grad) -> int:
    """One epoch through Opacus's ``BatchMemoryManager`` (physical batches of 2), a step
    after each backward pass; ``zero_grad(opt)`` before each backward. The number of
    physical batches whose step ran before a ``ValueError``, or all of them."""
    with BatchMemoryManager(data_loader=data_loader, max_physical_batch_size=2, optimizer=opt) as physical:
        for done, (X, y) in enumerate(physical):
            zero_grad(opt)
            nn.functional.cross_entropy(model(X), y).backward()
            try:
                opt.step()
            except ValueError as e:
                assert "zero_grad" in str(e), e
                return done
    return done + 1


def test_batch_memory_manager_without_zero_grad_raises_as_opacus(engine):
    """Each step BatchMemoryManager skips leaves ``.grad`` accumulated: the next step
    without ``zero_grad`` would count it twice. Opacus's optimizer raises a ValueError
    at the second physical batch; jacmem's too, before any parameter moved."""
    model = net()
    twin = copy.deepcopy(model)
    before = [p.detach().clone() for p in model.parameters()]
    _, opt, data_loader = private(engine, model, FLAT)
    assert physical_steps(model, opt, data_loader, zero_grad=lambda opt: None) == 1
    assert_params(model, before, "unmoved")
    twin_opt = torch.optim.SGD(twin.parameters(), lr=LR)
    wrapped, twin_opt, twin_loader = opacus.PrivacyEngine().make_private(
        module=twin, optimizer=twin_opt, data_loader=loader(*batch()), noise_multiplier=0.0, max_grad_norm=FLAT,
        poisson_sampling=False,
    )  # fmt: skip
    assert physical_steps(wrapped, twin_opt, twin_loader, zero_grad=lambda opt: None) == 1


@pytest.mark.parametrize("set_to_none", [True, False])
def test_batch_memory_manager_with_zero_grad_equals_the_loop(engine, set_to_none):
    """With ``zero_grad`` between physical batches (its ``.grad`` zeroed in place or
    dropped), the logical batch's step is the loop's on the whole batch."""
    model = net()
    twin = copy.deepcopy(model)
    _, opt, data_loader = private(engine, model, FLAT)
    assert physical_steps(model, opt, data_loader, lambda opt: opt.zero_grad(set_to_none)) == N // 2
    assert_params(model, loop_step(twin, [batch()], FLAT, "flat"), "loop")


def test_noise_has_std_sigma_c_over_b(engine):
    """Zero per-sample gradients (a loss that does not depend on the parameters'
    values), so the update is the noise alone: ``-lr · n / B``, ``n ~ N(0, σ²C²)`` per
    coordinate. 40,000 coordinates: the sample standard deviation is within 0.35% (1 sd
    of its sampling distribution, ``1/sqrt(2n)``), the mean within ``σC/(B sqrt(n))``;
    the test allows 5 of each, with a fixed seed."""
    sigma, C, B = 1.3, 0.7, 4
    model = nn.Linear(200, 200)
    before = model.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    X = torch.randn(B, 200)
    _, opt, _ = engine.make_private(
        module=model, optimizer=opt, data_loader=loader(X, X, batch_size=B), noise_multiplier=sigma,
        max_grad_norm=C, poisson_sampling=False, noise_generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    opt.zero_grad()
    (model(X) * 0).sum().backward()
    opt.step()
    noise = (before - model.weight.detach()).flatten()
    n, expected = noise.numel(), sigma * C / B
    assert abs(noise.std().item() / expected - 1) < 5 / (2 * n) ** 0.5
    assert abs(noise.mean().item()) < 5 * expected / n**0.5


@pytest.mark.parametrize("accountant", ["prv", "rdp", "gdp"])
def test_epsilon_is_opacus_accountant_on_the_same_history(accountant):
    """Poisson sampling at q = 1/4 for 5 steps: the accountant's history, and its ε."""
    X, y = batch(8)
    model = net()
    eng = PrivacyEngine(accountant=accountant)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt, dl = eng.make_private(
        module=model, optimizer=opt, data_loader=loader(X, y, batch_size=2), noise_multiplier=1.1, max_grad_norm=1.0
    )
    try:
        assert isinstance(dl.batch_sampler, opacus.utils.uniform_sampler.UniformWithReplacementSampler)
        steps = 0
        while steps < 5:
            for xb, yb in dl:
                if steps < 5:
                    train(model, opt, [(xb, yb)])
                    steps += 1
    finally:
        eng.detach()
    reference = create_accountant(accountant)
    for _ in range(5):
        reference.step(noise_multiplier=1.1, sample_rate=0.25)
    assert eng.accountant.history == reference.history
    assert eng.get_epsilon(1e-5) == pytest.approx(reference.get_epsilon(1e-5), rel=1e-12)


def test_make_private_with_epsilon_takes_opacus_noise_multiplier():
    """With the engine's accountant (RDP here: PRV's search takes seconds)."""
    X, y = batch(8)
    kwargs = dict(data_loader=loader(X, y, batch_size=2), target_epsilon=3.0, target_delta=1e-5, epochs=4)
    model, engine = net(), PrivacyEngine(accountant="rdp")
    _, opt, _ = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), max_grad_norm=1.0, **kwargs
    )
    engine.detach()
    twin = net()
    _, reference, _ = opacus.PrivacyEngine(accountant="rdp").make_private_with_epsilon(
        module=twin, optimizer=torch.optim.SGD(twin.parameters(), lr=LR), max_grad_norm=1.0, **kwargs
    )
    sigma = get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=0.25, epochs=4, accountant="rdp")
    assert opt.noise_multiplier == reference.noise_multiplier == sigma


def test_poisson_batches_and_an_empty_one(engine):
    """Opacus's Poisson loader; an empty batch, forward and backward as any other,
    gives a step of noise alone (here: none, σ = 0) and an accountant step."""
    X, y = batch(8)
    model = net()
    _, opt, dl = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), data_loader=loader(X, y, batch_size=2),
        noise_multiplier=0.0, max_grad_norm=1.0,
    )  # fmt: skip
    sizes = []
    for _ in range(3):
        for xb, yb in dl:
            sizes.append(len(xb))
            before = [p.detach().clone() for p in model.parameters()]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the mean over no sample is NaN, and its backward says so
                train(model, opt, [(xb, yb)])
            for p, b in zip(model.parameters(), before):
                assert torch.isfinite(p).all()
                if not len(xb):
                    assert torch.equal(p, b)
    assert 0 in sizes and len(set(sizes)) > 1, sizes
    assert len(engine.accountant.history) == 1 and engine.accountant.history[0][2] == len(sizes)


def test_batchnorm_in_training_is_refused_before_any_step():
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(36, 3))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    eng = PrivacyEngine()
    with pytest.raises(ValueError, match=r"'1' \(BatchNorm2d\).*GroupNorm"):
        eng.make_private(
            module=model, optimizer=opt, data_loader=loader(*batch()), noise_multiplier=1.0, max_grad_norm=1.0
        )
    assert jacmem.context._ACTIVE is None and not recorder.tracked_models()
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks
    assert not any(p._backward_hooks for p in model.parameters())
    assert len(eng.accountant) == 0


def tiny_gpt2(n_layer: int) -> nn.Module:
    """HF GPT-2 in float64, tied embeddings, no dropout: [N, 6] token ids -> logits."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=n_layer, n_embd=8, n_head=2, vocab_size=11, n_positions=6, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    return GPT2LMHeadModel(config).double()


def lm_loss(model, ids):
    """[N, T] ids -> [N]: each sample's mean cross-entropy over its tokens."""
    return nn.functional.cross_entropy(model(ids).logits.transpose(1, 2), ids, reduction="none").mean(1)


def private_lm_step_is_the_loop(engine, model, ids, max_norm=0.5) -> nn.Module:
    """One private step of ``model`` on ``ids`` [N, T] equals the loop on a copy taken before it:
    one ``.backward()`` per sample (a reentrant checkpoint gives ``torch.autograd.grad`` nothing).
    Returns what ``make_private`` returned as the module."""
    twin = copy.deepcopy(model)
    returned, opt, _ = private(engine, model, max_norm, data_loader=loader(ids, ids, batch_size=len(ids)))
    opt.zero_grad()
    lm_loss(model, ids).mean().backward()
    opt.step()
    params = [p for p in twin.parameters() if p.requires_grad]
    rows = []
    for i in range(len(ids)):
        twin.zero_grad(set_to_none=True)
        lm_loss(twin, ids[i : i + 1]).sum().backward()
        rows.append([p.grad.clone() for p in params])
    norms = torch.stack([torch.sqrt(sum(g.square().sum() for g in row)) for row in rows])
    c = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    assert (c < 1).any()
    trained = [p for p in model.parameters() if p.requires_grad]
    assert len(trained) == len(params)
    for k, (p, q) in enumerate(zip(trained, params)):
        expected = q - LR / len(ids) * sum(c[i] * rows[i][k] for i in range(len(ids)))
        torch.testing.assert_close(p.detach(), expected.detach(), rtol=1e-9, atol=1e-12)
    return returned


def test_the_model_is_the_users_own_hf_gpt2(engine):
    """No wrapper: the object itself, with its HF methods; a private step on it equals
    the loop (tied embeddings, default position ids)."""
    model = tiny_gpt2(1)
    config = model.config
    returned = private_lm_step_is_the_loop(engine, model, torch.randint(0, 11, (3, 6)))
    assert returned is model and model.config is config and callable(model.generate)


@pytest.mark.parametrize("top", ["trained", "frozen"])
@pytest.mark.parametrize("reentrant", [True, False])
def test_hf_gpt2_with_activation_checkpointing_steps_as_the_loop(engine, reentrant, top):
    """HF GPT-2 with ``gradient_checkpointing_enable`` (PEFT's ``prepare_model_for_kbit_training``
    turns it on, reentrant by default): a reentrant checkpoint backpropagates through each
    block with a backward nested in the outer one. A private step equals the loop; it
    clipped each checkpointed block by its own norms before (every parameter wrong).
    With the embeddings, head and final norm frozen (LoRA's case), no call of the outer
    backward is recorded before the first nested one."""
    model = tiny_gpt2(2)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if top == "frozen":
        for module in (model.transformer.wte, model.transformer.wpe, model.transformer.ln_f):
            module.requires_grad_(False)
    private_lm_step_is_the_loop(engine, model, torch.randint(0, 11, (3, 6)))


def test_autocast_bfloat16_steps(engine):
    model = net().float()
    X, y = batch()
    _, opt, _ = private(engine, model, 1.0, data_loader=loader(X.float(), y))
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(model(X.float()), y)
    loss.backward()
    opt.step()
    for p, b in zip(model.parameters(), before):
        assert p.dtype == torch.float32 and torch.isfinite(p).all() and not torch.equal(p, b)


WORLD = 2


def _ddp_worker(rank: int) -> None:
    torch.set_default_dtype(torch.float64)
    warnings.simplefilter("ignore")
    torch.manual_seed(0)  # the same model and whole batch in every rank
    model = net()
    X, y = batch(2 * N)
    expected = loop_step(copy.deepcopy(model), [(X, y)], FLAT, "flat")
    eng = PrivacyEngine()
    rows = slice(rank * N, (rank + 1) * N)

    def step_on_own_rows(module: nn.Module) -> None:
        """One private step of ``module`` on this rank's rows of the batch."""
        _, opt, _ = eng.make_private(
            module=module, optimizer=torch.optim.SGD(module.parameters(), lr=LR),
            data_loader=loader(X, y, 2 * N), noise_multiplier=0.0, max_grad_norm=FLAT, poisson_sampling=False,
        )  # fmt: skip
        try:
            train(module, opt, [(X[rows], y[rows])])
        finally:
            eng.detach()

    step_on_own_rows(nn.parallel.DistributedDataParallel(model))
    assert_params(model, expected, f"rank {rank} DDP")

    torch.manual_seed(0)  # Opacus's own data-parallel wrapper: the same global step
    model = net()
    step_on_own_rows(DPDDP(model))
    assert_params(model, expected, f"rank {rank} DPDDP")

    # a head that one rank's batch does not take (find_unused_parameters): each rank
    # .grad's the global clipped sum, the head too on the rank that did not use it
    torch.manual_seed(0)
    model = TwoHeads()
    twins = [copy.deepcopy(model) for _ in range(WORLD)]
    for r, twin in enumerate(twins):
        twin.head = "ab"[r]
    # the loop on the whole batch, each rank's rows through its own head: the mean of
    # the loop's steps on each rank's N rows is its step on the 2N
    shares = [slice(r * N, (r + 1) * N) for r in range(WORLD)]
    steps = [loop_step(t, [(X[s], y[s])], FLAT, "flat") for t, s in zip(twins, shares)]
    expected = [sum(ps) / WORLD for ps in zip(*steps)]
    model.head = "ab"[rank]
    step_on_own_rows(nn.parallel.DistributedDataParallel(model, find_unused_parameters=True))
    assert_params(model, expected, f"rank {rank} DDP, head {model.head}")

    # static_graph=True: the clipping turns DDP's synchronisation off, which its static
    # graph does not support (torch's reducer failed on an internal assert)
    static = nn.parallel.DistributedDataParallel(net(), static_graph=True)
    with pytest.raises(ValueError, match=r"module 'DistributedDataParallel' .* static_graph=False"):
        step_on_own_rows(static)
    with pytest.raises(ValueError, match=r"static_graph=False"):
        with jacmem.extend(jacmem.ClipGrad(FLAT)):
            static(X[rows])


class TwoHeads(nn.Module):
    """[N, 2, 5, 5] -> [N, 3]: :func:`net`'s body, then head ``a`` or ``b`` (``self.head``)."""

    def __init__(self):
        super().__init__()
        self.body, self.head = net()[:-1], "a"
        self.a, self.b = nn.Linear(36, 3), nn.Linear(36, 3)

    def forward(self, x):
        return getattr(self, self.head)(self.body(x))


@pytest.mark.slow
@needs_gloo
def test_two_ddp_ranks_equal_one_process(tmp_path):
    run_ranks(_ddp_worker, tmp_path, world=WORLD)


def _plain_step(model: nn.Module, X, y) -> torch.optim.Optimizer:
    """One private step of ``model`` (noise 0, threshold FLAT) on ``(X, y)``, a loader of
    that batch alone; the optimizer."""
    eng = PrivacyEngine()
    _, opt, _ = eng.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        data_loader=loader(X, y, len(X)), noise_multiplier=0.0, max_grad_norm=FLAT, poisson_sampling=False,
    )  # fmt: skip
    try:
        train(model, opt, [(X, y)])
    finally:
        eng.detach()
    return opt


def _plain_worker(rank: int) -> None:
    """A model with no data-parallel wrapper, private on each rank of a process group:
    one process's step on the rank's own batch (it was summed over the ranks: 1.98x)."""
    torch.set_default_dtype(torch.float64)
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = net()
    X, y = batch(2 * N)
    rows = slice(rank * N, (rank + 1) * N)
    expected = loop_step(copy.deepcopy(model), [(X[rows], y[rows])], FLAT, "flat")
    opt = _plain_step(model, X[rows], y[rows])
    assert type(opt) is DPOptimizer, f"rank {rank}: {type(opt).__name__}"
    assert_params(model, expected, f"rank {rank} plain model in a process group")


@needs_gloo
def test_a_plain_model_in_a_process_group_is_one_process_on_each_rank(tmp_path):
    run_ranks(_plain_worker, tmp_path, world=WORLD)


def _rank0_alone_worker(rank: int) -> None:
    """A model with no data-parallel wrapper, private (then in a ``jacmem.extend`` block
    of every first-order extension, then of ClipGrad) on rank 0 alone, as a reference run
    inside a torchrun script: no collective, so rank 0 ends while rank 1 waits (it hung
    for ever in all_reduce; a watchdog now ends rank 0 after a minute, with its stack, and
    the test fails). Each result is one process's."""
    torch.set_default_dtype(torch.float64)
    warnings.simplefilter("ignore")
    if rank == 0:
        faulthandler.dump_traceback_later(60, exit=True)
        torch.manual_seed(0)
        model = net()
        X, y = batch()
        expected = loop_step(copy.deepcopy(model), [(X, y)], FLAT, "flat")
        opt = _plain_step(model, X, y)
        assert type(opt) is DPOptimizer, type(opt).__name__
        assert_params(model, expected, "rank 0 alone, private")

        torch.manual_seed(0)
        model = net()
        grads = per_sample_grads(model, X, y, cross_entropy)
        extensions = [jacmem.BatchGrad(), jacmem.BatchL2Grad(), jacmem.SumGradSquared(), jacmem.Variance()]
        with jacmem.extend(*extensions):
            cross_entropy(model(X), y, "mean").backward()
        for p in model.parameters():
            for field, reference in REFERENCE.items():
                torch.testing.assert_close(getattr(p, field), reference(grads[p]), rtol=1e-10, atol=1e-12)
        model.zero_grad()
        with jacmem.extend(jacmem.ClipGrad(FLAT, loss_reduction="sum")):
            cross_entropy(model(X), y, "sum").backward()
        for p, e in expected_clipped(per_sample(model, X, y, cross_entropy, "sum"), FLAT).items():
            torch.testing.assert_close(p.grad, e, rtol=1e-10, atol=1e-12)
        faulthandler.cancel_dump_traceback_later()


@needs_gloo
def test_a_plain_model_private_on_rank_0_alone_completes(tmp_path):
    run_ranks(_rank0_alone_worker, tmp_path, world=WORLD)


def test_other_models_are_untouched_while_private(engine):
    """The private model's block has no global hooks: another model's backward gives
    autograd's own gradient, and a jacmem block on it runs meanwhile (its own block)."""
    other = net()
    X, y = batch()
    expected = torch.autograd.grad(nn.functional.cross_entropy(other(X), y), list(other.parameters()))
    private(engine, net(), FLAT)
    nn.functional.cross_entropy(other(X), y).backward()
    for p, e in zip(other.parameters(), expected):
        torch.testing.assert_close(p.grad, e, rtol=0, atol=0)
    with jacmem.extend(jacmem.BatchGrad()):
        nn.functional.cross_entropy(other(X), y).backward()
    for p, g in per_sample_grads(other, X, y, cross_entropy).items():
        torch.testing.assert_close(p.grad_batch, g, rtol=1e-10, atol=1e-12)


def test_a_backward_the_block_cannot_clip_raises(engine):
    """Another thread's backward is not the block's (one block per thread): it raises,
    even as the first backward, rather than leave an unclipped gradient in .grad."""
    model = net()
    private(engine, model, FLAT)
    errors = []

    def step():
        try:
            nn.functional.cross_entropy(model(batch()[0]), batch()[1]).backward()
        except RuntimeError as err:
            errors.append(err)

    thread = threading.Thread(target=step)
    thread.start()
    thread.join()
    assert errors and "jacmem: ClipGrad" in str(errors[0])
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
