"""``report(model, *inputs)``: what autograd keeps for the backward pass, and why.

One forward pass runs under ``torch.autograd.graph.saved_tensors_hooks``; a global
module pre/post forward hook keeps the stack of modules being run, so each saved
tensor is charged to the innermost module (qualified name) that saved it. A walk of
the graph afterwards reads every node's saved tensors once more, which names the op
(``grad_fn``) and the slot each tensor was saved as.

Memory is counted per storage (``untyped_storage``: device, address, bytes), once:
views, in-place outputs and a tensor saved by two ops are one storage, charged to the
module that saved it first. Storages that existed before the forward (parameters,
buffers, the inputs) are kept by reference and cost nothing extra; they are listed
apart. Storages that the caller gets back as outputs are kept anyway.

For the ops whose derivative formulas are listed in :data:`NEEDS`, each saved tensor
says which inputs' gradients read it; one that is read only for gradients nobody
asked for (a conv's input, with the weight frozen) is *wasted*.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from math import prod
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules import module as module_hooks

from jacmem import compat, walker
from jacmem.memory.lean import LEAN, STOCK

Key = tuple[str, int, int]
UNREACHED = "(off the graph)"

#: op -> saved slot -> positions in ``next_functions`` (the op's differentiable
#: inputs) whose gradients read that tensor; a callable takes the node. Ops not
#: listed count as needing everything they keep.
NEEDS: dict[str, dict[str, Any]] = {
    "ConvolutionBackward0": {"input": (1,), "weight": (0,)},
    "MmBackward0": {"self": (1,), "mat2": (0,)},
    "BmmBackward0": {"self": (1,), "mat2": (0,)},
    "AddmmBackward0": {"mat1": (2,), "mat2": (1,)},
    "MulBackward0": {"self": (1,), "other": (0,)},
    "NativeBatchNormBackward0": {
        "input": lambda node: (0, 1, 2) if compat.saved_value(node, "training", True) else (1,),
        "weight": (0,),
    },
    "CudnnBatchNormBackward0": {"input": (0, 1, 2), "weight": (0,)},
    "MaxPool1DWithIndicesBackward0": {"self": ()},
    "MaxPool2DWithIndicesBackward0": {"self": ()},
    "MaxPool3DWithIndicesBackward0": {"self": ()},
}
#: ops that read the named slot for its shape alone
SHAPE_ONLY = {name for name in NEEDS if name.startswith("MaxPool")}

#: nodes through which a parameter keeps its name (``weight.t()`` in a linear layer)
_VIEWS = (
    "TBackward0",
    "ViewBackward0",
    "ExpandBackward0",
    "PermuteBackward0",
    "TransposeBackward0",
    "UnsqueezeBackward0",
    "SqueezeBackward0",
    "ReshapeAliasBackward0",
    "AliasBackward0",
    "UnsafeViewBackward0",
)


def _key(t: Tensor) -> Key:
    s = t.untyped_storage()
    return (str(t.device), s.data_ptr(), s.nbytes())


def _ident(t: Tensor) -> tuple:
    """Which memory a tensor views (autograd may hand back a new tensor object for it)."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


def _tensors(obj) -> list[Tensor]:
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def fmt_bytes(n: float | None) -> str:
    """1536 -> '1.5 KiB'; None -> 'n/a'."""
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass
class SavedTensor:
    """One tensor that one op saved for the backward pass."""

    module: str  #: qualified name of the innermost module running when it was saved
    op: str  #: the grad_fn that keeps it; UNREACHED if kept by something off the path from the outputs (checkpoint)
    slot: str  #: what the op saved it as ("input", "weight", "result", "saved_tensors[0]", ...)
    shape: tuple[int, ...]
    dtype: str
    device: str
    nbytes: int  #: bytes of the whole storage it lives in
    kind: str  #: "activation", "output", "parameter", "buffer" or "input"
    needed_for: tuple[str, ...] = ()  #: gradients that read it (for ops in NEEDS)
    wasted: bool = False  #: read by no gradient that is computed
    why: str = ""  #: for a wasted tensor, why it is kept
    storage: Key = field(default=("", 0, 0), repr=False)


