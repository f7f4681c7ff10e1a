"""The per-device cost model and autotune of :mod:`jacmem.engine.strategies`.

- The CPU profile is the calibrated constants, so ``auto``'s CPU choices are as before.
- A CUDA profile is derived from the device's properties (mocked: the test machine has
  no GPU) and checked against NVIDIA's datasheet figures; ``estimated_seconds`` and
  ``choose`` use the profile of the device they are given.
- With ``autotune=True`` and a trial, ``choose`` times the candidates: the timed choice
  is the fastest one measured, even where the estimates prefer another; a strategy
  asked for by name is never overridden; ``explain()`` says that the choice was timed.
"""

import time
from types import SimpleNamespace

import pytest
import torch
from tests.support.reference import SAVEFIELDS, check_against, cross_entropy, per_sample_grads, run_jacmem
from torch import nn

from jacmem.derivatives import Cost, lookup
from jacmem.engine import cost_model, strategies
from jacmem.engine.cost_model import (
    BYTE_RATE,
    CPU_PROFILE,
    CUDA_ARCHS,
    FLOP_RATE,
    DeviceProfile,
    cuda_profile,
    estimated_seconds,
    profile_for,
)
from jacmem.engine.strategies import (
    AUTOTUNE_CALLS,
    Decision,
    StrategyChoices,
    measure,
)

#: What torch 2.13 reports for an H100 SXM and an A100 80GB SXM and an RTX 4090
#: (clock_rate and memory_clock_rate in kHz, memory_bus_width in bits).
H100 = SimpleNamespace(
    name="NVIDIA H100 80GB HBM3",
    major=9,
    minor=0,
    multi_processor_count=132,
    clock_rate=1_980_000,
    memory_clock_rate=2_619_000,
    memory_bus_width=5120,
)
A100 = SimpleNamespace(
    name="NVIDIA A100-SXM4-80GB",
    major=8,
    minor=0,
    multi_processor_count=108,
    clock_rate=1_410_000,
    memory_clock_rate=1_593_000,
    memory_bus_width=5120,
)
RTX4090 = SimpleNamespace(
    name="NVIDIA GeForce RTX 4090",
    major=8,
    minor=9,
    multi_processor_count=128,
    clock_rate=2_520_000,
    memory_clock_rate=10_501_000,
    memory_bus_width=384,
)

#: One candidate heavy in FLOPs, one heavy in memory traffic (entries of workspace).
FLOP_HEAVY = Cost(flops=1e9, workspace=0)
BYTE_HEAVY = Cost(flops=0, workspace=5e7)


@pytest.fixture
def fake_cuda(monkeypatch):
    """``torch.cuda.get_device_properties`` answers from ``devices`` (index -> props),
    counting its calls; ``profile_for``'s cache is empty before and after."""
    devices = {0: H100, 1: RTX4090}
    calls = []

    def properties(device):
        index = torch.device(device).index
        calls.append(index)
        return devices[index]

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cost_model._profile.cache_clear()
    yield calls
    cost_model._profile.cache_clear()


def linear_choice(plan: StrategyChoices, options, itemsize=4, device=None, trial=None) -> str:
    """``plan.choose`` for the weight's batch_grad of a Linear called "0"."""
    module = nn.Linear(2, 2)
    offered = {"outer", "unfold", "save_memory", "vmap", "direct"}
    return plan.choose(module, "0", offered, "weight", "batch_grad", options, itemsize, device=device, trial=trial)


# -- device profiles --------------------------------------------------------------------


def test_cpu_profile_is_the_calibrated_constants():
    assert (CPU_PROFILE.flop_rate, CPU_PROFILE.byte_rate) == (FLOP_RATE, BYTE_RATE) == (5e10, 5e9)
    assert CPU_PROFILE.flop_rate_fp64 is None and CPU_PROFILE.overhead == 0
    for device in (None, "cpu", torch.device("cpu"), torch.device("cpu", 0)):
        assert profile_for(device) == CPU_PROFILE
    cost = Cost(flops=3e8, workspace=2e6)
    for itemsize in (2, 4, 8):  # exactly the former formula, in every dtype
        old = cost.flops / FLOP_RATE + cost.workspace * itemsize / BYTE_RATE
        assert estimated_seconds(cost, itemsize) == old
        assert estimated_seconds(cost, itemsize, CPU_PROFILE) == old


