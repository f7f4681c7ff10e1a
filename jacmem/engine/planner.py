"""The planner: which strategies compute a parameter's quantities, and running them.

For one call of one module and one parameter, :func:`plan` chooses a strategy per
quantity from the shapes (``choose`` weighs the options; see :mod:`jacmem.engine.strategies`),
:func:`cached_plan` keeps the plans it made, and :func:`execute`
runs them, chunking over the batch so that temporary memory stays under a budget.
A plan that runs whole may be bound to its strategies (:func:`bind`), for a warm step to
run as it is (:func:`execute_bound`).
Both engines use it: the first-order one for every recorded call, the second-order
extensions for the per-sample Jacobian products they need (:func:`compute`).

:func:`execute` is also where the registry's contract is checked (a bound plan ran
through it first): every strategy's
result must have the shape and dtype its quantity promises (:func:`check_result`),
or an error names the module, the parameter and the strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from math import prod
from typing import NamedTuple

import torch
from torch import Tensor

from jacmem.derivatives import Cost, LayerDerivatives, Strategy
from jacmem.derivatives.quantities import BATCH_GRAD, GRAD, QUANTITIES, Quantity, as_quantity, derive
from jacmem.engine import alloc
from jacmem.engine.strategies import Decision, StrategyChoices


@dataclass(frozen=True)
class Option(Cost):
    """One candidate for one quantity, as :func:`compute` offers it to ``choose``.

    ``kind``: ``"direct"``, a strategy of the quantity's own (the ghost norm, say);
    ``"pass"``, per-sample gradients by this ``batch_grad`` strategy, reduced, whose
    cost includes writing and reading them; ``"reuse"``, a pass already planned for the
    quantities ``reuses``, which costs one more read of the per-sample gradients;
    ``"along"``, a direct strategy already planned for ``reuses`` that gives this
    quantity from the same work (its ``also``).
    """

    kind: str = "direct"
    reuses: tuple[str, ...] = ()


def _take(obj, sl: slice):
    """Slice the batch axis of a tensor, or of each tensor in a tuple (None passes)."""
    if isinstance(obj, Tensor):
        return obj[sl]
    if isinstance(obj, (tuple, list)):
        return type(obj)(_take(o, sl) for o in obj)
    return obj


def shapes(obj):
    """The shape of a tensor, or of each tensor in a tuple or list (the rest passes)."""
    if isinstance(obj, Tensor):
        return tuple(obj.shape)
    if isinstance(obj, (tuple, list)):
        return type(obj)(shapes(o) for o in obj)
    return obj


def _first(g) -> Tensor:
    """The output gradient, or the first one that is not None."""
    return g if isinstance(g, Tensor) else next(t for t in g if t is not None)


def batch_size(g) -> int:
    """N, from the output gradient(s)."""
    return (g if isinstance(g, Tensor) else _first(g)).shape[0]


def itemsize(g) -> int:
    """Bytes per entry of the output gradient(s)."""
    return (g if isinstance(g, Tensor) else _first(g)).element_size()


def _batch_size_of(gs) -> int:
    """N, from the shape(s) of the output gradient(s) (see :func:`shapes`)."""
    return gs[0] if isinstance(gs[0], int) else next(s for s in gs if s is not None)[0]


#: On CPU, chunks of this size stay in cache while they are reduced (the fastest size
#: that ``benchmarks/chunks.py`` finds)
CPU_CHUNK_BYTES = 16 * 2**20


def chunk_budget(budget: float, device: torch.device) -> float:
    """The bytes a chunk of temporaries may take: ``budget``, and on CPU at most
    :data:`CPU_CHUNK_BYTES`."""
    return min(budget, CPU_CHUNK_BYTES) if device.type == "cpu" else budget


class Chunked:
    """Runs strategy functions over slices of the batch and assembles their results.

    A slice holds as many samples as fit ``budget`` bytes of temporary memory, and on
    CPU at most :data:`CPU_CHUNK_BYTES`.
    """

    def __init__(self, x, g, budget: float):
        first = g if isinstance(g, Tensor) else _first(g)
        self.x, self.g = x, g
        self.budget = min(budget, CPU_CHUNK_BYTES) if first.device.type == "cpu" else budget  # (chunk_budget)
        self.n = first.shape[0]
        self.itemsize = first.element_size()
        self.dtype, self.device = first.dtype, first.device

    def slices(self, bytes_per_sample: float):
        size = max(1, int(self.budget // max(bytes_per_sample, 1)))
        for start in range(0, self.n, size):
            yield slice(start, min(start + size, self.n))

    def run(self, fn, per_sample_bytes: float, into: Tensor | None = None):
        """Call ``fn(x_chunk, g_chunk, out, n)`` per slice of ``n`` samples; ``fn`` returns
        a dict of quantities, per-sample ones (:attr:`~jacmem.derivatives.quantities.Quantity.per_sample`)
        concatenated over the slices, the others summed. ``into`` (``[N, *shape]``, or None)
        is where ``batch_grad`` goes: ``fn`` gets its slice as ``out`` and writes there
        itself, so no chunk is copied. (Where the whole batch fits ``budget``, :func:`execute`
        calls ``fn`` once itself.)"""
        out: dict[str, Tensor] = {} if into is None else {BATCH_GRAD: into}
        for sl in self.slices(per_sample_bytes):
            part = fn(_take(self.x, sl), _take(self.g, sl), None if into is None else into[sl], sl.stop - sl.start)
            for q, value in part.items():
                if not q.per_sample:
                    out[q] = value if q not in out else out[q] + value
                    continue
                if into is not None and q == BATCH_GRAD:
                    continue  # written in place
                if q not in out:
                    out[q] = alloc.empty((self.n, *value.shape[1:]), value.dtype, value.device)
                out[q][sl] = value
        return out


def _estimate(strategy: Strategy, xs, gs, hp: dict) -> Cost | None:
    """A strategy's cost on these shapes; one without a cost model counts as free."""
    return Cost(0, 0) if strategy.cost is None else strategy.cost(xs, gs, **hp)