@dataclass
class ModuleRow:
    """What one module's calls keep, storages counted once."""

    name: str
    type: str
    calls: int = 0
    tensors: int = 0  #: saved-tensor references
    bytes: int = 0  #: storages this module saved first
    exclusive: int = 0  #: storages no other module saved too: freed if this module kept nothing
    wasted: int = 0  #: storages that every saver keeps for no computed gradient
    input_bytes: int = 0  #: activation storages among the inputs of its calls
    ops: Counter = field(default_factory=Counter)
    #: gradient -> bytes of this module's storages that it reads ("input", or a parameter's name)
    kept_for: Counter = field(default_factory=Counter)
    #: what the same module keeps after ``jacmem.memory.lean`` (None: not measured)
    lean_bytes: int | None = None


@dataclass
class BlockRow:
    """A repeated block (a member of an ``nn.ModuleList`` or ``nn.Sequential`` with
    submodules of its own): what it keeps, and what checkpointing it would keep."""

    name: str
    type: str
    bytes: int  #: activation storages first saved inside the block
    input_bytes: int  #: activation storages among its inputs: what ``checkpoint`` keeps instead
    checkpoint_saves: int  #: ``bytes - input_bytes`` (at least 0), at the cost of one more forward of it


class MemoryReport:
    """The result of :func:`report`. ``str(r)`` / ``r.table()`` for people,
    ``r.to_dict()`` for programs.

    Attributes: ``tensors`` (list of :class:`SavedTensor`), ``modules`` (list of
    :class:`ModuleRow`, largest first), ``parameter_bytes``, ``trainable_bytes``,
    ``output_bytes``, ``input_bytes``, ``suggestions`` (list of str).
    """

    def __init__(self, tensors, modules, parameter_bytes, trainable_bytes, output_bytes, input_bytes, suggestions):
        self.tensors: list[SavedTensor] = tensors
        self.modules: list[ModuleRow] = modules
        self.parameter_bytes, self.trainable_bytes = parameter_bytes, trainable_bytes
        self.output_bytes, self.input_bytes = output_bytes, input_bytes
        self.suggestions: list[str] = suggestions
        self.blocks: list[BlockRow] = []  #: repeated blocks, largest checkpoint saving first
        self.lean_saved_bytes: int | None = None  #: :attr:`saved_bytes` of a lean copy (None: not measured)

    def savers(self, top: int = 10) -> list[dict[str, Any]]:
        """The modules where the most can be saved, largest first: for each, what it keeps
        (bytes), what for (gradient -> bytes), what a lean copy of it keeps, and what
        checkpointing the repeated block that contains it would save (the whole block's
        figure)."""
        blocks = sorted(self.blocks, key=lambda b: -len(b.name))
        rows = []
        for m in self.modules:
            if not m.bytes:
                continue
            block = next((b for b in blocks if m.name == b.name or m.name.startswith(b.name + ".")), None)
            lean_saves = m.bytes - m.lean_bytes if m.lean_bytes is not None else 0
            rows.append(
                {
                    "module": m.name,
                    "type": m.type,
                    "bytes": m.bytes,
                    "kept_for": dict(m.kept_for.most_common()),
                    "lean_bytes": m.lean_bytes,
                    "lean_saves": lean_saves,
                    "block": block.name if block else None,
                    "checkpoint_saves": block.checkpoint_saves if block else 0,
                }
            )
        rows.sort(key=lambda r: (-r["lean_saves"], -r["bytes"]))
        return rows[:top]

    def _storages(self, kinds=("activation",)) -> dict[Key, list[SavedTensor]]:
        out: dict[Key, list[SavedTensor]] = {}
        for t in self.tensors:
            if t.kind in kinds and t.nbytes:
                out.setdefault(t.storage, []).append(t)
        return out

    @property
    def saved_bytes(self) -> int:
        """Bytes that autograd keeps alive for the backward pass and nothing else does:
        activation storages, each once."""
        return sum(ts[0].nbytes for ts in self._storages().values())

    @property
    def wasted_bytes(self) -> int:
        """Part of :attr:`saved_bytes` that no computed gradient reads."""
        return sum(ts[0].nbytes for ts in self._storages().values() if all(t.wasted for t in ts))

    def by_op(self) -> list[tuple[str, int, int]]:
        """(op, saved tensors, activation bytes charged to it), largest first."""
        count: Counter = Counter(t.op for t in self.tensors)
        size: Counter = Counter()
        for ts in self._storages().values():
            size[ts[0].op] += ts[0].nbytes
        return sorted(((op, count[op], size[op]) for op in count), key=lambda r: -r[2])

    def to_dict(self) -> dict[str, Any]:
        """Everything, as plain Python values."""
        return {
            "totals": {
                "saved_bytes": self.saved_bytes,
                "wasted_bytes": self.wasted_bytes,
                "parameter_bytes": self.parameter_bytes,
                "trainable_parameter_bytes": self.trainable_bytes,
                "output_bytes": self.output_bytes,
                "input_bytes": self.input_bytes,
                "saved_tensors": len(self.tensors),
            },
            "modules": [{**asdict(m), "ops": dict(m.ops), "kept_for": dict(m.kept_for)} for m in self.modules],
            "ops": [{"op": op, "tensors": n, "bytes": b} for op, n, b in self.by_op()],
            "tensors": [asdict(t) for t in self.tensors],
            "suggestions": list(self.suggestions),
            "blocks": [asdict(b) for b in self.blocks],
            "lean_saved_bytes": self.lean_saved_bytes,
            "savers": self.savers(),
        }

    def table(self, top: int = 12) -> str:
        """A plain-text summary: totals, the ``top`` modules and ops, wasted tensors,
        suggestions."""
        saved, out = self.saved_bytes, self.output_bytes
        by_ref = self._storages(("parameter", "buffer", "input"))
        lines = [
            "What autograd keeps for the backward pass",
            f"  activations kept:   {fmt_bytes(saved)} in {len(self._storages())} storages"
            + (f"  ({saved / out:.1f}x the output, {fmt_bytes(out)})" if out else ""),
            f"  of which wasted:    {fmt_bytes(self.wasted_bytes)} (read by no gradient that is computed)",
            f"  parameters:         {fmt_bytes(self.parameter_bytes)} ({fmt_bytes(self.trainable_bytes)} trainable);"
            f" {len(by_ref)} parameter/buffer/input storages saved by reference, no extra memory",
            "",
            f"  {'module':<28} {'type':<18} {'calls':>5} {'saved':>6} {'bytes':>10} {'wasted':>10}  ops",
        ]
        for m in self.modules[:top]:
            ops = ", ".join(f"{op}x{n}" if n > 1 else op for op, n in m.ops.most_common(3))
            more = f", +{len(m.ops) - 3} more" if len(m.ops) > 3 else ""
            lines.append(
                f"  {m.name[:28]:<28} {m.type[:18]:<18} {m.calls:>5} {m.tensors:>6} {fmt_bytes(m.bytes):>10} "
                f"{fmt_bytes(m.wasted):>10}  {ops}{more}"
            )
        if len(self.modules) > top:
            lines.append(f"  ... {len(self.modules) - top} more modules")
        lines += ["", f"  {'op (grad_fn)':<36} {'saved':>6} {'bytes':>10}"]
        lines += [f"  {op[:36]:<36} {n:>6} {fmt_bytes(b):>10}" for op, n, b in self.by_op()[:top]]
        largest = sorted((ts[0] for ts in self._storages().values()), key=lambda t: -t.nbytes)[:5]
        if largest:
            lines += ["", "Largest kept storages (first saver):"]
            lines += [
                f"  {fmt_bytes(t.nbytes):>10}  {t.module}: {t.op}.{t.slot} {list(t.shape)} {t.dtype} on {t.device}"
                for t in largest
            ]
        wasted = [t for t in self.tensors if t.wasted and t.kind == "activation"]
        if wasted:
            lines += ["", "Kept for no computed gradient:"]
            for t in wasted[:top]:
                lines.append(f"  {t.module}: {t.op}.{t.slot} {list(t.shape)} {t.dtype} {fmt_bytes(t.nbytes)}: {t.why}")
            if len(wasted) > top:
                lines.append(f"  ... {len(wasted) - top} more")
        savers = self.savers(top)
        if savers:
            lean_total = (
                f" (a lean copy keeps {fmt_bytes(self.lean_saved_bytes)} in all, "
                f"{fmt_bytes(self.saved_bytes - self.lean_saved_bytes)} less)"
                if self.lean_saved_bytes is not None
                else ""
            )
            lines += [
                "",
                f"Largest savers, by module: what each keeps, for which gradients, and what jacmem.memory.lean "
                f"keeps instead{lean_total}:",
                f"  {'module':<40} {'kept':>10} {'lean keeps':>10}  kept for",
            ]
            for r in savers:
                for_ = ", ".join(f"{_short(k, r['module'])} {fmt_bytes(v)}" for k, v in list(r["kept_for"].items())[:3])
                lean_b = fmt_bytes(r["lean_bytes"]) if r["lean_bytes"] is not None else "n/a"
                lines.append(f"  {r['module'][-40:]:<40} {fmt_bytes(r['bytes']):>10} {lean_b:>10}  {for_}")
        if self.blocks:
            lines += [
                "",
                "Checkpointing a repeated block (torch.utils.checkpoint: keeps its inputs, runs its forward again "
                "in backward):",
                f"  {'block':<40} {'kept':>10} {'inputs':>10} {'saves':>10}",
            ]
            for blk in self.blocks[:top]:
                lines.append(
                    f"  {blk.name[-40:]:<40} {fmt_bytes(blk.bytes):>10} {fmt_bytes(blk.input_bytes):>10} "
                    f"{fmt_bytes(blk.checkpoint_saves):>10}"
                )
        if self.suggestions:
            lines += ["", "Suggestions:"]
            lines += [f"  {i}. {s}" for i, s in enumerate(self.suggestions, 1)]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return f"<MemoryReport: {fmt_bytes(self.saved_bytes)} kept, {fmt_bytes(self.wasted_bytes)} wasted>"