def test_cpu_choice_and_explain_unchanged():
    """On the CPU, with or without a device given, the same choice and the same text."""
    texts = []
    for device in (None, torch.device("cpu")):
        plan = StrategyChoices("auto")
        assert linear_choice(plan, {"outer": FLOP_HEAVY, "vmap": BYTE_HEAVY, "direct": None}, device=device) == "outer"
        texts.append(plan.explain())
    assert (
        texts[0]
        == texts[1]
        == ("0.weight batch_grad <- outer (auto: cheapest; estimates: outer 20 ms, vmap 40 ms; n/a: direct)")
    )
    assert not StrategyChoices().autotune


@pytest.mark.parametrize(
    "props, fp32, fp64, bandwidth",
    [(H100, 66.9e12, 33.5e12, 3.35e12), (A100, 19.5e12, 9.7e12, 2.04e12), (RTX4090, 82.6e12, 1.29e12, 1.008e12)],
    ids=["H100", "A100", "RTX4090"],
)
def test_cuda_profile_matches_the_datasheets(props, fp32, fp64, bandwidth):
    profile = cuda_profile(props)
    assert profile.flop_rate == pytest.approx(fp32, rel=0.01)
    assert profile.flop_rate_fp64 == pytest.approx(fp64, rel=0.01)
    assert profile.byte_rate == pytest.approx(bandwidth, rel=0.01)
    assert props.name in profile.name and profile.overhead > 0
    assert profile.flops_per_second(4) == profile.flop_rate and profile.flops_per_second(2) == profile.flop_rate
    assert profile.flops_per_second(8) == profile.flop_rate_fp64


def test_cuda_profile_without_clocks_takes_the_table():
    """An older torch reports no clocks (or 0): the table's clock and bandwidth stand in,
    which for the table's own reference part are the datasheet figures again."""
    bare = SimpleNamespace(name="H100", major=9, minor=0, multi_processor_count=132)
    zeros = SimpleNamespace(**vars(H100) | {"clock_rate": 0, "memory_clock_rate": 0, "memory_bus_width": 0})
    for props in (bare, zeros):
        profile = cuda_profile(props)
        assert profile.flop_rate == pytest.approx(66.9e12, rel=0.01)
        assert profile.byte_rate == pytest.approx(3.35e12, rel=0.01)
    unknown = cuda_profile(SimpleNamespace(name="future", major=99, minor=0, multi_processor_count=10))
    assert unknown.flop_rate > 0 and unknown.byte_rate > 0 and unknown.flop_rate_fp64 > 0
    assert all(arch.fp64_lanes <= arch.fp32_lanes for arch in CUDA_ARCHS.values())


def test_profile_for_cuda_is_derived_once_per_device(fake_cuda):
    h100 = profile_for(torch.device("cuda", 0))
    assert h100 == cuda_profile(H100) and h100 != CPU_PROFILE
    assert h100.flop_rate / h100.byte_rate != CPU_PROFILE.flop_rate / CPU_PROFILE.byte_rate
    assert profile_for("cuda") is h100 and profile_for("cuda:0") is h100  # the current device, cached
    assert profile_for(torch.device("cuda", 1)) == cuda_profile(RTX4090)
    assert fake_cuda == [0, 1]
    assert profile_for(torch.device("meta")) == CPU_PROFILE  # a device type without a profile


