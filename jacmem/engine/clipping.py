"""The clipping engine: clipped per-sample gradients summed into ``.grad``, in the one
backward pass (:class:`jacmem.ClipGrad`; the math is in :mod:`jacmem.extensions.clipping`).

It holds a :class:`jacmem.engine.staging.Stager`, as the first-order engine does (the
same records, strategies and staging), and stages each call its own way, with another
end of pass. While the backward runs, each call
of a module stages its parameters' squared per-sample norms (ghost norms where the
planner finds them cheaper) and keeps its input ``x`` and output gradient ``g``; a
parameter whose per-sample gradients take no more memory than ``x`` and ``g`` (a bias, a
norm's scale) stages its per-sample gradients instead, and so does one whose per-sample
gradients the cost model finds cheaper than its norms now and a second product at the
end of the pass, while the pass's kept per-sample gradients stay within
:func:`jacmem.engine.cost_model.keep_budget` beyond the ``x`` and ``g`` they let go
(``explain()``: ``clipped sum <- per-sample gradients kept``). A parameter used by several calls
(tied weights) keeps every call where its layers give ghost factors, and its norms come
at the end of the pass from their cross terms (:mod:`jacmem.derivatives.tied`), or from
per-sample gradients summed over the calls where the cost model finds that cheaper
(and always where a call has no factors). Once every norm is known, the clip factors
``c`` follow, and each parameter's clipped sum ``Σ_i c_i g_i`` is its summed gradient
computed from each call's ``x`` and ``g`` scaled by ``c`` row by row, summed over its
calls (book-keeping, Bu et al. 2023: a parameter's gradient is linear in the output
gradient, and sample ``i``'s term in it depends on row ``i`` alone), where a layer gives
ghost factors one product of them with the narrower scaled (an ``index_add`` for an
embedding; an LM head's ``[N, T, V]`` output gradient is never copied), or, for staged
per-sample gradients, ``einsum('n,n...->...', c, g)``. Each call's ``x`` and ``g`` are
dropped once its term is added, and autograd's gradients once checked.

autograd's own gradient never reaches ``.grad``: a call through
:class:`jacmem.engine.hooks.ComputeOnce` returns none for its parameters, and every trainable
parameter the block sees carries hooks that keep autograd from accumulating its gradient
(so ``.grad`` keeps what it held, and nothing of the parameter's size is written; inside
the block, ``torch.autograd.grad`` w.r.t. a parameter gives zeros). That hook also checks
autograd's gradient against the sum of the recorded calls' (those not through
ComputeOnce): a parameter the loss reaches outside them raises, as its clipped gradient
is unknown.

``DistributedDataParallel``: the block turns DDP's own gradient synchronisation off
(``require_backward_grad_sync``, as ``no_sync()`` does) for forwards run inside it, and
sums the ranks' clipped sums itself, with one ``all_reduce``: every rank's ``.grad``
gets the global sum ``Σ_r Σ_{i ∈ r} c_i g_i``, what one process would get on the whole
batch, and ``ClipGrad.samples`` the global sample count. A tracked DDP model whose
forward ran outside the block with the synchronisation on raises (DDP would overwrite
``.grad``): set ``ddp_model.require_backward_grad_sync = False`` for such forwards.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import Tensor, nn

from jacmem import compat
from jacmem.derivatives import Cost, entries
from jacmem.derivatives.quantities import squared_norms
from jacmem.derivatives.tied import add_clipped_sum, factor_projections, projections
from jacmem.engine import distributed, hooks, precision
from jacmem.engine.base import Context, Engine, Write
from jacmem.engine.cost_model import keep_budget
from jacmem.engine.notices import listing
from jacmem.engine.planner import batch_size, itemsize, shapes
from jacmem.engine.staging import Stager, Staging
from jacmem.extensions.clipping import ClipGrad, check_model_wide

#: random probes of :meth:`ClippingEngine._check_recorded`: a difference of 10 times its
#: tolerance passes unnoticed with probability below 1e-4, one of 100 times below 1e-15
#: (bounds for a difference of rank one, the worst case; each of 16 products of two
#: standard normals ``(ab)²`` must fall below ``16/10²``, probability 0.53, or ``16/100²``, 0.11)
PROBES = 16


def _nothing(grads: tuple) -> tuple:
    """A gradient accumulator's pre-hook: no gradient, so it accumulates none."""
    return (None,) * len(grads)


