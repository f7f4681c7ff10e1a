"""Strategy names, validation, per-layer overrides and the ``auto`` cost model.

``strategy`` in :func:`jacmem.extend` is either one name for every layer, or a dict
from module type or qualified module name (as in ``model.named_modules()``) to a name.
A name applies to every derivative that offers it; the others choose ``auto``. A name
given for one module in particular must be offered by that module.

The cost model
--------------
``auto`` estimates each candidate's time from its :class:`~jacmem.derivatives.Cost`
(``flops``, and ``workspace``: entries of temporary memory, written and read) on the
device the tensors live on, and takes the cheapest::

    seconds = flops / flop_rate(itemsize) + workspace * itemsize / byte_rate + overhead

The rates come from a :class:`DeviceProfile`, one per device, from :func:`profile_for`:

- ``flop_rate``: floating-point operations per second of a batched matrix product in
  float32 (and narrower types: jacmem computes them in float32);
  ``flop_rate_fp64`` the same in float64, where it differs (``None``: the same).
- ``byte_rate``: bytes per second of a large copy through the device's memory.
- ``overhead``: seconds per strategy call (kernel launches); it shifts every candidate
  alike, so it shows in :meth:`StrategyPlan.explain`'s figures, never in a choice.

Only the ratio of the rates steers a choice, which is why peak figures serve.

- **CPU** (:data:`CPU_PROFILE`, also any device type without a profile of its own):
  ``FLOP_RATE = 5e10`` and ``BYTE_RATE = 5e9``, measured on the 2-thread Xeon of the
  benchmarks (a batched matrix product and a strided copy), for every dtype. These are
  the constants ``auto`` has always used, so its CPU choices are as before.
- **CUDA** (:func:`cuda_profile`), derived from ``torch.cuda.get_device_properties``:
  ``flop_rate = 2 * multi_processor_count * lanes * clock_rate`` (an FMA is two
  operations), where ``lanes`` are the float32 (float64) results per clock cycle per
  multiprocessor of the compute capability, from the table "Throughput of Native
  Arithmetic Instructions" of the CUDA C++ Programming Guide (:data:`CUDA_ARCHS`);
  ``byte_rate = 2 * memory_clock_rate * memory_bus_width / 8`` (double data rate).
  Where torch reports no clock (0, or an older torch), the table's typical boost clock
  and its datasheet bandwidth per multiprocessor stand in. Checks against NVIDIA's
  datasheets: H100 SXM (9.0; 132 SMs at 1.98 GHz; 5120-bit HBM3 at 2.619 GHz) gives
  66.9 TFLOP/s float32, 33.5 float64, 3.35 TB/s; A100 80 GB (8.0; 108 SMs at 1.41 GHz)
  19.5 TFLOP/s float32, 9.7 float64, 2.04 TB/s. Consumer parts (8.6, 8.9, 12.0) run
  float64 at 1/64 of float32, so there ``auto`` weighs float64 FLOPs 64 times heavier.
  Tensor cores are not modelled: float32 matrix products use them only where
  ``torch.backends.cuda.matmul.allow_tf32`` is set (off by default).

Autotune
--------
``StrategyPlan(..., autotune=True)`` measures instead of estimating, wherever the
caller of :meth:`StrategyPlan.choose` passes a ``trial`` (candidate name -> a thunk
that runs that candidate once on the real tensors, or ``None`` where it cannot) and
no strategy was asked for by name. Each applicable candidate is run once to warm up,
then timed (:func:`measure`: ``time.perf_counter``, with ``torch.cuda.synchronize``
around each call on CUDA) up to :data:`AUTOTUNE_CALLS` times, or until its timed calls
took :data:`AUTOTUNE_SECONDS` together, and the median counts. The fastest is chosen,
and :meth:`StrategyPlan.explain` says so: ``(autotune: fastest measured; measured:
unfold 3.1 ms, save_memory 5.2 ms)``. A candidate that raises when tried (out of
memory, say) is left out and named; when one candidate has no thunk, or all raise,
the estimates decide as without autotune. ``choose`` keeps no state but the decisions
it records: the planner's plan cache makes timing happen once per plan key.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from jacmem.derivatives import Cost, all_strategy_names

AUTO = "auto"
#: FLOP/s of a batched matrix product and byte/s of a strided copy, on a 2-thread Xeon
#: (the benchmark machine): a matter of order, only their ratio steers ``auto``
FLOP_RATE = 5e10
BYTE_RATE = 5e9

StrategySpec = str | Mapping[type | str, str]


@dataclass(frozen=True)
class DeviceProfile:
    """The rates the cost model divides by, for one device (see the module docstring).

    ``flop_rate``: FLOP/s in float32 and narrower; ``flop_rate_fp64``: FLOP/s in
    float64, ``None`` where it is ``flop_rate``; ``byte_rate``: byte/s through memory;
    ``overhead``: seconds per strategy call.
    """

    name: str
    flop_rate: float
    byte_rate: float
    flop_rate_fp64: float | None = None
    overhead: float = 0.0

    def flops_per_second(self, itemsize: int) -> float:
        """The FLOP rate for entries of ``itemsize`` bytes."""
        return self.flop_rate_fp64 if itemsize >= 8 and self.flop_rate_fp64 is not None else self.flop_rate


#: The calibrated constants, for every dtype: ``auto``'s CPU choices as they always were.
CPU_PROFILE = DeviceProfile("cpu", FLOP_RATE, BYTE_RATE)


@dataclass(frozen=True)
class CudaArch:
    """What the cost model needs of one compute capability: float32 and float64
    results per clock cycle per multiprocessor (CUDA C++ Programming Guide, "Throughput
    of Native Arithmetic Instructions"), and, for a torch that reports no clocks, a
    typical boost clock and memory bandwidth per multiprocessor of ``part`` (NVIDIA's
    datasheet for it)."""

    fp32_lanes: int
    fp64_lanes: int
    clock_hz: float
    bytes_per_second_per_sm: float
    part: str


#: (major, minor) -> :class:`CudaArch`. A capability not listed takes :data:`CUDA_ARCH_DEFAULT`.
CUDA_ARCHS: dict[tuple[int, int], CudaArch] = {
    (6, 0): CudaArch(64, 32, 1.48e9, 732e9 / 56, "P100 SXM2"),
    (6, 1): CudaArch(128, 4, 1.58e9, 484e9 / 28, "GTX 1080 Ti"),
    (7, 0): CudaArch(64, 32, 1.53e9, 900e9 / 80, "V100 SXM2"),
    (7, 5): CudaArch(64, 2, 1.59e9, 320e9 / 40, "T4"),
    (8, 0): CudaArch(64, 32, 1.41e9, 2039e9 / 108, "A100 80GB SXM"),
    (8, 6): CudaArch(128, 2, 1.70e9, 936e9 / 82, "RTX 3090"),
    (8, 9): CudaArch(128, 2, 2.52e9, 1008e9 / 128, "RTX 4090"),
    (9, 0): CudaArch(128, 64, 1.98e9, 3350e9 / 132, "H100 SXM"),
    (10, 0): CudaArch(128, 64, 1.97e9, 8000e9 / 148, "B200"),
    (12, 0): CudaArch(128, 2, 2.41e9, 1792e9 / 170, "RTX 5090"),
}
#: A capability not in :data:`CUDA_ARCHS`: a consumer part's lanes, clock and bandwidth.
CUDA_ARCH_DEFAULT = CudaArch(128, 2, 1.5e9, 10e9, "unknown")
#: Seconds per strategy call on CUDA: a few kernel launches of ~3 us each.
CUDA_OVERHEAD = 1e-5


def cuda_profile(props) -> DeviceProfile:
    """The profile of a CUDA device from its properties (``torch.cuda.get_device_properties``:
    ``name``, ``major``, ``minor``, ``multi_processor_count`` and, where this torch has
    them, ``clock_rate`` and ``memory_clock_rate`` in kHz and ``memory_bus_width`` in bits)."""
    arch = CUDA_ARCHS.get((props.major, props.minor), CUDA_ARCH_DEFAULT)
    sms = props.multi_processor_count
    clock = getattr(props, "clock_rate", 0) * 1e3 or arch.clock_hz
    memory_clock, bus_bits = getattr(props, "memory_clock_rate", 0) * 1e3, getattr(props, "memory_bus_width", 0)
    byte_rate = 2 * memory_clock * bus_bits / 8 if memory_clock and bus_bits else arch.bytes_per_second_per_sm * sms
    return DeviceProfile(
        f"cuda: {props.name} ({props.major}.{props.minor})",
        flop_rate=2 * sms * arch.fp32_lanes * clock,
        byte_rate=byte_rate,
        flop_rate_fp64=2 * sms * arch.fp64_lanes * clock,
        overhead=CUDA_OVERHEAD,
    )


def profile_for(device: torch.device | str | None) -> DeviceProfile:
    """The profile of ``device`` (``None``: the CPU), derived once per device.

    CUDA devices get :func:`cuda_profile`; the CPU, and device types without a profile
    of their own (``mps``, ``xpu``...), get :data:`CPU_PROFILE`."""
    if device is None:
        return CPU_PROFILE
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _profile(device)


@functools.cache
def _profile(device: torch.device) -> DeviceProfile:
    if device.type == "cuda":
        return cuda_profile(torch.cuda.get_device_properties(device))
    return CPU_PROFILE


def estimated_seconds(cost: Cost, itemsize: int, profile: DeviceProfile = CPU_PROFILE) -> float:
    """The cost model: one number to compare strategies by, on the device of ``profile``."""
    return (
        cost.flops / profile.flops_per_second(itemsize)
        + cost.workspace * itemsize / profile.byte_rate
        + profile.overhead
    )


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
    reduced) or ``"reuse"`` (from the pass already planned for ``reuses``).

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
        """``quantity <- how (why)``, for :meth:`StrategyPlan.explain`."""
        if self.kind == "reuse":
            same = f"{self.quantity} <- the same {self.chosen} pass as {', '.join(self.reuses)}"
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


#: A trial, as :meth:`StrategyPlan.choose` takes it: candidate name -> a thunk that runs
#: that candidate once on the real tensors (its result is dropped), or ``None``.
Trial = Callable[[str], Callable[[], object] | None]


class StrategyPlan:
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
        ``device``: where the tensors are, for :func:`profile_for` (``None``: the CPU).

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
