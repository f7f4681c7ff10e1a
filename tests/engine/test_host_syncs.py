"""No host synchronisation in the backward pass of a first-order extension or of ClipGrad.

On an accelerator, an op whose result the host must read (``.item()``, ``bool(t)``,
``nonzero``, ``unique``, a size that depends on the data, ...) waits until the device's
queue drains. :class:`HostReads` counts those ops under a ``TorchDispatchMode`` while
``loss.backward()`` runs (the forward may read the host), together with ``tolist`` and
``numpy``, which read a tensor's memory without an op the mode sees; every test requires
zero. The models: tiny HF GPT-2 (tied embeddings, default position ids), BERT and LLaMA,
timm's ViT, a CNN, an LSTM and custom modules (the torch.func fallback), under every
first-order extension (BatchGrad also with subsampling) and every ClipGrad clipping;
and one module of every registered layer type (the case bank of
tests/support/registry_cases.py, which must cover the registry), under the engine and
with every strategy its entry offers called directly.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from tests.support.fallback_models import Model as FallbackModel
from tests.support.hf_models import build
from tests.support.host_reads import HostReads, backward_reads
from tests.support.reference import trainable
from tests.support.registry_cases import CASES, Case, applicable, arguments, capture, sample_loss
from torch import Tensor, nn

import jacmem
from jacmem.derivatives import REGISTRY, registered_type

DT = torch.float64
N = 3

FIRST_ORDER = {
    "BatchGrad": jacmem.BatchGrad,
    "BatchL2Grad": jacmem.BatchL2Grad,
    "SumGradSquared": jacmem.SumGradSquared,
    "Variance": jacmem.Variance,
}


def clip(clipping: str, reduction: str) -> Callable[[nn.Module], jacmem.ClipGrad]:
    def make(model: nn.Module) -> jacmem.ClipGrad:
        if clipping == "per_layer":
            return jacmem.ClipGrad([0.5] * len(trainable(model)), clipping=clipping, loss_reduction=reduction)
        return jacmem.ClipGrad(0.5, clipping=clipping, loss_reduction=reduction)

    return make


def extensions(reduction: str) -> dict[str, Callable[[nn.Module], object]]:
    """name -> ``make(model)``, the extension for that model."""
    made = {name: (lambda model, e=e: e()) for name, e in FIRST_ORDER.items()}
    made["BatchGrad-subsampling"] = lambda model: jacmem.BatchGrad(subsampling=[2, 0])
    made.update({f"ClipGrad-{c}": clip(c, reduction) for c in ("flat", "per_layer", "automatic")})
    return made


# -- real models ---------------------------------------------------------------------


class LSTMNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.lstm, self.head = nn.Embedding(11, 4), nn.LSTM(4, 5, batch_first=True), nn.Linear(5, 3)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.lstm(self.embed(ids))[0][:, -1])


def cnn():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 3, 3), nn.Flatten(), nn.Linear(3, 3),
    ).to(DT)  # fmt: skip
    return model, torch.randn(N, 2, 6, 6, dtype=DT), torch.randint(0, 3, (N,))


def lstm():
    torch.manual_seed(0)
    return LSTMNet().to(DT), torch.randint(0, 11, (N, 6)), torch.randint(0, 3, (N,))


def fallback():
    """Modules with no registered derivative (recomputed with torch.func) among registered ones."""
    torch.manual_seed(0)
    return FallbackModel().to(DT), torch.randn(N, 2, 6, 6, dtype=DT), torch.randint(0, 2, (N,))


MODELS = {
    "gpt2": lambda: build("gpt2"),
    "bert": lambda: build("bert"),
    "llama": lambda: build("llama"),
    "vit": lambda: build("vit"),
    "cnn": cnn,
    "lstm": lstm,
    "fallback": fallback,
}


@pytest.mark.parametrize("ext", list(extensions("mean")))
@pytest.mark.parametrize("name", list(MODELS))
def test_real_models_backward_without_host_reads(name, ext):
    """Two steps: the second must read nothing (the first may make what is reused, as
    the index of BatchGrad's subsampling)."""
    model, X, y = MODELS[name]()
    extension = extensions("mean")[ext](model)
    for _ in range(2):
        with jacmem.extend(extension):
            reads = backward_reads(F.cross_entropy(model(X), y))
    reads.check(f"{name}, {ext}")
    assert all(p.grad is not None for p in trainable(model))


# -- every registered layer ------------------------------------------------------------


def _bags():
    """A 1d EmbeddingBag input: indices, and the offsets of ``N`` bags (the second empty)."""
    return torch.tensor([1, 4, 4, 0, 2, 6]), torch.tensor([0, 3, 3])


def _one_bag(args: tuple, n: int) -> tuple:
    idx, offsets = args
    ends = [*offsets.tolist()[1:], len(idx)]
    return idx[offsets[n] : ends[n]], torch.tensor([0])


#: the registry's cases, and options whose derivatives take other paths (batch-level counts, a padded 1d input)
LAYERS: dict[str, Case] = {
    **CASES,
    "embedding-freq-padding": Case(
        lambda: nn.Embedding(7, 3, padding_idx=1, scale_grad_by_freq=True), lambda: (torch.randint(0, 7, (N, 5)),)
    ),
    "bag-offsets-padding": Case(lambda: nn.EmbeddingBag(7, 3, mode="mean", padding_idx=4), _bags, split=_one_bag),
}


def test_the_cases_cover_every_registered_layer():
    """Every registered layer type has a module among the cases below."""
    covered = {registered_type(REGISTRY, type(case.make())) for case in CASES.values()}
    missing = {
        t for t in REGISTRY if not getattr(t, "__module__", "").startswith("tests.")
    } - covered  # a test's own layers aside
    assert not missing, f"registered layers without a case in tests/support/registry_cases.py: {missing}"


@pytest.mark.parametrize("ext", list(extensions("sum")))
@pytest.mark.parametrize("case", list(LAYERS))
def test_every_registered_layer_backward_without_host_reads(case, ext):
    torch.manual_seed(0)
    module, args = LAYERS[case].make().to(DT), LAYERS[case].inputs()
    extension = extensions("sum")[ext](module)
    entry = REGISTRY[registered_type(REGISTRY, type(module))]
    if isinstance(extension, jacmem.ClipGrad) and entry.shared(**entry.hyperparams(module)):
        pytest.skip("ClipGrad refuses the layer (tests/extensions/test_clipping.py)")
    for _ in range(2):
        with jacmem.extend(extension):
            reads = backward_reads(sample_loss(module(*args, **LAYERS[case].kwargs)))
    reads.check(f"{case}, {ext}")


@pytest.mark.parametrize("case", list(LAYERS))
def test_every_registered_strategy_without_host_reads(case):
    cap = capture(LAYERS[case])
    for param, quantity, name, strategy in applicable(cap):
        x, g, hp = cap.call()
        with HostReads() as reads:
            strategy.fn(x, g, **hp, **arguments(quantity))
        reads.check(f"{case}: {param} {quantity} {name!r}")


def test_the_count_sees_host_reads():
    """Each kind of host read, in a backward pass, is counted."""
    w = torch.randn(4, dtype=DT, requires_grad=True)

    def reading(grad: Tensor) -> Tensor:
        grad.sum().item(), bool(grad.any()), grad.nonzero(), torch.unique(grad), grad.tolist()
        return grad

    w.register_hook(reading)
    reads = backward_reads((w * 2).sum())
    assert set(reads.counts) == {"_local_scalar_dense", "nonzero", "_unique2", "tolist"}, reads.counts
    with pytest.raises(AssertionError, match="host reads in the backward pass"):
        reads.check("reading")


def test_nan_is_flagged_on_the_device_and_warned_when_the_block_ends():
    """The NaN check reads nothing in the backward: a NaN in any pass of the block (the
    second here, whose flags add to the first's) is warned about once, at the block's
    end, from the user's line."""
    model, X, y = cnn()
    bad = X.clone()
    bad[1, 0, 2, 2] = float("nan")
    with pytest.warns(RuntimeWarning, match=r"of module\(s\) '0', '1', '4' and 1 more hold NaN or Inf") as caught:
        with jacmem.extend(jacmem.BatchGrad()):
            for inputs in (X, bad):
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    backward_reads(F.cross_entropy(model(inputs), y)).check("a pass with NaN")
    assert len(caught) == 1 and caught[0].filename == __file__
    assert model[0].weight.grad_batch[1].isnan().any() and not model[0].weight.grad_batch[0].isnan().any()


def test_the_unrecorded_use_check_raises_without_host_reads():
    """ClipGrad's check that no use of a parameter escaped the recorded calls runs on the
    device, and still raises (at once on the CPU) before anything is written."""
    model, X, y = cnn()
    reads = HostReads()
    with pytest.raises(RuntimeError, match="reaches parameter 'Sequential.6.weight' outside every module call"):
        with jacmem.extend(jacmem.ClipGrad(1.0)):
            loss = F.cross_entropy(model(X), y) + model[6].weight.square().sum()
            with reads:
                loss.backward()
    reads.check("ClipGrad's failing check")
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())  # autograd's zeros at most