#: the name :meth:`ClippingEngine._check_recorded` gives a parameter in no model the block ran or tracks
_UNHELD = "of shape {shape}, in no model the block ran or tracks"


_SPARSE = (
    "jacmem: ClipGrad: parameter {name!r} got a sparse gradient (an nn.Embedding or nn.EmbeddingBag with "
    "sparse=True); the clipped sum of its per-sample gradients is dense. Build the layer with sparse=False."
)

_CAPTURED = (
    "jacmem: ClipGrad: torch.autograd.grad asks for the gradient of parameter {name!r}, which the block clips: its "
    "gradient is the sum of the clipped per-sample gradients, which loss.backward() adds to .grad, and autograd "
    "would return none (or zeros). Call loss.backward() and read .grad; for the unclipped gradient, take it "
    "outside the block (a private model: on copy.deepcopy(model), which runs untracked, or after detach())."
)


class ClipStaging(Staging):
    """The clipping engine's state in one backward pass."""

    __slots__ = ("calls", "reached", "autograd", "recorded", "probes", "narrowest", "kept")

    def __init__(self):
        super().__init__()
        #: id(parameter) -> (record, parameter name, x, g) of each of its calls, for the clipped sum
        self.calls: dict[int, list[tuple]] = {}
        #: id(parameter) -> its name, for each parameter whose autograd gradient arrived
        self.reached: dict[int, str] = {}
        #: id(parameter) -> the gradient autograd computed for it (and did not accumulate)
        self.autograd: dict[int, Tensor] = {}
        #: id(parameter) -> the projections ``[PROBES]`` on its ``probes`` of the unclipped
        #: sum of the recorded calls that autograd also computed (not those through
        #: ComputeOnce): they must equal those of ``autograd``
        self.recorded: dict[int, Tensor] = {}
        #: id(parameter) -> its random probes ``(u [R, PROBES], v [C, PROBES])``, see
        #: :meth:`ClippingEngine._probes`
        self.probes: dict[int, tuple[Tensor, Tensor]] = {}
        #: id(parameter) -> the narrowest dtype of its calls' output gradients
        self.narrowest: dict[int, torch.dtype] = {}
        #: bytes of the per-sample gradients staged so far beyond the ``x`` and ``g`` they let go
        self.kept = 0.0


