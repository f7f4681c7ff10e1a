"""Strategy names, validation, per-layer overrides and the ``auto`` cost model.

``strategy`` in :func:`jacmem.extend` is either one name for every layer, or a dict
from module type or qualified module name (as in ``model.named_modules()``) to a name.
A name applies to every derivative that offers it; the others choose ``auto``. A name
given for one module in particular must be offered by that module.

``auto`` estimates each candidate's time as ``flops / FLOP_RATE + bytes / BYTE_RATE``,
where ``bytes`` is the temporary memory it writes and reads, and takes the cheapest.
The rates are a CPU's order of magnitude; only their ratio matters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from torch import nn

from jacmem.derivatives import Cost, all_strategy_names

AUTO = "auto"
#: FLOP/s of a batched matrix product and byte/s of a strided copy, on a 2-thread Xeon
#: (the benchmark machine): a matter of order, only their ratio steers ``auto``
FLOP_RATE = 5e10
BYTE_RATE = 5e9

StrategySpec = str | Mapping[type | str, str]


def estimated_seconds(cost: Cost, itemsize: int) -> float:
    """The cost model: one number to compare strategies by."""
    return cost.flops / FLOP_RATE + cost.workspace * itemsize / BYTE_RATE


@dataclass
class Decision:
    """What ``auto`` (or the user) chose for one quantity of one parameter.

    ``kind`` says how the chosen strategy gives the quantity: ``"direct"`` (its own
    strategy), ``"pass"`` (per-sample gradients by the chosen ``batch_grad`` strategy,
    reduced) or ``"reuse"`` (from the pass already planned for ``reuses``).
    """

    module: str
    param: str
    quantity: str
    chosen: str
    reason: str
    estimates: dict[str, float | None]
    kind: str = "direct"
    reuses: tuple = ()

    def describe(self) -> str:
        """``quantity <- how (why)``, for :meth:`StrategyPlan.explain`."""
        if self.kind == "reuse":
            return f"{self.quantity} <- the same {self.chosen} pass as {', '.join(self.reuses)}"
        how = f"per-sample gradients by {self.chosen}, reduced" if self.kind == "pass" else self.chosen
        if self.quantity == "batch_grad":
            how = self.chosen
        applicable = sorted((t, name) for name, t in self.estimates.items() if t is not None)
        if len(applicable) < 2:
            why = self.reason if self.reason == "asked for" else "the only strategy that applies"
        else:
            ranked = ", ".join(f"{name} {_ms(t)}" for t, name in applicable)
            skipped = [name for name, t in self.estimates.items() if t is None]
            why = f"{self.reason}; estimates: {ranked}" + (f"; n/a: {', '.join(skipped)}" if skipped else "")
        return f"{self.quantity} <- {how} ({why})"

    def __str__(self) -> str:
        return f"{self.module}.{self.param} {self.describe()}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


class StrategyPlan:
    """Validates the user's ``strategy`` argument and resolves it per module."""

    def __init__(self, strategy: StrategySpec = AUTO):
        if isinstance(strategy, str):
            self.default, self.overrides = strategy, {}
        elif isinstance(strategy, Mapping):
            self.default, self.overrides = AUTO, dict(strategy)
        else:
            raise TypeError(f"strategy must be a name or a dict, not {type(strategy).__name__}")
        for key, name in [(None, self.default), *self.overrides.items()]:
            # the registry is read only for a name other than auto (it costs ~50 us a block)
            valid = [AUTO] if name == AUTO else sorted(all_strategy_names() | {AUTO})
            if name not in valid:
                where = "" if key is None else f" (for {getattr(key, '__name__', key)!r})"
                raise ValueError(f"unknown strategy {name!r}{where}; valid strategies: {', '.join(valid)}")
            if key is not None and not isinstance(key, (str, type)):
                raise TypeError(f"strategy keys are module types or module names, not {key!r}")
        self.decisions: dict[tuple, Decision] = {}

    def requested(self, module: nn.Module, name: str) -> tuple:
        """(strategy name, whether it was asked for this module in particular)."""
        if name in self.overrides:
            return self.overrides[name], True
        for cls in type(module).__mro__:
            if cls in self.overrides:
                return self.overrides[cls], True
        return self.default, False

    def check(self, module: nn.Module, name: str, offered: Callable[[], set]) -> None:
        """A name asked for this module in particular must be one ``offered()`` by it
        (every strategy name its type has); ``ValueError`` naming the module otherwise."""
        wanted, specific = self.requested(module, name)
        if not specific or wanted == AUTO:
            return
        names = offered()
        if wanted not in names:
            raise ValueError(
                f"strategy {wanted!r} was asked for module {name!r} ({type(module).__name__}), "
                f"which offers: {', '.join(sorted(names | {AUTO}))}"
            )

    def choose(
        self,
        module: nn.Module,
        name: str,
        offered: set,
        param: str,
        quantity: str,
        options: dict[str, Cost | None],
        itemsize: int,
    ) -> str:
        """Pick one of ``options`` (candidate name -> cost, ``None`` if it does not apply).

        ``offered`` is every strategy name the module's type has; a name asked for this
        module in particular must be among them.
        """
        self.check(module, name, lambda: offered)
        wanted = self.requested(module, name)[0]
        estimates = {k: None if c is None else estimated_seconds(c, itemsize) for k, c in options.items()}
        applicable = {k: t for k, t in estimates.items() if t is not None}
        if not applicable:
            raise RuntimeError(f"no strategy applies to {quantity} of {name}.{param}: {sorted(options)}")
        if wanted in applicable:
            chosen, reason = wanted, "asked for"
        else:
            chosen = min(applicable, key=applicable.get)
            reason = "auto: cheapest" if wanted == AUTO else f"auto, as {wanted!r} does not apply here"
        cost = options[chosen]
        self.decisions[(name, param, quantity)] = Decision(
            name,
            param,
            quantity,
            chosen,
            reason,
            estimates,
            kind=getattr(cost, "kind", "direct"),
            reuses=tuple(getattr(cost, "reuses", ())),
        )
        return chosen

    def remember(self, decisions: Iterable[Decision]) -> None:
        """Record decisions taken before, for the same module, parameter and shapes."""
        for d in decisions:
            self.decisions[(d.module, d.param, d.quantity)] = d

    def explain(self) -> str:
        """One line per module and parameter: for each quantity, what gives it and why,
        e.g. ``3.weight sum_grad_squared <- per-sample gradients by unfold, reduced
        (auto: cheapest; estimates: unfold 48 ms, save_memory 96 ms); grad <- the same
        unfold pass as sum_grad_squared``."""
        if not self.decisions:
            return "no decisions yet: run a backward pass inside the block"
        lines: dict[tuple, list[str]] = {}
        for d in self.decisions.values():
            lines.setdefault((d.module, d.param), []).append(d.describe())
        return "\n".join(f"{module}.{param} {'; '.join(parts)}" for (module, param), parts in lines.items())