def _keywords(q: Quantity, hp: dict, label: str | None = None) -> dict:
    """What a direct strategy of ``q`` takes by keyword: ``q``'s parameters and the
    layer's hyper-parameters ``hp``; with ``label``, the parameter's stable name as ``name``
    where ``q`` is :attr:`~jacmem.derivatives.quantities.Quantity.named` (its costs take
    none: a plan does not depend on it)."""
    if not q.parameters:
        return hp
    return {**q.arguments(), **hp, "name": label} if label is not None and q.named else {**q.arguments(), **hp}


@dataclass(frozen=True)
class Plan:
    """How :func:`execute` gets the quantities of one parameter, as :func:`plan` chose them.

    ``direct``: (quantity, strategy name, temporary bytes per sample, the quantities it
    gives along) for each quantity that a strategy of its own computes; ``passes``:
    (``batch_grad`` strategy name, the
    quantities reduced from its per-sample gradients, their strategy's temporary bytes
    per sample) for each chunked pass.
    """

    direct: tuple[tuple[str, str, float, tuple[str, ...]], ...]
    passes: tuple[tuple[str, tuple[str, ...], float], ...]


def plan(
    entry: LayerDerivatives,
    hp: dict,
    xs,
    gs,
    item_bytes: int,
    param_name: str,
    param_shape: tuple[int, ...],
    quantities: Iterable[str],
    choose: Callable[[str, dict[str, Cost | None]], str],
) -> Plan:
    """Which strategies give the requested quantities of one parameter, on the shapes
    ``xs`` of ``x`` and ``gs`` of ``g`` (batch axis first; ``item_bytes``: bytes per entry of
    ``g``).

    ``choose(quantity, options)`` picks a strategy name among ``options`` (name ->
    Cost, or None where it does not apply). A quantity is computed either by a strategy
    of its own, or derived from per-sample gradients; all quantities derived from one
    ``batch_grad`` strategy share one chunked pass, and once such a pass is planned,
    the remaining quantities may ride along for the cost of reading its result once
    more (``auto`` weighs that against their direct strategies; a direct strategy
    asked for by name is used).
    """
    wanted = {as_quantity(q) for q in quantities}
    n = _batch_size_of(gs)
    bg_table = entry.strategies[(param_name, BATCH_GRAD)]
    bg_costs = {name: _estimate(s, xs, gs, hp) for name, s in bg_table.items()}
    # a pass also writes the per-sample gradients and reads them back to reduce them
    result = n * prod(param_shape)
    pass_options = {
        name: None if c is None else Option(c.flops + 2 * result, c.workspace + 2 * result, kind="pass")
        for name, c in bg_costs.items()
    }

    def per_sample_bytes(c: Cost) -> float:
        return c.workspace * item_bytes / max(n, 1)

    def applicable_direct(q: Quantity) -> int:
        table = {} if q == BATCH_GRAD else entry.strategies.get((param_name, q.name), {})
        return sum(_estimate(s, xs, gs, _keywords(q, hp)) is not None for s in table.values())

    # Quantities that need a pass plan it first, so the others can ride along. The
    # summed gradient comes last: a pass gives it for free, so a direct strategy for
    # another quantity leaves it to be computed on its own (its FLOPs count against that
    # strategy). Planned first, it would take its own direct strategy before a pass that
    # could have given it with the rest.
    # (ties in the quantities' order of registration, then in their keys)
    registered = list(QUANTITIES)
    order = sorted(
        wanted,
        key=lambda q: (q != BATCH_GRAD, q == GRAD, applicable_direct(q), registered.index(q.name), str.__str__(q)),
    )
    grad_flops = 0
    if GRAD in wanted:
        grad_costs = [_estimate(s, xs, gs, hp) for s in entry.strategies.get((param_name, GRAD), {}).values()]
        grad_flops = min((c.flops for c in grad_costs if c is not None), default=0)
    passes: dict[str, list[str]] = {}
    direct_steps: list[list] = []  # [quantity, strategy name, bytes per sample, quantities along]
    for q in order:
        direct = {} if q == BATCH_GRAD else entry.strategies.get((param_name, q.name), {})
        direct = {name: s for name, s in direct.items() if name not in passes}
        kw = _keywords(q, hp)
        if passes:  # reducing the pass's per-sample gradients once more reads them
            options = {name: Option(0, result, kind="reuse", reuses=tuple(qs)) for name, qs in passes.items()}
        else:
            options = dict(pass_options)
        for name, s in direct.items():
            c = _estimate(s, xs, gs, kw)
            unshared = 0 if passes or q == GRAD or GRAD in s.also else grad_flops
            options[name] = None if c is None else Option(c.flops + unshared, c.workspace)
        along = {
            step[1]: step
            for step in direct_steps
            if q in entry.strategies[(param_name, step[0].name)][step[1]].also
        }  # fmt: skip
        for name, step in along.items():  # the same work gives it: nothing more to pay
            options[name] = Option(0, 0, kind="along", reuses=(step[0],))
        if q.exclusive and any(options.get(name) is not None for name in direct):
            options = {name: options[name] for name in direct}  # its own rule, not the reduced one
        name = choose(q, options)
        if name in along:
            along[name][3].append(q)
        elif name in direct:
            direct_steps.append([q, name, per_sample_bytes(options[name]), []])
        else:
            passes.setdefault(name, []).append(q)
    return Plan(
        tuple((q, name, size, tuple(riders)) for q, name, size, riders in direct_steps),
        tuple((name, tuple(qs), per_sample_bytes(bg_costs[name])) for name, qs in passes.items()),
    )