def test_estimates_follow_the_device(fake_cuda):
    """A FLOP-heavy and a memory-heavy candidate: the CPU, the H100 and the RTX 4090 in
    float32 take the first; the RTX 4090 in float64 (1/64 the FLOP rate) the second."""
    options = {"outer": FLOP_HEAVY, "vmap": BYTE_HEAVY}
    h100, rtx = profile_for("cuda:0"), profile_for("cuda:1")
    assert estimated_seconds(FLOP_HEAVY, 4, h100) == pytest.approx(1e9 / h100.flop_rate + h100.overhead)
    assert estimated_seconds(BYTE_HEAVY, 8, rtx) == pytest.approx(4e8 / rtx.byte_rate + rtx.overhead)
    assert estimated_seconds(FLOP_HEAVY, 8, h100) < estimated_seconds(FLOP_HEAVY, 8, CPU_PROFILE) / 100
    chosen = {
        (device, itemsize): linear_choice(StrategyChoices(), options, itemsize, device=device)
        for device in ("cpu", "cuda:0", "cuda:1")
        for itemsize in (4, 8)
    }
    assert chosen.pop(("cuda:1", 8)) == "vmap"
    assert set(chosen.values()) == {"outer"}, chosen
    plan = StrategyChoices()
    linear_choice(plan, options, 8, device="cuda:1")
    assert plan.explain() == "0.weight batch_grad <- vmap (auto: cheapest; estimates: vmap 0.407 ms, outer 0.785 ms)"


def test_profile_is_frozen():
    with pytest.raises(AttributeError):
        CPU_PROFILE.flop_rate = 1.0  # type: ignore[misc]
    assert DeviceProfile("x", 1.0, 2.0).flops_per_second(8) == 1.0


# -- measuring ----------------------------------------------------------------------------


def counting(seconds: float, calls: list):
    """A thunk that sleeps ``seconds`` and counts its calls in ``calls``."""

    def thunk():
        calls.append(None)
        time.sleep(seconds)

    return thunk


def test_measure_is_bounded():
    """A warm-up call, then at most AUTOTUNE_CALLS timed ones, fewer once they took
    AUTOTUNE_SECONDS together, and always one."""
    quick, slow = [], []
    assert measure(counting(0.001, quick)) >= 0.001
    assert len(quick) == 1 + AUTOTUNE_CALLS
    assert measure(counting(0.06, slow)) >= 0.06
    assert len(slow) == 2
    once = []
    measure(counting(0, once), calls=0)
    assert len(once) == 2


def test_measure_synchronizes_on_cuda(monkeypatch):
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    calls = []
    measure(counting(0, calls), "cuda:0", calls=2)
    assert len(calls) == 3 and len(synced) == 4  # before the warm-up, after it, after each timed call
    assert set(synced) == {torch.device("cuda", 0)}
    synced.clear()
    measure(counting(0, []), "cpu")
    assert synced == []


# -- autotune -----------------------------------------------------------------------------


def sleeping_trial(seconds: dict[str, float], tried: list):
    """Candidate name -> a thunk sleeping ``seconds[name]``; names asked for go in ``tried``."""

    def trial(name):
        tried.append(name)
        return counting(seconds[name], [])

    return trial


def test_autotune_keeps_the_fastest_measured():
    """The estimates prefer outer (20 ms against 40 ms); measured, vmap is the faster, and
    the timed choice is the fastest one measured."""
    tried = []
    plan = StrategyChoices("auto", autotune=True)
    options = {"outer": FLOP_HEAVY, "vmap": BYTE_HEAVY, "direct": None}
    trial = sleeping_trial({"outer": 0.012, "vmap": 0.002}, tried)
    assert linear_choice(plan, options, trial=trial) == "vmap"
    assert sorted(tried) == ["outer", "vmap"]  # what does not apply is not tried
    d = plan.decisions[("0", "weight", "batch_grad")]
    assert d.timed and set(d.measured) == {"outer", "vmap"}
    assert d.chosen == min(d.measured, key=d.measured.get)
    assert d.measured["outer"] >= 0.012 and d.measured["vmap"] >= 0.002
    assert d.estimates["outer"] < d.estimates["vmap"]  # the estimates stay recorded
    text = plan.explain()
    assert text.startswith("0.weight batch_grad <- vmap (autotune: fastest measured; measured: vmap "), text
    assert "outer" in text and "estimates" not in text and text.endswith("; n/a: direct)"), text


