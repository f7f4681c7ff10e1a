"""FSDP2 (``fully_shard``): gloo ranks on the CPU against one process on the whole batch.

Each rank holds its own rows of the batch; the reference is the per-sample autograd loop
of ``tests/support/reference.py`` on the whole batch, in float64, in every rank, on an
unsharded copy of the model. With FSDP's averaging and ``reduction="mean"`` (see
:mod:`jacmem.engine.fsdp`):

- ``grad_batch.full_tensor()`` is the reference's ``[N, *shape]``; ``batch_l2`` the
  reference's rows of the rank's samples; ``sum_grad_squared`` and ``variance``
  (gathered) the reference's over the whole batch;
- under ``ClipGrad``, ``.grad.full_tensor()`` is the clipped sum over the whole batch,
  ``ClipGrad.samples`` the global count, ``ClipGrad.norms`` the rank's rows.

A branch that one rank's batch skips (two heads, rank ``r`` through head ``"ab"[r % 2]``)
gives every rank its shard of the global quantities and of the clipped sum, as one
process on the concatenated batch (zero per-sample gradients where a sample skips it).

Models: a CNN (uneven shards: dimension 0 of 3 over 2 and 4 ranks), a tiny HF GPT-2 (tied
``wte``/``lm_head``, default position ids) and a tiny timm ViT, each sharded whole, per
block (and the root) and nested (a part of each block too). One start of the processes
runs every check, as starting processes is the slow part.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tests.support import hf_models
from tests.support.clipping import expected, median_norm, norms, per_sample
from tests.support.distributed import needs_gloo, run_ranks
from tests.support.reference import REFERENCE, assert_close, cross_entropy, per_sample_grads
from torch import nn

import jacmem
from jacmem import compat

DT = torch.float64
PER_RANK = 2
FIELDS = ("grad_batch", "batch_l2", "sum_grad_squared", "variance")


def cnn() -> nn.Module:
    """[N, 2, 6, 6] -> [N, 3]"""
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Conv2d(4, 3, 3)), nn.ReLU(), nn.Flatten(), nn.Linear(12, 3)
    )


def data(name: str, n: int):
    if name == "cnn":
        return torch.randn(n, 2, 6, 6, dtype=DT), torch.randint(0, 3, (n,))
    if name == "vit":
        return torch.randn(n, 3, 8, 8, dtype=DT), torch.randint(0, 3, (n,))
    return torch.randint(0, hf_models.V, (n, hf_models.T)), torch.randint(0, hf_models.V, (n, hf_models.T))


MODELS = {"cnn": cnn, "gpt2": hf_models.gpt2, "vit": hf_models.vit}


def blocks(name: str, model: nn.Module) -> list[nn.Module]:
    """The model's blocks (what FSDP users shard one by one)."""
    if name == "cnn":
        return [model[0], model[3]]
    return list(model.model.transformer.h) if name == "gpt2" else list(model.blocks)


def inner(name: str, block: nn.Module) -> list[nn.Module]:
    """A part of a block, sharded on its own under ``nested``."""
    if name == "cnn":
        return [block[0]] if isinstance(block, nn.Sequential) else []
    return [block.mlp]


def shard(name: str, model: nn.Module, wrapping: str, **kwargs) -> nn.Module:
    """``model`` ``fully_shard``-ed ``whole``, ``per_block`` (each block, then the root) or
    ``nested`` (a part of each block, the block, the root)."""
    from torch.distributed.fsdp import fully_shard

    if wrapping != "whole":
        for block in blocks(name, model):
            for part in inner(name, block) if wrapping == "nested" else []:
                fully_shard(part, **kwargs)
            fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


class Case:
    """A model, its whole batch and the references, the same in every rank."""

    def __init__(self, name: str, rank: int, world: int):
        torch.manual_seed(0)
        self.name, self.rank, self.world = name, rank, world
        self.model = MODELS[name]().to(DT).eval()  # no dropout: the loop must compute the same function
        self.X, self.y = data(name, world * PER_RANK)
        self.rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        self.reference = list(per_sample_grads(self.model, self.X, self.y, cross_entropy).values())
        self.clipped = per_sample(self.model, self.X, self.y, cross_entropy, "mean")
        self.C = median_norm(self.clipped)
        self.expected = list(expected(self.clipped, self.C).values())

    def sharded(self, wrapping: str, **kwargs) -> nn.Module:
        return shard(self.name, copy.deepcopy(self.model), wrapping, **kwargs)

    def loss(self, model: nn.Module):
        return cross_entropy(model(self.X[self.rows]), self.y[self.rows], "mean")