def _short(target: str, module: str) -> str:
    """A gradient's name, relative to the module that keeps the tensor for it."""
    if target == "input":
        return "input grad"
    return "grad of " + (target[len(module) + 1 :] if target.startswith(module + ".") else target)


class _Handle:
    """What the graph holds instead of a saved tensor during the report."""

    __slots__ = ("index", "tensor", "__weakref__")

    def __init__(self, index: int, tensor: Tensor):
        self.index, self.tensor = index, tensor


class _State:
    """What a report's forward may change, to put back after it: torch's random state (CPU,
    and every CUDA device once CUDA is initialised) and, of each module the report meets
    (taken before its forward runs), its training flag, its parameter and buffer entries
    and a copy of its buffers' values (a kernel that updates running statistics in place
    need not move their version counter, so the values are compared). Parameters' values
    are not copied: a forward that writes them in place is not one a report can undo, and
    a copy of every weight would double the memory the report measures."""

    def __init__(self):
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.cpu_rng = torch.random.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if cuda else None
        self.modules: dict[int, tuple[nn.Module, bool, dict, dict]] = {}
        self.values: dict[int, tuple[Tensor, Tensor]] = {}  # id -> (tensor, copy)

    def take(self, module: nn.Module) -> None:
        for m in module.modules():
            if id(m) in self.modules:
                continue
            self.modules[id(m)] = (m, m.training, dict(compat.parameter_slots(m)), dict(compat.buffer_slots(m)))
            for t in compat.buffer_slots(m).values():
                if t is not None and id(t) not in self.values:
                    self.values[id(t)] = (t, t.detach().clone())

    def restore(self) -> None:
        with torch.no_grad():
            for t, copy in self.values.values():
                if not torch.equal(t, copy):  # an unchanged tensor keeps its version: graphs that saved it stay valid
                    t.copy_(copy)
        for m, training, params, buffers in self.modules.values():
            m.training = training
            compat.parameter_slots(m).clear()
            compat.parameter_slots(m).update(params)
            compat.buffer_slots(m).clear()
            compat.buffer_slots(m).update(buffers)
        torch.random.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