class ContractError(RuntimeError):
    """A strategy's result has not the shape or dtype its quantity promises."""


def check_result(value, quantity: Quantity, n: int, param: Tensor, dtype: torch.dtype, where: tuple[str, str, str]):
    """``value`` if it is what ``quantity`` promises for ``n`` samples of ``param``: a
    tensor of its shape (:meth:`~jacmem.derivatives.quantities.Quantity.shape`:
    ``[N, *param.shape]`` for ``batch_grad``, ``[N]`` for ``batch_l2``, ``param.shape``
    for the sums), in the compute dtype ``dtype``. Else a :class:`ContractError` naming
    ``where``: (module, parameter, strategy)."""
    # (the built-in ones inline: this runs for every result of every call)
    expected = (
        (n, *param.shape) if quantity == BATCH_GRAD  # (a quantity is its key: str's comparison, no call)
        else tuple(param.shape) if quantity == GRAD
        else quantity.shape(n, tuple(param.shape))
    )  # fmt: skip
    if isinstance(value, Tensor) and tuple(value.shape) == expected and value.dtype == dtype:
        return value
    module, pname, strategy = where
    got = f"shape {list(value.shape)} and dtype {value.dtype}" if isinstance(value, Tensor) else repr(type(value))
    raise ContractError(
        f"jacmem: strategy {strategy!r} for {quantity} of parameter {pname!r} of module {module!r} returned {got}; "
        f"{quantity} must be {quantity.spelled} = {list(expected)} in the compute dtype {dtype}. "
        "Fix the function registered with jacmem.register (or use another strategy)."
    )


