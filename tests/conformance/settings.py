"""The conformance matrix's settings: one table, name -> :class:`Setting`.

A setting runs every quantity asked of one model, once per (model, setting), and returns
per quantity a list of ``(samples, Outcome)``: which samples of the model's batch the
rank saw (``slice``), and what jacmem wrote (or raised, or warned). The cells compare.

- ``extend``: the forward inside ``jacmem.extend``; ``track``: ``jacmem.track(model)``,
  the forward outside, only the backward inside.
- ``compile``: ``torch.compile(model)`` with the default backend (inductor);
  ``model_compile``: ``model.compile()``, default backend. Each records how many graphs
  inductor compiled (``Outcome.inductor``): a cell whose setting compiled nothing with
  inductor fails (a graph break everywhere, or another backend, is not this setting).
- ``ddp``, ``fsdp2``: two gloo ranks, each on its half of the batch, wrapped in
  ``DistributedDataParallel`` / ``fully_shard`` (the private step's loader is the global
  batch's, under a ``DistributedSampler``: :func:`_loader`); ``process_group``: two gloo ranks, the
  plain model on each, which must give what one process gives on that rank's batch.
- ``autocast_bf16``: a float32 copy under ``torch.autocast("cpu", torch.bfloat16)``,
  against the float64 oracle within :data:`BF16_TOLERANCE`.
- ``batch_first_false``: the model built with ``batch_first=False`` and
  ``jacmem.extend(..., batch_first=False)`` (models that have the argument).
- ``accumulate``: two backward passes in one block, a first batch then the model's:
  the block's attributes are the last pass's, ``.grad`` the sum of both.
- ``create_graph``: ``loss.backward(create_graph=True)`` inside the block.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import jacmem

from . import oracle
from .models import Model
from .quantities import Quantity

#: autocast's tolerance: relative to the largest entry of the expected tensor, a few bf16 ulps
#: of the products of a two-layer model
BF16_TOLERANCE = 5e-2


@dataclass
class Outcome:
    """What one run of one quantity left: ``values`` (name -> tensor, as the quantity
    reads it), or ``error``; the jacmem warnings; what stayed behind after an error;
    inductor's graph count for a compile setting (None otherwise)."""

    values: dict[str, Tensor] = field(default_factory=dict)
    grad: dict[str, Tensor] = field(default_factory=dict)
    error: BaseException | None = None
    warnings: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    inductor: int | None = None


def _hook_count(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) + len(m._backward_pre_hooks)
        for m in model.modules()
    )


def _stored(p: nn.Parameter, savefield: str):
    if savefield == "data":
        return p.detach()
    return p.grad if savefield == "grad" else getattr(p, savefield, None)


def _full(value):
    if hasattr(value, "full_tensor"):
        return value.full_tensor()
    if isinstance(value, (tuple, list)):
        return type(value)(_full(v) for v in value)
    return value


def read(model: nn.Module, q: Quantity, dirs: dict[str, Tensor]) -> dict[str, Tensor]:
    """name -> the quantity's tensor, for every trainable parameter that holds one."""
    out = {}
    for name, p in model.named_parameters():
        value = _stored(p, q.savefield) if p.requires_grad else None
        if value is None:
            continue
        value = _full(value)
        value = q.read(value, name, dirs) if q.read else value
        out[name] = value.detach().to(torch.float64)
    return out


def clear(model: nn.Module, q: Quantity) -> None:
    for p in model.parameters():
        p.grad = None
        if q.savefield not in ("grad", "data") and hasattr(p, q.savefield):
            delattr(p, q.savefield)


def jacmem_warnings(caught) -> list[str]:
    """The warnings jacmem gave: those that name it, or come from its files."""
    return [
        f"{w.category.__name__}: {w.message}"
        for w in caught
        if "jacmem" in str(w.message) or "jacmem" in (w.filename or "")
    ]