def check_first_order(case: Case, model: nn.Module, what: str, grad: bool = True) -> None:
    """``grad=False``: leave ``.grad``, FSDP's own, unchecked."""
    params = [p for p in model.parameters() if p.requires_grad]
    assert len(params) == len(case.reference)
    for i, (p, gb) in enumerate(zip(params, case.reference)):
        where = f"rank {case.rank} {what} param {i}"
        if grad:
            assert_close(p.grad.full_tensor(), gb.sum(0), f"{where} .grad")
        assert p.grad_batch.placements == (torch.distributed.tensor.Shard(1),), where
        assert_close(p.grad_batch.full_tensor(), gb, f"{where} grad_batch")
        assert_close(p.batch_l2, REFERENCE["batch_l2"](gb)[case.rows], f"{where} batch_l2")
        for field in ("sum_grad_squared", "variance"):
            assert_close(getattr(p, field).full_tensor(), REFERENCE[field](gb), f"{where} {field}")


def check_clipped(case: Case, model: nn.Module, ext: jacmem.ClipGrad, what: str, passes: int = 1) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    for i, (p, want) in enumerate(zip(params, case.expected)):
        torch.testing.assert_close(
            p.grad.full_tensor(), passes * want, rtol=1e-9, atol=1e-12, msg=lambda m: f"{what} param {i}: {m}"
        )
    torch.testing.assert_close(ext.norms, norms(case.clipped)[case.rows], rtol=1e-9, atol=0)
    assert ext.samples == passes * case.world * PER_RANK


def first_order_and_clipping(case: Case, wrapping: str) -> None:
    model = case.sharded(wrapping)
    with jacmem.extend(jacmem.BatchGrad(), jacmem.BatchL2Grad(), jacmem.SumGradSquared(), jacmem.Variance()):
        case.loss(model).backward()
    check_first_order(case, model, f"{case.name} {wrapping}")

    model = case.sharded(wrapping)
    ext = jacmem.ClipGrad(case.C)
    with jacmem.extend(ext):
        case.loss(model).backward()
    check_clipped(case, model, ext, f"{case.name} {wrapping} ClipGrad")


def tracked(case: Case) -> None:
    """The forward before the block, the model given to ``jacmem.track``."""
    model = case.sharded("per_block")
    jacmem.track(model)
    try:
        loss = case.loss(model)
        with jacmem.extend(jacmem.BatchGrad(), jacmem.BatchL2Grad(), jacmem.SumGradSquared(), jacmem.Variance()):
            loss.backward()
    finally:
        jacmem.untrack(model)
    check_first_order(case, model, f"{case.name} track")


def training(case: Case) -> None:
    """Gradient accumulation, per-layer clipping, mixed precision."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = case.sharded("per_block")
    ext = jacmem.ClipGrad(case.C)
    with jacmem.extend(ext):  # two passes before the step: FSDP's .grad accumulates
        case.loss(model).backward()
        case.loss(model).backward()
    check_clipped(case, model, ext, f"{case.name} accumulation", passes=2)

    model = case.sharded("nested")
    thresholds = [g.flatten(1).norm(dim=1).median().item() for g in case.clipped.values()]
    with jacmem.extend(jacmem.ClipGrad(thresholds, "per_layer")):
        case.loss(model).backward()
    want = expected(case.clipped, thresholds, "per_layer")
    for i, (p, w) in enumerate(zip(model.parameters(), want.values())):
        torch.testing.assert_close(p.grad.full_tensor(), w, rtol=1e-9, atol=1e-12, msg=lambda m: f"per_layer {i}: {m}")

    policy = MixedPrecisionPolicy(param_dtype=DT, reduce_dtype=DT)
    model = case.sharded("per_block", mp_policy=policy)
    ext = jacmem.ClipGrad(case.C)
    with jacmem.extend(ext):
        case.loss(model).backward()
    check_clipped(case, model, ext, f"{case.name} MixedPrecisionPolicy")


#: float64 sharded parameters, FSDP computing in a lower dtype: the relative tolerance
#: of each (torch.testing's for float32 and float16, two rounding steps of bfloat16)
LOWER = {torch.float32: 1.3e-6, torch.bfloat16: 1.6e-2, torch.float16: 1e-3}


def assert_near(actual, want, rtol: float, what: str) -> None:
    """``actual`` (float64) equals ``want`` (a lower dtype) to ``rtol``, relative to the
    largest entry of ``want`` for entries near zero."""
    want = want.double()
    torch.testing.assert_close(
        actual, want, rtol=rtol, atol=rtol * want.abs().max().item(), msg=lambda m: f"{what}: {m}"
    )


def lower_precision(case: Case) -> None:
    """A float64 model under a ``MixedPrecisionPolicy`` whose ``param_dtype`` is lower
    (gloo reducing it): every quantity equals one process computing in that dtype (the
    loop on a copy cast to it), within its tolerance, stored in float64."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    for dtype, rtol in LOWER.items():
        low = copy.deepcopy(case.model).to(dtype)
        X = case.X.to(dtype)
        reference = list(per_sample_grads(low, X, case.y, cross_entropy).values())
        clipped = per_sample(low, X, case.y, cross_entropy, "mean")
        want = list(expected(clipped, case.C).values())

        model = case.sharded("per_block", mp_policy=MixedPrecisionPolicy(param_dtype=dtype))
        with jacmem.extend(jacmem.BatchGrad(), jacmem.BatchL2Grad(), jacmem.SumGradSquared(), jacmem.Variance()):
            case.loss(model).backward()
        for i, (p, gb) in enumerate(zip(model.parameters(), reference)):
            where = f"rank {case.rank} {dtype} param {i}"
            assert p.grad_batch.dtype == DT, where
            assert_near(p.grad_batch.full_tensor(), gb, rtol, f"{where} grad_batch")
            assert_near(p.batch_l2, REFERENCE["batch_l2"](gb)[case.rows], rtol, f"{where} batch_l2")
            for field in ("sum_grad_squared", "variance"):
                assert_near(getattr(p, field).full_tensor(), REFERENCE[field](gb), rtol, f"{where} {field}")

        model = case.sharded("per_block", mp_policy=MixedPrecisionPolicy(param_dtype=dtype))
        ext = jacmem.ClipGrad(case.C)
        with jacmem.extend(ext):
            case.loss(model).backward()
        for i, (p, w) in enumerate(zip(model.parameters(), want)):
            assert p.grad.dtype == DT
            assert_near(p.grad.full_tensor(), w, rtol, f"rank {case.rank} {dtype} ClipGrad param {i}")
        assert_near(ext.norms.double(), norms(clipped)[case.rows], rtol, f"rank {case.rank} {dtype} norms")


