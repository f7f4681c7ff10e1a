"""The first-order engine: per-sample quantities from each call's input and output gradient.

It holds a :class:`jacmem.engine.staging.Stager` (the records of the block's calls and
the staging of their parameters' quantities, which the clipping engine holds too) and
gives it :meth:`FirstOrderEngine._compute`, which stages each call's quantities, with
each parameter's summed gradient for a call through ComputeOnce. At the end of the
pass, :meth:`FirstOrderEngine.finish` turns the staged quantities into each extension's
result, sums over the ranks what is global (:mod:`jacmem.engine.distributed`), warns
where modules disagree on the batch size, and returns the writes. Whether the results
hold NaN or Inf is flagged on the device in each pass and read when the block ends (a
read in the backward would wait for the device), with one warning for the block.
"""

from __future__ import annotations

import itertools
from collections import Counter

import torch
from torch import Tensor, nn

from jacmem.derivatives.quantities import Quantity, as_quantity, derive
from jacmem.engine import distributed, fsdp, hooks, notices, precision
from jacmem.engine.base import Context, Engine, Write
from jacmem.engine.notices import listing
from jacmem.engine.planner import batch_size
from jacmem.engine.staging import Stager, Staging
from jacmem.errors import unsupported_module_error
from jacmem.extensions.firstorder import FirstOrderExtension

#: the :class:`Engine` methods that a first-order engine's :class:`Stager` answers as it is
_FORWARDED = ("on_enter", "on_leave", "on_forward", "on_call", "on_record", "on_backward")