class _Recorder:
    """The hooks of one report: module stack, saved tensors, graph walk."""

    def __init__(self, root: nn.Module | None, root_label: str):
        self.names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self.root_label = root_label
        if root is not None:
            for name, sub in root.named_modules():
                self.names[sub] = name or root_label
        self.stack: list[str] = []
        self.entries: list[SavedTensor] = []
        self.rows: dict[str, ModuleRow] = {}
        self.call_order: list[str] = []
        self.by_name: dict[str, nn.Module] = {}
        self.owned: dict[Key, str] = {}  # storages that existed before: key -> kind
        self.param_names: dict[int, str] = {}
        self.params: dict[int, nn.Parameter] = {}
        self.unpacked: list[tuple[int, tuple]] = []  # (entry index, _ident of the tensor) per unpack
        self.handles: list[weakref.ref] = []
        self.state = _State()
        if root is not None:
            self._own(root, "")

    def _own(self, module: nn.Module, prefix: str) -> None:
        self.state.take(module)
        for name, p in module.named_parameters(prefix=prefix):
            self.params.setdefault(id(p), p)
            self.param_names.setdefault(id(p), name)
            self.owned[_key(p)] = "parameter"
        for b in module.buffers():
            self.owned.setdefault(_key(b), "buffer")

    def name(self, module: nn.Module) -> str:
        if module not in self.names:
            self.names[module] = f"{type(module).__name__}@{len(self.names)}"
            self._own(module, self.names[module])
        return self.names[module]

    # -- forward -------------------------------------------------------------

    def pre(self, module, args):
        name = self.name(module)
        self.stack.append(name)
        self.call_order.append(name)
        self.by_name[name] = module
        row = self.rows.setdefault(name, ModuleRow(name, type(module).__name__))
        row.calls += 1
        new = {_key(t): t.untyped_storage().nbytes() for t in _tensors(args) if _key(t) not in self.owned}
        row.input_bytes += sum(new.values())

    def post(self, module, args, output):
        if self.stack:
            self.stack.pop()

    def pack(self, t: Tensor) -> _Handle:
        module = self.stack[-1] if self.stack else self.root_label
        key = _key(t)
        owned = self.owned.get(key)
        leaf = owned is None and (isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad))
        kind = "parameter" if leaf else owned or "activation"  # a trainable leaf: kept by reference
        if leaf:
            self.params.setdefault(id(t), t)
        self.entries.append(
            SavedTensor(
                module,
                UNREACHED,
                "?",
                tuple(t.shape),
                str(t.dtype).replace("torch.", ""),
                str(t.device),
                key[2],
                kind,
                storage=key,
            )
        )
        handle = _Handle(len(self.entries) - 1, t)
        self.handles.append(weakref.ref(handle))
        return handle

    def unpack(self, handle: _Handle) -> Tensor:
        self.unpacked.append((handle.index, _ident(handle.tensor)))
        return handle.tensor

    # -- after the forward -------------------------------------------------------

    def _read(self, node, slot: str) -> list[tuple[str, int]]:
        """(slot, entry index) of the tensors that ``node`` saved under ``slot`` (a custom
        Function's: ``saved_tensors``). Reading may unpack other tensors too (a
        checkpointed region recomputes its forward from its saved inputs): only those
        handed back as the slot's value count."""
        self.unpacked.clear()
        value = node.saved_tensors if slot == "saved_tensors" else compat.saved_value(node, slot)
        got = {ident: idx for idx, ident in self.unpacked}
        if isinstance(value, (tuple, list)):
            found = [(i, got.get(_ident(v))) for i, v in enumerate(value) if isinstance(v, Tensor)]
            return [(f"{slot}[{i}]", idx) for i, idx in found if idx is not None]
        idx = got.get(_ident(value)) if isinstance(value, Tensor) else None
        return [] if idx is None else [(slot, idx)]

    def walk(self, roots) -> None:
        """Name the op and slot of every saved tensor reachable from ``roots``."""
        for node in walker.Walk(roots):
            if isinstance(node, torch.autograd.function.BackwardCFunction):
                slots = self._read(node, "saved_tensors")
            else:
                slots = [s for a in compat.saved_names(node) for s in self._read(node, a)]
            for slot, idx in slots:
                entry = self.entries[idx]
                entry.op, entry.slot = node.name(), slot
                self._needs(node, entry)

    def _describe(self, node) -> str:
        """Whose gradient flows into ``node``: a parameter's name, or 'input'."""
        while node is not None and node.name() in _VIEWS and len(node.next_functions) == 1:
            node = node.next_functions[0][0]
        if node is None:
            return "?"
        variable = walker.leaf(node)
        if variable is not None:
            return self.param_names.get(id(variable), f"leaf {list(variable.shape)}")
        return "input"

    def _needs(self, node, entry: SavedTensor) -> None:
        rule = NEEDS.get(node.name(), {}).get(entry.slot)
        nexts = node.next_functions
        if rule is None:
            entry.needed_for = tuple(self._describe(n) for n, _ in nexts if n is not None)
            return
        positions = rule(node) if callable(rule) else rule
        live = [i for i in positions if i < len(nexts) and nexts[i][0] is not None]
        entry.needed_for = tuple(self._describe(nexts[i][0]) for i in live)
        if live:
            return
        entry.wasted = True
        if node.name() in SHAPE_ONLY:
            entry.why = "read only for its shape"
        else:
            frozen = [
                f"{entry.module}.{_SLOT_PARAMS[(node.name(), i)]}"
                if (node.name(), i) in _SLOT_PARAMS
                else f"the input of {entry.module}"
                if i == 0
                else f"input {i} of {entry.module}"
                for i in positions
            ]
            entry.why = f"read only for the gradient of {' and '.join(frozen)}, which is not computed"