def test_autotune_with_real_strategies():
    """The conv weight's registered batch_grad strategies, tried as the planner would try
    them (each strategy's function on the real input and output gradient): the choice is
    the fastest measured, and every candidate gives the same per-sample gradients."""
    conv = nn.Conv2d(3, 8, 3, padding=1)
    x = torch.randn(16, 3, 12, 12)
    g = torch.randn(16, 8, 12, 12)
    entry = lookup(conv)
    hp = entry.hyperparams(conv)
    table = entry.strategies[("weight", "batch_grad")]
    options = {
        name: Cost(0, 0) if s.cost is None else s.cost(tuple(x.shape), tuple(g.shape), **hp)
        for name, s in table.items()
    }
    applicable = [name for name, cost in options.items() if cost is not None]
    assert len(applicable) >= 2, options

    def trial(name):
        return lambda: table[name].fn(x, g, **hp)

    plan = StrategyChoices(autotune=True)
    chosen = plan.choose(conv, "0", entry.names(), "weight", "batch_grad", options, 4, device=x.device, trial=trial)
    d = plan.decisions[("0", "weight", "batch_grad")]
    assert d.timed and sorted(n for n, t in d.measured.items() if t is not None) == sorted(applicable)
    assert chosen == min(d.measured, key=d.measured.get)
    results = [table[name].fn(x, g, **hp) for name in applicable]
    for name, result in zip(applicable, results, strict=True):
        torch.testing.assert_close(result, results[0], msg=f"{name} against {applicable[0]}")


@pytest.mark.parametrize("spec", ["outer", {"0": "outer"}, {nn.Linear: "outer"}], ids=["global", "name", "type"])
def test_a_strategy_asked_for_is_never_overridden(spec):
    tried = []
    plan = StrategyChoices(spec, autotune=True)
    trial = sleeping_trial({"outer": 0.01, "vmap": 0.0}, tried)
    assert linear_choice(plan, {"outer": BYTE_HEAVY, "vmap": FLOP_HEAVY}, trial=trial) == "outer"
    assert tried == []
    d = plan.decisions[("0", "weight", "batch_grad")]
    assert d.reason == "asked for" and not d.timed
    assert "measured" not in plan.explain()


def test_a_name_that_does_not_apply_is_autotuned():
    """A global name that this layer does not offer: auto there, so autotune times it."""
    plan = StrategyChoices("unfold", autotune=True)
    trial = sleeping_trial({"outer": 0.005, "vmap": 0.0}, [])
    assert linear_choice(plan, {"outer": FLOP_HEAVY, "vmap": BYTE_HEAVY}, trial=trial) == "vmap"
    assert plan.explain().startswith(
        "0.weight batch_grad <- vmap (autotune: fastest measured, as 'unfold' does not apply here; measured: vmap"
    ), plan.explain()


def test_without_autotune_or_trial_the_estimates_decide():
    options = {"outer": FLOP_HEAVY, "vmap": BYTE_HEAVY}
    for plan, trial in [
        (StrategyChoices(), sleeping_trial({"outer": 0.01, "vmap": 0.0}, tried := [])),
        (StrategyChoices(autotune=True), None),
    ]:
        assert linear_choice(plan, options, trial=trial) == "outer"
        assert not plan.decisions[("0", "weight", "batch_grad")].timed
        assert "auto: cheapest; estimates:" in plan.explain()
    assert tried == []


def test_one_candidate_is_not_timed():
    tried = []
    plan = StrategyChoices(autotune=True)
    trial = sleeping_trial({"outer": 0.0}, tried)
    assert linear_choice(plan, {"outer": FLOP_HEAVY, "vmap": None}, trial=trial) == "outer"
    assert tried == [] and "the only strategy that applies" in plan.explain()


