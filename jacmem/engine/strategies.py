"""Strategy names, validation, per-layer overrides and the ``auto`` cost model.

``strategy`` in :func:`jacmem.extend` is one name for every layer, or a dict from module
type or qualified module name (as in ``model.named_modules()``) to a name. A name applies
to every derivative that offers it; the others choose ``auto``. A name given for one
module in particular must be offered by that module.

``auto`` estimates each candidate's time from its :class:`~jacmem.derivatives.Cost`
(``flops``; ``workspace``: entries of temporary memory, written and read) and takes the
cheapest::

    seconds = flops / flop_rate(itemsize) + workspace * itemsize / byte_rate + overhead

with the rates of the device's :class:`jacmem.engine.cost_model.DeviceProfile` (:func:`jacmem.engine.cost_model.profile_for`). Only their
ratio steers a choice, so peak rates serve; ``overhead`` shifts every candidate alike.
On CUDA (:func:`jacmem.engine.cost_model.cuda_profile`), ``flop_rate = 2 · SMs · lanes · clock`` (an FMA is two
operations) and ``byte_rate = 2 · memory clock · bus width / 8`` (double data rate),
from ``torch.cuda.get_device_properties`` and :data:`jacmem.engine.cost_model.CUDA_ARCHS`. Tensor cores are not
modelled: float32 products use them only under ``allow_tf32``, off by default. Any
other device takes :data:`jacmem.engine.cost_model.CPU_PROFILE`.

``autotune=True`` measures instead, where the caller of :meth:`StrategyChoices.choose`
passes ``trial`` thunks and no strategy was named: each candidate runs once to warm up,
then up to :data:`AUTOTUNE_CALLS` times or for :data:`AUTOTUNE_SECONDS`, and the
fastest median wins; a candidate that raises is left out and named. The planner's plan
cache makes this happen once per plan key.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from jacmem.derivatives import Cost, all_strategy_names
from jacmem.engine.cost_model import estimated_seconds, profile_for

AUTO = "auto"
StrategySpec = str | Mapping[type | str, str]


#: Autotune times a candidate at most this many times after its warm-up call...
AUTOTUNE_CALLS = 3
#: ... and stops earlier once its timed calls took this many seconds together.
AUTOTUNE_SECONDS = 0.05


def measure(
    thunk: Callable[[], object],
    device: torch.device | str | None = None,
    calls: int = AUTOTUNE_CALLS,
    seconds: float = AUTOTUNE_SECONDS,
) -> float:
    """Seconds one call of ``thunk`` takes: one warm-up call, then the median of at most
    ``calls`` timed ones, stopping once they took ``seconds`` together (so at least one).
    On CUDA, ``torch.cuda.synchronize`` brackets each call, so that its kernels count."""
    device = None if device is None else torch.device(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device is not None and device.type == "cuda" else _nothing
    sync()
    thunk()
    sync()
    times: list[float] = []
    while len(times) < max(calls, 1) and sum(times) < seconds:
        start = time.perf_counter()
        thunk()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _nothing() -> None:
    pass


def _try(thunk: Callable[[], object], device, failures: dict[str, str], name: str) -> float | None:
    """:func:`measure`, or ``None`` with the error's type in ``failures[name]`` where the
    candidate raises (out of memory, say: it is then not a candidate)."""
    try:
        return measure(thunk, device)
    except Exception as error:  # any error rules the candidate out, and explain() names it
        failures[name] = type(error).__name__
        return None


@dataclass
class Decision:
    """What ``auto`` (or the user) chose for one quantity of one parameter.

    ``kind`` says how the chosen strategy gives the quantity: ``"direct"`` (its own
    strategy), ``"pass"`` (per-sample gradients by the chosen ``batch_grad`` strategy,
    reduced), ``"reuse"`` (from the pass already planned for ``reuses``) or
    ``"along"`` (from the strategy already planned for ``reuses``, which gives it too).

    ``estimates``: the cost model's seconds per candidate (``None``: does not apply).
    ``measured``: where autotune timed the choice, the median seconds per applicable
    candidate (``None`` for one that raised when tried; ``failures`` names its error);
    ``None`` where the choice was estimated.
    """

    module: str
    param: str
    quantity: str
    chosen: str
    reason: str
    estimates: dict[str, float | None]
    kind: str = "direct"
    reuses: tuple = ()
    measured: dict[str, float | None] | None = None
    failures: dict[str, str] = field(default_factory=dict)

    @property
    def timed(self) -> bool:
        """Whether autotune measured the candidates rather than estimating them."""
        return self.measured is not None

    def describe(self) -> str:
        """``quantity <- how (why)``, for :meth:`StrategyChoices.explain`."""
        if self.kind in ("reuse", "along"):
            what = f"{self.chosen} pass" if self.kind == "reuse" else self.chosen
            same = f"{self.quantity} <- the same {what} as {', '.join(self.reuses)}"
            return f"{same} ({self._timed_why()})" if self.timed else same
        how = f"per-sample gradients by {self.chosen}, reduced" if self.kind == "pass" else self.chosen
        if self.quantity == "batch_grad":
            how = self.chosen
        applicable = sorted((t, name) for name, t in self.estimates.items() if t is not None)
        if self.timed:
            why = self._timed_why()
        elif len(applicable) < 2:
            why = self.reason if self.reason == "asked for" else "the only strategy that applies"
        else:
            ranked = ", ".join(f"{name} {_ms(t)}" for t, name in applicable)
            skipped = [name for name, t in self.estimates.items() if t is None]
            why = f"{self.reason}; estimates: {ranked}" + (f"; n/a: {', '.join(skipped)}" if skipped else "")
        return f"{self.quantity} <- {how} ({why})"

    def _timed_why(self) -> str:
        """``autotune: fastest measured; measured: a 1 ms, b 2 ms[; failed: c (Error)][; n/a: d]``."""
        assert self.measured is not None
        ranked = sorted((t, name) for name, t in self.measured.items() if t is not None)
        why = f"{self.reason}; measured: {', '.join(f'{name} {_ms(t)}' for t, name in ranked)}"
        if self.failures:
            why += "; failed: " + ", ".join(f"{name} ({error})" for name, error in self.failures.items())
        skipped = [name for name, t in self.estimates.items() if t is None]
        return why + (f"; n/a: {', '.join(skipped)}" if skipped else "")

    def __str__(self) -> str:
        return f"{self.module}.{self.param} {self.describe()}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


#: A trial, as :meth:`StrategyChoices.choose` takes it: candidate name -> a thunk that runs
#: that candidate once on the real tensors (its result is dropped), or ``None``.
Trial = Callable[[str], Callable[[], object] | None]


class StrategyChoices:
    """Validates the user's ``strategy`` argument and resolves it per module.

    ``autotune``: where :meth:`choose` gets a ``trial``, time the candidates rather than
    estimate them (see the module docstring).
    """

    def __init__(self, strategy: StrategySpec = AUTO, autotune: bool = False):
        if not isinstance(autotune, bool):
            raise TypeError(f"autotune must be True or False, not {autotune!r}")
        self.autotune = autotune
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
        device: torch.device | str | None = None,
        trial: Trial | None = None,
    ) -> str:
        """Pick one of ``options`` (candidate name -> cost, ``None`` if it does not apply).

        ``offered`` is every strategy name the module's type has; a name asked for this
        module in particular must be among them. ``itemsize``: bytes per entry;
        ``device``: where the tensors are, for :func:`jacmem.engine.cost_model.profile_for` (``None``: the CPU).

        ``trial`` (used only with ``autotune``, where no strategy applicable here was
        asked for by name): candidate name -> a thunk that runs it once on the real
        tensors, or ``None``. Each applicable candidate is then timed by :func:`measure`
        and the fastest chosen; a candidate that raises is left out. Without a thunk for
        every applicable candidate, or when all raise, the estimates decide.
        """
        self.check(module, name, lambda: offered)
        wanted = self.requested(module, name)[0]
        profile = profile_for(device)
        estimates = {k: None if c is None else estimated_seconds(c, itemsize, profile) for k, c in options.items()}
        applicable = {k: t for k, t in estimates.items() if t is not None}
        if not applicable:
            raise RuntimeError(f"no strategy applies to {quantity} of {name}.{param}: {sorted(options)}")
        measured: dict[str, float | None] | None = None
        failures: dict[str, str] = {}
        if wanted in applicable:
            chosen, reason = wanted, "asked for"
        else:
            chosen = min(applicable, key=applicable.get)
            how = "" if wanted == AUTO else f", as {wanted!r} does not apply here"
            reason = "auto: cheapest" if wanted == AUTO else f"auto{how}"
            if self.autotune and trial is not None and len(applicable) > 1:
                thunks = {k: trial(k) for k in applicable}
                untried = [k for k, thunk in thunks.items() if thunk is None]
                if untried:
                    reason += f"; not timed: no trial for {', '.join(untried)}"
                else:
                    times = {k: _try(thunk, device, failures, k) for k, thunk in thunks.items()}
                    ran = {k: t for k, t in times.items() if t is not None}
                    if ran:
                        chosen, measured = min(ran, key=ran.get), times
                        reason = "autotune: fastest measured" + how
                    else:
                        failed = ", ".join(f"{k} ({e})" for k, e in failures.items())
                        reason += f"; not timed: every candidate failed when tried: {failed}"
                        failures = {}
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
            measured=measured,
            failures=failures,
        )
        return chosen

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