#: (op, position) -> the module parameter name that usually sits there
_SLOT_PARAMS = {
    ("ConvolutionBackward0", 1): "weight",
    ("ConvolutionBackward0", 2): "bias",
    ("NativeBatchNormBackward0", 1): "weight",
    ("NativeBatchNormBackward0", 2): "bias",
    ("CudnnBatchNormBackward0", 1): "weight",
    ("AddmmBackward0", 2): "weight",
    ("MmBackward0", 1): "weight",
}


def _rows(rec: _Recorder) -> list[ModuleRow]:
    """Per-module totals, largest first; each activation storage is charged to its first saver."""
    rows = rec.rows
    storages: dict[Key, list[SavedTensor]] = {}
    for e in rec.entries:
        row = rows.setdefault(e.module, ModuleRow(e.module, e.module))
        row.tensors += 1
        row.ops[e.op] += 1
        if e.kind == "activation":
            storages.setdefault(e.storage, []).append(e)
    for ts in storages.values():
        row, nbytes = rows[ts[0].module], ts[0].nbytes
        for target in dict.fromkeys(g for t in ts for g in t.needed_for):
            row.kept_for[target] += nbytes
        row.bytes += nbytes
        row.exclusive += nbytes if all(t.module == row.name for t in ts) else 0
        row.wasted += nbytes if all(t.wasted for t in ts) else 0
    return sorted((r for r in rows.values() if r.tensors), key=lambda r: -r.bytes)