def test_a_candidate_without_trial_leaves_it_to_the_estimates():
    plan = StrategyChoices(autotune=True)
    trial = {"outer": counting(0.01, []), "vmap": None}.get
    assert linear_choice(plan, {"outer": FLOP_HEAVY, "vmap": BYTE_HEAVY}, trial=trial) == "outer"
    d = plan.decisions[("0", "weight", "batch_grad")]
    assert not d.timed and d.reason == "auto: cheapest; not timed: no trial for vmap"
    assert "(auto: cheapest; not timed: no trial for vmap; estimates: outer 20 ms" in plan.explain()


def test_a_candidate_that_fails_is_left_out():
    """Out of memory, say: the others are timed, and explain() names the failure; when
    every candidate fails, the estimates decide (and the chosen one fails where it runs)."""

    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory")

    plan = StrategyChoices(autotune=True)
    trial = {"outer": oom, "vmap": counting(0.0, []), "unfold": counting(0.01, [])}.get
    options = {"outer": FLOP_HEAVY, "vmap": BYTE_HEAVY, "unfold": BYTE_HEAVY}
    assert linear_choice(plan, options, trial=trial) == "vmap"
    d = plan.decisions[("0", "weight", "batch_grad")]
    assert d.measured["outer"] is None and d.failures == {"outer": "OutOfMemoryError"}
    assert plan.explain().endswith("; failed: outer (OutOfMemoryError))"), plan.explain()

    plan = StrategyChoices(autotune=True)
    assert linear_choice(plan, {"outer": FLOP_HEAVY, "vmap": BYTE_HEAVY}, trial=lambda name: oom) == "outer"
    d = plan.decisions[("0", "weight", "batch_grad")]
    assert not d.timed and "every candidate failed when tried: outer (OutOfMemoryError)" in d.reason


def test_timed_reuse_says_so():
    """A quantity that rides along a pass, chosen by timing, says it was timed."""
    d = Decision(
        "0",
        "weight",
        "grad",
        "outer",
        "autotune: fastest measured",
        {"outer": 1e-3, "sum": 2e-3},
        "reuse",
        ("batch_l2",),
    )
    assert d.describe() == "grad <- the same outer pass as batch_l2"
    d.measured = {"outer": 1e-3, "sum": 3e-3}
    assert d.describe() == (
        "grad <- the same outer pass as batch_l2 (autotune: fastest measured; measured: outer 1 ms, sum 3 ms)"
    )


def test_autotune_must_be_a_bool():
    with pytest.raises(TypeError, match="autotune must be True or False"):
        StrategyChoices(autotune="yes")  # type: ignore[arg-type]


def test_autotune_through_the_block_takes_the_fastest_measured_and_stays_exact():
    """``jacmem.extend(..., autotune=True)``: every choice among several candidates is
    timed, the chosen one is the fastest measured, explain() says so, and the results
    equal the per-sample loop's."""
    import jacmem
    from jacmem.engine.planner import _PLANS

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3)).double()
    X, y = torch.randn(5, 2, 6, 6, dtype=torch.float64), torch.randint(0, 3, (5,))
    reference = per_sample_grads(model, X, y, cross_entropy)
    _PLANS.clear()
    extensions = [jacmem.BatchGrad(), jacmem.BatchL2Grad(), jacmem.SumGradSquared(), jacmem.Variance()]
    ctx = run_jacmem(model, X, y, cross_entropy, "mean", extensions, autotune=True)
    check_against(model, reference, SAVEFIELDS, "[autotune]")
    timed = [d for d in ctx.plan.decisions.values() if d.timed]
    assert timed, ctx.explain()
    for d in timed:
        measured = {k: t for k, t in d.measured.items() if t is not None}
        assert d.chosen == min(measured, key=measured.get), str(d)
    assert "autotune: fastest measured" in ctx.explain()
    # the plan is kept: the next block with the same shapes times nothing again
    calls = []
    real = strategies.measure
    strategies.measure = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        run_jacmem(model, X, y, cross_entropy, "mean", extensions, autotune=True)
    finally:
        strategies.measure = real
    assert not calls