class TwoHeads(nn.Module):
    """[N, 2, 6, 6] -> [N, 3]: :func:`cnn`'s body, then head ``a`` or ``b`` (``self.head``)."""

    def __init__(self):
        super().__init__()
        self.body, self.head = cnn()[:-1], "a"
        self.a, self.b = nn.Linear(12, 3), nn.Linear(12, 3)

    def forward(self, x):
        return getattr(self, self.head)(self.body(x))


class BranchCase(Case):
    """:class:`TwoHeads`, rank ``r``'s rows through head ``"ab"[r % 2]``: the references
    are those of one process on the whole batch, each sample through its rank's head."""

    def __init__(self, rank: int, world: int):
        torch.manual_seed(0)
        self.name, self.rank, self.world = "cnn", rank, world
        self.model = TwoHeads().to(DT)
        self.X, self.y = data("cnn", world * PER_RANK)
        self.rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        grads, clipped = [], []
        for r in range(world):
            self.model.head = "ab"[r % 2]
            rows = slice(r * PER_RANK, (r + 1) * PER_RANK)
            mean = per_sample_grads(self.model, self.X[rows], self.y[rows], cross_entropy)  # over these rows
            grads.append([g / world for g in mean.values()])
            clipped.append(per_sample(self.model, self.X[rows], self.y[rows], cross_entropy, "mean"))
        self.reference = [torch.cat(rows) for rows in zip(*grads)]
        self.clipped = {p: torch.cat([c[p] for c in clipped]) for p in clipped[0]}
        self.C = median_norm(self.clipped)
        self.expected = list(expected(self.clipped, self.C).values())

    def sharded(self, wrapping: str, **kwargs) -> nn.Module:
        model = super().sharded(wrapping, **kwargs)
        model.head = "ab"[self.rank % 2]
        return model


def branches(rank: int, world: int) -> None:
    """A head this rank's batch skips: its shards of the results all the same, pass after
    pass. (FSDP2's own ``.grad``, which the first-order extensions leave to it, is not
    checked: FSDP2 assumes that every rank reaches the same parameters, pytorch#158719.)"""
    case = BranchCase(rank, world)
    model = case.sharded("whole")
    for i in range(2):
        with jacmem.extend(jacmem.BatchGrad(), jacmem.BatchL2Grad(), jacmem.SumGradSquared(), jacmem.Variance()):
            case.loss(model).backward()
        check_first_order(case, model, f"branches, pass {i}", grad=False)
        for p in model.parameters():
            p.grad = None
    ext = jacmem.ClipGrad(case.C)
    for i in range(2):
        with jacmem.extend(ext):
            case.loss(model).backward()
        check_clipped(case, model, ext, f"branches ClipGrad, pass {i}", passes=i + 1)