def _freeable(rec: _Recorder, name: str) -> tuple[int, int]:
    """(bytes, elements) of the activation storages module ``name`` saves that ``lean``
    would free: no other module saves them, or only for gradients that are not computed."""
    storages: dict[Key, list[SavedTensor]] = {}
    for e in rec.entries:
        if e.kind == "activation":
            storages.setdefault(e.storage, []).append(e)
    free = [
        ts
        for ts in storages.values()
        if any(t.module == name for t in ts) and all(t.module == name or t.wasted for t in ts)
    ]
    return sum(ts[0].nbytes for ts in free), sum(max(prod(t.shape) for t in ts) for ts in free)


def _blocks(rec: _Recorder, root: nn.Module | None) -> list[BlockRow]:
    """The repeated blocks of ``root`` (members of a ModuleList or Sequential that have
    submodules), with what they keep and what checkpointing each would save."""
    if root is None:
        return []
    first_saver: dict[Key, str] = {}
    for e in rec.entries:
        if e.kind == "activation":
            first_saver.setdefault(e.storage, e.module)
    out = []
    for name, container in root.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        for child_name, child in container.named_children():
            full = f"{name}.{child_name}" if name else child_name
            if not any(True for _ in child.children()) or full not in rec.rows:
                continue
            kept = sum(
                nbytes
                for (dev, ptr, nbytes), saver in first_saver.items()
                if saver == full or saver.startswith(full + ".")
            )
            inputs = rec.rows[full].input_bytes
            out.append(BlockRow(full, type(child).__name__, kept, inputs, max(kept - inputs, 0)))
    return sorted(out, key=lambda b: -b.checkpoint_saves)