@dataclass
class Pass:
    """How one run goes: the module the forward calls, the batches of its backward
    passes (in order), and the block's and the backward's options."""

    forward: Callable
    batches: list[tuple[Tensor, Tensor]]
    flow: str = "inside"
    create_graph: bool = False
    autocast: bool = False
    extend_kwargs: dict = field(default_factory=dict)
    shared: bool = False  # the batch is this rank's share of a global one (DDP, FSDP2)


def run(model: nn.Module, lossf: nn.Module, q: Quantity, threshold: float, how: Pass, dirs) -> Outcome:
    """One quantity on ``model`` (the module whose parameters hold the answers)."""
    clear(model, q)
    hooks = _hook_count(model)
    out = Outcome()
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if how.autocast else nullcontext()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if q.kind == "private":
                _private(model, lossf, threshold, how, amp)
            else:
                _backward(lossf, q.make(threshold), how, amp, model)
        except Exception as exc:  # noqa: BLE001 (the cell decides whether it was declared)
            out.error = exc
            out.leftovers = [n for n, p in model.named_parameters() if _stored(p, q.savefield) is not None]
            if q.savefield == "data":
                out.leftovers = []
            if _hook_count(model) != hooks:  # the private step detaches its engine too
                out.leftovers.append(f"hooks: {hooks} -> {_hook_count(model)}")
    out.warnings = jacmem_warnings(caught)
    if out.error is None:
        try:
            out.values = read(model, q, dirs)
        except Exception as exc:  # noqa: BLE001 (a result the quantity's reader cannot take: the cell fails)
            out.error = AssertionError(f"unreadable {q.savefield}: {type(exc).__name__}: {exc}")
        out.grad = {
            n: _full(p.grad).detach().to(torch.float64) for n, p in model.named_parameters() if p.grad is not None
        }
    return out


def _backward(lossf, extensions, how: Pass, amp, model) -> None:
    if how.flow == "track":
        jacmem.track(model, batch_first=how.extend_kwargs.get("batch_first", True))
    try:
        with jacmem.extend(*extensions, **how.extend_kwargs) if how.flow == "inside" else nullcontext():
            losses = []
            for X, y in how.batches:
                with amp:
                    loss = lossf(how.forward(X).float() if how.autocast else how.forward(X), y)
                if how.flow == "track":
                    losses.append(loss)
                    continue
                loss.backward(create_graph=how.create_graph)
        if how.flow == "track":
            with jacmem.extend(*extensions, **how.extend_kwargs):
                for loss in losses:
                    loss.backward(create_graph=how.create_graph)
    finally:
        if how.flow == "track":
            jacmem.untrack(model)


def _private(model, lossf, threshold, how: Pass, amp) -> None:
    from jacmem.privacy import PrivacyEngine

    X, y = how.batches[-1]
    opt = torch.optim.SGD(model.parameters(), lr=oracle.LR)
    loader = _loader(len(y), how.shared)
    compiled = isinstance(how.forward, torch._dynamo.eval_frame.OptimizedModule) or how.forward is model
    wrapper = model if compiled else how.forward  # DDP or FSDP2 go to make_private, as users do
    engine = PrivacyEngine()
    private, opt, _ = engine.make_private(
        module=wrapper, optimizer=opt, data_loader=loader, noise_multiplier=0.0, max_grad_norm=threshold,
        poisson_sampling=False, clipping="flat", batch_first=how.extend_kwargs.get("batch_first", True),
    )  # fmt: skip
    forward = how.forward
    try:
        opt.zero_grad()
        for Xb, yb in how.batches:
            with amp:
                loss = lossf(forward(Xb).float() if how.autocast else forward(Xb), yb)
            loss.backward(create_graph=how.create_graph)
        opt.step()
    finally:
        engine.detach()  # the model is private for this cell only: later tests in the process find it plain