def _blame(err: BaseException, strategy: str) -> None:
    """Note on ``err`` which strategy raised it, for the engine's message."""
    if not isinstance(err, ContractError) and getattr(err, "jacmem_strategy", None) is None:
        try:
            err.jacmem_strategy = strategy
        except AttributeError:
            pass


def _pass_layout(strategy: Strategy, qs: tuple, per_sample: float, param: Tensor, item: int) -> tuple[bool, float]:
    """A pass of ``strategy``'s per-sample gradients that gives ``qs``: whether it writes
    them into the result (asked for, and the strategy takes ``out=``), and its temporary
    bytes per sample, ``per_sample`` its strategy's own (``item``: bytes per entry). Chunks
    of per-sample gradients are temporaries (reduced, or copied into the result), so they
    count, unless the result is asked for and the strategy writes into it, or needs no
    workspace (then one call writes the result)."""
    if BATCH_GRAD in qs and strategy.writes_out:
        return True, per_sample
    if BATCH_GRAD not in qs or per_sample > 0:
        return False, per_sample + prod(param.shape) * item
    return False, per_sample


def execute(
    plan: Plan,
    entry: LayerDerivatives,
    hp: dict,
    x,
    g,
    param_name: str,
    param: Tensor,
    budget: float,
    module: str = "?",
    label: str | None = None,
) -> dict[str, Tensor]:
    """The quantities of one parameter for one call of its module (named ``module``, for
    errors), as ``plan`` says, chunked over the batch so that temporary memory stays
    under ``budget`` bytes. ``label``: the parameter's stable name, which the
    :attr:`~jacmem.derivatives.quantities.Quantity.named` quantities read (None: the module's
    name and ``param_name``). Each strategy's result is checked (:func:`check_result`);
    an exception a strategy raises carries its name as ``jacmem_strategy``."""
    label = f"{module}.{param_name}" if label is None else label
    first = g if isinstance(g, Tensor) else _first(g)
    n, dtype = first.shape[0], first.dtype
    cap = min(budget, CPU_CHUNK_BYTES) if first.device.type == "cpu" else budget  # (chunk_budget)
    results: dict[str, Tensor] = {}
    for q, name, per_sample, riders in plan.direct:
        fn = entry.strategies[(param_name, q.name)][name].fn
        where, kw = (module, param_name, name), _keywords(q, hp, label) if q.parameters else hp

        def direct(xc, gc, _, n, fn=fn, q=q, riders=riders, where=where, kw=kw):
            out = fn(xc, gc, also=riders, **kw) if riders else {q: fn(xc, gc, **kw)}
            checked = {q: check_result(out[q], q, n, param, dtype, where)}
            for k in riders:  # (a loop, not a comprehension: this runs at every step)
                checked[k] = check_result(out[k], k, n, param, dtype, where)
            return checked

        try:
            whole = per_sample * n <= cap  # (most calls: no Chunked to make)
            results.update(direct(x, g, None, n) if whole else Chunked(x, g, budget).run(direct, per_sample))
        except Exception as err:
            _blame(err, name)
            raise

    for name, qs, per_sample in plan.passes:
        strategy = entry.strategies[(param_name, BATCH_GRAD)][name]
        writes, per_sample = _pass_layout(strategy, qs, per_sample, param, first.element_size())
        into = alloc.empty((n, *param.shape), dtype, first.device) if writes else None
        where = (module, param_name, name)

        def one(xc, gc, out, n, fn=strategy.fn, qs=qs, where=where):
            bg = check_result(
                fn(xc, gc, **hp) if out is None else fn(xc, gc, out=out, **hp), BATCH_GRAD, n, param, dtype, where
            )
            return {BATCH_GRAD: bg} if qs == _BATCH_GRAD_ALONE else derive(bg, qs, label)  # (derive's, without a call)

        try:
            whole = per_sample * n <= cap
            results.update(one(x, g, into, n) if whole else Chunked(x, g, budget).run(one, per_sample, into))
        except Exception as err:
            _blame(err, name)
            raise
    return results