def _lean_rows(model: nn.Module, inputs, kwargs) -> tuple[dict[str, int], int]:
    """Per module name, the activation bytes a lean copy of ``model`` keeps, and its total
    (the copy runs once first: lean layers learn which layers read their outputs)."""
    import copy

    from jacmem.memory.lean import lean

    twin = lean(copy.deepcopy(model))
    state = _State()
    try:
        twin(*inputs, **kwargs)
    finally:
        state.restore()
    r = report(twin, *inputs, lean=False, **kwargs)
    del twin
    return {m.name: m.bytes for m in r.modules}, r.saved_bytes


_ACTIVATIONS = (nn.ReLU, nn.LeakyReLU)


def _suggest(rec: _Recorder, rows: list[ModuleRow], total: int, top: int) -> list[str]:
    """One or more suggestions for each module that keeps at least 5% of ``total``."""
    out: list[str] = []
    follower = {a: b for a, b in zip(rec.call_order, rec.call_order[1:])}
    devices = {e.device for e in rec.entries if e.kind == "activation"}
    needed_only = None
    for row in [r for r in rows if total and r.bytes >= 0.05 * total][:top]:
        module = rec.by_name.get(row.name)
        kind = type(module)
        here = f"{row.name} ({row.type}, {row.bytes / total:.0%} of the total)"
        before = len(out)
        if row.wasted >= 0.1 * row.bytes > 0:
            fix = (
                "jacmem.memory.lean(model) keeps none of it"
                if kind in LEAN or kind in STOCK
                else "a freeze-aware torch.autograd.Function that saves only what ctx.needs_input_grad asks for "
                "would drop it"
            )
            out.append(f"{here}: {fmt_bytes(row.wasted)} is kept for gradients that are not computed; {fix}.")
        freeable, numel = _freeable(rec, row.name)
        if kind is nn.ReLU and freeable:
            out.append(
                f"{here}: keeps its float output ({fmt_bytes(freeable)} that nothing else needs); "
                f"jacmem.memory.lean(model) keeps a 1-bit mask instead ({fmt_bytes(-(-numel // 8))})."
            )
        if kind is nn.Dropout and freeable:
            out.append(
                f"{here}: keeps its mask ({fmt_bytes(freeable)}); jacmem.memory.lean(model) keeps the RNG "
                "seed and draws the mask again in backward."
            )
        nxt = rec.by_name.get(follower.get(row.name, ""))
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and isinstance(nxt, _ACTIVATIONS) and module.training:
            act = type(nxt).__name__
            change = (
                "" if isinstance(nxt, nn.LeakyReLU) else " (this swaps ReLU for LeakyReLU, which changes the model)"
            )
            out.append(
                f"{here}: fuse it with the {act} that follows into jacmem.memory.BatchNormAct (InPlace-ABN), which "
                f"keeps only its output and frees about {fmt_bytes(row.exclusive)}{change}."
            )
        per_call = row.tensors / max(row.calls, 1)
        if per_call >= 3 and len(row.ops) >= 3 and row.exclusive > 2 * row.input_bytes:
            out.append(
                f"{here}: {row.tensors} tensors from {len(row.ops)} ops; torch.utils.checkpoint.checkpoint on each call "
                f"keeps only its inputs (about {fmt_bytes(row.input_bytes)} instead of {fmt_bytes(row.exclusive)}) and "
                "runs its forward once more during backward."
            )
        if devices - {"cpu"}:
            out.append(
                f"{here}: torch.autograd.graph.save_on_cpu(pin_memory=True) around its forward moves its "
                f"{fmt_bytes(row.bytes)} to host memory until backward (costs transfers, saves accelerator memory)."
            )
        if len(out) == before and needed_only is None:
            needed_only = (
                f"{here}: its {fmt_bytes(row.bytes)} is read by the gradients asked for; only recomputation "
                "(torch.utils.checkpoint around the block that contains it) or offloading "
                "(torch.autograd.graph.save_on_cpu, on an accelerator) can lower it."
            )
    if needed_only:
        out.append(needed_only)
    return out