class FirstOrderEngine(Engine):
    """First-order extensions for one block (the interface is :class:`jacmem.engine.base.Engine`)."""

    skips_leaves = True  # (its stager records no such call)

    def __init__(self, extensions: list[FirstOrderExtension], context: Context):
        self.extensions = extensions
        #: quantity -> how many of the extensions read it
        self.readers = Counter()
        for ext in extensions:  # (a loop, not generators: an engine is made at every step)
            self.readers.update(ext.quantities)
        self.quantities = set(self.readers)
        #: the quantities that add up over a parameter's calls: a shared parameter's calls
        #: compute each of them, summed (a tied head's projection: by its own rule, never from
        #: per-sample gradients), and the per-sample gradients only for the others
        self.linear = set()
        for q in self.quantities:  # (a loop, not a comprehension: an engine is made at every step)
            if (q if isinstance(q, Quantity) else as_quantity(q)).linear:
                self.linear.add(q)
        #: what a shared parameter's calls compute: :attr:`linear`, and the per-sample
        #: gradients where another quantity is asked (derived from their sum at the end)
        self.per_call = self.linear | ({"batch_grad"} if self.linear != self.quantities else set())
        self.context, self.groups, self.shardings = context, context.groups, context.shardings
        self.stager = Stager(self, extensions, self.quantities, context, self._compute, self._unsupported, recipes=True)
        self.recorder = self.stager.recorder
        for hook in _FORWARDED:  # the block's calls go to the stager, with no call of the engine's between
            setattr(self, hook, getattr(self.stager, hook))
        #: (device, the names of K modules) -> [K] bool on the device: whose results held
        #: NaN or Inf in a pass of the block with those modules; read when the block ends
        self.nonfinite: dict[tuple[torch.device, tuple[str, ...]], Tensor] = {}

    @property
    def handles(self) -> list:
        return self.recorder.tensor_handles

    def close(self) -> None:
        self.recorder.close()  # (the stager's: its records are void from now on, :meth:`Recorder.close`)
        pending, self.nonfinite = self.nonfinite, {}
        for flags in pending.values():  # (a read of each flag here, a call only where one is set: most blocks)
            if flags.any():
                self._warn_nonfinite(pending)
                break

    #: (the state's class itself: one call less per pass)
    new_state = Staging

    def _compute(self, run: Staging, rec: hooks.Record) -> dict[str, Tensor]:
        """Stage the call's quantities; returns each parameter's summed gradient where
        the call runs through :class:`hooks.ComputeOnce` (from the same pass, where one
        is planned), else nothing. (A parameter used by this call alone and staged here
        first gets all the engine's quantities: what its stager's recipes replay, see
        :meth:`Stager.planned`.)"""
        stager = self.stager
        params = stager.params(rec)
        grads: dict[str, Tensor] = {}
        if not params:
            return grads
        dtype = precision.compute_dtype(params.values())
        x, g = rec.x, rec.g
        # (precision.cast, where it is one tensor in the compute dtype: most calls, no call)
        x = x.detach() if isinstance(x, Tensor) and x.dtype == dtype else precision.cast(x, dtype)
        g = g.detach() if isinstance(g, Tensor) and g.dtype == dtype else precision.cast(g, dtype)
        n = g.shape[0] if isinstance(g, Tensor) else batch_size(g)
        for pname, param in params.items():
            staged = stager.stage(run, rec, pname, param, n)
            # (most parameters are used once: not kept, asked without a call)
            kept = staged.summed and staged.calls is not None and stager.keep(staged, rec, pname, x, g, dtype)
            if kept and stager.first_dense(staged):
                grads.update(stager.early(staged, rec, pname, dtype))
                continue
            wanted = set() if kept else self.per_call if staged.summed else self.quantities
            extra = {"grad"} - wanted if rec.once else set()
            if not wanted | extra:
                continue
            values = stager.compute(rec, pname, param, wanted | extra, x, g, dtype)
            if rec.once:
                grads[pname] = (values.pop("grad") if extra else values["grad"]).to(param.dtype)
                checksum = grads[pname].sum()
                staged.checksum = checksum if staged.checksum is None else staged.checksum + checksum
            if staged.quantities:
                staged.add(values)
            else:  # (the first: nothing to add to)
                staged.quantities.update(values)
        return grads

    def finish(self, run: Staging) -> list[Write]:
        """End of the backward pass: finish the partial records and the summed
        parameters, sum over the ranks what is global; the results, unwritten."""
        stager = self.stager
        staged = stager.settle(run)
        quantities, sizes, checksums, params, batch, seen = {}, {}, {}, {}, 0, set()
        for key, s in staged.items():  # (one loop, not five comprehensions)
            if s.summed and self.linear != self.quantities and "batch_grad" in s.quantities:
                quantities[key] = {q: v for q, v in s.quantities.items() if q in self.linear}
                quantities[key].update(derive(s.quantities["batch_grad"], self.quantities - self.linear))
            else:
                quantities[key] = dict(s.quantities)
            sizes[key], checksums[key], params[key] = s.batch_size, s.checksum, s.param
            batch = max(batch, s.batch_size)
            seen.add(s.batch_size)
        if len(seen) > 1 or 1 in seen:
            stager.check_batch_sizes(run.names, sizes)
            stager.check_one_row(run.names, sizes)
        else:  # one batch size, not one: what the two checks find, without their calls (the offers forgotten)
            stager.offered = {}
        self._flag_nonfinite(run.names, quantities, checksums)
        for group, members in self.groups():
            params.update(
                (id(p), p) for p in distributed.synchronize(group, members, self.quantities, quantities, sizes, batch)
            )
        sharded = {}
        for sharding in self.shardings() if self.context.sharded else ():  # (no FSDP2 model: none, without a call)
            params.update((id(p), p) for p in sharding.synchronize(self.quantities, quantities, sizes, batch))
            sharded.update(dict.fromkeys(sharding.sharded, sharding))
        writes: list[Write] = []
        for key, param in params.items():  # (loops: one call per parameter and extension, its finalize)
            sharding = sharded.get(key)
            for ext in self.extensions:
                if ext.as_is is not None:  # (what its finalize would return, without the call)
                    value = quantities[key][ext.as_is]
                else:
                    value = ext.finalize(
                        self._handed(ext, quantities[key]) if ext.overwrites else quantities[key], sizes[key]
                    )
                if sharding is None and type(value) is Tensor and value.dtype == param.dtype:
                    writes.append((param, ext.savefield, value))  # (already in its dtype: as _write gives it)
                else:
                    writes.append(_write(ext, param, key, value, sharding))
        return writes

    def _handed(self, ext: FirstOrderExtension, quantities: dict[str, Tensor]) -> dict[str, Tensor]:
        """``quantities`` for ``ext.finalize``, with a copy of each that it overwrites and
        another extension of the block reads too."""
        shared = [q for q in ext.overwrites if self.readers[q] > 1]
        return {**quantities, **{q: quantities[q].clone() for q in shared}} if shared else quantities

    def _flag_nonfinite(
        self, names: dict[int, str], quantities: dict[int, dict[str, Tensor]], checksums: dict[int, Tensor | None]
    ) -> None:
        """Flag, on the device, the modules whose quantities hold NaN or Inf (their input
        or output gradient did), for :meth:`_warn_nonfinite`. It costs one sum per
        parameter: the sum of its summed gradient where ``checksums`` has it (taken at
        its call: a sum over the samples holds NaN or Inf wherever a sample does), else
        that of its smallest quantity; and nothing on the host. Passes with the same
        modules share their flags."""
        by_device: dict[torch.device, list[int]] = {}
        for key in reversed(list(quantities)):  # forward order, about
            if quantities[key]:
                by_device.setdefault(next(iter(quantities[key].values())).device, []).append(key)
        for keys in by_device.values():
            sums = []
            for k in keys:
                checksum = checksums.get(k)
                sums.append(checksum if checksum is not None else min(quantities[k].values(), key=Tensor.numel).sum())
            bad = torch.stack(sums).isfinite().logical_not_()
            flags = self.nonfinite.setdefault((bad.device, tuple(map(names.__getitem__, keys))), bad)
            if flags is not bad:
                flags.logical_or_(bad)

    def _warn_nonfinite(self, flagged: dict[tuple[torch.device, tuple[str, ...]], Tensor]) -> None:
        """One warning, naming the modules that :meth:`_flag_nonfinite` flagged in any
        pass of the block (some were); one transfer per entry, after the block."""
        modules: dict[str, None] = {}  # (in order, once each; a loop, not a generator)
        for (_, names), bad in flagged.items():
            modules.update(dict.fromkeys(itertools.compress(names, bad.tolist())))
        modules = list(modules)
        notices.warn(
            f"jacmem: the {', '.join(e.savefield for e in self.extensions)} of module(s) "
            f"{listing(modules)} hold NaN or Inf, as their input or the gradient of the loss "
            f"w.r.t. their output does. If it came with the data, it entered at {modules[0]!r}: check the "
            "data with torch.isfinite(X).all(); otherwise check the loss (log of 0, division by 0) or lower "
            "the learning rate.",
            RuntimeWarning,
        )

    def _unsupported(self, rec: hooks.Record, params: list[str]) -> None:
        """Raise :class:`jacmem.errors.UnsupportedModuleError`: this backward pass
        differentiates ``params``, parameters of the call that no derivative covers (a
        module with none, whose generic fallback was refused; a legacy weight-normed
        Linear's ``weight_g`` and ``weight_v``), so the extensions would have nothing for
        them. It comes in the backward, before the pass writes anything (a pass writes its
        results at its end; a failed pass writes none)."""
        raise unsupported_module_error()(
            f"jacmem: module {rec.name!r} ({type(rec.module).__name__}) has trainable parameter(s) {params} that "
            f"{', '.join(map(repr, self.extensions))} cannot handle: jacmem has no exact "
            f"{', '.join(e.savefield for e in self.extensions)} for them. Register a derivative with "
            "jacmem.register(...) (docs: 'Adding a layer or a strategy'), or freeze them (requires_grad_(False))."
        )


def _write(
    ext: FirstOrderExtension, param: nn.Parameter, key: int, value: Tensor, sharding: fsdp.Sharding | None
) -> Write:
    """``ext``'s result for ``param``, on the parameter, or under FSDP2 (``sharding``, a
    :class:`jacmem.engine.fsdp.Sharding`) on the user's sharded parameter: per-sample
    gradients as a ``DTensor`` sharded on their dimension 1, per-sample norms as they
    are, the rest as a ``DTensor`` like the parameter."""
    if sharding is None:
        return param, ext.savefield, precision.result(value, param)
    target = sharding.sharded[key]
    if "batch_grad" in ext.quantities:
        return target, ext.savefield, sharding.dtensor(key, value, dim=1)
    if all(as_quantity(q).per_sample for q in ext.quantities):
        return target, ext.savefield, precision.result(value, target)
    return target, ext.savefield, sharding.dtensor(key, value)