def compute(
    entry: LayerDerivatives,
    hp: dict,
    x,
    g,
    param_name: str,
    param: Tensor,
    quantities: Iterable[str],
    choose: Callable[[str, dict[str, Cost | None]], str],
    budget: float,
    module: str = "?",
    label: str | None = None,
) -> dict[str, Tensor]:
    """The requested quantities of one parameter for one call of its module: :func:`plan`
    on the shapes of ``x`` and ``g``, then :func:`execute` (``label``: see there)."""
    chosen = plan(entry, hp, shapes(x), shapes(g), itemsize(g), param_name, tuple(param.shape), quantities, choose)
    return execute(chosen, entry, hp, x, g, param_name, param, budget, module, label)


_NONE: dict = {}
#: a pass's quantities where it gives the per-sample gradients alone
_BATCH_GRAD_ALONE = (BATCH_GRAD,)
#: a pass's quantities where it gives the per-sample gradients and their sum (a ComputeOnce
#: call's bias, say)
_WITH_SUM = (BATCH_GRAD, GRAD)


class Step(NamedTuple):
    """One step of a :class:`Plan` for one parameter, bound to its strategy (:func:`bind`).

    ``fn(x, g, **kw)`` runs on the whole batch. ``derived`` None: a strategy of
    ``quantity``'s own, which gives ``riders`` along (``fn(x, g, also=riders, **kw)`` then
    returns a dict); else a pass of per-sample gradients, written into a new tensor of
    shape ``into`` (made by ``empty``, in ``g``'s dtype and on its device) where ``into``
    is not None, from which the quantities ``derived`` come. ``table``, ``name``,
    ``strategy``: where the strategy was found, ``entry.strategies[table][name]``, to tell
    whether it still is. ``label``: the parameter's stable name, for the ``derived`` quantities
    that read it."""

    fn: Callable
    kw: dict
    quantity: Quantity
    riders: tuple
    derived: tuple | None
    into: tuple | None
    empty: Callable | None
    table: tuple[str, str]
    name: str
    strategy: Strategy
    label: str | None = None