def report(fn_or_model: Callable, *inputs, top: int = 5, lean: bool | None = None, **kwargs) -> MemoryReport:
    """Run ``fn_or_model(*inputs, **kwargs)`` once, with gradients enabled, and report what
    autograd keeps for the backward pass.

    ``fn_or_model``: an ``nn.Module`` (its submodules get qualified names), a bound
    method of one (``model.propagate``), or any callable (modules that it runs are
    named ``Type@i``). ``top``: how many hot spots get suggestions. Nothing of the
    forward pass is kept: the graph is freed when the report returns.

    ``lean``: also run a lean copy of the model (``copy.deepcopy``, then
    :func:`jacmem.memory.lean`; the RNG state is restored after it) and give, per module,
    what it would keep (``ModuleRow.lean_bytes``, ``MemoryReport.lean_saved_bytes``).
    Default: when ``fn_or_model`` is an ``nn.Module``. Repeated blocks (members of a
    ModuleList or Sequential) get what checkpointing each would save
    (``MemoryReport.blocks``); :meth:`MemoryReport.savers` puts it together. A storage
    that lean layers share (a norm's output that the next Linear keeps too) is charged
    to its first saver, so per-module figures may move between modules; the totals
    are exact.

    The forward runs in the mode the model is in (a train-mode BatchNorm uses the batch's
    statistics, a Dropout draws), and what it changes is put back afterwards, also when it
    raises: every buffer of the modules it ran (BatchNorm's running statistics and
    ``num_batches_tracked``), their parameter and buffer entries, their training flags and
    torch's random state (CPU, and CUDA once initialised). A copy of those buffers (not of
    the weights) is held while the report runs.
    """
    root = fn_or_model if isinstance(fn_or_model, nn.Module) else getattr(fn_or_model, "__self__", None)
    root = root if isinstance(root, nn.Module) else None
    rec = _Recorder(root, f"({type(root).__name__})" if root is not None else "(function)")
    for t in _tensors((inputs, kwargs)):
        rec.owned.setdefault(_key(t), "input")
    handles = [
        module_hooks.register_module_forward_pre_hook(rec.pre),
        module_hooks.register_module_forward_hook(rec.post, always_call=True),
    ]
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack):
            outputs = _tensors(fn_or_model(*inputs, **kwargs))
    finally:
        for h in handles:
            h.remove()
        rec.state.restore()
    # what the graph still holds now that the forward's temporaries are gone
    kept = [ref() is not None for ref in rec.handles]
    rec.walk([t.grad_fn for t in outputs])
    rec.entries = [e for e, alive in zip(rec.entries, kept) if alive]
    out_keys = {_key(t): t.untyped_storage().nbytes() for t in outputs}
    for e in rec.entries:
        if e.kind == "activation" and e.storage in out_keys:
            e.kind = "output"
    params = list(rec.params.values())
    rows = _rows(rec)
    result = MemoryReport(
        rec.entries,
        rows,
        sum(p.numel() * p.element_size() for p in params),
        sum(p.numel() * p.element_size() for p in params if p.requires_grad),
        sum(out_keys.values()),
        sum({_key(t): t.untyped_storage().nbytes() for t in _tensors((inputs, kwargs))}.values()),
        [],
    )
    result.suggestions = _suggest(rec, rows, result.saved_bytes, top)
    result.blocks = _blocks(rec, root)
    if lean if lean is not None else isinstance(fn_or_model, nn.Module):
        if not isinstance(fn_or_model, nn.Module):
            raise ValueError("report(..., lean=True) needs the model itself, to copy it")
        try:
            per_module, result.lean_saved_bytes = _lean_rows(fn_or_model, inputs, kwargs)
        except RuntimeError:  # a model that does not deep-copy (non-leaf tensors as attributes)
            per_module = None
        for row in rows if per_module is not None else ():
            row.lean_bytes = per_module.get(row.name, 0)
        less = result.saved_bytes - (result.lean_saved_bytes or result.saved_bytes)
        if less >= 0.05 * result.saved_bytes > 0:
            result.suggestions.insert(
                0,
                f"jacmem.memory.lean(model) keeps {fmt_bytes(result.lean_saved_bytes)} instead of "
                f"{fmt_bytes(result.saved_bytes)} ({result.lean_saved_bytes / result.saved_bytes:.2f}x), with the "
                "same outputs and gradients; 'Largest savers' above shows where.",
            )
    return result