class ClippingEngine(Engine):
    """:class:`ClipGrad` for one block (the interface is :class:`jacmem.engine.base.Engine`)."""

    #: the engine takes over ``.grad``: no other engine may share its block
    exclusive = True
    skips_leaves = True  # (its stager records no such call; its depth counts the others alike)

    def __init__(self, extensions: list[ClipGrad], context: Context):
        if len(extensions) != 1:
            raise ValueError(f"jacmem: one ClipGrad per block, not {len(extensions)}")
        self.clip = extensions[0]
        self.stager = Stager(
            self, extensions, set(self.clip.quantities), context, self._compute, self._unsupported, self._refuse
        )
        self.recorder = self.stager.recorder
        for hook in ("on_forward", "on_call", "on_record"):  # the stager's as they are, with no call between
            setattr(self, hook, getattr(self.stager, hook))
        #: what the engine knows of its block
        self.context = context
        #: id(parameter) -> the handles of its two hooks (see :meth:`_guard`)
        self.guarded: dict[int, tuple[torch.utils.hooks.RemovableHandle, ...]] = {}
        #: the gradient accumulators (autograd's nodes) of the guarded parameters: a
        #: parameter holds its own weakly, and a new one would come without the hook
        self.accumulators: list = []
        #: device -> the generator of :meth:`_probes`
        self.generators: dict[torch.device, torch.Generator] = {}
        #: DDP modules whose gradient synchronisation the block turned off
        self.unsynced: list[nn.Module] = []
        #: the models called at depth 0 in the block, in order (per-layer thresholds)
        self.roots: weakref.WeakKeyDictionary[nn.Module, None] = weakref.WeakKeyDictionary()
        self.depth = 0

    # -- forward -------------------------------------------------------------------

    def on_enter(self, module):
        if self.depth == 0 and module not in self.roots:
            if torch.is_grad_enabled():
                check_model_wide(module)
            self.roots[module] = None  # every parameter of a model, used in a call or not
            self._guard_model(module)
        self.depth += 1
        if isinstance(module, nn.parallel.DistributedDataParallel) and module.require_backward_grad_sync:
            module.require_backward_grad_sync = False  # the block sums the clipped gradients itself
            self.unsynced.append(module)
        self.stager.on_enter(module)

    def on_leave(self, module, outermost):
        self.depth = 0 if outermost else max(self.depth - 1, 0)
        self.stager.on_leave(module, outermost)

    @property
    def handles(self) -> list:
        return self.recorder.tensor_handles

    def close(self) -> None:
        hooks.remove([handle for pair in self.guarded.values() for handle in pair])
        self.guarded.clear()
        self.accumulators.clear()
        for module in self.unsynced:
            module.require_backward_grad_sync = True
        self.unsynced = []
        self.roots = weakref.WeakKeyDictionary()
        self.recorder.close()  # (the stager's: its records are void from now on, :meth:`Recorder.close`)

    def on_track(self, model: nn.Module) -> None:
        """Guard every parameter of a model the block tracks from now on, so that a
        backward the block cannot clip (another thread's) raises, even the first one;
        refuse what :func:`check_model_wide` refuses."""
        check_model_wide(model)
        self._guard_model(model)

    def on_backward(self, tensors, grad_tensors, alone: bool, reached: list) -> None:
        """Before a backward begins: guard every trainable parameter its graph reaches
        that no model of the block holds (a free ``nn.Parameter`` read in a functional op,
        or one of a model whose forward ran before the block, untracked). autograd would
        otherwise accumulate its unclipped gradient into ``.grad``; guarded, its gradient
        meets :meth:`_check_recorded`, which raises. Those of the tracked models are
        guarded first, by their names (their forward ran before the block)."""
        self.stager.on_backward(tensors, grad_tensors, alone, reached)
        for model in self.context.models():
            self._guard_model(model)
        self._guard((_UNHELD.format(shape=list(p.shape)), p) for p in reached)

    def _guard_model(self, model: nn.Module) -> None:
        """:meth:`_guard` every parameter of ``model``, named in it."""
        self._guard((f"{self.context.name(model)}.{n}", p) for n, p in model.named_parameters())

    def _guard(self, named) -> None:
        """Hook each trainable parameter of ``named`` ((name, parameter) pairs) once: its
        gradient hook (:meth:`_intercept`), and a pre-hook on its gradient accumulator
        that hands it no gradient, so that autograd accumulates nothing into ``.grad``
        (not even zeros: a tied 50k-token embedding's ``[V, d]`` would be filled, then
        added to, in every step)."""
        for name, p in named:
            if p.requires_grad and id(p) not in self.guarded:
                accumulator = torch.autograd.graph.get_gradient_edge(p).node
                self.accumulators.append(accumulator)
                self.guarded[id(p)] = (
                    p.register_hook(functools.partial(self._intercept, id(p), name, accumulator)),
                    accumulator.register_prehook(_nothing),
                )

    def _intercept(self, key: int, name: str, accumulator, grad: Tensor | None) -> Tensor | None:
        """autograd's gradient for a parameter, about to be accumulated into ``.grad``
        (which the accumulator's pre-hook prevents: the clipped sum comes at the end of
        the pass): a note that the loss reached the parameter, and zeros instead (a zero
        expanded to the gradient's shape, no memory of it). None (a call through
        ComputeOnce) stays None, and so does the gradient of a derivative's own
        recomputation (inside torch.func). ``torch.autograd.grad`` asking for it raises."""
        if grad is None or compat.functorch_transforms_active():
            return None
        if compat.grad_captures(accumulator):
            raise RuntimeError(_CAPTURED.format(name=name))
        if grad.is_sparse:
            raise RuntimeError(_SPARSE.format(name=name))
        run = self.context.passes.state(self)
        run.reached[key], run.autograd[key] = name, grad
        return grad.new_zeros(()).expand_as(grad)

    # -- backward ------------------------------------------------------------------

    def new_state(self) -> ClipStaging:
        for model in self.context.models():  # their forwards ran outside the block
            self.on_track(model)
        return ClipStaging()

    def _refuse(self, rec: hooks.Record) -> None:
        """Before a call is computed: raise, as it is (no other strategy helps), where the
        call's per-sample gradients are shares that the other samples change (clipping them
        bounds nothing), or where ``torch.autograd.grad`` asks for one of its parameters'
        gradients (the block's is the clipped sum, into ``.grad``)."""
        shared = rec.entry.shared(**rec.hp) if rec.entry is not None and self.stager.params(rec) else None
        if shared:
            raise RuntimeError(f"jacmem: ClipGrad: module {rec.name!r} ({type(rec.module).__name__}) {shared}.")
        captured = [pname for pname in rec.params if compat.grad_captures(rec.nodes[pname])]
        if captured:
            raise RuntimeError(_CAPTURED.format(name=f"{rec.name}.{captured[0]}"))

    def _compute(self, run: ClipStaging, rec: hooks.Record) -> dict[str, Tensor]:
        """Stage the call's squared per-sample norms (per-sample gradients, for a
        parameter that several calls share) and keep its ``x`` and ``g``; returns no
        gradient for a call through ComputeOnce, so that autograd accumulates none."""
        stager = self.stager
        params = stager.params(rec)
        if not params:
            return {}
        # whether autograd computes the call's parameter gradients too, for _check_recorded to
        # compare with the call's own: under create_graph=True, ComputeOnce's backward is autograd's
        computed = not rec.once or self.context.passes.current().create_graph
        dtype = precision.compute_dtype(params.values())
        x, g = precision.cast(rec.x, dtype), precision.cast(rec.g, dtype)
        n = batch_size(g)
        for pname, param in params.items():
            self._guard([(f"{rec.name}.{pname}", param)])
            staged = stager.stage(run, rec, pname, param, n)
            kept = stager.keep(staged, rec, pname, x, g, dtype)
            per_sample = not kept and (staged.summed or self._per_sample(run, rec, pname, param, n, x, g))
            factored = pname in rec.entry.ghost_factors
            wanted = (set() if kept else {"batch_grad"} if per_sample else {"batch_l2"}) | (
                {"grad"} if computed and not factored else set()
            )
            values = stager.compute(rec, pname, param, wanted, x, g, dtype) if wanted else {}
            if computed:
                key, probes = id(param), self._probes(run, param)
                inside = getattr(rec.hp.get("shared"), "narrowest", None)  # a recomputed module's own casts
                dtypes = (
                    run.narrowest.get(key, rec.grads[0].dtype),
                    rec.grads[0].dtype,
                    rec.autocast or torch.float64,
                    inside or torch.float64,
                )
                run.narrowest[key] = max(dtypes, key=lambda t: torch.finfo(t).eps)
                seen = (
                    factor_projections(rec.entry.ghost_factors[pname](x, g, **rec.hp), *probes)
                    if factored
                    else projections(values.pop("grad"), *probes)
                )
                run.recorded[key] = seen + run.recorded[key] if key in run.recorded else seen
            staged.add(values)
            if not per_sample:
                run.calls.setdefault(id(param), []).append((rec, pname, x, g))
        return {}

    def _probes(self, run: ClipStaging, param: nn.Parameter) -> tuple[Tensor, Tensor]:
        """The pass's random probes of a parameter, seen as a matrix ``[R, C]`` (its first
        axis by the rest), for :meth:`_check_recorded`: ``u [R, PROBES]`` and
        ``v [C, PROBES]``, standard normal, float64 for a float64 parameter and float32
        otherwise, from the engine's own generator on the parameter's device (the user's
        random state is left alone)."""
        key = id(param)
        if key not in run.probes:
            rows = max(param.shape[0], 1) if param.dim() else 1
            if param.device not in self.generators:
                self.generators[param.device] = torch.Generator(param.device).manual_seed(0)
            dtype = torch.float64 if param.dtype == torch.float64 else torch.float32
            gen = self.generators[param.device]
            run.probes[key] = tuple(
                torch.randn(m, PROBES, dtype=dtype, device=param.device, generator=gen)
                for m in (rows, param.numel() // rows)
            )
        return run.probes[key]

    def _per_sample(self, run: ClipStaging, rec: hooks.Record, pname: str, param: nn.Parameter, n: int, x, g) -> bool:
        """Whether the call stages its per-sample gradients ``[n, *param.shape]`` rather
        than its norms and its ``x`` and ``g`` for the clipped sum: where they take no more
        memory than ``x`` and ``g`` (a bias, a norm's scale, a Linear on long sequences),
        or, while the pass's kept per-sample gradients stay within
        :func:`keep_budget`, where the cost model finds them cheaper (ViT-S's ``qkv`` at
        197 tokens: its ghost norm's 0.95 GFLOP against 3.5M entries written and read
        twice). That choice is ``explain()``'s ``clipped sum``."""
        extra = (n * param.numel() - entries(x) - entries(g)) * itemsize(g)
        if extra <= 0:
            return True
        costs = _clip_costs(rec, pname, n * param.numel(), shapes(x), shapes(g))
        if costs is None:
            return False
        keep, recompute = costs
        options = {
            "per-sample gradients kept": keep if run.kept + extra <= keep_budget(self.context.chunk_bytes) else None,
            "norms, then the clipped sum from x and g": recompute,
        }
        chosen = self.context.strategies.choose(
            rec.module, rec.name, rec.entry.names(), pname, "clipped sum", options, itemsize(g), param.device
        )
        if chosen != "per-sample gradients kept":
            return False
        run.kept += extra
        return True

    def _unsupported(self, rec: hooks.Record, params: list[str]) -> None:
        """A trainable parameter without exact per-sample gradients: an unclipped
        gradient would leak, so it raises."""
        raise RuntimeError(
            f"jacmem: ClipGrad: module {rec.name!r} ({type(rec.module).__name__}) has trainable parameter(s) "
            f"{params} whose per-sample gradients jacmem cannot compute exactly, so it cannot clip them. Register "
            "derivatives for it with jacmem.register(...), replace it by a supported layer (e.g. GroupNorm for "
            "BatchNorm), or freeze them (requires_grad=False)."
        )

    def finish(self, run: ClipStaging) -> list[Write]:
        """End of the backward pass: the clip factors from every parameter's norms, the
        clipped sums, summed over the ranks under DDP; ``.grad`` gets them added."""
        staged = self.stager.settle(run)
        self._check_recorded(run)
        run.autograd.clear()  # checked: autograd's gradients, which the clipped sums need no more
        run.recorded.clear()
        run.probes.clear()
        self._check_unsynced(staged)
        n = self._batch_size(run.names, {key: s.batch_size for key, s in staged.items()})
        self._check_rows_are_samples(n)
        scale = float(n) if self.clip.loss_reduction == "mean" else 1.0
        squared = {
            key: (s.quantities["batch_l2"] if "batch_l2" in s.quantities else squared_norms(s.quantities["batch_grad"]))
            for key, s in staged.items()
        }
        squared = {key: sq.to(torch.promote_types(sq.dtype, torch.float32)) * scale**2 for key, sq in squared.items()}
        if self.clip.clipping == "per_layer":
            self.clip.bind(p for model in [*self.roots, *self.context.models()] for p in model.parameters())
        shardings = self.context.shardings()
        user = {key: id(sharding.sharded[key]) for sharding in shardings for key in sharding.sharded}
        factors, norms, threshold = self._factors(squared, run.names, user)
        sums = {key: self._clipped_sum(run, s, factors[key] * scale) for key, s in staged.items()}
        count = n
        params = {key: s.param for key, s in staged.items()}
        for group, members in self.context.groups():  # every group holds the same samples: each gives the global count
            sums, count = distributed.sum_over_ranks(group, members, sums, n)
            params.update((id(p), p) for p in members if id(p) in sums)  # with those only other ranks reached
        writes: list[Write] = [
            (self.clip, "norms", norms),
            (self.clip, "unclipped", self.clip.count_unclipped(factors)),
        ]
        for sharding in shardings:  # FSDP2: the shards of the sums, to the user's sharded parameters
            shards, count = sharding.reduce_scatter({key: sums.pop(key) for key in sharding.sharded if key in sums}, n)
            for key, local in shards.items():
                param, value = sharding.sharded[key], sharding.dtensor(key, local)
                writes.append((param, "grad", value if param.grad is None else param.grad.add_(value)))
        writes.append((self.clip, "samples", self.clip.samples + count))
        if staged:  # a pass to the inputs alone reached no parameter: it clipped nothing
            writes.append((self.clip, "passes", self.clip.passes + 1))
            if self.clip.held is None:
                writes.append((self.clip, "held", threshold))
        for key, param in params.items():
            if key in sums:
                value = precision.result(sums[key], param)
                writes.append((param, "grad", value if param.grad is None else param.grad.add_(value)))
        return writes

    def _factors(
        self, squared: dict[int, Tensor], names: dict[int, str], user: dict[int, int]
    ) -> tuple[dict[int, Tensor], Tensor, float | dict[int, float] | None]:
        """The clip factors and norms of ``squared`` (``id(param) -> [N]``), and the
        threshold they were clipped at (:meth:`ClipGrad.threshold`, read once per pass;
        None where nothing was clipped); ``user`` maps an FSDP2 unsharded parameter's id
        to its sharded one's, the parameter that per-layer thresholds name."""
        if not squared:
            return {}, torch.zeros(0), None
        threshold = self.clip.threshold()
        factors, norms = self.clip.factors(
            {user.get(k, k): v for k, v in squared.items()}, {user.get(k, k): v for k, v in names.items()}, threshold
        )
        return {k: factors[user.get(k, k)] for k in squared}, norms, threshold

    def _check_recorded(self, run: ClipStaging) -> None:
        """Raise where autograd's gradient of a parameter is not the sum of its recorded
        calls' (of those that autograd computed): a use outside them reached the loss,
        and its per-sample gradients are unknown. Neither sum is formed: the norm of their
        difference ``D`` is estimated from ``PROBES`` random projections ``uₖᵀ D vₖ``
        (``E (uᵀ D v)² = ‖D‖²`` for standard normal ``u``, ``v``), the recorded calls'
        taken from their ghost factors where their layers give them
        (:func:`~jacmem.derivatives.tied.factor_projections`: a tied 50k-token embedding's
        ``[V, d]`` is read once, in autograd's gradient, and never written). Tolerance:
        ``sqrt(eps)`` of the norm,
        ``eps`` that of the narrowest dtype the calls ran in (the sums add in different
        orders; under autocast, autograd's in bfloat16): 1.5e-8 for float64, 3.5e-4 for
        float32, 0.09 for bfloat16; plus ``eps`` of the largest gradient norm of the pass: a
        gradient that is zero in exact arithmetic (an attention key's bias: softmax ignores a
        shift shared by every key) is rounding alone in both sums, which then differ by as much
        as they hold, at the rounding error of the pass's scale. Checked on the device (the
        host reads nothing): on CUDA, a failure is a device-side assertion."""
        norms = {key: grad.norm() for key, grad in run.autograd.items()}
        device = next((n.device for n in norms.values()), None)
        largest = torch.stack([n.to(device, torch.float32) for n in norms.values()]).max() if norms else None
        for key, grad in run.autograd.items():
            recorded = run.recorded.get(key)
            diff = (
                grad.norm()
                if recorded is None
                else (projections(grad, *run.probes[key]) - recorded).square().mean().sqrt()
            )
            eps = max(torch.finfo(dtype).eps for dtype in (grad.dtype, run.narrowest.get(key, grad.dtype)))
            tol = eps**0.5 * norms[key].clamp(min=1e-30) + eps * largest.to(norms[key])
            compat.assert_on_device(
                (diff > tol).logical_not(),  # a NaN gradient is no use outside the calls: it passes
                f"jacmem: ClipGrad: the loss reaches parameter {run.reached[key]!r} outside every module call "
                "jacmem recorded (e.g. a parameter read in a loss term or in a functional op of a parent "
                "module, or a model whose forward ran before the block untracked), so its per-sample gradients, "
                "and its clipped gradient, are unknown. Use it only inside the forward of modules (as their own "
                "parameter), run that forward inside the block (or jacmem.track(model) before it), or freeze it.",
            )

    def _check_unsynced(self, staged: dict) -> None:
        """A tracked DDP model whose forward ran outside the block with DDP's gradient
        synchronisation on: DDP would overwrite ``.grad`` with the average of autograd's
        gradients after this pass, so it raises instead."""
        for model in map(compat.uncompiled, self.context.models()):
            if isinstance(model, nn.parallel.DistributedDataParallel) and model.require_backward_grad_sync:
                if any(id(p) in staged for p in model.parameters()):
                    raise RuntimeError(
                        "jacmem: ClipGrad: the forward of the DistributedDataParallel model ran outside the block "
                        "with DDP's gradient synchronisation on, which would overwrite the clipped sums in .grad. "
                        "Run the forward inside the block (the block sums the clipped sums over the ranks itself), "
                        "or set ddp_model.require_backward_grad_sync = False before it (as ddp_model.no_sync() does)."
                    )

    def _batch_size(self, names: dict[int, str], sizes: dict[int, int]) -> int:
        """The pass's one batch size; modules that disagree raise (a module whose axis 0
        is not the batch would be clipped per row, not per sample)."""
        self.stager.check_batch_sizes(names, sizes)  # a batch of one among larger ones: its own message
        if len(set(sizes.values())) > 1:
            seen = {n: [names[k] for k, m in sizes.items() if m == n] for n in set(sizes.values())}
            raise RuntimeError(
                "jacmem: ClipGrad: the modules of one backward pass see different batch sizes ("
                + "; ".join(f"{n}: {listing(mods)}" for n, mods in seen.items())
                + "), so axis 0 is not the batch everywhere and per-sample gradients would be wrong. For a model "
                "fed [T, N, ...], pass batch_first=False; otherwise put the batch first, and run one batch per "
                "backward pass."
            )
        return next(iter(sizes.values()), 0)

    def _check_rows_are_samples(self, n: int) -> None:
        """Raise where the pass's batch size ``n`` is none that the inputs of the models'
        outermost calls offer: the model moved rows of its samples onto the batch axis
        (HF's ``*ForMultipleChoice`` flattens ``[N, K, T]`` into ``[N·K, T]``) or runs its
        layers sequence-first, so every layer sees the same wrong batch and would be
        clipped per row, not per sample."""
        inputs = self.stager.unoffered(n)
        if inputs is None:
            return
        raise RuntimeError(
            f"jacmem: ClipGrad: the layers of this backward pass take {n} rows on their batch axis, but no input "
            f"of the model's call has that many (it offers {inputs}): the model moves parts of its samples onto "
            "the batch axis (HF's *ForMultipleChoice flattens [N, K, T] into [N*K, T]; a time-distributed layer "
            "flattens [N, T, ...]) or runs its layers sequence-first, and each row would be clipped on its own, "
            "not each sample. For layers that run on [T, N, ...], pass batch_first=False; a sample spread over "
            "several rows cannot be clipped per sample: give each sample one row of its layers' inputs."
        )

    def _clipped_sum(self, run: ClipStaging, staged, c: Tensor) -> Tensor:
        """``Σ_i c_i g_i`` for one parameter: from its staged per-sample gradients, or
        summed over its calls, each dropped once added (an LM head's output gradient is
        the largest thing a pass keeps): a call whose layer gives ghost factors adds
        their product with the narrower factor scaled by ``c`` (``[N]``)
        (:func:`jacmem.derivatives.tied.add_clipped_sum`), any other call its gradient
        computed from ``x`` and ``g`` scaled by ``c`` row by row."""
        bg = staged.quantities.get("batch_grad")
        if bg is not None:
            return torch.einsum("n,n...->...", c.to(bg.dtype), bg)
        dtype = staged.quantities["batch_l2"].dtype
        calls, total = run.calls.pop(id(staged.param)), None
        while calls:
            rec, pname, x, g = calls.pop(0)
            with precision.computing(precision.device_of(g)):
                if pname in rec.entry.ghost_factors:
                    factors = rec.entry.ghost_factors[pname](x, g, **rec.hp)
                    total = add_clipped_sum(total, factors, c, staged.param.shape)
                    continue
                scaled = compat.tree_map(
                    lambda t: t * c.to(t.dtype).view(-1, *[1] * (t.dim() - 1)) if isinstance(t, Tensor) else t, g
                )
                grad = self.stager.compute(rec, pname, staged.param, {"grad"}, x, scaled, dtype)["grad"]
            total = grad if total is None else total + grad
        return total


def _clip_costs(rec: hooks.Record, pname: str, result: int, xs, gs) -> tuple[Cost, Cost] | None:
    """The cost of a parameter's clipped sum in one call by its layer's cheapest
    strategies: keeping its per-sample gradients (``result`` entries, written, then
    read for the norms and for the ``c``-weighted sum: memory traffic that makes it
    lose to a ghost norm on short sequences, as GPT-2's at T=128 on the CPU) against its
    norms now and its summed gradient from ``x`` and the scaled ``g`` at the end of the
    pass (the norms by a strategy of their own, or from per-sample gradients computed and
    dropped). ``None`` where a strategy it needs has no cost model."""

    def cheapest(quantity: str) -> Cost | None:
        costs = [
            s.cost(xs, gs, **rec.hp) if s.cost is not None else None
            for s in rec.entry.strategies.get((pname, quantity), {}).values()
        ]
        return min((c for c in costs if c is not None), key=lambda c: c.flops, default=None)

    per_sample, grad, norms = cheapest("batch_grad"), cheapest("grad"), cheapest("batch_l2")
    if per_sample is None or grad is None:
        return None
    if norms is None:
        norms = Cost(per_sample.flops + 2 * result, per_sample.workspace + 2 * result)
    keep = Cost(per_sample.flops + 3 * result, per_sample.workspace + 3 * result)
    return keep, Cost(norms.flops + grad.flops, norms.workspace)