def bind(
    plan: Plan,
    entry: LayerDerivatives,
    hp: dict,
    param_name: str,
    param: Tensor,
    g: Tensor,
    budget: float,
    label: str | None = None,
) -> tuple[Step, ...] | None:
    """``plan``'s steps for ``param``, bound to their strategies, for an output gradient of
    ``g``'s shape, dtype and device (:func:`execute_bound` runs them); None where a step
    must be chunked to stay under ``budget`` bytes (then only :func:`execute` runs the plan).
    ``label``: the parameter's stable name (see :func:`execute`)."""
    n, cap, item = g.shape[0], chunk_budget(budget, g.device), g.element_size()
    steps = []
    for q, name, per_sample, riders in plan.direct:
        if per_sample * n > cap:
            return None
        table = (param_name, q.name)
        strategy = entry.strategies[table][name]
        kw = _keywords(q, hp, label)
        steps.append(Step(strategy.fn, kw, q, riders, None, None, None, table, name, strategy, label))
    for name, qs, per_sample in plan.passes:
        table = (param_name, BATCH_GRAD.name)
        strategy = entry.strategies[table][name]
        writes, per_sample = _pass_layout(strategy, qs, per_sample, param, item)
        if per_sample * n > cap:
            return None
        # the strategy's own result where alloc.empty would leave it to torch (its test, made once
        # here): no empty result to write into, one op less
        small = g.device.type != "cpu" or n * prod(param.shape) * item < alloc.HUGE_PAGE_MIN_BYTES
        into = (n, *param.shape) if writes and not small else None
        steps.append(Step(strategy.fn, hp, BATCH_GRAD, (), qs, into, alloc.empty, table, name, strategy, label))
    return tuple(steps)


def execute_bound(bound: tuple[tuple[Step, ...], ...], x, g) -> list[dict[Quantity, Tensor]]:
    """The quantities of each parameter of one call, by its steps (:func:`bind`), in the
    order of ``bound``: each strategy on the whole batch, its result unchecked (it was
    checked when :func:`execute` ran the plan the steps came from); an exception a strategy
    raises carries its name as ``jacmem_strategy``, as in :func:`execute`. (Loops, and the
    built-in derivations inline: this runs for every call of a warm step.)"""
    results = []
    for steps in bound:
        values: dict[Quantity, Tensor] = {}
        for fn, kw, q, riders, derived, into, empty, _, name, _, label in steps:
            try:
                if derived is None and riders:
                    got = fn(x, g, also=riders, **kw)
                    values[q] = got[q]
                    for k in riders:
                        values[k] = got[k]
                elif derived is None:
                    values[q] = fn(x, g, **kw)
                else:
                    out = None if into is None else empty(into, dtype=g.dtype, device=g.device)
                    bg = fn(x, g, **kw) if out is None else fn(x, g, out=out, **kw)
                    if derived == _BATCH_GRAD_ALONE or derived == _WITH_SUM:  # (derive's answers, without a call)
                        values[BATCH_GRAD] = bg
                        if derived == _WITH_SUM:
                            values[GRAD] = bg.sum(0)
                    else:
                        values.update(derive(bg, derived, label))
            except Exception as err:
                _blame(err, name)
                raise
        results.append(values)
    return results


#: the key :func:`cached_plan` makes (everything :func:`plan` depends on), the module's name, the strategy asked for it and the parameter's
#: itemsize -> (the plan, the decisions it took, as ``StrategyChoices.decisions`` keeps them): a parameter's strategies are chosen
#: once per call shape, not at every step of every block
_PLANS: dict[tuple, tuple[Plan, dict[tuple[str, str, str], Decision]]] = {}
#: how many plans ``_PLANS`` holds before it starts over
_MAX_PLANS = 4096


def plain(values: Iterable) -> bool:
    """Whether each of ``values`` is a plain value (None, an int, a float, a string) or a
    tuple of them (nested): what a key may hold and compare safely (a tensor, a module, a
    dict may not)."""
    todo = list(values)
    while todo:
        v = todo.pop()
        if isinstance(v, tuple):
            todo.extend(v)
        elif not (v is None or isinstance(v, (int, float, str))):
            return False
    return True


