"""The case bank of every registered layer type (tests/derivatives/test_registry_coverage.py,
tests/engine/test_host_syncs.py): a module and a batch of ``N`` inputs per case, and one
captured call of it with its float64 per-sample reference."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from jacmem.derivatives import REGISTRY, Strategy, detached, lookup, registered_type
from jacmem.engine.planner import shapes

DT = torch.float64
N = 3


@dataclass
class Case:
    """A module and a batch of ``N`` inputs (positional arguments of its forward).
    ``split(args, n)``: the arguments of sample ``n`` alone; by default each tensor's
    first axis, sliced (``None`` and other values pass)."""

    make: Callable[[], nn.Module]
    inputs: Callable[[], tuple]
    split: Callable[[tuple, int], tuple] | None = None
    kwargs: dict = field(default_factory=dict)


def _float(*shape):
    return lambda: (torch.randn(*shape, dtype=DT),)


def _ints(high, *shape):
    return lambda: (torch.randint(0, high, shape),)


def _bag_weights():
    return torch.randint(0, 7, (N, 4)), None, torch.randn(N, 4, dtype=DT)


def _self_attention(*shape):
    def inputs():
        x = torch.randn(*shape, dtype=DT)
        return x, x, x

    return inputs


def _cross_attention():
    return torch.randn(N, 4, 6, dtype=DT), torch.randn(N, 5, 3, dtype=DT), torch.randn(N, 5, 2, dtype=DT)


def _hf_conv1d(nf: int, nx: int) -> nn.Module:
    """HF transformers' ``Conv1D`` (GPT-2's linear layer, registered by qualified name)."""
    from transformers.pytorch_utils import Conv1D

    return Conv1D(nf, nx)


def _rnn_linear(nf: int, nx: int) -> nn.Module:
    """Opacus's ``RNNLinear`` (the cells' Linear in its DPLSTM, registered by qualified name)."""
    from opacus.layers.dp_rnn import RNNLinear

    return RNNLinear(nx, nf)


def _eval_bn(module: nn.modules.batchnorm._BatchNorm) -> nn.Module:
    """Eval mode, with running statistics that are not the defaults."""
    module.running_mean.copy_(torch.randn(module.num_features))
    module.running_var.copy_(torch.rand(module.num_features) + 0.5)
    return module.eval()


def _axis1(args: tuple, n: int) -> tuple:
    return tuple(a[:, n : n + 1] if isinstance(a, Tensor) else a for a in args)


CASES: dict[str, Case] = {
    "linear": Case(lambda: nn.Linear(4, 3), _float(N, 4)),
    "linear-seq": Case(lambda: nn.Linear(4, 3), _float(N, 5, 4)),
    "linear-seq2-nobias": Case(lambda: nn.Linear(4, 3, bias=False), _float(N, 2, 3, 4)),
    "hf-conv1d": Case(lambda: _hf_conv1d(3, 4), _float(N, 4)),
    "hf-conv1d-seq": Case(lambda: _hf_conv1d(3, 4), _float(N, 5, 4)),
    "opacus-rnn-linear": Case(lambda: _rnn_linear(3, 4), _float(N, 4)),
    "conv1d-groups-stride": Case(lambda: nn.Conv1d(4, 6, 3, stride=2, padding=1, groups=2), _float(N, 4, 9)),
    "conv1d-depthwise": Case(lambda: nn.Conv1d(3, 3, 3, groups=3, padding="same"), _float(N, 3, 7)),
    "conv2d": Case(lambda: nn.Conv2d(2, 3, 3), _float(N, 2, 6, 6)),
    "conv2d-reflect-dilation": Case(
        lambda: nn.Conv2d(2, 4, (3, 2), dilation=(2, 1), padding=(2, 1), padding_mode="reflect"), _float(N, 2, 7, 6)
    ),
    "conv2d-same-circular": Case(
        lambda: nn.Conv2d(2, 2, 2, padding="same", padding_mode="circular"), _float(N, 2, 5, 5)
    ),
    "conv3d-nobias": Case(lambda: nn.Conv3d(2, 2, 2, stride=(1, 2, 1), bias=False), _float(N, 2, 4, 4, 3)),
    "conv3d-groups": Case(lambda: nn.Conv3d(2, 4, (1, 2, 2), groups=2, padding=1), _float(N, 2, 3, 3, 2)),
    "convT1d-groups": Case(lambda: nn.ConvTranspose1d(4, 6, 3, stride=2, output_padding=1, groups=2), _float(N, 4, 5)),
    "convT2d": Case(lambda: nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1, dilation=1), _float(N, 2, 4, 3)),
    "convT3d": Case(lambda: nn.ConvTranspose3d(2, 2, 2, stride=(2, 1, 1)), _float(N, 2, 3, 2, 2)),
    "embedding": Case(lambda: nn.Embedding(7, 3, padding_idx=1), _ints(7, N, 5)),
    "embedding-2d": Case(lambda: nn.Embedding(6, 2, max_norm=1.0), _ints(6, N, 2, 3)),
    "bag-sum-weights": Case(lambda: nn.EmbeddingBag(7, 3, mode="sum"), _bag_weights),
    "bag-max": Case(lambda: nn.EmbeddingBag(7, 3, mode="max"), _ints(7, N, 4)),
    "bag-mean-padding": Case(lambda: nn.EmbeddingBag(7, 3, mode="mean", padding_idx=0), _ints(7, N, 4)),
    "batchnorm1d": Case(lambda: _eval_bn(nn.BatchNorm1d(3)), _float(N, 3, 4)),
    "batchnorm2d": Case(lambda: _eval_bn(nn.BatchNorm2d(3)), _float(N, 3, 2, 3)),
    "batchnorm3d": Case(lambda: _eval_bn(nn.BatchNorm3d(2)), _float(N, 2, 2, 2, 2)),
    "instancenorm1d": Case(lambda: nn.InstanceNorm1d(3, affine=True), _float(N, 3, 5)),
    "instancenorm2d-running": Case(
        lambda: _eval_bn(nn.InstanceNorm2d(3, affine=True, track_running_stats=True)), _float(N, 3, 2, 3)
    ),
    "instancenorm3d": Case(lambda: nn.InstanceNorm3d(2, affine=True), _float(N, 2, 2, 3, 2)),
    "groupnorm": Case(lambda: nn.GroupNorm(2, 4), _float(N, 4, 3)),
    "layernorm": Case(lambda: nn.LayerNorm(5), _float(N, 2, 5)),
    "layernorm-rank2": Case(lambda: nn.LayerNorm((2, 5), bias=False), _float(N, 2, 5)),
    "mha": Case(lambda: nn.MultiheadAttention(6, 2, batch_first=True), _self_attention(N, 4, 6)),
    "mha-kdim-bias-kv": Case(
        lambda: nn.MultiheadAttention(6, 3, kdim=3, vdim=2, add_bias_kv=True, batch_first=True), _cross_attention
    ),
    "mha-seq-first": Case(lambda: nn.MultiheadAttention(4, 2), _self_attention(3, N, 4), split=_axis1),
    "rnn-bidirectional": Case(lambda: nn.RNN(3, 4, bidirectional=True, batch_first=True), _float(N, 4, 3)),
    "rnn-relu-2layers-seq-first": Case(
        lambda: nn.RNN(3, 2, num_layers=2, nonlinearity="relu"), _float(4, N, 3), split=_axis1
    ),
    "gru-bidirectional": Case(lambda: nn.GRU(3, 3, bidirectional=True, batch_first=True), _float(N, 4, 3)),
    "lstm-proj-bidirectional": Case(
        lambda: nn.LSTM(3, 4, proj_size=2, bidirectional=True, batch_first=True), _float(N, 3, 3)
    ),
    "lstm-nobias": Case(lambda: nn.LSTM(2, 3, bias=False, batch_first=True), _float(N, 4, 2)),
}


if hasattr(nn, "RMSNorm"):
    CASES["rmsnorm"] = Case(lambda: nn.RMSNorm(5), _float(N, 2, 5))
    CASES["rmsnorm-rank2-eps"] = Case(lambda: nn.RMSNorm((2, 5), eps=1e-3), _float(N, 2, 5))


def sample_loss(output) -> Tensor:
    """A per-sample loss: every floating-point output entry through ``sin``, summed (so the
    batch's loss is the sum of the samples')."""
    leaves = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.is_floating_point()]
    return sum(t.sin().sum() for t in leaves)


def _split(case: Case, args: tuple, n: int) -> tuple:
    if case.split is not None:
        return case.split(args, n)
    return tuple(a[n : n + 1] if isinstance(a, Tensor) else a for a in args)


@dataclass
class Captured:
    """One call, as the block would see it."""

    module: nn.Module
    module_type: type  # the registered type whose entry answers for it
    entry: object
    kept: object  # what ``keep`` returned, detached (before arrange_input)
    grads: object  # the output gradient(s), before arrange
    reference: dict[str, Tensor]  # name -> per-sample gradients [N, *p.shape]

    def call(self) -> tuple[object, object, dict]:
        """``(x, g, hp)`` as a strategy takes them; fresh hyper-parameters each time
        (they may hold a shared pass's cache)."""
        hp = self.entry.hyperparams(self.module)
        return self.entry.arrange_input(self.kept, **hp), self.entry.arrange(self.grads, **hp), hp


def capture(case: Case) -> Captured:
    torch.manual_seed(0)
    module = case.make().to(DT)
    args = case.inputs()
    entry = lookup(module)
    module_type = registered_type(REGISTRY, type(module))
    assert entry is not None and module_type is not None, f"no entry for {type(module).__name__}"
    output = module(*args)
    out = entry.outputs(output)
    outs = [out] if isinstance(out, Tensor) else [t for t in out if isinstance(t, Tensor)]
    outs = [t for t in outs if t.requires_grad]
    grads = torch.autograd.grad(sample_loss(output), outs, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(outs, grads)]
    params = dict(module.named_parameters())
    rows = []
    for n in range(N):
        row = torch.autograd.grad(sample_loss(module(*_split(case, args, n))), list(params.values()), allow_unused=True)
        rows.append([torch.zeros_like(p) if r is None else r for p, r in zip(params.values(), row)])
    reference = {name: torch.stack([row[i] for row in rows]) for i, name in enumerate(params)}
    kept = detached(entry.keep(args, {}))
    return Captured(module, module_type, entry, kept, grads[0] if len(grads) == 1 else tuple(grads), reference)


#: the parameters of the quantities that take some, in these cases
PARAMETERS = {"grad_proj": {"dim": 6, "kind": "kronecker", "seed": 0}}
#: the stable name a named quantity's strategies get here
NAME = "case.weight"


def arguments(quantity: str) -> dict:
    """What a strategy of ``quantity`` takes by keyword beside the layer's hyper-parameters:
    its :data:`PARAMETERS`, and the parameter's name where it reads one (:data:`NAME`)."""
    return {**PARAMETERS[quantity], "name": NAME} if quantity in PARAMETERS else {}


def applicable(cap: Captured) -> list[tuple[str, str, str, Strategy]]:
    """(param, quantity, name, strategy) of every strategy whose cost applies here, for
    the parameters the module has (``bias=False`` leaves ``bias`` out, say)."""
    x, g, hp = cap.call()
    found = []
    for (param, quantity), table in cap.entry.strategies.items():
        if param not in cap.reference:
            continue
        for name, strategy in table.items():
            cost = strategy.cost
            if cost is None or cost(shapes(x), shapes(g), **PARAMETERS.get(quantity, {}), **hp) is not None:
                found.append((param, quantity, name, strategy))
    return found