def fsdp1(case: Case) -> None:
    """FSDP1 (``FullyShardedDataParallel``, here on the CPU) raises naming FSDP, both
    where the forward enters the block and where a tracked model's backward does."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = FullyShardedDataParallel(copy.deepcopy(case.model), device_id=torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"FSDP1 \(FullyShardedDataParallel\).*fully_shard"):
        with jacmem.extend(jacmem.ClipGrad(case.C)):
            case.loss(model)
    jacmem.track(model)
    try:
        loss = case.loss(model)
        with pytest.raises(RuntimeError, match=r"FSDP1 \(FullyShardedDataParallel\).*fully_shard"):
            with jacmem.extend(jacmem.BatchGrad()):
                loss.backward()
    finally:
        jacmem.untrack(model)


def frozen(rank: int, world: int) -> None:
    """LoRA on GPT-2: the frozen base gets nothing; the adapters equal one process."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = hf_models.gpt2().to(DT).eval()
    config = peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["c_attn"], fan_in_fan_out=True)
    model.model = peft.get_peft_model(model.model, config).to(DT)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "lora_B" in pname:
                p.normal_()
    X, y = data("gpt2", world * PER_RANK)
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    clipped = per_sample(model, X, y, cross_entropy, "mean")
    C = median_norm(clipped)
    want = list(expected(clipped, C).values())
    from torch.distributed.fsdp import fully_shard

    for block in model.model.base_model.model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    with jacmem.extend(jacmem.ClipGrad(C)):
        cross_entropy(model(X[rows]), y[rows], "mean").backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == len(want) and all(p.grad is None for p in model.parameters() if not p.requires_grad)
    for i, (p, w) in enumerate(zip(trainable, want)):
        torch.testing.assert_close(p.grad.full_tensor(), w, rtol=1e-9, atol=1e-12, msg=lambda m: f"LoRA {i}: {m}")


def private_names(case: Case) -> None:
    """``jacmem.compat.fsdp_parameters``: the user's sharded parameters, and the unsharded
    ones FSDP puts in their place for the forward (one object across steps)."""
    model = case.sharded("whole")
    pairs = compat.fsdp_parameters(model)
    assert [s for s, _ in pairs] == list(model.parameters()) and all(u is None for _, u in pairs)
    seen, weight = [], model[3].weight
    handle = model[3].register_forward_hook(lambda module, args, out: seen.append(module.weight))
    for _ in range(2):
        case.loss(model)
    handle.remove()
    unsharded = dict(compat.fsdp_parameters(model))[weight]
    assert seen == [unsharded, unsharded] and not isinstance(unsharded, torch.distributed.tensor.DTensor)


def errors(case: Case) -> None:
    """Second order and unsupported placements raise before the step, naming FSDP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = case.sharded("whole")
    with pytest.raises(RuntimeError, match="FSDP.*second-order"):
        with jacmem.extend(jacmem.DiagGGNExact()):
            case.loss(model)
    jacmem.track(model)
    try:
        loss = case.loss(model)
        with pytest.raises(RuntimeError, match="FSDP.*second-order"):
            with jacmem.extend(jacmem.KFAC()):
                loss.backward()
    finally:
        jacmem.untrack(model)

    by_column = copy.deepcopy(case.model)
    fully_shard(by_column, shard_placement_fn=lambda p: torch.distributed.tensor.Shard(int(p.dim() == 2)))
    with pytest.raises(RuntimeError, match=r"FSDP .*Shard\(0\) on a 1-D mesh"):
        with jacmem.extend(jacmem.BatchGrad()):
            case.loss(by_column)

    hsdp = copy.deepcopy(case.model)
    fully_shard(hsdp, mesh=init_device_mesh("cpu", (1, case.world), mesh_dim_names=("replicate", "shard")))
    with pytest.raises(RuntimeError, match=r"FSDP .*Shard\(0\) on a 1-D mesh"):
        with jacmem.extend(jacmem.ClipGrad(1.0)):
            case.loss(hsdp)


def _worker(rank: int, world: int, names: tuple[str, ...]) -> None:
    for name in names:
        case = Case(name, rank, world)
        for wrapping in ("whole", "per_block", "nested"):
            first_order_and_clipping(case, wrapping)
        tracked(case)
        if name == "cnn":
            training(case)
            private_names(case)
            errors(case)
            lower_precision(case)
            fsdp1(case)
    branches(rank, world)
    if world == 2:
        frozen(rank, world)


@pytest.mark.slow
@needs_gloo
def test_two_ranks_equal_one_process_on_the_whole_batch(tmp_path):
    run_ranks(_worker, tmp_path, 2, ("cnn", "gpt2", "vit"), world=2)


@pytest.mark.slow
@needs_gloo
@pytest.mark.heavy
def test_four_ranks_equal_one_process_on_the_whole_batch(tmp_path):
    run_ranks(_worker, tmp_path, 4, ("cnn", "gpt2"), world=4)