def trial(
    entry: LayerDerivatives, hp: dict, x, g, pname: str, param: Tensor, quantity: str, options, size: int, budget
):
    """For autotune: candidate name -> a thunk that computes ``quantity`` once by that
    candidate on the real ``x`` and ``g`` (a strategy of its own, or a pass of per-sample
    gradients, reduced), or ``None`` for a candidate that rides a pass already planned
    (its cost is reading that pass's result: left to the estimate)."""
    n = batch_size(g)

    def thunk(name: str):
        option = options[name]
        kind = getattr(option, "kind", "direct")
        if kind in ("reuse", "along"):
            return None
        per_sample = option.workspace * size / max(n, 1)
        one = (
            Plan(((quantity, name, per_sample, ()),), ())
            if kind == "direct"
            else Plan((), ((name, (quantity,), per_sample),))
        )
        return lambda: execute(one, entry, hp, x, g, pname, param, budget)

    return thunk


def cached_plan(
    strategies: StrategyChoices,
    module,
    name: str,
    entry: LayerDerivatives,
    hp: dict,
    xs,
    gs,
    size: int,
    pname: str,
    param: Tensor,
    quantities: set,
    x=None,
    g=None,
    budget: float = float("inf"),
) -> Plan:
    """How to compute ``quantities`` of ``param`` in a call of ``module`` (named
    ``name``), whose input and output gradient have the shapes ``xs`` and ``gs`` and
    ``size`` bytes per entry, as the block's ``strategies`` choose: by the cost model
    of the parameter's device, or, with ``strategies.autotune``, by timing each
    candidate once on ``x`` and ``g`` (chunked under ``budget``), see :func:`trial`.

    Made once and kept in ``_PLANS`` under everything it depends on (where its
    hyper-parameters are plain values); its decisions go to ``strategies`` either way,
    for ``explain()``."""
    shape = tuple(param.shape)
    # The key: everything :func:`plan` depends on but ``choose``: the parameter's strategies,
    # the shapes, the hyper-parameters, the quantities (each with its parameters: a quantity
    # is its key, :class:`~jacmem.derivatives.quantities.Quantity`, so two parameterisations
    # are two plans); none where a hyper-parameter or an entry of ``xs`` is not a plain value
    # (a tensor, a module, a dict), so that a plan kept under it could not be trusted. (Made
    # here, not by a function of its own: this runs for every parameter of every call
    # that reuses no recipe, :meth:`jacmem.engine.staging.Stager.planned`.)
    key = None
    if plain((xs, gs, *hp.values())):
        wanted = frozenset(quantities)
        names = {BATCH_GRAD}
        for q in wanted:
            names.add(q.name if isinstance(q, Quantity) else q)
        tables = []
        for q in sorted(names):
            tables.append(tuple(entry.strategies.get((pname, q), _NONE).items()))
        key = (tuple(tables), tuple(hp.items()), xs, gs, size, pname, shape, wanted)
    if key is not None:
        # (where no module has a strategy of its own, the block's default, without asking)
        requested = strategies.requested(module, name) if strategies.overrides else (strategies.default, False)
        key += (name, requested, param.element_size(), param.device, strategies.autotune)
        cached = _PLANS.get(key)
        if cached is not None:
            strategies.decisions.update(cached[1])  # (the decisions taken then, as explain()'s)
            return cached[0]
    made: list[Decision] = []
    timed = strategies.autotune and x is not None and g is not None

    def choose(quantity, options):
        tried = trial(entry, hp, x, g, pname, param, quantity, options, size, budget) if timed else None
        chosen = strategies.choose(
            module, name, entry.names(), pname, quantity, options, param.element_size(), param.device, tried
        )
        made.append(strategies.decisions[(name, pname, quantity)])
        return chosen

    result = plan(entry, hp, xs, gs, size, pname, shape, quantities, choose)
    if key is not None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = (result, {(d.module, d.param, d.quantity): d for d in made})
    return result