def _loader(n: int, shared: bool) -> DataLoader:
    """The loader ``make_private`` reads the expected batch size from (it draws no sample):
    ``n`` samples in one batch; with ``shared`` (DDP, FSDP2), the global dataset under a
    ``DistributedSampler``, ``n`` a rank, as Opacus's data-parallel training has it.

    Opacus's expected batch size is ``len(dataset) / len(loader)``, over the world size a
    rank, and its ``DistributedDPOptimizer`` averages the ranks' clipped sums over each
    rank's: the step of one process on the global batch. A loader of the rank's ``n`` alone
    says a global batch of ``n``: Opacus 1.6's DPDDP then steps twice as far as one process
    on the ``2n`` samples (the MLP's 0.weight 6.0e-2 off), and jacmem agrees with it to
    1e-16 under DDP and FSDP2, with either loader."""
    if not shared:
        return DataLoader(TensorDataset(torch.zeros(n)), batch_size=n)
    dataset = TensorDataset(torch.zeros(n * torch.distributed.get_world_size()))
    return DataLoader(dataset, batch_size=n, sampler=DistributedSampler(dataset, shuffle=False))


def _second_batch(X: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """Another batch of the same shape: the first pass of ``accumulate``."""
    X2 = (X + 1) % (int(X.max()) + 1) if not X.is_floating_point() else -0.7 * X
    return X2, y.roll(1, 0)


def _inductor_graphs() -> int:
    """Graphs inductor has compiled (or loaded from its caches) in this process so far."""
    from torch._dynamo.utils import counters

    return sum(counters["inductor"].values()) + counters["aot_autograd"]["autograd_cache_hit"]


def single(
    spec: Model, qs: list[Quantity], threshold: float, *, flow: str = "inside", compile: str | None = None,
    create_graph: bool = False, autocast: bool = False, batch_first: bool = True, accumulate: bool = False,
    backend: str | None = None,
) -> dict[str, list[tuple[slice, Outcome]]]:  # fmt: skip
    """Every quantity of ``qs`` on ``spec``'s model in this process."""
    model, X, y = spec.build(batch_first)
    if autocast:
        model, X = model.float(), X.float() if X.is_floating_point() else X
    lossf, axis = spec.loss(), 0 if batch_first else 1
    dirs = {k: v.to(next(model.parameters()).dtype) for k, v in oracle.directions(model).items()}
    kwargs = {} if batch_first else {"batch_first": False}
    compiled = {}
    if compile:
        # a fresh Dynamo per run: the models' shared code (nn.Sequential.forward) compiled for
        # the earlier rows of this process would reach Dynamo's recompile limit, after which
        # it runs eagerly and this setting would compile nothing
        torch._dynamo.reset()
    start = _inductor_graphs()
    results = {}
    for q in qs:
        m = copy.deepcopy(model) if q.kind == "private" else model
        if compile and (q.kind == "private" or not compiled):
            if compile == "torch_compile":
                compiled[id(m)] = torch.compile(m) if backend is None else torch.compile(m, backend=backend)
            else:
                m.compile() if backend is None else m.compile(backend=backend)
                compiled[id(m)] = m
        forward = compiled.get(id(m), m) if compile else m
        Xq, yq = (X.narrow(axis, 0, 1), y[:1]) if q.one_sample else (X, y)
        batches = [_second_batch(Xq, yq), (Xq, yq)] if accumulate else [(Xq, yq)]
        how = Pass(forward, batches, flow, create_graph, autocast, kwargs)
        out = run(m, lossf, q, threshold, how, dirs)
        results[q.name] = [(slice(None), out)]
    if compile:
        graphs = _inductor_graphs() - start
        for outs in results.values():
            for _, out in outs:
                out.inductor = graphs
    return results


class RemoteError(Exception):
    """An exception raised on a rank, as the cell sees it: its class name and message."""

    def __init__(self, typename: str, message: str):
        super().__init__(message)
        self.typename = typename


def distributed(spec: Model, qs: list[Quantity], threshold: float, *, wrap: str, tmp_path) -> dict:
    """Every quantity on two gloo ranks, each on its half of the batch (``wrap``: ``ddp``,
    ``fsdp2`` or ``none``, the plain model)."""
    from tests.support.distributed import run_ranks

    run_ranks(_rank_worker, tmp_path, spec.name, [q.name for q in qs], threshold, wrap, str(tmp_path))
    results: dict = {}
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for qname, (rows, fields) in saved.items():
            error = RemoteError(*fields.pop("error")) if fields.get("error") else None
            fields.pop("error", None)
            results.setdefault(qname, []).append((rows, Outcome(error=error, **fields)))
    return results


def rank_rows(rank: int, n: int) -> slice:
    half = n // 2
    return slice(rank * half, (rank + 1) * half)


def _rank_worker(rank: int, model_name: str, qnames: list[str], threshold: float, wrap: str, outdir: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from .models import MODELS
    from .quantities import QUANTITIES

    torch.set_num_threads(1)
    spec = MODELS[model_name]
    model, X, y = spec.build()
    rows = rank_rows(rank, X.shape[0])
    X, y = X[rows], y[rows]
    lossf = spec.loss()
    dirs = oracle.directions(model)
    saved = {}
    for qname in qnames:
        q = QUANTITIES[qname]
        m = copy.deepcopy(model)
        if wrap == "ddp":
            forward = DistributedDataParallel(m)
        elif wrap == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            forward = fully_shard(m)
        else:
            forward = m
        Xq, yq = (X[:1], y[:1]) if q.one_sample else (X, y)
        out = run(m, lossf, q, threshold, Pass(forward, [(Xq, yq)], shared=wrap != "none"), dirs)
        fields = {
            "values": out.values, "grad": out.grad, "warnings": out.warnings, "leftovers": out.leftovers,
            "error": (type(out.error).__name__, str(out.error)) if out.error else None,
        }  # fmt: skip
        saved[qname] = (rows, fields)
        dist.barrier()
    torch.save(saved, f"{outdir}/rank{rank}.pt")


@dataclass(frozen=True)
class Setting:
    name: str
    doc: str
    runner: Callable  # (Model, [Quantity], threshold, tmp_path) -> results
    distributed: bool = False
    batch_first: bool = True
    compiled: bool = False
    tolerance: float | None = None  # None: float64 exact


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in [
        Setting("extend", "the forward inside `jacmem.extend`", lambda m, q, c, t: single(m, q, c)),
        Setting("track", "`jacmem.track(model)`, the forward outside the block", lambda m, q, c, t: single(m, q, c, flow="track")),
        Setting("compile", "`torch.compile(model)`, default backend (inductor)", lambda m, q, c, t: single(m, q, c, compile="torch_compile"), compiled=True),
        Setting("model_compile", "`model.compile()`, default backend", lambda m, q, c, t: single(m, q, c, compile="in_place"), compiled=True),
        Setting("ddp", "`DistributedDataParallel`, 2 gloo ranks", lambda m, q, c, t: distributed(m, q, c, wrap="ddp", tmp_path=t), distributed=True),
        Setting("fsdp2", "`fully_shard` (FSDP2), 2 gloo ranks", lambda m, q, c, t: distributed(m, q, c, wrap="fsdp2", tmp_path=t), distributed=True),
        Setting("process_group", "a plain model on each rank of a 2-rank group", lambda m, q, c, t: distributed(m, q, c, wrap="none", tmp_path=t), distributed=True),
        Setting("autocast_bf16", "`torch.autocast('cpu', torch.bfloat16)`", lambda m, q, c, t: single(m, q, c, autocast=True), tolerance=BF16_TOLERANCE),
        Setting("batch_first_false", "`batch_first=False` layout", lambda m, q, c, t: single(m, q, c, batch_first=False), batch_first=False),
        Setting("accumulate", "two backward passes in one block", lambda m, q, c, t: single(m, q, c, accumulate=True)),
        Setting("create_graph", "`loss.backward(create_graph=True)`", lambda m, q, c, t: single(m, q, c, create_graph=True)),
    ]
}  # fmt: skip
